#include "train/cuda/gpu_bench.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <chrono>
#include <ostream>
#include <vector>

#include "core/build_info.h"
#include "core/cuda/phase_clock.h"
#include "core/error.h"
#include "core/gpu.h"
#include "core/nvtx_range.h"
#include "core/rng.h"
#include "model/cuda/gpu_phases.h"
#include "model/cuda/gpu_transformer.h"
#include "model/cuda/loopback_exchange.h"
#include "model/gpu_buffer_sizes.h"
#include "model/transformer.h"
#include "obs/cuda/board_sampler.h"
#include "optim/cuda/gpu_optimizer.h"
#include "train/trainer.h"

namespace moe {

GpuBenchResult run_gpu_bench(const RunConfig& config, const GpuBenchOptions& bench, std::ostream& out) {
  const int warmup_steps = bench.warmup_steps, timed_steps = bench.timed_steps;
  const bool ep_loopback = bench.ep_loopback;
  const ModelConfig& mc = config.model;
  const int64_t batch = config.training.micro_batch, S = mc.seq_len, T = batch * S;
  MOE_CHECK(mc.vocab_size > 0, "bench needs model.vocab_size");
  if (bench.sm_clocks && config.training.cuda_graphs)
    MOE_CONFIG_ERROR("moe bench --sm-clocks needs the phase split: set training.cuda_graphs = false");
  // Before anything large is allocated on the host.
  MOE_CHECK(gpu::device_count() > 0, "moe bench needs a CUDA device, and none is visible");
  ParameterCounts counts;
  std::unique_ptr<GpuTransformer> gpu;
  std::unique_ptr<GpuOptimizer> optimizer;
  GpuModelOptions options = GpuModelOptions::from_config(config.training, config.optimizer.state_dtype);
  if (ep_loopback) {
    MOE_CHECK(mc.moe.n_experts > 0, "bench --ep-loopback needs an MoE model");
    if (options.bf16_expert_grads)
      MOE_CONFIG_ERROR("moe bench --ep-loopback runs expert parallelism, which training.expert_grad_dtype = bf16 does "
                       "not support: set it to fp32");
    options.expert_exchange = std::make_shared<LoopbackExpertExchange>();
  }
  {
    // Initialise on the host (the same weights as the CPU path), copy, then free the host copy.
    Transformer<float> host(mc, config.training.seed);
    counts = count_parameters(mc, host.params());
    gpu = std::make_unique<GpuTransformer>(mc, host.params(), options);
    optimizer = std::make_unique<GpuOptimizer>(gpu->parameters(), host.params(), gpu->stream());
  }
  gpu->plan(batch);
  gpu->enable_graphs(config.training.cuda_graphs);
  std::vector<int32_t> inputs(static_cast<size_t>(T)), targets(static_cast<size_t>(T));
  CounterRng rng(config.training.seed, "bench.tokens");
  for (int64_t i = 0; i < T; ++i) {
    const auto bits = rng.bits(static_cast<uint64_t>(i));
    inputs[static_cast<size_t>(i)] = static_cast<int32_t>(bits[0] % static_cast<uint32_t>(mc.vocab_size));
    targets[static_cast<size_t>(i)] = static_cast<int32_t>(bits[1] % static_cast<uint32_t>(mc.vocab_size));
  }
  cudaEvent_t start, stop;
  MOE_CUDA_CHECK(cudaEventCreate(&start));
  MOE_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> step_ms;
  double loss = 0;
  gpu::PhaseClock clock(gpu_phase_names());
  clock.set_enabled(!config.training.cuda_graphs);  // no events inside a graph
  clock.set_sm_clocks(bench.sm_clocks);
  gpu->set_phase_clock(&clock);
  optimizer->set_phase_clock(&clock);
  // The board's clock and power over the timed steps: at its power limit the SM clock falls.
  BoardSampler board(std::chrono::milliseconds(50));
  for (int step = 1; step <= warmup_steps + timed_steps; ++step) {
    if (step == warmup_steps + 1) {
      clock.take();  // drop the warm-up steps' phases
      clock.take_sm_mhz();
      board.start();
    }
    const NvtxRange range((step <= warmup_steps ? "warm-up step " : "step ") + std::to_string(step));
    MOE_CUDA_CHECK(cudaEventRecord(start));
    gpu->begin_gradients();  // as training: no zeroing pass over the expert gradients
    loss = gpu->forward_backward(inputs.data(), targets.data(), 1.0).total();
    // The whole optimizer step as training runs it: gradient norm, clipping, AdamW.
    const OptimizerConfig& o = config.optimizer;
    optimizer->clip_and_adamw_step(AdamWStep{config.lr.peak, o.beta1, o.beta2, o.eps, o.weight_decay, step},
                                   config.training.grad_clip);
    MOE_CUDA_CHECK(cudaEventRecord(stop));
    MOE_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (step > warmup_steps) step_ms.push_back(ms);
  }
  board.stop();
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  const auto phases = clock.take();
  const std::vector<double> sm_mhz = clock.take_sm_mhz();
  std::sort(step_ms.begin(), step_ms.end());
  GpuBenchResult result;
  result.median_step_ms = step_ms[step_ms.size() / 2];
  result.tokens_per_second = static_cast<double>(T) / (result.median_step_ms / 1e3);
  // TorchTitan's count: 6 x active non-embedding parameters (LM head included) + attention.
  const double active_non_embedding = static_cast<double>(counts.active - counts.embedding);
  const double flops_per_token = 6.0 * active_non_embedding +
                                 12.0 * static_cast<double>(mc.n_layers * mc.dim * mc.seq_len);
  constexpr double kPeakFlops = 989e12;  // H100/H200 dense bf16
  result.mfu = result.tokens_per_second * flops_per_token / kPeakFlops;
  result.device_gb = static_cast<double>(gpu::device_bytes_in_use()) / 1e9;
  fmt::print(out, "bench: {} layers, dim {}, {} experts top-{}, micro-batch {} x {} tokens\n", mc.n_layers, mc.dim,
             mc.moe.n_experts, mc.moe.top_k, batch, S);
  fmt::print(out,
             "mode: experts' and projections' GEMMs {}{}{}, AdamW moments {}, expert gradients {}, activations of {} "
             "layers recomputed, experts recompute {}{}, CUDA graphs {}\n",
             name_of(config.training.precision),
             config.training.precision != TrainingPrecision::Fp8
                 ? fmt::format(" (experts' kernels {})", name_of(config.training.bf16_gemm_backend))
                 : fmt::format(" ({}; kernels {})",
                               config.training.fp8_weight_cache ? "expert weights quantised once a step"
                                                                : "weights quantised at each use",
                               name_of(config.training.fp8_gemm_backend)),
             config.training.precision == TrainingPrecision::Fp8 && config.training.fp8_weight_gradients
                 ? fmt::format(", the experts' weight gradients too (x's and act's scales {})",
                               name_of(config.training.fp8_weight_gradient_scales))
                 : "",
             name_of(config.optimizer.state_dtype),
             name_of(config.training.expert_grad_dtype),
             config.training.recompute_layers < 0 ? mc.n_layers : config.training.recompute_layers,
             name_of(config.training.recompute_experts),
             config.training.recompute_experts != ExpertRecompute::None && config.training.recompute_experts_layers >= 0
                 ? fmt::format(" (the first {} MoE layers)", config.training.recompute_experts_layers)
                 : "",
             config.training.cuda_graphs ? "on (forward + backward replayed; no phase split)" : "off");
  if (config.training.precision == TrainingPrecision::Fp8) fmt::print(out, "{}\n", describe_fp8_projections(mc, T));
  fmt::print(out, "attention backward: {}{}; {}\n",
             name_of(attention_dq(config.training.deterministic, config.training.deterministic_attention)),
             config.training.attention_query_chunks > 1
                 ? fmt::format(", in {} query chunks", config.training.attention_query_chunks)
                 : "",
             gpu_library_versions());
  if (ep_loopback)
    fmt::print(out, "expert parallel over this one GPU (--ep-loopback): every exchange a device copy\n");
  fmt::print(out, "params: total {:.3f} B, active {:.3f} B, embedding {:.3f} B\n", counts.total / 1e9,
             counts.active / 1e9, counts.embedding / 1e9);
  fmt::print(out, "steps: {} warm-up + {} timed; median {:.1f} ms, min {:.1f}, max {:.1f}; last loss {:.4f}\n",
             warmup_steps, timed_steps, result.median_step_ms, step_ms.front(), step_ms.back(), loss);
  fmt::print(out,
             "tokens/s {:.0f} | MFU {:.1f}% = tokens/s x (6 x {:.4g} active non-embedding params + 12 x {} layers x "
             "{} dim x {} seq) / {:.0f} TFLOP/s\n",
             result.tokens_per_second, 100 * result.mfu, active_non_embedding, mc.n_layers, mc.dim, mc.seq_len,
             kPeakFlops / 1e12);
  fmt::print(out, "device memory in use: {:.1f} GB\n", result.device_gb);
  double phase_total = 0, mhz_ms = 0, mhz_weight = 0;
  for (size_t p = 0; p < phases.size(); ++p) {
    const auto& [name, ms] = phases[p];
    phase_total += ms;
    if (!config.training.cuda_graphs) result.phase_ms[name] = ms / timed_steps;
    if (!sm_mhz.empty() && sm_mhz[p] > 0) {
      result.phase_sm_mhz[name] = sm_mhz[p];
      mhz_ms += sm_mhz[p] * ms;
      mhz_weight += ms;
    }
  }
  result.board = board.summary();
  if (mhz_weight > 0) result.board.sm_mhz_counted = mhz_ms / mhz_weight;  // beside NVML's in the line below
  fmt::print(out, "board over the timed steps: {}\n",
             board.available() ? describe_board(result.board) : "not sampled: " + board.unavailable_reason());
  fmt::print(out, "time by phase, mean per step (forward + backward; from CUDA events at phase boundaries){}:\n",
             sm_mhz.empty() ? "" : ", and the SMs' mean clock in each (their cycle counters)");
  for (size_t p = 0; p < phases.size(); ++p) {
    const auto& [name, ms] = phases[p];
    fmt::print(out, "  {:<16} {:8.1f} ms  {:5.1f}%{}\n", name, ms / timed_steps,
               100.0 * ms / std::max(phase_total, 1e-9),
               sm_mhz.empty() || sm_mhz[p] <= 0 ? "" : fmt::format("  {:5.0f} MHz", sm_mhz[p]));
  }
  if (mhz_weight > 0)
    fmt::print(out, "SM clock over the phases (time-weighted): {:.0f} MHz\n", result.board.sm_mhz_counted);
  return result;
}

}  // namespace moe

// GPU training runs in the GEMM modes (training.precision, the fp8 options, the GEMM
// backends) for the tests that compare them (test_gpu_fp8_training.cpp,
// test_gpu_bf16_deepgemm_training.cpp): a small model's losses, first-step gradients and
// drops from fixed batches, and the distance between two runs' gradients.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/rng.h"
#include "gpu_test_util.h"
#include "model/cuda/gpu_transformer.h"
#include "model/transformer.h"
#include "optim/cuda/gpu_optimizer.h"
#include "small_models.h"

namespace moe::test {

struct PrecisionRun {
  std::vector<double> losses;  // ce per micro-batch (or per step)
  std::vector<float> grads;    // after the micro-batches of the first step
  std::vector<bool> expert;    // per element of grads: an expert weight's (w1, w2, w3 of the routed experts)
  int64_t dropped = 0;         // assignments dropped by capacity, over every forward
};

// What runs in fp8, and how the step is run.
struct Mode {
  bool experts = false, projections = false;
  ExpertRecompute recompute = ExpertRecompute::None;
  int64_t recompute_layers = 0;
  bool graphs = false;
  bool weight_gradients = false;  // the experts' weight gradients in fp8 too
  bool bf16_grads = false;        // the experts' gradients in bf16 (training.expert_grad_dtype)
  bool block_columns = false;     // x's and act's token columns 128x128 (training.fp8_weight_gradient_scales)
  bool padded = false;            // rows padded per expert, DeepGEMM's GEMMs (training.fp8_gemm_backend)
  bool bf16_padded = false;       // the same for the bf16 experts (training.bf16_gemm_backend)
  bool interleave = false;        // with bf16_padded: w1 | w3 interleaved (training.interleave_gate_up)
  bool swiglu_in_gemm = false;    // with interleave: SwiGLU in the gate|up GEMM's epilogue (training.swiglu_in_gemm)
  bool overwrite_grads = false;   // the first micro-batch writes the gradients (begin_gradients), as the trainer's
};
inline constexpr Mode kBf16{}, kExperts{true, false}, kProjections{false, true}, kAll{true, true};

// `steps` optimizer steps of two micro-batches each on fixed random batches (the same for
// every run); the gradients of the first step are kept.
inline PrecisionRun run(const Mode& mode, int steps, const ModelConfig& config = test::small_moe_model(0.0)) {
  Transformer<float> host(config, 7);
  GpuModelOptions options;
  options.fp8_experts = mode.experts;
  options.fp8_projections = mode.projections;
  options.recompute_experts = mode.recompute;
  options.recompute_layers = mode.recompute_layers;
  options.fp8_weight_gradients = mode.weight_gradients;
  options.bf16_expert_grads = mode.bf16_grads;
  options.fp8_weight_gradient_scales = mode.block_columns ? Fp8ColumnScales::Block128x128 : Fp8ColumnScales::Tile1x128;
  options.fp8_deepgemm = mode.padded;
  options.bf16_deepgemm = mode.bf16_padded;
  options.interleave_gate_up = mode.interleave;
  options.swiglu_in_gemm = mode.swiglu_in_gemm;
  GpuTransformer gpu(config, host.params(), options);
  EXPECT_EQ(gpu.swiglu_in_gemm(), mode.swiglu_in_gemm) << "training.swiglu_in_gemm did not take as asked";
  gpu.enable_graphs(mode.graphs);
  GpuOptimizer optimizer(gpu.parameters(), host.params(), gpu.stream());
  gpu.plan(2);
  PrecisionRun r;
  for (int step = 0; step < steps; ++step) {
    if (mode.overwrite_grads)
      gpu.begin_gradients();
    else
      gpu.parameters().zero_grads();
    double loss = 0;
    for (int micro = 0; micro < 2; ++micro) {
      CounterRng rng(100 + micro, "fp8 batch");
      std::vector<int32_t> inputs, targets;
      // A learnable batch: each target is the next input token.
      for (int64_t i = 0; i < 2 * config.seq_len; ++i)
        inputs.push_back(static_cast<int32_t>(rng.bits(i)[0] % 64));
      for (int64_t i = 0; i < 2 * config.seq_len; ++i)
        targets.push_back(i + 1 < 2 * config.seq_len ? inputs[static_cast<size_t>(i + 1)] : -1);
      const ForwardResult result = gpu.forward_backward(inputs.data(), targets.data(), 0.5);
      loss += result.ce_loss / 2;
      r.dropped += result.dropped;
    }
    r.losses.push_back(loss);
    if (step == 0) {
      gpu.download_grads(host.params());
      auto& params = host.params();
      for (int id = 0; id < params.size(); ++id) {
        r.grads.insert(r.grads.end(), params.grad(id), params.grad(id) + params.numel(id));
        const std::string& name = params.spec(id).name;
        const bool expert = name.find(".experts.w") != std::string::npos;
        r.expert.insert(r.expert.end(), static_cast<size_t>(params.numel(id)), expert);
      }
    }
    optimizer.adamw_step(AdamWStep{3e-3, 0.9, 0.95, 1e-8, 0.0, step + 1}, 1.0f);
  }
  return r;
}

// ||g - g16|| / ||g16|| over the whole gradient, or over the experts' weights' or the
// other parameters' elements (every element finite).
enum class Part { All, Experts, Others };
inline double relative_distance(const PrecisionRun& run, const PrecisionRun& bf16, Part part = Part::All) {
  EXPECT_EQ(run.grads.size(), bf16.grads.size());
  std::vector<float> got, want;
  for (size_t i = 0; i < bf16.grads.size() && i < run.grads.size(); ++i) {
    if (part != Part::All && bf16.expert[i] != (part == Part::Experts)) continue;
    EXPECT_TRUE(std::isfinite(run.grads[i])) << i;
    got.push_back(run.grads[i]);
    want.push_back(bf16.grads[i]);
  }
  return relative_l2(got, want);
}
}  // namespace moe::test

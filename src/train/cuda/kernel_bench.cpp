// `moe bench --kernels`: the GEMM-shaped kernels of one layer at the config's shapes,
// each timed alone (CUDA events, warm-up, median), as ms and TFLOP/s against the dense
// GEMM of the same size: where the experts' and attention's time goes.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "core/gpu.h"
#include "kernels/gpu_ops.h"
#include "model/gpu_buffer_sizes.h"
#include "train/cuda/gpu_bench.h"
#include "train/cuda/kernel_bench_util.h"

namespace moe {
namespace {

using bench::filled;
using bench::kTimed;
using bench::kWarmup;
using bench::median_ms;

// One of the six expert GEMMs of a layer, three ways: CUTLASS's grouped GEMM, the per-expert
// cuBLASLt loop it replaced (host offsets) and DeepGEMM's bf16 kernel over rows padded per
// expert (empty without it).
struct GemmCase {
  std::string name;
  double flops;
  std::function<void()> grouped, loop, deepgemm;
};

// The padded offsets DeepGEMM's rows take (each expert's rows rounded up to 128), or empty
// where its kernel does not run here or the padded rows exceed the buffers' R.
std::vector<int32_t> deepgemm_offsets(const std::vector<int32_t>& offsets, int64_t E, int64_t D, int64_t F,
                                      std::ostream& out) {
  if (!cuda::deepgemm_available() || E > cuda::PaddedExpertGemmBf16::kMaxExperts || D % 128 != 0 || F % 128 != 0) {
    fmt::print(out, "  DeepGEMM's bf16 kernel: not on this GPU or these shapes\n");
    return {};
  }
  std::vector<int32_t> padded(offsets.size(), 0);
  for (size_t e = 0; e + 1 < offsets.size(); ++e)
    padded[e + 1] = padded[e] + (offsets[e + 1] - offsets[e] + 127) / 128 * 128;
  if (padded.back() > offsets.back()) {
    fmt::print(out, "  DeepGEMM's bf16 kernel: {} padded rows do not fit the {} of the buffers (not timed)\n",
               padded.back(), offsets.back());
    return {};
  }
  return padded;
}

// Each case alone on a warm board (median of kTimed): CUTLASS beside the cuBLASLt loop, then
// DeepGEMM beside CUTLASS.
void print_warm(const std::vector<GemmCase>& cases, const std::string& header, double dense_ms, double dense_flops,
                const std::string& dense_name, std::ostream& out) {
  fmt::print(out, "{}; median of {} after {} warm-up\n", header, kTimed, kWarmup);
  fmt::print(out, "  {:<36} {:>9} {:>8}   {:>12} {:>8}\n", "kernel", "grouped", "TFLOP/s", "cuBLAS loop", "TFLOP/s");
  std::vector<double> grouped_ms;
  double grouped_total = 0, loop_total = 0, flops_total = 0;
  for (const GemmCase& c : cases) {
    const double g = median_ms(c.grouped), l = median_ms(c.loop);
    grouped_ms.push_back(g);
    fmt::print(out, "  {:<36} {:7.3f}ms {:8.0f}   {:10.3f}ms {:8.0f}\n", c.name, g, c.flops / g / 1e9, l,
               c.flops / l / 1e9);
    grouped_total += g;
    loop_total += l;
    flops_total += c.flops;
  }
  fmt::print(out, "  {:<36} {:7.3f}ms {:8.0f}   {:10.3f}ms {:8.0f}\n", "all expert GEMMs of the layer", grouped_total,
             flops_total / grouped_total / 1e9, loop_total, flops_total / loop_total / 1e9);
  fmt::print(out, "  dense ceiling: one cuBLASLt {} GEMM {:.3f} ms = {:.0f} TFLOP/s\n", dense_name, dense_ms,
             dense_flops / dense_ms / 1e9);
  if (!cases.front().deepgemm) return;
  fmt::print(out, "  DeepGEMM's bf16 kernel against CUTLASS's grouped GEMM above:\n");
  double total = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const double ms = median_ms(cases[i].deepgemm);
    fmt::print(out, "  {:<36} {:7.3f}ms {:8.0f}   (CUTLASS {:.3f} ms)\n", cases[i].name, ms,
               cases[i].flops / ms / 1e9, grouped_ms[i]);
    total += ms;
  }
  fmt::print(out, "  {:<36} {:7.3f}ms            (CUTLASS {:.3f} ms)\n", "all six", total, grouped_total);
}

// Each case back to back for `sustain_ms` (SustainedTimer): the rate under the power limit,
// CUTLASS and DeepGEMM alternating case by case, and the dense GEMM the same way.
void print_sustained(const std::vector<GemmCase>& cases, const std::string& header, bench::SustainedTimer& timer,
                     double sustain_ms, const std::function<void()>& dense, double dense_flops,
                     const std::string& dense_name, std::ostream& out) {
  fmt::print(out, "{}; each kernel back to back for {:.0f} ms, the median of the second half, with the board's mean "
                  "SM clock and power over it\n",
             header, sustain_ms);
  fmt::print(out, "  {:<36} {:>9} {:>8} {:>15}   {:>9} {:>8} {:>15}\n", "kernel", "CUTLASS", "TFLOP/s", "board",
             "DeepGEMM", "TFLOP/s", "board");
  double cutlass_total = 0, deepgemm_total = 0, flops_total = 0;
  for (const GemmCase& c : cases) {
    const double g = timer.ms(c.grouped);
    const std::string g_board = timer.last_board();
    flops_total += c.flops;
    cutlass_total += g;
    if (!c.deepgemm) {
      fmt::print(out, "  {:<36} {:7.3f}ms {:8.0f} {:>15}\n", c.name, g, c.flops / g / 1e9, g_board);
      continue;
    }
    const double d = timer.ms(c.deepgemm);
    deepgemm_total += d;
    fmt::print(out, "  {:<36} {:7.3f}ms {:8.0f} {:>15}   {:7.3f}ms {:8.0f} {:>15}\n", c.name, g, c.flops / g / 1e9,
               g_board, d, c.flops / d / 1e9, timer.last_board());
  }
  fmt::print(out, "  {:<36} {:7.3f}ms {:8.0f} {:>15}   {:7.3f}ms {:8.0f}\n", "all six", cutlass_total,
             flops_total / cutlass_total / 1e9, "", deepgemm_total,
             deepgemm_total > 0 ? flops_total / deepgemm_total / 1e9 : 0.0);
  const double d = timer.ms(dense);
  fmt::print(out, "  dense ceiling under the limit: one cuBLASLt {} GEMM {:.3f} ms = {:.0f} TFLOP/s ({})\n", dense_name,
             d, dense_flops / d / 1e9, timer.last_board());
}

}  // namespace

void run_kernel_bench(const RunConfig& config, std::ostream& out, const KernelBenchOptions& options) {
  const double sustain_ms = options.sustain_ms;
  const ModelConfig& mc = config.model;
  const int64_t T = config.training.micro_batch * mc.seq_len, D = mc.dim, E = mc.moe.n_experts, K = mc.moe.top_k,
                F = mc.moe.expert_hidden;
  MOE_CHECK(E > 0, "moe bench --kernels needs an MoE model");
  MOE_CHECK(gpu::device_count() > 0, "moe bench needs a CUDA device, and none is visible");
  // Dropless routing spread evenly: rows per expert = T * K / E (the balanced case the
  // aux loss steers towards); the rest of the rows go to the last expert.
  const int64_t R = T * K, per_expert = R / E;
  std::vector<int32_t> offsets(static_cast<size_t>(E + 1));
  for (int64_t e = 0; e <= E; ++e) offsets[static_cast<size_t>(e)] = static_cast<int32_t>(std::min(R, e * per_expert));
  offsets[static_cast<size_t>(E)] = static_cast<int32_t>(R);
  gpu::DeviceArray<int32_t> offsets_d(offsets.size());
  offsets_d.upload(offsets.data(), offsets.size());
  auto x = filled<bf16>(R * D, 1.0f, 1), gate_up = filled<bf16>(R * 2 * F, 1.0f, 2), act = filled<bf16>(R * F, 1.0f, 3),
       y = filled<bf16>(R * D, 1.0f, 4);
  auto w1 = filled<bf16>(E * F * D, 0.02f, 5), w3 = filled<bf16>(E * F * D, 0.02f, 6), w2 = filled<bf16>(E * D * F, 0.02f, 7);
  auto g1 = filled<float>(E * F * D, 1e-3f, 8), g3 = filled<float>(E * F * D, 1e-3f, 9), g2 = filled<float>(E * D * F, 1e-3f, 10);
  auto h1 = filled<bf16>(E * F * D, 1e-3f, 11), h3 = filled<bf16>(E * F * D, 1e-3f, 12), h2 = filled<bf16>(E * D * F, 1e-3f, 13);
  cuda::ExpertGemm grouped(E);
  cuda::Blas blas;
  const cuda::Stream stream = nullptr;
  // The per-expert cuBLASLt loop the grouped GEMM replaced (host offsets), for comparison.
  auto loop = [&](const std::function<void(int64_t first, int64_t rows, int64_t e)>& gemm) {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t first = offsets[static_cast<size_t>(e)], rows = offsets[static_cast<size_t>(e + 1)] - first;
      if (rows > 0) gemm(first, rows, e);
    }
  };
  // The weight gradients as the run's step writes them: bf16 with beta 0 (a step's first
  // micro-batch; training.expert_grad_dtype = bf16), else fp32 with beta 1.
  const bool bf16_grads = config.training.expert_grad_dtype == GradDtype::Bf16;
  const std::string wgrad = bf16_grads ? "bf16 b0" : "fp32 b1";
  const double mnk = 2.0 * static_cast<double>(R) * static_cast<double>(D) * static_cast<double>(F);
  bf16* gu_halves[2] = {gate_up.data(), gate_up.data() + F};
  const bf16* gu_in[2] = {gate_up.data(), gate_up.data() + F};
  const bf16* w13[2] = {w1.data(), w3.data()};
  bf16* y_out[1] = {y.data()};
  const bf16* w2s[1] = {w2.data()};
  const bf16* dy[1] = {y.data()};
  float* g2s[1] = {g2.data()};
  float* g13[2] = {g1.data(), g3.data()};
  bf16* h2s[1] = {h2.data()};
  bf16* h13[2] = {h1.data(), h3.data()};
  std::vector<GemmCase> cases;
  cases.push_back({"fwd gate|up  [rows,D]x[D,2F]", 2 * mnk,
                   [&] { grouped.forward(2, gu_halves, 2 * F, x.data(), D, w13, offsets_d.data(), F, D, stream); },
                   [&] {
                     loop([&](int64_t first, int64_t n, int64_t e) {
                       blas.gemm(false, true, n, F, D, 1, x.data() + first * D, D, w1.data() + e * F * D, D, 0,
                                 gate_up.data() + first * 2 * F, false, 2 * F, stream);
                       blas.gemm(false, true, n, F, D, 1, x.data() + first * D, D, w3.data() + e * F * D, D, 0,
                                 gate_up.data() + first * 2 * F + F, false, 2 * F, stream);
                     });
                   },
                   {}});
  cases.push_back({"fwd down     [rows,F]x[F,D]", mnk,
                   [&] { grouped.forward(1, y_out, D, act.data(), F, w2s, offsets_d.data(), D, F, stream); },
                   [&] {
                     loop([&](int64_t first, int64_t n, int64_t e) {
                       blas.gemm(false, true, n, D, F, 1, act.data() + first * F, F, w2.data() + e * D * F, F, 0,
                                 y.data() + first * D, false, D, stream);
                     });
                   },
                   {}});
  cases.push_back({"dgrad down   [rows,D]x[D,F]", mnk,
                   [&] { grouped.backward_data(act.data(), F, y.data(), D, w2.data(), offsets_d.data(), F, D, 0, stream); },
                   [&] {
                     loop([&](int64_t first, int64_t n, int64_t e) {
                       blas.gemm(false, false, n, F, D, 1, y.data() + first * D, D, w2.data() + e * D * F, F, 0,
                                 act.data() + first * F, false, F, stream);
                     });
                   },
                   {}});
  cases.push_back({"dgrad gate+up 2x[rows,F]x[F,D]", 2 * mnk,
                   [&] {
                     grouped.backward_data(x.data(), D, gate_up.data(), 2 * F, w1.data(), offsets_d.data(), D, F, 0,
                                           stream);
                     grouped.backward_data(x.data(), D, gate_up.data() + F, 2 * F, w3.data(), offsets_d.data(), D, F,
                                           1, stream);
                   },
                   [&] {
                     loop([&](int64_t first, int64_t n, int64_t e) {
                       blas.gemm(false, false, n, D, F, 1, gate_up.data() + first * 2 * F, 2 * F, w1.data() + e * F * D,
                                 D, 0, x.data() + first * D, false, D, stream);
                       blas.gemm(false, false, n, D, F, 1, gate_up.data() + first * 2 * F + F, 2 * F,
                                 w3.data() + e * F * D, D, 1, x.data() + first * D, false, D, stream);
                     });
                   },
                   {}});
  cases.push_back({"wgrad down   [D,rows]x[rows,F] " + wgrad, mnk,
                   [&] {
                     if (bf16_grads) grouped.backward_weight(1, h2s, dy, D, act.data(), F, offsets_d.data(), D, F, stream, 0.0f);
                     else grouped.backward_weight(1, g2s, dy, D, act.data(), F, offsets_d.data(), D, F, stream);
                   },
                   [&] {
                     loop([&](int64_t first, int64_t n, int64_t e) {
                       blas.gemm(true, false, D, F, n, 1, y.data() + first * D, D, act.data() + first * F, F, 1,
                                 g2.data() + e * D * F, true, F, stream);
                     });
                   },
                   {}});
  cases.push_back({"wgrad gate|up 2x[F,rows]x[rows,D] " + wgrad, 2 * mnk,
                   [&] {
                     if (bf16_grads) grouped.backward_weight(2, h13, gu_in, 2 * F, x.data(), D, offsets_d.data(), F, D, stream, 0.0f);
                     else grouped.backward_weight(2, g13, gu_in, 2 * F, x.data(), D, offsets_d.data(), F, D, stream);
                   },
                   [&] {
                     loop([&](int64_t first, int64_t n, int64_t e) {
                       blas.gemm(true, false, F, D, n, 1, gate_up.data() + first * 2 * F, 2 * F, x.data() + first * D,
                                 D, 1, g1.data() + e * F * D, true, D, stream);
                       blas.gemm(true, false, F, D, n, 1, gate_up.data() + first * 2 * F + F, 2 * F,
                                 x.data() + first * D, D, 1, g3.data() + e * F * D, true, D, stream);
                     });
                   },
                   {}});
  // DeepGEMM's bf16 kernel over the balanced rows padded per expert (the padding rows read
  // whatever the buffers hold: timing only); its weight gradients bf16 with beta 0, as that
  // backend runs them.
  const std::vector<int32_t> padded = deepgemm_offsets(offsets, E, D, F, out);
  gpu::DeviceArray<int32_t> padded_d(std::max<size_t>(padded.size(), 1));
  std::unique_ptr<cuda::PaddedExpertGemmBf16> deepgemm;
  if (!padded.empty()) {
    padded_d.upload(padded.data(), padded.size());
    deepgemm = std::make_unique<cuda::PaddedExpertGemmBf16>(E);
    const int32_t* P = padded_d.data();
    cuda::PaddedExpertGemmBf16& g = *deepgemm;
    cases[0].deepgemm = [&, P] { g.forward(2, gu_halves, 2 * F, x.data(), D, w13, P, R, F, D, stream); };
    cases[1].deepgemm = [&, P] { g.forward(1, y_out, D, act.data(), F, w2s, P, R, D, F, stream); };
    cases[2].deepgemm = [&, P] { g.backward_data(act.data(), F, y.data(), D, w2.data(), P, R, F, D, 0.0f, stream); };
    cases[3].deepgemm = [&, P] {
      g.backward_data(x.data(), D, gate_up.data(), 2 * F, w1.data(), P, R, D, F, 0.0f, stream);
      g.backward_data(x.data(), D, gate_up.data() + F, 2 * F, w3.data(), P, R, D, F, 1.0f, stream);
    };
    cases[4].deepgemm = [&, P] { g.backward_weight(1, h2s, dy, D, act.data(), F, P, R, D, F, stream); };
    cases[5].deepgemm = [&, P] { g.backward_weight(2, h13, gu_in, 2 * F, x.data(), D, P, R, F, D, stream); };
  }
  // The dense ceiling at the same total size: one [rows, D] x [D, F] GEMM through cuBLASLt.
  auto dense = [&] { blas.gemm(false, true, R, F, D, 1, x.data(), D, w1.data(), D, 0, act.data(), false, F, stream); };
  const std::string dense_name = fmt::format("[{},{}]x[{},{}]", R, D, D, F);
  const std::string header =
      fmt::format("expert GEMMs, one MoE layer: {} experts x {} rows (T {} x top-{}), D {}, F {}{}", E, per_expert, T,
                  K, D, F, padded.empty() ? "" : fmt::format("; DeepGEMM over {} padded rows", padded.back()));
  if (sustain_ms > 0) {
    bench::SustainedTimer timer(sustain_ms);
    if (options.gemms) print_sustained(cases, header, timer, sustain_ms, dense, mnk, dense_name, out);
    if (!options.fp8) return;
    fmt::print(out, "fp8 section: each kernel back to back for {:.0f} ms (the median of the second half)\n", sustain_ms);
    run_fp8_kernel_bench(config, out, [&](const std::function<void()>& launch) { return timer.ms(launch); });
    return;
  }
  if (options.gemms) print_warm(cases, header, median_ms(dense), mnk, dense_name, out);
  // The gate|up forward over interleaved [w1_e; w3_e] weights (training.interleave_gate_up)
  // then the SwiGLU pass, against our kernel with SwiGLU in the epilogue
  // (training.swiglu_in_gemm).
  if (options.swiglu && deepgemm && swiglu_in_gemm_fits(F)) {
    auto w13_joined = filled<bf16>(E * 2 * F * D, 0.02f, 14);
    const int32_t* P = padded_d.data();
    bf16* joined_out[1] = {gate_up.data()};
    const bf16* joined_w[1] = {w13_joined.data()};
    const double gemm = median_ms([&] {
      deepgemm->forward(1, joined_out, 2 * F, x.data(), D, joined_w, P, R, 2 * F, D, stream);
    });
    const double pass = median_ms([&] { cuda::swiglu_forward(act.data(), gate_up.data(), R, F, stream); });
    const double fused = median_ms([&] {
      deepgemm->forward_swiglu(gate_up.data(), act.data(), x.data(), D, w13_joined.data(), P, R, F, D, stream);
    });
    fmt::print(out,
               "  gate|up forward + SwiGLU: DeepGEMM's one GEMM {:.3f} ms ({:.0f} TFLOP/s) + the SwiGLU pass {:.3f} ms "
               "= {:.3f} ms; SwiGLU in our GEMM's epilogue {:.3f} ms ({:.0f} TFLOP/s)\n",
               gemm, 2 * mnk / gemm / 1e9, pass, gemm + pass, fused, 2 * mnk / fused / 1e9);
    // The down projection's data gradient then SwiGLU's backward (act refilled, as under
    // recompute_experts = swiglu, or not), against our kernel with SwiGLU's backward in it.
    auto dgate_up = filled<bf16>(R * 2 * F, 1.0f, 15), dact = filled<bf16>(R * F, 1.0f, 16);
    const double dgrad = median_ms([&] {
      deepgemm->backward_data(dact.data(), F, y.data(), D, w2.data(), P, R, F, D, 0.0f, stream);
    });
    for (const bool refill : {false, true}) {
      bf16* act_out = refill ? act.data() : nullptr;
      const double backward_pass = median_ms([&] {
        cuda::swiglu_backward(dgate_up.data(), dact.data(), gate_up.data(), R, F, stream, act_out);
      });
      const double fused_backward = median_ms([&] {
        deepgemm->backward_data_swiglu(dgate_up.data(), act_out, y.data(), D, w2.data(), gate_up.data(), P, R, F, D,
                                       stream);
      });
      fmt::print(out,
                 "  down data gradient + SwiGLU's backward{}: DeepGEMM's GEMM {:.3f} ms ({:.0f} TFLOP/s) + the pass "
                 "{:.3f} ms = {:.3f} ms; SwiGLU's backward in our GEMM {:.3f} ms ({:.0f} TFLOP/s)\n",
                 refill ? " refilling act" : "", dgrad, mnk / dgrad / 1e9, backward_pass, dgrad + backward_pass,
                 fused_backward, mnk / fused_backward / 1e9);
    }
  }
  // The gate|up weight gradient in each output type, beta 1 and beta 0 (a step's first
  // micro-batch: no read of the old gradient), grouped only.
  if (options.wgrad) {
    fmt::print(out, "  wgrad gate|up variants (grouped):");
    for (const bool bf16_out : {false, true})
      for (const float beta : {1.0f, 0.0f}) {
        const double ms = median_ms([&] {
          if (bf16_out)
            grouped.backward_weight(2, h13, gu_in, 2 * F, x.data(), D, offsets_d.data(), F, D, stream, beta);
          else
            grouped.backward_weight(2, g13, gu_in, 2 * F, x.data(), D, offsets_d.data(), F, D, stream, beta);
        });
        fmt::print(out, " {} beta {:.0f} {:.3f} ms ({:.0f} TFLOP/s);", bf16_out ? "bf16" : "fp32", beta, ms,
                   2 * mnk / ms / 1e9);
      }
    fmt::print(out, "\n");
  }
  if (options.fp8) run_fp8_kernel_bench(config, out, median_ms);
}

}  // namespace moe

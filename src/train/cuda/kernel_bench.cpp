// `moe bench --kernels`: the GEMM-shaped kernels of one layer at the config's shapes,
// each timed alone (CUDA events, warm-up, median), as ms and TFLOP/s against the dense
// GEMM of the same size: where the experts' and attention's time goes.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <functional>
#include <ostream>
#include <string>
#include <type_traits>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "core/gpu.h"
#include "kernels/gpu_ops.h"
#include "train/cuda/gpu_bench.h"
#include "train/cuda/kernel_bench_util.h"

namespace moe {
namespace {

using bench::filled;
using bench::kTimed;
using bench::kWarmup;
using bench::median_ms;

struct Row {
  std::string name;
  double flops, grouped_ms, loop_ms;
};

// The same GEMMs through DeepGEMM's bf16 kernel (training.bf16_gemm_backend = deepgemm) over
// rows padded per expert to 128, beside CUTLASS's (`rows`, in the same order); the weight
// gradients into bf16 with beta 0, as that backend runs them.
void run_deepgemm_bf16_rows(const std::vector<Row>& rows, const std::vector<int32_t>& offsets, bf16* x, bf16* gate_up,
                            bf16* act, bf16* y, const bf16* w1, const bf16* w3, const bf16* w2, bf16* h1, bf16* h3,
                            int64_t E, int64_t D, int64_t F, std::ostream& out) {
  if (!cuda::deepgemm_available() || E > cuda::PaddedExpertGemmBf16::kMaxExperts || D % 128 != 0 || F % 128 != 0) {
    fmt::print(out, "  DeepGEMM's bf16 kernel: not on this GPU or these shapes\n");
    return;
  }
  // The balanced rows padded per expert (the padding rows read whatever the buffers hold:
  // timing only), within the buffers' R rows when every expert's rows are whole tiles.
  std::vector<int32_t> padded(offsets.size(), 0);
  for (size_t e = 0; e + 1 < offsets.size(); ++e)
    padded[e + 1] = padded[e] + (offsets[e + 1] - offsets[e] + 127) / 128 * 128;
  const int64_t R = offsets.back();
  if (padded.back() > R) {
    fmt::print(out, "  DeepGEMM's bf16 kernel: {} padded rows do not fit the {} of the buffers (not timed)\n",
               padded.back(), R);
    return;
  }
  gpu::DeviceArray<int32_t> padded_d(padded.size());
  padded_d.upload(padded.data(), padded.size());
  cuda::PaddedExpertGemmBf16 gemm(E);
  const cuda::Stream stream = nullptr;
  const int32_t* P = padded_d.data();
  bf16* gu[2] = {gate_up, gate_up + F};
  const bf16* w13[2] = {w1, w3};
  bf16* down[1] = {y};
  const bf16* w2s[1] = {w2};
  bf16* dw1[1] = {h1};
  const bf16* dy[1] = {y};
  bf16* dw13[2] = {h1, h3};
  const bf16* dgu[2] = {gate_up, gate_up + F};
  const double ms[6] = {
      median_ms([&] { gemm.forward(2, gu, 2 * F, x, D, w13, P, R, F, D, stream); }),
      median_ms([&] { gemm.forward(1, down, D, act, F, w2s, P, R, D, F, stream); }),
      median_ms([&] { gemm.backward_data(act, F, y, D, w2, P, R, F, D, 0.0f, stream); }),
      median_ms([&] {
        gemm.backward_data(x, D, gate_up, 2 * F, w1, P, R, D, F, 0.0f, stream);
        gemm.backward_data(x, D, gate_up + F, 2 * F, w3, P, R, D, F, 1.0f, stream);
      }),
      median_ms([&] { gemm.backward_weight(1, dw1, dy, D, act, F, P, R, D, F, stream); }),
      median_ms([&] { gemm.backward_weight(2, dw13, dgu, 2 * F, x, D, P, R, F, D, stream); })};
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  fmt::print(out, "  DeepGEMM's bf16 kernel ({} padded rows; wgrad bf16, beta 0) against CUTLASS's grouped GEMM above:\n",
             padded.back());
  double total = 0, cutlass = 0;
  for (size_t i = 0; i < rows.size() && i < 6; ++i) {
    fmt::print(out, "  {:<36} {:7.3f}ms {:8.0f}   (CUTLASS {:.3f} ms)\n", rows[i].name, ms[i],
               rows[i].flops / ms[i] / 1e9, rows[i].grouped_ms);
    total += ms[i];
    cutlass += rows[i].grouped_ms;
  }
  fmt::print(out, "  {:<36} {:7.3f}ms            (CUTLASS {:.3f} ms)\n", "all six", total, cutlass);
}

}  // namespace

void run_kernel_bench(const RunConfig& config, std::ostream& out) {
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
  const double mnk = 2.0 * static_cast<double>(R) * static_cast<double>(D) * static_cast<double>(F);
  std::vector<Row> rows;
  {
    bf16* outs[2] = {gate_up.data(), gate_up.data() + F};
    const bf16* ws[2] = {w1.data(), w3.data()};
    rows.push_back({"fwd gate|up  [rows,D]x[D,2F]", 2 * mnk,
                    median_ms([&] { grouped.forward(2, outs, 2 * F, x.data(), D, ws, offsets_d.data(), F, D, stream); }),
                    median_ms([&] {
                      loop([&](int64_t first, int64_t n, int64_t e) {
                        blas.gemm(false, true, n, F, D, 1, x.data() + first * D, D, w1.data() + e * F * D, D, 0,
                                  gate_up.data() + first * 2 * F, false, 2 * F, stream);
                        blas.gemm(false, true, n, F, D, 1, x.data() + first * D, D, w3.data() + e * F * D, D, 0,
                                  gate_up.data() + first * 2 * F + F, false, 2 * F, stream);
                      });
                    })});
  }
  {
    bf16* outs[1] = {y.data()};
    const bf16* ws[1] = {w2.data()};
    rows.push_back({"fwd down     [rows,F]x[F,D]", mnk,
                    median_ms([&] { grouped.forward(1, outs, D, act.data(), F, ws, offsets_d.data(), D, F, stream); }),
                    median_ms([&] {
                      loop([&](int64_t first, int64_t n, int64_t e) {
                        blas.gemm(false, true, n, D, F, 1, act.data() + first * F, F, w2.data() + e * D * F, F, 0,
                                  y.data() + first * D, false, D, stream);
                      });
                    })});
  }
  rows.push_back({"dgrad down   [rows,D]x[D,F]", mnk,
                  median_ms([&] {
                    grouped.backward_data(act.data(), F, y.data(), D, w2.data(), offsets_d.data(), F, D, 0, stream);
                  }),
                  median_ms([&] {
                    loop([&](int64_t first, int64_t n, int64_t e) {
                      blas.gemm(false, false, n, F, D, 1, y.data() + first * D, D, w2.data() + e * D * F, F, 0,
                                act.data() + first * F, false, F, stream);
                    });
                  })});
  rows.push_back({"dgrad gate+up 2x[rows,F]x[F,D]", 2 * mnk,
                  median_ms([&] {
                    grouped.backward_data(x.data(), D, gate_up.data(), 2 * F, w1.data(), offsets_d.data(), D, F, 0,
                                          stream);
                    grouped.backward_data(x.data(), D, gate_up.data() + F, 2 * F, w3.data(), offsets_d.data(), D, F,
                                          1, stream);
                  }),
                  median_ms([&] {
                    loop([&](int64_t first, int64_t n, int64_t e) {
                      blas.gemm(false, false, n, D, F, 1, gate_up.data() + first * 2 * F, 2 * F, w1.data() + e * F * D,
                                D, 0, x.data() + first * D, false, D, stream);
                      blas.gemm(false, false, n, D, F, 1, gate_up.data() + first * 2 * F + F, 2 * F,
                                w3.data() + e * F * D, D, 1, x.data() + first * D, false, D, stream);
                    });
                  })});
  {
    float* dws[1] = {g2.data()};
    const bf16* as[1] = {y.data()};
    rows.push_back({"wgrad down   [D,rows]x[rows,F]", mnk,
                    median_ms([&] {
                      grouped.backward_weight(1, dws, as, D, act.data(), F, offsets_d.data(), D, F, stream);
                    }),
                    median_ms([&] {
                      loop([&](int64_t first, int64_t n, int64_t e) {
                        blas.gemm(true, false, D, F, n, 1, y.data() + first * D, D, act.data() + first * F, F, 1,
                                  g2.data() + e * D * F, true, F, stream);
                      });
                    })});
  }
  {
    float* dws[2] = {g1.data(), g3.data()};
    const bf16* as[2] = {gate_up.data(), gate_up.data() + F};
    rows.push_back({"wgrad gate|up 2x[F,rows]x[rows,D]", 2 * mnk,
                    median_ms([&] {
                      grouped.backward_weight(2, dws, as, 2 * F, x.data(), D, offsets_d.data(), F, D, stream);
                    }),
                    median_ms([&] {
                      loop([&](int64_t first, int64_t n, int64_t e) {
                        blas.gemm(true, false, F, D, n, 1, gate_up.data() + first * 2 * F, 2 * F, x.data() + first * D,
                                  D, 1, g1.data() + e * F * D, true, D, stream);
                        blas.gemm(true, false, F, D, n, 1, gate_up.data() + first * 2 * F + F, 2 * F,
                                  x.data() + first * D, D, 1, g3.data() + e * F * D, true, D, stream);
                      });
                    })});
  }
  // The dense ceiling at the same total size: one [rows, D] x [D, F] GEMM through cuBLASLt.
  const double dense_ms = median_ms([&] {
    blas.gemm(false, true, R, F, D, 1, x.data(), D, w1.data(), D, 0, act.data(), false, F, stream);
  });
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  fmt::print(out, "expert GEMMs, one MoE layer: {} experts x {} rows (T {} x top-{}), D {}, F {}; median of {} after {} "
                  "warm-up\n",
             E, per_expert, T, K, D, F, kTimed, kWarmup);
  fmt::print(out, "  {:<36} {:>9} {:>8}   {:>12} {:>8}\n", "kernel", "grouped", "TFLOP/s", "cuBLAS loop", "TFLOP/s");
  double grouped_total = 0, loop_total = 0, flops_total = 0;
  for (const Row& row : rows) {
    fmt::print(out, "  {:<36} {:7.3f}ms {:8.0f}   {:10.3f}ms {:8.0f}\n", row.name, row.grouped_ms,
               row.flops / row.grouped_ms / 1e9, row.loop_ms, row.flops / row.loop_ms / 1e9);
    grouped_total += row.grouped_ms;
    loop_total += row.loop_ms;
    flops_total += row.flops;
  }
  fmt::print(out, "  {:<36} {:7.3f}ms {:8.0f}   {:10.3f}ms {:8.0f}\n", "all expert GEMMs of the layer", grouped_total,
             flops_total / grouped_total / 1e9, loop_total, flops_total / loop_total / 1e9);
  fmt::print(out, "  dense ceiling: one cuBLASLt [{},{}]x[{},{}] GEMM {:.3f} ms = {:.0f} TFLOP/s\n", R, D, D, F, dense_ms,
             mnk / dense_ms / 1e9);
  // The gate|up weight gradient as a step's first micro-batch writes it (beta 0: no read of
  // the old gradient) and with bf16 gradients (training.expert_grad_dtype), grouped only.
  auto h1 = filled<bf16>(E * F * D, 1e-3f, 11), h3 = filled<bf16>(E * F * D, 1e-3f, 12);
  const bf16* as[2] = {gate_up.data(), gate_up.data() + F};
  float* dws[2] = {g1.data(), g3.data()};
  bf16* hws[2] = {h1.data(), h3.data()};
  fmt::print(out, "  wgrad gate|up variants (grouped):");
  for (const bool bf16_out : {false, true})
    for (const float beta : {1.0f, 0.0f}) {
      const double ms = median_ms([&] {
        if (bf16_out) grouped.backward_weight(2, hws, as, 2 * F, x.data(), D, offsets_d.data(), F, D, stream, beta);
        else grouped.backward_weight(2, dws, as, 2 * F, x.data(), D, offsets_d.data(), F, D, stream, beta);
      });
      fmt::print(out, " {} beta {:.0f} {:.3f} ms ({:.0f} TFLOP/s);", bf16_out ? "bf16" : "fp32", beta, ms,
                 2 * mnk / ms / 1e9);
    }
  fmt::print(out, "\n");
  run_deepgemm_bf16_rows(rows, offsets, x.data(), gate_up.data(), act.data(), y.data(), w1.data(), w3.data(),
                         w2.data(), h1.data(), h3.data(), E, D, F, out);
  run_fp8_kernel_bench(config, out);
}

}  // namespace moe

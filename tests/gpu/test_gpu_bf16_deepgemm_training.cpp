// training.bf16_gemm_backend = deepgemm on the GPU model (GpuModelOptions::bf16_deepgemm):
// rows padded per expert to 128, the experts' forward and data-gradient GEMMs on DeepGEMM's
// bf16 kernel, the weight gradients too where they are bf16 and written (the step's first
// micro-batch). Against CUTLASS's path from the same weights: the same drops, losses and
// gradients within fp32 summation order and one more rounding of dx (up's data gradient
// added to gate's in bf16); bit-identical across reruns, recomputation and CUDA graphs;
// learning as fast.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <utility>

#include "fp8_gemm_test_util.h"
#include "kernels/adamw_math.h"
#include "kernels/gpu_ops.h"
#include "precision_runs.h"

namespace moe {
namespace {

using test::kBf16;
using test::Mode;
using test::Part;
using test::relative_distance;
using test::run;

// As the trainer runs it: w1 | w3 interleaved (training.interleave_gate_up) and SwiGLU in
// the gate|up GEMM's epilogue (training.swiglu_in_gemm) unless told.
Mode padded(bool bf16_grads, bool interleave = true, bool swiglu_in_gemm = true) {
  Mode mode = kBf16;
  mode.bf16_padded = true;
  mode.interleave = interleave;
  mode.swiglu_in_gemm = interleave && swiglu_in_gemm;
  mode.bf16_grads = bf16_grads;
  mode.overwrite_grads = true;  // as the trainer: the first micro-batch's weight gradients written (beta 0)
  return mode;
}

// One MoE layer from the same inputs routes the same tokens: the same drops (the padding
// not counted). One step: the next routes from weights that the two paths' gradients
// (other roundings) updated, where a logit within a rounding of a tie may pick another
// expert (2 steps, interleaved gate|up: 245 drops against CUTLASS's 246, H100); deeper
// layers the same.
TEST(GpuBf16DeepGemm, OneMoeLayerDropsWhatCutlasssPathDrops) {
  MOE_REQUIRE_DEEPGEMM();
  ModelConfig config = test::small_moe_model(1.0);
  config.n_layers = 1;
  config.first_dense_layers = 0;
  Mode cutlass = kBf16;
  cutlass.overwrite_grads = true;
  const test::PrecisionRun a = run(padded(true), 1, config), b = run(cutlass, 1, config);
  EXPECT_GT(b.dropped, 0) << "nothing dropped, the capacity untested";
  EXPECT_EQ(a.dropped, b.dropped) << "the kept rows counted the padding";
}

// Dropless and with capacity, fp32 and bf16 expert gradients (bf16: the first micro-batch's
// weight gradients on DeepGEMM's kernel): losses within 1e-3, gradients within 1% (measured:
// printed), and not the same bits (DeepGEMM ran).
TEST(GpuBf16DeepGemm, TracksCutlasssPathWithinSummationOrder) {
  MOE_REQUIRE_DEEPGEMM();
  for (const double capacity : {0.0, 1.0})
    for (const bool bf16_grads : {false, true}) {
      const ModelConfig config = test::small_moe_model(capacity);
      Mode cutlass = kBf16;
      cutlass.bf16_grads = bf16_grads;
      cutlass.overwrite_grads = true;
      const test::PrecisionRun a = run(padded(bf16_grads), 2, config), b = run(cutlass, 2, config);
      const std::string what = std::string(capacity > 0 ? "capacity 1" : "dropless") +
                               (bf16_grads ? ", bf16 expert gradients" : ", fp32 expert gradients");
      if (capacity > 0) EXPECT_GT(b.dropped, 0) << what << ": nothing dropped, the capacity untested";
      ASSERT_EQ(a.losses.size(), b.losses.size());
      for (size_t i = 0; i < a.losses.size(); ++i) {
        ASSERT_TRUE(std::isfinite(a.losses[i])) << what;
        EXPECT_NEAR(a.losses[i], b.losses[i], 1e-3 * b.losses[i]) << what << ", step " << i;
      }
      const double experts = relative_distance(a, b, Part::Experts), others = relative_distance(a, b, Part::Others);
      std::printf("  %s: gradients from CUTLASS's path: experts %.5f, the others %.5f\n", what.c_str(), experts,
                  others);
      EXPECT_GT(experts, 0.0) << what << ": DeepGEMM's kernels did not run";
      EXPECT_LT(experts, 0.01) << what;
      EXPECT_LT(others, 0.01) << what;
    }
}

TEST(GpuBf16DeepGemm, RerunsAndRecomputationAndGraphsAreBitIdentical) {
  MOE_REQUIRE_DEEPGEMM();
  for (const bool bf16_grads : {false, true}) {
    const Mode base = padded(bf16_grads);
    const test::PrecisionRun first = run(base, 2), again = run(base, 2);
    EXPECT_EQ(again.losses, first.losses);
    EXPECT_TRUE(again.grads == first.grads) << "a padded rerun's gradients differ";
    Mode experts_recomputed = base, swiglu_recomputed = base, graphs = base;
    experts_recomputed.recompute = ExpertRecompute::All;
    swiglu_recomputed.recompute = ExpertRecompute::Swiglu;
    graphs.graphs = true;
    for (const auto& [mode, name] : {std::pair{experts_recomputed, "recompute_experts = all"},
                                     std::pair{swiglu_recomputed, "recompute_experts = swiglu"},
                                     std::pair{graphs, "CUDA graphs"}}) {
      const test::PrecisionRun other = run(mode, 2);
      EXPECT_EQ(other.losses, first.losses) << name << (bf16_grads ? ", bf16 expert gradients" : "");
      EXPECT_TRUE(other.grads == first.grads) << name << " changes the padded path's gradients";
    }
  }
}

// training.interleave_gate_up: gate|up as one GEMM each way over the interleaved weights.
// The forward's bits are the two launches' (each output's sum over K is the same), so the
// first step's losses are equal; dx is rounded once instead of twice, so the gradients and
// later losses differ within that rounding (step 2: 1.01e-3 relative, gradients 0.75%, on an
// H100; DeepGEMM's and CUTLASS's paths differ as much); reruns are bit-identical. The small model's
// expert slice (128 x 128) is a multiple of the AdamW chunk, so the interleave applies.
TEST(GpuBf16DeepGemm, InterleavedGateUpKeepsTheForwardAndTracksTheSeparateLayout) {
  MOE_REQUIRE_DEEPGEMM();
  const ModelConfig config = test::small_moe_model(0.0);
  ASSERT_EQ(config.moe.expert_hidden * config.dim % adamw_math::kNormChunk, 0) << "the interleave would not apply";
  for (const bool bf16_grads : {false, true}) {
    const std::string what = bf16_grads ? "bf16 expert gradients" : "fp32 expert gradients";
    const test::PrecisionRun joined = run(padded(bf16_grads), 3), separate = run(padded(bf16_grads, false), 3);
    ASSERT_EQ(joined.losses.size(), separate.losses.size());
    EXPECT_EQ(joined.losses[0], separate.losses[0]) << what << ": the interleaved forward changed the bits";
    for (size_t i = 1; i < joined.losses.size(); ++i)
      EXPECT_NEAR(joined.losses[i], separate.losses[i], 3e-3 * separate.losses[i]) << what << ", step " << i;
    const double distance = relative_distance(joined, separate);
    std::printf("  %s: gradients of the joined data gradient from the two launches': %.6f\n", what.c_str(), distance);
    EXPECT_GT(distance, 0.0) << what << ": the joined launch did not run";
    EXPECT_LT(distance, 0.01) << what;
    const test::PrecisionRun again = run(padded(bf16_grads), 3);
    EXPECT_EQ(again.losses, joined.losses) << what;
    EXPECT_TRUE(again.grads == joined.grads) << what << ": an interleaved rerun's gradients differ";
  }
}

// training.swiglu_in_gemm: act from the gate|up GEMM's epilogue has swiglu_forward's bits and
// d gate|up (and a refilled act) from the down data gradient's has swiglu_backward's, so every
// loss and gradient is the separate passes', with the experts' rows kept or recomputed
// (SwiGLU's backward refilling act, or the whole gate|up GEMM again).
TEST(GpuBf16DeepGemm, SwigluInTheGemmKeepsEveryBit) {
  MOE_REQUIRE_DEEPGEMM();
  const ModelConfig config = test::small_moe_model(0.0);
  ASSERT_EQ(config.moe.expert_hidden % cuda::PaddedExpertGemmBf16::kSwigluColumns, 0) << "the fusion would not apply";
  for (const ExpertRecompute recompute : {ExpertRecompute::None, ExpertRecompute::Swiglu, ExpertRecompute::All}) {
    Mode fused = padded(true), separate = padded(true, true, false);
    fused.recompute = separate.recompute = recompute;
    const std::string what = "recompute_experts " + std::to_string(static_cast<int>(recompute));
    const test::PrecisionRun a = run(fused, 3), b = run(separate, 3);
    EXPECT_EQ(a.losses, b.losses) << what;
    EXPECT_TRUE(a.grads == b.grads) << what << ": the gradients differ";
  }
}

TEST(GpuBf16DeepGemm, TrainingLossFallsLikeCutlasss) {
  MOE_REQUIRE_DEEPGEMM();
  const int steps = 30;
  Mode cutlass = kBf16;
  cutlass.bf16_grads = cutlass.overwrite_grads = true;
  const test::PrecisionRun a = run(padded(true), steps), b = run(cutlass, steps);
  std::printf("  loss after %d steps (first %.3f): DeepGEMM %.3f, CUTLASS %.3f\n", steps, b.losses.front(),
              a.losses.back(), b.losses.back());
  for (double loss : a.losses) ASSERT_TRUE(std::isfinite(loss));
  EXPECT_LT(a.losses.back(), 0.8 * a.losses.front()) << "the padded path did not learn";
  EXPECT_NEAR(a.losses.back(), b.losses.back(), 0.02 * b.losses.front());
}

}  // namespace
}  // namespace moe

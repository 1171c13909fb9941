// The memory planner (train/memory_plan.h): known answers for the state of small models,
// activations linear in the micro-batch, EP and ZeRO dividing what they should, the
// refusal's one line, and the estimate against the bench models' measured peaks and the
// ZeRO state measured on one H200.
#include "train/memory_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "config/run_config.h"
#include "core/error.h"
#include "core/rng.h"
#include "expect_error.h"
#include "memory_plan_test_config.h"
#include "kernels/fp8_blockwise.h"
#include "model/gpu_buffer_sizes.h"
#include "model/transformer.h"

namespace moe {
namespace {

constexpr int64_t kChunk = int64_t{2} << 20;  // ResidentBlock's 2 MiB

std::filesystem::path source_dir() {
  if (const char* dir = std::getenv("MOE_SOURCE_DIR"); dir && *dir) return dir;
  return MOE_TEST_SOURCE_DIR;
}

int64_t chunks(int64_t bytes) { return (bytes + kChunk - 1) / kChunk; }

// 2 layers, dim 512 (4 heads of 128, 2 KV heads), 8 experts of 1024 top-2, vocab 1024.
using test::small_config;

// By hand: embedding and head 1024 x 512 each; per layer two norms (512), wq and wo
// 512 x 512, wk and wv 256 x 512, the router 8 x 512 and its bias 8 (padded to 16), the
// experts 3 x 8 x 1024 x 512; the final norm 512. Every other tensor is a multiple of 16.
constexpr int64_t kExperts = 3 * 8 * 1024 * 512;
constexpr int64_t kLayer = 2 * 512 + 2 * 512 * 512 + 2 * 256 * 512 + 8 * 512 + 16 + kExperts;
constexpr int64_t kStorage = 2 * 1024 * 512 + 512 + 2 * kLayer;

TEST(MemoryPlan, ParameterSpecsAreTheModelsLayout) {
  for (bool tied : {false, true}) {
    RunConfig c = small_config();
    c.model.tie_embeddings = tied;
    c.model.first_dense_layers = 1;
    c.model.moe.n_shared_experts = 1;
    const Transformer<float> model(c.model, 1);
    const ParameterStore<float> specs = Transformer<float>::parameter_specs(c.model);
    ASSERT_EQ(specs.size(), model.params().size());
    const std::vector<int64_t> offsets = specs.planned_offsets();
    EXPECT_EQ(offsets.back(), model.params().storage_numel());
    for (int id = 0; id < specs.size(); ++id) {
      EXPECT_EQ(specs.spec(id).name, model.params().spec(id).name);
      EXPECT_EQ(offsets[static_cast<size_t>(id)], model.params().offset(id)) << specs.spec(id).name;
    }
  }
  EXPECT_EQ(Transformer<float>::parameter_specs(small_config().model).planned_offsets().back(), kStorage);
}

// The GPU model's fused q|k|v projection (model/cuda/gpu_attention.cpp) reads each
// layer's wq, wk, wv as one [(H + 2G) d, D] matrix: the layout must put them back to back
// (no padding between) in every shipped model, as it does in the small one.
TEST(MemoryPlan, AttentionProjectionsLieBackToBackInEveryShippedModel) {
  std::vector<ModelConfig> models = {small_config().model};
  for (const auto& entry : std::filesystem::recursive_directory_iterator(source_dir() / "configs"))
    if (entry.path().extension() == ".toml" && entry.path().parent_path().filename() != "hardware")
      models.push_back(load_config(entry.path().string()).model);
  ASSERT_GE(models.size(), 6u);
  for (ModelConfig& m : models) {
    if (m.vocab_size == 0) m.vocab_size = 32000;  // configs that take it from the tokenizer
    const ParameterStore<float> specs = Transformer<float>::parameter_specs(m);
    const std::vector<int64_t> offsets = specs.planned_offsets();
    for (int64_t l = 0; l < m.n_layers; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".attn.";
      const int q = specs.find(p + "wq"), k = specs.find(p + "wk"), v = specs.find(p + "wv");
      ASSERT_TRUE(q >= 0 && k >= 0 && v >= 0) << p;
      const auto at = [&](int id) { return offsets[static_cast<size_t>(id)]; };
      EXPECT_EQ(at(k), at(q) + specs.numel(q)) << p << " dim " << m.dim;
      EXPECT_EQ(at(v), at(k) + specs.numel(k)) << p << " dim " << m.dim;
    }
  }
}

TEST(MemoryPlan, StateBytesOfOneGpuKnownAnswer) {
  const RunConfig c = small_config();
  const MemoryEstimate e = estimate_memory(c, configured_layout(c, 1, 1));
  EXPECT_EQ(kStorage, 27798048);
  EXPECT_EQ(e.weights, chunks(kStorage * 2) * kChunk);  // 27 chunks
  EXPECT_EQ(e.weights, 27 * kChunk);
  EXPECT_EQ(e.master_lo, 27 * kChunk);
  EXPECT_EQ(e.gradients, 54 * kChunk);  // 111,192,192 bytes
  EXPECT_EQ(e.moments, 2 * 54 * kChunk);
  EXPECT_EQ(e.fp32_copies, 2 * 16 * 4);  // two router biases
  EXPECT_EQ(e.zero_pools, 0);
  RunConfig bf16 = c;
  bf16.optimizer.state_dtype = MomentDtype::Bf16;
  EXPECT_EQ(estimate_memory(bf16, configured_layout(bf16, 1, 1)).moments, 2 * 27 * kChunk);
  // fp8: a byte a code (whole chunks) and a scale byte per 16 elements, for each moment.
  RunConfig fp8 = c;
  fp8.optimizer.state_dtype = MomentDtype::Fp8;
  EXPECT_EQ(estimate_memory(fp8, configured_layout(fp8, 1, 1)).moments, 2 * 14 * kChunk + 2 * ((kStorage + 15) / 16));
}

// training.expert_grad_dtype = bf16 (one GPU): 2 B per expert weight's gradient, 4 B per
// other one, each block's resident ranges rounded out to whole chunks (at most one chunk
// more per end of each of the five ranges: two expert ones, three others).
TEST(MemoryPlan, Bf16ExpertGradientsHalveTheExpertsGradientBytes) {
  RunConfig c = small_config();
  const int64_t fp32 = estimate_memory(c, configured_layout(c, 1, 1)).gradients;
  c.training.expert_grad_dtype = GradDtype::Bf16;
  const MemoryEstimate e = estimate_memory(c, configured_layout(c, 1, 1));
  const int64_t exact = (kStorage - 2 * kExperts) * 4 + 2 * kExperts * 2;
  EXPECT_GE(e.gradients, exact);
  EXPECT_LE(e.gradients, exact + 10 * kChunk);
  EXPECT_LT(e.gradients, fp32 - 2 * kExperts * 2 + 10 * kChunk);
  EXPECT_EQ(e.weights, 27 * kChunk);  // nothing else changes
  EXPECT_EQ(e.moments, 2 * 54 * kChunk);
  // Over several GPUs the key is refused at launch; the estimate stays the fp32 one there.
  EXPECT_EQ(estimate_memory(c, configured_layout(c, 2, 2)).gradients,
            estimate_memory(small_config(), configured_layout(small_config(), 2, 2)).gradients);
}

// training.precision = fp8: per MoE layer the local experts' quantised weights (w1, w3,
// w2 as stored and transposed: 1 B codes per element, fp32 scales per 128 x 128 block,
// each copy's padded to 16 bytes), or without the cache scratch for two tensors.
TEST(MemoryPlan, Fp8ExpertWeightsKnownAnswer) {
  RunConfig c = small_config();
  const MemoryEstimate bf16 = estimate_memory(c, configured_layout(c, 1, 1));
  EXPECT_EQ(bf16.fp8_weights, 0);
  c.training.precision = TrainingPrecision::Fp8;
  const MemoryEstimate cached = estimate_memory(c, configured_layout(c, 1, 1));
  // 8 experts of 1024 x 512: 4 x 8 blocks each, 256 scales per copy (a multiple of 4).
  constexpr int64_t kLayerCache = 6 * 8 * 1024 * 512 + 6 * 256 * 4;
  EXPECT_EQ(cached.fp8_weights, 2 * kLayerCache);
  c.training.fp8_weight_cache = false;
  const MemoryEstimate per_use = estimate_memory(c, configured_layout(c, 1, 1));
  EXPECT_EQ(per_use.fp8_weights, 0);
  EXPECT_EQ(per_use.step_buffers - cached.step_buffers, 2 * 8 * 1024 * 512 + 2 * 256 * 4);
  // Scale padding: 3 experts of 1024 x 512 hold 96 scales a copy; 1 expert of 640 x 256, 10 -> 12.
  EXPECT_EQ(fp8_expert_weight_sizes(3, 512, 1024).scales_per_copy, 96);
  EXPECT_EQ(fp8_expert_weight_sizes(1, 256, 640).scales_per_copy, 12);
  EXPECT_EQ(fp8_expert_weight_sizes(1, 256, 640).bytes(), 6 * (256 * 640 + 12 * 4));
}

TEST(MemoryPlan, ActivationsScaleLinearlyInTheMicroBatch) {
  const RunConfig c = small_config();
  MemoryLayout one = configured_layout(c, 1, 1), two = one;
  one.micro_batch = 1;
  two.micro_batch = 2;
  const MemoryEstimate a = estimate_memory(c, one), b = estimate_memory(c, two);
  ASSERT_EQ(a.layer_activations.size(), 2u);
  // Only the per-expert counts and offsets (3E + 1 int32) do not grow with the tokens.
  for (size_t l = 0; l < 2; ++l) EXPECT_EQ(2 * a.layer_activations[l] - b.layer_activations[l], (3 * 8 + 1) * 4);
  EXPECT_EQ(a.weights + a.moments, b.weights + b.moments);
  // One layer by hand at micro-batch 1 (T = 256, R = T * K = 512 rows): 4 x [T, D] bf16
  // (x, n1, h, n2; no ffn_out: the next norm sums the experts' rows), rstd1/2, q/out [T, 512], k/v [T, 256], stats [H, S] fp32;
  // logits and scores [T, E] fp32, weights [T, K], aux and z [T], four [T, K] int32,
  // counts/assign_counts/offsets, the row-rank scratch (T K + E x 2 tiles), expert rows
  // x [R, D], gate|up [R, 2F], act [R, F], y [R, D].
  const int64_t T = 256, D = 512, E = 8, K = 2, F = 1024, R = T * K;
  const int64_t by_hand = 4 * T * D * 2 + 2 * T * 4 + 2 * T * 512 * 2 + 2 * T * 256 * 2 + 4 * 256 * 4 +
                          2 * T * E * 4 + T * K * 4 + 2 * T * 4 + 4 * T * K * 4 + (3 * E + 1) * 4 +
                          (T * K + E * 2) * 4 + R * D * 2 + R * 2 * F * 2 + R * F * 2 + R * D * 2;
  EXPECT_EQ(a.layer_activations[0], by_hand);
  // A shared expert adds into ffn_out, which the layer then stores ([T, D]), beside the
  // shared expert's gate|up [T, 2F] and act [T, F].
  RunConfig shared = c;
  shared.model.moe.n_shared_experts = 1;
  const MemoryEstimate s = estimate_memory(shared, one);
  EXPECT_EQ(s.layer_activations[0], by_hand + T * D * 2 + (T * 2 * F + T * F) * 2);
}

// dlogits_head, the MoE backward's row gradients and cuDNN's attention workspace share one
// allocation (model/gpu_buffer_sizes.h): the plan counts the largest of the three, and
// the deterministic attention's dP moves the shared scratch, not the workspace.
TEST(MemoryPlan, SharedScratchIsTheLargestOfItsThreeUses) {
  RunConfig c = small_config();  // micro-batch 4: T = 1024 tokens, R = 2048 rows
  const int64_t T = 1024, V = 1024, D = 512, F = 1024, R = 2048;
  const SharedScratchSizes sizes = shared_scratch_sizes(T, V, D, F, R, R);
  EXPECT_EQ(sizes.dlogits_head, T * V);
  EXPECT_EQ(sizes.dact_at, R * D * 2);
  EXPECT_EQ(sizes.dgate_up_at, R * D * 2 + R * F * 2);
  EXPECT_EQ(sizes.dx_at, R * D * 2 + R * F * 2 + R * 2 * F * 2);
  EXPECT_EQ(sizes.rows_end, 2 * R * D * 2 + 3 * R * F * 2);
  EXPECT_EQ(sizes.bytes(), sizes.rows_end);  // 16 MB of row gradients against 2 MB of dlogits
  // cudnn-frontend's sizes: dP over sequences padded to 64 and fp32 softmax sums; without
  // the deterministic dP decomposition, past 256 MB of dP, an fp32 dQ accumulator instead,
  // which the ordered deterministic backward always takes.
  using enum AttentionDq;
  EXPECT_EQ(attention_workspace_estimate(4, 4, 250, 128, Workspace), 4 * 4 * 256 * 256 * 2 + 4 * 4 * 250 * 4);
  EXPECT_EQ(attention_workspace_estimate(4, 4, 250, 128, Atomic), 4 * 4 * 256 * 256 * 2 + 4 * 4 * 250 * 4);
  EXPECT_EQ(attention_workspace_estimate(4, 4, 250, 128, Ordered), 4 * 4 * 250 * 128 * 4 + 4 * 4 * 250 * 4);
  EXPECT_EQ(attention_workspace_estimate(8, 16, 4096, 64, Workspace),
            8 * 16 * int64_t{4096} * 4096 * 2 + 8 * 16 * 4096 * 4);
  EXPECT_EQ(attention_workspace_estimate(8, 16, 4096, 64, Atomic), 8 * 16 * 4096 * 64 * 4 + 8 * 16 * 4096 * 4);
  EXPECT_EQ(attention_workspace_estimate(8, 16, 4096, 64, Ordered), 8 * 16 * 4096 * 64 * 4 + 8 * 16 * 4096 * 4);
  // In 4 query chunks (training.attention_query_chunks): the last chunk's 1,024 queries
  // against all 4,096 keys, our dK | dV scratch and packed stats, cuDNN's fp32 dK, dV.
  const int64_t chunk_dp = 8 * 16 * int64_t{1024} * 4096 * 2, chunk_sums = 8 * 16 * 1024 * 4;
  const int64_t chunk_scratch = 8 * 4096 * 2 * 16 * 64 * 2 + chunk_sums + 2 * 8 * 16 * 4096 * 64 * 4;
  EXPECT_EQ(attention_workspace_estimate(8, 16, 4096, 64, Workspace, 4, 16), chunk_scratch + chunk_dp + chunk_sums);
  EXPECT_LT(attention_workspace_estimate(8, 16, 4096, 64, Workspace, 4, 16),
            attention_workspace_estimate(8, 16, 4096, 64, Workspace) / 2);
  EXPECT_EQ(attention_workspace_estimate(8, 16, 4096, 64, Workspace, 1, 16),
            attention_workspace_estimate(8, 16, 4096, 64, Workspace));
  const MemoryLayout layout = configured_layout(c, 1, 1);
  MemoryEstimate a = estimate_memory(c, layout);
  EXPECT_EQ(a.shared_scratch, sizes.rows_end);
  // Sequences of 4096: the deterministic dP of 4 x 4 x 4096^2 bf16 (537 MB) is now the
  // largest; the other algorithm's dQ accumulator (34 MB) is below the row gradients (268 MB).
  c.model.seq_len = 4096;
  c.training.global_batch_tokens = 4 * 4096 * 8;
  c.training.deterministic = true;
  const MemoryEstimate det = estimate_memory(c, configured_layout(c, 1, 1));
  c.training.deterministic_attention = DeterministicAttention::Ordered;
  const MemoryEstimate ordered = estimate_memory(c, configured_layout(c, 1, 1));
  c.training.deterministic_attention = DeterministicAttention::Workspace;
  c.training.deterministic = false;
  const MemoryEstimate fast = estimate_memory(c, configured_layout(c, 1, 1));
  EXPECT_EQ(det.shared_scratch, attention_workspace_estimate(4, 4, 4096, 128, Workspace));
  EXPECT_EQ(ordered.total(), fast.total());  // both take the dQ accumulator, below the row gradients
  EXPECT_EQ(det.workspace, fast.workspace);
  EXPECT_EQ(fast.shared_scratch, shared_scratch_sizes(4 * 4096, V, D, F, 4 * 4096 * 2, 4 * 4096 * 2).bytes());
  EXPECT_EQ(det.total() - fast.total(), det.shared_scratch - fast.shared_scratch);
}

// With SwiGLU's backward inside the down data gradient (training.swiglu_in_gemm over
// DeepGEMM's bf16 GEMMs, gate|up interleaved), no d act rows: the shared scratch loses
// exactly [local rows, F] bf16 where the row gradients are its largest use; F off the fused
// kernels' 128-column tiles (the interleave still applies) keeps them.
TEST(MemoryPlan, SwigluInTheGemmPlansNoDactRows) {
  for (const int64_t F : {int64_t{1024}, int64_t{960}}) {
    RunConfig c = small_config();
    c.model.moe.expert_hidden = F;
    c.training.bf16_gemm_backend = GemmBackend::DeepGemm;
    ASSERT_TRUE(interleaves_gate_up(c.training));
    const MemoryEstimate fused = estimate_memory(c, configured_layout(c, 1, 1));
    c.training.swiglu_in_gemm = false;
    const MemoryEstimate separate = estimate_memory(c, configured_layout(c, 1, 1));
    const int64_t rows = expert_row_bounds(c.model.moe, 4 * 256, 1, false, 0, 128).max_local_rows;
    const SharedScratchSizes sizes = shared_scratch_sizes(4 * 256, 1024, 512, F, rows, rows);
    ASSERT_EQ(separate.shared_scratch, sizes.rows_end) << "F " << F << ": the row gradients are the largest use";
    EXPECT_EQ(separate.shared_scratch - fused.shared_scratch, F % 128 == 0 ? rows * F * 2 : 0) << "F " << F;
    EXPECT_EQ(separate.total() - fused.total(), separate.shared_scratch - fused.shared_scratch) << "F " << F;
    EXPECT_EQ(shared_scratch_sizes(4 * 256, 1024, 512, F, rows, rows, false).dact, 0);
  }
}

TEST(MemoryPlan, RecomputedLayersKeepTheirInputAndShareOneSet) {
  RunConfig c = small_config();
  const MemoryEstimate kept = estimate_memory(c, configured_layout(c, 1, 1));
  c.training.recompute_layers = -1;
  const MemoryEstimate recomputed = estimate_memory(c, configured_layout(c, 1, 1));
  const int64_t input = 4 * 256 * 512 * 2;
  for (int64_t bytes : recomputed.layer_activations) EXPECT_EQ(bytes, input);
  EXPECT_EQ(recomputed.recompute_set, kept.layer_activations[0] - input);
  EXPECT_EQ(recomputed.activations(), 2 * input + kept.layer_activations[0] - input);
}

// recompute_experts_layers: the first N MoE layers share the expert rows, the later keep
// their own; the shared buffers exist only while some layer uses them.
TEST(MemoryPlan, ExpertRowsSharedByTheFirstMoELayersOnly) {
  RunConfig c = small_config();  // two MoE layers, micro-batch 4: R = 2,048 rows
  const MemoryEstimate none = estimate_memory(c, configured_layout(c, 1, 1));
  c.training.recompute_experts = ExpertRecompute::Swiglu;
  const MemoryEstimate all = estimate_memory(c, configured_layout(c, 1, 1));
  const int64_t R = 4 * 256 * 2, D = 512, F = 1024, shared_rows = R * D * 2 + R * F * 2;  // x and act rows
  EXPECT_EQ(all.recompute_set, shared_rows);
  for (size_t l = 0; l < 2; ++l) EXPECT_EQ(none.layer_activations[l] - all.layer_activations[l], shared_rows);
  // Everything recomputed: gate|up's rows [R, 2F] are shared too.
  RunConfig every_config = c;
  every_config.training.recompute_experts = ExpertRecompute::All;
  const MemoryEstimate every = estimate_memory(every_config, configured_layout(every_config, 1, 1));
  const int64_t every_rows = shared_rows + R * 2 * F * 2;
  EXPECT_EQ(every.recompute_set, every_rows);
  for (size_t l = 0; l < 2; ++l) EXPECT_EQ(none.layer_activations[l] - every.layer_activations[l], every_rows);
  c.training.recompute_experts_layers = 1;
  const MemoryEstimate first = estimate_memory(c, configured_layout(c, 1, 1));
  EXPECT_EQ(first.layer_activations[0], all.layer_activations[0]);
  EXPECT_EQ(first.layer_activations[1], none.layer_activations[1]);
  EXPECT_EQ(first.recompute_set, shared_rows);
  EXPECT_EQ(first.total(), all.total() + shared_rows);
  c.training.recompute_experts_layers = 0;  // nothing shares them: no shared buffers
  const MemoryEstimate zero = estimate_memory(c, configured_layout(c, 1, 1));
  EXPECT_EQ(zero.total(), none.total());
  EXPECT_EQ(zero.recompute_set, 0);
  // Layers recomputed whole share one set, whose expert rows are the shared ones.
  c.training.recompute_layers = 1;
  const MemoryEstimate whole_first = estimate_memory(c, configured_layout(c, 1, 1));
  EXPECT_EQ(whole_first.layer_activations[1], none.layer_activations[1]);
  EXPECT_EQ(whole_first.recompute_set, all.layer_activations[0] - 4 * 256 * 512 * 2 + shared_rows);
}

TEST(MemoryPlan, ExpertParallelismHalvesTheExpertState) {
  RunConfig c = small_config();
  c.model.moe.expert_hidden = 4096;  // each rank's half of an expert tensor: 8 Mi elements
  MemoryLayout ep1 = configured_layout(c, 2, 2), ep2 = ep1;
  ep2.expert_parallel = 2;
  const MemoryEstimate a = estimate_memory(c, ep1), b = estimate_memory(c, ep2);
  // The other rank's 4 experts of each of the 6 expert tensors hold no memory: half of
  // the experts' 3 x 8 x 4096 x 512 x 2 layers, less at most the two chunks each of the 6
  // holes' edges round to.
  const int64_t freed = 3 * 8 * 4096 * 512 * 2 / 2;
  for (auto [whole, half, elem] : {std::tuple{a.weights, b.weights, 2}, std::tuple{a.gradients, b.gradients, 4}}) {
    EXPECT_GE(whole - half, freed * elem - 12 * kChunk);
    EXPECT_LE(whole - half, freed * elem + kChunk);
    EXPECT_GT(whole - half, freed * elem * 3 / 4);
  }
  EXPECT_EQ(a.moments - b.moments, 2 * (a.gradients - b.gradients));
  EXPECT_EQ(a.master_lo, a.weights);
  EXPECT_EQ(b.master_lo, b.weights);
  // Split experts (parallel.split_experts): each rank holds half of every expert's hidden
  // rows instead of half of the experts: as much freed, less the chunks each of the 6 expert
  // tensors' two windows (a rank's and the hinge it shares) round up to; the plan takes the
  // larger rank's.
  c.parallel.expert_parallel = 2;
  c.parallel.split_experts = true;
  const MemoryEstimate split = estimate_memory(c, ep2);
  for (auto [whole, ep_half, split_half, elem] : {std::tuple{a.weights, b.weights, split.weights, 2},
                                                  std::tuple{a.gradients, b.gradients, split.gradients, 4}}) {
    EXPECT_GE(split_half, ep_half) << "elem " << elem;
    EXPECT_LE(split_half - ep_half, 12 * kChunk * elem / 2) << "elem " << elem;
    EXPECT_GT(whole - split_half, freed * elem / 2) << "elem " << elem;
  }
  EXPECT_EQ(split.master_lo, split.weights);
}

TEST(MemoryPlan, ZeroLevelsKeepWhatTheGpuAllocates) {
  const RunConfig c = small_config();
  MemoryLayout layout = configured_layout(c, 4, 4);
  std::vector<MemoryEstimate> by_level;
  for (int64_t zero = 0; zero <= 3; ++zero) {
    layout.zero = zero;
    by_level.push_back(estimate_memory(c, layout));
  }
  const MemoryEstimate &z0 = by_level[0], &z1 = by_level[1], &z2 = by_level[2], &z3 = by_level[3];
  // ZeRO-1 over 4: every span between the router biases is whole 64-element units (the
  // embedding and the head 1024 x 512 + 512, a layer's attention and router 791,552, its
  // experts 12,582,912), so a rank steps a quarter of each plus both biases whole (16
  // each, padded): (kStorage - 32) / 4 + 32 elements, each piece on a multiple of 16, so
  // packed without padding.
  const int64_t stepped = (kStorage - 32) / 4 + 32;
  EXPECT_EQ(stepped, 6949536);
  EXPECT_EQ(z1.weights, z0.weights);
  EXPECT_EQ(z1.gradients, z0.gradients);
  EXPECT_EQ(z1.master_lo, chunks(stepped * 2) * kChunk);  // packed into blocks of whole chunks
  EXPECT_EQ(z1.moments, 2 * chunks(stepped * 4) * kChunk);
  EXPECT_EQ(z1.zero_pools, 0);
  // ZeRO-2, rank 0 (rank 3 holds as much: 23 own chunks, 31 shared). fp32 chunks of
  // 524,288 elements: the embedding 0, layer 0 (stage 2) 1-26, layer 1 (stage 1) 26-52,
  // the head 52-53. Own: 0 and 52-53 (the first and last stage), 26 (both layers' edge),
  // and the chunks of rank 0's pieces: the first quarter of each 6,249,984-element bucket
  // (a layer's attention and router: 1 bucket; its experts: 2 full and one of 82,944)
  // and the router biases: layer 0 1-5, 14-17, 26; layer 1 26, 28-30, 39-42, 51 = 21.
  // The pools: layer 0's 26 chunks less its 10 own (pool 0: 16), layer 1's 27 less 10
  // (pool 1: 17). Two layers: the pools hold as much as sharding frees.
  EXPECT_EQ(z2.weights, z0.weights);
  EXPECT_EQ(z2.master_lo, z1.master_lo);
  EXPECT_EQ(z2.moments, z1.moments);
  EXPECT_EQ(z2.gradients, 21 * kChunk);
  EXPECT_EQ(z2.zero_pools, (16 + 17) * kChunk);
  // ZeRO-3 adds the bf16 weights' (chunks of 1,048,576 elements; 27): the embedding 0,
  // layer 0 0-13, layer 1 13-26, the head 26. Own: 0, 26, 13 and rank 0's pieces' 1-2,
  // 7-8, 14-15, 19-21, 25 = 13; pools: layer 0's 14 less 6 own (8), layer 1's 14 less 8 (6).
  EXPECT_EQ(z3.gradients, z2.gradients);
  EXPECT_EQ(z3.weights, 13 * kChunk);
  EXPECT_EQ(z3.zero_pools, z2.zero_pools + (8 + 6) * kChunk);
  // One GPU has no group to divide over.
  MemoryLayout alone = configured_layout(c, 1, 1);
  alone.zero = 3;
  EXPECT_EQ(estimate_memory(c, alone).total(), estimate_memory(c, configured_layout(c, 1, 1)).total());
}

// bench/zero_memory.sh on one H200 (2026-12-02, commit 0776e6e): the model of 0.4134 B
// parameters data parallel over N thread ranks, rank 0's "device state" line
// (GpuParameterStore::device_bytes: weights, lo halves, gradients, moments, the router
// biases' fp32 copies, the ZeRO pools), in GB; vocabulary 4,096 (the bench's tokenizer).
// The estimate (the larger of rank 0 and the last rank) within 2% of each.
TEST(MemoryPlan, ZeroStateWithinTwoPercentOfTheMeasured) {
  const RunConfig c = load_config(
      (source_dir() / "configs/default.toml").string(),
      {"model.vocab_size=4096", "model.dim=512", "model.n_heads=8", "model.n_kv_heads=4", "model.n_layers=8",
       "model.seq_len=512", "moe.n_experts=64", "moe.expert_hidden=512", "training.micro_batch=1",
       "training.cuda_graphs=false"});
  const auto state_gb = [&](int64_t gpus, int64_t zero) {
    MemoryLayout layout = configured_layout(c, gpus, gpus);
    layout.zero = zero;
    const MemoryEstimate e = estimate_memory(c, layout);
    return static_cast<double>(e.weights + e.master_lo + e.gradients + e.moments + e.fp32_copies + e.zero_pools) / 1e9;
  };
  EXPECT_NEAR(state_gb(1, 0), 6.621, 0.02 * 6.621);
  const double measured[3][3] = {{4.550, 3.517, 3.000}, {4.053, 2.718, 2.050}, {3.854, 2.372, 1.637}};
  for (int64_t zero = 1; zero <= 3; ++zero)
    for (int i = 0; i < 3; ++i) {
      const int64_t gpus = int64_t{2} << i;
      const double want = measured[zero - 1][i];
      EXPECT_NEAR(state_gb(gpus, zero), want, 0.02 * want) << "ZeRO " << zero << " over " << gpus;
      EXPECT_NEAR(state_gb(gpus, 0), 6.621, 0.02 * 6.621) << "ZeRO 0 over " << gpus;
    }
}

TEST(MemoryPlan, ExpertRowBoundsKnownAnswers) {
  MoEConfig moe;
  moe.n_experts = 128;
  moe.top_k = 2;
  moe.capacity_factor = 1.25;
  // T = 4096: capacity ceil(1.25 x 8192 / 128) = 80 rows per expert and source.
  const ExpertRowBounds one = expert_row_bounds(moe, 4096, 1, false, 0);
  EXPECT_EQ(one.capacity, 80);
  EXPECT_EQ(one.max_rows, 8192);
  EXPECT_EQ(one.max_local_rows, 8192);
  const ExpertRowBounds ep = expert_row_bounds(moe, 4096, 128, false, 0);
  EXPECT_EQ(ep.max_local_experts, 1);
  EXPECT_EQ(ep.max_tokens, 128 * 4096);
  EXPECT_EQ(ep.max_local_rows, 128 * 80);
  EXPECT_EQ(expert_row_bounds(moe, 4096, 128, true, 0).max_local_experts, 2);
  moe.capacity_factor = 0;  // dropless: every rank may send all its T x K rows
  EXPECT_EQ(expert_row_bounds(moe, 4096, 8, false, 0).max_local_rows, 8 * 8192);
  EXPECT_EQ(lm_head_chunk_rows(16384, 32000), 2048);
  // Rows padded per expert to 128 (training.fp8_gemm_backend = deepgemm): up to 127 more
  // rows per expert, R a multiple of 4; only without expert parallelism.
  moe.n_experts = 6;
  const ExpertRowBounds padded = expert_row_bounds(moe, 4095, 1, false, 0, 128);
  EXPECT_EQ(padded.max_rows, (8190 + 6 * 127 + 3) / 4 * 4);
  EXPECT_EQ(padded.max_local_rows, padded.max_rows);
  EXPECT_THROW(expert_row_bounds(moe, 4096, 2, false, 0, 128), Error);
  TrainingConfig t;
  EXPECT_EQ(expert_row_align(t), 1);
  t.fp8_gemm_backend = GemmBackend::DeepGemm;
  EXPECT_EQ(expert_row_align(t), 1) << "bf16 runs never pad";
  t.precision = TrainingPrecision::Fp8;
  EXPECT_EQ(expert_row_align(t), 128);
}

// ZeRO under expert parallelism: the shared parameters' lo halves and moments over all 4
// GPUs, the experts' over their replicas (EP 2: 2 of them; EP 4: none, stepped whole), each
// rank's whole block of 4 (or 2) experts of the 8 held at level 0. With EP 2 the gradients
// and weights follow at levels 2 and 3 (6 layers: pools of two stages free the others';
// with EP 4 only the shared part of a layer is sharded, a few chunks, too little to free).
// training.precision = fp8's dense projections (model/cuda/projection_gemms.h): which
// GEMMs run in fp8 on the GPU test model (tests/gpu/small_models.h: dim 128, 4 heads of 32,
// 2 KV heads, a dense first layer of 192, one shared expert of 128), and the scratch sized
// for the largest of them, by hand.
TEST(MemoryPlan, Fp8ProjectionsKnownAnswers) {
  ModelConfig m;
  m.dim = 128;
  m.n_layers = 4;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.first_dense_layers = 1;
  m.dense_hidden = 192;
  m.moe.n_experts = 8;
  m.moe.expert_hidden = 128;
  m.moe.n_shared_experts = 1;
  const int64_t T = 128;
  const std::vector<DenseGemmShape> gemms = dense_projection_gemms(m, T);
  ASSERT_EQ(gemms.size(), 12u);
  std::vector<std::string> bf16;
  for (const DenseGemmShape& g : gemms) {
    EXPECT_EQ(g.M, T);
    if (!g.fp8) bf16.push_back(g.name);
  }
  // K = 192 (the dense FFN's hidden) is not whole 128-blocks: its down projection's forward
  // and its gate and up data gradients stay bf16; everything else fits.
  EXPECT_EQ(bf16, (std::vector<std::string>{"dense FFN down forward", "dense FFN gate, up data gradient"}));
  EXPECT_EQ(gemms[0].N, (4 + 2 * 2) * 32);  // q|k|v forward: N = (H + 2G) d
  EXPECT_FALSE(gemms[0].data_gradient);
  EXPECT_TRUE(gemms[1].data_gradient);
  const Fp8ProjectionScratch s = fp8_projection_scratch(m, T);
  EXPECT_EQ(s.row_codes, T * 256);        // the q|k|v data gradient's dy rows, K = 256
  EXPECT_EQ(s.row_scales, T * 2);
  EXPECT_EQ(s.weight_codes, 256 * 128);   // [wq; wk; wv]
  EXPECT_EQ(s.weight_scales, 2);
  EXPECT_EQ(s.bytes(), T * 256 + T * 2 * 4 + 256 * 128 + 2 * 4);
  EXPECT_EQ(describe_fp8_projections(m, T),
            "fp8 dense projections: 10 of 12 GEMMs in fp8; bf16: dense FFN down forward, dense FFN gate, up data "
            "gradient (docs/FP8.md, the fallback rule)");
  // T not a multiple of 4: nothing fits, no scratch.
  const Fp8ProjectionScratch none = fp8_projection_scratch(m, 126);
  EXPECT_EQ(none.bytes(), 0);
  for (const DenseGemmShape& g : dense_projection_gemms(m, 126)) EXPECT_FALSE(g.fp8) << g.name;
}

// The estimate counts the fp8 scratch GpuTransformer::plan allocates: the experts' (rows of
// d gate and d up side by side, 2 x 1024 wide, and two weight tensors) and the projections',
// by hand for small_config (T = 1024, dim 512, q|k|v 1024 wide, 8 experts of 1024, dropless
// top-2: 2048 rows).
TEST(MemoryPlan, Fp8CountsTheExpertAndProjectionScratch) {
  RunConfig bf16 = small_config();
  RunConfig fp8 = bf16;
  fp8.training.precision = TrainingPrecision::Fp8;
  fp8.training.device = TrainingDevice::Cuda;
  const MemoryEstimate a = estimate_memory(bf16, configured_layout(bf16, 1, 1));
  const MemoryEstimate b = estimate_memory(fp8, configured_layout(fp8, 1, 1));
  // The experts' rows (their weights in the weight cache, Fp8ExpertWeightsKnownAnswer) and
  // the largest fp8 projection's rows and weight.
  const int64_t expert_rows = 2048 * 2048 + 2048 * 16 * 4;
  const int64_t projections = 1024 * 1024 + 1024 * 8 * 4 + 1024 * 512 + 8 * 4 * 4;
  EXPECT_EQ(fp8_projection_scratch(fp8.model, 1024).bytes(), projections);
  EXPECT_EQ(b.step_buffers - a.step_buffers, expert_rows + projections);
  // Without the cache: two local expert weight tensors' codes and scales too.
  fp8.training.fp8_weight_cache = false;
  const MemoryEstimate c = estimate_memory(fp8, configured_layout(fp8, 1, 1));
  EXPECT_EQ(c.step_buffers - a.step_buffers, expert_rows + 2 * 8 * 512 * 1024 + 2 * 8 * 4 * 8 * 4 + projections);
  // fp8 weight gradients: token columns for 3 x hidden + dim = 3584 features of 2048 rows +
  // 127 per expert (3064 tokens, 24 blocks of 128), a scale per feature and block, and the
  // weight GEMM's workspace.
  fp8.training.fp8_weight_cache = true;
  fp8.training.fp8_weight_gradients = true;
  const MemoryEstimate d = estimate_memory(fp8, configured_layout(fp8, 1, 1));
  EXPECT_EQ(fp8_token_column_sizes(2048, 8, 512, 1024).ld_t, 3072);
  // SwiGLU's bf16 act is never written: no act buffer at all (none a layer, none shared).
  EXPECT_EQ(d.step_buffers - b.step_buffers, 3584 * 3072 + 3584 * 24 * 4);
  ASSERT_EQ(d.layer_activations.size(), b.layer_activations.size());
  for (size_t l = 0; l < d.layer_activations.size(); ++l)
    EXPECT_EQ(b.layer_activations[l] - d.layer_activations[l], 2048 * 1024 * 2) << "layer " << l;
  EXPECT_EQ(d.workspace - b.workspace, 64 << 20);
  // Rows padded per expert to 128 (training.fp8_gemm_backend = deepgemm): 2048 + 8 x 127 =
  // 3064 rows; an MoE layer's token_of_row, x, gate|up, act and y rows and the fp8 row
  // scratch (width 2 x hidden) grow by 1016 rows each.
  fp8.training.fp8_weight_gradients = false;
  fp8.training.fp8_gemm_backend = GemmBackend::DeepGemm;
  const MemoryEstimate e = estimate_memory(fp8, configured_layout(fp8, 1, 1));
  EXPECT_EQ(e.step_buffers - b.step_buffers, 1016 * (2048 + 2048 / 128 * 4));
  ASSERT_EQ(e.layer_activations.size(), b.layer_activations.size());
  int moe_layers = 0;
  for (size_t l = 0; l < e.layer_activations.size(); ++l) {
    const int64_t grown = e.layer_activations[l] - b.layer_activations[l];
    moe_layers += grown > 0;
    EXPECT_TRUE(grown == 0 || grown == 1016 * (4 + 512 * 2 + 2048 * 2 + 1024 * 2 + 512 * 2)) << "layer " << l;
  }
  EXPECT_GT(moe_layers, 0);
}

// The fp8 weight gradients' token-column scratch is sized before the routing: its row
// stride must hold every routing's padded tokens (each expert's rows rounded up to 128).
// Random routings of up to the planned rows over up to the planned experts, empty experts
// and single rows included.
TEST(MemoryPlan, TokenColumnScratchHoldsEveryRoutingsPaddedTokens) {
  CounterRng rng(5, "token columns");
  uint64_t draw = 0;
  for (int trial = 0; trial < 500; ++trial) {
    const int64_t L = 1 + static_cast<int64_t>(rng.bits(draw++)[0] % 64);
    const int64_t RL = 1 + static_cast<int64_t>(rng.bits(draw++)[0] % 5000);
    const Fp8TokenColumnSizes sizes = fp8_token_column_sizes(RL, L, 256, 512);
    ASSERT_EQ(sizes.ld_t % 16, 0);
    // A routing of at most RL rows over E <= L experts.
    const int64_t E = 1 + static_cast<int64_t>(rng.bits(draw++)[0] % static_cast<uint64_t>(L));
    std::vector<int32_t> offsets(static_cast<size_t>(E + 1), 0);
    int64_t left = static_cast<int64_t>(rng.bits(draw++)[0] % static_cast<uint64_t>(RL + 1));
    for (int64_t e = 0; e < E; ++e) {
      const uint64_t pick = rng.bits(draw++)[0] % static_cast<uint64_t>(left + 1);
      const int64_t rows = e + 1 == E ? left : static_cast<int64_t>(pick);
      left -= rows;
      offsets[static_cast<size_t>(e + 1)] = offsets[static_cast<size_t>(e)] + static_cast<int32_t>(rows);
    }
    const std::vector<int64_t> P_E1 = fp8::padded_token_offsets(offsets.data(), E);
    ASSERT_LE(P_E1.back(), sizes.ld_t) << "trial " << trial << ": " << offsets.back() << " rows of " << E
                                       << " experts, room for " << RL << " of " << L;
    ASSERT_EQ(sizes.scales, (3 * 512 + 256) * fp8::blocks(sizes.ld_t));
  }
  // The worst routings: every expert 128 k + 1 rows (127 padding tokens each).
  for (int64_t L = 1; L <= 64; ++L)
    for (int64_t k : {0, 1, 3}) {
      const int64_t RL = L * (128 * k + 1);
      std::vector<int32_t> offsets(static_cast<size_t>(L + 1), 0);
      for (int64_t e = 0; e < L; ++e)
        offsets[static_cast<size_t>(e + 1)] = static_cast<int32_t>((e + 1) * (128 * k + 1));
      const int64_t padded = fp8::padded_token_offsets(offsets.data(), L).back();
      ASSERT_EQ(padded, L * 128 * (k + 1));
      ASSERT_LE(padded, fp8_token_column_sizes(RL, L, 256, 512).ld_t) << L << " experts of " << 128 * k + 1 << " rows";
    }
}

// The expert-parallel dispatcher's extra scratch (GpuExpertParallelDispatcher::plan):
// fp8 wire rows both ways under parallel.a2a_compression, and moe.speculative_dispatch's
// early rows out and in and corrections in (rows of the wider format) with their index
// arrays. EP 2: T = 4 x 256 tokens per rank, U = 2 T rows each way, D = 512.
TEST(MemoryPlan, ExchangeCountsFp8RowsAndSpeculation) {
  RunConfig c = small_config();
  c.parallel.expert_parallel = 2;
  MemoryLayout layout = configured_layout(c, 2, 2);
  layout.expert_parallel = 2;
  const int64_t T = 4 * 256, P = 2, U = P * T, D = 512, fp8_row = 4 + D;
  const MemoryEstimate exact = estimate_memory(c, layout);
  c.parallel.a2a_compression = A2aCompression::Fp8;
  const MemoryEstimate fp8 = estimate_memory(c, layout);
  EXPECT_EQ(fp8.exchange - exact.exchange, 2 * U * fp8_row);
  c.parallel.a2a_compression = A2aCompression::None;
  c.model.moe.route_cache = true;
  c.model.moe.speculative_dispatch = true;
  const MemoryEstimate spec = estimate_memory(c, layout);
  const int64_t indices = (2 * T * P + 4 * P + 2 * U + 3 * (P + 1)) * 4;
  EXPECT_EQ(spec.exchange - exact.exchange, 3 * U * 2 * D + indices);
  c.parallel.a2a_compression = A2aCompression::Auto;  // room for both row formats: bf16 rows are the wider
  const MemoryEstimate both = estimate_memory(c, layout);
  EXPECT_EQ(both.exchange - exact.exchange, 2 * U * fp8_row + 3 * U * 2 * D + indices);
}

TEST(MemoryPlan, ZeroUnderExpertParallelismShardsSharedAndExpertState) {
  RunConfig c = small_config();
  c.model.n_layers = 6;
  c.model.moe.expert_hidden = 4096;  // a rank's piece of its experts' bf16 weights spans whole chunks
  const int64_t n = c.model.n_layers, experts = 3 * 8 * 4096 * 512;
  const int64_t shared = 2 * 1024 * 512 + 512 + n * (kLayer - kExperts);
  for (int64_t ep : {2, 4}) {
    SCOPED_TRACE(testing::Message() << "EP " << ep);
    MemoryLayout layout = configured_layout(c, 4, 4);
    layout.expert_parallel = ep;
    std::vector<MemoryEstimate> by_level;
    for (int64_t zero = 0; zero <= 3; ++zero) {
      layout.zero = zero;
      by_level.push_back(estimate_memory(c, layout));
    }
    const MemoryEstimate &z0 = by_level[0], &z1 = by_level[1], &z2 = by_level[2], &z3 = by_level[3];
    const int64_t own_experts = n * experts / ep, replicas = 4 / ep;
    // Stepped: a quarter of the shared elements (the router biases whole: 16 each) and
    // 1 / replicas of its experts, give or take a unit at each stage's ends.
    const int64_t stepped = (shared - 16 * n) / 4 + 16 * n + own_experts / replicas;
    // Packed into blocks of whole chunks.
    EXPECT_NEAR(static_cast<double>(z1.master_lo), static_cast<double>(stepped * 2), kChunk + 4096);
    EXPECT_NEAR(static_cast<double>(z1.moments), static_cast<double>(stepped * 8), 2 * kChunk + 16384);
    EXPECT_LE(z1.weights, z0.weights);  // the largest rank at level 0 need not be the largest at 1
    EXPECT_LE(z1.gradients, z0.gradients);
    EXPECT_LT(z1.total(), z0.total());
    if (ep != 2) continue;
    EXPECT_LT(z2.gradients + z2.zero_pools, z1.gradients);
    EXPECT_LT(z3.weights + z3.zero_pools - z2.zero_pools, z2.weights);
    EXPECT_LT(z3.total(), z2.total());
    EXPECT_LT(z2.total(), z1.total());
  }
}

TEST(MemoryPlan, BenchModelsWithinTenPercentOfTheirMeasuredPeaks) {
  for (const auto& [name, measured_gb] : {std::pair{"mixtral-mini", 113.5}, std::pair{"olmoe-mini", 79.7}}) {
    const RunConfig c = load_config((source_dir() / "configs/bench" / (std::string(name) + ".toml")).string());
    const double estimate_gb = static_cast<double>(estimate_memory(c, configured_layout(c, 1, 1)).total()) / 1e9;
    EXPECT_NEAR(estimate_gb, measured_gb, 0.1 * measured_gb) << name;
    // An H200 reports ~150 GB to cudaMemGetInfo; the refusal takes the reserve off.
    EXPECT_NO_THROW(check_memory_fits(c, 1, 1, 1, static_cast<int64_t>((141.0 - kMemoryReserveGb) * 1e9))) << name;
  }
}

}  // namespace
}  // namespace moe

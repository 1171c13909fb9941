// A rank's parameter state as the planner computes it (train/state_memory.h): the block
// layout from the config alone is the allocated model's (the backward stages the GPU
// reduces and shards by, the router biases it keeps whole), and what the levels keep.
#include "train/state_memory.h"

#include <gtest/gtest.h>

#include "dist/gradient_stages.h"
#include "model/gpu_state_layout.h"
#include "model/transformer.h"

namespace moe {
namespace {

constexpr int64_t kChunk = kResidentGranularity;

ModelConfig small_model() {
  ModelConfig m;
  m.vocab_size = 1000;  // 1000 x 64: not a multiple of 16 tensors' worth of padding
  m.dim = 64;
  m.n_layers = 3;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.moe.n_experts = 6;  // router bias of 6, padded to 16
  m.moe.expert_hidden = 96;
  return m;
}

TEST(StateMemory, BlockLayoutIsTheAllocatedModels) {
  for (bool tied : {false, true})
    for (int64_t dense : {0, 1}) {
      ModelConfig c = small_model();
      c.tie_embeddings = tied;
      c.first_dense_layers = dense;
      const Transformer<float> model(c, 1);
      const ParameterBlockLayout block = parameter_block_layout(c, Transformer<float>::parameter_specs(c));
      const ParameterStore<float>& params = model.params();
      EXPECT_EQ(block.storage, params.storage_numel());
      // The stages GpuBackend::make_data_parallel builds from the allocated model.
      EXPECT_EQ(block.stages, dist::gradient_ranges_by_stage(
                                  params, [&](const std::string& name) { return model.backward_stage_of(name); },
                                  model.backward_stages()))
          << "tied " << tied << ", dense layers " << dense;
      RangeList biases;
      for (int id = 0; id < params.size(); ++id)
        if (params.spec(id).name.ends_with("router.bias")) biases.push_back({params.offset(id), 16});
      EXPECT_EQ(block.fp32_copies, biases);
      EXPECT_EQ(static_cast<int64_t>(biases.size()), 3 - dense);
    }
}

TEST(StateMemory, LevelsKeepTheirBlocksPiecesOnly) {
  // Three stages of one chunk of fp32 each (elements 0-524,287, ...), one range each.
  ParameterBlockLayout block;
  const int64_t n = kChunk / 4;
  block.storage = 3 * n;
  block.stages = {{{2 * n, n}}, {{n, n}}, {{0, n}}};
  const RangeList whole{{0, block.storage}};
  const StateBytes z0 = rank_state_bytes(block, whole, 0, {}, 4);
  EXPECT_EQ(z0.weights, 2 * kChunk);  // 3 x 2 MiB of bf16 in 2 MiB chunks
  EXPECT_EQ(z0.master_lo, 2 * kChunk);
  EXPECT_EQ(z0.gradients, 3 * kChunk);
  EXPECT_EQ(z0.moments, 6 * kChunk);
  EXPECT_EQ(z0.pools, 0);
  // Keeping [8, 40) and [n + 16, n + 32): packed at 8 and 48 (each congruent to its offset
  // modulo 16, the second on the multiple of 16 after 40), 64 elements in all, in blocks
  // of whole chunks: one each for the lo halves, m and v.
  const RangeList kept = {{8, 32}, {n + 16, 16}};
  const StateBytes z1 = rank_state_bytes(block, whole, 1, kept, 2);
  EXPECT_EQ(packed_state_layout(kept).total, 64);
  EXPECT_EQ(z1.master_lo, kChunk);
  EXPECT_EQ(z1.moments, 2 * kChunk);
  EXPECT_EQ(z1.gradients, z0.gradients);
  // ZeRO-2: the middle stage's chunk holds its first element, so it stays private: no pool.
  const StateBytes z2 = rank_state_bytes(block, whole, 2, kept, 4);
  EXPECT_EQ(z2.gradients, 3 * kChunk);
  EXPECT_EQ(z2.pools, 0);
  // Four stages of four fp32 chunks each, nothing kept: stages 0 and 3 whole and the
  // middle ones' edge chunks are private (12), their two inner chunks each share the pool
  // of their parity (2 + 2). In bf16 a stage is two chunks, both at an edge: all private.
  block.storage = 16 * n;
  block.stages = {{{12 * n, 4 * n}}, {{8 * n, 4 * n}}, {{4 * n, 4 * n}}, {{0, 4 * n}}};
  const StateBytes z3 = rank_state_bytes(block, {{0, block.storage}}, 3, {}, 4);
  EXPECT_EQ(z3.gradients, 12 * kChunk);
  EXPECT_EQ(z3.weights, 8 * kChunk);
  EXPECT_EQ(z3.pools, (2 + 2) * kChunk);
  EXPECT_EQ(z3.master_lo, 0);
}

}  // namespace
}  // namespace moe

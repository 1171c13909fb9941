// Expert merging (moe.merge_interval, docs/EXPERT_MERGING.md): the CPU reference of
// finding an MoE layer's most similar experts and merging each such pair in place, with
// tensor shapes unchanged ("split" mode). Pure functions on per-expert rows, so the
// host model, the GPU path (which merges a host copy of its state) and the tests share
// one arithmetic.
//
// A layer's state is a set of tensors whose leading dimension is the expert (w1, w3, w2,
// the router's weight rows and bias, the balancing bias), each with its AdamW moments
// (null where a tensor has none: the balancing bias).
#pragma once
#include <cstdint>
#include <vector>

namespace moe {

struct ExpertRows {
  float* value = nullptr;  // E rows of `row` elements
  float* m = nullptr;      // AdamW first moment, same layout (may be null)
  float* v = nullptr;      // second moment (may be null)
  int64_t row = 0;
  bool similarity = false; // part of the similarity measure (the expert weights w1, w3, w2)
  bool perturb = false;    // the split copy gets a seeded relative perturbation (expert weights)
};

struct ExpertMerge {
  int64_t kept = 0;        // a: holds the merged expert
  int64_t freed = 0;       // b: re-initialised as a split of split_of
  int64_t split_of = 0;    // c: the most loaded expert outside this event's pairs
  double similarity = 0;   // cosine of a's and b's flattened weights
  double kept_share = 0;   // a's weight in the average: load_a / (load_a + load_b) (0.5 when both 0)
};

// Cosine similarity of every pair of experts' flattened weights (the rows marked
// `similarity`, concatenated), E x E row-major (1 on the diagonal; 0 for a zero expert).
// Sums in double in a fixed order: the same on every machine.
std::vector<double> expert_cosine_EE(const std::vector<ExpertRows>& tensors, int64_t E);

// The merges of one event: pairs (i < j) with cosine >= min_similarity, most similar
// first (ties: lower i, then lower j), disjoint, at most max_pairs; in each the more
// loaded expert is kept (ties: the lower index). Each freed expert becomes a split of
// the most loaded expert in no pair of this event, the first pair taking the most loaded
// (ties: the lower index). Experts listed in `protected_experts` (the last event's split
// pairs, still near-copies of each other) are in no pair. Empty when fewer than 3 experts.
std::vector<ExpertMerge> plan_expert_merges(const std::vector<double>& cosine_EE, const std::vector<int64_t>& load_E,
                                            double min_similarity, int64_t max_pairs,
                                            const std::vector<int64_t>& protected_experts = {});

// Applies the merges in order: row a = s * row a + (1 - s) * row b (s = kept_share) for
// every tensor's values and moments; then row b = row c (values and moments), the
// `perturb` tensors' values times (1 + noise * u), u uniform in [-1, 1) keyed by
// (seed, tensor index, element): the same on every run and every device.
void apply_expert_merges(const std::vector<ExpertRows>& tensors, const std::vector<ExpertMerge>& merges,
                         double noise, uint64_t seed);

}  // namespace moe

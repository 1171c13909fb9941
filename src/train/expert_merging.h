// Expert merging on the host model (moe.merge_interval, docs/EXPERT_MERGING.md): the
// MoE layers' expert tensors, router rows and AdamW moments as moe/expert_merge.h's rows,
// and one merge event over every MoE layer. The CPU reference trains these host copies;
// the GPU path downloads its state into them, merges and uploads it back.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "config/model_config.h"
#include "model/transformer.h"
#include "moe/expert_merge.h"
#include "optim/adamw.h"
#include "train/state_pieces.h"

namespace moe {

// MoE layer `layer` (index among the MoE layers) of the host model: w1, w3, w2 (similarity
// and perturbation), the router's weight rows and bias (when moe.router_bias), each with
// its AdamW moments, and the balancing bias (when moe.bias_balancing; no moments).
std::vector<ExpertRows> host_expert_rows(Transformer<float>& model, AdamW& optimizer, size_t layer,
                                         const MoEConfig& config);

// The perturbation seed of MoE layer `layer` at a merge after step `step`.
uint64_t expert_merge_seed(uint64_t training_seed, int64_t step, size_t layer);

// One merge event after step `step` (1-based): per MoE layer, plan by the weights' cosine
// and load_LE (that layer's tokens per expert in the step), with protected_LE's experts in
// no pair (empty: none), apply, and return the merges.
std::vector<std::vector<ExpertMerge>> merge_host_experts(Transformer<float>& model, AdamW& optimizer,
                                                         const MoEConfig& config,
                                                         const std::vector<std::vector<int64_t>>& load_LE,
                                                         const std::vector<std::vector<int64_t>>& protected_LE,
                                                         uint64_t training_seed, int64_t step);

// The same event on a state spread over ranks (ZeRO pieces, expert-parallel experts,
// replicas; docs/EXPERT_MERGING.md, "Over several ranks"). Collective: per MoE layer, every
// rank rebuilds the merged tensors whole (values and moments) from `saved` (its pieces,
// each element from the one copy replica_share picks, zero elsewhere) and
// `sum_over_world` (an in-place sum over all ranks), plans and applies the merges with the
// host path's code, and writes the rows it changed back into `targets` (the slices this
// rank holds: its restore targets). The balancing bias is whole and equal on every rank
// and is merged in place. Every rank takes the same decisions with the same inputs (loads
// summed over the ranks, the same seed).
std::vector<std::vector<ExpertMerge>> merge_sharded_experts(
    Transformer<float>& model, const MoEConfig& config, const SavedState& saved, const std::vector<StateTarget>& targets,
    const std::function<void(float*, int64_t)>& sum_over_world, const std::vector<std::vector<int64_t>>& load_LE,
    const std::vector<std::vector<int64_t>>& protected_LE, uint64_t training_seed, int64_t step);

// The experts the next event leaves alone: each merge's freed expert and its split source.
std::vector<std::vector<int64_t>> split_experts_of(const std::vector<std::vector<ExpertMerge>>& merges);

}  // namespace moe

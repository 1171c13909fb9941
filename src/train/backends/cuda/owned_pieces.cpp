#include "train/backends/cuda/owned_pieces.h"

#include <spdlog/spdlog.h>

#include <string>

#include "core/error.h"
#include "train/checkpoint_manifest.h"

namespace moe {

void OwnedPieces::add(int id, Range block, int64_t begin, int replicas, int replica) {
  pieces.push_back({id, block, begin, replicas, replica, elements()});
}

void OwnedPieces::allocate(bool pinned) {
  const auto n = static_cast<size_t>(elements());
  float* base = nullptr;
  if (pinned && n > 0) {
    try {
      pinned_ = gpu::PinnedHostArray<float>(3 * n);
      base = pinned_.data();
    } catch (const gpu::OutOfMemory& e) {
      spdlog::warn("checkpoint: {}; saving through pageable memory (slower device-to-host copies)", e.what());
    }
  }
  if (!base) {
    pageable_.reset(new float[3 * n]);
    base = pageable_.get();
  }
  values_ = base;
  m_ = base + n;
  v_ = base + 2 * n;
}

namespace {

// Parameter `id`, which all `world` ranks hold: whole, or (saving) only the part this rank
// writes. replica_share cuts a large tensor evenly whatever its name (so param/, adam_m/
// and adam_v/ agree and the piece is this rank's alone); a small one goes whole to a copy
// its name picks, so it stays a replicated piece for capture_state to choose.
void add_replicated(OwnedPieces& own, const ParameterStore<float>& params, int id, int world, int rank, bool whole) {
  const int64_t offset = params.offset(id), count = params.numel(id);
  if (whole || world <= 1) return own.add(id, {offset, count}, 0, world, rank);
  const std::string& name = params.spec(id).name;
  const Range share = replica_share("param/" + name, 0, count, world, rank);
  const bool same = share == replica_share("adam_m/" + name, 0, count, world, rank) &&
                    share == replica_share("adam_v/" + name, 0, count, world, rank);
  if (!same) return own.add(id, {offset, count}, 0, world, rank);
  if (share.count > 0) own.add(id, {offset + share.offset, share.count}, share.offset, 1, 0);
}

// Per MoE layer, the slots of this rank's block (`window`: of its window, a hinge
// included) as their experts' slices of the expert tensors, held by the world / ep ranks
// with the same EP rank.
void add_expert_slots(OwnedPieces& own, const ParameterStore<float>& params, const ExpertLayout& layout, int world,
                      int rank, int ep, bool window) {
  const int p = rank % ep;
  for (const MoeLayerExperts& layer : layout) {
    const ExpertSlots& slots = layer.slots;
    const int64_t first = slots.window_first(p);
    const int64_t end = window ? slots.window_end_P[static_cast<size_t>(p)] : slots.first_slot_P1[static_cast<size_t>(p) + 1];
    for (const Range& tensor : layer.tensors) {
      int id = 0;
      while (id < params.size() && params.offset(id) != tensor.offset) ++id;
      MOE_CHECK(id < params.size(), "checkpoint: no parameter at expert tensor offset {}", tensor.offset);
      const int64_t per = tensor.count / slots.n_experts();
      for (int64_t slot = first; slot < end; ++slot)
        own.add(id, {tensor.offset + slot * per, per}, slots.expert_of_slot[static_cast<size_t>(slot)] * per,
                world / ep, rank / ep);
    }
  }
}

// `whole`'s pieces cut to the plan's update ranges (appended to `own`): the sharded parts
// are this rank's alone, the replicated ones held by all the plan's ranks.
void add_plan_pieces(OwnedPieces& own, const OwnedPieces& whole, const dist::ZeroShardPlan& plan) {
  RangeList replicated;
  for (const RangeList& stage : plan.replicated) replicated.insert(replicated.end(), stage.begin(), stage.end());
  replicated = merge_ranges(std::move(replicated));
  const RangeList sharded = subtract_ranges(plan.update, replicated);
  const RangeList kept_whole = intersect_ranges(plan.update, replicated);
  for (const OwnedPieces::Piece& piece : whole.pieces)
    for (const bool rep : {false, true}) {
      const RangeList& set = rep ? kept_whole : sharded;
      for (const Range& part : intersect_ranges({piece.block}, set))
        own.add(piece.id, part, piece.begin + (part.offset - piece.block.offset), rep ? plan.ranks : 1,
                rep ? plan.rank : 0);
    }
}

}  // namespace

OwnedPieces zero_pieces(const ParameterStore<float>& params, const dist::ZeroShardPlan& plan) {
  OwnedPieces own;
  add_plan_pieces(own, replica_pieces(params, plan.ranks, plan.rank, /*whole=*/true), plan);
  return own;
}

OwnedPieces expert_pieces(const ParameterStore<float>& params, const ExpertLayout& layout, int world, int rank,
                          int ep, bool window) {
  OwnedPieces own;
  for (int id = 0; id < params.size(); ++id)
    if (params.spec(id).expert_group.empty()) add_replicated(own, params, id, world, rank, window);
  add_expert_slots(own, params, layout, world, rank, ep, window);
  return own;
}

OwnedPieces expert_zero_pieces(const ParameterStore<float>& params, const ExpertLayout& layout, int world, int rank,
                               int ep, const dist::ExpertParallelZero& zero) {
  OwnedPieces shared, experts, own;
  for (int id = 0; id < params.size(); ++id)
    if (params.spec(id).expert_group.empty()) shared.add(id, {params.offset(id), params.numel(id)}, 0, world, rank);
  add_expert_slots(experts, params, layout, world, rank, ep, /*window=*/false);
  add_plan_pieces(own, shared, zero.shared);
  add_plan_pieces(own, experts, zero.experts);
  return own;
}

OwnedPieces expert_slot_pieces(const ParameterStore<float>& params, const ExpertLayout& layout, int world, int rank,
                               int ep) {
  OwnedPieces own;
  add_expert_slots(own, params, layout, world, rank, ep, /*window=*/false);
  return own;
}

OwnedPieces replica_pieces(const ParameterStore<float>& params, int world, int rank, bool whole) {
  OwnedPieces own;
  for (int id = 0; id < params.size(); ++id) add_replicated(own, params, id, world, rank, whole);
  return own;
}

std::shared_ptr<OwnedPieces> SaveBufferPool::take(OwnedPieces now) {
  if (saved_ && saved_.use_count() == 1 && saved_->elements() == now.elements()) {
    saved_->pieces = std::move(now.pieces);
    return saved_;
  }
  saved_ = std::make_shared<OwnedPieces>(std::move(now));
  saved_->allocate(/*pinned=*/true);
  return saved_;
}

}  // namespace moe

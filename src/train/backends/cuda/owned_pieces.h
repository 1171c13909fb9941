// What a GPU rank saves and restores of the checkpoint's global tensors: its own slices
// (ZeRO pieces, expert-parallel experts, or a replica's share), where each lies in the
// device block and in its global tensor, and host buffers for their values and moments.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/gpu.h"
#include "core/range.h"
#include "dist/zero_shards.h"
#include "model/expert_layout.h"
#include "model/parameters.h"

namespace moe {

struct OwnedPieces {
  struct Piece {
    int id = 0;
    Range block;        // in the parameter block
    int64_t begin = 0;  // in the global tensor
    int replicas = 1, replica = 0;
    int64_t at = 0;     // in the host buffers
  };
  std::vector<Piece> pieces;

  void add(int id, Range block, int64_t begin, int replicas, int replica);
  int64_t elements() const { return pieces.empty() ? 0 : pieces.back().at + pieces.back().block.count; }
  // Host buffers for values, m and v: pinned (saves: the device copies into them at the
  // link's speed; falls back to pageable memory when the host cannot pin that much) or
  // pageable (restores: filled by the checkpoint reader). Not initialised.
  void allocate(bool pinned);
  float* values_of(const Piece& p) { return values_ + p.at; }
  float* m_of(const Piece& p) { return m_ + p.at; }
  float* v_of(const Piece& p) { return v_ + p.at; }

 private:
  gpu::PinnedHostArray<float> pinned_;
  std::unique_ptr<float[]> pageable_;  // not zeroed: the reader or the download fills it
  float *values_ = nullptr, *m_ = nullptr, *v_ = nullptr;
};

// ZeRO: the plan's update ranges cut at the parameters; those every rank steps (the plan's
// replicated ranges) are held by all `plan.ranks`.
OwnedPieces zero_pieces(const ParameterStore<float>& params, const dist::ZeroShardPlan& plan);

// Expert parallelism over `world` ranks (this one `rank`, EP rank rank % ep): every
// parameter outside the expert tensors (held by all ranks) and, per MoE layer, the slots
// of its block (`window`: of its window, a hinge included) as their experts' slices of the
// expert tensors (held by the world / ep ranks with the same EP rank).
OwnedPieces expert_pieces(const ParameterStore<float>& params, const ExpertLayout& layout, int world, int rank,
                          int ep, bool window);

// ZeRO under expert parallelism (dist::plan_expert_parallel_zero): the plan's pieces of the
// parameters outside the expert tensors (held by all ranks) and of this rank's experts'
// slices of the expert tensors (held by their replicas).
OwnedPieces expert_zero_pieces(const ParameterStore<float>& params, const ExpertLayout& layout, int world, int rank,
                               int ep, const dist::ExpertParallelZero& zero);
// This rank's experts' slices of the expert tensors, whole (what a restore under ZeRO
// reads of their weights).
OwnedPieces expert_slot_pieces(const ParameterStore<float>& params, const ExpertLayout& layout, int world, int rank,
                               int ep);

// Replicas over `world` ranks (one GPU, or data parallelism without ZeRO): every parameter
// whole when `whole` (restoring), else only what this rank writes of it (replica_share:
// its even part of a large tensor, a small one whole where the share picks this rank), so
// a save downloads 1 / world of the state.
OwnedPieces replica_pieces(const ParameterStore<float>& params, int world, int rank, bool whole);

// Pinned host buffers for a rank's saves. take(now): the last save's buffers again if its
// write is done (only the pool still holds them) and the sizes agree (a re-placement moves
// experts between slots, not their sizes); else new pinned ones, kept for the next save.
class SaveBufferPool {
 public:
  std::shared_ptr<OwnedPieces> take(OwnedPieces now);
  const OwnedPieces* last() const { return saved_.get(); }

 private:
  std::shared_ptr<OwnedPieces> saved_;
};

}  // namespace moe

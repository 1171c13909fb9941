// ZeRO-1 for data parallelism, one layout for the GPU and the CPU: which parts of the
// parameter block each rank sums, steps and sends back. The block keeps its layout on every
// rank (no packing): each bucket [offset, offset + count) of the gradients is
// reduce-scattered in place, so rank r ends up holding the sum of its piece
// [offset + r * count / N, offset + (r + 1) * count / N), takes the AdamW step there only,
// and the pieces of the new weights (GPU: bf16; CPU: fp32) are all-gathered in place.
// GPU: GpuDataParallel over GpuParameterStore; CPU: ZeroOptimizer (zero_optimizer.h) over
// the CPU ParameterStore, whose offsets and padding the GPU store copies.
//
// Some ranges are all-reduced whole and stepped by every rank instead ("replicated"):
// parameters the GPU's forward also reads from an fp32 copy (router biases: every rank must
// refresh its copy; the CPU keeps the same ones whole so that the plans are one), and the
// few elements at the ends of a stage's ranges that do not fill a whole bucket unit
// (buckets are multiples of N x kZeroAlign elements so that every piece starts on a 64-byte
// boundary).
//
// With gate|up interleaved in the GPU store's bf16 weights (training.interleave_gate_up,
// model/gpu_state_layout.h) the plan cuts each w1 | w3 pair at expert slices, so that the
// new weights, gathered in that order, still move in place: see plan_zero_shards.
//
// Host code: the plan is computed and tested without a GPU.
#pragma once
#include <cstdint>
#include <vector>

#include "dist/gradient_stages.h"
#include "model/gpu_state_layout.h"

namespace moe::dist {

// Elements per piece boundary: 16 fp32 = 64 bytes (the parameter store's tensor alignment).
constexpr int64_t kZeroAlign = 16;

// Elements per gradient bucket for parallel.bucket_mb (MB of fp32 gradients) over a block
// of block_numel elements: a multiple of 64 (256-byte boundaries keep NCCL's loads
// aligned), at least 64, at most the block; 0 MB: the whole block. GpuDataParallel's
// buckets and the ZeRO-1 plans of both paths (bucket_elems below) take it.
int64_t gradient_bucket_elems(double bucket_mb, int64_t block_numel);

struct ZeroShardPlan {
  int ranks = 1, rank = 0;
  // Per backward stage: the buckets reduce-scattered (count a multiple of ranks x
  // kZeroAlign) and the ranges all-reduced whole.
  std::vector<RangeList> sharded, replicated;
  // Per backward stage: the same buckets where the bf16 weights keep them (the store's hi
  // halves; GpuParameterStore::hi_offset), which the all-gathers of the new weights take:
  // rank r's piece of each is the hi halves of rank r's pieces of `sharded`. `sharded`
  // itself without interleaved pairs.
  std::vector<RangeList> weight_gathers;
  // What this rank's optimizer steps: its piece of every bucket and every replicated range.
  RangeList update;
  // What this rank adds to the global gradient norm: its pieces, and the replicated ranges
  // on rank 0 only, so that the sum over the ranks counts every element once.
  RangeList norm;

  // Rank r's piece of a bucket.
  Range piece(Range bucket, int r) const {
    const int64_t shard = bucket.count / ranks;
    return {bucket.offset + r * shard, shard};
  }
};

// stage_ranges: the block's ranges per backward stage (gradient_ranges_by_stage), disjoint,
// starting on kZeroAlign multiples. keep_whole: ranges to replicate (disjoint; each lies
// inside one stage's ranges). bucket_elems: the most elements per bucket (rounded down to
// the unit, at least one unit).
// pairs: the store's interleaved w1 | w3 pairs (each inside one stage's ranges, none
// overlapping keep_whole). A pair's buckets never cross an expert slice, except that where
// ranks whole slices fit a bucket, w1's experts [e, e + k) (k a multiple of ranks) and w3's
// become two buckets whose pieces are whole slices: their hi halves are one range, in which
// rank r's pieces of both lie side by side, in rank order (one all-gather).
ZeroShardPlan plan_zero_shards(const std::vector<RangeList>& stage_ranges, const RangeList& keep_whole,
                               int64_t bucket_elems, int ranks, int rank, const std::vector<HiInterleave>& pairs = {});

// ZeRO under expert parallelism over `world` ranks in EP groups of `ep` (this rank's EP
// rank rank % ep; its experts' replicas: the world / ep ranks of that EP rank, in which it
// is rank / ep): the shared parameters (ranges.shared) sharded over the world, its own
// experts (ranges.own_experts) over their replicas (one replica: stepped whole). The GPU's
// two data-parallel groups take one plan each; the memory planner counts the same.
struct ExpertParallelZero {
  ZeroShardPlan shared, experts;
  RangeList update, norm;        // both plans': what this rank steps, and adds to the global norm
  std::vector<RangeList> held;   // per backward stage: the shared and own experts' ranges
};
ExpertParallelZero plan_expert_parallel_zero(const ExpertParallelRanges& ranges, const RangeList& keep_whole,
                                             int64_t bucket_elems, int world, int rank, int ep);

// ZeRO-0 (full replicas) in the same form: every bucket of `plan` becomes a replicated
// range (all-reduced whole, still one bucket at a time; every rank steps everything), the
// norm counted on rank 0 only.
ZeroShardPlan replicated_plan(const ZeroShardPlan& plan);

// The parts of the plan's buckets that other ranks own (per backward stage): the gradients
// (ZeRO-2) and parameters (ZeRO-3) this rank keeps no memory for between uses.
std::vector<RangeList> others_pieces(const ZeroShardPlan& plan);

}  // namespace moe::dist

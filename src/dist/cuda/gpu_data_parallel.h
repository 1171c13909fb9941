// Data parallelism for the GPU model over NCCL: every rank holds a full replica (weights,
// fp32 gradient block, AdamW state); after the step's last backward the gradient block
// is all-reduced (summed) over the data-parallel group, in buckets of parallel.bucket_mb,
// on the model's CUDA stream. Each rank then computes the same global norm on the
// device and takes the same AdamW step. The ranks' losses are weighted before backward
// so that the sum is the global micro-batch's mean (src/train/backends/cuda/gpu_backend.cpp).
//
// Overlap: given the block's ranges per backward stage (gradient_stages.h), the step's
// last backward calls launch_stage() as each stage's work is enqueued, which starts that
// stage's all-reduce on the communicator's stream while the backward goes on;
// finish_overlapped() then makes the model's stream wait for all of them. Without stage
// ranges (or inside a CUDA graph) all_reduce_grads() does it all after the backward.
// bf16 reduction (parallel.grad_reduce_dtype = bf16) halves the bytes on the wire: each
// bucket is rounded to bf16 into a scratch buffer, summed in bf16 by NCCL and widened back
// into the fp32 block, on side streams of this class that follow the model's stream, so
// neither cast holds up the backward. Two side streams with a scratch bucket each take
// the buckets in turn: one bucket's cast runs while the previous one is summed.
// ZeRO-1 (set_zero_plan, src/dist/zero_shards.h): the buckets are reduce-scattered in place
// instead (each rank then holds the sums of its pieces only, half the all-reduce's bytes),
// every rank steps its pieces, and gather_pieces() all-gathers the new bf16 weights.
//
// Built only with CUDA (src/dist/cuda/). The header needs no CUDA include: the stream is
// a cudaStream_t passed as void*.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "core/bf16.h"
#include "dist/communicator.h"
#include "dist/comm_stats.h"
#include "dist/zero_shards.h"

namespace moe::dist {

class GpuDataParallel {
 public:
  // group: an NCCL communicator (any size, 1 included). stream: the model's cudaStream_t.
  // grads: the fp32 gradient block of `count` elements on the device. bucket_mb: MB
  // (1e6 bytes of fp32 gradients) per all-reduce; 0: the whole block in one.
  // reduce_dtype: f32 (exact sums) or bf16 (half the traffic, sums rounded to bf16).
  GpuDataParallel(std::unique_ptr<Communicator> group, void* stream, float* grads, int64_t count, double bucket_mb,
                  DType reduce_dtype = DType::f32);
  ~GpuDataParallel();
  GpuDataParallel(const GpuDataParallel&) = delete;
  GpuDataParallel& operator=(const GpuDataParallel&) = delete;

  int rank() const { return group_->rank(); }
  int size() const { return group_->size(); }
  Communicator& group() { return *group_; }
  // [offset, offset + count) of the gradient block per all-reduce.
  const RangeList& buckets() const { return buckets_; }
  int64_t bucket_elems() const { return bucket_elems_; }

  // Sums n host doubles over the ranks in place (a device round trip on the model's
  // stream; the host blocks for it, counted as communication wait).
  void sum(double* values, int64_t n) { reduce(values, n, ReduceOp::sum); }
  // The same with another reduction (max: a decision every rank takes alike).
  void reduce(double* values, int64_t n, ReduceOp op);
  double sum(double value) {
    sum(&value, 1);
    return value;
  }
  // Sums n host floats over the ranks in place, in pieces through the same scratch (fp32
  // sums: exact where at most one rank's element is nonzero, as expert merging relies on).
  void sum(float* values, int64_t n);

  // Sums the gradient block over the ranks, bucket by bucket, after the work already on
  // the model's stream; returns when the sum is complete. CUDA events around it give the
  // gradient-sync latency, which is also time the model's stream waits (no overlap yet).
  void all_reduce_grads();

  // Overlapped all-reduce: stage_ranges[s] are the [offset, count) ranges whose gradients
  // backward stage s completes and this group sums (disjoint; the whole block in plain
  // data parallelism, a part of it under expert parallelism).
  void set_stage_ranges(std::vector<RangeList> stage_ranges);
  bool overlaps() const { return overlap_; }
  // Starts stage s's all-reduces after the work enqueued so far on the model's stream.
  void launch_stage(int stage);
  // ZeRO-1: the plan's buckets are reduce-scattered and its replicated ranges all-reduced,
  // stage by stage during the backward when `overlap` (launch_stage), else all at once by
  // all_reduce_grads(). Replaces set_stage_ranges.
  void set_zero_plan(ZeroShardPlan plan, bool overlap);
  const ZeroShardPlan* zero_plan() const { return zero_ ? &*zero_ : nullptr; }
  // ZeRO-2 (after set_zero_plan with overlap, fp32 sums): the backward of every micro-batch
  // calls launch_stage, preceded by begin_micro_batch(last). The buckets are reduce-scattered
  // every time (a rank's piece holds the running sum: in place, its own gradient plus the
  // others'), the replicated ranges all-reduced on the step's last micro-batch only (they
  // accumulate locally before), and once stage s - 1's scatters are done (waited for when
  // stage s is launched, or by finish_overlapped) zero_after[s - 1] (its elements outside
  // this rank's pieces: undefined after the scatter) is zeroed on the model's stream, so
  // stage s + 1, whose gradients share its memory (share_gradients in
  // model/cuda/gpu_parameter_zero.h), and the next micro-batch start from zeros.
  void set_gradient_sharding(std::vector<RangeList> zero_after);
  void begin_micro_batch(bool last) { last_micro_batch_ = last; }
  // ZeRO-3 (after set_gradient_sharding): the bf16 weights `block` keeps only this rank's
  // pieces between uses; each stage's are all-gathered before its forward and again before
  // its backward, one stage ahead (a stage's memory is shared with the stages two away:
  // share_weights in model/cuda/gpu_parameter_zero.h, so a gather is issued once the stage
  // two before has been enqueued). begin_forward_gathers: before a forward (its first stage, the
  // embedding's); forward_stage(s): the forward's stage hook (the next stage's gather
  // issued, stage s's waited for); backward_stage_done(s): after stage s's backward is
  // enqueued (stage s + 2's gather issued, s + 1's waited for; stages 1 and 2 are still
  // there from the forward).
  void set_weight_sharding(void* block);
  bool shards_weights() const { return weights_ != nullptr; }
  void begin_forward_gathers();
  void forward_stage(int stage);
  void backward_stage_done(int stage);
  // Which buckets an all-gather moves: the plan's `sharded` (a block in the gradient block's
  // layout: the lo halves, the moments) or its `weight_gathers` (the store's bf16 weights,
  // whose interleaved gate|up pairs keep another order: GpuParameterStore::hi_offset).
  enum class Layout { Parameters, Weights };
  // ZeRO-1, after the optimizer step on the model's stream: every rank's pieces of a block
  // (the bf16 weights; for checkpoints also the lo halves and the moments) are all-gathered
  // in place; the model's stream waits for them (counted as communication wait, and returns
  // without blocking the host). `stage` >= 0: that backward stage's pieces only. The
  // layout has no default: the weights and the other blocks move different ranges.
  void gather_pieces(void* block, DType dtype, Layout layout, int stage = -1);
  // ZeRO-1, overlapped: the same all-gathers, stage by stage in the forward's order (the
  // embedding's first), without the model's stream waiting; wait_stage(s) then makes it
  // wait for stage s's (GpuTransformer's forward stage hook), so the next step's forward
  // runs while the later stages' weights arrive. Only what the stream still waits there
  // counts as communication wait.
  void gather_pieces_by_stage(void* block, DType dtype, Layout layout);
  void wait_stage(int stage);
  // The model's stream waits for every pending gather_pieces_by_stage() all-gather (before
  // anything else writes or reads the whole block).
  void join_stage_gathers();
  // Some stage's all-gather has not been waited for yet.
  bool gathers_pending() const {
    for (const auto& work : stage_gathered_)
      if (work) return true;
    return false;
  }
  // The model's stream waits for every launched all-reduce; returns when they are done.
  // grad_sync_s: from the first launch to the end; wait_s: what the model's stream waited
  // after its own work (the part the backward did not hide).
  void finish_overlapped();

  // The communication measured since the last call (wait_s, grad_sync_s), then reset.
  CommStats take_stats();

 private:
  void ensure_scratch(int64_t n);
  // Sums grads_[offset, offset + n) over the group after the work enqueued so far on the
  // model's stream: f32 on the communicator's stream (a Work in in_flight_), bf16 through
  // the side stream.
  void launch_sum(int64_t offset, int64_t n);
  // bf16 sums of [offset, offset + n): rounded into the next lane's scratch on its side
  // stream, `collective` run on that scratch there, then [widen_from, widen_from + widen_n)
  // of it widened back into the block.
  void launch_bf16(int64_t offset, int64_t n, int64_t widen_from, int64_t widen_n,
                   const std::function<std::unique_ptr<Work>(bf16*)>& collective);
  // ZeRO-1: reduce-scatters the bucket [offset, offset + n) in place.
  void launch_scatter(int64_t offset, int64_t n);
  // Every stage's sums (after the backward).
  void launch_all_stages();
  // Enqueues the all-gathers of `stage`'s buckets of a block; returns the last one's Work.
  std::unique_ptr<Work> gather_stage(size_t stage, void* block, DType dtype, Layout layout);
  // The model's stream waits for everything launched (both paths).
  void join_launched();

  std::unique_ptr<Communicator> group_;
  void* stream_;  // cudaStream_t
  float* grads_;
  int64_t count_;
  int64_t bucket_elems_ = 0;  // elements per all-reduce (the last bucket may be shorter)
  RangeList buckets_;
  double* scratch_ = nullptr;  // device doubles for sum()
  int64_t scratch_count_ = 0;
  void* sync_begin_ = nullptr;  // cudaEvent_t with timing
  void* sync_end_ = nullptr;
  void* backward_end_ = nullptr;  // overlapped: the model's own work done
  std::vector<RangeList> stage_ranges_;
  bool overlap_ = false;
  std::optional<ZeroShardPlan> zero_;
  // Event pairs on the model's stream around stretches where it waits for communication
  // (a joined gather_pieces(), a wait_stage() whose gather was still running), read and
  // recycled by take_stats().
  std::vector<std::pair<void*, void*>> timed_waits_;
  size_t timed_waits_used_ = 0;
  std::pair<void*, void*> next_timed_wait();
  std::vector<std::unique_ptr<Work>> stage_gathered_;  // per stage: its last all-gather, until waited for
  // ZeRO-1: the host sums (sum()) on a communicator of their own, so that they do not
  // queue behind the all-gathers that overlap the forward on group_'s stream.
  std::unique_ptr<Communicator> sum_group_;
  std::vector<std::unique_ptr<Work>> in_flight_;
  // ZeRO-2: per stage the ranges zeroed after its scatters; the stage launched last and
  // not yet zeroed (-1: none); whether this backward is the step's last micro-batch's.
  std::vector<RangeList> zero_after_;
  int unzeroed_stage_ = -1;
  bool last_micro_batch_ = true;
  void zero_stage(int stage);
  void* weights_ = nullptr;  // ZeRO-3: the bf16 weight block
  void fetch_stage(int stage);
  bool launched_ = false;  // a stage was launched since the last finish_overlapped()
  DType reduce_dtype_ = DType::f32;
  // bf16: two lanes, each a side stream (casts, and waits for its all-reduces), a
  // cudaEvent_t for its last widen and one bucket of bf16 scratch; buckets alternate.
  static constexpr int kLanes = 2;
  void* side_stream_[kLanes] = {};
  void* side_done_[kLanes] = {};
  void* bf16_scratch_[kLanes] = {};
  void* side_ready_ = nullptr;  // cudaEvent_t: the model's stream reached a launch
  int next_lane_ = 0;
  bool side_pending_ = false;
  CommStats stats_;
};

}  // namespace moe::dist

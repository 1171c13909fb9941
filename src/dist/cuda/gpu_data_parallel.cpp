#include "dist/cuda/gpu_data_parallel.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "core/error.h"
#include "core/gpu.h"
#include "kernels/gpu_ops.h"

namespace moe::dist {
namespace {

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }
cudaEvent_t as_event(void* event) { return static_cast<cudaEvent_t>(event); }

}  // namespace

GpuDataParallel::GpuDataParallel(std::unique_ptr<Communicator> group, void* stream, float* grads, int64_t count,
                                 double bucket_mb, DType reduce_dtype)
    : group_(std::move(group)), stream_(stream), grads_(grads), count_(count), reduce_dtype_(reduce_dtype) {
  MOE_CHECK(group_ != nullptr, "GPU data parallel: no communicator");
  MOE_CHECK(group_->device_memory(), "GPU data parallel needs a device-memory backend (nccl), got '{}'",
            group_->backend());
  MOE_CHECK(grads_ != nullptr && count_ > 0, "GPU data parallel: no gradient block ({} elements)", count_);
  MOE_CHECK(reduce_dtype_ == DType::f32 || reduce_dtype_ == DType::bf16,
            "GPU data parallel: gradients are summed in fp32 or bf16");
  group_->set_stream(stream_);
  const int64_t per_bucket = gradient_bucket_elems(bucket_mb, count_);  // checks bucket_mb >= 0
  bucket_elems_ = per_bucket;
  for (int64_t offset = 0; offset < count_; offset += per_bucket)
    buckets_.emplace_back(offset, std::min(per_bucket, count_ - offset));
  cudaEvent_t begin = nullptr, end = nullptr, backward_end = nullptr;
  MOE_CUDA_CHECK(cudaEventCreate(&begin));
  MOE_CUDA_CHECK(cudaEventCreate(&end));
  MOE_CUDA_CHECK(cudaEventCreate(&backward_end));
  sync_begin_ = begin;
  sync_end_ = end;
  backward_end_ = backward_end;
  if (reduce_dtype_ == DType::bf16) {
    cudaEvent_t ready = nullptr;
    MOE_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    side_ready_ = ready;
    for (int lane = 0; lane < kLanes; ++lane) {
      cudaStream_t side = nullptr;
      cudaEvent_t done = nullptr;
      MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
      MOE_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      side_stream_[lane] = side;
      side_done_[lane] = done;
      // A ZeRO bucket may be up to one unit longer than bucket_elems_ (zero_shards.h).
      const int64_t scratch = bucket_elems_ + kZeroAlign * group_->size();
      MOE_CUDA_CHECK(cudaMalloc(&bf16_scratch_[lane], static_cast<size_t>(scratch) * sizeof(bf16)));
    }
  }
}

GpuDataParallel::~GpuDataParallel() {
  if (scratch_) cudaFree(scratch_);
  for (auto& [begin, end] : timed_waits_) {
    cudaEventDestroy(as_event(begin));
    cudaEventDestroy(as_event(end));
  }
  if (sync_begin_) cudaEventDestroy(as_event(sync_begin_));
  if (sync_end_) cudaEventDestroy(as_event(sync_end_));
  if (backward_end_) cudaEventDestroy(as_event(backward_end_));
  if (side_ready_) cudaEventDestroy(as_event(side_ready_));
  for (int lane = 0; lane < kLanes; ++lane) {
    if (bf16_scratch_[lane]) cudaFree(bf16_scratch_[lane]);
    if (side_done_[lane]) cudaEventDestroy(as_event(side_done_[lane]));
    if (side_stream_[lane]) cudaStreamDestroy(as_stream(side_stream_[lane]));
  }
}

void GpuDataParallel::launch_sum(int64_t offset, int64_t n) {
  if (reduce_dtype_ == DType::f32) {
    in_flight_.push_back(group_->all_reduce_async(grads_ + offset, static_cast<size_t>(n), DType::f32, ReduceOp::sum));
    return;
  }
  launch_bf16(offset, n, 0, n, [&](bf16* scratch) {
    return group_->all_reduce_async(scratch, static_cast<size_t>(n), DType::bf16, ReduceOp::sum);
  });
}

// bf16: round, sum, widen back in place on the next lane; NCCL's stream takes the sums in
// order, so the other lane's cast overlaps this bucket's sum.
void GpuDataParallel::launch_bf16(int64_t offset, int64_t n, int64_t widen_from, int64_t widen_n,
                                  const std::function<std::unique_ptr<Work>(bf16*)>& collective) {
  const int lane = next_lane_;
  next_lane_ = (next_lane_ + 1) % kLanes;
  cudaStream_t side = as_stream(side_stream_[lane]);
  auto* scratch = static_cast<bf16*>(bf16_scratch_[lane]);
  MOE_CUDA_CHECK(cudaEventRecord(as_event(side_ready_), as_stream(stream_)));
  MOE_CUDA_CHECK(cudaStreamWaitEvent(side, as_event(side_ready_), 0));
  cuda::cast_to_bf16(scratch, grads_ + offset, n, side);
  group_->set_stream(side);  // the collective follows the cast; the widen follows the collective
  collective(scratch)->wait();
  group_->set_stream(stream_);
  cuda::cast_to_float(grads_ + offset + widen_from, scratch + widen_from, widen_n, side);
  side_pending_ = true;
}

void GpuDataParallel::launch_scatter(int64_t offset, int64_t n) {
  const int rank = group_->rank();
  const int64_t shard = n / group_->size();
  const auto piece = static_cast<size_t>(shard);
  if (reduce_dtype_ == DType::f32) {
    float* bucket = grads_ + offset;  // in place: rank r's sums land in its own piece
    in_flight_.push_back(group_->reduce_scatter_async(bucket, bucket + rank * shard, piece, DType::f32, ReduceOp::sum));
    return;
  }
  // bf16: as launch_sum, but only this rank's piece is widened back.
  launch_bf16(offset, n, rank * shard, shard, [&](bf16* scratch) {
    return group_->reduce_scatter_async(scratch, scratch + rank * shard, piece, DType::bf16, ReduceOp::sum);
  });
}

void GpuDataParallel::launch_all_stages() {
  const int n_stages = zero_ ? static_cast<int>(zero_->sharded.size()) : static_cast<int>(stage_ranges_.size());
  if (n_stages == 0) {
    for (const auto& [offset, n] : buckets_) launch_sum(offset, n);
    return;
  }
  for (int stage = 0; stage < n_stages; ++stage) launch_stage(stage);
}

void GpuDataParallel::join_launched() {
  for (auto& work : in_flight_) work->wait();
  in_flight_.clear();
  if (!side_pending_) return;
  for (int lane = 0; lane < kLanes; ++lane) {
    MOE_CUDA_CHECK(cudaEventRecord(as_event(side_done_[lane]), as_stream(side_stream_[lane])));
    MOE_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream_), as_event(side_done_[lane]), 0));
  }
  side_pending_ = false;
}

void GpuDataParallel::ensure_scratch(int64_t n) {
  if (n <= scratch_count_) return;
  if (scratch_) MOE_CUDA_CHECK(cudaFree(scratch_));
  scratch_ = nullptr;
  scratch_count_ = 0;
  MOE_CUDA_CHECK(cudaMalloc(&scratch_, static_cast<size_t>(n) * sizeof(double)));
  scratch_count_ = n;
}

void GpuDataParallel::reduce(double* values, int64_t n, ReduceOp op) {
  if (n <= 0) return;
  timed_blocking(stats_, [&] {
    ensure_scratch(n);
    const size_t bytes = static_cast<size_t>(n) * sizeof(double);
    MOE_CUDA_CHECK(cudaMemcpyAsync(scratch_, values, bytes, cudaMemcpyHostToDevice, as_stream(stream_)));
    (sum_group_ ? *sum_group_ : *group_).all_reduce(scratch_, static_cast<size_t>(n), DType::f64, op);
    MOE_CUDA_CHECK(cudaMemcpyAsync(values, scratch_, bytes, cudaMemcpyDeviceToHost, as_stream(stream_)));
    MOE_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream_)));
  });
}

void GpuDataParallel::sum(float* values, int64_t n) {
  constexpr int64_t kPiece = int64_t{1} << 24;  // floats per round trip (64 MB)
  if (n <= 0) return;
  timed_blocking(stats_, [&] {
    ensure_scratch((std::min(n, kPiece) + 1) / 2);
    auto* scratch = reinterpret_cast<float*>(scratch_);
    for (int64_t at = 0; at < n; at += kPiece) {
      const int64_t count = std::min(kPiece, n - at);
      const size_t bytes = static_cast<size_t>(count) * sizeof(float);
      MOE_CUDA_CHECK(cudaMemcpyAsync(scratch, values + at, bytes, cudaMemcpyHostToDevice, as_stream(stream_)));
      (sum_group_ ? *sum_group_ : *group_).all_reduce(scratch, static_cast<size_t>(count), DType::f32, ReduceOp::sum);
      MOE_CUDA_CHECK(cudaMemcpyAsync(values + at, scratch, bytes, cudaMemcpyDeviceToHost, as_stream(stream_)));
      MOE_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream_)));
    }
  });
}

void GpuDataParallel::all_reduce_grads() {
  cudaStream_t stream = as_stream(stream_);
  MOE_CUDA_CHECK(cudaEventRecord(as_event(sync_begin_), stream));
  launch_all_stages();
  launched_ = false;
  join_launched();  // the model's stream waits for every bucket
  MOE_CUDA_CHECK(cudaEventRecord(as_event(sync_end_), stream));
  MOE_CUDA_CHECK(cudaEventSynchronize(as_event(sync_end_)));
  float ms = 0;
  MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, as_event(sync_begin_), as_event(sync_end_)));
  const double seconds = static_cast<double>(ms) * 1e-3;
  stats_.grad_sync_s += seconds;
  // Nothing overlaps the all-reduce yet: the model's stream idles for all of it.
  stats_.wait_s += seconds;
}

void GpuDataParallel::set_stage_ranges(std::vector<RangeList> stage_ranges) {
  // Ranges inside the block, none overlapping another (they need not cover it: under
  // expert parallelism other experts' gradients are not this group's to sum).
  RangeList all;
  for (const auto& stage : stage_ranges) all.insert(all.end(), stage.begin(), stage.end());
  std::sort(all.begin(), all.end());
  int64_t end = 0;
  for (const auto& [offset, n] : all) {
    MOE_CHECK(offset >= end && n > 0, "GPU data parallel: the stages' ranges overlap at element {}", offset);
    end = offset + n;
  }
  MOE_CHECK(end <= count_, "GPU data parallel: the stages' ranges reach element {} of a {}-element block", end,
            count_);
  stage_ranges_ = std::move(stage_ranges);
  overlap_ = !stage_ranges_.empty();
}

void GpuDataParallel::set_zero_plan(ZeroShardPlan plan, bool overlap) {
  MOE_CHECK(plan.ranks == group_->size() && plan.rank == group_->rank(),
            "GPU data parallel: a ZeRO plan for rank {} of {} on rank {} of {}", plan.rank, plan.ranks, group_->rank(),
            group_->size());
  std::vector<RangeList> all(plan.sharded.size());
  for (size_t stage = 0; stage < plan.sharded.size(); ++stage) {
    all[stage] = plan.sharded[stage];
    all[stage].insert(all[stage].end(), plan.replicated[stage].begin(), plan.replicated[stage].end());
    for (const auto& [offset, n] : plan.sharded[stage])
      MOE_CHECK(n % (kZeroAlign * group_->size()) == 0 && n <= bucket_elems_ + kZeroAlign * group_->size(),
                "GPU data parallel: ZeRO bucket [{}, +{}) does not split into {} aligned pieces", offset, n,
                group_->size());
  }
  set_stage_ranges(std::move(all));  // the same checks: disjoint, inside the block
  overlap_ = overlap;
  zero_ = std::move(plan);
  if (!sum_group_) {
    sum_group_ = group_->split(0, group_->rank());  // collective: every rank sets its plan
    sum_group_->set_stream(stream_);
  }
}

void GpuDataParallel::gather_pieces(void* block, DType dtype, Layout layout, int stage) {
  MOE_CHECK(zero_.has_value(), "GPU data parallel: gather_pieces without a ZeRO plan");
  MOE_CHECK(dtype == DType::f32 || dtype == DType::bf16, "GPU data parallel: gather_pieces of 4- or 2-byte elements");
  cudaStream_t stream = as_stream(stream_);
  join_stage_gathers();
  const auto [begin, end] = next_timed_wait();
  MOE_CUDA_CHECK(cudaEventRecord(as_event(begin), stream));
  MOE_CHECK(stage < static_cast<int>(zero_->sharded.size()), "GPU data parallel: no backward stage {}", stage);
  for (size_t s = 0; s < zero_->sharded.size(); ++s)
    if (stage < 0 || static_cast<int>(s) == stage)
      if (auto last = gather_stage(s, block, dtype, layout)) last->wait();  // in order: the last one covers the stage
  MOE_CUDA_CHECK(cudaEventRecord(as_event(end), stream));
}

std::unique_ptr<Work> GpuDataParallel::gather_stage(size_t stage, void* block, DType dtype, Layout layout) {
  const size_t bytes = dtype == DType::f32 ? 4 : 2;
  std::unique_ptr<Work> last;
  const RangeList& buckets = layout == Layout::Weights ? zero_->weight_gathers[stage] : zero_->sharded[stage];
  if (buckets.empty()) return last;
  group_->group_begin();  // the stage's all-gathers as one NCCL group
  for (const auto& bucket : buckets) {
    const auto [piece_offset, piece_count] = zero_->piece(bucket, group_->rank());
    char* whole = static_cast<char*>(block) + static_cast<size_t>(bucket.offset) * bytes;
    const char* mine = static_cast<char*>(block) + static_cast<size_t>(piece_offset) * bytes;
    // In place: this rank's piece is where the gathered block keeps it.
    last = group_->all_gather_async(mine, whole, static_cast<size_t>(piece_count), dtype);
  }
  if (auto done = group_->group_end()) last = std::move(done);
  return last;
}

void GpuDataParallel::gather_pieces_by_stage(void* block, DType dtype, Layout layout) {
  MOE_CHECK(zero_.has_value(), "GPU data parallel: gather_pieces_by_stage without a ZeRO plan");
  MOE_CHECK(dtype == DType::f32 || dtype == DType::bf16, "GPU data parallel: gather of 4- or 2-byte elements");
  join_stage_gathers();
  stage_gathered_.resize(zero_->sharded.size());
  // The forward's order: the embedding (the last backward stage) first, the LM head last.
  for (size_t stage = zero_->sharded.size(); stage-- > 0;) stage_gathered_[stage] = gather_stage(stage, block, dtype, layout);
}

std::pair<void*, void*> GpuDataParallel::next_timed_wait() {
  if (timed_waits_used_ == timed_waits_.size()) {
    cudaEvent_t begin = nullptr, end = nullptr;
    MOE_CUDA_CHECK(cudaEventCreate(&begin));
    MOE_CUDA_CHECK(cudaEventCreate(&end));
    timed_waits_.emplace_back(begin, end);
  }
  return timed_waits_[timed_waits_used_++];
}

void GpuDataParallel::wait_stage(int stage) {
  if (stage < 0 || static_cast<size_t>(stage) >= stage_gathered_.size()) return;
  if (auto& work = stage_gathered_[static_cast<size_t>(stage)]) {
    // The events bracket the wait: the second runs only once the gather is done, so their
    // distance is how long the stream stood still here (about 0 when it was done already).
    const auto [begin, end] = next_timed_wait();
    MOE_CUDA_CHECK(cudaEventRecord(as_event(begin), as_stream(stream_)));
    work->wait();
    MOE_CUDA_CHECK(cudaEventRecord(as_event(end), as_stream(stream_)));
    work.reset();
  }
}

void GpuDataParallel::join_stage_gathers() {
  for (size_t stage = 0; stage < stage_gathered_.size(); ++stage) wait_stage(static_cast<int>(stage));
}

void GpuDataParallel::launch_stage(int stage) {
  MOE_CHECK(stage >= 0 && stage < static_cast<int>(stage_ranges_.size()), "GPU data parallel: no backward stage {}",
            stage);
  if (!launched_) MOE_CUDA_CHECK(cudaEventRecord(as_event(sync_begin_), as_stream(stream_)));
  launched_ = true;
  const size_t earlier = in_flight_.size();
  // fp32: the stage's collectives as one NCCL group, one kernel instead of one per bucket
  // (bf16's casts hop between side streams, so they go one by one).
  const bool grouped = reduce_dtype_ == DType::f32;
  if (grouped) group_->group_begin();
  if (zero_)
    for (const auto& [offset, n] : zero_->sharded[static_cast<size_t>(stage)]) launch_scatter(offset, n);
  // Buckets of at most the configured size, so one huge layer still streams. ZeRO-2: the
  // replicated ranges accumulate locally until the step's last micro-batch.
  const auto& sums = zero_ ? zero_->replicated[static_cast<size_t>(stage)] : stage_ranges_[static_cast<size_t>(stage)];
  if (zero_after_.empty() || last_micro_batch_)
    for (const auto& [offset, n] : sums)
      for (int64_t at = offset; at < offset + n; at += bucket_elems_) launch_sum(at, std::min(bucket_elems_, offset + n - at));
  if (grouped)
    if (auto done = group_->group_end()) in_flight_.push_back(std::move(done));
  if (zero_after_.empty()) return;
  // ZeRO-2: the earlier stages' scatters are done before the next stage's backward writes
  // the memory the stage before this one's gradients share.
  for (size_t i = 0; i < earlier; ++i) in_flight_[i]->wait();
  in_flight_.erase(in_flight_.begin(), in_flight_.begin() + static_cast<std::ptrdiff_t>(earlier));
  if (unzeroed_stage_ >= 0) zero_stage(unzeroed_stage_);
  unzeroed_stage_ = stage;
}

void GpuDataParallel::set_gradient_sharding(std::vector<RangeList> zero_after) {
  MOE_CHECK(zero_ && overlap_ && reduce_dtype_ == DType::f32,
            "GPU data parallel: ZeRO-2 needs an overlapped ZeRO plan with fp32 sums");
  MOE_CHECK(zero_after.size() == zero_->sharded.size(), "GPU data parallel: ZeRO-2 ranges for {} stages of {}",
            zero_after.size(), zero_->sharded.size());
  zero_after_ = std::move(zero_after);
}

void GpuDataParallel::set_weight_sharding(void* block) {
  MOE_CHECK(!zero_after_.empty() && block != nullptr, "GPU data parallel: ZeRO-3 needs ZeRO-2's gradient sharding");
  weights_ = block;
  stage_gathered_.resize(zero_->sharded.size());
}

void GpuDataParallel::fetch_stage(int stage) {
  if (stage < 0 || static_cast<size_t>(stage) >= stage_gathered_.size()) return;
  auto& work = stage_gathered_[static_cast<size_t>(stage)];
  if (work) return;  // in flight already
  work = gather_stage(static_cast<size_t>(stage), weights_, DType::bf16, Layout::Weights);
}

void GpuDataParallel::begin_forward_gathers() {
  if (!weights_) return;
  fetch_stage(static_cast<int>(stage_gathered_.size()) - 1);  // the embedding's, the forward's first
}

void GpuDataParallel::forward_stage(int stage) {
  if (!weights_) return wait_stage(stage);
  fetch_stage(stage - 1);  // the forward goes from the last backward stage to stage 0
  wait_stage(stage);
}

void GpuDataParallel::backward_stage_done(int stage) {
  if (!weights_) return;
  // Stages 1 and 2 are still there from the forward; the last (the embedding's: private
  // memory, gathered at the forward's start) needs no second gather.
  const int pooled_end = static_cast<int>(stage_gathered_.size()) - 1;
  if (stage + 2 >= 3 && stage + 2 < pooled_end) fetch_stage(stage + 2);
  wait_stage(stage + 1);
}

void GpuDataParallel::zero_stage(int stage) {
  for (const Range& r : zero_after_[static_cast<size_t>(stage)])
    MOE_CUDA_CHECK(cudaMemsetAsync(grads_ + r.offset, 0, static_cast<size_t>(r.count) * sizeof(float), as_stream(stream_)));
  unzeroed_stage_ = -1;
}

void GpuDataParallel::finish_overlapped() {
  cudaStream_t stream = as_stream(stream_);
  MOE_CUDA_CHECK(cudaEventRecord(as_event(backward_end_), stream));
  join_launched();
  if (unzeroed_stage_ >= 0) zero_stage(unzeroed_stage_);
  const bool launched = std::exchange(launched_, false);
  MOE_CUDA_CHECK(cudaEventRecord(as_event(sync_end_), stream));
  MOE_CUDA_CHECK(cudaEventSynchronize(as_event(sync_end_)));
  if (!launched) return;
  float sync_ms = 0, wait_ms = 0;
  MOE_CUDA_CHECK(cudaEventElapsedTime(&sync_ms, as_event(sync_begin_), as_event(sync_end_)));
  MOE_CUDA_CHECK(cudaEventElapsedTime(&wait_ms, as_event(backward_end_), as_event(sync_end_)));
  stats_.grad_sync_s += static_cast<double>(sync_ms) * 1e-3;
  stats_.wait_s += static_cast<double>(wait_ms) * 1e-3;
}

CommStats GpuDataParallel::take_stats() {
  // The weight gathers' waits since the last call.
  for (size_t i = 0; i < timed_waits_used_; ++i) {
    const auto [begin, end] = timed_waits_[i];
    MOE_CUDA_CHECK(cudaEventSynchronize(as_event(end)));
    float ms = 0;
    MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, as_event(begin), as_event(end)));
    stats_.wait_s += static_cast<double>(ms) * 1e-3;
  }
  timed_waits_used_ = 0;
  return std::exchange(stats_, CommStats{});
}

}  // namespace moe::dist

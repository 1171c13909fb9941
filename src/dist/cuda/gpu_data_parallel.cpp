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

// Bucket boundaries on 256-byte multiples keep NCCL's loads aligned.
constexpr int64_t kBucketAlign = 64;

}  // namespace

GpuDataParallel::GpuDataParallel(std::unique_ptr<Communicator> group, void* stream, float* grads, int64_t count,
                                 double bucket_mb, DType reduce_dtype)
    : group_(std::move(group)), stream_(stream), grads_(grads), count_(count), reduce_dtype_(reduce_dtype) {
  MOE_CHECK(group_ != nullptr, "GPU data parallel: no communicator");
  MOE_CHECK(group_->backend() == "nccl", "GPU data parallel needs the nccl backend, got '{}'", group_->backend());
  MOE_CHECK(grads_ != nullptr && count_ > 0, "GPU data parallel: no gradient block ({} elements)", count_);
  MOE_CHECK(bucket_mb >= 0, "parallel.bucket_mb must be >= 0, got {}", bucket_mb);
  MOE_CHECK(reduce_dtype_ == DType::f32 || reduce_dtype_ == DType::bf16,
            "GPU data parallel: gradients are summed in fp32 or bf16");
  group_->set_stream(stream_);
  int64_t per_bucket = count_;
  if (bucket_mb > 0) {
    per_bucket = static_cast<int64_t>(bucket_mb * 1e6 / sizeof(float)) / kBucketAlign * kBucketAlign;
    per_bucket = std::clamp<int64_t>(per_bucket, kBucketAlign, count_);
  }
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
      MOE_CUDA_CHECK(cudaMalloc(&bf16_scratch_[lane], static_cast<size_t>(bucket_elems_) * sizeof(bf16)));
    }
  }
}

GpuDataParallel::~GpuDataParallel() {
  if (scratch_) cudaFree(scratch_);
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
  // bf16: round, sum, widen back in place on the next lane; NCCL's stream takes the sums in
  // order, so the other lane's cast overlaps this bucket's sum.
  const int lane = next_lane_;
  next_lane_ = (next_lane_ + 1) % kLanes;
  cudaStream_t side = as_stream(side_stream_[lane]);
  auto* scratch = static_cast<bf16*>(bf16_scratch_[lane]);
  MOE_CUDA_CHECK(cudaEventRecord(as_event(side_ready_), as_stream(stream_)));
  MOE_CUDA_CHECK(cudaStreamWaitEvent(side, as_event(side_ready_), 0));
  cuda::cast_to_bf16(scratch, grads_ + offset, n, side);
  group_->set_stream(side);  // the all-reduce follows the cast; the widen follows the all-reduce
  group_->all_reduce_async(scratch, static_cast<size_t>(n), DType::bf16, ReduceOp::sum)->wait();
  group_->set_stream(stream_);
  cuda::cast_to_float(grads_ + offset, scratch, n, side);
  side_pending_ = true;
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

void GpuDataParallel::sum(double* values, int64_t n) {
  if (n <= 0) return;
  timed_blocking(stats_, [&] {
    ensure_scratch(n);
    const size_t bytes = static_cast<size_t>(n) * sizeof(double);
    MOE_CUDA_CHECK(cudaMemcpyAsync(scratch_, values, bytes, cudaMemcpyHostToDevice, as_stream(stream_)));
    group_->all_reduce(scratch_, static_cast<size_t>(n), DType::f64, ReduceOp::sum);
    MOE_CUDA_CHECK(cudaMemcpyAsync(values, scratch_, bytes, cudaMemcpyDeviceToHost, as_stream(stream_)));
    MOE_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream_)));
  });
}

void GpuDataParallel::all_reduce_grads() {
  cudaStream_t stream = as_stream(stream_);
  MOE_CUDA_CHECK(cudaEventRecord(as_event(sync_begin_), stream));
  for (const auto& [offset, n] : buckets_) launch_sum(offset, n);
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

void GpuDataParallel::set_stage_ranges(std::vector<std::vector<std::pair<int64_t, int64_t>>> stage_ranges) {
  // Ranges inside the block, none overlapping another (they need not cover it: under
  // expert parallelism other experts' gradients are not this group's to sum).
  std::vector<std::pair<int64_t, int64_t>> all;
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
}

void GpuDataParallel::launch_stage(int stage) {
  MOE_CHECK(stage >= 0 && stage < static_cast<int>(stage_ranges_.size()), "GPU data parallel: no backward stage {}",
            stage);
  if (!launched_) MOE_CUDA_CHECK(cudaEventRecord(as_event(sync_begin_), as_stream(stream_)));
  launched_ = true;
  // Buckets of at most the configured size, so one huge layer still streams.
  for (const auto& [offset, n] : stage_ranges_[static_cast<size_t>(stage)])
    for (int64_t at = offset; at < offset + n; at += bucket_elems_) launch_sum(at, std::min(bucket_elems_, offset + n - at));
}

void GpuDataParallel::finish_overlapped() {
  cudaStream_t stream = as_stream(stream_);
  MOE_CUDA_CHECK(cudaEventRecord(as_event(backward_end_), stream));
  join_launched();
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

CommStats GpuDataParallel::take_stats() { return std::exchange(stats_, CommStats{}); }

}  // namespace moe::dist

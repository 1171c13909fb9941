#include "optim/cuda/gpu_optimizer.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "core/gpu.h"
#include "core/range.h"
#include "model/cuda/gpu_parameter_zero.h"
#include "model/cuda/gpu_phases.h"
#include "optim/cuda/segment_set.h"
#include "optim/gpu_ops.h"

namespace moe {
namespace {

template <typename T>
using Buffer = gpu::DeviceArray<T>;

// The per-expert slices cut to one ZeRO-1 rank's ranges.
struct ExpertSliceSet {
  SegmentSet slices;  // segment_sq: the slices' sums of squares
  std::vector<int32_t> expert_of, first_X1;
  Buffer<int32_t> d_expert_of, d_first_X1;
};

}  // namespace

struct GpuOptimizer::State {
  GpuParameterStore* store = nullptr;
  cudaStream_t stream = nullptr;
  int64_t storage = 0;
  // Every parameter whole; under ZeRO-1 (set_step_ranges) the parts this rank steps and
  // the parts it adds to the norm, as separate sets (null: the whole set).
  SegmentSet whole;
  std::unique_ptr<SegmentSet> update_part, norm_part;
  SegmentSet& update_set() { return update_part ? *update_part : whole; }
  SegmentSet& norm_set() { return norm_part ? *norm_part : whole; }
  Buffer<adamw_math::AdamWScalars> scalars;
  // Pinned: the step's scalars on their way in, and the norm on its way out.
  adamw_math::AdamWScalars* host_in = nullptr;
  adamw_math::AdamWScalars* host_out = nullptr;
  cudaEvent_t in_copied = nullptr, out_copied = nullptr;

  // Per-expert clipping: the expert tensors cut into slices, one expert slot's part of one
  // tensor each, slot after slot; slot x owns slices first_slice_X1[x] ..
  // first_slice_X1[x+1] - 1. The device tables are made on first use.
  std::vector<cuda::OptimizerSegment> expert_slices;
  std::vector<int32_t> expert_of_slice, first_slice_X1{0};
  int64_t expert_slice_chunks = 0;
  Buffer<cuda::OptimizerSegment> d_expert_slices;
  Buffer<int32_t> d_expert_of_slice, d_first_slice_X1;
  Buffer<double> slice_chunk_sq, slice_sq, expert_norm;
  Buffer<float> expert_factor;
  Buffer<adamw_math::AdamWScalars> slice_scalars;  // grad_norm's scalars, unused here
  // ZeRO-1 (shard_expert_clip): the slices cut to this rank's norm and update ranges.
  std::unique_ptr<ExpertSliceSet> clip_norm_part, clip_scale_part;
  // The store's optimizer_ranges when the update set was cut, if packed then.
  RangeList update_state_ranges;

  // Whether block element `offset`'s gradient is bf16 (inside the store's bf16 ranges; a
  // parameter's extent is in them whole or not at all).
  int32_t bf16_grad_at(int64_t offset) const {
    for (const Range& r : store->bf16_grad_ranges())
      if (offset >= r.offset && offset < r.end()) return 1;
    return 0;
  }
  void sync() { MOE_CUDA_CHECK(cudaStreamSynchronize(stream)); }
  // The previous copy must have read host_in before it is overwritten.
  void upload_scalars(const adamw_math::AdamWScalars& s) {
    MOE_CUDA_CHECK(cudaEventSynchronize(in_copied));
    *host_in = s;
    MOE_CUDA_CHECK(cudaMemcpyAsync(scalars.data(), host_in, sizeof s, cudaMemcpyHostToDevice, stream));
    MOE_CUDA_CHECK(cudaEventRecord(in_copied, stream));
  }
  void fetch_result() {
    MOE_CUDA_CHECK(cudaMemcpyAsync(host_out, scalars.data(), sizeof *host_out, cudaMemcpyDeviceToHost, stream));
    MOE_CUDA_CHECK(cudaEventRecord(out_copied, stream));
  }
  void launch_norm(double max_norm) {
    SegmentSet& set = norm_set();
    cuda::grad_norm(scalars.data(), set.chunk_sq.data(), set.segment_sq.data(), store->grads(), set.segments.data(),
                    static_cast<int64_t>(set.host.size()), set.n_chunks, max_norm, stream, store->grads_bf16());
  }
  void launch_adamw() {
    SegmentSet& set = update_set();
    const StepState state = step_state(*store);
    MOE_CHECK(!state.packed || (update_part && optimizer_ranges(*store) == update_state_ranges),
              "GPU optimizer: the store's optimizer state was packed after set_step_ranges (call it after "
              "pack_optimizer_state)");
    const cuda::MomentState moments{state.m, state.v, state.m_scales, state.v_scales, store->moment_dtype()};
    if (moments.dtype == MomentDtype::Fp8 && !set.fp8_blocks_checked) {
      for (const cuda::OptimizerSegment& seg : set.host)
        MOE_CHECK((seg.state_offset >= 0 ? seg.state_offset : seg.offset) % adamw_math::kMomentBlock == 0,
                  "GPU optimizer: fp8 moments: the segment at element {} does not start on a block of {}", seg.offset,
                  adamw_math::kMomentBlock);
      set.fp8_blocks_checked = true;
    }
    cuda::multi_tensor_adamw(store->weights_hi(), state.lo, store->fp32_copies().block(), store->grads(), moments,
                             set.segments.data(), static_cast<int64_t>(set.host.size()), set.n_chunks,
                             scalars.data(), stream, store->grads_bf16());
  }
  // The parameters' segments cut to `ranges` (sorted, disjoint): a piece of a parameter
  // keeps its decay flag and the matching part of its fp32 copy; `with_state`: and where
  // its lo halves and moments are in the store (packed under ZeRO) and its hi halves (a
  // piece of an interleaved gate|up tensor cut again where it leaves an expert slice it
  // started inside: hi_piece).
  std::unique_ptr<SegmentSet> cut_to(const RangeList& ranges, bool with_state = false) const {
    RangeList spans;
    for (const cuda::OptimizerSegment& seg : whole.host) spans.emplace_back(seg.offset, seg.numel);
    std::vector<cuda::OptimizerSegment> pieces;
    for (const SpanPiece& part : cut_spans(spans, ranges)) {
      const cuda::OptimizerSegment& seg = whole.host[part.span];
      for (int64_t at = part.offset, end = part.offset + part.count; at < end;) {
        cuda::OptimizerSegment piece = seg;
        piece.offset = at;
        piece.numel = with_state ? hi_piece(seg, piece, end - at) : end - at;
        if (seg.mirror_offset >= 0) piece.mirror_offset = seg.mirror_offset + (at - seg.offset);
        if (with_state) piece.state_offset = state_offset(*store, at);
        pieces.push_back(piece);
        at += piece.numel;
      }
    }
    return std::make_unique<SegmentSet>(std::move(pieces));
  }
  // The piece of `seg` from piece.offset, at most `count` elements: how many it takes, and
  // where their hi halves are. From an expert slice's start: every slice to `count` (runs
  // as the whole tensor's); from inside one: to its end at most, one run.
  static int64_t hi_piece(const cuda::OptimizerSegment& seg, cuda::OptimizerSegment& piece, int64_t count) {
    if (seg.hi_run == 0) return count;
    const int64_t within = piece.offset - seg.offset, phase = within % seg.hi_run;
    piece.hi_offset = seg.hi_offset + within / seg.hi_run * seg.hi_stride + phase;
    if (phase == 0) return count;
    piece.hi_run = std::min(count, seg.hi_run - phase);
    return piece.hi_run;
  }
  // A parameter of an interleaved gate|up pair (the store's hi_interleave()): where its hi
  // halves are, expert slice by expert slice.
  void place_hi(cuda::OptimizerSegment& seg) const {
    for (const HiInterleave& pair : store->hi_interleave()) {
      if (seg.offset >= pair.end() || seg.offset + seg.numel <= pair.first) continue;
      const int64_t tensor = pair.experts * pair.per_expert;
      MOE_CHECK((seg.offset == pair.first || seg.offset == pair.first + tensor) && seg.numel == tensor,
                "GPU optimizer: the parameter at element {} is not one whole tensor of the interleaved gate|up pair "
                "at {}",
                seg.offset, pair.first);
      MOE_CHECK(pair.per_expert % adamw_math::kNormChunk == 0,
                "GPU optimizer: interleaved gate|up needs an expert's slice ({} elements) to be a multiple of {}",
                pair.per_expert, adamw_math::kNormChunk);
      seg.hi_offset = pair.hi_offset(seg.offset);
      seg.hi_run = pair.per_expert;
      seg.hi_stride = 2 * pair.per_expert;
    }
  }
  void build_expert_slices(const ParameterStore<float>& params);
  void ensure_clip_tables();
  std::unique_ptr<ExpertSliceSet> cut_expert_slices(const RangeList& ranges) const;
};

// Groups of parameters sharing an expert_group (optim/grad_clip.cpp), in registration
// order (the MoE layers' order); each group's tensors cut at the leading expert dimension.
void GpuOptimizer::State::build_expert_slices(const ParameterStore<float>& params) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int id = 0; id < params.size(); ++id) {
    const std::string& group = params.spec(id).expert_group;
    if (group.empty()) continue;
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == group; });
    if (it != groups.end()) it->second.push_back(id);
    else groups.emplace_back(group, std::vector<int>{id});
  }
  for (const auto& [group, ids] : groups) {
    const int64_t n_experts = params.spec(ids.front()).shape[0];
    for (int64_t e = 0; e < n_experts; ++e) {
      first_slice_X1.back() = static_cast<int32_t>(expert_slices.size());
      for (int id : ids) {
        const int64_t per_expert = params.numel(id) / n_experts;
        cuda::OptimizerSegment slice;
        slice.offset = params.offset(id) + e * per_expert;
        slice.numel = per_expert;
        slice.first_chunk = expert_slice_chunks;
        slice.bf16_grad = bf16_grad_at(slice.offset);
        expert_slice_chunks += (per_expert + adamw_math::kNormChunk - 1) / adamw_math::kNormChunk;
        expert_slices.push_back(slice);
        expert_of_slice.push_back(static_cast<int32_t>(first_slice_X1.size() - 1));
      }
      first_slice_X1.push_back(static_cast<int32_t>(expert_slices.size()));
    }
  }
}

void GpuOptimizer::State::ensure_clip_tables() {
  const size_t n_experts = first_slice_X1.size() - 1, n_slices = expert_slices.size();
  if (d_expert_slices.size() != 0) return;
  d_expert_slices = Buffer<cuda::OptimizerSegment>(n_slices);
  d_expert_slices.upload(expert_slices.data(), n_slices);
  d_expert_of_slice = Buffer<int32_t>(n_slices);
  d_expert_of_slice.upload(expert_of_slice.data(), n_slices);
  d_first_slice_X1 = Buffer<int32_t>(n_experts + 1);
  d_first_slice_X1.upload(first_slice_X1.data(), n_experts + 1);
  slice_chunk_sq = Buffer<double>(static_cast<size_t>(expert_slice_chunks));
  slice_sq = Buffer<double>(n_slices);
  expert_norm = Buffer<double>(n_experts);
  expert_factor = Buffer<float>(n_experts);
  slice_scalars = Buffer<adamw_math::AdamWScalars>(1);
}

std::unique_ptr<ExpertSliceSet> GpuOptimizer::State::cut_expert_slices(
    const RangeList& ranges) const {
  auto set = std::make_unique<ExpertSliceSet>();
  RangeList spans;
  for (const cuda::OptimizerSegment& slice : expert_slices) spans.emplace_back(slice.offset, slice.numel);
  const size_t n_experts = first_slice_X1.size() - 1;
  std::vector<cuda::OptimizerSegment> pieces;
  for (const SpanPiece& part : cut_spans(spans, ranges)) {
    cuda::OptimizerSegment piece;
    piece.offset = part.offset;
    piece.numel = part.count;
    piece.bf16_grad = expert_slices[part.span].bf16_grad;
    const int32_t expert = expert_of_slice[part.span];
    // Pieces keep the slices' order (expert after expert): expert x's start where the
    // first piece of an expert >= x is.
    while (static_cast<int32_t>(set->first_X1.size()) <= expert)
      set->first_X1.push_back(static_cast<int32_t>(pieces.size()));
    pieces.push_back(piece);
    set->expert_of.push_back(expert);
  }
  while (set->first_X1.size() <= n_experts) set->first_X1.push_back(static_cast<int32_t>(pieces.size()));
  set->slices = SegmentSet(std::move(pieces));  // numbers their chunks
  set->d_expert_of = Buffer<int32_t>(std::max<size_t>(1, set->expert_of.size()));
  if (!set->expert_of.empty()) set->d_expert_of.upload(set->expert_of.data(), set->expert_of.size());
  set->d_first_X1 = Buffer<int32_t>(set->first_X1.size());
  set->d_first_X1.upload(set->first_X1.data(), set->first_X1.size());
  return set;
}

GpuOptimizer::GpuOptimizer(GpuParameterStore& store, const ParameterStore<float>& params, void* stream)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.store = &store;
  s.stream = static_cast<cudaStream_t>(stream);
  s.storage = store.storage_numel();
  MOE_CHECK(params.storage_numel() == s.storage, "GPU optimizer: the host layout has {} elements, the device block {}",
            params.storage_numel(), s.storage);
  std::vector<cuda::OptimizerSegment> segments;
  for (int id = 0; id < params.size(); ++id) {
    cuda::OptimizerSegment seg;
    seg.offset = params.offset(id);
    seg.numel = params.numel(id);
    seg.mirror_offset = store.fp32_copies().offset(id);
    seg.decay = params.spec(id).weight_decay ? 1 : 0;
    seg.bf16_grad = s.bf16_grad_at(seg.offset);
    s.place_hi(seg);
    segments.push_back(seg);
  }
  MOE_CHECK(!segments.empty(), "GPU optimizer: the store has no parameters");
  s.whole = SegmentSet(std::move(segments));
  s.scalars = Buffer<adamw_math::AdamWScalars>(1);
  MOE_CUDA_CHECK(cudaMallocHost(&s.host_in, sizeof *s.host_in));
  MOE_CUDA_CHECK(cudaMallocHost(&s.host_out, sizeof *s.host_out));
  *s.host_in = adamw_math::AdamWScalars{};
  *s.host_out = adamw_math::AdamWScalars{};
  MOE_CUDA_CHECK(cudaEventCreateWithFlags(&s.in_copied, cudaEventDisableTiming));
  MOE_CUDA_CHECK(cudaEventCreateWithFlags(&s.out_copied, cudaEventDisableTiming));
  s.scalars.upload(s.host_in, 1);
  s.build_expert_slices(params);
}

GpuOptimizer::~GpuOptimizer() {
  State& s = *state_;
  if (s.in_copied) cudaEventDestroy(s.in_copied);
  if (s.out_copied) cudaEventDestroy(s.out_copied);
  if (s.host_in) cudaFreeHost(s.host_in);
  if (s.host_out) cudaFreeHost(s.host_out);
}

void GpuOptimizer::set_step_ranges(const RangeList& update,
                                   const RangeList& norm) {
  State& s = *state_;
  for (const auto* ranges : {&update, &norm}) {
    int64_t end = 0;
    for (const auto& [begin, count] : *ranges) {
      MOE_CHECK(begin >= end && count > 0 && begin + count <= s.storage,
                "GPU optimizer: step ranges must be sorted, disjoint and inside the {}-element block; got [{}, +{})",
                s.storage, begin, count);
      end = begin + count;
    }
  }
  s.update_part = s.cut_to(update, /*with_state=*/true);
  s.norm_part = s.cut_to(norm);
  if (step_state(*s.store).packed) s.update_state_ranges = optimizer_ranges(*s.store);
}

double GpuOptimizer::grad_norm() {
  State& s = *state_;
  if (s.norm_set().host.empty()) return 0.0;  // ZeRO-1: nothing of the norm on this rank
  s.launch_norm(0.0);
  s.fetch_result();
  return last_grad_norm();
}

void GpuOptimizer::adamw_step(const AdamWStep& hyper, float grad_scale) {
  State& s = *state_;
  MOE_CHECK(hyper.step >= 1, "adamw_step: step counts from 1, got {}", hyper.step);
  if (clock_) clock_->mark(kOptimizer, s.stream);
  adamw_math::AdamWScalars scalars =
      adamw_math::adamw_step_scalars(hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, hyper.step);
  scalars.grad_scale = grad_scale;
  s.upload_scalars(scalars);
  s.launch_adamw();
  s.sync();
  if (clock_) clock_->mark(kHost, s.stream);
}

void GpuOptimizer::clip_and_adamw_step(const AdamWStep& hyper, double max_norm) {
  State& s = *state_;
  MOE_CHECK(hyper.step >= 1, "clip_and_adamw_step: step counts from 1, got {}", hyper.step);
  MOE_CHECK(!s.norm_part, "clip_and_adamw_step: the optimizer is sharded (ZeRO-1): the norm must be summed over the "
                          "ranks first (grad_norm(), then adamw_step())");
  if (clock_) clock_->mark(kOptimizer, s.stream);
  s.upload_scalars(
      adamw_math::adamw_step_scalars(hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, hyper.step));
  s.launch_norm(max_norm);
  s.fetch_result();
  s.launch_adamw();
  if (clock_) clock_->mark(kHost, s.stream);
}

double GpuOptimizer::last_grad_norm() {
  MOE_CUDA_CHECK(cudaEventSynchronize(state_->out_copied));
  return state_->host_out->norm;
}

bool GpuOptimizer::last_step_skipped() {
  MOE_CUDA_CHECK(cudaEventSynchronize(state_->out_copied));
  return state_->host_out->skip != 0;
}

void GpuOptimizer::shard_expert_clip(const RangeList& norm,
                                     const RangeList& update) {
  State& s = *state_;
  s.clip_norm_part = s.cut_expert_slices(norm);
  s.clip_scale_part = s.cut_expert_slices(update);
}

std::vector<double> GpuOptimizer::clip_expert_grads(double max_norm,
                                                    const std::function<void(std::vector<double>&)>& sum_over_ranks) {
  State& s = *state_;
  const size_t n_experts = s.first_slice_X1.size() - 1, n_slices = s.expert_slices.size();
  if (n_slices == 0) return {};
  s.ensure_clip_tables();
  float* grads = s.store->grads();
  bf16* grads16 = s.store->grads_bf16();  // the expert slices' when bf16
  if (clock_) clock_->mark(kOptimizer, s.stream);
  if (s.clip_norm_part) {
    // ZeRO-1: this rank's partial sums of squares, added up over the ranks on the host.
    MOE_CHECK(sum_over_ranks != nullptr, "clip_expert_grads: sharded gradients need a sum over the ranks");
    ExpertSliceSet& part = *s.clip_norm_part;
    std::vector<double> squares(n_experts, 0.0);
    const SegmentSet& slices = part.slices;
    if (!slices.host.empty()) {
      cuda::grad_norm(s.slice_scalars.data(), slices.chunk_sq.data(), slices.segment_sq.data(), grads,
                      slices.segments.data(), static_cast<int64_t>(slices.host.size()), slices.n_chunks, 0.0, s.stream,
                      grads16);
      cuda::expert_clip_factors(s.expert_norm.data(), s.expert_factor.data(), slices.segment_sq.data(),
                                part.d_first_X1.data(), static_cast<int64_t>(n_experts), 0.0, s.stream);
      MOE_CUDA_CHECK(cudaMemcpyAsync(squares.data(), s.expert_norm.data(), n_experts * sizeof(double),
                                     cudaMemcpyDeviceToHost, s.stream));
      MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));
      for (double& x : squares) x *= x;  // the partial norms back to sums of squares
    }
    sum_over_ranks(squares);
    std::vector<double> norms(n_experts);
    std::vector<float> factors(n_experts, 1.0f);
    for (size_t x = 0; x < n_experts; ++x) {
      norms[x] = std::sqrt(squares[x]);
      if (max_norm > 0 && norms[x] > max_norm) factors[x] = static_cast<float>(max_norm / (norms[x] + 1e-6));
    }
    ExpertSliceSet& scale = *s.clip_scale_part;
    if (max_norm > 0 && !scale.slices.host.empty()) {
      s.expert_factor.upload(factors.data(), n_experts);
      cuda::scale_expert_slices(grads, scale.slices.segments.data(), scale.d_expert_of.data(),
                                static_cast<int64_t>(scale.slices.host.size()), s.expert_factor.data(), s.stream,
                                grads16);
    }
    if (clock_) clock_->mark(kHost, s.stream);
    return norms;
  }
  cuda::grad_norm(s.slice_scalars.data(), s.slice_chunk_sq.data(), s.slice_sq.data(), grads, s.d_expert_slices.data(),
                  static_cast<int64_t>(n_slices), s.expert_slice_chunks, 0.0, s.stream, grads16);
  cuda::expert_clip_factors(s.expert_norm.data(), s.expert_factor.data(), s.slice_sq.data(), s.d_first_slice_X1.data(),
                            static_cast<int64_t>(n_experts), max_norm, s.stream);
  if (max_norm > 0)
    cuda::scale_expert_slices(grads, s.d_expert_slices.data(), s.d_expert_of_slice.data(),
                              static_cast<int64_t>(n_slices), s.expert_factor.data(), s.stream, grads16);
  std::vector<double> norms(n_experts);
  MOE_CUDA_CHECK(cudaMemcpyAsync(norms.data(), s.expert_norm.data(), n_experts * sizeof(double),
                                 cudaMemcpyDeviceToHost, s.stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  if (clock_) clock_->mark(kHost, s.stream);
  return norms;
}

size_t GpuOptimizer::device_bytes() const {
  const State& s = *state_;
  return s.whole.bytes() + (s.update_part ? s.update_part->bytes() : 0) + (s.norm_part ? s.norm_part->bytes() : 0) +
         sizeof(adamw_math::AdamWScalars);
}

}  // namespace moe

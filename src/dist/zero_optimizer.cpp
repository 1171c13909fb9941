#include "dist/zero_optimizer.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <utility>

#include "core/error.h"
#include "dist/gradient_stages.h"
#include "optim/adamw.h"
#include "optim/grad_clip.h"

namespace moe::dist {

adamw_math::AdamWScalars adamw_scalars(const OptimizerConfig& config, double lr, int64_t step) {
  return adamw_math::adamw_step_scalars(lr, config.beta1, config.beta2, config.eps, config.weight_decay, step);
}


namespace {

// A parameter with the store's padding behind it (ParameterStore::allocate).
int64_t padded_numel(const ParameterStore<float>& params, int id) {
  return (params.numel(id) + kZeroAlign - 1) / kZeroAlign * kZeroAlign;
}

RangeList padded_extents(const ParameterStore<float>& params, const std::vector<int>& ids) {
  RangeList ranges;
  for (int id : ids) ranges.emplace_back(params.offset(id), padded_numel(params, id));
  std::sort(ranges.begin(), ranges.end());
  return ranges;
}

}  // namespace

ZeroShardPlan plan_zero_for_store(const ParameterStore<float>& params,
                                  const std::function<int(const std::string&)>& stage_of, int n_stages,
                                  const std::vector<int>& keep_whole, const std::vector<int>& left_out,
                                  double bucket_mb, int ranks, int rank) {
  std::vector<RangeList> stages = gradient_ranges_by_stage(params, stage_of, n_stages);
  if (!left_out.empty()) {
    const RangeList out = padded_extents(params, left_out);
    for (RangeList& stage : stages) stage = subtract_ranges(stage, out);
  }
  return plan_zero_shards(stages, padded_extents(params, keep_whole),
                          gradient_bucket_elems(bucket_mb, params.storage_numel()), ranks, rank);
}

ZeroOptimizer::ZeroOptimizer(ParameterStore<float>& params, ZeroShardPlan plan, Communicator& group,
                             const OptimizerConfig& config, CommStats& stats, int level)
    : params_(params), plan_(std::move(plan)), group_(group), config_(config), stats_(stats), level_(level) {
  MOE_CHECK(level_ >= 0 && level_ <= 3, "ZeRO optimizer: no level {}", level_);
  MOE_CHECK(plan_.ranks == group_.size() && plan_.rank == group_.rank(),
            "ZeRO optimizer: a plan for rank {} of {} on rank {} of {}", plan_.rank, plan_.ranks, group_.rank(),
            group_.size());
  // The parameters the plan covers: each lies whole inside its ranges or outside them.
  const RangeList covered = merged_ranges({plan_.sharded, plan_.replicated});
  MOE_CHECK(covered.empty() || covered.back().end() <= params_.storage_numel(),
            "ZeRO optimizer: the plan reaches past the block of {} elements", params_.storage_numel());
  for (int id = 0; id < params_.size(); ++id) {
    const int64_t begin = params_.offset(id), end = begin + params_.numel(id);
    auto after = std::upper_bound(covered.begin(), covered.end(), Range{begin, INT64_MAX});
    const bool starts_inside = after != covered.begin() && std::prev(after)->end() > begin;
    const bool inside = starts_inside && std::prev(after)->end() >= end;
    const bool meets_next = after != covered.end() && after->offset < end;
    MOE_CHECK(inside || (!starts_inside && !meets_next), "ZeRO optimizer: the plan covers part of parameter {}",
              params_.spec(id).name);
    if (inside) ids_.push_back(id);
  }
  update_ = segments_of(plan_.update);
  norm_ = segments_of(plan_.norm);
  const int64_t state = update_.empty() ? 0 : update_.back().state + update_.back().count;
  m_.assign(static_cast<size_t>(state), 0.0f);
  v_.assign(static_cast<size_t>(state), 0.0f);
  others_ = others_pieces(plan_);
}

std::vector<ZeroOptimizer::Segment> ZeroOptimizer::segments_of(const RangeList& ranges) const {
  std::vector<int> by_offset = ids_;
  std::sort(by_offset.begin(), by_offset.end(), [&](int a, int b) { return params_.offset(a) < params_.offset(b); });
  std::vector<Segment> segments;
  int64_t state = 0;
  size_t first = 0;  // the first parameter not wholly before the current range
  for (const auto& [begin, count] : ranges) {
    const int64_t end = begin + count;
    while (first < by_offset.size() && params_.offset(by_offset[first]) + params_.numel(by_offset[first]) <= begin)
      ++first;
    for (size_t k = first; k < by_offset.size() && params_.offset(by_offset[k]) < end; ++k) {
      const int id = by_offset[k];
      const int64_t lo = std::max(begin, params_.offset(id)), hi = std::min(end, params_.offset(id) + params_.numel(id));
      if (lo >= hi) continue;
      segments.push_back({id, lo, hi - lo, state});
      state += hi - lo;
    }
  }
  return segments;
}

void ZeroOptimizer::on_stage(int stage) {
  // ZeRO-2/3 sum the buckets on every micro-batch (the replicated ranges still once a step).
  const bool every_micro_batch = level_ >= 2;
  if (!armed_ && !every_micro_batch) return;
  MOE_CHECK(stage >= 0 && stage < static_cast<int>(plan_.sharded.size()), "ZeRO optimizer: no backward stage {}",
            stage);
  float* grads = params_.grads_data();
  const auto s = static_cast<size_t>(stage);
  const bool replicated = armed_ && !plan_.replicated[s].empty();
  if (!issued_ && (!plan_.sharded[s].empty() || replicated)) {
    issued_ = true;
    first_issue_ = CommClock::now();
  }
  std::vector<std::unique_ptr<Work>>& scatters =
      every_micro_batch ? scattering_.emplace_back(Scatter{stage, {}}).works : in_flight_;
  for (const auto& bucket : plan_.sharded[s]) {
    // In place: this rank's sums land in its own piece of the bucket.
    const auto [piece, count] = plan_.piece(bucket, plan_.rank);
    scatters.push_back(group_.reduce_scatter_async(grads + bucket.offset, grads + piece, static_cast<size_t>(count),
                                                   DType::f32, ReduceOp::sum));
  }
  if (armed_)
    for (const auto& [begin, count] : plan_.replicated[s])
      in_flight_.push_back(
          group_.all_reduce_async(grads + begin, static_cast<size_t>(count), DType::f32, ReduceOp::sum));
  poll();
  // One stage in flight while the next computes: at most two stages' whole gradients live.
  if (every_micro_batch) retire_scatters(1);
}

void ZeroOptimizer::retire_scatters(size_t keep) {
  while (scattering_.size() > keep) {
    Scatter& oldest = scattering_.front();
    for (auto& work : oldest.works)
      if (work) {
        timed_wait(*work, stats_);
        last_complete_ = CommClock::now();
      }
    params_.release_grads(others_[static_cast<size_t>(oldest.stage)]);
    scattering_.erase(scattering_.begin());
  }
}

void ZeroOptimizer::end_micro_batch() {
  if (level_ < 2) return;
  retire_scatters(0);
  if (!armed_) settle_timing();  // else finish() waits for the replicated ranges and times the round
}

RangeList ZeroOptimizer::gradients_to_zero(const RangeList& resident) const {
  return level_ >= 2 ? subtract_ranges(resident, merged_ranges({others_})) : resident;
}

void ZeroOptimizer::settle_timing() {
  if (issued_) stats_.grad_sync_s += seconds_between(first_issue_, last_complete_);
  issued_ = false;
}

// MPI progresses non-blocking collectives inside MPI calls: testing them between layers
// keeps the reductions moving while backward computes.
void ZeroOptimizer::poll() {
  for (auto& work : in_flight_)
    if (work && work->done()) {
      work.reset();
      last_complete_ = CommClock::now();
    }
}

void ZeroOptimizer::finish() {
  const bool nothing = std::all_of(plan_.sharded.begin(), plan_.sharded.end(), [](const auto& s) { return s.empty(); }) &&
                       std::all_of(plan_.replicated.begin(), plan_.replicated.end(), [](const auto& s) { return s.empty(); });
  MOE_CHECK(!armed_ || issued_ || nothing, "ZeRO gradient sync armed but nothing was issued");
  for (auto& work : in_flight_)
    if (work) {
      timed_wait(*work, stats_);
      work.reset();
      last_complete_ = CommClock::now();
    }
  in_flight_.clear();
  retire_scatters(0);
  settle_timing();
  armed_ = false;
}

double ZeroOptimizer::shard_sum_of_squares() const {
  const float* grads = params_.grads_data();
  double sum = 0;
  for (const auto& [begin, count] : plan_.norm) sum += sum_of_squares(grads + begin, count);
  return sum;
}

void ZeroOptimizer::scale_gradients(float factor) {
  float* grads = params_.grads_data();
  for (const auto& [begin, count] : plan_.update)
    for (int64_t i = begin; i < begin + count; ++i) grads[i] *= factor;
}

template <class F>
void ZeroOptimizer::for_expert_elements(const std::vector<Segment>& segments, const std::vector<int>& group_of_id,
                                        F&& f) const {
  for (const Segment& segment : segments) {
    const int group = group_of_id[static_cast<size_t>(segment.id)];
    if (group < 0) continue;
    const int64_t E = params_.spec(segment.id).shape[0], per_expert = params_.numel(segment.id) / E;
    const int64_t first = segment.begin - params_.offset(segment.id);  // element index inside the tensor
    for (int64_t i = 0; i < segment.count; ++i)
      f(segment.begin + i, static_cast<size_t>(group * E + (first + i) / per_expert));
  }
}

void ZeroOptimizer::add_expert_sums_of_squares(const std::vector<int>& group_of_id, std::vector<double>& sums) const {
  const float* grads = params_.grads_data();
  for_expert_elements(norm_, group_of_id, [&](int64_t at, size_t expert) {
    const double g = grads[at];
    sums[expert] += g * g;
  });
}

void ZeroOptimizer::scale_experts(const std::vector<int>& group_of_id, const std::vector<float>& factors) {
  float* grads = params_.grads_data();
  for_expert_elements(update_, group_of_id, [&](int64_t at, size_t expert) { grads[at] *= factors[expert]; });
}

void ZeroOptimizer::gather_pieces(float* block) {
  std::vector<std::unique_ptr<Work>> gathers;
  for (const auto& stage : plan_.sharded)
    for (const auto& bucket : stage) {
      // In place: this rank's piece is where the gathered bucket keeps it.
      const auto [piece, count] = plan_.piece(bucket, plan_.rank);
      gathers.push_back(group_.all_gather_async(block + piece, block + bucket.offset, static_cast<size_t>(count), DType::f32));
    }
  for (auto& work : gathers) timed_wait(*work, stats_);
}

void ZeroOptimizer::step(double lr) {
  ++steps_;
  const adamw_math::AdamWScalars c = adamw_scalars(config_, lr, steps_);
  float* values = params_.values_data();
  const float* grads = params_.grads_data();
  for (const Segment& s : update_)
    adamw_update_range(values + s.begin, grads + s.begin, m_.data() + s.state, v_.data() + s.state, s.count,
                       s.begin, c, params_.spec(s.id).weight_decay ? c.decay_factor : 1.0f,
                       config_.state_dtype);
  // The replicated ranges came out the same on every rank; the pieces travel (ZeRO-3:
  // when a stage is next needed, ZeroParameterGather).
  if (level_ < 3) gather_pieces(values);
}

void ZeroOptimizer::gather_moments(const std::function<int64_t(int)>& moment_offset, std::vector<float>& m,
                                   std::vector<float>& v) {
  // Every rank's part in the block's layout, the pieces gathered in place, then the
  // parameters' elements packed in the single-process layout.
  std::vector<float> block(static_cast<size_t>(params_.storage_numel()));
  for (auto [state, full] : {std::pair{&m_, &m}, std::pair{&v_, &v}}) {
    std::fill(block.begin(), block.end(), 0.0f);
    for (const Segment& s : update_)
      std::memcpy(block.data() + s.begin, state->data() + s.state, static_cast<size_t>(s.count) * sizeof(float));
    gather_pieces(block.data());
    for (int id : ids_)
      std::memcpy(full->data() + moment_offset(id), block.data() + params_.offset(id),
                  static_cast<size_t>(params_.numel(id)) * sizeof(float));
  }
}

std::vector<ZeroOptimizer::MomentSlice> ZeroOptimizer::moment_slices() {
  const RangeList whole = merged_ranges({plan_.replicated});
  std::vector<MomentSlice> slices;
  for (const Segment& s : update_) {
    // Split the segment where it enters and leaves the replicated ranges.
    int64_t at = s.begin;
    const int64_t end = s.begin + s.count;
    while (at < end) {
      auto next = std::upper_bound(whole.begin(), whole.end(), Range{at, INT64_MAX});
      const bool inside = next != whole.begin() && std::prev(next)->end() > at;
      int64_t stop = end;
      if (inside) stop = std::min(end, std::prev(next)->end());
      else if (next != whole.end()) stop = std::min(end, next->offset);
      const int64_t state = s.state + (at - s.begin);
      slices.push_back({s.id, at - params_.offset(s.id), stop - at, m_.data() + state, v_.data() + state,
                        params_.values_data() + at, inside});
      at = stop;
    }
  }
  return slices;
}

void ZeroOptimizer::scatter_moments(const std::function<int64_t(int)>& moment_offset, const std::vector<float>& m,
                                    const std::vector<float>& v) {
  for (const Segment& s : update_) {
    const int64_t from = moment_offset(s.id) + (s.begin - params_.offset(s.id));
    std::memcpy(m_.data() + s.state, m.data() + from, static_cast<size_t>(s.count) * sizeof(float));
    std::memcpy(v_.data() + s.state, v.data() + from, static_cast<size_t>(s.count) * sizeof(float));
  }
}

}  // namespace moe::dist

#include "dist/zero_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "optim/grad_clip.h"

namespace moe::dist {

adamw_math::AdamWScalars adamw_scalars(const OptimizerConfig& config, double lr, int64_t step) {
  return adamw_math::adamw_step_scalars(lr, config.beta1, config.beta2, config.eps, config.weight_decay, step);
}

void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const adamw_math::AdamWScalars& s,
                  bool decay, bool bf16_moments) {
  const float d = decay ? s.decay_factor : 1.0f;
#pragma omp parallel for schedule(static) if (n >= (1 << 14))
  for (int64_t i = 0; i < n; ++i) p[i] = adamw_math::adamw_update(p[i], g[i], m[i], v[i], s, d, bf16_moments);
}

ZeroOptimizer::ZeroOptimizer(ParameterStore<float>& params, std::vector<int> ids,
                             const std::function<int(int)>& stage_of, int n_stages, double bucket_mb,
                             Communicator& group, const OptimizerConfig& config, CommStats& stats)
    : params_(params), group_(group), config_(config), stats_(stats) {
  const auto bucket_elements = static_cast<int64_t>(bucket_mb * 1e6 / sizeof(float));
  const int64_t N = group_.size();
  Bucket current;
  auto close = [&](int stage) {
    if (current.pieces.empty()) return;
    current.last_stage = stage;
    current.shard = (current.numel + N - 1) / N;
    buckets_.push_back(std::move(current));
    current = Bucket{};
  };
  for (int stage = 0; stage < n_stages; ++stage) {
    for (int id : ids) {
      if (stage_of(id) != stage) continue;
      current.pieces.push_back({id, current.numel, params_.numel(id)});
      current.numel += params_.numel(id);
    }
    if (current.numel >= bucket_elements) close(stage);
  }
  close(n_stages - 1);
  int64_t offset = 0;
  for (Bucket& b : buckets_) {
    b.state_offset = offset;
    offset += b.shard;
    b.send.assign(static_cast<size_t>(b.shard * N), 0.0f);
    b.gathered.assign(static_cast<size_t>(b.shard * N), 0.0f);
    b.mine.assign(static_cast<size_t>(b.shard), 0.0f);
  }
  grad_.assign(static_cast<size_t>(offset), 0.0f);
  m_.assign(static_cast<size_t>(offset), 0.0f);
  v_.assign(static_cast<size_t>(offset), 0.0f);
}

int64_t ZeroOptimizer::total_numel() const {
  int64_t n = 0;
  for (const Bucket& b : buckets_) n += b.numel;
  return n;
}

template <class F>
void ZeroOptimizer::for_my_part(const Bucket& b, F&& f) const {
  const int64_t lo = group_.rank() * b.shard, hi = std::min(lo + b.shard, b.numel);
  for (const Piece& piece : b.pieces) {
    const int64_t first = std::max(lo, piece.offset), last = std::min(hi, piece.offset + piece.numel);
    if (first >= last) continue;
    f(piece, first - piece.offset, last - first, b.state_offset + (first - lo));
  }
}

void ZeroOptimizer::on_stage(int stage) {
  if (!armed_) return;
  for (Bucket& b : buckets_) {
    if (b.last_stage != stage) continue;
    for (const Piece& piece : b.pieces)
      std::memcpy(b.send.data() + piece.offset, params_.grad(piece.id), static_cast<size_t>(piece.numel) * sizeof(float));
    if (!issued_) {
      issued_ = true;
      first_issue_ = CommClock::now();
    }
    b.complete = false;
    b.work = group_.reduce_scatter_async(b.send.data(), grad_.data() + b.state_offset, static_cast<size_t>(b.shard),
                                         DType::f32, ReduceOp::sum);
  }
  poll();
}

// MPI progresses non-blocking collectives inside MPI calls: testing them between layers
// keeps the reductions moving while backward computes.
void ZeroOptimizer::poll() {
  for (Bucket& b : buckets_) {
    if (!b.work || b.complete) continue;
    if (b.work->done()) {
      b.complete = true;
      last_complete_ = CommClock::now();
    }
  }
}

void ZeroOptimizer::finish() {
  MOE_CHECK(!armed_ || issued_ || buckets_.empty(), "ZeRO gradient sync armed but no bucket was issued");
  for (Bucket& b : buckets_) {
    if (!b.work) continue;
    if (!b.complete) {
      timed_wait(*b.work, stats_);
      b.complete = true;
      last_complete_ = CommClock::now();
    }
    b.work.reset();
  }
  if (issued_) stats_.grad_sync_s += seconds_between(first_issue_, last_complete_);
  armed_ = false;
  issued_ = false;
}

double ZeroOptimizer::shard_sum_of_squares() const { return sum_of_squares(grad_.data(), static_cast<int64_t>(grad_.size())); }

void ZeroOptimizer::scale_gradients(float factor) {
  for (float& g : grad_) g *= factor;
}

void ZeroOptimizer::add_expert_sums_of_squares(const std::vector<int>& group_of_id, std::vector<double>& sums) const {
  for (const Bucket& b : buckets_)
    for_my_part(b, [&](const Piece& piece, int64_t first, int64_t count, int64_t at) {
      const int group = group_of_id[static_cast<size_t>(piece.id)];
      if (group < 0) return;
      const int64_t E = params_.spec(piece.id).shape[0], per_expert = piece.numel / E;
      for (int64_t i = 0; i < count; ++i) {
        const double g = grad_[static_cast<size_t>(at + i)];
        sums[static_cast<size_t>(group * E + (first + i) / per_expert)] += g * g;
      }
    });
}

void ZeroOptimizer::scale_experts(const std::vector<int>& group_of_id, const std::vector<float>& factors) {
  for (const Bucket& b : buckets_)
    for_my_part(b, [&](const Piece& piece, int64_t first, int64_t count, int64_t at) {
      const int group = group_of_id[static_cast<size_t>(piece.id)];
      if (group < 0) return;
      const int64_t E = params_.spec(piece.id).shape[0], per_expert = piece.numel / E;
      for (int64_t i = 0; i < count; ++i)
        grad_[static_cast<size_t>(at + i)] *= factors[static_cast<size_t>(group * E + (first + i) / per_expert)];
    });
}

void ZeroOptimizer::step(double lr) {
  ++steps_;
  const adamw_math::AdamWScalars c = adamw_scalars(config_, lr, steps_);
  const bool bf16 = config_.state_dtype == MomentDtype::Bf16;
  for (Bucket& b : buckets_) {
    std::fill(b.mine.begin(), b.mine.end(), 0.0f);
    for_my_part(b, [&](const Piece& piece, int64_t first, int64_t count, int64_t at) {
      float* p = params_.value(piece.id) + first;
      adamw_update(p, grad_.data() + at, m_.data() + at, v_.data() + at, count, c, params_.spec(piece.id).weight_decay,
                   bf16);
      std::memcpy(b.mine.data() + (at - b.state_offset), p, static_cast<size_t>(count) * sizeof(float));
    });
    b.work = group_.all_gather_async(b.mine.data(), b.gathered.data(), static_cast<size_t>(b.shard), DType::f32);
  }
  for (Bucket& b : buckets_) {
    timed_wait(*b.work, stats_);
    b.work.reset();
    for (const Piece& piece : b.pieces) {
      // This rank's part is already in place (and identical).
      std::memcpy(params_.value(piece.id), b.gathered.data() + piece.offset, static_cast<size_t>(piece.numel) * sizeof(float));
    }
  }
}

void ZeroOptimizer::gather_moments(const std::function<int64_t(int)>& moment_offset, std::vector<float>& m,
                                   std::vector<float>& v) {
  for (Bucket& b : buckets_)
    for (auto [shards, full] : {std::pair{&m_, &m}, std::pair{&v_, &v}}) {
      // Every rank's shard of the bucket, back to back, is the bucket's layout (+ padding).
      timed_blocking(stats_, [&] {
        group_.all_gather(shards->data() + b.state_offset, b.gathered.data(), static_cast<size_t>(b.shard), DType::f32);
      });
      for (const Piece& piece : b.pieces)
        std::memcpy(full->data() + moment_offset(piece.id), b.gathered.data() + piece.offset,
                    static_cast<size_t>(piece.numel) * sizeof(float));
    }
}

void ZeroOptimizer::scatter_moments(const std::function<int64_t(int)>& moment_offset, const std::vector<float>& m,
                                    const std::vector<float>& v) {
  for (const Bucket& b : buckets_)
    for_my_part(b, [&](const Piece& piece, int64_t first, int64_t count, int64_t at) {
      const int64_t from = moment_offset(piece.id) + first;
      std::memcpy(m_.data() + at, m.data() + from, static_cast<size_t>(count) * sizeof(float));
      std::memcpy(v_.data() + at, v.data() + from, static_cast<size_t>(count) * sizeof(float));
    });
}

}  // namespace moe::dist

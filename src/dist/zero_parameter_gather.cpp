#include "dist/zero_parameter_gather.h"

#include <algorithm>
#include <utility>

#include "core/error.h"

namespace moe::dist {

ZeroParameterGather::ZeroParameterGather(ParameterStore<float>& params, const ZeroShardPlan& plan,
                                         Communicator& group, CommStats& stats, std::vector<std::vector<int>> reads)
    : params_(params), plan_(plan), group_(group), stats_(stats), reads_(std::move(reads)) {
  const size_t n = plan_.sharded.size();
  MOE_CHECK(reads_.size() == n, "ZeRO-3: what {} stages read, for {} stages", reads_.size(), n);
  for (const auto& stages : reads_)
    for (int s : stages) MOE_CHECK(s >= 0 && static_cast<size_t>(s) < n, "ZeRO-3: a stage reads stage {} of {}", s, n);
  others_ = others_pieces(plan_);
  state_.assign(n, State::Present);  // every rank starts from the same initial values
  gathers_.resize(n);
  release_all();
}

ZeroParameterGather::~ZeroParameterGather() {
  for (auto& works : gathers_)
    for (auto& work : works)
      if (work) work->wait();
}

void ZeroParameterGather::issue(int stage) {
  const auto s = static_cast<size_t>(stage);
  if (state_[s] != State::Released) return;
  float* values = params_.values_data();
  for (const Range& bucket : plan_.sharded[s]) {
    // In place: this rank's piece is where the gathered bucket keeps it.
    const Range own = plan_.piece(bucket, plan_.rank);
    gathers_[s].push_back(group_.all_gather_async(values + own.offset, values + bucket.offset,
                                                  static_cast<size_t>(own.count), DType::f32));
  }
  state_[s] = State::InFlight;
}

void ZeroParameterGather::wait(int stage) {
  const auto s = static_cast<size_t>(stage);
  if (state_[s] != State::InFlight) return;
  for (auto& work : gathers_[s]) timed_wait(*work, stats_);
  gathers_[s].clear();
  state_[s] = State::Present;
}

void ZeroParameterGather::release(int stage) {
  wait(stage);
  params_.release_values(others_[static_cast<size_t>(stage)]);
  state_[static_cast<size_t>(stage)] = State::Released;
}

void ZeroParameterGather::needed(int stage, bool backward) {
  for (int read : reads_[static_cast<size_t>(stage)]) {
    issue(read);
    wait(read);
  }
  // Prefetch: the pass's next stage gathers while this one computes.
  const int next = backward ? stage + 1 : stage - 1;
  if (next >= 0 && next < static_cast<int>(reads_.size()))
    for (int read : reads_[static_cast<size_t>(next)]) issue(read);
}

bool ZeroParameterGather::read_later(int stage, bool backward, int read) const {
  const int n = static_cast<int>(reads_.size());
  // The forward's last stage (0) is the backward's first: what it reads stays.
  const int from = backward ? stage + 1 : 0, to = backward ? n : std::max(stage, 1);
  for (int s = from; s < to; ++s) {
    const auto& reads = reads_[static_cast<size_t>(s)];
    if (std::find(reads.begin(), reads.end(), read) != reads.end()) return true;
  }
  return false;
}

void ZeroParameterGather::done(int stage, bool backward) {
  for (int read : reads_[static_cast<size_t>(stage)])
    if (!read_later(stage, backward, read)) release(read);
  // MPI moves non-blocking collectives along inside MPI calls: test the prefetch.
  for (auto& works : gathers_)
    for (auto& work : works) work->done();
}

void ZeroParameterGather::release_all() {
  for (size_t s = 0; s < state_.size(); ++s) release(static_cast<int>(s));
}

void ZeroParameterGather::gather_all() {
  for (size_t s = 0; s < state_.size(); ++s) issue(static_cast<int>(s));
  for (size_t s = 0; s < state_.size(); ++s) wait(static_cast<int>(s));
}

int64_t ZeroParameterGather::gathered_elements() const {
  int64_t n = 0;
  for (size_t s = 0; s < state_.size(); ++s)
    if (state_[s] != State::Released)
      for (const Range& r : others_[s]) n += r.count;
  return n;
}

}  // namespace moe::dist

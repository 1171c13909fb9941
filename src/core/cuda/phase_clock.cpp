#include "core/cuda/phase_clock.h"

#include <algorithm>
#include <utility>

#include "core/cuda/sm_clocks.h"
#include "core/error.h"
#include "core/gpu.h"

namespace moe::gpu {

PhaseClock::PhaseClock(std::vector<std::string> phase_names)
    : names_(std::move(phase_names)), ms_(names_.size(), 0.0) {}

void PhaseClock::set_sm_clocks(bool on) {
  if (!on) {
    sm_clocks_.reset();
    return;
  }
  if (!sm_clocks_) sm_clocks_ = std::make_unique<SmClocks>(static_cast<int>(names_.size()));
  last_phase_ = -1;  // no interval before the first stamp
}

std::vector<double> PhaseClock::take_sm_mhz() {
  if (!sm_clocks_) return {};
  MOE_CUDA_CHECK(cudaDeviceSynchronize());  // the marks' stamps may be on several streams
  return sm_clocks_->take_mhz(nullptr);
}

PhaseClock::~PhaseClock() {
  for (cudaEvent_t event : events_) cudaEventDestroy(event);
}

void PhaseClock::mark(int phase, cudaStream_t stream) {
  MOE_CHECK(phase >= 0 && static_cast<size_t>(phase) < names_.size(), "phase clock: no phase {} ({} named)", phase,
            names_.size());
  nvtx_.begin(names_[static_cast<size_t>(phase)].c_str());
  if (!enabled_) return;
  if (sm_clocks_) {
    sm_clocks_->stamp(last_phase_, stream);
    last_phase_ = phase;
  }
  if (used_ == events_.size()) {
    cudaEvent_t event;
    MOE_CUDA_CHECK(cudaEventCreate(&event));
    events_.push_back(event);
  }
  MOE_CUDA_CHECK(cudaEventRecord(events_[used_], stream));
  phase_of_.resize(used_ + 1);
  phase_of_[used_++] = phase;
}

// Charges the recorded intervals, keeping the last event as the start of the next one.
void PhaseClock::collect() {
  if (used_ < 2) return;
  MOE_CUDA_CHECK(cudaEventSynchronize(events_[used_ - 1]));
  for (size_t i = 1; i < used_; ++i) {
    float elapsed = 0;
    MOE_CUDA_CHECK(cudaEventElapsedTime(&elapsed, events_[i - 1], events_[i]));
    ms_[static_cast<size_t>(phase_of_[i - 1])] += elapsed;
  }
  std::swap(events_[0], events_[used_ - 1]);
  phase_of_[0] = phase_of_[used_ - 1];
  used_ = 1;
}

std::vector<std::pair<std::string, double>> PhaseClock::take() {
  collect();
  std::vector<std::pair<std::string, double>> times;
  for (size_t phase = 0; phase < names_.size(); ++phase) times.emplace_back(names_[phase], ms_[phase]);
  std::fill(ms_.begin(), ms_.end(), 0.0);
  return times;
}

}  // namespace moe::gpu

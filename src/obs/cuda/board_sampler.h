// BoardSampler: a thread that reads the current CUDA device's SM clock, power draw and
// clock-event reasons (power cap, thermal) through NVML every `period` between start()
// and stop(). NVML is the driver's libnvidia-ml.so.1, opened at run time, so the binary
// also starts without a driver (CI): the sampler then says why and collects nothing.
#pragma once
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "obs/board_power.h"

namespace moe {

class BoardSampler {
 public:
  // The device current on the calling thread.
  explicit BoardSampler(std::chrono::milliseconds period = std::chrono::milliseconds(100));
  ~BoardSampler();
  BoardSampler(const BoardSampler&) = delete;
  BoardSampler& operator=(const BoardSampler&) = delete;

  bool available() const { return device_ != nullptr; }
  const std::string& unavailable_reason() const { return reason_; }
  void start();  // drops earlier samples; no-op without NVML
  void stop();
  std::vector<BoardSample> samples() const;
  BoardSummary summary() const;  // of the samples so far
  BoardSummary take_summary();   // of the samples so far, which it drops (sampling goes on)

 private:
  void run();
  bool sample(BoardSample& out) const;

  std::chrono::milliseconds period_;
  void* device_ = nullptr;  // nvmlDevice_t
  std::string reason_;
  double max_sm_mhz_ = 0, power_limit_w_ = 0;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool running_ = false;
  std::vector<BoardSample> samples_;
  std::thread thread_;
};

}  // namespace moe

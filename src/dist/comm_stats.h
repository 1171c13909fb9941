// What communication cost one training step: time blocked waiting on it, the gradient
// synchronisation's latency, and the expert-parallel all-to-all's volume and speed.
// The parallel pieces (ZeRO buckets, expert exchanges, batch sums) add into one of these;
// the trainer takes it once per step.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>

#include "dist/communicator.h"

namespace moe::dist {

using CommClock = std::chrono::steady_clock;

inline double seconds_between(CommClock::time_point a, CommClock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct CommStats {
  double wait_s = 0;          // blocked in wait() or in a blocking collective
  double grad_sync_s = 0;     // first gradient bucket issued -> last one complete
  int64_t a2a_bytes = 0;      // expert exchange: bytes sent to other ranks (token rows both ways, counts, routing)
  double a2a_s = 0;           // per exchange, issue -> observed completion, summed
  int64_t a2a_exchanges = 0;
  int64_t a2a_off_node_bytes = 0;  // the part of a2a_bytes' token rows sent to ranks of other nodes

  double a2a_bandwidth() const { return a2a_s > 0 ? static_cast<double>(a2a_bytes) / a2a_s : 0; }
  void add(const CommStats& o) {
    wait_s += o.wait_s;
    grad_sync_s += o.grad_sync_s;
    a2a_bytes += o.a2a_bytes;
    a2a_s += o.a2a_s;
    a2a_exchanges += o.a2a_exchanges;
    a2a_off_node_bytes += o.a2a_off_node_bytes;
  }
};

// Waits for `work`, adding the time blocked to stats.wait_s.
inline void timed_wait(Work& work, CommStats& stats) {
  const auto start = CommClock::now();
  work.wait();
  stats.wait_s += seconds_between(start, CommClock::now());
}

// Runs a blocking collective, adding its time to stats.wait_s.
template <class F>
void timed_blocking(CommStats& stats, F&& collective) {
  const auto start = CommClock::now();
  collective();
  stats.wait_s += seconds_between(start, CommClock::now());
}

}  // namespace moe::dist

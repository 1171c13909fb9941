// A progress line for long start-up work (tokenizing a large corpus): quiet for the first
// `quiet_seconds`, so small runs print nothing, then at most one update per
// `interval_seconds` with the bytes and documents done and the rate.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace moe {

class ProgressLine {
 public:
  // `out` receives whole lines ("\r"-refreshed in place when it is a terminal).
  ProgressLine(std::string label, int64_t total_bytes, std::FILE* out = stderr, double quiet_seconds = 2.0,
               double interval_seconds = 1.0);
  void update(int64_t bytes_done, int64_t docs_done);
  // Ends the line if one was printed (a last update with the totals).
  void finish(int64_t bytes_done, int64_t docs_done);
  int updates_printed() const { return printed_; }

 private:
  using Clock = std::chrono::steady_clock;
  void print(int64_t bytes_done, int64_t docs_done, bool last);

  std::string label_;
  int64_t total_bytes_;
  std::FILE* out_;
  bool tty_;
  double quiet_seconds_, interval_seconds_;
  Clock::time_point start_, last_;
  int printed_ = 0;
};

}  // namespace moe

// Thread control. OpenMP owns the parallelism; OpenBLAS always runs single-threaded
// inside our fixed-size tiles, so results do not depend on the thread count.
#pragma once
#include <cstdint>
#include <iosfwd>
#include <string_view>

namespace moe {

// The most threads a thread-count setting (training.threads, --threads) may ask for:
// more is refused as a typo (OpenMP crashes trying to start 100000 threads).
inline constexpr int64_t kMaxThreads = 1024;

// n <= 0 means "all cores". Returns the count in effect.
int set_num_threads(int n);
int num_threads();
// The cores this process may run on (its affinity mask).
int available_cores();

// Throws ConfigError "`name` must be between 0 (all cores) and 1024, got N" unless
// 0 <= requested <= kMaxThreads.
void check_thread_count(int64_t requested, std::string_view name);
// The thread count to use for `requested`: 0 is every core; above the core count it is
// lowered to the core count (more threads than cores only slow the run down, and results
// do not depend on the count), with a warning line on `warnings`. Checks it first.
int threads_in_effect(int64_t requested, std::string_view name, std::ostream& warnings);

}  // namespace moe

#include "dist/all_reduce_bench.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

#include "core/error.h"
#include "dist/comm_util.h"
#include "dist/communicator.h"
#include "dist/launch_env.h"

namespace moe::dist {
namespace {

// Element i of rank r's buffer: small integers, so every sum over the ranks is exact in fp32.
float element(int rank, int64_t i) { return static_cast<float>((rank + 1) * ((i % 13) + 1)); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

AllReduceSweep run_all_reduce_bench(Communicator& world, int64_t min_bytes, int64_t max_bytes, int warmup, int iters,
                                    std::ostream& out) {
  MOE_CHECK(iters > 0, "allreduce-bench: --iters must be positive, got {}", iters);
  MOE_CHECK(warmup >= 0, "allreduce-bench: --warmup must not be negative, got {}", warmup);
  MOE_CHECK(min_bytes >= 4 && min_bytes % 4 == 0 && max_bytes % 4 == 0 && min_bytes <= max_bytes,
            "allreduce-bench: --min-bytes {} and --max-bytes {} must be multiples of 4 with 4 <= min <= max", min_bytes,
            max_bytes);
  const int n = world.size(), me = world.rank();
  const LaunchEnv env = read_launch_env();
  int per_node = env.world_size == n ? env.local_size : n;
  if (world.ranks_per_node() > 0) per_node = world.ranks_per_node();  // simulated nodes (threads)
  AllReduceSweep sweep;
  sweep.ranks = n;
  sweep.nodes = std::max(1, n / std::max(1, per_node));
  std::shared_ptr<void> buffer = world.allocate(static_cast<size_t>(max_bytes));
  if (me == 0)
    fmt::print(out,
               "allreduce-bench: backend {}, {} ranks ({} node(s) of {}); fp32 sums, median of {} after {} warm-up, "
               "the slowest rank's time; busbw = algbw x 2 (n - 1) / n\n{:>14} {:>10} {:>10} {:>10} {:>5}\n",
               world.backend(), n, sweep.nodes, per_node, iters, warmup, "bytes", "ms", "algbw GB/s",
               "busbw GB/s", "sums");
  for (int64_t bytes = min_bytes;; bytes = std::min(bytes * 2, max_bytes)) {
    const int64_t count = bytes / 4;
    std::vector<float> host(static_cast<size_t>(count));
    std::vector<double> seconds;
    for (int it = 0; it < warmup + iters; ++it) {
      // Fresh inputs every time: the sum is in place.
      for (int64_t i = 0; i < count; ++i) host[static_cast<size_t>(i)] = element(me, i);
      world.copy(buffer.get(), host.data(), static_cast<size_t>(bytes));
      world.synchronize();
      world.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      world.all_reduce(buffer.get(), static_cast<size_t>(count), DType::f32, ReduceOp::sum);
      world.synchronize();
      const auto t1 = std::chrono::steady_clock::now();
      if (it >= warmup) seconds.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
    all_reduce_host(world, seconds.data(), seconds.size(), DType::f64, ReduceOp::max);
    world.copy(host.data(), buffer.get(), static_cast<size_t>(bytes));
    world.synchronize();
    double bad = 0;
    const double ranks_sum = static_cast<double>(n) * (n + 1) / 2;
    for (int64_t i = 0; i < count && bad == 0; ++i)
      if (host[static_cast<size_t>(i)] != static_cast<float>(ranks_sum * ((i % 13) + 1))) bad = 1;
    all_reduce_host(world, &bad, 1, DType::f64, ReduceOp::max);
    AllReduceBenchResult r;
    r.bytes = static_cast<double>(bytes);
    r.ms = median(seconds) * 1e3;
    r.alg_gb_per_s = r.bytes / 1e9 / (r.ms / 1e3);
    r.bus_gb_per_s = r.alg_gb_per_s * 2.0 * (n - 1) / n;
    r.sums_ok = bad == 0;
    sweep.results.push_back(r);
    if (me == 0)
      fmt::print(out, "{:>14} {:>10.4f} {:>10.2f} {:>10.2f} {:>5}\n", bytes, r.ms, r.alg_gb_per_s, r.bus_gb_per_s,
                 r.sums_ok ? "ok" : "WRONG");
    if (bytes == max_bytes) break;
  }
  return sweep;
}

}  // namespace moe::dist

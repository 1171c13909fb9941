// `moe allreduce-bench`: NCCL-tests' all-reduce sweep over the launch's ranks, the curve
// the step simulator reads for data-parallel reductions (moe plan --simulate
// --collectives). For each size, doubling from min_bytes to max_bytes: the median over
// iterations of the slowest rank's time, the algorithm bandwidth (bytes / time) and the bus
// bandwidth (algbw x 2 (n - 1) / n, the ring's bytes per link: comparable across rank
// counts), and a check of every summed element.
#pragma once
#include <cstdint>
#include <ostream>
#include <vector>

namespace moe::dist {

class Communicator;

struct AllReduceBenchResult {
  double bytes = 0;  // the buffer, fp32 elements x 4
  double ms = 0;
  double alg_gb_per_s = 0, bus_gb_per_s = 0;
  bool sums_ok = false;
};

struct AllReduceSweep {
  int ranks = 0, nodes = 0;
  std::vector<AllReduceBenchResult> results;
};

// Collective over world. Rank 0 prints the table. min_bytes and max_bytes: multiples of 4,
// 4 <= min_bytes <= max_bytes.
AllReduceSweep run_all_reduce_bench(Communicator& world, int64_t min_bytes, int64_t max_bytes, int warmup, int iters,
                                    std::ostream& out);

}  // namespace moe::dist

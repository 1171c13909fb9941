// `moe allreduce-bench` over the test world (4 ranks; 2 simulated nodes of 2 when
// MOE_RANKS_PER_NODE=2): every size from 4 bytes doubling to the largest (also when it is
// not a power of two), every sum checked, the bus bandwidth NCCL-tests' 2 (n - 1) / n of
// the algorithm bandwidth, and rank 0 alone prints the table.
#include <gtest/gtest.h>

#include <sstream>

#include "comm_mpi_world.h"
#include "core/error.h"
#include "dist/all_reduce_bench.h"

namespace moe::dist {
namespace {

using testing::world;

TEST(AllReduceBench, EverySizeSumsRight) {
  std::ostringstream out;
  const AllReduceSweep sweep = run_all_reduce_bench(world(), 4, 3000, 1, 2, out);
  ASSERT_EQ(sweep.results.size(), 11u);  // 4, 8, ..., 2048 (10 sizes), then 3000
  EXPECT_EQ(sweep.ranks, world().size());
  EXPECT_GE(sweep.nodes, 1);
  double expected = 4;
  for (const AllReduceBenchResult& r : sweep.results) {
    EXPECT_EQ(r.bytes, std::min(expected, 3000.0));
    expected *= 2;
    EXPECT_TRUE(r.sums_ok) << r.bytes;
    EXPECT_GT(r.ms, 0) << r.bytes;
    EXPECT_NEAR(r.bus_gb_per_s, r.alg_gb_per_s * 2.0 * (sweep.ranks - 1) / sweep.ranks, 1e-9 * r.alg_gb_per_s);
  }
  if (world().rank() == 0) {
    EXPECT_NE(out.str().find("busbw"), std::string::npos) << out.str();
    EXPECT_EQ(out.str().find("WRONG"), std::string::npos) << out.str();
  } else {
    EXPECT_TRUE(out.str().empty());
  }
}

TEST(AllReduceBench, RejectsBadSizesAndCounts) {
  std::ostringstream out;
  EXPECT_THROW(run_all_reduce_bench(world(), 4, 64, 1, 0, out), Error);
  EXPECT_THROW(run_all_reduce_bench(world(), 4, 64, -1, 2, out), Error);
  EXPECT_THROW(run_all_reduce_bench(world(), 6, 64, 1, 2, out), Error);
  EXPECT_THROW(run_all_reduce_bench(world(), 128, 64, 1, 2, out), Error);
}

}  // namespace
}  // namespace moe::dist

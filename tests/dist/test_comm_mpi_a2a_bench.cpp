// `moe a2a-bench` over the test world (4 ranks; 2 simulated nodes of 2 when
// MOE_RANKS_PER_NODE=2): both exchanges deliver every row (the bench checks each one),
// the round trip restores the sent rows, and rank 0 prints a line per kind.
#include <gtest/gtest.h>

#include <sstream>

#include "comm_mpi_world.h"
#include "core/error.h"
#include "dist/all_to_all_bench.h"

namespace moe::dist {
namespace {

using testing::world;

RunConfig small_config() {
  RunConfig c;
  c.model.dim = 24;  // 24 bf16 per row: blocks not a multiple of 16 bytes
  c.model.seq_len = 17;
  c.model.moe.n_experts = 4;
  c.model.moe.top_k = 3;  // 2 x 17 x 3 = 102 rows: not a multiple of 4, uneven blocks
  c.training.micro_batch = 2;
  return c;
}

TEST(AllToAllBench, FlatAndHierarchicalDeliverEveryRow) {
  std::ostringstream out;
  const auto results = run_all_to_all_bench(small_config(), world(), 1, 3, out);
  ASSERT_EQ(results.size(), 2u);
  for (const AllToAllBenchResult& r : results) {
    EXPECT_TRUE(r.rows_ok) << name_of(r.kind);
    EXPECT_GT(r.dispatch_ms, 0) << name_of(r.kind);
    EXPECT_GT(r.combine_ms, 0) << name_of(r.kind);
  }
  EXPECT_EQ(results[0].kind, AllToAllKind::Flat);
  EXPECT_EQ(results[1].kind, AllToAllKind::Hierarchical);
  if (world().rank() == 0) {
    EXPECT_NE(out.str().find("flat"), std::string::npos) << out.str();
    EXPECT_NE(out.str().find("rows checked"), std::string::npos) << out.str();
  } else {
    EXPECT_TRUE(out.str().empty());
  }
}

TEST(AllToAllBench, RejectsBadIterationCounts) {
  std::ostringstream out;
  EXPECT_THROW(run_all_to_all_bench(small_config(), world(), 1, 0, out), Error);
  EXPECT_THROW(run_all_to_all_bench(small_config(), world(), -1, 3, out), Error);
}

}  // namespace
}  // namespace moe::dist

// The GPU backend's routing counters summed over the ranks (host code: runs without a GPU):
// every counter, the speculative dispatch's rows and the dispatch waits in one sum.
#include <gtest/gtest.h>

#include "train/backends/cuda/gpu_routing_report.h"

namespace moe {
namespace {

TEST(GpuRoutingReport, OneSumCarriesEveryCounter) {
  GpuRoutingStats routing;
  routing.kept = {{1, 2}, {3, 4}};
  routing.entropy_sum = {0.5, 0.25};
  routing.tokens = {10, 20};
  routing.speculation = {SpeculationRows{0, 0, 0}, SpeculationRows{5, 6, 7}};
  routing.dispatch_wait_s = {0.125, 0.375};
  std::vector<std::vector<int64_t>> load = {{8, 9}, {10, 11}};
  int calls = 0;
  sum_routing_over_ranks(routing, load, [&](double* v, int64_t n) {  // two ranks with the same counters
    ++calls;
    for (int64_t i = 0; i < n; ++i) v[i] *= 2;
  });
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(load, (std::vector<std::vector<int64_t>>{{16, 18}, {20, 22}}));
  EXPECT_EQ(routing.kept, (std::vector<std::vector<int64_t>>{{2, 4}, {6, 8}}));
  EXPECT_EQ(routing.entropy_sum, (std::vector<double>{1.0, 0.5}));
  EXPECT_EQ(routing.tokens, (std::vector<int64_t>{20, 40}));
  EXPECT_EQ(routing.speculation[1].used, 10);
  EXPECT_EQ(routing.speculation[1].wasted, 12);
  EXPECT_EQ(routing.speculation[1].corrected, 14);
  EXPECT_EQ(routing.dispatch_wait_s, (std::vector<double>{0.25, 0.75}));
}

}  // namespace
}  // namespace moe

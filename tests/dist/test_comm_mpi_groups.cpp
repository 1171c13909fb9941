// Process-group layouts (EP=4, DP=4, DP2xEP2, nodes of 2 when MOE_RANKS_PER_NODE=2) and
// the flat and hierarchical all-to-all, which must agree bit for bit with each other and
// with the serial reference.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "comm_mpi_world.h"
#include "core/error.h"
#include "dist/hierarchical_all_to_all.h"
#include "dist/launch_env.h"
#include "dist/process_groups.h"

namespace moe::dist {
namespace {

using testing::world;

// World ranks of the group's members, in group order.
std::vector<int32_t> members_of(Communicator& group) {
  int32_t me = world().rank();
  std::vector<int32_t> members(group.size());
  group.all_gather(&me, members.data(), 1, DType::i32);
  return members;
}

std::vector<int32_t> ranks_where(int world_size, const std::function<bool(int)>& keep) {
  std::vector<int32_t> ranks;
  for (int r = 0; r < world_size; ++r)
    if (keep(r)) ranks.push_back(r);
  return ranks;
}

void check_layout(int ep, int ranks_per_node) {
  Communicator& comm = world();
  const int W = comm.size(), r = comm.rank();
  ProcessGroups groups = make_process_groups(comm, ep, ranks_per_node);
  const int rpn = ranks_per_node;
  EXPECT_EQ(groups.ranks_per_node, rpn);
  EXPECT_EQ(groups.n_nodes, W / rpn);
  EXPECT_EQ(groups.node, r / rpn);
  EXPECT_EQ(groups.local_rank, r % rpn);
  SCOPED_TRACE("ep " + std::to_string(ep) + ", ranks per node " + std::to_string(rpn));
  EXPECT_EQ(members_of(*groups.world), ranks_where(W, [](int) { return true; }));
  EXPECT_EQ(members_of(*groups.data_parallel), ranks_where(W, [](int) { return true; }));
  EXPECT_EQ(members_of(*groups.expert_parallel), ranks_where(W, [&](int q) { return q / ep == r / ep; }));
  EXPECT_EQ(groups.expert_parallel->rank(), r % ep);
  EXPECT_EQ(members_of(*groups.expert_data_parallel), ranks_where(W, [&](int q) { return q % ep == r % ep; }));
  EXPECT_EQ(members_of(*groups.intra_node), ranks_where(W, [&](int q) { return q / rpn == r / rpn; }));
  EXPECT_EQ(groups.intra_node->rank(), r % rpn);
  EXPECT_EQ(members_of(*groups.inter_node), ranks_where(W, [&](int q) { return q % rpn == r % rpn; }));
  EXPECT_EQ(groups.inter_node->rank(), r / rpn);
}

TEST(ProcessGroups, ExpertParallelOverTheWorld) { check_layout(world().size(), world().size()); }
TEST(ProcessGroups, DataParallelOnly) { check_layout(1, world().size()); }
TEST(ProcessGroups, DataParallelTimesExpertParallel) {
  if (world().size() % 2) GTEST_SKIP() << "needs an even world";
  check_layout(2, world().size());
}
TEST(ProcessGroups, TwoNodesOfTwo) {
  if (world().size() != 4) GTEST_SKIP() << "needs 4 ranks";
  check_layout(4, 2);  // EP groups span both nodes
  check_layout(2, 2);  // one EP group per node
  check_layout(1, 2);
}

TEST(ProcessGroups, NodesFromTheLaunchEnvironment) {
  const LaunchEnv env = read_launch_env();
  ProcessGroups groups = make_process_groups(world(), 1);
  EXPECT_EQ(groups.ranks_per_node, env.local_size);
  EXPECT_EQ(groups.node, env.node_rank);
  EXPECT_EQ(groups.local_rank, env.local_rank);
}

TEST(ProcessGroups, BadLayoutsAreConfigErrors) {
  const int W = world().size();
  // Checked before any split, on every rank alike, so nobody is left in a collective.
  EXPECT_THROW(make_process_groups(world(), W + 1, W), ConfigError);
  EXPECT_THROW(make_process_groups(world(), 0, W), ConfigError);
  EXPECT_THROW(make_process_groups(world(), 1, W + 1), ConfigError);
  if (W == 4) EXPECT_THROW(make_process_groups(world(), 4, 3), ConfigError);
}

// Send buffer of float32 tokens (value encodes source, destination, index) with random
// ragged counts (seeded so that all ranks agree), zero rows included.
struct Exchange {
  std::vector<int64_t> send_counts, recv_counts;
  std::vector<float> send, expected;
};

Exchange make_exchange(int group_size, int me, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int64_t> counts(static_cast<size_t>(group_size * group_size));  // [src][dst]
  for (int64_t& c : counts) c = rng() % 3 == 0 ? 0 : rng() % 9;
  Exchange e;
  for (int p = 0; p < group_size; ++p) {
    e.send_counts.push_back(counts[me * group_size + p]);
    e.recv_counts.push_back(counts[p * group_size + me]);
    for (int64_t i = 0; i < e.send_counts.back(); ++i) e.send.push_back(static_cast<float>(me * 10000 + p * 100 + i));
    for (int64_t i = 0; i < e.recv_counts.back(); ++i) e.expected.push_back(static_cast<float>(p * 10000 + me * 100 + i));
  }
  return e;
}

void check_flat_equals_hierarchical(ProcessGroups& groups, Communicator& ep_group) {
  auto flat = make_all_to_all(AllToAllKind::Flat, ep_group, groups);
  auto hierarchical = make_all_to_all(AllToAllKind::Hierarchical, ep_group, groups);
  EXPECT_EQ(flat->name(), "flat");
  EXPECT_EQ(hierarchical->name(), "hierarchical");
  for (uint32_t seed = 1; seed <= 8; ++seed) {
    Exchange e = make_exchange(ep_group.size(), ep_group.rank(), seed);
    std::vector<float> by_flat(e.expected.size(), -1.0f), by_hierarchical(e.expected.size(), -2.0f);
    flat->exchange(e.send.data(), e.send_counts, by_flat.data(), e.recv_counts, DType::f32);
    hierarchical->exchange_async(e.send.data(), e.send_counts, by_hierarchical.data(), e.recv_counts, DType::f32)
        ->wait();
    EXPECT_EQ(by_flat, e.expected) << "seed " << seed;
    const size_t bytes = by_flat.size() * sizeof(float);  // memcmp's pointers must not be null, even for 0 bytes
    EXPECT_EQ(0, bytes == 0 ? 0 : std::memcmp(by_flat.data(), by_hierarchical.data(), bytes)) << "seed " << seed;
  }
  // The free function gives the same.
  Exchange e = make_exchange(ep_group.size(), ep_group.rank(), 99);
  std::vector<float> out(e.expected.size());
  all_to_all_v_hierarchical(groups, ep_group, e.send.data(), e.send_counts, out.data(), e.recv_counts, DType::f32);
  EXPECT_EQ(out, e.expected);
}

TEST(HierarchicalAllToAll, MatchesFlatWithEpOverAllNodes) {
  ProcessGroups groups = make_process_groups(world(), world().size());
  check_flat_equals_hierarchical(groups, *groups.expert_parallel);
}

TEST(HierarchicalAllToAll, MatchesFlatOnTwoSimulatedNodesOfTwo) {
  if (world().size() != 4) GTEST_SKIP() << "needs 4 ranks";
  ProcessGroups groups = make_process_groups(world(), 4, 2);
  check_flat_equals_hierarchical(groups, *groups.expert_parallel);
  ProcessGroups per_node = make_process_groups(world(), 2, 2);  // EP inside a node: hierarchical = flat
  check_flat_equals_hierarchical(per_node, *per_node.expert_parallel);
}


}  // namespace
}  // namespace moe::dist

// Rank identity from each launcher's variables, and the errors for inconsistent ones.
#include <gtest/gtest.h>

#include "core/error.h"
#include "dist/launch_env.h"

namespace moe::dist {
namespace {

TEST(LaunchEnv, NoLauncherIsAWorldOfOne) {
  const LaunchEnv env = parse_launch_env(std::map<std::string, std::string>{});
  EXPECT_EQ(env.source, "none");
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.n_nodes, 1);
}

TEST(LaunchEnv, Mpirun) {
  const LaunchEnv env = parse_launch_env({{"OMPI_COMM_WORLD_RANK", "5"},
                                          {"OMPI_COMM_WORLD_SIZE", "8"},
                                          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(env.source, "mpirun");
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_size, 4);
  EXPECT_EQ(env.node_rank, 1);
  EXPECT_EQ(env.n_nodes, 2);
}

TEST(LaunchEnv, Slurm) {
  const LaunchEnv env = parse_launch_env({{"SLURM_PROCID", "6"},
                                          {"SLURM_NTASKS", "8"},
                                          {"SLURM_LOCALID", "2"},
                                          {"SLURM_NODEID", "1"},
                                          {"SLURM_NNODES", "2"},
                                          {"MASTER_ADDR", "node0"},
                                          {"MASTER_PORT", "29500"}});
  EXPECT_EQ(env.source, "slurm");
  EXPECT_EQ(env.rank, 6);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.local_size, 4);
  EXPECT_EQ(env.node_rank, 1);
  EXPECT_EQ(env.n_nodes, 2);
  EXPECT_EQ(env.master_addr, "node0");
  EXPECT_EQ(env.master_port, 29500);
}

TEST(LaunchEnv, TorchrunStyle) {
  const LaunchEnv env = parse_launch_env({{"RANK", "3"},
                                          {"WORLD_SIZE", "4"},
                                          {"LOCAL_RANK", "1"},
                                          {"LOCAL_WORLD_SIZE", "2"},
                                          {"GROUP_RANK", "1"},
                                          {"MASTER_ADDR", "10.0.0.1"},
                                          {"MASTER_PORT", "1234"}});
  EXPECT_EQ(env.source, "torchrun");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_size, 2);
  EXPECT_EQ(env.node_rank, 1);
  EXPECT_EQ(env.n_nodes, 2);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 1234);
}

// torchrun's agent keeps its TCPStore on MASTER_PORT while the workers run: our rendezvous
// goes to the next port; MOE_RENDEZVOUS_PORT names another; `moe launch` (no
// TORCHELASTIC_RUN_ID) keeps MASTER_PORT, which it reserved for us.
TEST(LaunchEnv, RendezvousPortBesideTorchrunsStore) {
  std::map<std::string, std::string> vars = {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                             {"MASTER_PORT", "29500"}};
  LaunchEnv env = parse_launch_env(vars);
  EXPECT_FALSE(env.torchelastic);
  EXPECT_EQ(env.rendezvous_port, 29500);
  vars["TORCHELASTIC_RUN_ID"] = "none";
  env = parse_launch_env(vars);
  EXPECT_TRUE(env.torchelastic);
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(env.rendezvous_port, 29501);
  vars["MASTER_PORT"] = "65535";
  EXPECT_EQ(parse_launch_env(vars).rendezvous_port, 65534);
  vars["MOE_RENDEZVOUS_PORT"] = "4321";
  EXPECT_EQ(parse_launch_env(vars).rendezvous_port, 4321);
  vars["MOE_RENDEZVOUS_PORT"] = "0";
  EXPECT_THROW(parse_launch_env(vars), ConfigError);
}

TEST(LaunchEnv, TorchrunVariablesWinOverSlurmOnes) {
  // `moe launch` started by srun: the workers' own RANK counts, not the launcher's task id.
  const LaunchEnv env = parse_launch_env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"RANK", "1"},
                                          {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}});
  EXPECT_EQ(env.source, "torchrun");
  EXPECT_EQ(env.rank, 1);
}

TEST(LaunchEnv, SimulatedNodes) {
  const LaunchEnv env = parse_launch_env({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "3"},
                                          {"LOCAL_WORLD_SIZE", "4"}, {"MOE_RANKS_PER_NODE", "2"}});
  EXPECT_TRUE(env.nodes_simulated);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_size, 2);
  EXPECT_EQ(env.node_rank, 1);
  EXPECT_EQ(env.n_nodes, 2);
  EXPECT_EQ(env.device_rank, 3);  // the GPU is still the real node's index
  EXPECT_THROW(parse_launch_env({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"MOE_RANKS_PER_NODE", "3"}}), ConfigError);
}

// One line naming what is wrong.
void expect_error(const std::map<std::string, std::string>& vars, const std::string& fragment) {
  try {
    parse_launch_env(vars);
    ADD_FAILURE() << "no error for a launch environment that should mention '" << fragment << "'";
  } catch (const ConfigError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(fragment), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(LaunchEnv, InconsistentValuesAreOneLineErrors) {
  expect_error({{"RANK", "4"}, {"WORLD_SIZE", "4"}}, "rank 4 outside world size 4");
  expect_error({{"RANK", "x"}, {"WORLD_SIZE", "4"}}, "RANK='x' is not an integer");
  expect_error({{"RANK", "0"}}, "WORLD_SIZE is not set");
  expect_error({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
               "local rank 2 outside local size 2");
  expect_error({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "3"}},
               "not a multiple of the 3 ranks per node");
  expect_error({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"},
                {"GROUP_RANK", "1"}},
               "rank 1 is not node 1 x 2 ranks per node + local rank 0");
  expect_error({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"}}, "OMPI_COMM_WORLD_LOCAL_RANK is not set");
  expect_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "3"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "0"},
                {"SLURM_NNODES", "2"}},
               "not a multiple");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}, "MASTER_PORT 70000");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MOE_RENDEZVOUS_PORT", "x"}}, "MOE_RENDEZVOUS_PORT='x' is not an integer");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MOE_RENDEZVOUS_PORT", "70000"}}, "MOE_RENDEZVOUS_PORT 70000");
}

}  // namespace
}  // namespace moe::dist

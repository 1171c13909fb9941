// Topology: sysfs parsing on a fake tree, and CPU binding on this machine.
#include <gtest/gtest.h>
#include <sched.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "dist/topology.h"

namespace moe::dist {
namespace {

namespace fs = std::filesystem;

TEST(Topology, ParsesCpuLists) {
  EXPECT_EQ(parse_cpulist("0-3,8,10-11\n"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(parse_cpulist("5"), (std::vector<int>{5}));
  EXPECT_EQ(parse_cpulist(""), (std::vector<int>{}));
  EXPECT_THROW(parse_cpulist("3-1"), Error);
  EXPECT_THROW(parse_cpulist("a"), Error);
  EXPECT_THROW(parse_cpulist("1-"), Error);
}

TEST(Topology, ReadsTheNumaNodeOfAGpuFromSysfs) {
  const fs::path root = fs::temp_directory_path() / ("moe_sysfs_" + std::to_string(getpid()));
  fs::create_directories(root / "bus/pci/devices/0000:3b:00.0");
  fs::create_directories(root / "bus/pci/devices/0000:5e:00.0");
  fs::create_directories(root / "devices/system/node/node1");
  std::ofstream(root / "bus/pci/devices/0000:3b:00.0/numa_node") << "1\n";
  std::ofstream(root / "bus/pci/devices/0000:5e:00.0/numa_node") << "-1\n";  // what VMs often say
  std::ofstream(root / "devices/system/node/node1/cpulist") << "16-19,48\n";
  EXPECT_EQ(numa_node_of_pci_device("0000:3B:00.0", root.string()), 1);  // CUDA writes upper case
  EXPECT_EQ(numa_node_of_pci_device("0000:5e:00.0", root.string()), -1);
  EXPECT_EQ(numa_node_of_pci_device("0000:99:00.0", root.string()), -1);
  EXPECT_EQ(cpus_of_numa_node(1, root.string()), (std::vector<int>{16, 17, 18, 19, 48}));
  EXPECT_EQ(cpus_of_numa_node(0, root.string()), (std::vector<int>{}));
  fs::remove_all(root);
}

TEST(Topology, BindsToACpuSliceAndBack) {
  cpu_set_t original;
  ASSERT_EQ(sched_getaffinity(0, sizeof original, &original), 0);
  std::vector<int> usable;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &original)) usable.push_back(cpu);
  const Binding binding = bind_to_local_cpu_slice(usable.size() > 1 ? 1 : 0, usable.size() > 1 ? 2 : 1);
  EXPECT_TRUE(binding.bound) << binding.reason;
  cpu_set_t now;
  sched_getaffinity(0, sizeof now, &now);
  EXPECT_EQ(CPU_COUNT(&now), static_cast<int>(binding.cpus.size()));
  for (int cpu : binding.cpus) EXPECT_TRUE(CPU_ISSET(cpu, &now));
  EXPECT_TRUE(bind_process_to_cpus({CPU_SETSIZE + 5}).empty());  // nothing usable: nothing done
  // Binding never widens the mask: asking for all CPUs keeps the slice.
  EXPECT_EQ(bind_process_to_cpus(usable), binding.cpus);
  EXPECT_FALSE(bind_to_local_cpu_slice(0, CPU_SETSIZE + 1).bound);
  ASSERT_EQ(sched_setaffinity(0, sizeof original, &original), 0);  // for the other tests in this process
}

}  // namespace
}  // namespace moe::dist

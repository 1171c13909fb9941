// Where a worker runs: its node and local index (from the launch environment), and the
// CPU binding to the NUMA node of its GPU, read from sysfs
// (/sys/bus/pci/devices/<bus id>/numa_node, /sys/devices/system/node/node<N>/cpulist).
#pragma once
#include <string>
#include <vector>

#include "dist/launch_env.h"

namespace moe::dist {

struct Binding {
  bool bound = false;
  int numa_node = -1;     // -1: unknown
  std::vector<int> cpus;  // the CPUs the process was bound to (empty when not bound)
  std::string reason;     // one line for the log: what was done, or why nothing was
};

// "0-3,8,10-11" -> {0,1,2,3,8,10,11}; throws on malformed text.
std::vector<int> parse_cpulist(const std::string& text);

// NUMA node of a PCI device ("0000:3b:00.0", any case), or -1 when sysfs does not say.
int numa_node_of_pci_device(const std::string& bus_id, const std::string& sysfs_root = "/sys");
// CPUs of a NUMA node (empty when unknown).
std::vector<int> cpus_of_numa_node(int numa_node, const std::string& sysfs_root = "/sys");

// Binds every thread of this process (and threads started later) to `cpus`, intersected
// with the CPUs it may use now. Returns the CPUs bound to (empty: nothing done).
std::vector<int> bind_process_to_cpus(const std::vector<int>& cpus);

// The GPU worker's binding: the NUMA node of GPU `device` (cudaDeviceGetPCIBusId). Does
// nothing, with the reason, when the build has no CUDA or the machine does not say.
Binding bind_to_gpu_numa_node(int device, const std::string& sysfs_root = "/sys");

// CPU workers: slice `local_rank` of `local_size` equal slices of the usable CPUs (so
// co-located ranks do not fight over cores). Opt-in (MOE_BIND_CPUS=1): oversubscribed
// runs such as the tests would lose from it.
Binding bind_to_local_cpu_slice(int local_rank, int local_size);

// What a worker calls at start-up: GPU binding for device >= 0, else the CPU slice when
// MOE_BIND_CPUS=1. Logs one line either way.
Binding bind_worker(const LaunchEnv& env, int device);

}  // namespace moe::dist

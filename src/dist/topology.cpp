#include "dist/topology.h"

#include <dirent.h>
#include <sched.h>
#include <spdlog/spdlog.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/error.h"

#ifdef MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::dist {
namespace {

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (in) std::getline(in, line);
  return line;
}

std::vector<int> usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  return cpus;
}

std::string join(const std::vector<int>& cpus) {
  std::string text;
  for (int cpu : cpus) text += (text.empty() ? "" : ",") + std::to_string(cpu);
  return text;
}

}  // namespace

std::vector<int> parse_cpulist(const std::string& text) {
  std::vector<int> cpus;
  std::stringstream ranges(text);
  std::string range;
  while (std::getline(ranges, range, ',')) {
    range.erase(std::remove_if(range.begin(), range.end(), [](unsigned char c) { return std::isspace(c); }),
                range.end());
    if (range.empty()) continue;
    const size_t dash = range.find('-');
    char* end = nullptr;
    const long first = std::strtol(range.c_str(), &end, 10);
    long last = first;
    bool ok = end != range.c_str() && (dash == std::string::npos ? *end == '\0' : end == range.c_str() + dash);
    if (ok && dash != std::string::npos) {
      const char* second = range.c_str() + dash + 1;
      last = std::strtol(second, &end, 10);
      ok = end != second && *end == '\0';
    }
    if (!ok || first < 0 || last < first || last >= CPU_SETSIZE) MOE_THROW("malformed CPU list '{}'", text);
    for (long cpu = first; cpu <= last; ++cpu) cpus.push_back(static_cast<int>(cpu));
  }
  return cpus;
}

int numa_node_of_pci_device(const std::string& bus_id, const std::string& sysfs_root) {
  std::string id = bus_id;
  std::transform(id.begin(), id.end(), id.begin(), [](unsigned char c) { return std::tolower(c); });
  const std::string text = read_first_line(sysfs_root + "/bus/pci/devices/" + id + "/numa_node");
  if (text.empty()) return -1;
  char* end = nullptr;
  const long node = std::strtol(text.c_str(), &end, 10);
  return end == text.c_str() || node < 0 ? -1 : static_cast<int>(node);
}

std::vector<int> cpus_of_numa_node(int numa_node, const std::string& sysfs_root) {
  if (numa_node < 0) return {};
  const std::string text =
      read_first_line(sysfs_root + "/devices/system/node/node" + std::to_string(numa_node) + "/cpulist");
  return text.empty() ? std::vector<int>{} : parse_cpulist(text);
}

std::vector<int> bind_process_to_cpus(const std::vector<int>& cpus) {
  const std::vector<int> usable = usable_cpus();
  std::vector<int> chosen;
  for (int cpu : cpus)
    if (std::find(usable.begin(), usable.end(), cpu) != usable.end()) chosen.push_back(cpu);
  if (chosen.empty()) return chosen;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : chosen) CPU_SET(cpu, &set);
  // Every thread that exists now (sched_setaffinity binds one thread); threads started
  // later inherit the mask of the thread that starts them.
  if (DIR* tasks = opendir("/proc/self/task")) {
    while (dirent* entry = readdir(tasks)) {
      if (entry->d_name[0] == '.') continue;
      sched_setaffinity(static_cast<pid_t>(std::atoi(entry->d_name)), sizeof set, &set);
    }
    closedir(tasks);
  }
  if (sched_setaffinity(0, sizeof set, &set) != 0) return {};
  return chosen;
}

Binding bind_to_gpu_numa_node(int device, const std::string& sysfs_root) {
  Binding binding;
#ifdef MOE_HAVE_CUDA
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, device) != cudaSuccess) {
    cudaGetLastError();
    binding.reason = "GPU " + std::to_string(device) + " has no PCI bus id: not bound";
    return binding;
  }
  binding.numa_node = numa_node_of_pci_device(bus_id, sysfs_root);
  if (binding.numa_node < 0) {
    binding.reason = std::string("the NUMA node of GPU ") + std::to_string(device) + " (" + bus_id +
                     ") is unknown: not bound";
    return binding;
  }
  binding.cpus = bind_process_to_cpus(cpus_of_numa_node(binding.numa_node, sysfs_root));
  binding.bound = !binding.cpus.empty();
  binding.reason = binding.bound ? "bound to NUMA node " + std::to_string(binding.numa_node) + " of GPU " +
                                       std::to_string(device) + " (CPUs " + join(binding.cpus) + ")"
                                 : "NUMA node " + std::to_string(binding.numa_node) + " has no usable CPUs: not bound";
#else
  binding.reason = "built without CUDA: GPU " + std::to_string(device) + " not bound";
#endif
  return binding;
}

Binding bind_to_local_cpu_slice(int local_rank, int local_size) {
  Binding binding;
  const std::vector<int> usable = usable_cpus();
  const size_t slice = usable.size() / static_cast<size_t>(std::max(local_size, 1));
  if (slice == 0 || local_rank < 0 || local_rank >= local_size) {
    binding.reason = "fewer usable CPUs (" + std::to_string(usable.size()) + ") than local ranks: not bound";
    return binding;
  }
  const std::vector<int> mine(usable.begin() + local_rank * slice, usable.begin() + (local_rank + 1) * slice);
  binding.cpus = bind_process_to_cpus(mine);
  binding.bound = !binding.cpus.empty();
  binding.reason = "bound to CPUs " + join(binding.cpus) + " (slice " + std::to_string(local_rank) + " of " +
                   std::to_string(local_size) + ")";
  return binding;
}

Binding bind_worker(const LaunchEnv& env, int device) {
  Binding binding;
  if (device >= 0) {
    binding = bind_to_gpu_numa_node(device);
  } else if (const char* flag = std::getenv("MOE_BIND_CPUS"); flag && std::string(flag) == "1") {
    binding = bind_to_local_cpu_slice(env.local_rank, env.local_size);
  } else {
    binding.reason = "CPU run: not bound (MOE_BIND_CPUS=1 binds each local rank to a slice of the CPUs)";
  }
  spdlog::info("topology: {}: {}", describe(env), binding.reason);
  return binding;
}

}  // namespace moe::dist

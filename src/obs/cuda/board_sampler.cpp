#include "obs/cuda/board_sampler.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <nvml.h>

#include <type_traits>

namespace moe {
namespace {

// The NVML entry points, from the driver's library; opened once per process.
struct Nvml {
  decltype(&nvmlInit_v2) init = nullptr;
  decltype(&nvmlErrorString) error_string = nullptr;
  decltype(&nvmlDeviceGetHandleByPciBusId_v2) by_pci_bus_id = nullptr;
  decltype(&nvmlDeviceGetClockInfo) clock = nullptr;
  decltype(&nvmlDeviceGetMaxClockInfo) max_clock = nullptr;
  decltype(&nvmlDeviceGetPowerUsage) power = nullptr;
  decltype(&nvmlDeviceGetEnforcedPowerLimit) power_limit = nullptr;
  decltype(&nvmlDeviceGetCurrentClocksEventReasons) reasons = nullptr;
  std::string error;  // why NVML is not usable here, if it is not

  Nvml() {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      error = fmt::format("NVML not found (dlopen libnvidia-ml.so.1: {})", dlerror());
      return;
    }
    auto load = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn && error.empty()) error = fmt::format("NVML has no {}", name);
    };
    load(init, "nvmlInit_v2");
    load(error_string, "nvmlErrorString");
    load(by_pci_bus_id, "nvmlDeviceGetHandleByPciBusId_v2");
    load(clock, "nvmlDeviceGetClockInfo");
    load(max_clock, "nvmlDeviceGetMaxClockInfo");
    load(power, "nvmlDeviceGetPowerUsage");
    load(power_limit, "nvmlDeviceGetEnforcedPowerLimit");
    // Drivers before r535 name it ...ThrottleReasons (the same call).
    reasons = reinterpret_cast<decltype(reasons)>(dlsym(lib, "nvmlDeviceGetCurrentClocksEventReasons"));
    if (!reasons) load(reasons, "nvmlDeviceGetCurrentClocksThrottleReasons");
    if (!error.empty()) return;
    const nvmlReturn_t r = init();
    if (r != NVML_SUCCESS) error = fmt::format("nvmlInit: {}", error_string(r));
  }
};

const Nvml& nvml() {
  static const Nvml instance;  // initialised once, thread-safe
  return instance;
}

constexpr unsigned long long kPowerCap = nvmlClocksEventReasonSwPowerCap;
constexpr unsigned long long kThermal = nvmlClocksEventReasonSwThermalSlowdown |
                                        nvmlClocksThrottleReasonHwThermalSlowdown;

}  // namespace

BoardSampler::BoardSampler(std::chrono::milliseconds period) : period_(period) {
  const Nvml& api = nvml();
  if (!api.error.empty()) {
    reason_ = api.error;
    return;
  }
  int cuda_device = 0;
  char bus_id[32] = {};
  if (cudaGetDevice(&cuda_device) != cudaSuccess ||
      cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), cuda_device) != cudaSuccess) {
    cudaGetLastError();
    reason_ = "no CUDA device";
    return;
  }
  nvmlDevice_t device = nullptr;
  const nvmlReturn_t r = api.by_pci_bus_id(bus_id, &device);
  if (r != NVML_SUCCESS) {
    reason_ = fmt::format("NVML has no device at PCI {}: {}", bus_id, api.error_string(r));
    return;
  }
  device_ = device;
  unsigned int mhz = 0, milliwatts = 0;
  if (api.max_clock(device, NVML_CLOCK_SM, &mhz) == NVML_SUCCESS) max_sm_mhz_ = mhz;
  if (api.power_limit(device, &milliwatts) == NVML_SUCCESS) power_limit_w_ = milliwatts / 1e3;
}

BoardSampler::~BoardSampler() { stop(); }

bool BoardSampler::sample(BoardSample& out) const {
  const Nvml& api = nvml();
  auto device = static_cast<nvmlDevice_t>(device_);
  unsigned int mhz = 0, milliwatts = 0;
  unsigned long long reasons = 0;
  if (api.clock(device, NVML_CLOCK_SM, &mhz) != NVML_SUCCESS || api.power(device, &milliwatts) != NVML_SUCCESS)
    return false;
  if (api.reasons(device, &reasons) != NVML_SUCCESS) reasons = 0;
  out = {static_cast<double>(mhz), milliwatts / 1e3, (reasons & kPowerCap) != 0, (reasons & kThermal) != 0};
  return true;
}

void BoardSampler::run() {
  std::unique_lock lock(mutex_);
  while (running_) {
    lock.unlock();
    BoardSample s;
    const bool ok = sample(s);
    lock.lock();
    if (ok) samples_.push_back(s);
    wake_.wait_for(lock, period_, [&] { return !running_; });
  }
}

void BoardSampler::start() {
  if (!available()) return;
  stop();
  {
    std::lock_guard lock(mutex_);
    samples_.clear();
    running_ = true;
  }
  thread_ = std::thread([this] { run(); });
}

void BoardSampler::stop() {
  {
    std::lock_guard lock(mutex_);
    running_ = false;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::vector<BoardSample> BoardSampler::samples() const {
  std::lock_guard lock(mutex_);
  return samples_;
}

BoardSummary BoardSampler::summary() const { return summarize_board(samples(), max_sm_mhz_, power_limit_w_); }

BoardSummary BoardSampler::take_summary() {
  std::vector<BoardSample> taken;
  {
    std::lock_guard lock(mutex_);
    taken.swap(samples_);
  }
  return summarize_board(taken, max_sm_mhz_, power_limit_w_);
}

}  // namespace moe

// Probe (issue 21): what a byte and a FLOP cost in joules on this board, from NVML's energy
// counter. Under the 700 W limit the step's time is its joules over the power the limit
// leaves, so a lever is worth its joules, not its kernel milliseconds at full clock. Each
// workload runs back to back for S seconds after a 1 s warm-up at the limit; the program
// prints its joules, mean power, mean SM clock (NVML, sampled every 25 ms) and its joules a
// unit of work:
//   idle        nothing launched (the board's floor at its idle clock)
//   dram copy   8 GB read and written a pass (two 4 GB buffers, 16-byte accesses)
//   dram read   8 GB read a pass (a sum kept per thread: no writes)
//   l2 copy     two 12 MB buffers copied back and forth 64 times a launch (L2-resident)
//   fma         a chain of fp32 FMAs in registers (no memory): joules a warp instruction
//   gemm bf16   cuBLAS bf16 GEMM, fp32 accumulation, at mixtral-mini's gate|up shape
//               [32768, 2048] x [2048, 11264] and its down shape [32768, 5632] x [5632, 2048]
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I.deps/cuda-headers/nvidia/cu13/include
//        bench/probes/energy_rates.cu -o energy_rates -lcublas -ldl   (nvml.h: make setup's CUDA headers)
// Run on the GPU machine: ./energy_rates [seconds a workload, default 4]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nvml.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>

#define CHECK(x)                                                                           \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

namespace {

struct Nvml {
  decltype(&nvmlInit_v2) init = nullptr;
  decltype(&nvmlDeviceGetHandleByIndex_v2) by_index = nullptr;
  decltype(&nvmlDeviceGetTotalEnergyConsumption) energy = nullptr;
  decltype(&nvmlDeviceGetClockInfo) clock = nullptr;
  nvmlDevice_t device = nullptr;
  Nvml() {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!lib) std::fprintf(stderr, "dlopen libnvidia-ml.so.1: %s\n", dlerror()), std::exit(1);
    init = reinterpret_cast<decltype(init)>(dlsym(lib, "nvmlInit_v2"));
    by_index = reinterpret_cast<decltype(by_index)>(dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
    energy = reinterpret_cast<decltype(energy)>(dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption"));
    clock = reinterpret_cast<decltype(clock)>(dlsym(lib, "nvmlDeviceGetClockInfo"));
    if (!init || !by_index || !energy || !clock || init() != NVML_SUCCESS || by_index(0, &device) != NVML_SUCCESS)
      std::fprintf(stderr, "NVML: no device 0 or a missing entry point\n"), std::exit(1);
  }
  double millijoules() const {
    unsigned long long mj = 0;
    if (energy(device, &mj) != NVML_SUCCESS) std::fprintf(stderr, "NVML: no energy counter\n"), std::exit(1);
    return static_cast<double>(mj);
  }
  unsigned sm_mhz() const {
    unsigned mhz = 0;
    clock(device, NVML_CLOCK_SM, &mhz);
    return mhz;
  }
};

__global__ void copy_kernel(const uint4* __restrict__ in, uint4* __restrict__ out, long n16, int repeats) {
  for (int r = 0; r < repeats; ++r)
    for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n16;
         i += static_cast<long>(gridDim.x) * blockDim.x)
      out[i] = in[i];
}

__global__ void read_kernel(const uint4* __restrict__ in, long n16, unsigned* sink) {
  unsigned acc = 0;
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n16;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    const uint4 q = __ldcs(in + i);
    acc ^= q.x ^ q.y ^ q.z ^ q.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads; almost never stores
}

constexpr int kFmaChain = 4096;
__global__ void fma_kernel(float* sink, float seed) {
  float a = seed + threadIdx.x, b = seed * 0.5f, c = seed * 0.25f, d = seed * 0.125f;
#pragma unroll 64
  for (int i = 0; i < kFmaChain; ++i) {  // four independent chains: 4 FMAs an iteration
    a = fmaf(a, 0.999f, 1e-3f);
    b = fmaf(b, 0.999f, 1e-3f);
    c = fmaf(c, 0.999f, 1e-3f);
    d = fmaf(d, 0.999f, 1e-3f);
  }
  if (a + b + c + d == 0.0f) *sink = a;
}

// Random bf16 values of magnitude < 0.06 (a hash of the index): the energy of a GEMM or a
// copy depends on how many bits toggle, so constant data would understate it.
__global__ void fill_random_kernel(uint16_t* out, long n, uint32_t salt) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9e3779b1u ^ salt;
    h ^= h >> 15;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    const float x = (static_cast<float>(h & 0xffffu) / 65536.0f - 0.5f) * 0.125f;
    out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
}

struct Result {
  double seconds, joules, mean_mhz, units;
};

// Runs `launch` (which enqueues one unit of `units_each` work) until `seconds` have passed,
// after a 1 s warm-up, sampling the SM clock beside it.
Result measure(const Nvml& nvml, double seconds, double units_each, const std::function<void()>& launch) {
  using clock = std::chrono::steady_clock;
  const auto run_for = [&](double s, double* units) {
    const auto start = clock::now();
    double done = 0;
    while (std::chrono::duration<double>(clock::now() - start).count() < s) {
      for (int k = 0; k < 4; ++k) launch(), done += units_each;
      CHECK(cudaDeviceSynchronize());
    }
    if (units) *units = done;
  };
  run_for(1.0, nullptr);
  std::atomic<bool> stop{false};
  double mhz_sum = 0;
  long samples = 0;
  std::thread sampler([&] {
    while (!stop.load()) {
      mhz_sum += nvml.sm_mhz();
      ++samples;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
  });
  const double e0 = nvml.millijoules();
  const auto t0 = clock::now();
  double units = 0;
  run_for(seconds, &units);
  const double t = std::chrono::duration<double>(clock::now() - t0).count();
  const double e1 = nvml.millijoules();
  stop = true;
  sampler.join();
  return {t, (e1 - e0) / 1e3, samples ? mhz_sum / samples : 0.0, units};
}

void print(const char* name, const Result& r, const char* unit) {
  std::printf("%-34s %6.2f s %8.1f J %6.1f W %6.0f MHz %10.2f %s/s %9.3f J/%s\n", name, r.seconds, r.joules,
              r.joules / r.seconds, r.mean_mhz, r.units / r.seconds, unit, r.joules / r.units, unit);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 4.0;
  Nvml nvml;
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; %.1f s a workload after a 1 s warm-up\n", prop.name, prop.multiProcessorCount, seconds);
  std::printf("%-34s %8s %10s %8s %10s %16s %15s\n", "workload", "time", "energy", "power", "SM clock", "rate",
              "energy a unit");

  // idle: nothing on the GPU (no unit of work: its power is the floor the others are read against).
  const Result idle = measure(nvml, seconds, 1.0, [] { std::this_thread::sleep_for(std::chrono::milliseconds(25)); });
  std::printf("%-34s %6.2f s %8.1f J %6.1f W %6.0f MHz\n", "idle", idle.seconds, idle.joules, idle.joules / idle.seconds,
              idle.mean_mhz);

  const long big = 4L << 30, small = 12L << 20;
  void *a = nullptr, *b = nullptr;
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&a, big));
  CHECK(cudaMalloc(&b, big));
  CHECK(cudaMalloc(&sink, 64));
  const int grid = prop.multiProcessorCount * 4;
  fill_random_kernel<<<grid, 1024>>>(static_cast<uint16_t*>(a), big / 2, 1u);
  fill_random_kernel<<<grid, 1024>>>(static_cast<uint16_t*>(b), big / 2, 2u);
  CHECK(cudaDeviceSynchronize());
  const auto* in = static_cast<const uint4*>(a);
  auto* out = static_cast<uint4*>(b);
  print("dram copy (GB read + written)",
        measure(nvml, seconds, 2.0 * big / 1e9, [&] { copy_kernel<<<grid, 1024>>>(in, out, big / 16, 1); }), "GB");
  print("dram read (GB)",
        measure(nvml, seconds, 2.0 * big / 1e9, [&] {
          read_kernel<<<grid, 1024>>>(in, big / 16, sink);
          read_kernel<<<grid, 1024>>>(static_cast<const uint4*>(b), big / 16, sink);
        }),
        "GB");
  constexpr int kL2Repeats = 64;
  print("l2 copy, 2 x 12 MB (GB read + written)", measure(nvml, seconds, 2.0 * small * kL2Repeats / 1e9, [&] {
          copy_kernel<<<grid, 1024>>>(in, out, small / 16, kL2Repeats);
        }),
        "GB");
  const double fma_warp_instructions = static_cast<double>(grid) * 1024 / 32 * kFmaChain * 4;
  print("fma (G warp instructions)", measure(nvml, seconds, fma_warp_instructions / 1e9, [&] {
          fma_kernel<<<grid, 1024>>>(reinterpret_cast<float*>(sink), 1.0f);
        }),
        "Ginst");

  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) std::fprintf(stderr, "cublasCreate failed\n"), std::exit(1);
  struct Shape {
    const char* name;
    int m, n, k;
  };
  const Shape shapes[] = {{"gemm bf16 gate|up 32768x11264x2048", 32768, 11264, 2048},
                          {"gemm bf16 down 32768x2048x5632", 32768, 2048, 5632}};
  const float alpha = 1.0f, beta = 0.0f;
  for (const Shape& s : shapes) {
    // Row-major C [m, n] = A [m, k] B [k, n] as column-major C^T = B^T A^T, on the random
    // values of a and b (the first m k and k n of them).
    void* c = nullptr;
    CHECK(cudaMalloc(&c, static_cast<size_t>(s.m) * s.n * 2));
    const double tflop = 2.0 * s.m * s.n * s.k / 1e12;
    print(s.name, measure(nvml, seconds, tflop, [&] {
            cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, s.n, s.m, s.k, &alpha, b, CUDA_R_16BF, s.n, a,
                         CUDA_R_16BF, s.k, &beta, c, CUDA_R_16BF, s.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
          }),
          "TFLOP");
    CHECK(cudaFree(c));
  }
  cublasDestroy(handle);
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  CHECK(cudaFree(sink));
  return 0;
}

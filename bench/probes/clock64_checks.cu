// Probe (issue 21): does an SM's clock64, over the global timer, give the SM clock that
// `moe bench --sm-clocks` (core/cuda/sm_clocks.h) reports? Two checks on the GPU machine:
//   idle: stamp every SM, spin on 1 (or every) SM for 20 / 200 ms, stamp again: each SM's
//         cycles over nanoseconds, the idle ones' too (do idle SMs' counters stop?);
//   mma:  mma.sync on every SM for N seconds (the board at its power limit), each block
//         counting its own cycles over nanoseconds; run nvidia-smi beside it
//         (`--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active -lms 100`) and set
//         NVML's mean clock against the counters'.
// Build: nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/probes/clock64_checks.cu -o clock64_checks
// Run:   ./clock64_checks idle;  ./clock64_checks mma [seconds]   (BENCHMARKS.md "Each phase's SM clock")
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

__device__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void stamp(unsigned long long* cycles, unsigned long long* ns, int* seen) {
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  const unsigned long long c = clock64(), t = global_ns();
  if (threadIdx.x == 0 && atomicExch(&seen[sm], 1) == 0) cycles[sm] = c, ns[sm] = t;
}

__global__ void spin(unsigned long long ns) {
  const unsigned long long t0 = global_ns();
  while (global_ns() - t0 < ns) {
  }
}

__global__ void __launch_bounds__(256) mma_spin(unsigned long long ns, double* mhz, float* sink) {
  unsigned a0 = threadIdx.x * 0x9e3779b9u, a1 = a0 ^ 0x5bd1e995u, a2 = a0 * 3u, a3 = a0 + 77u, b0 = a0 ^ 0xdeadbeefu,
           b1 = a1 * 5u;
  float d0 = 0, d1 = 0, d2 = 0, d3 = 0;
  const unsigned long long t0 = global_ns();
  const long long c0 = clock64();
  unsigned long long t = t0;
  long long c1 = c0;
  while (t - t0 < ns) {
#pragma unroll 1
    for (int i = 0; i < 256; ++i) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
          : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      a0 ^= __float_as_uint(d0) & 0xffffu;  // bits that keep changing: power follows the toggling
    }
    t = global_ns();
    c1 = clock64();
  }
  if (threadIdx.x == 0) mhz[blockIdx.x] = 1e3 * double(c1 - c0) / double(t - t0);
  if (d0 == 1.2345f) sink[0] = d1 + d2 + d3;
}

void print_spread(const char* what, std::vector<double> mhz) {
  std::sort(mhz.begin(), mhz.end());
  std::printf("%s: %zu counters, MHz min %.0f median %.0f max %.0f\n", what, mhz.size(), mhz.front(),
              mhz[mhz.size() / 2], mhz.back());
}

void idle_check(int sms) {
  constexpr int kMaxSm = 512;
  unsigned long long *c0, *t0, *c1, *t1;
  int *s0, *s1;
  for (auto* p : {&c0, &t0, &c1, &t1}) cudaMalloc(p, kMaxSm * sizeof(unsigned long long));
  cudaMalloc(&s0, kMaxSm * sizeof(int));
  cudaMalloc(&s1, kMaxSm * sizeof(int));
  for (const unsigned long long ns : {20'000'000ull, 200'000'000ull})
    for (const int blocks : {1, sms}) {
      cudaMemset(s0, 0, kMaxSm * sizeof(int));
      cudaMemset(s1, 0, kMaxSm * sizeof(int));
      stamp<<<sms * 4, 32>>>(c0, t0, s0);
      spin<<<blocks, 128>>>(ns);
      stamp<<<sms * 4, 32>>>(c1, t1, s1);
      std::vector<unsigned long long> a(kMaxSm), b(kMaxSm), x(kMaxSm), y(kMaxSm);
      std::vector<int> u(kMaxSm), v(kMaxSm);
      cudaMemcpy(a.data(), c0, kMaxSm * 8, cudaMemcpyDeviceToHost);
      cudaMemcpy(b.data(), c1, kMaxSm * 8, cudaMemcpyDeviceToHost);
      cudaMemcpy(x.data(), t0, kMaxSm * 8, cudaMemcpyDeviceToHost);
      cudaMemcpy(y.data(), t1, kMaxSm * 8, cudaMemcpyDeviceToHost);
      cudaMemcpy(u.data(), s0, kMaxSm * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(v.data(), s1, kMaxSm * 4, cudaMemcpyDeviceToHost);
      std::vector<double> mhz;
      for (int s = 0; s < kMaxSm; ++s)
        if (u[s] && v[s]) mhz.push_back(1e3 * double(b[s] - a[s]) / double(y[s] - x[s]));
      char what[96];
      std::snprintf(what, sizeof what, "spin on %d blocks for %llu ms, every SM stamped", blocks, ns / 1'000'000);
      print_spread(what, mhz);
    }
}

void mma_check(int sms, double seconds) {
  const int blocks = sms * 4;
  double* mhz;
  float* sink;
  cudaMalloc(&mhz, blocks * sizeof(double));
  cudaMalloc(&sink, sizeof(float));
  for (int rep = 0; rep < 2; ++rep) {
    mma_spin<<<blocks, 256>>>(static_cast<unsigned long long>(seconds * 1e9), mhz, sink);
    std::vector<double> h(blocks);
    cudaMemcpy(h.data(), mhz, blocks * sizeof(double), cudaMemcpyDeviceToHost);
    print_spread("mma.sync on every SM", h);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || (std::strcmp(argv[1], "idle") != 0 && std::strcmp(argv[1], "mma") != 0)) {
    std::fprintf(stderr, "usage: clock64_checks idle | mma [seconds]\n");
    return 2;
  }
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  if (std::strcmp(argv[1], "idle") == 0)
    idle_check(sms);
  else
    mma_check(sms, argc > 2 ? std::atof(argv[2]) : 4.0);
  const cudaError_t status = cudaDeviceSynchronize();
  if (status != cudaSuccess) {
    std::fprintf(stderr, "clock64_checks: %s\n", cudaGetErrorString(status));
    return 1;
  }
  return 0;
}

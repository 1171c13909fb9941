// Probe (issue 21): does a memory-bound pass on a few reserved multiprocessors, run beside
// bf16 GEMMs held at the board's power limit, cost less than running it alone afterwards?
// The step's GEMMs run power-capped (~1.5 GHz on an H200) while its memory-bound passes
// (AdamW, norms, permutes) draw less than the limit at full clock; beside each other the
// pass would use the power the GEMMs leave. This measures the exchange rate:
//   GEMMs alone on all SMs, alone on (SMs - k), the stream pass alone on k SMs and on all,
//   and both together (GEMMs on SMs - k through cublasSetSmCountTarget, the pass on k
//   blocks of 1024 threads, one an SM), each for `seconds` after a warm-up at the limit.
// R(k) = t_gemm(all) / t_gemm(beside) + rate(beside) / rate(all SMs alone): the work done
// beside each other in a second, in seconds of the two run one after the other; > 1 gains.
// Build here (the build's include paths for the board sampler, NVML's header from setup):
//   g++ -O2 -std=c++20 -Isrc -isystem .deps/cuda-headers/nvidia/cu13/include -I/usr/local/cuda/include -c src/obs/cuda/board_sampler.cpp -o /tmp/bs.o
//   g++ -O2 -std=c++20 -Isrc -c src/obs/board_power.cpp -o /tmp/bp.o
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -Isrc \
//     bench/probes/reserved_sm_overlap.cu /tmp/bs.o /tmp/bp.o \
//     -lcublas -lfmt -ldl -o build/reserved_sm_overlap
// Run on the GPU machine: reserved_sm_overlap [seconds a phase, default 2] [M N K, default 32768 5632 2048].
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "obs/cuda/board_sampler.h"

#define CHECK(x)                                                   \
  do {                                                             \
    cudaError_t err_ = (x);                                        \
    if (err_ != cudaSuccess) {                                     \
      std::printf("%s: %s\n", #x, cudaGetErrorString(err_));       \
      std::exit(1);                                                \
    }                                                              \
  } while (0)
#define CHECK_BLAS(x)                                              \
  do {                                                             \
    cublasStatus_t st_ = (x);                                      \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                            \
      std::printf("%s: cuBLAS status %d\n", #x, static_cast<int>(st_)); \
      std::exit(1);                                                \
    }                                                              \
  } while (0)

constexpr int kReads = 5, kWrites = 3;  // the fp8-moment AdamW's streams, roughly
constexpr int kThreads = 1024;

// Grid-stride over n16 16-byte units of each stream, `reps` times; kReads read, kWrites
// written in place. `*stop` != 0 ends it early (checked once a pass).
__global__ void __launch_bounds__(kThreads) stream_kernel(uint4* const* bufs, long n16, int reps,
                                                           volatile int* stop) {
  const long stride = static_cast<long>(gridDim.x) * kThreads;
  for (int rep = 0; rep < reps; ++rep) {
    if (*stop) return;
    for (long i = blockIdx.x * static_cast<long>(kThreads) + threadIdx.x; i < n16; i += 2 * stride) {
      uint4 v[2][kReads];
      const bool second = i + stride < n16;
#pragma unroll
      for (int r = 0; r < kReads; ++r) {
        v[0][r] = __ldcs(bufs[r] + i);
        if (second) v[1][r] = __ldcs(bufs[r] + i + stride);
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (u == 1 && !second) break;
        uint4 acc = v[u][0];
#pragma unroll
        for (int r = 1; r < kReads; ++r) acc.x ^= v[u][r].x, acc.y += v[u][r].y, acc.z ^= v[u][r].z, acc.w += v[u][r].w;
#pragma unroll
        for (int w = 0; w < kWrites; ++w) __stcs(bufs[w] + i + u * stride, make_uint4(acc.x + w, acc.y, acc.z, acc.w));
      }
    }
  }
}

struct Gemm {
  cublasHandle_t handle;
  int m, n, k;
  __nv_bfloat16 *a, *b, *c;
  void run(cudaStream_t s) const {
    const float one = 1, zero = 0;
    CHECK_BLAS(cublasSetStream(handle, s));
    // Column-major C [n, m] = B^T [n, k] A [k, m]: row-major C [m, n] = A [m, k] B [k, n].
    CHECK_BLAS(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &one, b, CUDA_R_16BF, n, a, CUDA_R_16BF, k,
                            &zero, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
};

struct Stream {
  uint4** bufs;
  long n16;
  int* stop;
  double bytes_a_pass() const { return static_cast<double>(n16) * 16 * (kReads + kWrites); }
};

float elapsed(cudaEvent_t a, cudaEvent_t b) {
  float t = 0;
  CHECK(cudaEventElapsedTime(&t, a, b));
  return t;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

constexpr int kBatch = 10;  // GEMMs between two events

struct Result {
  double gemm_ms = 0, stream_ms = 0;  // stream_ms: how long the pass ran beside the GEMMs
  moe::BoardSummary board;
};

// GEMMs for `seconds` (sm_target 0: all SMs), with the stream pass on `stream_blocks` blocks
// beside them (0: none, else stopped as the GEMMs end). gemm_ms: the median ms a GEMM over
// the second half of the batches; the pass's rate beside them comes from a bounded run (main).

Result run_phase(const Gemm& g, const Stream& st, int sm_target, int stream_blocks, double seconds,
                 double gemm_ms_guess, double stream_tbs_guess, moe::BoardSampler& sampler) {
  cudaStream_t sa, sb;
  CHECK(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
  CHECK_BLAS(cublasSetSmCountTarget(g.handle, sm_target));
  const int batches = std::max(4, static_cast<int>(seconds * 1e3 / (gemm_ms_guess * kBatch)));
  std::vector<cudaEvent_t> ev(batches + 1);
  for (auto& e : ev) CHECK(cudaEventCreate(&e));
  cudaEvent_t s0, s1;
  CHECK(cudaEventCreate(&s0));
  CHECK(cudaEventCreate(&s1));
  CHECK(cudaMemset(st.stop, 0, sizeof(int)));
  CHECK(cudaDeviceSynchronize());
  sampler.start();
  if (stream_blocks > 0) {
    // Long enough to outlast the GEMMs (stopped through `stop` once they are done).
    const int reps = std::max(1, static_cast<int>(2.0 * seconds * stream_tbs_guess * 1e12 / st.bytes_a_pass()) + 1);
    CHECK(cudaEventRecord(s0, sb));
    stream_kernel<<<stream_blocks, kThreads, 0, sb>>>(st.bufs, st.n16, reps, st.stop);
    CHECK(cudaEventRecord(s1, sb));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // the pass takes its SMs first
  }
  CHECK(cudaEventRecord(ev[0], sa));
  for (int b = 0; b < batches; ++b) {
    for (int i = 0; i < kBatch; ++i) g.run(sa);
    CHECK(cudaEventRecord(ev[b + 1], sa));
  }
  Result r;
  if (stream_blocks > 0) {
    CHECK(cudaEventSynchronize(ev[batches]));
    // Stop the pass as the GEMMs end.
    const int one = 1;
    CHECK(cudaMemcpy(st.stop, &one, sizeof(int), cudaMemcpyHostToDevice));
  }
  CHECK(cudaDeviceSynchronize());
  sampler.stop();
  r.board = sampler.summary();
  std::vector<double> per;
  for (int b = batches / 2; b < batches; ++b) per.push_back(elapsed(ev[b], ev[b + 1]) / kBatch);
  r.gemm_ms = median(per);
  if (stream_blocks > 0) r.stream_ms = elapsed(s0, s1);
  for (auto& e : ev) CHECK(cudaEventDestroy(e));
  CHECK(cudaEventDestroy(s0));
  CHECK(cudaEventDestroy(s1));
  CHECK(cudaStreamDestroy(sa));
  CHECK(cudaStreamDestroy(sb));
  return r;
}

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 2.0;
  const int m = argc > 4 ? std::atoi(argv[2]) : 32768, n = argc > 4 ? std::atoi(argv[3]) : 5632,
            k = argc > 4 ? std::atoi(argv[4]) : 2048;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; GEMM bf16 [%d, %d] x [%d, %d], %d GEMMs a batch; stream pass %d reads + %d writes\n",
              prop.name, sms, m, k, k, n, kBatch, kReads, kWrites);
  Gemm g{};
  CHECK_BLAS(cublasCreate(&g.handle));
  g.m = m, g.n = n, g.k = k;
  CHECK(cudaMalloc(&g.a, sizeof(__nv_bfloat16) * m * k));
  CHECK(cudaMalloc(&g.b, sizeof(__nv_bfloat16) * k * n));
  CHECK(cudaMalloc(&g.c, sizeof(__nv_bfloat16) * m * n));
  {
    // Random bf16 in [-1, 1): the power a GEMM draws depends on its data.
    std::vector<__nv_bfloat16> h(static_cast<size_t>(std::max<long>(1L * m * k, 1L * k * n)));
    unsigned x = 12345;
    for (auto& v : h) x = x * 1664525u + 1013904223u, v = __float2bfloat16((x >> 8) / 8388608.0f - 1.0f);
    CHECK(cudaMemcpy(g.a, h.data(), sizeof(__nv_bfloat16) * m * k, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(g.b, h.data(), sizeof(__nv_bfloat16) * k * n, cudaMemcpyHostToDevice));
  }
  Stream st{};
  st.n16 = 1L << 26;  // 1 GiB a stream: 8 GiB a pass, far beyond L2
  std::vector<uint4*> host_bufs(kReads);
  for (auto& p : host_bufs) {
    CHECK(cudaMalloc(&p, st.n16 * 16));
    CHECK(cudaMemset(p, 1, st.n16 * 16));
  }
  CHECK(cudaMalloc(&st.bufs, sizeof(uint4*) * kReads));
  CHECK(cudaMemcpy(st.bufs, host_bufs.data(), sizeof(uint4*) * kReads, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&st.stop, sizeof(int)));
  CHECK(cudaMemset(st.stop, 0, sizeof(int)));
  moe::BoardSampler sampler(std::chrono::milliseconds(50));
  const double flops = 2.0 * m * n * k;

  // The stream pass alone: `passes` whole passes on `blocks` blocks, TB/s.
  auto stream_alone = [&](int blocks, int passes) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    stream_kernel<<<blocks, kThreads>>>(st.bufs, st.n16, 1, st.stop);  // warm
    CHECK(cudaEventRecord(a));
    stream_kernel<<<blocks, kThreads>>>(st.bufs, st.n16, passes, st.stop);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    const double tbs = passes * st.bytes_a_pass() / (elapsed(a, b) * 1e-3) / 1e12;
    CHECK(cudaEventDestroy(a));
    CHECK(cudaEventDestroy(b));
    return tbs;
  };
  auto print = [&](const char* what, int gemm_sms, int blocks, const Result& r, double tbs) {
    std::printf("%-34s GEMM SMs %3d, pass blocks %3d: GEMM %7.3f ms (%4.0f TFLOP/s), pass %5.2f TB/s; %s\n", what,
                gemm_sms, blocks, r.gemm_ms, r.gemm_ms > 0 ? flops / (r.gemm_ms * 1e-3) / 1e12 : 0.0, tbs,
                moe::describe_board(r.board).c_str());
  };

  const double full_tbs = stream_alone(sms, 3);
  std::printf("stream pass alone, %d blocks (all SMs): %.2f TB/s\n", sms, full_tbs);
  // Warm the board to its power limit, then GEMMs alone on all SMs.
  run_phase(g, st, 0, 0, 1.0, 1.0, 0, sampler);
  const Result all = run_phase(g, st, 0, 0, seconds, 1.0, 0, sampler);
  print("GEMMs alone", sms, 0, all, 0);
  for (int reserved : {4, 8, 16, 24, 32}) {
    const double alone_tbs = stream_alone(reserved, 2);
    const Result fewer = run_phase(g, st, sms - reserved, 0, seconds, all.gemm_ms, 0, sampler);
    print("GEMMs alone on fewer SMs", sms - reserved, 0, fewer, 0);
    std::printf("%-34s %45s pass %5.2f TB/s\n", "stream pass alone", "", alone_tbs);
    // Beside each other: the pass's rate from the number of whole passes it finished. Run it
    // bounded to the passes that fit the GEMMs' span at its lone rate, and time both.
    const Result both = run_phase(g, st, sms - reserved, reserved, seconds, all.gemm_ms, alone_tbs, sampler);
    // The pass's rate beside the GEMMs: a bounded run of whole passes while GEMMs (on the
    // same SMs - reserved) run longer than it.
    const int passes = std::max(1, static_cast<int>(0.5 * seconds * alone_tbs * 1e12 / st.bytes_a_pass()));
    cudaStream_t sa, sb;
    CHECK(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    CHECK(cudaMemset(st.stop, 0, sizeof(int)));
    CHECK(cudaDeviceSynchronize());
    CHECK_BLAS(cublasSetSmCountTarget(g.handle, sms - reserved));
    CHECK(cudaEventRecord(a, sb));
    stream_kernel<<<reserved, kThreads, 0, sb>>>(st.bufs, st.n16, passes, st.stop);
    CHECK(cudaEventRecord(b, sb));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const int gemms = static_cast<int>(1.5 * passes * st.bytes_a_pass() / (alone_tbs * 1e12) * 1e3 / all.gemm_ms) + kBatch;
    for (int i = 0; i < gemms; ++i) g.run(sa);
    CHECK(cudaDeviceSynchronize());
    const double beside_tbs = passes * st.bytes_a_pass() / (elapsed(a, b) * 1e-3) / 1e12;
    CHECK(cudaEventDestroy(a));
    CHECK(cudaEventDestroy(b));
    CHECK(cudaStreamDestroy(sa));
    CHECK(cudaStreamDestroy(sb));
    print("beside each other", sms - reserved, reserved, both, beside_tbs);
    const double ratio = all.gemm_ms / both.gemm_ms + beside_tbs / full_tbs;
    std::printf("  R(%d) = %.3f + %.3f = %.3f (the pass ran %.0f ms beside the GEMMs)\n", reserved,
                all.gemm_ms / both.gemm_ms, beside_tbs / full_tbs, ratio, both.stream_ms);
  }
  return 0;
}

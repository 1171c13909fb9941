// Probe (issue 21): the memory rate of AdamW's access pattern without its arithmetic.
// NR read streams and NW write streams of 2-byte elements (AdamW with bf16 moments and
// bf16 gradients: hi, lo, m, v, g read; hi, lo, m, v written), 16 bytes a stream a thread,
// one block of 256 threads per 16,384-element chunk as multi_tensor_adamw_kernel runs, or
// a grid of resident blocks striding over the chunks. CUDA events, median of 5 after a warm-up.
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/probes/stream_mix.cu -o stream_mix -lcuda
// Run on the GPU machine: ./stream_mix [elements a stream] [1: only the two AdamW patterns;
// 2: those, then both patterns staged through shared memory as their kernels stage them;
// 3: those, then the staged fp8 pattern with the scale bytes' streams;
// 4 MB: the streams on memory mapped as the parameter store maps its blocks (gpu::ResidentBlock:
// cuMemCreate allocations of MB megabytes each, mapped back to back; 0: cudaMalloc), then
// the two AdamW patterns, unstaged and staged]
// (default 4.8e9, mixtral-mini's parameters). The fp8-moment pattern: 3 two-byte and 2 one-byte
// streams read, 2 and 2 written (the fp8 AdamW kernel's bytes but its scales').
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

constexpr int kThreads = 256;
constexpr long kChunk = 1 << 14;

template <int NR, int NW>
__global__ void __launch_bounds__(kThreads) chunk_kernel(uint4* const* in, uint4* const* out, long n16, bool persistent) {
  const long chunk16 = kChunk / 8;  // 16-byte units of a chunk (8 two-byte elements each)
  const long n_chunks = (n16 + chunk16 - 1) / chunk16;
  for (long c = blockIdx.x; c < n_chunks; c += persistent ? gridDim.x : n_chunks) {
    const long end = n16 < (c + 1) * chunk16 ? n16 : (c + 1) * chunk16;
    for (long i = c * chunk16 + threadIdx.x; i < end; i += kThreads) {
      uint4 acc = make_uint4(0, 0, 0, 0);
      uint4 v[NR];
#pragma unroll
      for (int r = 0; r < NR; ++r) v[r] = __ldcs(in[r] + i);
#pragma unroll
      for (int r = 0; r < NR; ++r) acc.x ^= v[r].x, acc.y += v[r].y, acc.z ^= v[r].z, acc.w += v[r].w;
#pragma unroll
      for (int w = 0; w < NW; ++w) __stcs(out[w] + i, make_uint4(acc.x + w, acc.y, acc.z, acc.w));
      if (NW == 0 && acc.x == 0x9e3779b9u && acc.y == 7u) out[0][i] = acc;  // never: keeps the loads
    }
  }
}

// The fp8-moment AdamW's pattern (multi_tensor_adamw_fp8.cu, bf16 gradients): 8 elements a
// thread, read hi, lo, g (16 bytes each) and m, v (8 bytes each), write hi, lo, m, v back.
__global__ void __launch_bounds__(kThreads) fp8_moments_kernel(uint4* hi, uint4* lo, const uint4* g, uint2* m, uint2* v,
                                                                long n8) {
  const long chunk8 = kChunk / 8;
  const long c = blockIdx.x;
  const long end = n8 < (c + 1) * chunk8 ? n8 : (c + 1) * chunk8;
  for (long i = c * chunk8 + threadIdx.x; i < end; i += kThreads) {
    uint4 a = __ldcs(hi + i), b = __ldcs(lo + i), d = __ldcs(g + i);
    uint2 p = __ldcs(m + i), q = __ldcs(v + i);
    a.x ^= d.x, b.y += d.y, p.x ^= d.z, q.y += d.w;
    __stcs(hi + i, a);
    __stcs(lo + i, b);
    __stcs(m + i, p);
    __stcs(v + i, q);
  }
}

// The fp8 pattern staged as the fp8 AdamW kernel stages it: kT threads a block, each pass's
// 8 elements a thread copied into shared memory with cp.async (16 bytes of hi, lo, g; 8 of m,
// v) kS - 1 passes ahead, a chunk of `chunk` elements a block; no arithmetic.
__device__ __forceinline__ void cp16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp8(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem), "l"(gmem) : "memory");
}
// The block's chunk [first, end) in 16-byte units; kHops > 0: the block first waits on a
// chain of kHops dependent loads of a small zeroed table by one thread (the AdamW kernels'
// chunk_of_block: a segment search, then the segment and the scalars), then __syncthreads,
// as the shipped kernels start every chunk.
template <int kHops>
__device__ __forceinline__ void block_chunk(long& first, long& end, long n8, long chunk, const long* table) {
  long c8 = chunk / 8;
  if constexpr (kHops > 0) {
    __shared__ long found;
    if (threadIdx.x == 0) {
      long at = blockIdx.x & 127;
      for (int h = 0; h < kHops; ++h) at = __ldcg(table + at) + ((at + 1) & 127);  // from the L2
      found = at;
    }
    __syncthreads();
    c8 += found < 0 ? 1 : 0;  // never (the chain ends in 0..127), but the block waits for it
  }
  first = blockIdx.x * (chunk / 8);
  end = n8 < first + c8 ? n8 : first + c8;
}

// A thread's passes i = first + threadIdx.x, + kT, ... below end, each staged kS - 1 passes
// ahead: stage_in(i, stage) issues one pass's copies (and commits a group, empty past the
// end), use(i, stage) reads the stage once its group is in.
template <int kT, int kS, class StageIn, class Use>
__device__ __forceinline__ void staged_passes(long first, long end, const StageIn& stage_in, const Use& use) {
  long i = first + threadIdx.x;
  for (int s = 0; s < kS - 1; ++s) stage_in(i + s * kT, s);
  for (int s = 0; i < end; i += kT, s = (s + 1) % kS) {
    stage_in(i + (kS - 1) * kT, (s + kS - 1) % kS);
    asm volatile("cp.async.wait_group %0;" ::"n"(kS - 1) : "memory");
    use(i, s);
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
}

// kWork > 0: each pass also does kWork fp32 multiply-adds a thread (8 chains) between its
// loads and its stores, the kernel's arithmetic in issue slots (~550 instructions a warp a
// pass: kWork 512), so the probe shows what the arithmetic's time a pass costs the pattern.
// kPairMV: m's and v's 8 bytes a thread as 16-byte copies of a lane pair's (the even lane m,
// the odd one v; the pair's halves read back after a __syncwarp) instead of 8-byte
// cp.async.ca copies, two a thread.
// kHops: block_chunk's.
// kScales: the blocks' scale bytes (one a 16 elements, a lane pair's) as the kernel moves
// them: 1: m's and v's in two byte arrays, loaded a pass ahead by plain loads and stored by
// both lanes of the pair; 2: the two bytes of a block side by side in one array (one stream);
// 3: the two byte arrays of 1, moved as 4-byte words by every eighth lane (shuffles between).
template <int kT, int kS, int kHops = 0, int kWork = 0, bool kPairMV = false, int kScales = 0>
__global__ void __launch_bounds__(kT) staged_fp8_kernel(uint4* hi, uint4* lo, const uint4* g, uint2* m, uint2* v,
                                                         long n8, long chunk, const long* table, uint8_t* ms,
                                                         uint8_t* vs) {
  extern __shared__ uint4 slots_sm[];  // [kS][4 units][kT]
  long first, end;
  block_chunk<kHops>(first, end, n8, chunk, table);
  auto* mvs = reinterpret_cast<uint16_t*>(ms);  // kScales 2
  uint32_t xs = 0;                              // the next pass's scale bytes
  const auto load_scales = [&](long i) {
    if constexpr (kScales == 1) xs = ms[i / 2] | static_cast<uint32_t>(vs[i / 2]) << 8;
    if constexpr (kScales == 2) xs = mvs[i / 2];
    if constexpr (kScales == 3) {
      const bool leader = (threadIdx.x & 7) == 0;
      const uint32_t wm = leader ? *reinterpret_cast<const uint32_t*>(ms + i / 2) : 0;
      const uint32_t wv = leader ? *reinterpret_cast<const uint32_t*>(vs + i / 2) : 0;
      const int from = threadIdx.x & 31 & ~7, shift = 8 * ((threadIdx.x & 7) / 2);
      xs = (__shfl_sync(0xffffffffu, wm, from) >> shift & 0xff) | (__shfl_sync(0xffffffffu, wv, from) >> shift & 0xff) << 8;
    }
  };
  if (kScales != 0 && first + threadIdx.x < end) load_scales(first + threadIdx.x);
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(slots_sm + threadIdx.x));
  constexpr uint32_t kUnit = kT * 16, kStage = 4 * kUnit;
  const auto stage_in = [&](long i, int s) {
    if (i < end) {
      const uint32_t at = base + s * kStage;
      cp16(at, hi + i);
      cp16(at + kUnit, lo + i);
      if constexpr (kPairMV) {
        const uint4* pair_source = reinterpret_cast<const uint4*>(threadIdx.x & 1 ? v : m) + (i >> 1);
        cp16(at + 2 * kUnit, pair_source);
      } else {
        cp8(at + 2 * kUnit, m + i);
        cp8(at + 2 * kUnit + 8, v + i);
      }
      cp16(at + 3 * kUnit, g + i);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  staged_passes<kT, kS>(first, end, stage_in, [&](long i, int s) {
    const uint4* at = slots_sm + s * 4 * kT + threadIdx.x;
    uint4 a = at[0], b = at[kT], q, d = at[3 * kT];
    if constexpr (kPairMV) {
      __syncwarp();  // the partner's copy is in too
      const uint4* pair = slots_sm + s * 4 * kT + 2 * kT + (threadIdx.x & ~1u);
      const uint2 mm = reinterpret_cast<const uint2*>(pair)[threadIdx.x & 1];
      const uint2 vv = reinterpret_cast<const uint2*>(pair + 1)[threadIdx.x & 1];
      q = make_uint4(mm.x, mm.y, vv.x, vv.y);
    } else {
      q = at[2 * kT];
    }
    a.x ^= d.x, b.y += d.y, q.x ^= d.z, q.w += d.w;
    const uint32_t this_xs = xs;
    if (kScales != 0 && i + kT < end) load_scales(i + kT);
    a.z += this_xs;
    if constexpr (kWork > 0) {
      float f[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) f[j] = __uint_as_float((j < 4 ? a.x : b.y) & 0x3f7fffffu) + j;
#pragma unroll 8
      for (int w = 0; w < kWork / 8; ++w)
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = fmaf(f[j], 0.999f, 1e-3f);
      float sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) sum += f[j];
      a.y ^= __float_as_uint(sum) & 1u;  // keeps the work, changes one bit the probe never reads back
    }
    __stcs(hi + i, a);
    __stcs(lo + i, b);
    __stcs(m + i, make_uint2(q.x, q.y));
    __stcs(v + i, make_uint2(q.z, q.w));
    if constexpr (kScales == 1) ms[i / 2] = static_cast<uint8_t>(a.x), vs[i / 2] = static_cast<uint8_t>(a.y);
    if constexpr (kScales == 2) mvs[i / 2] = static_cast<uint16_t>(a.x);
    if constexpr (kScales == 3) {
      uint32_t wm = a.x & 0xff, wv = a.y & 0xff;
#pragma unroll
      for (int d = 2; d < 8; d += 2) {
        wm |= (__shfl_down_sync(0xffffffffu, a.x, d) & 0xff) << (4 * d);
        wv |= (__shfl_down_sync(0xffffffffu, a.y, d) & 0xff) << (4 * d);
      }
      if ((threadIdx.x & 7) == 0) {
        *reinterpret_cast<uint32_t*>(ms + i / 2) = wm;
        *reinterpret_cast<uint32_t*>(vs + i / 2) = wv;
      }
    }
  });
}

// The bf16-moment AdamW's pattern staged as its kernel stages it (multi_tensor_adamw.cu,
// bf16 gradients): 16 bytes a thread a pass of hi, lo, m, v, g copied into shared memory
// (6 slots a thread a stage, as the kernel allocates for fp32 gradients), hi, lo, m, v
// written back; kHops: block_chunk's.
template <int kT, int kS, int kHops = 0>
__global__ void __launch_bounds__(kT) staged_bf16_kernel(uint4* hi, uint4* lo, const uint4* g, uint4* m, uint4* v,
                                                          long n8, long chunk, const long* table) {
  extern __shared__ uint4 slots_sm[];  // [kS][6 units][kT]
  long first, end;
  block_chunk<kHops>(first, end, n8, chunk, table);
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(slots_sm + threadIdx.x));
  constexpr uint32_t kUnit = kT * 16, kStage = 6 * kUnit;
  const auto stage_in = [&](long i, int s) {
    if (i < end) {
      const uint32_t at = base + s * kStage;
      cp16(at, hi + i);
      cp16(at + kUnit, lo + i);
      cp16(at + 2 * kUnit, m + i);
      cp16(at + 3 * kUnit, v + i);
      cp16(at + 4 * kUnit, g + i);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  staged_passes<kT, kS>(first, end, stage_in, [&](long i, int s) {
    const uint4* at = slots_sm + s * 6 * kT + threadIdx.x;
    uint4 a = at[0], b = at[kT], p = at[2 * kT], q = at[3 * kT], d = at[4 * kT];
    a.x ^= d.x, b.y += d.y, p.z ^= d.z, q.w += d.w;
    __stcs(hi + i, a);
    __stcs(lo + i, b);
    __stcs(m + i, p);
    __stcs(v + i, q);
  });
}

#define CU_CHECK(x) do { CUresult e = (x); if (e != CUDA_SUCCESS) { const char* what = nullptr; cuGetErrorString(e, &what); std::printf("%s: %s\n", #x, what ? what : "?"); std::exit(1); } } while (0)
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { std::printf("%s: %s\n", #x, cudaGetErrorString(e)); std::exit(1); } } while (0)

// The median of 5 launches after a warm-up, in ms (CUDA events).
template <class Launch>
float median_ms(const Launch& launch) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int rep = 0; rep < 6; ++rep) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    if (rep > 0) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return ms[2];
}

// blocks_per_sm > 0: dynamic shared memory (unused) that lets only that many blocks share
// an SM, as registers or staging buffers would (AdamW: 64 registers, 4 blocks of 256).
template <int NR, int NW>
void run(const char* name, std::vector<uint4*>& bufs, long n16, bool persistent, int blocks_per_sm = 0) {
  uint4 **in, **out;
  CHECK(cudaMallocManaged(&in, NR * sizeof(uint4*)));
  CHECK(cudaMallocManaged(&out, (NW > 0 ? NW : 1) * sizeof(uint4*)));
  for (int r = 0; r < NR; ++r) in[r] = bufs[r];
  for (int w = 0; w < NW; ++w) out[w] = bufs[w];  // written in place, as AdamW does
  if (NW == 0) out[0] = bufs[0];
  int sms = 0, per_sm = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  size_t smem = 0;
  if (blocks_per_sm > 0) {
    int per_sm_bytes = 0;
    CHECK(cudaDeviceGetAttribute(&per_sm_bytes, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
    smem = static_cast<size_t>(per_sm_bytes / blocks_per_sm - 2048);  // less the per-block reservation
    CHECK(cudaFuncSetAttribute(chunk_kernel<NR, NW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem)));
  }
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, chunk_kernel<NR, NW>, kThreads, smem));
  const long chunks = (n16 * 8 + kChunk - 1) / kChunk;
  const unsigned grid = persistent ? static_cast<unsigned>(sms * per_sm) : static_cast<unsigned>(chunks);
  const float median = median_ms([&] { chunk_kernel<NR, NW><<<grid, kThreads, smem>>>(in, out, n16, persistent); });
  const double bytes = static_cast<double>(n16) * 16 * (NR + NW);
  std::printf("%-44s %s grid %7u, %d blocks an SM: %8.2f ms  %6.1f GB  %5.2f TB/s\n", name,
              persistent ? "resident" : "per-chunk", grid, per_sm, median, bytes / 1e9, bytes / median / 1e9);
  CHECK(cudaFree(in));
  CHECK(cudaFree(out));
}

void run_fp8_moments(std::vector<uint4*>& bufs, long n8, int blocks_per_sm) {
  size_t smem = 0;
  if (blocks_per_sm > 0) {
    int per_sm_bytes = 0;
    CHECK(cudaDeviceGetAttribute(&per_sm_bytes, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
    smem = static_cast<size_t>(per_sm_bytes / blocks_per_sm - 2048);
    CHECK(cudaFuncSetAttribute(fp8_moments_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fp8_moments_kernel, kThreads, smem));
  const unsigned grid = static_cast<unsigned>((n8 * 8 + kChunk - 1) / kChunk);
  auto* m = reinterpret_cast<uint2*>(bufs[3]);
  auto* v = reinterpret_cast<uint2*>(bufs[4]);
  const float median =
      median_ms([&] { fp8_moments_kernel<<<grid, kThreads, smem>>>(bufs[0], bufs[1], bufs[2], m, v, n8); });
  const double bytes = static_cast<double>(n8) * 8 * (2 * 3 + 1 * 2 + 2 * 2 + 1 * 2);
  std::printf("%-44s per-chunk grid %7u, %d blocks an SM: %8.2f ms  %6.1f GB  %5.2f TB/s\n",
              "fp8 AdamW: 3+2 reads, 2+2 writes (2 B + 1 B)", grid, per_sm, median, bytes / 1e9, bytes / median / 1e9);
}

// block_chunk's table (256 zeros), allocated once.
const long* zeroed_table() {
  static long* table = nullptr;
  if (!table) {
    CHECK(cudaMalloc(&table, 256 * sizeof(long)));
    CHECK(cudaMemset(table, 0, 256 * sizeof(long)));
  }
  return table;
}

// m's and v's scale bytes (kScales), allocated once: n8 / 2 blocks of 16 elements a moment.
uint8_t* scale_bytes(long n8, int which) {
  static uint8_t* bytes[2] = {nullptr, nullptr};
  if (!bytes[which]) {
    CHECK(cudaMalloc(&bytes[which], n8));  // kScales 2 takes 2 bytes a block: n8 in all
    CHECK(cudaMemset(bytes[which], 1, n8));
  }
  return bytes[which];
}

template <int kT, int kS, int kHops = 0, int kWork = 0, bool kPairMV = false, int kScales = 0>
void run_staged(std::vector<uint4*>& bufs, long n8, long chunk) {
  const long* table = zeroed_table();
  uint8_t* ms = kScales ? scale_bytes(n8, 0) : nullptr;
  uint8_t* vs = kScales ? scale_bytes(n8, 1) : nullptr;
  const size_t smem = size_t{kS} * 4 * kT * 16;
  CHECK(cudaFuncSetAttribute(staged_fp8_kernel<kT, kS, kHops, kWork, kPairMV, kScales>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, staged_fp8_kernel<kT, kS, kHops, kWork, kPairMV, kScales>, kT, smem));
  const unsigned grid = static_cast<unsigned>((n8 * 8 + chunk - 1) / chunk);
  auto* m = reinterpret_cast<uint2*>(bufs[3]);
  auto* v = reinterpret_cast<uint2*>(bufs[4]);
  const float median = median_ms(
      [&] { staged_fp8_kernel<kT, kS, kHops, kWork, kPairMV, kScales><<<grid, kT, smem>>>(bufs[0], bufs[1], bufs[2], m, v, n8, chunk, table, ms, vs); });
  const double bytes = static_cast<double>(n8) * 8 * 14 + (kScales ? 2.0 * n8 : 0.0);
  static const char* const scales[] = {"no scales      ", "scales: 2 bytes", "scales: 1 short", "scales: 2 words"};
  std::printf("fp8 staged: %4d threads, %d stages, %d hops, %3d FMA, m|v %s, %s, chunk %6ld: grid %7u, %d blocks an SM: %8.2f ms  %5.2f TB/s\n",
              kT, kS, kHops, kWork, kPairMV ? "paired 16 B" : "8 B each ", scales[kScales], chunk, grid, per_sm, median,
              bytes / median / 1e9);
}

template <int kT, int kS, int kHops = 0>
void run_staged_bf16(std::vector<uint4*>& bufs, long n8, long chunk) {
  const long* table = zeroed_table();
  const size_t smem = size_t{kS} * 6 * kT * 16;
  CHECK(cudaFuncSetAttribute(staged_bf16_kernel<kT, kS, kHops>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, staged_bf16_kernel<kT, kS, kHops>, kT, smem));
  const unsigned grid = static_cast<unsigned>((n8 * 8 + chunk - 1) / chunk);
  const float median = median_ms([&] {
    staged_bf16_kernel<kT, kS, kHops><<<grid, kT, smem>>>(bufs[0], bufs[1], bufs[2], bufs[3], bufs[4], n8, chunk, table);
  });
  const double bytes = static_cast<double>(n8) * 16 * 9;
  std::printf("bf16 staged: %4d threads, %d stages, %d hops, chunk %6ld: grid %7u, %d blocks an SM: %8.2f ms  %5.2f TB/s\n",
              kT, kS, kHops, chunk, grid, per_sm, median, bytes / median / 1e9);
}

// `bytes` of addresses backed by cuMemCreate allocations of `chunk` bytes each, mapped back
// to back (gpu::ResidentBlock's way, whose chunks are 2 MB below 2 TB a block).
void* vmm_alloc(size_t bytes, size_t chunk) {
  CHECK(cudaFree(nullptr));
  int device = 0;
  CHECK(cudaGetDevice(&device));
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  size_t granularity = 0;
  CU_CHECK(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  chunk = (chunk + granularity - 1) / granularity * granularity;
  const size_t reserved = (bytes + chunk - 1) / chunk * chunk;
  CUdeviceptr base = 0;
  CU_CHECK(cuMemAddressReserve(&base, reserved, granularity, 0, 0));
  for (size_t at = 0; at < reserved; at += chunk) {
    CUmemGenericAllocationHandle handle = 0;
    CU_CHECK(cuMemCreate(&handle, chunk, &prop, 0));
    CU_CHECK(cuMemMap(base + at, chunk, 0, handle, 0));
    CU_CHECK(cuMemRelease(handle));  // the mapping keeps it
  }
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU_CHECK(cuMemSetAccess(base, reserved, &access, 1));
  return reinterpret_cast<void*>(base);
}

int main(int argc, char** argv) {
  // Default: 4.80 e9 elements (mixtral-mini's 4.76 B parameters), 9.6 GB a stream, 5 streams.
  const long n = argc > 1 ? std::atol(argv[1]) : 4'800'000'000L;
  const long n16 = n / 8;
  const int mode = argc > 2 ? std::atoi(argv[2]) : 0;
  const long chunk_mb = mode == 4 && argc > 3 ? std::atol(argv[3]) : 0;
  std::vector<uint4*> bufs(5);
  for (auto& p : bufs) {
    if (chunk_mb > 0)
      p = static_cast<uint4*>(vmm_alloc(n16 * 16, static_cast<size_t>(chunk_mb) << 20));
    else
      CHECK(cudaMalloc(&p, n16 * 16));
    CHECK(cudaMemset(p, 1, n16 * 16));
  }
  if (mode == 4) {
    std::printf("memory: %s\n", chunk_mb > 0 ? (std::to_string(chunk_mb) + " MB cuMemCreate allocations").c_str() : "cudaMalloc");
    for (int rep = 0; rep < 2; ++rep) {
      run_fp8_moments(bufs, n16, 0);
      run<5, 4>("5 reads, 4 writes (AdamW, bf16 state)", bufs, n16, false, 0);
      run_staged<512, 2, 4, 512>(bufs, n16, 1 << 14);
      run_staged_bf16<512, 2, 4>(bufs, n16, 1 << 14);
    }
    return 0;
  }
  const bool only_adamw = mode == 1;  // just the two AdamW patterns
  for (int blocks : {0, 4}) {
    run_fp8_moments(bufs, n16, blocks);
    run<5, 4>("5 reads, 4 writes (AdamW, bf16 state)", bufs, n16, false, blocks);
  }
  if (mode == 3) {  // the scale bytes' streams, as shipped and interleaved
    for (int rep = 0; rep < 2; ++rep) {
      run_staged<512, 2, 4, 512>(bufs, n16, 1 << 14);
      run_staged<512, 2, 4, 512, false, 1>(bufs, n16, 1 << 14);
      run_staged<512, 2, 4, 512, false, 2>(bufs, n16, 1 << 14);
      run_staged<512, 2, 4, 512, false, 3>(bufs, n16, 1 << 14);
      run_staged<512, 2, 4, 0, false, 1>(bufs, n16, 1 << 14);
      run_staged<512, 2, 4, 0, false, 2>(bufs, n16, 1 << 14);
    }
    return 0;
  }
  if (mode == 2) {  // the fp8 pattern staged as the fp8 AdamW kernel stages it
    run_staged<512, 2>(bufs, n16, 1 << 14);  // as shipped: 80 KB, 2 blocks an SM
    run_staged<512, 2, 2>(bufs, n16, 1 << 14);
    run_staged<512, 2, 4>(bufs, n16, 1 << 14);
    run_staged<512, 2, 4>(bufs, n16, 1 << 16);
    run_staged<512, 2, 4, 256>(bufs, n16, 1 << 14);
    run_staged<512, 2, 4, 512>(bufs, n16, 1 << 14);
    run_staged<512, 3, 4, 512>(bufs, n16, 1 << 14);
    run_staged<512, 2, 4, 0, true>(bufs, n16, 1 << 14);
    run_staged<512, 2, 4, 512, true>(bufs, n16, 1 << 14);
    run_staged_bf16<512, 2>(bufs, n16, 1 << 14);  // the bf16-moment kernel's: 96 KB, 2 blocks an SM
    run_staged_bf16<512, 2, 4>(bufs, n16, 1 << 14);
    run_staged_bf16<256, 3, 4>(bufs, n16, 1 << 14);
    run_staged<512, 2>(bufs, n16, 1 << 16);
    run_staged<512, 3>(bufs, n16, 1 << 14);
    run_staged<256, 2>(bufs, n16, 1 << 14);
    run_staged<256, 3>(bufs, n16, 1 << 14);
    run_staged<256, 4>(bufs, n16, 1 << 14);
    run_staged<128, 4>(bufs, n16, 1 << 14);
    run_staged<1024, 2>(bufs, n16, 1 << 14);
    return 0;
  }
  if (only_adamw) return 0;
  for (bool persistent : {false, true}) {
    run<1, 1>("copy: 1 read, 1 write", bufs, n16, persistent);
    run<2, 1>("2 reads, 1 write", bufs, n16, persistent);
    run<3, 2>("3 reads, 2 writes (SwiGLU backward)", bufs, n16, persistent);
    run<5, 4>("5 reads, 4 writes (AdamW, bf16 state)", bufs, n16, persistent);
    run<5, 0>("5 reads", bufs, n16, persistent);
    run<1, 0>("1 read", bufs, n16, persistent);
  }
  for (int blocks : {4, 2}) {
    run<1, 1>("copy: 1 read, 1 write", bufs, n16, false, blocks);
    run<5, 4>("5 reads, 4 writes (AdamW, bf16 state)", bufs, n16, false, blocks);
  }
  return 0;
}

// Our own Hopper kernel for the down projection's data gradient with SwiGLU's backward fused
// in (PaddedExpertGemmBf16::backward_data_swiglu): d act [R, F] = dy [R, D] @ W2_e (W2 as
// stored, [E][D][F]: B MN-major, as DeepGEMM's data kernel reads it) stays in shared memory,
// rounded to bf16 as the data kernel stores it; from it and gate|up [R, 2F] the kernel writes
// d gate|up [R, 2F] and (optionally) act [R, F] as swiglu_backward writes them, bit for bit.
// The same split as bf16_deepgemm_swiglu.cu: the math warps stage each d act tile and go on
// to the next tile's mainloop; three idle warps of the TMA warp group read it, load gate and
// up from global memory (16 bytes a thread, a row's 512 contiguous bytes a warp), and store
// d gate, d up and act straight from registers (no staging: nothing else of the tile is
// stored), then free the staged tile. So d act never goes to memory, and SwiGLU's backward
// pass (its bytes and its exponentials) runs beside the tensor cores.
// docs/KERNEL_ROADMAP.md, "Its backward in the down projection's data-gradient epilogue".
#include <cutlass/arch/barrier.h>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <deep_gemm/comm/barrier.cuh>
#include <deep_gemm/common/tma_copy.cuh>
#include <deep_gemm/common/types.cuh>
#include <deep_gemm/mma/sm90.cuh>
#include <deep_gemm/ptx/utils.cuh>
#include <deep_gemm/scheduler/gemm.cuh>

#include "kernels/cuda/bf16_deepgemm_fused.cuh"
#include "kernels/cuda/swiglu_math.cuh"
#include "kernels/gpu_ops.h"

namespace moe::cuda::bf16_deepgemm {

namespace {

constexpr auto kMNMajor = cute::UMMA::Major::MN;
constexpr uint32_t kChunksPerRow = kBlockN / 8;  // 16-byte chunks of the staged tile's rows
constexpr uint32_t kLoadBatch = 8;                // chunks a SwiGLU warp's thread loads before it computes

// 8 bf16 of a uint4 as floats, and back.
__device__ __forceinline__ void unpack_chunk(const uint4& v, float (&out)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (uint32_t j = 0; j < 8; ++j) out[j] = bf16_half(w[j / 2], j % 2);
}
__device__ __forceinline__ uint4 pack_chunk(const float (&in)[8]) {
  return make_uint4(bf16_pair(in[0], in[1]), bf16_pair(in[2], in[3]), bf16_pair(in[4], in[5]), bf16_pair(in[6], in[7]));
}

// SwiGLU's backward over chunks [begin, end) of the staged d act tile (chunk c: row c / 32,
// columns 8 (c % 32) .. + 7) by kThreads threads, thread t taking every kThreads-th chunk:
// kBatch chunks' gate and up loads in flight before any is used.
template <uint32_t kThreads, uint32_t kBatch>
__device__ __forceinline__ void swiglu_backward_chunks(uint32_t begin, uint32_t end, uint32_t t, const uint8_t* tile_d,
                                                       uint32_t m_block, uint32_t n_block, uint32_t rows, uint32_t f,
                                                       const bf16* __restrict__ gate_up, bf16* __restrict__ dgate_up,
                                                       bf16* __restrict__ act) {
  const int64_t ld = 2 * static_cast<int64_t>(f);
  for (uint32_t first = begin; first < end; first += kBatch * kThreads) {
    uint4 gate[kBatch], up[kBatch];
#pragma unroll
    for (uint32_t j = 0; j < kBatch; ++j) {
      const uint32_t c = first + j * kThreads + t, col = n_block * kBlockN + (c % kChunksPerRow) * 8;
      const int64_t row = static_cast<int64_t>(m_block) * kBlockM + c / kChunksPerRow;
      if (c >= end || col >= f || row >= rows) continue;
      gate[j] = __ldg(reinterpret_cast<const uint4*>(gate_up + row * ld + col));
      up[j] = __ldg(reinterpret_cast<const uint4*>(gate_up + row * ld + f + col));
    }
#pragma unroll
    for (uint32_t j = 0; j < kBatch; ++j) {
      const uint32_t c = first + j * kThreads + t, r = c / kChunksPerRow, chunk = c % kChunksPerRow;
      const uint32_t col = n_block * kBlockN + chunk * 8;
      const int64_t row = static_cast<int64_t>(m_block) * kBlockM + r;
      if (c >= end || col >= f || row >= rows) continue;
      const uint32_t at = (chunk / 8) * kActAtomBytes + r * kSwizzle + (((chunk % 8) ^ (r % 8)) * 16);
      float da[8], g[8], u[8], a[8], dg[8], du[8];
      unpack_chunk(*reinterpret_cast<const uint4*>(tile_d + at), da);
      unpack_chunk(gate[j], g);
      unpack_chunk(up[j], u);
      swiglu_value_and_grads_n(g, u, da, a, dg, du);
      *reinterpret_cast<uint4*>(dgate_up + row * ld + col) = pack_chunk(dg);
      *reinterpret_cast<uint4*>(dgate_up + row * ld + f + col) = pack_chunk(du);
      if (act) *reinterpret_cast<uint4*>(act + row * f + col) = pack_chunk(a);
    }
  }
}

template <uint32_t kGroups, uint32_t kMulticast>
__global__ void __launch_bounds__(kTmaThreads + kMathThreads, 1)
    data_swiglu_backward_kernel(int* group_ends, uint32_t rows, uint32_t f, uint32_t k,
                                const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_w2,
                                const bf16* __restrict__ gate_up, bf16* __restrict__ dgate_up, bf16* __restrict__ act,
                                uint32_t math_rows) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using WGMMA = typename deep_gemm::mma::sm90::BF16MMASelector<kBlockN, kKMajor, kMNMajor>::type;
  static_assert(WGMMA::M == 64 && WGMMA::kNumAccum == 128, "a warp group's 64 x 256 accumulators");
  constexpr uint32_t kGroupsOf8 = WGMMA::kNumAccum / 4;
  const uint32_t warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0);
  const uint32_t lane = deep_gemm::ptx::get_lane_idx();

  extern __shared__ __align__(1024) uint8_t shared[];
  const FusedShared smem{shared};  // the forward kernel's layout; its spare atom unused here
  uint8_t* tile_d = smem.tile_d();  // d act's staged tile
  Barrier* tile_staged = smem.tile_staged();
  Barrier* tile_free = smem.tile_free();

  if (warp == kMathThreads / 32 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(&map_dy);
    cute::prefetch_tma_descriptor(&map_w2);
  }
  init_barriers<kMulticast>(smem, warp);

  auto scheduler = deep_gemm::sched::Scheduler<deep_gemm::GemmType::MGroupedContiguousWithPsumLayout, kBlockM, kBlockN,
                                               kGroups, kMulticast, false, static_cast<uint32_t>(kDeepGemmSms)>(
      rows, f, k, group_ends);
  const uint32_t k_blocks = (k + kBlockK - 1) / kBlockK;
  uint32_t tile_phase = 0;
  uint32_t m_block = 0, n_block = 0;

  if (warp == kMathThreads / 32 + 2) {
    // One thread loads: dy's rows and W2_e's [64 of K][256 of N] (four 64-column atoms).
    produce<kMulticast>(scheduler, smem, k_blocks,
                        [&](uint32_t m, uint32_t n, uint32_t kb, Barrier* full, Bf16* a, Bf16* b, uint32_t multicast_b) {
                          deep_gemm::tma::copy<kBlockK, kBlockM, kSwizzle, Bf16>(&map_dy, full, a, kb * kBlockK,
                                                                                 m * kBlockM, 1);
                          deep_gemm::tma::copy<kBlockN, kBlockK, kSwizzle, Bf16>(
                              &map_w2, full, b, n * kBlockN, scheduler.current_group_idx * k + kb * kBlockK,
                              multicast_b);
                        });
    return;
  }

  if (warp >= kMathThreads / 32) {
    // The SwiGLU warps: the staged tile's rows from math_rows on (the math warps take the
    // first math_rows themselves).
    const uint32_t t = swiglu_thread(warp, lane);
    if (lane == 0) tile_free->arrive();  // the staged tile starts free
    while (scheduler.get_next_block(m_block, n_block)) {
      tile_staged->wait(tile_phase);
      tile_phase ^= 1;
      swiglu_backward_chunks<kSwigluWarps * 32, kLoadBatch>(math_rows * kChunksPerRow, kBlockM * kChunksPerRow, t,
                                                            tile_d, m_block, n_block, rows, f, gate_up, dgate_up, act);
      __syncwarp();
      if (lane == 0) tile_free->arrive();  // the staged tile read out: the next epilogue may write it
    }
    return;
  }

  Mainloop<WGMMA, kMNMajor, kMulticast> mainloop(smem, __shfl_sync(0xffffffffu, threadIdx.x / 128, 0));
  while (scheduler.get_next_block(m_block, n_block)) {
    float acc[WGMMA::kNumAccum];
    mainloop.run(acc, smem, k_blocks, scheduler, lane);
    // d act as the data kernel would store it (bf16), into the staged tile once the SwiGLU
    // warps have read the last one out.
    tile_free->wait(tile_phase);
    tile_phase ^= 1;
    // Every math warp done with its rows of the last tile before any overwrites it.
    if (math_rows > 0) cutlass::arch::NamedBarrier::sync(kMathThreads, 0);
#pragma unroll
    for (uint32_t i = 0; i < kGroupsOf8; ++i)
      stsm_x2(staged_at(tile_d, warp, lane, i), bf16_pair(acc[i * 4 + 0], acc[i * 4 + 1]),
              bf16_pair(acc[i * 4 + 2], acc[i * 4 + 3]));
    cutlass::arch::NamedBarrier::sync(kMathThreads, 0);
    if (lane == 0) tile_staged->arrive();
    // The first math_rows rows of the tile by the math warps themselves (their accumulators
    // are in the staged tile now), so that the SwiGLU warps' share fits in the next mainloop.
    swiglu_backward_chunks<kMathThreads, 4>(0, math_rows * kChunksPerRow, threadIdx.x, tile_d, m_block, n_block, rows,
                                            f, gate_up, dgate_up, act);
  }
#endif
}

template <uint32_t kMulticast>
struct DataSwigluBackward {
  template <uint32_t G>
  struct Pick {
    static constexpr SwigluBackwardKernel value = &data_swiglu_backward_kernel<G, kMulticast>;
  };
};

}  // namespace

SwigluBackwardKernel data_swiglu_backward_kernel_for(int64_t experts, bool pairs) {
  return by_groups_and_cluster<DataSwigluBackward>(experts, pairs);
}

}  // namespace moe::cuda::bf16_deepgemm

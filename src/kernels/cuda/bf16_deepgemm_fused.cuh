// Device pieces of our fused kernels built on DeepGEMM's bf16 tiles (bf16_deepgemm_kernels.h):
// the tile sizes, the shared memory's layout and barriers, the TMA warp's producer loop, the
// math warp groups' mainloop, the staged output tile's swizzled addressing, bf16 pairs and
// the warps' STSM. Included by bf16_deepgemm_swiglu.cu (the forward's gate|up + SwiGLU) and
// bf16_deepgemm_swiglu_backward.cu (the down projection's data gradient + SwiGLU's backward),
// which differ in B's loads and major mode and in their epilogues.
#pragma once
#include <cuda_bf16.h>
#include <cutlass/arch/barrier.h>

#include <cstdint>
#include <cute/arch/cluster_sm90.hpp>
#include <deep_gemm/comm/barrier.cuh>
#include <deep_gemm/mma/sm90.cuh>
#include <deep_gemm/ptx/utils.cuh>
#include <deep_gemm/ptx/wgmma.cuh>

#include "kernels/cuda/bf16_deepgemm_instance.cuh"

namespace moe::cuda::bf16_deepgemm {

using Bf16 = cutlass::bfloat16_t;
constexpr auto kKMajor = cute::UMMA::Major::K;
constexpr uint32_t kSwizzle = 128;                        // bytes: every tile's rows are 64 bf16
constexpr uint32_t kAtomCols = kSwizzle / sizeof(Bf16);   // 64 columns a swizzle atom
constexpr uint32_t kHalfN = kBlockN / 2;                  // 128 gate (and up) columns a CTA
constexpr uint32_t kTileA = kBlockM * kBlockK * sizeof(Bf16), kTileB = kBlockN * kBlockK * sizeof(Bf16);
constexpr uint32_t kTileD = kBlockM * kBlockN * sizeof(Bf16);
static_assert(kTileD % 1024 == 0 && kTileA % 1024 == 0 && kTileB % 1024 == 0, "the 128-byte swizzle's alignment");
static_assert(kBlockM == 128 && kMathThreads == 256 && kBlockK == kAtomCols, "two warp groups of 64 rows, K in atoms");
constexpr uint32_t kActAtomBytes = kBlockM * kSwizzle;  // 16 KB: [128 rows][64 columns] of bf16
constexpr uint32_t kSwigluWarps = 3;                    // the TMA warp group's warps 0, 1 and 3
static_assert(swiglu_shared_bytes() == size_t{kTileD} + kStages * (kTileA + kTileB) + kActAtomBytes +
                                           (2 * kStages + 2) * 8,
              "bf16_deepgemm_kernels.h's count of the fused kernels' shared memory");
using Barrier = cutlass::arch::ClusterTransactionBarrier;

// The fused kernels' shared memory (swiglu_shared_bytes): the staged output tile, kStages of
// A and B, one spare 16 KB atom, then the barriers: each stage's full and empty, and the
// staged tile's hand-over between the math warps (8 arrivals a tile) and the SwiGLU warps (3).
struct FusedShared {
  uint8_t* base;
  __device__ __forceinline__ uint8_t* tile_d() const { return base; }
  __device__ __forceinline__ Bf16* tile_a(uint32_t s) const {
    return reinterpret_cast<Bf16*>(base + kTileD + s * kTileA);
  }
  __device__ __forceinline__ Bf16* tile_b(uint32_t s) const {
    return reinterpret_cast<Bf16*>(base + kTileD + kStages * kTileA + s * kTileB);
  }
  __device__ __forceinline__ uint8_t* spare() const { return base + kTileD + kStages * (kTileA + kTileB); }
  __device__ __forceinline__ Barrier* full() const { return reinterpret_cast<Barrier*>(spare() + kActAtomBytes); }
  __device__ __forceinline__ Barrier* empty() const { return full() + kStages; }
  __device__ __forceinline__ Barrier* tile_staged() const { return full() + 2 * kStages; }
  __device__ __forceinline__ Barrier* tile_free() const { return full() + 2 * kStages + 1; }
};

// The barriers set up by one thread of warp 9, then the cluster's CTAs in step.
template <uint32_t kMulticast>
__device__ __forceinline__ void init_barriers(const FusedShared& smem, uint32_t warp) {
  if (warp == kMathThreads / 32 + 1 && cute::elect_one_sync()) {
    for (uint32_t s = 0; s < kStages; ++s) {
      smem.full()[s].init(1);
      smem.empty()[s].init(kMulticast * kMathThreads / 32);
    }
    smem.tile_staged()->init(kMathThreads / 32);
    smem.tile_free()->init(kSwigluWarps);
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (kMulticast > 1)
    deep_gemm::comm::cluster_sync_with_relaxed_arrive();
  else
    __syncthreads();
}

// The stage of the A | B pipeline and its phase, advanced after each k block.
struct Pipeline {
  uint32_t stage = 0, phase = 0;
  __device__ __forceinline__ void advance() {
    stage = stage == kStages - 1 ? 0 : stage + 1;
    phase ^= stage == 0;
  }
};

// The TMA warp's loop (one elected thread): for each tile and k block, a free stage, then
// load(m_block, n_block, kb, full barrier, A's tile, B's tile, B's multicast) issues its
// copies of kTileA + kTileB bytes. Clusters: the peer's last arrivals on our empty barriers
// are awaited before the CTA exits.
template <uint32_t kMulticast, typename Scheduler, typename Load>
__device__ __forceinline__ void produce(Scheduler& scheduler, const FusedShared& smem, uint32_t k_blocks,
                                        const Load& load) {
  if (!cute::elect_one_sync()) return;
  Pipeline p;
  uint32_t m_block = 0, n_block = 0;
  while (scheduler.get_next_block(m_block, n_block)) {
    const uint32_t multicast_b = scheduler.is_tma_multicast_valid(m_block) ? kMulticast : 1;
    for (uint32_t kb = 0; kb < k_blocks; ++kb, p.advance()) {
      smem.empty()[p.stage].wait(p.phase ^ 1);
      load(m_block, n_block, kb, &smem.full()[p.stage], smem.tile_a(p.stage), smem.tile_b(p.stage), multicast_b);
      smem.full()[p.stage].arrive_and_expect_tx(kTileA + kTileB);
    }
  }
  if constexpr (kMulticast > 1)
    for (uint32_t s = 0; s < kStages; ++s, p.advance()) smem.empty()[p.stage].wait(p.phase ^ 1);
}

// The math warp groups' mainloop: a warp group's 64 rows of A (K-major) against B's 256
// columns (kMajorB) over every k block into acc, each stage freed (the peer CTA's too in a
// cluster) once its WGMMAs are done.
template <typename WGMMA, cute::UMMA::Major kMajorB, uint32_t kMulticast>
struct Mainloop {
  cute::GmmaDescriptor a_desc, b_desc;
  uint32_t a_lo, b_lo;
  Pipeline p;
  __device__ __forceinline__ Mainloop(const FusedShared& smem, uint32_t math_group)
      : a_desc(deep_gemm::mma::sm90::make_gmma_desc<kKMajor, kBlockM, kBlockK, kSwizzle>(smem.tile_a(0),
                                                                                         math_group * WGMMA::M, 0)),
        b_desc(deep_gemm::mma::sm90::make_gmma_desc<kMajorB, kBlockN, kBlockK, kSwizzle>(smem.tile_b(0), 0, 0)),
        a_lo(__shfl_sync(0xffffffffu, a_desc.reg32_[0], 0)),
        b_lo(__shfl_sync(0xffffffffu, b_desc.reg32_[0], 0)) {}

  template <typename Scheduler>
  __device__ __forceinline__ void run(float (&acc)[WGMMA::kNumAccum], const FusedShared& smem, uint32_t k_blocks,
                                      const Scheduler& scheduler, uint32_t lane) {
#pragma unroll
    for (uint32_t i = 0; i < WGMMA::kNumAccum; ++i) acc[i] = 0.0f;
    for (uint32_t kb = 0; kb < k_blocks; ++kb, p.advance()) {
      const uint32_t a_base = a_lo + p.stage * (kTileA / 16), b_base = b_lo + p.stage * (kTileB / 16);
      smem.full()[p.stage].wait(p.phase);
#pragma unroll
      for (uint32_t i = 0; i < WGMMA::kNumAccum; ++i) deep_gemm::ptx::warpgroup_fence_operand(acc[i]);
      deep_gemm::ptx::warpgroup_arrive();
#pragma unroll
      for (uint32_t kk = 0; kk < kBlockK / WGMMA::K; ++kk) {
        a_desc.reg32_[0] = deep_gemm::mma::sm90::advance_gmma_desc_lo<kKMajor, kBlockM, kBlockK, kSwizzle, nv_bfloat16>(
            a_base, 0, kk * WGMMA::K);
        b_desc.reg32_[0] = deep_gemm::mma::sm90::advance_gmma_desc_lo<kMajorB, kBlockN, kBlockK, kSwizzle, nv_bfloat16>(
            b_base, 0, kk * WGMMA::K);
        WGMMA::wgmma(a_desc, b_desc, acc, true);
      }
      deep_gemm::ptx::warpgroup_commit_batch();
#pragma unroll
      for (uint32_t i = 0; i < WGMMA::kNumAccum; ++i) deep_gemm::ptx::warpgroup_fence_operand(acc[i]);
      deep_gemm::ptx::warpgroup_wait<0>();
      if constexpr (kMulticast == 1) {
        if (lane == 0) smem.empty()[p.stage].arrive();
      } else {
        const uint32_t target = scheduler.is_peer_cta_alive ? lane : cute::block_rank_in_cluster();
        if (lane < kMulticast) smem.empty()[p.stage].arrive(target);
      }
    }
  }
};
// The SwiGLU warps' index 0..95 (the TMA warp group's warps 0, 1 and 3; warp 2 loads).
__device__ __forceinline__ uint32_t swiglu_thread(uint32_t warp, uint32_t lane) {
  return (warp == kMathThreads / 32 + 3 ? 2 : warp - kMathThreads / 32) * 32 + lane;
}

// Where a warp's STSM of accumulator group i (8 columns of 16 rows: the warp's rows, lane l
// addressing row l) goes in a tile staged as atoms of [kBlockM][64] bf16, 128-byte swizzled.
__device__ __forceinline__ uint8_t* staged_at(uint8_t* tile, uint32_t warp, uint32_t lane, uint32_t i) {
  const uint32_t atom = i / 8, chunk = (i % 8) ^ (lane % 8);
  return tile + atom * kBlockM * kSwizzle + warp * 16 * kSwizzle + lane * kSwizzle + chunk * 16;
}

// Two floats rounded to bf16, a in the low half (one conversion for both), and back.
__device__ __forceinline__ uint32_t bf16_pair(float a, float b) {
  const __nv_bfloat162 pair = __float22bfloat162_rn({a, b});
  return *reinterpret_cast<const uint32_t*>(&pair);
}
__device__ __forceinline__ float bf16_half(uint32_t pair, uint32_t high) {
  return __uint_as_float(high ? pair & 0xffff0000u : pair << 16);
}
// One warp's two 8 x 8 bf16 matrices (rows 0-7 and 8-15 of its 16) into shared memory.
__device__ __forceinline__ void stsm_x2(const uint8_t* at, uint32_t rows_0_7, uint32_t rows_8_15) {
  asm volatile("stmatrix.sync.aligned.x2.m8n8.shared.b16 [%0], {%1, %2};\n" ::"l"(__cvta_generic_to_shared(at)),
               "r"(rows_0_7), "r"(rows_8_15));
}

}  // namespace moe::cuda::bf16_deepgemm

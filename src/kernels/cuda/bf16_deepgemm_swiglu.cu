// Our own Hopper kernel for the experts' gate|up projection with SwiGLU fused in
// (PaddedExpertGemmBf16::forward_swiglu): gate|up [R, 2F] = x [R, K] @ [w1_e; w3_e]^T as the
// forward kernel writes it, and act [R, F] = silu(gate) * up from the staged tile, so that
// no separate pass reads gate|up back from memory. Built from DeepGEMM's device pieces (its
// scheduler, TMA copies, WGMMA wrappers) in bf16_deepgemm_kernels.h's tiles; what differs
// from DeepGEMM's own bf16 kernel:
// - a CTA's 256 columns are 128 of gate and the same 128 of up: B's tile is two TMA boxes,
//   rows e * 2F + 128 n and e * 2F + F + 128 n of the interleaved weights;
// - the math warp groups' epilogue stores gate|up's four 64-column atoms at columns 128 n
//   (+ 64) and F + 128 n (+ 64) as DeepGEMM's stores its tile, and signals the tile staged;
// - three warps of the TMA warp group (idle in DeepGEMM's: one thread issues the loads)
//   compute act from the staged tile while the math warps run the next tile's mainloop,
//   stage it an atom at a time (16 KB: shared memory holds no more beside 3 stages) and
//   store it, then free the staged tile for the next epilogue. SwiGLU's exponentials and
//   reciprocals then overlap the tensor cores instead of following them.
// act's bits are swiglu_forward's: gate and up as stored (bf16), swiglu_math.cuh's
// expression, rounded to bf16. docs/KERNEL_ROADMAP.md, "SwiGLU in the gate|up GEMM's epilogue".
#include <cutlass/arch/barrier.h>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <deep_gemm/comm/barrier.cuh>
#include <deep_gemm/common/tma_copy.cuh>
#include <deep_gemm/common/types.cuh>
#include <deep_gemm/mma/sm90.cuh>
#include <deep_gemm/ptx/ld_st.cuh>
#include <deep_gemm/ptx/utils.cuh>
#include <deep_gemm/scheduler/gemm.cuh>

#include "kernels/cuda/bf16_deepgemm_fused.cuh"
#include "kernels/cuda/swiglu_math.cuh"
#include "kernels/gpu_ops.h"

namespace moe::cuda::bf16_deepgemm {

namespace {

template <uint32_t kGroups, uint32_t kMulticast>
__global__ void __launch_bounds__(kTmaThreads + kMathThreads, 1)
    gate_up_swiglu_kernel(int* group_ends, uint32_t rows, uint32_t n2, uint32_t k,
                          const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                          const __grid_constant__ CUtensorMap map_gate_up, const __grid_constant__ CUtensorMap map_act) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using WGMMA = typename deep_gemm::mma::sm90::BF16MMASelector<kBlockN, kKMajor, kKMajor>::type;
  static_assert(WGMMA::M == 64 && WGMMA::kNumAccum == 128, "a warp group's 64 x 256 accumulators");
  constexpr uint32_t kGroupsOf8 = WGMMA::kNumAccum / 4;  // 32: 8 columns each
  const uint32_t warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0);
  const uint32_t lane = deep_gemm::ptx::get_lane_idx();
  const uint32_t f = n2 / 2;

  extern __shared__ __align__(1024) uint8_t shared[];
  const FusedShared smem{shared};
  uint8_t* tile_d = smem.tile_d();  // gate|up's staged tile
  uint8_t* act_atom = smem.spare();  // one staged atom of act
  Barrier* tile_staged = smem.tile_staged();
  Barrier* tile_free = smem.tile_free();

  if (warp == kMathThreads / 32 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(&map_x);
    cute::prefetch_tma_descriptor(&map_w);
    cute::prefetch_tma_descriptor(&map_gate_up);
    cute::prefetch_tma_descriptor(&map_act);
  }
  init_barriers<kMulticast>(smem, warp);

  auto scheduler = deep_gemm::sched::Scheduler<deep_gemm::GemmType::MGroupedContiguousWithPsumLayout, kBlockM, kBlockN,
                                               kGroups, kMulticast, false, static_cast<uint32_t>(kDeepGemmSms)>(
      rows, n2, k, group_ends);
  const uint32_t k_blocks = (k + kBlockK - 1) / kBlockK;
  uint32_t tile_phase = 0;
  uint32_t m_block = 0, n_block = 0;

  if (warp == kMathThreads / 32 + 2) {
    // One thread loads: x's rows, gate's 128 weight rows and up's same 128.
    produce<kMulticast>(scheduler, smem, k_blocks,
                        [&](uint32_t m, uint32_t n, uint32_t kb, Barrier* full, Bf16* a, Bf16* b, uint32_t multicast_b) {
                          const uint32_t row_gate = scheduler.current_group_idx * n2 + n * kHalfN;
                          deep_gemm::tma::copy<kBlockK, kBlockM, kSwizzle, Bf16>(&map_x, full, a, kb * kBlockK,
                                                                                 m * kBlockM, 1);
                          deep_gemm::tma::copy<kBlockK, kHalfN, kSwizzle, Bf16>(&map_w, full, b, kb * kBlockK,
                                                                                row_gate, multicast_b);
                          deep_gemm::tma::copy<kBlockK, kHalfN, kSwizzle, Bf16>(&map_w, full, b + kHalfN * kBlockK,
                                                                                kb * kBlockK, row_gate + f, multicast_b);
                        });
    return;
  }

  if (warp >= kMathThreads / 32) {
    // The SwiGLU warps: act atom a (columns 64 a of the tile's 128) from gate's atom a and
    // up's atom a + 2 of the staged tile, 16 bytes (8 values) a thread at a time.
    const uint32_t t = swiglu_thread(warp, lane);
    const bool issuer = t == 0;
    if (lane == 0) tile_free->arrive();  // the staged tile starts free
    while (scheduler.get_next_block(m_block, n_block)) {
      tile_staged->wait(tile_phase);
      tile_phase ^= 1;
#pragma unroll 1
      for (uint32_t a = 0; a < kHalfN / kAtomCols; ++a) {
        if (issuer) cute::tma_store_wait<0>();  // the last atom's store has read act_atom
        cutlass::arch::NamedBarrier::sync(kSwigluWarps * 32, 1);
#pragma unroll 2
        for (uint32_t c = t; c < kBlockM * 8; c += kSwigluWarps * 32) {
          const uint32_t at = (c / 8) * kSwizzle + (((c % 8) ^ (c / 8 % 8)) * 16);  // row c / 8, chunk c % 8
          const uint4 gate = *reinterpret_cast<const uint4*>(tile_d + a * kActAtomBytes + at);
          const uint4 up = *reinterpret_cast<const uint4*>(tile_d + (a + 2) * kActAtomBytes + at);
          const uint32_t gw[4] = {gate.x, gate.y, gate.z, gate.w}, uw[4] = {up.x, up.y, up.z, up.w};
          float g[8], u[8], v[8];
#pragma unroll
          for (uint32_t j = 0; j < 8; ++j) {
            g[j] = bf16_half(gw[j / 2], j % 2);
            u[j] = bf16_half(uw[j / 2], j % 2);
          }
          swiglu_value_n(g, u, v);
          *reinterpret_cast<uint4*>(act_atom + at) =
              make_uint4(bf16_pair(v[0], v[1]), bf16_pair(v[2], v[3]), bf16_pair(v[4], v[5]), bf16_pair(v[6], v[7]));
        }
        if (a + 1 == kHalfN / kAtomCols) {  // the staged tile read out: the next epilogue may write it
          __syncwarp();
          if (lane == 0) tile_free->arrive();
        }
        cute::tma_store_fence();
        cutlass::arch::NamedBarrier::sync(kSwigluWarps * 32, 1);
        if (issuer) {
          cute::SM90_TMA_STORE_2D::copy(&map_act, act_atom, n_block * kHalfN + a * kAtomCols, m_block * kBlockM);
          cute::tma_store_arrive();
        }
      }
    }
    if (issuer) cute::tma_store_wait<0>();
    return;
  }

  Mainloop<WGMMA, kKMajor, kMulticast> mainloop(smem, __shfl_sync(0xffffffffu, threadIdx.x / 128, 0));
  while (scheduler.get_next_block(m_block, n_block)) {
    float acc[WGMMA::kNumAccum];
    mainloop.run(acc, smem, k_blocks, scheduler, lane);

    // The staged tile is free: the TMA has read the last tile's gate|up out of it and the
    // SwiGLU warps their act.
    if (threadIdx.x < kBlockN / kAtomCols) cute::tma_store_wait<0>();
    tile_free->wait(tile_phase);
    tile_phase ^= 1;
    cutlass::arch::NamedBarrier::sync(kMathThreads, 0);
#pragma unroll
    for (uint32_t i = 0; i < kGroupsOf8; ++i)
      stsm_x2(staged_at(tile_d, warp, lane, i), bf16_pair(acc[i * 4 + 0], acc[i * 4 + 1]),
              bf16_pair(acc[i * 4 + 2], acc[i * 4 + 3]));
    cute::tma_store_fence();
    cutlass::arch::NamedBarrier::sync(kMathThreads, 0);
    if (threadIdx.x < kBlockN / kAtomCols) {  // atoms 0, 1: gate's; 2, 3: up's
      const uint32_t atom = threadIdx.x, col = (atom < 2 ? 0 : f) + n_block * kHalfN + (atom % 2) * kAtomCols;
      cute::SM90_TMA_STORE_2D::copy(&map_gate_up, tile_d + atom * kBlockM * kSwizzle, col, m_block * kBlockM);
      cute::tma_store_arrive();
    }
    if (lane == 0) tile_staged->arrive();
    __syncwarp();
  }
  if (threadIdx.x < kBlockN / kAtomCols) cute::tma_store_wait<0>();
#endif
}

template <uint32_t kMulticast>
struct GateUpSwiglu {
  template <uint32_t G>
  struct Pick {
    static constexpr SwigluKernel value = &gate_up_swiglu_kernel<G, kMulticast>;
  };
};

}  // namespace

SwigluKernel gate_up_swiglu_kernel_for(int64_t experts, bool pairs) {
  return by_groups_and_cluster<GateUpSwiglu>(experts, pairs);
}

}  // namespace moe::cuda::bf16_deepgemm

// The experts' GEMMs as one CUTLASS Hopper grouped GEMM per operation (TMA + wgmma,
// warp-specialised cooperative persistent kernel). The per-group problem sizes, operand
// pointers and strides live in device arrays filled by a small kernel from the expert
// row offsets, so the number of rows per expert is never read on the host.
//
// One template, instantiated four times (one translation unit each, they compile slowly):
// forward (A row-major, B = weight [N, K] row-major, i.e. column-major K x N), data
// gradient (B = weight [K, N] row-major) and weight gradient (A = rows^T, fp32 or bf16
// output, grouped_gemm_weight.cuh).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/error_base.h"
#include "core/gpu.h"
#include "kernels/cuda/grouped_gemm_entry.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace moe::cuda::grouped {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group
using GroupShape = ProblemShape::UnderlyingProblemShape;
using ElementAB = cutlass::bfloat16_t;

// A stride (M, K, L) or (N, K, L) or (M, N, L) with one unit mode: sets the other to ld.
template <class Stride>
__host__ __device__ Stride leading_stride(int64_t ld) {
  Stride stride{};
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(stride))>>::value)
    cute::get<1>(stride) = ld;
  else
    cute::get<0>(stride) = ld;
  return stride;
}

template <class LayoutA, class LayoutB, class ElementD>
struct GroupedGemmKernel {
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignmentAB = 8;  // 16-byte rows for TMA
  static constexpr int kAlignmentD = 16 / static_cast<int>(sizeof(ElementD));
  // 128 x 256 output tiles over two SMs' cluster: the shape CUTLASS's Hopper grouped GEMM
  // reaches its best bf16 rate with at the bench models' expert sizes.
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  static_assert(cute::size(ClusterShape{}) == moe::cuda::grouped::kClusterSms,
                "grouped_gemm_entry.h's kClusterSms is the cluster's size");

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, LayoutD*, kAlignmentD, ElementD,
      LayoutD*, kAlignmentD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA*, kAlignmentAB, ElementAB, LayoutB*,
      kAlignmentAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;

  // The per-group arrays the kernel reads (device memory, carved from one block).
  struct Groups {
    GroupShape* shapes;
    const ElementAB** a;
    const ElementAB** b;
    const ElementD** c;
    ElementD** d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideC* stride_c;
    StrideD* stride_d;
  };

  static size_t align_up(size_t bytes) { return (bytes + 255) & ~size_t{255}; }
  static size_t group_bytes(int max_groups) {
    const size_t n = static_cast<size_t>(max_groups);
    return align_up(n * sizeof(GroupShape)) + 4 * align_up(n * sizeof(void*)) + align_up(n * sizeof(StrideA)) +
           align_up(n * sizeof(StrideB)) + align_up(n * sizeof(StrideC)) + align_up(n * sizeof(StrideD));
  }
  static Groups carve(void* block, int max_groups) {
    const size_t n = static_cast<size_t>(max_groups);
    char* p = static_cast<char*>(block);
    auto take = [&](size_t bytes) {
      char* at = p;
      p += align_up(bytes);
      return at;
    };
    Groups g;
    g.shapes = reinterpret_cast<GroupShape*>(take(n * sizeof(GroupShape)));
    g.a = reinterpret_cast<const ElementAB**>(take(n * sizeof(void*)));
    g.b = reinterpret_cast<const ElementAB**>(take(n * sizeof(void*)));
    g.c = reinterpret_cast<const ElementD**>(take(n * sizeof(void*)));
    g.d = reinterpret_cast<ElementD**>(take(n * sizeof(void*)));
    g.stride_a = reinterpret_cast<StrideA*>(take(n * sizeof(StrideA)));
    g.stride_b = reinterpret_cast<StrideB*>(take(n * sizeof(StrideB)));
    g.stride_c = reinterpret_cast<StrideC*>(take(n * sizeof(StrideC)));
    g.stride_d = reinterpret_cast<StrideD*>(take(n * sizeof(StrideD)));
    return g;
  }

  static typename Gemm::Arguments arguments(const Groups& g, int groups, float alpha, float beta, int sm_count) {
    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = 0;
    hw_info.sm_count = sm_count;
    typename Gemm::Arguments args;
    decltype(args.epilogue.thread) fusion;
    fusion.alpha = alpha;
    fusion.beta = beta;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = nullptr;
    fusion.beta_ptr_array = nullptr;
    fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
    fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
    // No host copy of the problem sizes: the kernel reads them on the device and the grid
    // is sized from the SM count.
    args = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                    {groups, g.shapes, nullptr},
                                    {g.a, g.stride_a, g.b, g.stride_b},
                                    {fusion, g.c, g.stride_c, g.d, g.stride_d},
                                    hw_info};
    return args;
  }

  static size_t workspace_bytes(int groups, int sm_count) {
    Groups none{};
    return Gemm::get_workspace_size(arguments(none, groups, 1.0f, 0.0f, sm_count));
  }

  static void run(const Groups& g, int groups, float alpha, float beta, void* workspace, size_t workspace_size,
                  int sm_count, cudaStream_t stream) {
    const auto args = arguments(g, groups, alpha, beta, sm_count);
    MOE_CHECKF(Gemm::get_workspace_size(args) <= workspace_size, "grouped GEMM: workspace too small");
    Gemm gemm;
    cutlass::Status status = gemm.initialize(args, workspace, stream);
    MOE_CHECKF(status == cutlass::Status::kSuccess, "grouped GEMM: initialize failed: %s",
               cutlassGetStatusString(status));
    status = gemm.run(stream);
    MOE_CHECKF(status == cutlass::Status::kSuccess, "grouped GEMM: launch failed: %s", cutlassGetStatusString(status));
  }
};

// Expert e of set s is group s * E + e.
struct GroupIndex {
  int set, expert;
};
__device__ inline GroupIndex group_index(int group, int64_t E) {
  return {static_cast<int>(group / E), static_cast<int>(group % E)};
}

}  // namespace moe::cuda::grouped

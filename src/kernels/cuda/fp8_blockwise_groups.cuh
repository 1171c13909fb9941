// CUTLASS's ptr-array grouped GEMM with blockwise scaling as the experts' fp8 GEMMs use it
// (fp8_grouped_gemm.cu: forward and data gradient; fp8_weight_gemm.cu: weight gradients):
// the kernel's types for a scale granularity and an output type, the per-group arrays
// (device memory, carved from one block) and the arguments that point the kernel at them.
// A `describe` kernel of each fills the arrays on the device.
#pragma once

#include <cstddef>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

namespace moe::cuda::grouped {

template <class Gemm, class GroupShape, class ElementAB, class ElementD, class LayoutSFA, class LayoutSFB>
struct BlockwiseGroups;

// e4m3 A [M, K] and B (K x N stored [N, K]), both K-major as FP8 wgmma needs, scales by
// ScaleConfig (cutlass::detail::Sm90BlockwiseScaleConfig), fp32 accumulation promoted
// every 128 of K, ElementD out (row-major); 128 x 128 x 128 tiles (one scale slice per K
// tile: the blockwise mainloop's requirement), cooperative, clusters of two SMs: 1 x 2 (A's
// tile multicast) by default, 2 x 1 (B's tile multicast) where that is faster.
using ClusterAlongN = cute::Shape<cute::_1, cute::_2, cute::_1>;
using ClusterAlongM = cute::Shape<cute::_2, cute::_1, cute::_1>;
template <class ScaleConfig, class ElementD_, class ClusterShape_ = ClusterAlongN>
struct BlockwiseGemm {
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group
  using GroupShape = typename ProblemShape::UnderlyingProblemShape;
  using ElementAB = cutlass::float_e4m3_t;
  using ElementD = ElementD_;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignmentAB = 16;  // 16-byte TMA rows
  static constexpr int kAlignmentD = 16 / static_cast<int>(sizeof(ElementD));
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = ClusterShape_;
  static constexpr int kClusterSms = cute::size(ClusterShape{});
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, LayoutD*, kAlignmentD, ElementD,
      LayoutD*, kAlignmentD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, cute::tuple<LayoutA*, LayoutSFA*>, kAlignmentAB,
      ElementAB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignmentAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using Groups = BlockwiseGroups<Gemm, GroupShape, ElementAB, ElementD, LayoutSFA, LayoutSFB>;
};

template <class Gemm, class GroupShape, class ElementAB, class ElementD, class LayoutSFA, class LayoutSFB>
struct BlockwiseGroups {
  using StrideA = typename Gemm::GemmKernel::InternalStrideA;
  using StrideB = typename Gemm::GemmKernel::InternalStrideB;
  using StrideC = typename Gemm::GemmKernel::InternalStrideC;
  using StrideD = typename Gemm::GemmKernel::InternalStrideD;

  GroupShape* shapes;
  const ElementAB** a;
  const ElementAB** b;
  const ElementD** c;
  ElementD** d;
  const float** sfa;
  const float** sfb;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideC* stride_c;
  StrideD* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;

  static size_t align_up(size_t bytes) { return (bytes + 255) & ~size_t{255}; }
  // The block `groups` groups take.
  static size_t bytes(int groups) {
    const size_t n = static_cast<size_t>(groups);
    return align_up(n * sizeof(GroupShape)) + 6 * align_up(n * sizeof(void*)) + align_up(n * sizeof(StrideA)) +
           align_up(n * sizeof(StrideB)) + align_up(n * sizeof(StrideC)) + align_up(n * sizeof(StrideD)) +
           align_up(n * sizeof(LayoutSFA)) + align_up(n * sizeof(LayoutSFB));
  }
  static BlockwiseGroups carve(void* block, int groups) {
    const size_t n = static_cast<size_t>(groups);
    char* p = static_cast<char*>(block);
    auto take = [&](size_t size) {
      char* at = p;
      p += align_up(size);
      return at;
    };
    BlockwiseGroups g;
    g.shapes = reinterpret_cast<GroupShape*>(take(n * sizeof(GroupShape)));
    g.a = reinterpret_cast<const ElementAB**>(take(n * sizeof(void*)));
    g.b = reinterpret_cast<const ElementAB**>(take(n * sizeof(void*)));
    g.c = reinterpret_cast<const ElementD**>(take(n * sizeof(void*)));
    g.d = reinterpret_cast<ElementD**>(take(n * sizeof(void*)));
    g.sfa = reinterpret_cast<const float**>(take(n * sizeof(void*)));
    g.sfb = reinterpret_cast<const float**>(take(n * sizeof(void*)));
    g.stride_a = reinterpret_cast<StrideA*>(take(n * sizeof(StrideA)));
    g.stride_b = reinterpret_cast<StrideB*>(take(n * sizeof(StrideB)));
    g.stride_c = reinterpret_cast<StrideC*>(take(n * sizeof(StrideC)));
    g.stride_d = reinterpret_cast<StrideD*>(take(n * sizeof(StrideD)));
    g.layout_sfa = reinterpret_cast<LayoutSFA*>(take(n * sizeof(LayoutSFA)));
    g.layout_sfb = reinterpret_cast<LayoutSFB*>(take(n * sizeof(LayoutSFB)));
    return g;
  }
  // D = alpha (1) * A B + beta * C over `groups` groups on `sm_count` multiprocessors; no
  // host copy of the problem sizes (the kernel reads them on the device).
  static typename Gemm::Arguments arguments(const BlockwiseGroups& g, int groups, float beta, int sm_count) {
    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = 0;
    hw_info.sm_count = sm_count;
    typename Gemm::Arguments args;
    decltype(args.epilogue.thread) fusion;
    fusion.alpha = 1.0f;
    fusion.beta = beta;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = nullptr;
    fusion.beta_ptr_array = nullptr;
    fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
    fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
    return typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                    {groups, g.shapes, nullptr},
                                    {g.a, g.stride_a, g.b, g.stride_b, g.sfa, g.layout_sfa, g.sfb, g.layout_sfb},
                                    {fusion, g.c, g.stride_c, g.d, g.stride_d},
                                    hw_info};
  }
};

}  // namespace moe::cuda::grouped

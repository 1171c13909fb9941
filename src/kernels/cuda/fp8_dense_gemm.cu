// DenseGemmFp8: one FP8 GEMM with blockwise scaling for the dense projections (CUTLASS's
// Hopper warp-specialised cooperative kernel; e4m3 A [M, K] with per-row-and-128-of-K
// scales, e4m3 B [N, K] with per-128x128-block scales, bf16 out). The scales of A are
// loaded by TMA, so M must be a multiple of 4 (16-byte rows of the [KB][M] scales).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/error_base.h"
#include "core/gpu.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "kernels/fp8_blockwise.h"
#include "kernels/fp8_gpu_ops.h"

namespace moe::cuda {
namespace {

using ElementAB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, fp8::kBlock, fp8::kBlock>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, LayoutD, 8, ElementD, LayoutD, 8,
    cutlass::epilogue::TmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, cute::tuple<LayoutA, LayoutSFA>, 16, ElementAB,
    cute::tuple<LayoutB, LayoutSFB>, 16, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
using StrideA = typename Kernel::StrideA;
using StrideB = typename Kernel::StrideB;
using StrideC = typename Kernel::StrideC;
using StrideD = typename Kernel::StrideD;

}  // namespace

struct DenseGemmFp8::State {
  gpu::DeviceArray<char> workspace;
  bool have_hw_info = false;
  cutlass::KernelHardwareInfo hw_info;
  int sm_limit = 0;
  bool deepgemm = false;
};

DenseGemmFp8::DenseGemmFp8() : state_(new State) {}
DenseGemmFp8::~DenseGemmFp8() { delete state_; }

void DenseGemmFp8::set_sm_limit(int sms) { state_->sm_limit = std::max(0, sms); }

void DenseGemmFp8::use_deepgemm(bool on) {
  MOE_CHECKF(!on || deepgemm_available(), "DenseGemmFp8: DeepGEMM's kernel needs an sm_90 GPU with %lld multiprocessors",
             static_cast<long long>(kDeepGemmSms));
  state_->deepgemm = on;
}

void DenseGemmFp8::gemm(bf16* c, int64_t ldc, const uint8_t* a_codes, const float* a_scales, const uint8_t* b_codes,
                        const float* b_scales, int64_t M, int64_t N, int64_t K, float beta, Stream stream) {
  MOE_CHECKF(K > 0 && K % fp8::kBlock == 0, "DenseGemmFp8: K = %lld is not a multiple of %lld (the fp8 scale blocks)",
             static_cast<long long>(K), static_cast<long long>(fp8::kBlock));
  MOE_CHECKF(M >= 0 && M % 4 == 0, "DenseGemmFp8: M = %lld is not a multiple of 4 (TMA rows of its scales)",
             static_cast<long long>(M));
  MOE_CHECKF(N > 0 && N % 8 == 0 && ldc % 8 == 0 && ldc >= N,
             "DenseGemmFp8: N = %lld and ldc = %lld must be multiples of 8 (ldc >= N)", static_cast<long long>(N),
             static_cast<long long>(ldc));
  MOE_CHECKF(M < (int64_t{1} << 31) && N < (int64_t{1} << 31) && K < (int64_t{1} << 31), "DenseGemmFp8: sizes past int");
  if (M == 0) return;
  if (state_->deepgemm && beta == 0.0f && state_->sm_limit == 0) {
    dense_gemm_deepgemm(c, ldc, a_codes, a_scales, b_codes, b_scales, M, N, K, stream);
    return;
  }
  const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
  StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(m, k, 1));
  StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(n, k, 1));
  StrideC stride_c = cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(m, n, 1));
  cute::get<0>(stride_c) = ldc;
  const StrideD stride_d = stride_c;
  const LayoutSFA layout_sfa = ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
  const LayoutSFB layout_sfb = ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
  auto* out = reinterpret_cast<ElementD*>(c);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {m, n, k, 1},
                                {reinterpret_cast<const ElementAB*>(a_codes), stride_a,
                                 reinterpret_cast<const ElementAB*>(b_codes), stride_b, a_scales, layout_sfa, b_scales,
                                 layout_sfb},
                                {{}, out, stride_c, out, stride_d}};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = beta;
  if (!state_->have_hw_info) {
    int device = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&device));
    state_->hw_info = cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(device);
    state_->have_hw_info = true;
  }
  args.hw_info = state_->hw_info;
  // set_sm_limit: whole clusters of the 1 x 2 cluster shape within the limit.
  constexpr int kClusterSms = 2;
  const int whole = std::max(kClusterSms, state_->sm_limit / kClusterSms * kClusterSms);
  if (state_->sm_limit > 0 && whole < args.hw_info.sm_count) {
    args.hw_info.sm_count = whole;
    args.hw_info.max_active_clusters = std::min(args.hw_info.max_active_clusters, whole / kClusterSms);
  }
  MOE_CHECKF(Gemm::can_implement(args) == cutlass::Status::kSuccess,
             "DenseGemmFp8: CUTLASS cannot run [%lld, %lld] x [%lld, %lld]^T (alignment)", static_cast<long long>(M),
             static_cast<long long>(K), static_cast<long long>(N), static_cast<long long>(K));
  const size_t bytes = Gemm::get_workspace_size(args);
  if (bytes > state_->workspace.size()) state_->workspace = gpu::DeviceArray<char>(bytes);
  Gemm gemm;
  cutlass::Status status = gemm.initialize(args, state_->workspace.data(), stream);
  MOE_CHECKF(status == cutlass::Status::kSuccess, "DenseGemmFp8: initialize failed: %s",
             cutlassGetStatusString(status));
  status = gemm.run(stream);
  MOE_CHECKF(status == cutlass::Status::kSuccess, "DenseGemmFp8: launch failed: %s", cutlassGetStatusString(status));
}

}  // namespace moe::cuda

// ExpertWeightGemmFp8: the experts' weight gradients as one CUTLASS Hopper grouped GEMM with
// blockwise scaling, the tokens as K (docs/FP8.md, "Still to do"). Group e: dw_e [M, N] =
// a_e [M, K_e] b_e^T, with a the token columns of dy (codes [M, ld_t], K-major) and b those
// of x (codes [N, ld_t]), K_e the expert's padded tokens (a multiple of 128) starting at
// column P_e; one scale per row of a, per row of b, and 128 tokens
// (Sm90BlockwiseScaleConfig<1, 1, 128>, MN-major: fp8::token_column_scale_index), or, with
// b's columns block-scaled (fp8::ColumnScales::Block), one per 128 rows of b and 128 tokens
// (Sm90BlockwiseScaleConfig<1, 128, 128>, the forward's kernel type:
// fp8::token_column_block_scale_index). Experts without rows have no group; with beta 0
// their gradients are zeroed first.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/error_base.h"
#include "core/gpu.h"
#include "kernels/cuda/fp8_blockwise_groups.cuh"
#include "kernels/cuda/grouped_gemm.cuh"
#include "kernels/fp8_blockwise.h"
#include "kernels/fp8_gpu_ops.h"

namespace moe::cuda {
namespace {

using FeatureScales = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, fp8::kBlock>;
using BlockScales = cutlass::detail::Sm90BlockwiseScaleConfig<1, fp8::kBlock, fp8::kBlock>;
template <class ElementD, class ScaleConfig = FeatureScales>
using WeightKernel = grouped::BlockwiseGemm<ScaleConfig, ElementD>;
using ElementAB = WeightKernel<float>::ElementAB;
using GroupShape = WeightKernel<float>::GroupShape;

// Group e: expert e's padded token columns [P_e, P_e+1); none (M = 0) when it has no rows.
template <class ElementD, class ScaleConfig>
__global__ void describe_weight_fp8(typename WeightKernel<ElementD, ScaleConfig>::Groups g, ElementD* dw,
                                    const int64_t* P_E1, int64_t E, int64_t M, int64_t N, const ElementAB* a,
                                    const float* sfa, const ElementAB* b, const float* sfb, int64_t ld_t) {
  using W = WeightKernel<ElementD, ScaleConfig>;
  constexpr bool kBlockB = std::is_same_v<ScaleConfig, BlockScales>;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= E) return;
  const int64_t P_e = P_E1[e], K = P_E1[e + 1] - P_e;
  const GroupShape shape = K > 0 ? GroupShape(static_cast<int>(M), static_cast<int>(N), static_cast<int>(K))
                                 : GroupShape(0, static_cast<int>(N), 0);
  g.shapes[e] = shape;
  g.a[e] = a + P_e;
  g.b[e] = b + P_e;
  g.c[e] = dw + e * M * N;
  g.d[e] = dw + e * M * N;
  g.sfa[e] = sfa + P_e / fp8::kBlock * M;
  g.sfb[e] = sfb + P_e / fp8::kBlock * (kBlockB ? fp8::blocks(N) : N);
  g.stride_a[e] = grouped::leading_stride<typename W::StrideA>(ld_t);
  g.stride_b[e] = grouped::leading_stride<typename W::StrideB>(ld_t);
  g.stride_c[e] = grouped::leading_stride<typename W::StrideC>(N);
  g.stride_d[e] = grouped::leading_stride<typename W::StrideD>(N);
  g.layout_sfa[e] = ScaleConfig::tile_atom_to_shape_SFA(shape);
  g.layout_sfb[e] = ScaleConfig::tile_atom_to_shape_SFB(shape);
}

// beta = 0: the experts without tokens get zero gradients (they have no group).
template <class ElementD>
__global__ void zero_tokenless_experts(ElementD* dw, const int64_t* P_E1, int64_t slice) {
  const int64_t e = blockIdx.x;
  if (P_E1[e + 1] != P_E1[e]) return;
  ElementD* out = dw + e * slice;
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; i < slice;
       i += static_cast<int64_t>(gridDim.y) * blockDim.x)
    out[i] = ElementD(0.0f);
}

}  // namespace

struct ExpertWeightGemmFp8::State {
  int64_t max_experts = 0;
  int device_sms = 0, sm_count = 0;
  gpu::DeviceArray<char> groups, workspace;

  template <class ElementD>
  void run(ElementD* dw, const uint8_t* a, const float* sfa, const uint8_t* b, const float* sfb, int64_t ld_t,
           const int64_t* P_E1, int64_t E, int64_t M, int64_t N, float beta, fp8::ColumnScales b_kind, Stream stream) {
    if (b_kind == fp8::ColumnScales::Block)
      run_with<ElementD, BlockScales>(dw, a, sfa, b, sfb, ld_t, P_E1, E, M, N, beta, stream);
    else
      run_with<ElementD, FeatureScales>(dw, a, sfa, b, sfb, ld_t, P_E1, E, M, N, beta, stream);
  }

  template <class ElementD, class ScaleConfig>
  void run_with(ElementD* dw, const uint8_t* a, const float* sfa, const uint8_t* b, const float* sfb, int64_t ld_t,
                const int64_t* P_E1, int64_t E, int64_t M, int64_t N, float beta, Stream stream) {
    using K = WeightKernel<ElementD, ScaleConfig>;
    const int n = static_cast<int>(E);
    const typename K::Groups g = K::Groups::carve(groups.data(), n);
    describe_weight_fp8<ElementD, ScaleConfig><<<(n + 127) / 128, 128, 0, stream>>>(
        g, dw, P_E1, E, M, N, reinterpret_cast<const ElementAB*>(a), sfa, reinterpret_cast<const ElementAB*>(b), sfb,
        ld_t);
    MOE_CUDA_CHECK(cudaGetLastError());
    if (beta == 0.0f) {
      zero_tokenless_experts<ElementD><<<dim3(static_cast<unsigned>(n), 16), 256, 0, stream>>>(dw, P_E1, M * N);
      MOE_CUDA_CHECK(cudaGetLastError());
    }
    const auto args = K::Groups::arguments(g, n, beta, sm_count);
    MOE_CHECKF(K::Gemm::get_workspace_size(args) <= workspace.size(), "fp8 weight GEMM: workspace too small");
    typename K::Gemm gemm;
    cutlass::Status status = gemm.initialize(args, workspace.data(), stream);
    MOE_CHECKF(status == cutlass::Status::kSuccess, "fp8 weight GEMM: initialize failed: %s",
               cutlassGetStatusString(status));
    status = gemm.run(stream);
    MOE_CHECKF(status == cutlass::Status::kSuccess, "fp8 weight GEMM: launch failed: %s", cutlassGetStatusString(status));
  }
};

ExpertWeightGemmFp8::ExpertWeightGemmFp8(int64_t max_experts) : state_(new State) {
  MOE_CHECKF(max_experts >= 1, "ExpertWeightGemmFp8: room for %lld experts", static_cast<long long>(max_experts));
  State& s = *state_;
  s.max_experts = max_experts;
  int device = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&s.device_sms, cudaDevAttrMultiProcessorCount, device));
  s.sm_count = s.device_sms;
  const int n = static_cast<int>(max_experts);
  // The group arrays and workspace of the largest of the four kernel types.
  size_t group_bytes = 0, workspace_bytes = 256;
  const auto room_for = [&]<class K>(K*) {
    const typename K::Groups none{};
    group_bytes = std::max(group_bytes, K::Groups::bytes(n));
    workspace_bytes = std::max(workspace_bytes, K::Gemm::get_workspace_size(K::Groups::arguments(none, n, 0.0f, s.sm_count)));
  };
  room_for(static_cast<WeightKernel<float>*>(nullptr));
  room_for(static_cast<WeightKernel<cutlass::bfloat16_t>*>(nullptr));
  room_for(static_cast<WeightKernel<float, BlockScales>*>(nullptr));
  room_for(static_cast<WeightKernel<cutlass::bfloat16_t, BlockScales>*>(nullptr));
  s.groups = gpu::DeviceArray<char>(group_bytes);
  s.workspace = gpu::DeviceArray<char>(workspace_bytes);
}

ExpertWeightGemmFp8::~ExpertWeightGemmFp8() { delete state_; }

void ExpertWeightGemmFp8::set_sm_limit(int sms) {
  constexpr int kClusterSms = WeightKernel<float>::kClusterSms;
  const int whole = std::max(kClusterSms, sms / kClusterSms * kClusterSms);
  state_->sm_count = sms > 0 && whole < state_->device_sms ? whole : state_->device_sms;
}

namespace {
void check_weight_shape(int64_t E, int64_t max_experts, int64_t M, int64_t N, int64_t ld_t) {
  MOE_CHECKF(E >= 1 && E <= max_experts && M > 0 && N > 0 && M % 8 == 0 && N % 8 == 0 && ld_t % 16 == 0,
             "ExpertWeightGemmFp8: %lld experts (room for %lld), [%lld, %lld] (multiples of 8), token rows of %lld "
             "(a multiple of 16)",
             static_cast<long long>(E), static_cast<long long>(max_experts), static_cast<long long>(M),
             static_cast<long long>(N), static_cast<long long>(ld_t));
}
}  // namespace

void ExpertWeightGemmFp8::run(float* dw_EMN, const uint8_t* a_t, const float* a_scales, const uint8_t* b_t,
                              const float* b_scales, int64_t ld_t, const int64_t* P_E1, int64_t E, int64_t M, int64_t N,
                              float beta, Stream stream, fp8::ColumnScales b_kind) {
  check_weight_shape(E, state_->max_experts, M, N, ld_t);
  state_->run<float>(dw_EMN, a_t, a_scales, b_t, b_scales, ld_t, P_E1, E, M, N, beta, b_kind, stream);
}

void ExpertWeightGemmFp8::run(bf16* dw_EMN, const uint8_t* a_t, const float* a_scales, const uint8_t* b_t,
                              const float* b_scales, int64_t ld_t, const int64_t* P_E1, int64_t E, int64_t M, int64_t N,
                              float beta, Stream stream, fp8::ColumnScales b_kind) {
  check_weight_shape(E, state_->max_experts, M, N, ld_t);
  state_->run<cutlass::bfloat16_t>(reinterpret_cast<cutlass::bfloat16_t*>(dw_EMN), a_t, a_scales, b_t, b_scales, ld_t,
                                   P_E1, E, M, N, beta, b_kind, stream);
}

}  // namespace moe::cuda

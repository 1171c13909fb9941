// ExpertGemmFp8: the experts' FP8 GEMMs as one CUTLASS Hopper grouped GEMM with blockwise
// scaling (e4m3 A and B, both K-major as FP8 wgmma needs; A scales per row and 128 of K,
// B scales per 128 x 128 block; fp32 accumulation, promoted and scaled every 128 of K;
// bf16 out). As the bf16 ExpertGemm (grouped_gemm.cuh), the per-group problem sizes,
// pointers and strides are written on the device from the expert row offsets, so the
// rows per expert are never read on the host. Forward (x @ W^T) and data gradient
// (dy @ W, with W's quantised transpose as B) are the same kernel with other operands.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/error_base.h"
#include "core/gpu.h"
#include "kernels/cuda/fp8_blockwise_groups.cuh"
#include "kernels/cuda/grouped_gemm.cuh"
#include "kernels/fp8_blockwise.h"
#include "kernels/fp8_gpu_ops.h"

namespace moe::cuda {
namespace {

using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, fp8::kBlock, fp8::kBlock>;
// The forward shares each expert's weight tile between the cluster's two SMs (2 x 1:
// mixtral-mini's gate|up GEMM 1.417 -> 1.362 ms on 2026-12-04, BENCHMARKS.md), the data
// gradient its token rows' tile (1 x 2: the down projection's 0.862 ms on 2 x 1, 0.803 on
// 1 x 2, 2026-12-03).
using ForwardGemm = grouped::BlockwiseGemm<ScaleConfig, cutlass::bfloat16_t, grouped::ClusterAlongM>;
using DataGemm = grouped::BlockwiseGemm<ScaleConfig, cutlass::bfloat16_t, grouped::ClusterAlongN>;
static_assert(ForwardGemm::kClusterSms == DataGemm::kClusterSms, "set_sm_limit rounds to one cluster size");
using GroupShape = DataGemm::GroupShape;
using ElementAB = DataGemm::ElementAB;
using ElementD = DataGemm::ElementD;
constexpr int kClusterSms = DataGemm::kClusterSms;

// Set s's operands: B codes and scales, the output.
struct Sets {
  const ElementAB* b[ExpertGemmFp8::kMaxSets];
  const float* sfb[ExpertGemmFp8::kMaxSets];
  ElementD* out[ExpertGemmFp8::kMaxSets];
};

// Group s * E + e: expert e of set s. A is shared by the sets (rows [first, first + rows)
// of the [R, K] codes, their scales at first * KB); B of expert e at e * N * K, its scales
// at e * NB * KB; the output rows at first * ld_out.
template <class Blockwise>
__global__ void describe(typename Blockwise::Groups g, Sets sets, int groups, const int32_t* offsets_E1, int64_t E,
                         int64_t N, int64_t K, const ElementAB* a, const float* sfa, int64_t ld_out) {
  using Groups = typename Blockwise::Groups;
  const int group = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (group >= groups) return;
  const int set = static_cast<int>(group / E);
  const int64_t expert = group % E;
  const int64_t first = offsets_E1[expert], rows = offsets_E1[expert + 1] - first;
  const int64_t KB = K / fp8::kBlock, NB = fp8::blocks(N);
  const GroupShape shape(static_cast<int>(rows), static_cast<int>(N), static_cast<int>(K));
  g.shapes[group] = shape;
  g.a[group] = a + first * K;
  g.b[group] = sets.b[set] + expert * N * K;
  g.c[group] = sets.out[set] + first * ld_out;
  g.d[group] = sets.out[set] + first * ld_out;
  g.sfa[group] = sfa + first * KB;
  g.sfb[group] = sets.sfb[set] + expert * NB * KB;
  g.stride_a[group] = grouped::leading_stride<typename Groups::StrideA>(K);
  g.stride_b[group] = grouped::leading_stride<typename Groups::StrideB>(K);
  g.stride_c[group] = grouped::leading_stride<typename Groups::StrideC>(ld_out);
  g.stride_d[group] = grouped::leading_stride<typename Groups::StrideD>(ld_out);
  // The grouped mainloop derives each group's scale layouts from its shape; these say the same.
  g.layout_sfa[group] = ScaleConfig::tile_atom_to_shape_SFA(shape);
  g.layout_sfb[group] = ScaleConfig::tile_atom_to_shape_SFB(shape);
}

// The workspace a kernel needs for `groups` groups on `sms` multiprocessors.
template <class Blockwise>
size_t workspace_bytes(int groups, int sms) {
  const typename Blockwise::Groups none{};
  return Blockwise::Gemm::get_workspace_size(Blockwise::Groups::arguments(none, groups, 0.0f, sms));
}

void check_shape(const char* what, int64_t N, int64_t K, int64_t ld_out) {
  MOE_CHECKF(K > 0 && K % fp8::kBlock == 0, "%s: K = %lld is not a multiple of %lld (the fp8 scale blocks)", what,
             static_cast<long long>(K), static_cast<long long>(fp8::kBlock));
  MOE_CHECKF(N > 0 && N % 8 == 0 && ld_out % 8 == 0 && ld_out >= N,
             "%s: N = %lld and ld_out = %lld must be multiples of 8 (ld_out >= N)", what, static_cast<long long>(N),
             static_cast<long long>(ld_out));
}

}  // namespace

struct ExpertGemmFp8::State {
  int64_t max_experts = 0, n_experts = 0;
  int device_sms = 0, sm_count = 0;
  // One block of per-group arrays per operation, so that operations on different streams
  // never overwrite each other's descriptions.
  gpu::DeviceArray<char> forward_groups, data_groups, workspace;

  template <class Blockwise>
  void run(const gpu::DeviceArray<char>& groups_block, const Sets& sets, int n_sets, const int32_t* offsets_E1,
           int64_t N, int64_t K, const uint8_t* a, const float* sfa, int64_t ld_out, float beta, Stream stream) const {
    using Groups = typename Blockwise::Groups;
    using Gemm = typename Blockwise::Gemm;
    const int groups = static_cast<int>(n_sets * n_experts);
    const Groups g = Groups::carve(groups_block.data(), groups);
    describe<Blockwise><<<(groups + 127) / 128, 128, 0, stream>>>(
        g, sets, groups, offsets_E1, n_experts, N, K, reinterpret_cast<const ElementAB*>(a), sfa, ld_out);
    MOE_CUDA_CHECK(cudaGetLastError());
    const auto args = Groups::arguments(g, groups, beta, sm_count);
    MOE_CHECKF(Gemm::get_workspace_size(args) <= workspace.size(), "fp8 grouped GEMM: workspace too small");
    Gemm gemm;
    cutlass::Status status = gemm.initialize(args, workspace.data(), stream);
    MOE_CHECKF(status == cutlass::Status::kSuccess, "fp8 grouped GEMM: initialize failed: %s",
               cutlassGetStatusString(status));
    status = gemm.run(stream);
    MOE_CHECKF(status == cutlass::Status::kSuccess, "fp8 grouped GEMM: launch failed: %s",
               cutlassGetStatusString(status));
  }
};

ExpertGemmFp8::ExpertGemmFp8(int64_t max_experts) : state_(new State) {
  State& s = *state_;
  MOE_CHECKF(max_experts >= 1, "ExpertGemmFp8: room for %lld experts", static_cast<long long>(max_experts));
  s.max_experts = s.n_experts = max_experts;
  int device = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&s.device_sms, cudaDevAttrMultiProcessorCount, device));
  s.sm_count = s.device_sms;
  const int max_groups = static_cast<int>(kMaxSets * max_experts);
  s.forward_groups = gpu::DeviceArray<char>(ForwardGemm::Groups::bytes(max_groups));
  s.data_groups = gpu::DeviceArray<char>(DataGemm::Groups::bytes(max_groups));
  const size_t workspace = std::max(workspace_bytes<ForwardGemm>(max_groups, s.device_sms),
                                    workspace_bytes<DataGemm>(max_groups, s.device_sms));
  s.workspace = gpu::DeviceArray<char>(std::max<size_t>(workspace, size_t{256}));
}

ExpertGemmFp8::~ExpertGemmFp8() { delete state_; }

void ExpertGemmFp8::set_sm_limit(int sms) {
  const int whole = std::max(kClusterSms, sms / kClusterSms * kClusterSms);
  state_->sm_count = sms > 0 && whole < state_->device_sms ? whole : state_->device_sms;
}

void ExpertGemmFp8::set_experts(int64_t n_experts) {
  MOE_CHECKF(n_experts >= 0 && n_experts <= state_->max_experts, "ExpertGemmFp8: %lld experts, room for %lld",
             static_cast<long long>(n_experts), static_cast<long long>(state_->max_experts));
  state_->n_experts = n_experts;
}

void ExpertGemmFp8::forward(int sets, bf16* const* out, int64_t ld_out, const uint8_t* x_codes, const float* x_scales,
                            const uint8_t* const* w_codes, const float* const* w_scales, const int32_t* offsets_E1,
                            int64_t N, int64_t K, Stream stream) {
  MOE_CHECKF(sets >= 1 && sets <= kMaxSets, "ExpertGemmFp8: %d sets", sets);
  check_shape("ExpertGemmFp8::forward", N, K, ld_out);
  if (state_->n_experts == 0) return;
  Sets pointers{};
  for (int s = 0; s < sets; ++s) {
    pointers.b[s] = reinterpret_cast<const ElementAB*>(w_codes[s]);
    pointers.sfb[s] = w_scales[s];
    pointers.out[s] = reinterpret_cast<ElementD*>(out[s]);
  }
  state_->run<ForwardGemm>(state_->forward_groups, pointers, sets, offsets_E1, N, K, x_codes, x_scales, ld_out, 0.0f,
                           stream);
}

void ExpertGemmFp8::backward_data(bf16* out, int64_t ld_out, const uint8_t* dy_codes, const float* dy_scales,
                                  const uint8_t* wt_codes, const float* wt_scales, const int32_t* offsets_E1,
                                  int64_t N, int64_t K, float beta, Stream stream) {
  check_shape("ExpertGemmFp8::backward_data", N, K, ld_out);
  if (state_->n_experts == 0) return;
  Sets pointers{};
  pointers.b[0] = reinterpret_cast<const ElementAB*>(wt_codes);
  pointers.sfb[0] = wt_scales;
  pointers.out[0] = reinterpret_cast<ElementD*>(out);
  state_->run<DataGemm>(state_->data_groups, pointers, 1, offsets_E1, N, K, dy_codes, dy_scales, ld_out, beta, stream);
}

}  // namespace moe::cuda

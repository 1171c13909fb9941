// ExpertGemm: owns the per-group arrays and the workspace of the three grouped GEMMs.
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "core/gpu.h"
#include "kernels/cuda/grouped_gemm_entry.h"
#include "kernels/gpu_ops.h"

namespace moe::cuda {

namespace {

void check_widths(const char* what, std::initializer_list<int64_t> widths) {
  for (int64_t width : widths)
    MOE_CHECKF(width % 8 == 0, "%s: width or leading dimension %lld is not a multiple of 8 elements", what,
               static_cast<long long>(width));
}

}  // namespace

struct ExpertGemm::State {
  int64_t max_experts = 0, n_experts = 0;
  int device_sms = 0;  // the workspace is sized for all of them
  int sm_count = 0;    // what the kernels launch on
  // One block of per-group arrays per operation kind, so that operations on different
  // streams could never overwrite each other's descriptions.
  gpu::DeviceArray<char> forward_groups, data_groups, weight_groups, workspace;

  grouped::Scratch scratch(const gpu::DeviceArray<char>& groups) const {
    return {groups.data(), workspace.data(), workspace.size(), sm_count};
  }
};

ExpertGemm::ExpertGemm(int64_t max_experts) : state_(new State) {
  State& s = *state_;
  MOE_CHECKF(max_experts >= 1, "ExpertGemm: room for %lld experts", static_cast<long long>(max_experts));
  s.max_experts = s.n_experts = max_experts;
  int device = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&s.device_sms, cudaDevAttrMultiProcessorCount, device));
  s.sm_count = s.device_sms;
  const int max_groups = static_cast<int>(kMaxSets * max_experts);
  const grouped::Sizes forward = grouped::forward_sizes(max_groups, s.sm_count);
  const grouped::Sizes data = grouped::data_sizes(max_groups, s.sm_count);
  const grouped::Sizes weight = grouped::weight_sizes(max_groups, s.sm_count);
  const grouped::Sizes weight_bf16 = grouped::weight_bf16_sizes(max_groups, s.sm_count);
  s.forward_groups = gpu::DeviceArray<char>(forward.group_bytes);
  s.data_groups = gpu::DeviceArray<char>(data.group_bytes);
  s.weight_groups = gpu::DeviceArray<char>(std::max(weight.group_bytes, weight_bf16.group_bytes));
  s.workspace = gpu::DeviceArray<char>(std::max<size_t>(
      {forward.workspace_bytes, data.workspace_bytes, weight.workspace_bytes, weight_bf16.workspace_bytes, size_t{256}}));
}

ExpertGemm::~ExpertGemm() { delete state_; }

void ExpertGemm::set_sm_limit(int sms) {
  // Whole clusters only (a persistent grid of an odd SM count fails to launch).
  const int whole = std::max(grouped::kClusterSms, sms / grouped::kClusterSms * grouped::kClusterSms);
  state_->sm_count = sms > 0 && whole < state_->device_sms ? whole : state_->device_sms;
}

void ExpertGemm::set_experts(int64_t n_experts) {
  MOE_CHECKF(n_experts >= 0 && n_experts <= state_->max_experts, "ExpertGemm: %lld experts, room for %lld",
             static_cast<long long>(n_experts), static_cast<long long>(state_->max_experts));
  state_->n_experts = n_experts;
}

void ExpertGemm::forward(int sets, bf16* const* out, int64_t ld_out, const bf16* x, int64_t ld_x,
                         const bf16* const* w, const int32_t* offsets_E1, int64_t N, int64_t K, Stream stream) {
  MOE_CHECKF(sets >= 1 && sets <= kMaxSets, "ExpertGemm: %d sets", sets);
  check_widths("ExpertGemm::forward", {N, K, ld_out, ld_x});
  if (state_->n_experts == 0) return;
  grouped::forward(state_->scratch(state_->forward_groups), sets, out, ld_out, x, ld_x, w, offsets_E1,
                   state_->n_experts, N, K, stream);
}

void ExpertGemm::backward_data(bf16* out, int64_t ld_out, const bf16* dy, int64_t ld_dy, const bf16* w,
                               const int32_t* offsets_E1, int64_t N, int64_t K, float beta, Stream stream) {
  check_widths("ExpertGemm::backward_data", {N, K, ld_out, ld_dy});
  if (state_->n_experts == 0) return;
  grouped::backward_data(state_->scratch(state_->data_groups), out, ld_out, dy, ld_dy, w, offsets_E1,
                         state_->n_experts, N, K, beta, stream);
}

// The checks both gradient dtypes share, then the fp32 or bf16 instantiation.
template <typename Grad>
void ExpertGemm::backward_weight_into(int sets, Grad* const* dw, const bf16* const* a, int64_t ld_a, const bf16* b,
                                      int64_t ld_b, const int32_t* offsets_E1, int64_t M, int64_t N, Stream stream,
                                      float beta) {
  MOE_CHECKF(sets >= 1 && sets <= kMaxSets, "ExpertGemm: %d sets", sets);
  check_widths("ExpertGemm::backward_weight", {M, N, ld_a, ld_b});
  MOE_CHECKF(beta == 0.0f || beta == 1.0f, "ExpertGemm::backward_weight: beta %g (0 or 1)", beta);
  if (state_->n_experts == 0) return;
  const grouped::Scratch scratch = state_->scratch(state_->weight_groups);
  if constexpr (std::is_same_v<Grad, float>)
    grouped::backward_weight(scratch, sets, dw, a, ld_a, b, ld_b, offsets_E1, state_->n_experts, M, N, beta, stream);
  else
    grouped::backward_weight_bf16(scratch, sets, dw, a, ld_a, b, ld_b, offsets_E1, state_->n_experts, M, N, beta,
                                  stream);
}

void ExpertGemm::backward_weight(int sets, float* const* dw, const bf16* const* a, int64_t ld_a, const bf16* b,
                                 int64_t ld_b, const int32_t* offsets_E1, int64_t M, int64_t N, Stream stream,
                                 float beta) {
  backward_weight_into(sets, dw, a, ld_a, b, ld_b, offsets_E1, M, N, stream, beta);
}

void ExpertGemm::backward_weight(int sets, bf16* const* dw, const bf16* const* a, int64_t ld_a, const bf16* b,
                                 int64_t ld_b, const int32_t* offsets_E1, int64_t M, int64_t N, Stream stream,
                                 float beta) {
  backward_weight_into(sets, dw, a, ld_a, b, ld_b, offsets_E1, M, N, stream, beta);
}

}  // namespace moe::cuda

// Dense bf16 GEMM through cuBLASLt (fp32 accumulation), in the row-major terms the rest
// of the code uses. Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, so
// cuBLAS sees the operands swapped.
#include <cublasLt.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"

#define MOE_CUBLAS_CHECK(call)                                                                   \
  do {                                                                                           \
    cublasStatus_t moe_status_ = (call);                                                         \
    if (moe_status_ != CUBLAS_STATUS_SUCCESS)                                                    \
      ::moe::detail::throw_printf(__FILE__, __LINE__, "cuBLAS error %d in %s",                   \
                                  static_cast<int>(moe_status_), #call);                         \
  } while (0)

namespace moe::cuda {

struct Blas::State {
  cublasLtHandle_t handle = nullptr;
  gpu::DeviceArray<char> workspace;
  int sm_limit = 0;  // 0: all multiprocessors
  // Heuristic results per problem shape and SM limit, so the search runs once for each.
  std::map<std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, int>,
           cublasLtMatmulHeuristicResult_t>
      algos;
};

Blas::Blas(size_t workspace_bytes) : state_(new State) {
  MOE_CUBLAS_CHECK(cublasLtCreate(&state_->handle));
  state_->workspace = gpu::DeviceArray<char>(workspace_bytes);
}

void Blas::set_sm_limit(int sms) { state_->sm_limit = std::max(0, sms); }

Blas::~Blas() {
  if (state_ && state_->handle) cublasLtDestroy(state_->handle);
  delete state_;
}

void Blas::gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A,
                int64_t lda, const bf16* B, int64_t ldb, float beta, void* C, bool c_is_fp32, int64_t ldc,
                Stream stream) {
  if (M == 0 || N == 0) return;
  MOE_CHECKF(K > 0, "gemm: K must be positive, got %lld", static_cast<long long>(K));
  const cublasOperation_t op_first = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;   // applied to B
  const cublasOperation_t op_second = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // applied to A
  cublasLtMatmulDesc_t desc;
  MOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
  MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
  if (state_->sm_limit > 0) {
    const int32_t sms = state_->sm_limit;
    MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms, sizeof(sms)));
  }
  // Column-major shapes of the stored matrices.
  cublasLtMatrixLayout_t layout_b, layout_a, layout_c;
  MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_b, CUDA_R_16BF, trans_b ? K : N, trans_b ? N : K, ldb));
  MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_a, CUDA_R_16BF, trans_a ? M : K, trans_a ? K : M, lda));
  MOE_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&layout_c, c_is_fp32 ? CUDA_R_32F : CUDA_R_16BF, N, M, ldc));
  const auto key = std::make_tuple(trans_a, trans_b, M, N, K, lda, ldb, ldc, c_is_fp32, state_->sm_limit);
  auto found = state_->algos.find(key);
  if (found == state_->algos.end()) {
    cublasLtMatmulPreference_t preference;
    MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
    size_t workspace_bytes = state_->workspace.size();
    MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &workspace_bytes, sizeof(workspace_bytes)));
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    MOE_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(state_->handle, desc, layout_b, layout_a, layout_c, layout_c,
                                                    preference, 1, &result, &returned));
    cublasLtMatmulPreferenceDestroy(preference);
    MOE_CHECKF(returned > 0, "gemm: cuBLASLt has no algorithm for M=%lld N=%lld K=%lld", static_cast<long long>(M),
               static_cast<long long>(N), static_cast<long long>(K));
    found = state_->algos.emplace(key, result).first;
  }
  MOE_CUBLAS_CHECK(cublasLtMatmul(state_->handle, desc, &alpha, B, layout_b, A, layout_a, &beta, C, layout_c, C,
                                  layout_c, &found->second.algo, state_->workspace.data(), state_->workspace.size(),
                                  stream));
  cublasLtMatrixLayoutDestroy(layout_b);
  cublasLtMatrixLayoutDestroy(layout_a);
  cublasLtMatrixLayoutDestroy(layout_c);
  cublasLtMatmulDescDestroy(desc);
}

}  // namespace moe::cuda

#include "model/cuda/projection_gemms.h"

#include "core/error.h"
#include "kernels/fp8_blockwise.h"
#include "model/gpu_buffer_sizes.h"

namespace moe {

ProjectionGemms::ProjectionGemms(cuda::Blas& blas, bool fp8, bool deepgemm) : blas_(blas) {
  MOE_CHECK(fp8 || !deepgemm, "fp8 projections: DeepGEMM's kernel without fp8");
  if (fp8) gemm_fp8_ = std::make_unique<cuda::DenseGemmFp8>();
  if (deepgemm) gemm_fp8_->use_deepgemm(true);
}

void ProjectionGemms::plan(const ModelConfig& config, int64_t tokens) {
  // The old scratch goes first, so that a re-plan does not hold both.
  row_codes_ = {};
  weight_codes_ = {};
  row_scales_ = {};
  weight_scales_ = {};
  if (!fp8()) return;
  const Fp8ProjectionScratch s = fp8_projection_scratch(config, tokens);
  row_codes_ = gpu::DeviceArray<uint8_t>(static_cast<size_t>(s.row_codes));
  row_scales_ = gpu::DeviceArray<float>(static_cast<size_t>(s.row_scales));
  weight_codes_ = gpu::DeviceArray<uint8_t>(static_cast<size_t>(s.weight_codes));
  weight_scales_ = gpu::DeviceArray<float>(static_cast<size_t>(s.weight_scales));
}

void ProjectionGemms::set_sm_limit(int sms) {
  if (gemm_fp8_) gemm_fp8_->set_sm_limit(sms);
}

// A shape fp8::dense_gemm_fits takes but fp8_projection_scratch did not list (a projection
// called with a shape dense_projection_gemms does not know) is refused, never overrun.
void ProjectionGemms::check_scratch(int64_t rows, int64_t K, int64_t N) const {
  MOE_CHECK(rows * K <= static_cast<int64_t>(row_codes_.size()) &&
                rows * (K / fp8::kBlock) <= static_cast<int64_t>(row_scales_.size()) &&
                N * K <= static_cast<int64_t>(weight_codes_.size()) &&
                fp8::blocks(N) * fp8::blocks(K) <= static_cast<int64_t>(weight_scales_.size()),
            "fp8 projections: no scratch planned for [{}, {}] x [{}, {}]^T (model/gpu_buffer_sizes.h)", rows, K, N,
            K);
}

cuda::RowCodes ProjectionGemms::row_codes(int64_t rows, int64_t K, int64_t N) {
  check_scratch(rows, K, N);
  return {row_codes_.data(), row_scales_.data(), nullptr, 1, rows};
}

cuda::RowCodes ProjectionGemms::forward_row_codes(int64_t rows, int64_t in, int64_t out, int64_t ldy) {
  return fp8() && fp8::dense_gemm_fits(rows, out, in, in, ldy) ? row_codes(rows, in, out) : cuda::RowCodes{};
}

cuda::RowCodes ProjectionGemms::backward_row_codes(int64_t rows, int64_t in, int64_t out, int64_t ld_dy) {
  return fp8() && fp8::dense_gemm_fits(rows, in, out, ld_dy, in) ? row_codes(rows, out, in) : cuda::RowCodes{};
}

void ProjectionGemms::forward(bf16* y, int64_t ldy, const bf16* x, const bf16* w, int64_t rows, int64_t in,
                              int64_t out, bool accumulate, cuda::Stream stream, bool x_quantised) {
  const float beta = accumulate ? 1.0f : 0.0f;
  if (!fp8() || !fp8::dense_gemm_fits(rows, out, in, in, ldy)) {
    MOE_CHECK(!x_quantised, "fp8 projection: rows quantised for a bf16 GEMM");
    blas_.gemm(false, true, rows, out, in, 1.0f, x, in, w, in, beta, y, false, ldy, stream);
    return;
  }
  check_scratch(rows, in, out);
  if (!x_quantised)
    cuda::quantize_rows_blockwise(row_codes_.data(), row_scales_.data(), x, in, nullptr, 1, rows, in, stream);
  cuda::quantize_weight_blocks(weight_codes_.data(), weight_scales_.data(), nullptr, nullptr, w, 1, out, in, stream);
  gemm_fp8_->gemm(y, ldy, row_codes_.data(), row_scales_.data(), weight_codes_.data(), weight_scales_.data(), rows,
                  out, in, beta, stream);
}

void ProjectionGemms::backward_data(bf16* dx, const bf16* dy, int64_t ld_dy, const bf16* w, int64_t rows, int64_t in,
                                    int64_t out, bool accumulate, cuda::Stream stream, bool dy_quantised) {
  const float beta = accumulate ? 1.0f : 0.0f;
  if (!fp8() || !fp8::dense_gemm_fits(rows, in, out, ld_dy, in)) {
    MOE_CHECK(!dy_quantised, "fp8 projection: rows quantised for a bf16 GEMM");
    blas_.gemm(false, false, rows, in, out, 1.0f, dy, ld_dy, w, in, beta, dx, false, in, stream);
    return;
  }
  check_scratch(rows, out, in);
  if (!dy_quantised)
    cuda::quantize_rows_blockwise(row_codes_.data(), row_scales_.data(), dy, ld_dy, nullptr, 1, rows, out, stream);
  // W [out, in] is the GEMM's [K, N]; its quantised transpose [in, out] is the B operand.
  cuda::quantize_weight_blocks(nullptr, nullptr, weight_codes_.data(), weight_scales_.data(), w, 1, out, in, stream);
  gemm_fp8_->gemm(dx, in, row_codes_.data(), row_scales_.data(), weight_codes_.data(), weight_scales_.data(), rows, in,
                  out, beta, stream);
}

}  // namespace moe

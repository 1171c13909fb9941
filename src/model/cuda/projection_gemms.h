// The dense projections' forward (y = x W^T) and data-gradient (dx = dy W) GEMMs in the
// run's precision, decided in this one place (docs/FP8.md section 4): bf16 through
// cuBLASLt, or, with training.precision = fp8 (GpuModelOptions::fp8_projections), e4m3
// through DenseGemmFp8 for every GEMM whose shape it takes (fp8::dense_gemm_fits; the
// others stay bf16). The rows are quantised per 1 x 128 tile and the weight per 128 x 128
// block (its transposed copy for dy @ W) right before each GEMM, into scratch shared by
// all projections (model/gpu_buffer_sizes.h's fp8_projection_scratch, which the memory
// plan counts). The projections' weight gradients are not here: they stay bf16 GEMMs.
// Used by the GPU model (attention's q|k|v and output, the dense FFN and shared experts).
#pragma once
#include <cstdint>
#include <memory>

#include "config/model_config.h"
#include "core/bf16.h"
#include "core/gpu.h"
#include "kernels/fp8_gpu_ops.h"
#include "kernels/gpu_ops.h"

namespace moe {

class ProjectionGemms {
 public:
  // `blas` runs the bf16 GEMMs (kept by reference: it outlives this object).
  // deepgemm: the fp8 GEMMs that do not accumulate through DeepGEMM's kernel (DenseGemmFp8::use_deepgemm).
  ProjectionGemms(cuda::Blas& blas, bool fp8, bool deepgemm = false);
  ProjectionGemms(const ProjectionGemms&) = delete;
  ProjectionGemms& operator=(const ProjectionGemms&) = delete;
  bool fp8() const { return gemm_fp8_ != nullptr; }
  // Scratch for `config`'s fp8 projections on micro-batches of `tokens` tokens (fp8 only;
  // fp8_projection_scratch's sizes, exactly).
  void plan(const ModelConfig& config, int64_t tokens);
  void set_sm_limit(int sms);
  // y [rows, out] (row stride ldy) = x [rows, in] @ W^T (+ y when accumulate), W [out, in]
  // (a Linear weight). x_quantised: x's codes are in the row scratch already, written by the
  // kernel that wrote x (forward_row_codes).
  void forward(bf16* y, int64_t ldy, const bf16* x, const bf16* w, int64_t rows, int64_t in, int64_t out,
               bool accumulate, cuda::Stream stream, bool x_quantised = false);
  // dx [rows, in] = dy [rows, out] (row stride ld_dy) @ W (+ dx when accumulate).
  // dy_quantised: as x_quantised (backward_row_codes).
  void backward_data(bf16* dx, const bf16* dy, int64_t ld_dy, const bf16* w, int64_t rows, int64_t in, int64_t out,
                     bool accumulate, cuda::Stream stream, bool dy_quantised = false);
  // Where a kernel writing forward's x [rows, in] (backward_data's dy [rows, out], rows
  // whole) may write its codes for that GEMM: the row scratch, one group of `rows`; codes_RK
  // null when that GEMM runs in bf16. The scratch holds one operand: the GEMM must come next.
  cuda::RowCodes forward_row_codes(int64_t rows, int64_t in, int64_t out, int64_t ldy);
  cuda::RowCodes backward_row_codes(int64_t rows, int64_t in, int64_t out, int64_t ld_dy);

 private:
  cuda::Blas& blas_;
  std::unique_ptr<cuda::DenseGemmFp8> gemm_fp8_;  // null: bf16 only
  gpu::DeviceArray<uint8_t> row_codes_, weight_codes_;
  gpu::DeviceArray<float> row_scales_, weight_scales_;
  void check_scratch(int64_t rows, int64_t K, int64_t N) const;
  cuda::RowCodes row_codes(int64_t rows, int64_t K, int64_t N);
};

}  // namespace moe

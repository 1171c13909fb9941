// RMSNorm over the last dimension: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
// Statistics are computed in T (fp32 on the fp32 path, fp64 in gradient checks).
// Convention for all ops: parameter gradients accumulate (+=); activation gradients
// are overwritten unless a flag says to accumulate.
#pragma once
#include <cstdint>

namespace moe {

// Writes y_TD and saves rstd_T (one value per token) for the backward pass.
template <typename T>
void rmsnorm_forward(T* y_TD, T* rstd_T, const T* x_TD, const T* w_D, int64_t T_, int64_t D,
                     double eps);

// dx_TD = (or += when accumulate_dx) dL/dx; dw_D += dL/dw, summed over tokens in token
// order so the result does not depend on the thread count.
template <typename T>
void rmsnorm_backward(T* dx_TD, T* dw_D, const T* dy_TD, const T* x_TD, const T* w_D,
                      const T* rstd_T, int64_t T_, int64_t D, bool accumulate_dx);

}  // namespace moe

#include "kernels/rmsnorm.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace moe {
namespace {

// Smaller problems run serially: a parallel region would cost more than it saves (more
// so on a busy machine). Results are identical either way.
constexpr int64_t kMinParallelWork = int64_t(1) << 16;

// Columns per dw task (see rmsnorm_backward).
constexpr int64_t kColumnBlock = 32;

}  // namespace

template <typename T>
void rmsnorm_forward(T* y_TD, T* rstd_T, const T* x_TD, const T* w_D, int64_t T_, int64_t D,
                     double eps) {
  MOE_CHECK(T_ >= 0 && D > 0, "rmsnorm: bad shape T={} D={}", T_, D);
  MOE_CHECK(eps >= 0, "rmsnorm: eps must be >= 0, got {}", eps);
#pragma omp parallel for schedule(static) if (T_ * D >= kMinParallelWork)
  for (int64_t t = 0; t < T_; ++t) {
    const T* x = x_TD + t * D;
    T* y = y_TD + t * D;
    T sum_sq = 0;
    for (int64_t i = 0; i < D; ++i) sum_sq += x[i] * x[i];
    const T rstd = T(1) / std::sqrt(sum_sq / T(D) + T(eps));
    rstd_T[t] = rstd;
    for (int64_t i = 0; i < D; ++i) y[i] = x[i] * rstd * w_D[i];
  }
}

template <typename T>
void rmsnorm_backward(T* dx_TD, T* dw_D, const T* dy_TD, const T* x_TD, const T* w_D,
                      const T* rstd_T, int64_t T_, int64_t D, bool accumulate_dx) {
  MOE_CHECK(T_ >= 0 && D > 0, "rmsnorm: bad shape T={} D={}", T_, D);
  // With g = dy * w and n = x * rstd:  dx = rstd * (g - n * mean(g * n)).
  if (dx_TD) {
#pragma omp parallel for schedule(static) if (T_ * D >= kMinParallelWork)
    for (int64_t t = 0; t < T_; ++t) {
      const T* x = x_TD + t * D;
      const T* dy = dy_TD + t * D;
      T* dx = dx_TD + t * D;
      const T rstd = rstd_T[t];
      T dot = 0;
      for (int64_t i = 0; i < D; ++i) dot += dy[i] * w_D[i] * x[i];
      const T coef = dot * rstd * rstd / T(D);  // x * coef = n * mean(g * n)
      for (int64_t i = 0; i < D; ++i) {
        const T g = rstd * (dy[i] * w_D[i] - x[i] * coef);
        dx[i] = accumulate_dx ? dx[i] + g : g;
      }
    }
  }
  // dw = sum over tokens of dy * x * rstd. Each task owns a block of columns and walks
  // the tokens in order, so the sum order is fixed whatever the thread count.
  if (dw_D) {
    const int64_t blocks = (D + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static) if (T_ * D >= kMinParallelWork)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t c0 = blk * kColumnBlock, c1 = std::min(D, c0 + kColumnBlock);
      T sum[kColumnBlock] = {};
      for (int64_t t = 0; t < T_; ++t) {
        const T* x = x_TD + t * D;
        const T* dy = dy_TD + t * D;
        const T rstd = rstd_T[t];
        for (int64_t c = c0; c < c1; ++c) sum[c - c0] += dy[c] * x[c] * rstd;
      }
      for (int64_t c = c0; c < c1; ++c) dw_D[c] += sum[c - c0];
    }
  }
}

#define MOE_INSTANTIATE(T)                                                                   \
  template void rmsnorm_forward<T>(T*, T*, const T*, const T*, int64_t, int64_t, double);    \
  template void rmsnorm_backward<T>(T*, T*, const T*, const T*, const T*, const T*, int64_t, \
                                    int64_t, bool);
MOE_INSTANTIATE(float)
MOE_INSTANTIATE(double)
#undef MOE_INSTANTIATE

}  // namespace moe

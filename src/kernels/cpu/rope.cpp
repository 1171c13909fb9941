#include "kernels/rope.h"

#include <cmath>
#include <vector>

#include "core/error.h"

namespace moe {
namespace {

// Smaller problems run serially: a parallel region would cost more than it saves (more
// so on a busy machine). Results are identical either way.
constexpr int64_t kMinParallelWork = int64_t(1) << 16;

// Rotates every head of every token by +angle (sign = 1) or -angle (sign = -1); the
// transpose of a rotation is the rotation by the opposite angle.
template <typename T>
void rope_rotate(T* x_TNd, const int32_t* positions_T, int64_t T_, int64_t N, int64_t d,
                 double theta, double sign) {
  MOE_CHECK(T_ >= 0 && N > 0 && d > 0 && d % 2 == 0,
            "rope: bad shape T={} N={} d={} (d must be even)", T_, N, d);
  MOE_CHECK(theta > 0, "rope: theta must be > 0, got {}", theta);
  for (int64_t t = 0; t < T_; ++t)
    MOE_CHECK(positions_T[t] >= 0, "rope: position {} at token {} is negative", positions_T[t], t);
  const int64_t half = d / 2;
  std::vector<double> inv_freq(half);
  for (int64_t i = 0; i < half; ++i)
    inv_freq[i] = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
#pragma omp parallel if (T_ * N * d >= kMinParallelWork)
  {
    std::vector<T> cos_h(half), sin_h(half);  // this token's table, shared by its heads
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T_; ++t) {
      const double pos = positions_T[t];
      for (int64_t i = 0; i < half; ++i) {
        const double angle = pos * inv_freq[i];
        cos_h[i] = static_cast<T>(std::cos(angle));
        sin_h[i] = static_cast<T>(sign * std::sin(angle));
      }
      for (int64_t n = 0; n < N; ++n) {
        T* x = x_TNd + (t * N + n) * d;
        for (int64_t i = 0; i < half; ++i) {
          const T a = x[i], b = x[i + half];
          x[i] = a * cos_h[i] - b * sin_h[i];
          x[i + half] = b * cos_h[i] + a * sin_h[i];
        }
      }
    }
  }
}

}  // namespace

template <typename T>
void rope_forward(T* x_TNd, const int32_t* positions_T, int64_t T_, int64_t N, int64_t d,
                  double theta) {
  rope_rotate(x_TNd, positions_T, T_, N, d, theta, 1.0);
}

template <typename T>
void rope_backward(T* dx_TNd, const int32_t* positions_T, int64_t T_, int64_t N, int64_t d,
                   double theta) {
  rope_rotate(dx_TNd, positions_T, T_, N, d, theta, -1.0);
}

#define MOE_INSTANTIATE(T)                                                              \
  template void rope_forward<T>(T*, const int32_t*, int64_t, int64_t, int64_t, double); \
  template void rope_backward<T>(T*, const int32_t*, int64_t, int64_t, int64_t, double);
MOE_INSTANTIATE(float)
MOE_INSTANTIATE(double)
#undef MOE_INSTANTIATE

}  // namespace moe

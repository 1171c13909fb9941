#include "kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace moe {
namespace {

// Smaller problems run serially: a parallel region would cost more than it saves (more
// so on a busy machine). Results are identical either way.
constexpr int64_t kMinParallelWork = int64_t(1) << 16;

constexpr int32_t kIgnore = -1;

// Validates the targets (before any parallel region, which an exception must not
// escape) and returns how many are not ignored.
int64_t count_valid(const int32_t* targets_T, int64_t T_, int64_t V) {
  int64_t n_valid = 0;
  for (int64_t t = 0; t < T_; ++t) {
    MOE_CHECK(targets_T[t] >= kIgnore && targets_T[t] < V,
              "cross_entropy: target {} at position {} is outside [-1, {})", targets_T[t], t, V);
    n_valid += targets_T[t] != kIgnore;
  }
  return n_valid;
}

}  // namespace

template <typename T>
double cross_entropy_forward(T* lse_T, const T* logits_TV, const int32_t* targets_T, int64_t T_,
                             int64_t V) {
  MOE_CHECK(T_ >= 0 && V > 0, "cross_entropy: bad shape T={} V={}", T_, V);
  const int64_t n_valid = count_valid(targets_T, T_, V);
#pragma omp parallel for schedule(static) if (T_ * V >= kMinParallelWork)
  for (int64_t t = 0; t < T_; ++t) {
    const T* x = logits_TV + t * V;
    const T max = *std::max_element(x, x + V);
    T sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(x[v] - max);
    lse_T[t] = max + std::log(sum);
  }
  if (n_valid == 0) return 0.0;
  double total = 0;  // serial, in row order: the same sum for any thread count
  for (int64_t t = 0; t < T_; ++t)
    if (targets_T[t] != kIgnore)
      total += static_cast<double>(lse_T[t]) - static_cast<double>(logits_TV[t * V + targets_T[t]]);
  return total / static_cast<double>(n_valid);
}

template <typename T>
void cross_entropy_backward(T* dlogits_TV, const T* logits_TV, const T* lse_T,
                            const int32_t* targets_T, int64_t T_, int64_t V, double dloss) {
  MOE_CHECK(T_ >= 0 && V > 0, "cross_entropy: bad shape T={} V={}", T_, V);
  const int64_t n_valid = count_valid(targets_T, T_, V);
  const T scale = n_valid > 0 ? static_cast<T>(dloss / static_cast<double>(n_valid)) : T(0);
  // Element by element, reading logits[t, v] before writing dlogits[t, v], so the two may
  // be the same buffer.
#pragma omp parallel for schedule(static) if (T_ * V >= kMinParallelWork)
  for (int64_t t = 0; t < T_; ++t) {
    const T* x = logits_TV + t * V;
    T* dx = dlogits_TV + t * V;
    const int32_t target = targets_T[t];
    if (target == kIgnore) {
      std::fill(dx, dx + V, T(0));
      continue;
    }
    const T lse = lse_T[t];
    for (int64_t v = 0; v < V; ++v) {
      const T p = std::exp(x[v] - lse);
      dx[v] = scale * (v == target ? p - T(1) : p);
    }
  }
}

#define MOE_INSTANTIATE(T)                                                                  \
  template double cross_entropy_forward<T>(T*, const T*, const int32_t*, int64_t, int64_t); \
  template void cross_entropy_backward<T>(T*, const T*, const T*, const int32_t*, int64_t,  \
                                          int64_t, double);
MOE_INSTANTIATE(float)
MOE_INSTANTIATE(double)
#undef MOE_INSTANTIATE

}  // namespace moe

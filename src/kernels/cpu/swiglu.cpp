#include "kernels/swiglu.h"

#include <cmath>

#include "core/error.h"

namespace moe {
namespace {

// Smaller problems run serially: a parallel region would cost more than it saves (more
// so on a busy machine). Results are identical either way.
constexpr int64_t kMinParallelWork = int64_t(1) << 16;

// exp(-x) overflows to inf for very negative x, giving 0: the correct limit.
template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

}  // namespace

template <typename T>
void swiglu_forward(T* act, const T* gate, const T* up, int64_t count) {
  MOE_CHECK(count >= 0, "swiglu: bad count {}", count);
#pragma omp parallel for schedule(static) if (count >= kMinParallelWork)
  for (int64_t i = 0; i < count; ++i) act[i] = gate[i] * sigmoid(gate[i]) * up[i];
}

template <typename T>
void swiglu_backward(T* dgate, T* dup, const T* dact, const T* gate, const T* up, int64_t count) {
  MOE_CHECK(count >= 0, "swiglu: bad count {}", count);
#pragma omp parallel for schedule(static) if (count >= kMinParallelWork)
  for (int64_t i = 0; i < count; ++i) {
    const T x = gate[i], s = sigmoid(x);
    // silu'(x) = s + x * s * (1 - s)
    dgate[i] = dact[i] * up[i] * s * (T(1) + x * (T(1) - s));
    dup[i] = dact[i] * x * s;
  }
}

#define MOE_INSTANTIATE(T)                                          \
  template void swiglu_forward<T>(T*, const T*, const T*, int64_t); \
  template void swiglu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t);
MOE_INSTANTIATE(float)
MOE_INSTANTIATE(double)
#undef MOE_INSTANTIATE

}  // namespace moe

#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/matmul.h"

// Each (b, h) head is a few small matrix products on strided views: rows of q for head h
// are H * d apart, rows of k / v for kv head g are G * d apart. The products cover the
// full S x S square (BLAS is far faster than causal loops, even doing twice the work);
// the causal mask is applied in the softmax and the zero probabilities above the
// diagonal keep it in the backward pass. gemm() sums over fixed tiles whichever thread
// runs them, and each head's products run in one task, so results do not depend on the
// thread count.

namespace moe {
namespace {

// Smaller problems run serially: a parallel region would cost more than it saves (more
// so on a busy machine). Results are identical either way.
constexpr int64_t kMinParallelWork = int64_t(1) << 16;

void check_shape(int64_t B, int64_t S, int64_t H, int64_t G, int64_t d) {
  MOE_CHECK(B >= 0 && S >= 0 && H > 0 && G > 0 && d > 0 && H % G == 0,
            "attention: bad shape B={} S={} H={} G={} d={} (need H % G == 0)", B, S, H, G, d);
}

// Causal softmax of one score row in place: entries 0..i normalised, the rest zeroed.
template <typename T>
void causal_softmax_row(T* p, int64_t i, int64_t S) {
  const T max = *std::max_element(p, p + i + 1);
  T sum = 0;
  for (int64_t j = 0; j <= i; ++j) {
    p[j] = std::exp(p[j] - max);
    sum += p[j];
  }
  const T inv_sum = T(1) / sum;
  for (int64_t j = 0; j <= i; ++j) p[j] *= inv_sum;
  std::fill(p + i + 1, p + S, T(0));
}

}  // namespace

template <typename T>
void attention_forward(T* out_BSHd, T* probs_BHSS, const T* q_BSHd, const T* k_BSGd,
                       const T* v_BSGd, int64_t B, int64_t S, int64_t H, int64_t G, int64_t d) {
  check_shape(B, S, H, G, d);
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(d)));
  const int64_t group = H / G;
#pragma omp parallel for schedule(static) if (B * H * S * S * d >= kMinParallelWork)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H, g = h / group;
    const T* q = q_BSHd + (b * S * H + h) * d;  // row i at q + i * H * d
    const T* k = k_BSGd + (b * S * G + g) * d;  // row j at k + j * G * d
    const T* v = v_BSGd + (b * S * G + g) * d;
    T* out = out_BSHd + (b * S * H + h) * d;
    T* p = probs_BHSS + bh * S * S;
    gemm<T>(false, true, S, S, d, scale, q, H * d, k, G * d, T(0), p, S);  // scores = q k^T
    for (int64_t i = 0; i < S; ++i) causal_softmax_row(p + i * S, i, S);
    gemm<T>(false, false, S, d, S, T(1), p, S, v, G * d, T(0), out, H * d);  // out = P v
  }
}

template <typename T>
void attention_forward_cached(T* out_nHd, const T* q_nHd, const T* k_LGd, const T* v_LGd, int64_t n, int64_t start,
                              int64_t H, int64_t G, int64_t d) {
  check_shape(1, start + n, H, G, d);
  MOE_CHECK(n > 0 && start >= 0, "cached attention: {} new tokens at position {}", n, start);
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(d)));
  const int64_t group = H / G, L = start + n;
#pragma omp parallel if (H * n * L * d >= kMinParallelWork)
  {
    std::vector<T> p(static_cast<size_t>(n * L));  // one head's probabilities
#pragma omp for schedule(static)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group;
      gemm<T>(false, true, n, L, d, scale, q_nHd + h * d, H * d, k_LGd + g * d, G * d, T(0), p.data(), L);
      for (int64_t i = 0; i < n; ++i) causal_softmax_row(p.data() + i * L, start + i, L);
      gemm<T>(false, false, n, d, L, T(1), p.data(), L, v_LGd + g * d, G * d, T(0), out_nHd + h * d, H * d);
    }
  }
}

template <typename T>
void attention_backward(T* dq_BSHd, T* dk_BSGd, T* dv_BSGd, const T* dout_BSHd, const T* q_BSHd,
                        const T* k_BSGd, const T* v_BSGd, const T* probs_BHSS, int64_t B, int64_t S,
                        int64_t H, int64_t G, int64_t d) {
  check_shape(B, S, H, G, d);
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(d)));
  const int64_t group = H / G;
  // One task per (b, g): it owns dk / dv of that kv head and the dq of its query heads,
  // which it visits in order, so dk / dv are summed over heads in a fixed order.
#pragma omp parallel if (B * H * S * S * d >= kMinParallelWork)
  {
    std::vector<T> ds(S * S);  // dL/dprobs, then dL/dscores, of one head
#pragma omp for schedule(static)
    for (int64_t bg = 0; bg < B * G; ++bg) {
      const int64_t b = bg / G, g = bg % G;
      const T* k = k_BSGd + (b * S * G + g) * d;
      const T* v = v_BSGd + (b * S * G + g) * d;
      T* dk = dk_BSGd + (b * S * G + g) * d;
      T* dv = dv_BSGd + (b * S * G + g) * d;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const T* q = q_BSHd + (b * S * H + h) * d;
        const T* dout = dout_BSHd + (b * S * H + h) * d;
        T* dq = dq_BSHd + (b * S * H + h) * d;
        const T* p = probs_BHSS + (b * H + h) * S * S;
        const T beta = h == g * group ? T(0) : T(1);  // the group's first head overwrites

        // dv += P^T dout;  dP = dout v^T
        gemm<T>(true, false, S, d, S, T(1), p, S, dout, H * d, beta, dv, G * d);
        gemm<T>(false, true, S, S, d, T(1), dout, H * d, v, G * d, T(0), ds.data(), S);
        // Softmax backward: dscore_ij = p_ij * (dP_ij - sum_l p_il dP_il), times the
        // score scale. Zero probabilities above the diagonal zero those entries.
        for (int64_t i = 0; i < S; ++i) {
          const T* p_row = p + i * S;
          T* ds_row = ds.data() + i * S;
          T row_dot = 0;
          for (int64_t j = 0; j <= i; ++j) row_dot += p_row[j] * ds_row[j];
          for (int64_t j = 0; j <= i; ++j) ds_row[j] = p_row[j] * (ds_row[j] - row_dot) * scale;
          std::fill(ds_row + i + 1, ds_row + S, T(0));
        }
        // dq = dS k;  dk += dS^T q
        gemm<T>(false, false, S, d, S, T(1), ds.data(), S, k, G * d, T(0), dq, H * d);
        gemm<T>(true, false, S, d, S, T(1), ds.data(), S, q, H * d, beta, dk, G * d);
      }
    }
  }
}

#define MOE_INSTANTIATE(T)                                                                   \
  template void attention_forward<T>(T*, T*, const T*, const T*, const T*, int64_t, int64_t, \
                                     int64_t, int64_t, int64_t);                             \
  template void attention_forward_cached<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t, \
                                            int64_t, int64_t);                                          \
  template void attention_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*,    \
                                      const T*, int64_t, int64_t, int64_t, int64_t, int64_t);
MOE_INSTANTIATE(float)
MOE_INSTANTIATE(double)
#undef MOE_INSTANTIATE

}  // namespace moe

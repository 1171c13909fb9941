#include "kernels/embedding.h"

#include <algorithm>

#include "core/error.h"

namespace moe {
namespace {

// Smaller problems run serially: a parallel region would cost more than it saves (more
// so on a busy machine). Results are identical either way.
constexpr int64_t kMinParallelWork = int64_t(1) << 16;

// Checked before any parallel region: an exception must not escape an OpenMP loop.
void check_ids(const int32_t* ids_T, int64_t T_, int64_t V) {
  for (int64_t t = 0; t < T_; ++t)
    MOE_CHECK(ids_T[t] >= 0 && ids_T[t] < V,
              "embedding: token id {} at position {} is outside [0, {})", ids_T[t], t, V);
}

// Columns per backward task: wide enough for contiguous row segments, small enough to
// give two cores work at D = 64.
constexpr int64_t kColumnBlock = 32;

}  // namespace

template <typename T>
void embedding_forward(T* out_TD, const int32_t* ids_T, const T* table_VD, int64_t T_, int64_t V,
                       int64_t D) {
  MOE_CHECK(T_ >= 0 && V > 0 && D > 0, "embedding: bad shape T={} V={} D={}", T_, V, D);
  check_ids(ids_T, T_, V);
#pragma omp parallel for schedule(static) if (T_ * D >= kMinParallelWork)
  for (int64_t t = 0; t < T_; ++t) {
    const T* row = table_VD + static_cast<int64_t>(ids_T[t]) * D;
    std::copy(row, row + D, out_TD + t * D);
  }
}

template <typename T>
void embedding_backward(T* dtable_VD, const int32_t* ids_T, const T* dout_TD, int64_t T_, int64_t V,
                        int64_t D) {
  MOE_CHECK(T_ >= 0 && V > 0 && D > 0, "embedding: bad shape T={} V={} D={}", T_, V, D);
  check_ids(ids_T, T_, V);
  // Each task owns a block of columns and walks the tokens in order: no two tasks touch
  // the same element, and repeated ids are summed in token order.
  const int64_t blocks = (D + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static) if (T_ * D >= kMinParallelWork)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kColumnBlock, c1 = std::min(D, c0 + kColumnBlock);
    for (int64_t t = 0; t < T_; ++t) {
      T* drow = dtable_VD + static_cast<int64_t>(ids_T[t]) * D;
      const T* g = dout_TD + t * D;
      for (int64_t c = c0; c < c1; ++c) drow[c] += g[c];
    }
  }
}

#define MOE_INSTANTIATE(T)                                                                     \
  template void embedding_forward<T>(T*, const int32_t*, const T*, int64_t, int64_t, int64_t); \
  template void embedding_backward<T>(T*, const int32_t*, const T*, int64_t, int64_t, int64_t);
MOE_INSTANTIATE(float)
MOE_INSTANTIATE(double)
#undef MOE_INSTANTIATE

}  // namespace moe

#include "kernels/matmul.h"

#include <cblas.h>

#include <algorithm>

#include "core/error.h"

namespace moe {
namespace {

constexpr int64_t kTileRows = 128;
constexpr int64_t kTileCols = 256;

void blas_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a,
              static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

void blas_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
               int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a,
              static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

}  // namespace

template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
    return;
  }
  const int64_t row_tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t col_tiles = (N + kTileCols - 1) / kTileCols;
  const int64_t tiles = row_tiles * col_tiles;
#pragma omp parallel for schedule(dynamic, 1) if (tiles > 1)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t r0 = (tile / col_tiles) * kTileRows, c0 = (tile % col_tiles) * kTileCols;
    const int64_t m = std::min(kTileRows, M - r0), n = std::min(kTileCols, N - c0);
    const T* a_tile = trans_a ? A + r0 : A + r0 * lda;  // op(A) rows r0.. = columns of A^T
    const T* b_tile = trans_b ? B + c0 * ldb : B + c0;
    blas_gemm(trans_a, trans_b, m, n, K, alpha, a_tile, lda, b_tile, ldb, beta,
              C + r0 * ldc + c0, ldc);
  }
}

template <typename T>
void linear_forward(T* y_TO, const T* x_TI, const T* w_OI, const T* b_O, int64_t T_, int64_t I,
                    int64_t O) {
  gemm<T>(false, true, T_, O, I, T(1), x_TI, I, w_OI, I, T(0), y_TO, O);
  if (b_O) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t o = 0; o < O; ++o) y_TO[t * O + o] += b_O[o];
  }
}

template <typename T>
void linear_backward(T* dx_TI, T* dw_OI, T* db_O, const T* dy_TO, const T* x_TI, const T* w_OI,
                     int64_t T_, int64_t I, int64_t O, bool accumulate_dx) {
  if (dx_TI) gemm<T>(false, false, T_, I, O, T(1), dy_TO, O, w_OI, I, accumulate_dx ? T(1) : T(0), dx_TI, I);
  if (dw_OI) gemm<T>(true, false, O, I, T_, T(1), dy_TO, O, x_TI, I, T(1), dw_OI, I);
  if (db_O) {
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < O; ++o) {
      T sum = 0;
      for (int64_t t = 0; t < T_; ++t) sum += dy_TO[t * O + o];
      db_O[o] += sum;
    }
  }
}

#define MOE_INSTANTIATE(T)                                                                     \
  template void gemm<T>(bool, bool, int64_t, int64_t, int64_t, T, const T*, int64_t, const T*, \
                        int64_t, T, T*, int64_t);                                              \
  template void linear_forward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t); \
  template void linear_backward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int64_t, \
                                   int64_t, bool);
MOE_INSTANTIATE(float)
MOE_INSTANTIATE(double)
#undef MOE_INSTANTIATE

}  // namespace moe

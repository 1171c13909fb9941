// Dense matmul on the CPU through OpenBLAS. The output is cut into tiles of a fixed
// size (independent of the thread count) and each tile is one single-threaded BLAS
// call, so every element is summed in the same order whatever the thread count.
// Convention for all ops: parameter gradients accumulate (+=); activation gradients
// are overwritten unless a flag says to accumulate.
#pragma once
#include <cstdint>

namespace moe {

// Row-major C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C.
// op(A) = A (lda >= K) or A^T (A stored [K,M], lda >= M); likewise for B.
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// y_TO = x_TI @ w_OI^T (+ b_O when b_O is not null).
template <typename T>
void linear_forward(T* y_TO, const T* x_TI, const T* w_OI, const T* b_O, int64_t T_, int64_t I,
                    int64_t O);

// dx_TI = dy_TO @ w_OI (or += when accumulate_dx), dw_OI += dy_TO^T @ x_TI,
// db_O += sum over rows of dy_TO. Pass null for gradients that are not wanted.
template <typename T>
void linear_backward(T* dx_TI, T* dw_OI, T* db_O, const T* dy_TO, const T* x_TI, const T* w_OI,
                     int64_t T_, int64_t I, int64_t O, bool accumulate_dx = false);

}  // namespace moe

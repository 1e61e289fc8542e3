// The blocked, multi-threaded GEMM behind rnnkern::linear (linear.cpp), also
// used for the recurrence's large weight-gradient products.
#pragma once

#include <cstdint>

namespace rnnkern::cpu {

// C[M, N] (+)= A[M, K] B[K, N] on all threads, with A[m][k] = A[m*a_rows + k*a_ks],
// B[k][n] = B[k*b_ks + n*b_ns], C row-major with leading dimension ldc.
template <typename T>
void blocked_gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_rows, int64_t a_ks,
                  const T* B, int64_t b_ks, int64_t b_ns, T* C, int64_t ldc, bool accumulate);

}  // namespace rnnkern::cpu

// The blocked, multi-threaded GEMM behind rnnkern::linear (linear.cpp), also
// used for the recurrence's large weight-gradient products.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace rnnkern::cpu {

// C[M, N] (+)= A[M, K] B[K, N] on all threads, with A[m][k] = A[m*a_rows + k*a_ks],
// B[k][n] = B[k*b_ks + n*b_ns], C row-major with leading dimension ldc.
template <typename T>
void blocked_gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_rows, int64_t a_ks,
                  const T* B, int64_t b_ks, int64_t b_ns, T* C, int64_t ldc, bool accumulate);

// x[M, K] w[N, K]^T in the accumulate dtype (float32 for the half types),
// pooled: bfloat16 operands on bf16 pairs where the CPU runs them (pairs.h),
// others through copies in the accumulate dtype.  rnnkern::linear and a
// step's input product.
at::Tensor linear_acc(const at::Tensor& x, const at::Tensor& weight);

// Its gradients in the accumulate dtype: grad_x = grad_y w, grad_w =
// grad_y^T x (pooled where needed, else empty), on bf16 pairs where all
// three are bfloat16.
std::tuple<at::Tensor, at::Tensor> linear_backward_acc(const at::Tensor& grad_y, const at::Tensor& x,
                                                       const at::Tensor& weight, bool need_x,
                                                       bool need_weight);

}  // namespace rnnkern::cpu

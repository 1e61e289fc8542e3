// A row-major GEMM on cuBLAS (cublasGemmEx), for the per-step products of
// the time loops.  Plain C++: no torch headers, no device code.
#pragma once

#include <cstdint>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

namespace rnnkern::cuda {

enum class DType : int { F64, F32, F16, BF16 };

// C[M, N] = op(A)[M, K] op(B)[K, N] + beta C, all row-major: A is stored
// [M, K] (or [K, M] when trans_a) with row stride lda, B [K, N] (or [N, K]
// when trans_b) with row stride ldb, C [M, N] with row stride ldc.  beta is 0
// (C is overwritten, whatever it held) or 1.
//
// A and B have dtype ab, C has dtype c (ab, or F32 for F16/BF16 inputs).
// Accumulation: F64 in double; F32 in float, or TF32 tensor cores when
// allow_tf32; F16/BF16 in float on tensor cores.  Runs on the stream the
// handle is bound to (`stream` must be the same; it is used when K == 0).
// Throws std::runtime_error on a cuBLAS error.
void gemm_rowmajor(cublasHandle_t handle, cudaStream_t stream, DType ab, DType c, bool allow_tf32,
                   bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* a,
                   int64_t lda, const void* b, int64_t ldb, float beta, void* c_ptr, int64_t ldc);

}  // namespace rnnkern::cuda

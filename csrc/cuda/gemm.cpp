// cublasGemmEx behind a row-major interface (see gemm.h).
#include "gemm.h"

#include <limits>
#include <stdexcept>
#include <string>

namespace rnnkern::cuda {
namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::F64: return CUDA_R_64F;
    case DType::F32: return CUDA_R_32F;
    case DType::F16: return CUDA_R_16F;
    case DType::BF16: return CUDA_R_16BF;
  }
  throw std::invalid_argument("rnnkern gemm: unknown dtype");
}

size_t element_size(DType t) { return t == DType::F64 ? 8 : t == DType::F32 ? 4 : 2; }

int as_int(int64_t v, const char* what) {
  if (v < 0 || v > std::numeric_limits<int>::max())
    throw std::invalid_argument(std::string("rnnkern gemm: ") + what + " = " + std::to_string(v) +
                                " does not fit cuBLAS's 32-bit int");
  return static_cast<int>(v);
}

}  // namespace

void gemm_rowmajor(cublasHandle_t handle, cudaStream_t stream, DType ab, DType c, bool allow_tf32,
                   bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* a,
                   int64_t lda, const void* b, int64_t ldb, float beta, void* c_ptr, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    // An empty sum: cuBLAS would want leading dimensions of at least 1 for
    // empty operands; do what it would do.
    if (beta == 0.f) {
      const size_t es = element_size(c);
      const cudaError_t e = cudaMemset2DAsync(c_ptr, ldc * es, 0, N * es, M, stream);
      if (e != cudaSuccess)
        throw std::runtime_error(std::string("rnnkern gemm: ") + cudaGetErrorString(e));
    }
    return;
  }
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLAS
  // sees B first, each operand transposed exactly when it is in row-major terms.
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int m = as_int(N, "N"), n = as_int(M, "M"), k = as_int(K, "K");
  const int ld_b = as_int(ldb, "ldb"), ld_a = as_int(lda, "lda"), ld_c = as_int(ldc, "ldc");
  cublasStatus_t status;
  if (ab == DType::F64) {
    const double alpha = 1.0, beta_d = beta;
    status = cublasGemmEx(handle, op_b, op_a, m, n, k, &alpha, b, CUDA_R_64F, ld_b, a, CUDA_R_64F,
                          ld_a, &beta_d, c_ptr, cuda_type(c), ld_c, CUBLAS_COMPUTE_64F,
                          CUBLAS_GEMM_DEFAULT);
  } else {
    const float alpha = 1.f;
    const cublasComputeType_t compute = ab == DType::F32 && allow_tf32
                                            ? CUBLAS_COMPUTE_32F_FAST_TF32
                                            : CUBLAS_COMPUTE_32F;
    status = cublasGemmEx(handle, op_b, op_a, m, n, k, &alpha, b, cuda_type(ab), ld_b, a,
                          cuda_type(ab), ld_a, &beta, c_ptr, cuda_type(c), ld_c, compute,
                          CUBLAS_GEMM_DEFAULT);
  }
  if (status != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("rnnkern gemm: cublasGemmEx failed: ") +
                             cublasGetStatusString(status) + " (M=" + std::to_string(M) +
                             " N=" + std::to_string(N) + " K=" + std::to_string(K) + ")");
}

}  // namespace rnnkern::cuda

// The GEMMs of the CPU backend:
//     C[M, N] (+)= A[M, K] * B[K, N]
// with B packed into column panels.  Register-blocked MR x NR micro-kernel
// written with GCC vector extensions (256-bit vectors); the caller compiles it
// per ISA level (target_clones).  Two drivers:
//  * multiply(): the per-step products of the recurrence, B packed once per
//    call so the T steps that multiply by the same W_hh slice do not repack it
//    each time (a BLAS call does); single-threaded, each thread owns a slice;
//  * pack_a_block() + multiply_packed(): the building blocks of the large
//    products (input projection, dX, dW), blocked for the caches; threading is
//    the caller's (csrc/cpu/linear.cpp).
// On the 2-core AMD EPYC this project is measured on, the micro-kernel runs
// at 1.3-2x the speed of the MKL bundled with torch for these shapes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__GNUC__)
#define RNNKERN_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define RNNKERN_ALWAYS_INLINE inline
#endif

#include "isa.h"

namespace rnnkern::cpu::gemm {

template <typename T>
struct Vec {
  // 256 bits: 8 floats or 4 doubles.
  typedef T type __attribute__((vector_size(32)));
  static constexpr int kLanes = 32 / sizeof(T);
};

constexpr int kMR = 6;  // rows of C per micro-kernel call
template <typename T>
constexpr int kNR = 2 * Vec<T>::kLanes;  // columns per packed panel

// B packed as panels of kNR columns: panel p holds B[k][p*kNR + c] at
// data[(p*K + k)*kNR + c], zero-padded past N.  Or, made by view_rows(), B
// read where it lies (row-major, row stride ld) for its whole panels and only
// the last, partial one packed: for a product used by one or two steps, where
// packing all of B would cost more than the product.
template <typename T>
struct PackedB {
  int64_t K = 0, N = 0;
  std::vector<T> data;
  const T* src = nullptr;  // view_rows(): B[k][n] = src[k*ld + n] for panels < src_panels
  int64_t ld = 0, src_panels = 0;

  int64_t panels() const { return (N + kNR<T> - 1) / kNR<T>; }
  const T* panel(int64_t p) const {
    return p < src_panels ? src + p * kNR<T> : data.data() + (p - src_panels) * K * kNR<T>;
  }
  int64_t panel_ld(int64_t p) const { return p < src_panels ? ld : kNR<T>; }

  static PackedB view_rows(const T* b, int64_t K_, int64_t N_, int64_t ld_) {
    PackedB v;
    v.K = K_;
    v.N = N_;
    v.src = b;
    v.ld = ld_;
    v.src_panels = N_ / kNR<T>;
    const int64_t tail = N_ - v.src_panels * kNR<T>;
    if (tail > 0) {
      v.data.assign(static_cast<size_t>(K_ * kNR<T>), T(0));
      for (int64_t k = 0; k < K_; ++k)
        std::memcpy(v.data.data() + k * kNR<T>, b + k * ld_ + v.src_panels * kNR<T>, tail * sizeof(T));
    }
    return v;
  }

  void resize(int64_t K_, int64_t N_) {
    K = K_;
    N = N_;
    data.resize(static_cast<size_t>(panels() * K * kNR<T>));
  }

  // Panels [p0, p1) of B[k][n] = src[k*sk + n*sn] (after resize).
  void pack_panels(const T* src, int64_t sk, int64_t sn, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kNR<T>, nc = std::min<int64_t>(kNR<T>, N - n0);
      T* dst = data.data() + p * K * kNR<T>;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t c = 0; c < kNR<T>; ++c) dst[k * kNR<T> + c] = c < nc ? src[k * sk + (n0 + c) * sn] : T(0);
    }
  }

  void pack(const T* src, int64_t K_, int64_t N_, int64_t sk, int64_t sn) {
    resize(K_, N_);
    pack_panels(src, sk, sn, 0, panels());
  }
};

// A is addressed as A[r*ars + k*aks]: row-major (aks = 1) or transposed.
struct StridesA {
  int64_t rows, ks;
};

template <typename T, int MR>
RNNKERN_ALWAYS_INLINE void micro_kernel(int64_t K, const T* A, StridesA sa, const T* panel,
                                        int64_t ldb, T* C, int64_t ldc, int64_t ncols,
                                        bool accumulate) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::kLanes;
  V c0[MR], c1[MR];
  for (int r = 0; r < MR; ++r) c0[r] = c1[r] = V{};
  for (int64_t k = 0; k < K; ++k) {
    V b0, b1;
    std::memcpy(&b0, panel + k * ldb, sizeof(V));
    std::memcpy(&b1, panel + k * ldb + L, sizeof(V));
    for (int r = 0; r < MR; ++r) {
      const T a = A[r * sa.rows + k * sa.ks];
      c0[r] += a * b0;
      c1[r] += a * b1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    T* c = C + r * ldc;
    if (ncols == 2 * L) {
      if (accumulate) {
        V o0, o1;
        std::memcpy(&o0, c, sizeof(V));
        std::memcpy(&o1, c + L, sizeof(V));
        c0[r] += o0;
        c1[r] += o1;
      }
      std::memcpy(c, &c0[r], sizeof(V));
      std::memcpy(c + L, &c1[r], sizeof(V));
    } else {
      T tmp[2 * L];
      std::memcpy(tmp, &c0[r], sizeof(V));
      std::memcpy(tmp + L, &c1[r], sizeof(V));
      for (int64_t j = 0; j < ncols; ++j) c[j] = accumulate ? c[j] + tmp[j] : tmp[j];
    }
  }
}

// The micro-kernel for a block of mr <= kMR rows (the row count is a template
// parameter so the accumulators stay in registers).
template <typename T>
RNNKERN_ALWAYS_INLINE void micro_kernel_rows(int64_t mr, int64_t K, const T* A, StridesA sa,
                                             const T* panel, int64_t ldb, T* C, int64_t ldc,
                                             int64_t ncols, bool accumulate) {
  switch (mr) {
    case 6: micro_kernel<T, 6>(K, A, sa, panel, ldb, C, ldc, ncols, accumulate); break;
    case 5: micro_kernel<T, 5>(K, A, sa, panel, ldb, C, ldc, ncols, accumulate); break;
    case 4: micro_kernel<T, 4>(K, A, sa, panel, ldb, C, ldc, ncols, accumulate); break;
    case 3: micro_kernel<T, 3>(K, A, sa, panel, ldb, C, ldc, ncols, accumulate); break;
    case 2: micro_kernel<T, 2>(K, A, sa, panel, ldb, C, ldc, ncols, accumulate); break;
    default: micro_kernel<T, 1>(K, A, sa, panel, ldb, C, ldc, ncols, accumulate); break;
  }
}
static_assert(kMR == 6, "micro_kernel_rows dispatches up to 6 rows");

// C[M, N] (+)= A[M, K] B[:, panels p0..p1), A[r][k] = A[r*sa.rows + k*sa.ks].
template <typename T>
RNNKERN_ALWAYS_INLINE void multiply(int64_t M, const T* A, StridesA sa, const PackedB<T>& B,
                                    T* C, int64_t ldc, bool accumulate, int64_t p0 = 0,
                                    int64_t p1 = -1) {
  const int64_t K = B.K, N = B.N;
  if (p1 < 0) p1 = B.panels();
  // Rows in blocks of near-equal size (M = 32: 6 6 5 5 5 5, not 6 6 6 6 6 2).
  const int64_t blocks = (M + kMR - 1) / kMR;
  for (int64_t bi = 0, i = 0, mr = 0; bi < blocks; ++bi, i += mr) {
    mr = (M - i + (blocks - bi) - 1) / (blocks - bi);
    const T* a = A + i * sa.rows;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kNR<T>;
      const int64_t nc = std::min<int64_t>(kNR<T>, N - n0);
      T* c = C + i * ldc + n0;
      micro_kernel_rows<T>(mr, K, a, sa, B.panel(p), B.panel_ld(p), c, ldc, nc, accumulate);
    }
  }
}

// C[M, N] (+)= A[M, K] W^T for a row-major W [N, K] (row n at W + n*ldw), W
// unpacked: dot products of the rows of A with the rows of W, NB rows of W at
// a time so that each load of A serves NB of them.  The per-step product of a
// call of one step, or of one or two rows a step (a matrix-vector product at
// batch 1), where the packed kernel would reuse a panel for as few rows and
// packing costs about two passes over W.
template <typename T, int MB, int NB>
RNNKERN_ALWAYS_INLINE void dot_block(int64_t K, const T* A, int64_t lda, const T* W, int64_t ldw,
                                     T* C, int64_t ldc, bool accumulate) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::kLanes;
  V acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = V{};
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    V a[MB];
    for (int m = 0; m < MB; ++m) std::memcpy(&a[m], A + m * lda + k, sizeof(V));
    for (int n = 0; n < NB; ++n) {
      V w;
      std::memcpy(&w, W + n * ldw + k, sizeof(V));
      for (int m = 0; m < MB; ++m) acc[m][n] += a[m] * w;
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int n = 0; n < NB; ++n) {
      T sum = 0;
      for (int l = 0; l < L; ++l) sum += acc[m][n][l];
      for (int64_t kk = k; kk < K; ++kk) sum += A[m * lda + kk] * W[n * ldw + kk];
      T& c = C[m * ldc + n];
      c = accumulate ? c + sum : sum;
    }
  }
}

template <typename T>
RNNKERN_ALWAYS_INLINE void multiply_nt(int64_t M, const T* A, int64_t lda, const T* W,
                                       int64_t ldw, int64_t N, int64_t K, T* C, int64_t ldc,
                                       bool accumulate) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) {
    int64_t n = 0;
    for (; n + 4 <= N; n += 4)
      dot_block<T, 2, 4>(K, A + m * lda, lda, W + n * ldw, ldw, C + m * ldc + n, ldc, accumulate);
    for (; n < N; ++n)
      dot_block<T, 2, 1>(K, A + m * lda, lda, W + n * ldw, ldw, C + m * ldc + n, ldc, accumulate);
  }
  if (m < M) {
    int64_t n = 0;
    for (; n + 8 <= N; n += 8)
      dot_block<T, 1, 8>(K, A + m * lda, lda, W + n * ldw, ldw, C + m * ldc + n, ldc, accumulate);
    for (; n < N; ++n)
      dot_block<T, 1, 1>(K, A + m * lda, lda, W + n * ldw, ldw, C + m * ldc + n, ldc, accumulate);
  }
}

// ---- blocked large products ----------------------------------------------
// A block of rows [m0, m0 + m) and of K [k0, k0 + kc), packed as micro-panels
// of kMR rows: dst[(i / kMR) * kc * kMR + k * kMR + i % kMR], zero past M.
template <typename T>
RNNKERN_ALWAYS_INLINE void pack_a_block(const T* A, StridesA sa, int64_t m0, int64_t m, int64_t M,
                                        int64_t k0, int64_t kc, T* dst) {
  for (int64_t i0 = 0; i0 < m; i0 += kMR) {
    T* panel = dst + (i0 / kMR) * kc * kMR;
    const int64_t rows = std::min<int64_t>({kMR, m - i0, M - m0 - i0});
    const T* a = A + (m0 + i0) * sa.rows + k0 * sa.ks;
    // k outer: a transposed A (dW = dY^T X) reads kMR neighbours per k.
    for (int64_t k = 0; k < kc; ++k) {
      for (int r = 0; r < kMR; ++r) panel[k * kMR + r] = r < rows ? a[r * sa.rows + k * sa.ks] : T(0);
    }
  }
}

// C[m rows, panels p0..p1) (+)= packed A block (from pack_a_block) * packed B.
template <typename T>
RNNKERN_ALWAYS_INLINE void multiply_packed(int64_t m, const T* a_packed, const PackedB<T>& B,
                                           T* C, int64_t ldc, bool accumulate, int64_t p0,
                                           int64_t p1) {
  const int64_t K = B.K, N = B.N;
  const StridesA sa{1, kMR};
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kNR<T>;
    const int64_t nc = std::min<int64_t>(kNR<T>, N - n0);
    const T* panel = B.panel(p);
    const int64_t ldb = B.panel_ld(p);
    for (int64_t i = 0; i < m; i += kMR) {
      const int64_t mr = std::min<int64_t>(kMR, m - i);
      const T* a = a_packed + (i / kMR) * K * kMR;
      T* c = C + i * ldc + n0;
      micro_kernel_rows<T>(mr, K, a, sa, panel, ldb, c, ldc, nc, accumulate);
    }
  }
}

}  // namespace rnnkern::cpu::gemm

// A small GEMM for the per-step products of the CPU recurrence:
//     C[M, N] (+)= A[M, K] * B[K, N]
// with B packed once per call into column panels, so the T steps that
// multiply by the same W_hh slice do not repack it each time (a BLAS call
// does).  Register-blocked MR x NR micro-kernel written with GCC vector
// extensions (256-bit vectors): the caller compiles it per ISA level.
//
// Single-threaded by design: the recurrence gives each thread its own slice.
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
// data[(p*K + k)*kNR + c], zero-padded past N.
template <typename T>
struct PackedB {
  int64_t K = 0, N = 0;
  std::vector<T> data;

  int64_t panels() const { return (N + kNR<T> - 1) / kNR<T>; }

  // B[k][n] = src[k*sk + n*sn]
  void pack(const T* src, int64_t K_, int64_t N_, int64_t sk, int64_t sn) {
    K = K_;
    N = N_;
    data.assign(static_cast<size_t>(panels() * K * kNR<T>), T(0));
    for (int64_t p = 0; p < panels(); ++p) {
      const int64_t n0 = p * kNR<T>, nc = std::min<int64_t>(kNR<T>, N - n0);
      T* dst = data.data() + p * K * kNR<T>;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t c = 0; c < nc; ++c) dst[k * kNR<T> + c] = src[k * sk + (n0 + c) * sn];
    }
  }
};

// A is addressed as A[r*ars + k*aks]: row-major (aks = 1) or transposed.
struct StridesA {
  int64_t rows, ks;
};

template <typename T, int MR>
RNNKERN_ALWAYS_INLINE void micro_kernel(int64_t K, const T* A, StridesA sa, const T* panel,
                                        T* C, int64_t ldc, int64_t ncols, bool accumulate) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::kLanes;
  V c0[MR], c1[MR];
  for (int r = 0; r < MR; ++r) c0[r] = c1[r] = V{};
  for (int64_t k = 0; k < K; ++k) {
    V b0, b1;
    std::memcpy(&b0, panel + k * 2 * L, sizeof(V));
    std::memcpy(&b1, panel + k * 2 * L + L, sizeof(V));
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

// C[M, N] (+)= A[M, K] B[:, panels p0..p1), A[r][k] = A[r*sa.rows + k*sa.ks].
template <typename T>
RNNKERN_ALWAYS_INLINE void multiply(int64_t M, const T* A, StridesA sa, const PackedB<T>& B,
                                    T* C, int64_t ldc, bool accumulate, int64_t p0 = 0,
                                    int64_t p1 = -1) {
  const int64_t K = B.K, N = B.N;
  if (p1 < 0) p1 = B.panels();
  for (int64_t i = 0; i < M; i += kMR) {
    const int64_t mr = std::min<int64_t>(kMR, M - i);
    const T* a = A + i * sa.rows;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kNR<T>;
      const int64_t nc = std::min<int64_t>(kNR<T>, N - n0);
      const T* panel = B.data.data() + p * K * kNR<T>;
      T* c = C + i * ldc + n0;
      switch (mr) {
        case 6: micro_kernel<T, 6>(K, a, sa, panel, c, ldc, nc, accumulate); break;
        case 5: micro_kernel<T, 5>(K, a, sa, panel, c, ldc, nc, accumulate); break;
        case 4: micro_kernel<T, 4>(K, a, sa, panel, c, ldc, nc, accumulate); break;
        case 3: micro_kernel<T, 3>(K, a, sa, panel, c, ldc, nc, accumulate); break;
        case 2: micro_kernel<T, 2>(K, a, sa, panel, c, ldc, nc, accumulate); break;
        default: micro_kernel<T, 1>(K, a, sa, panel, c, ldc, nc, accumulate); break;
      }
    }
  }
}

}  // namespace rnnkern::cpu::gemm

// The GEMMs of the CPU backend:
//     C[M, N] (+)= A[M, K] * B[K, N]
// with B packed into column panels.  Register-blocked MR x NR micro-kernel
// written with GCC vector extensions, in two widths: 256-bit vectors, which the
// caller compiles per ISA level (target_clones), and 512-bit vectors compiled
// for x86-64-v4 (isa.h), used on CPUs with AVX-512.  On an AMD Zen 5 core (full
// 512-bit FMA units) the 512-bit kernel runs at 270 GFLOP/s, the 256-bit one
// at 137: oneDNN's LSTM in torch.nn, 512-bit there, ran the B=32 T=256 H=256
// forward 1.8x faster than the 256-bit kernels.  The panel width (PackedB::nr,
// two vectors) follows the width chosen.  Two drivers:
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
#include <memory>
#include <type_traits>
#include <utility>
#include <new>
#include <vector>

#if defined(__GNUC__)
#define RNNKERN_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define RNNKERN_ALWAYS_INLINE inline
#endif

#include <c10/util/Half.h>

#include "isa.h"

namespace rnnkern::cpu::gemm {

// C[M, N] (+)= A B with nothing to multiply (M, N or K zero): C becomes
// zeros for K = 0 unless accumulating.  True where the product is settled so.
template <typename T>
bool settle_empty_product(int64_t M, int64_t N, int64_t K, T* C, int64_t ldc, bool accumulate) {
  if (M == 0 || N == 0) return true;
  if (K != 0) return false;
  if (!accumulate)
    for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, T(0));
  return true;
}

// Whether the products use 512-bit vectors: built with them (isa.h) and the CPU
// has AVX-512 (F, VL, BW, DQ: x86-64-v4).  Decided once per process.
bool wide_vectors();

// The width of the cores' FMA pipes, as far as rnnkern tells them apart: 512
// on AMD's server and desktop Zen 5 (CPUID family 0x1A, models 0x00-0x1F and
// 0x40-0x4F), which run a 512-bit FMA whole; 256 elsewhere (a Zen 4 runs it as
// two 256-bit halves, as do the mobile Zen 5).  RNNKERN_CPU_FMA_BITS=256 or 512
// says otherwise (A/B timings, tests).  Paths whose worth depends on it read it;
// rnnkern.auto's CPU classes follow the same rule (fma_pipes_512bit).
int fma_pipe_bits();

template <typename T, int Bytes>
struct Vec {
  typedef T type __attribute__((vector_size(Bytes)));
  static constexpr int kLanes = Bytes / sizeof(T);
};
constexpr int kNarrow = 32;  // bytes of a vector: AVX2 and below
constexpr int kWide = 64;    // AVX-512

constexpr int kMR = 6;  // rows of C per micro-kernel call (packed A blocks; 16 registers)
// Rows per call of the per-step products with 512-bit vectors (32 registers:
// 16 accumulators): a batch of 32 rows runs as 4 x 8, not 6 6 5 5 5 5
// (M=32 K=256 N=1024: 254 GFLOP/s against 229, Zen 5).
constexpr int kMRWide = 8;
// Columns per packed panel: two vectors.
template <typename T, int Bytes>
constexpr int kNR = 2 * Vec<T, Bytes>::kLanes;
// The panel width of this process's products.
template <typename T>
inline int64_t panel_cols() {
  return wide_vectors() ? kNR<T, kWide> : kNR<T, kNarrow>;
}

// An L x L tile transposed in registers, L the lanes of a 32-byte vector:
// out[i][j] = in[j][i], rows `ld_in` and `ld_out` elements apart.  Packing
// the input projection's and the recurrence's W^T from a row-major W is a
// transpose: element by element it took 37 us for an LSTM's 256 KB weight at
// H=128 (a 256-step B=1 call's recurrence streams it in 2.7 us a step),
// 9 us by tiles.  log2(L) butterfly stages, stage S interleaving blocks of S
// lanes of rows i and i + S.
template <typename T>
constexpr int64_t kTileLanes = Vec<T, kNarrow>::kLanes;

template <typename T, int S>
RNNKERN_ALWAYS_INLINE void tile_butterfly(typename Vec<T, kNarrow>::type& a,
                                          typename Vec<T, kNarrow>::type& b) {
  using I = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  typedef I Mask __attribute__((vector_size(kNarrow)));
  constexpr int L = Vec<T, kNarrow>::kLanes;
  Mask lo, hi;  // lane j: block j / (2S), within it the S lanes of a then of b
  for (int j = 0; j < L; ++j) {
    const int base = j / (2 * S) * 2 * S, off = j % (2 * S);
    lo[j] = off < S ? base + off : L + base + off - S;
    hi[j] = off < S ? base + S + off : L + base + off;
  }
  const auto x = __builtin_shuffle(a, b, lo), y = __builtin_shuffle(a, b, hi);
  a = x;
  b = y;
}

template <typename T, int S = 1>
RNNKERN_ALWAYS_INLINE void tile_stages(typename Vec<T, kNarrow>::type* r) {
  constexpr int L = Vec<T, kNarrow>::kLanes;
  if constexpr (S < L) {
    for (int i = 0; i < L; ++i)
      if ((i & S) == 0) tile_butterfly<T, S>(r[i], r[i + S]);
    tile_stages<T, 2 * S>(r);
  }
}

template <typename T>
RNNKERN_ALWAYS_INLINE void transpose_tile(const T* in, int64_t ld_in, T* out, int64_t ld_out) {
  using V = typename Vec<T, kNarrow>::type;
  constexpr int L = Vec<T, kNarrow>::kLanes;
  V r[L];
  for (int i = 0; i < L; ++i) std::memcpy(&r[i], in + i * ld_in, sizeof(V));
  tile_stages<T>(r);
  for (int i = 0; i < L; ++i) std::memcpy(out + i * ld_out, &r[i], sizeof(V));
}

// A vector's allocator that leaves new elements uninitialised: packing
// writes every element of B's panels, padding included, and zero-filling
// them first was a pass over the weight per call (1 MB for an LSTM at H=256).
template <typename T>
struct UninitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  UninitAllocator() = default;
  template <typename U>
  UninitAllocator(const UninitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  // Cache-line aligned: a panel's rows are 64 bytes at 512 bits, and from
  // malloc's 16-byte alignment every one of their loads straddled two lines.
  static constexpr std::align_val_t kAlign{64};
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, size_t) noexcept { ::operator delete(p, kAlign); }
};

// B packed as panels of nr columns: panel p holds B[k][p*nr + c] at
// data[(p*K + k)*nr + c], zero-padded past N.  Or, made by view_rows(), B
// read where it lies (row-major, row stride ld) for its whole panels and only
// the last, partial one packed: for a product used by one or two steps, where
// packing all of B would cost more than the product.
template <typename T>
struct PackedB {
  int64_t K = 0, N = 0;
  int64_t nr = panel_cols<T>();
  std::vector<T, UninitAllocator<T>> data;  // every element written by pack_panels / view_rows
  const T* src = nullptr;  // view_rows(): B[k][n] = src[k*ld + n] for panels < src_panels
  int64_t ld = 0, src_panels = 0;

  int64_t panels() const { return (N + nr - 1) / nr; }
  const T* panel(int64_t p) const {
    return p < src_panels ? src + p * nr : data.data() + (p - src_panels) * K * nr;
  }
  int64_t panel_ld(int64_t p) const { return p < src_panels ? ld : nr; }
  bool wide() const { return nr == kNR<T, kWide>; }

  static PackedB view_rows(const T* b, int64_t K_, int64_t N_, int64_t ld_) {
    PackedB v;
    v.K = K_;
    v.N = N_;
    v.src = b;
    v.ld = ld_;
    v.src_panels = N_ / v.nr;
    const int64_t tail = N_ - v.src_panels * v.nr;
    if (tail > 0) {
      v.data.assign(static_cast<size_t>(K_ * v.nr), T(0));
      for (int64_t k = 0; k < K_; ++k)
        std::memcpy(v.data.data() + k * v.nr, b + k * ld_ + v.src_panels * v.nr, tail * sizeof(T));
    }
    return v;
  }

  void resize(int64_t K_, int64_t N_) {
    K = K_;
    N = N_;
    data.resize(static_cast<size_t>(panels() * K * nr));
  }

  // Panels [p0, p1) of B[k][n] = src[k*sk + n*sn] (after resize).
  RNNKERN_ALWAYS_INLINE void pack_panels(const T* src_, int64_t sk, int64_t sn, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * nr, nc = std::min<int64_t>(nr, N - n0);
      T* dst = data.data() + p * K * nr;
      if (sn == 1 && nc == nr) {  // a whole panel of a row-major B: row by row, vector copies
        for (int64_t k = 0; k < K; ++k) std::memcpy(dst + k * nr, src_ + k * sk + n0, nr * sizeof(T));
        continue;
      }
      int64_t k = 0;
      if (sk == 1 && nc == nr)  // B = W^T of a row-major W: its rows transposed by tiles
        for (; k + kTileLanes<T> <= K; k += kTileLanes<T>)
          for (int64_t c = 0; c < nr; c += kTileLanes<T>)
            transpose_tile(src_ + (n0 + c) * sn + k, sn, dst + k * nr + c, nr);
      for (; k < K; ++k)
        for (int64_t c = 0; c < nr; ++c) dst[k * nr + c] = c < nc ? src_[k * sk + (n0 + c) * sn] : T(0);
    }
  }

  void pack(const T* src_, int64_t K_, int64_t N_, int64_t sk, int64_t sn) {
    resize(K_, N_);
    pack_panels(src_, sk, sn, 0, panels());
  }
};

// B.pack_panels compiled per ISA level (its copies and tile transposes
// vectorise), for callers that are not.
template <typename T>
RNNKERN_CPU_CLONES void pack_panels(PackedB<T>& b, const T* src, int64_t sk, int64_t sn, int64_t p0,
                                    int64_t p1) {
  b.pack_panels(src, sk, sn, p0, p1);
}

// A is addressed as A[r*ars + k*aks]: row-major (aks = 1) or transposed.
struct StridesA {
  int64_t rows, ks;
};

// How many k ahead the 512-bit micro-kernel prefetches a transposed A (see
// micro_kernel).
constexpr int64_t kPrefetchK = 16;

// A matrix-vector product (one or two rows) whose panels outgrow L2 streams
// them from L3 each step, two panels at a time and four FMAs per k (the
// forward's packed W_hh^T), or a row of W per k (the backward's W_hh read in
// place): the hardware prefetchers alone kept that stream at 93 GB/s (LSTM
// B=1 H=512, W_hh's 4 MB a step; Zen 5), 8 k ahead it runs at 108 (the
// recurrence 18.0 -> 15.5 ms at T=400; the speech encoder's bidirectional
// two-layer LSTM at B=1, one thread, 99 -> 88 ms).  Where the
// panels stay in L2 the prefetches only take load slots: the B=1 H=128 LSTM's
// forward ran 1.2x slower with them, and at 1-1.6 MB (GRU H=320, RNN H=640)
// they made no difference or cost, so only slices of kStreamedPanelBytes or
// more prefetch (LSTM H=384: 2.4 MB; H=512 on two threads: 2 MB a thread).
// The 256-bit kernels (Zen 3) are left as they are: not measured.  Only on
// 512-bit FMA pipes (fma_pipe_bits(): the Zen 5 it was measured on): a Zen 4,
// the same 512-bit kernels on 256-bit pipes, ran slower with the prefetches
// (speech encoder's LSTM, alternating builds: B=1 one thread 172 -> 153 ms
// without them, two threads 88 -> 79, B=2 one thread 238 -> 224).
constexpr int64_t kPrefetchB = 8;
constexpr int64_t kStreamedPanelBytes = int64_t(2) << 20;

// The 512-bit micro-kernels of 3 to 8 rows prefetch their panel's rows this
// many k ahead where prefetches_panels(): a panel of K = 256 is 32 KB, which a
// step's product reads from L2 once per block of rows (the forward's W_ih^T
// and W_hh^T, 2 MB at H = 256), and the hardware prefetchers left the loads of
// each k waiting on it.  Intel Xeon with two 512-bit FMA pipes, one thread,
// micro-benchmark (128 steps of a product, W packed): M=32 K=256 N=1024 and
// the same with x and h, 145-149 -> 168-172 GFLOP/s; single products of 6-128
// rows 1.03-1.08x; 8, 16 or 32 k ahead alike.  Whole calls, torch.nn in the
// same process, separate processes alternated three times (the ratio to
// torch.nn): LSTM forward T=256 B=32 H=256 0.975 -> 1.086x, B=16 0.94 ->
// 1.11x, B=64 0.96 -> 1.04x, T=64 B=32 H=512 0.69 -> 0.78x (two threads 0.75
// -> 0.90x), GRU forward B=32 H=256 1.33 -> 1.48x; forward + backward 1.00-1.07x
// (the weight gradients' packed products take them too); B=1 (the one- and
// two-row kernels) unchanged.
constexpr int64_t kPrefetchPanelK = 16;

// Whether the products prefetch their panels so (micro_kernel): with 512-bit
// vectors on an Intel CPU, where it was measured (above).  Not on AMD's until
// measured there: a Zen 4 ran the streamed matrix-vector kernels slower with
// prefetches (kPrefetchB).  RNNKERN_CPU_PREFETCH_PANELS=0 or 1 says otherwise
// (A/B timings; the bits are the same either way).  Decided once per process.
bool prefetches_panels();

// From this size of the panels a step's product multiplies (W^T: 4 MB for an
// LSTM's W_hh at H = 512, and as much again for its W_ih inside the step),
// multiply() runs them panel by panel, each through every block of rows:
// block by block, each block of rows streamed all of them again from L3.
// Intel Xeon (2 MB of L2 a core), one thread, torch.nn in the same process,
// separate processes alternated three times: LSTM forward T=64 B=32 H=512
// 0.78 -> 0.92x, B=64 0.70 -> 0.87x, forward + backward 0.94 -> 1.03x; T=128
// B=32 H=384 0.86 -> 0.93x; GRU T=64 B=32 H=512 1.04 -> 1.19x forward, 1.14 ->
// 1.28x with the backward; two threads (each worker's slice) level.  Only the
// step's products: the blocked GEMMs' blocks of 96 rows (linear.cpp) ran
// 2-9% slower so (the input projection M=8192 K=512 N=2048), and H = 256 (1 MB)
// is level either way.  Each element of C sums in the same order.
constexpr int64_t kPanelOuterBytes = int64_t(2) << 20;

// C[MR rows, NP panels] (+)= A[MR, K] * the panels (each 2 vectors wide, row
// k of panel q at panel[q] + k * ldb[q]).  NP = 2 for one or two rows of A
// (a matrix-vector product at batch 1): four independent accumulators per row
// instead of two, so the FMAs' latency no longer bounds it (1.09 us instead
// of 2.46 for the 512 x 128 product of an LSTM step at H = 128, Zen 5).
// prefetch_panel: prefetch the panel's rows kPrefetchPanelK ahead (512-bit,
// 3 rows or more: prefetches_panels()).
template <typename T, int MR, int Bytes, int NP, bool kStreamB = false>
RNNKERN_ALWAYS_INLINE void micro_kernel(int64_t K, const T* A, StridesA sa, const T* const* panel,
                                        const int64_t* ldb, T* C, int64_t ldc, int64_t ncols,
                                        bool accumulate, bool prefetch_panel = false) {
  using V = typename Vec<T, Bytes>::type;
  constexpr int L = Vec<T, Bytes>::kLanes;
  constexpr int NV = 2 * NP;  // vectors of C per row
  V c[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) c[r][v] = V{};
  // A transposed A (the weight gradients' dY^T, read where it lies) steps
  // a whole row of dY per k, 4 KB at 4H = 1024: each k's values lie on a
  // new page, which the hardware prefetchers do not cross, so every k waited
  // on memory (dW of 8192 x 64 x 1024 at 60 GFLOP/s, 85 with this; 4096 x
  // 128 x 512: 76 -> 95; Zen 4).  With 256-bit vectors the same prefetch made
  // the first shape slower (71 -> 50), so only the 512-bit kernel has it.
  // (Since then the 512-bit products pack such an A where B has two panels
  // or more, faster on an Intel Xeon: linear.cpp's multiply_rows.  A B of
  // one panel still reads it here.)
  const bool prefetch_a = Bytes == kWide && sa.ks * static_cast<int64_t>(sizeof(T)) > 64;
  for (int64_t k = 0; k < K; ++k) {
    V b[NV];
    if (prefetch_a)  // (an address, not a pointer into A: past its end near the last k)
      __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(A) +
                                                       (k + kPrefetchK) * sa.ks * sizeof(T)));
    if constexpr (Bytes == kWide && MR > 2 && NP == 1 && !kStreamB) {
      if (prefetch_panel) {  // k's two lines (addresses, as above)
        const uintptr_t ahead =
            reinterpret_cast<uintptr_t>(panel[0]) + (k + kPrefetchPanelK) * ldb[0] * sizeof(T);
        __builtin_prefetch(reinterpret_cast<const void*>(ahead));
        __builtin_prefetch(reinterpret_cast<const void*>(ahead + 64));
      }
    }
    if constexpr (kStreamB)  // k's two lines of each panel, kPrefetchB ahead (addresses, as above)
      for (int q = 0; q < NP; ++q) {
        const uintptr_t ahead = reinterpret_cast<uintptr_t>(panel[q]) + (k + kPrefetchB) * ldb[q] * sizeof(T);
        __builtin_prefetch(reinterpret_cast<const void*>(ahead));
        __builtin_prefetch(reinterpret_cast<const void*>(ahead + 64));
      }
    for (int q = 0; q < NP; ++q) {
      std::memcpy(&b[2 * q], panel[q] + k * ldb[q], sizeof(V));
      std::memcpy(&b[2 * q + 1], panel[q] + k * ldb[q] + L, sizeof(V));
    }
    for (int r = 0; r < MR; ++r) {
      const T a = A[r * sa.rows + k * sa.ks];
      for (int v = 0; v < NV; ++v) c[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; ++r) {
    T* cr = C + r * ldc;
    if (ncols == NV * L) {
      for (int v = 0; v < NV; ++v) {
        if (accumulate) {
          V o;
          std::memcpy(&o, cr + v * L, sizeof(V));
          c[r][v] += o;
        }
        std::memcpy(cr + v * L, &c[r][v], sizeof(V));
      }
    } else {
      T tmp[NV * L];
      for (int v = 0; v < NV; ++v) std::memcpy(tmp + v * L, &c[r][v], sizeof(V));
      for (int64_t j = 0; j < ncols; ++j) cr[j] = accumulate ? cr[j] + tmp[j] : tmp[j];
    }
  }
}

// The micro-kernel for a block of mr <= kMR rows (the row count is a template
// parameter so the accumulators stay in registers).
template <typename T, int Bytes, int NP>
RNNKERN_ALWAYS_INLINE void micro_kernel_rows(int64_t mr, int64_t K, const T* A, StridesA sa,
                                             const T* const* panel, const int64_t* ldb, T* C,
                                             int64_t ldc, int64_t ncols, bool accumulate,
                                             bool prefetch_panel = false) {
  const bool pf = prefetch_panel;
  if constexpr (Bytes == kWide) {  // 32 vector registers: up to kMRWide rows
    if (mr == 8) return micro_kernel<T, 8, Bytes, NP>(K, A, sa, panel, ldb, C, ldc, ncols, accumulate, pf);
    if (mr == 7) return micro_kernel<T, 7, Bytes, NP>(K, A, sa, panel, ldb, C, ldc, ncols, accumulate, pf);
  }
  switch (mr) {
    case 6: micro_kernel<T, 6, Bytes, NP>(K, A, sa, panel, ldb, C, ldc, ncols, accumulate, pf); break;
    case 5: micro_kernel<T, 5, Bytes, NP>(K, A, sa, panel, ldb, C, ldc, ncols, accumulate, pf); break;
    case 4: micro_kernel<T, 4, Bytes, NP>(K, A, sa, panel, ldb, C, ldc, ncols, accumulate, pf); break;
    case 3: micro_kernel<T, 3, Bytes, NP>(K, A, sa, panel, ldb, C, ldc, ncols, accumulate, pf); break;
    case 2: micro_kernel<T, 2, Bytes, NP>(K, A, sa, panel, ldb, C, ldc, ncols, accumulate); break;
    default: micro_kernel<T, 1, Bytes, NP>(K, A, sa, panel, ldb, C, ldc, ncols, accumulate); break;
  }
}
static_assert(kMR == 6, "micro_kernel_rows dispatches up to 6 rows");

// C[M, N] (+)= A[M, K] B[:, panels p0..p1), A[r][k] = A[r*sa.rows + k*sa.ks],
// with vectors of `Bytes` (B.nr must be kNR<T, Bytes>).
template <typename T, int Bytes>
RNNKERN_ALWAYS_INLINE void multiply_impl(int64_t M, const T* A, StridesA sa, const PackedB<T>& B,
                                         T* C, int64_t ldc, bool accumulate, int64_t p0,
                                         int64_t p1, bool step_product) {
  constexpr int64_t NR = kNR<T, Bytes>;
  constexpr int64_t MR = Bytes == kWide ? kMRWide : kMR;
  const bool prefetch_panel = Bytes == kWide && prefetches_panels();
  const int64_t K = B.K, N = B.N;
  // Rows in blocks of near-equal size (M = 32, 6 rows: 6 6 5 5 5 5, not 6 6 6 6 6 2).
  const int64_t blocks = (M + MR - 1) / MR;
  if (step_product && blocks > 1 && (p1 - p0) * NR * K * int64_t(sizeof(T)) >= kPanelOuterBytes) {
    // Panel by panel, every block of rows (each then of 3 rows or more).
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * NR;
      const int64_t nc = std::min<int64_t>(NR, N - n0);
      const T* panel = B.panel(p);
      const int64_t ld = B.panel_ld(p);
      for (int64_t bi = 0, i = 0, mr = 0; bi < blocks; ++bi, i += mr) {
        mr = (M - i + (blocks - bi) - 1) / (blocks - bi);
        micro_kernel_rows<T, Bytes, 1>(mr, K, A + i * sa.rows, sa, &panel, &ld, C + i * ldc + n0,
                                       ldc, nc, accumulate, prefetch_panel);
      }
    }
    return;
  }
  for (int64_t bi = 0, i = 0, mr = 0; bi < blocks; ++bi, i += mr) {
    mr = (M - i + (blocks - bi) - 1) / (blocks - bi);
    const T* a = A + i * sa.rows;
    int64_t p = p0;
    if (mr <= 2) {  // two panels per call while both are whole
      const bool stream = Bytes == kWide && (p1 - p0) * NR * K * int64_t(sizeof(T)) >= kStreamedPanelBytes &&
                          fma_pipe_bits() == 512;
      for (; p + 2 <= p1 && (p + 2) * NR <= N; p += 2) {
        const T* panels[2] = {B.panel(p), B.panel(p + 1)};
        const int64_t lds[2] = {B.panel_ld(p), B.panel_ld(p + 1)};
        T* c = C + i * ldc + p * NR;
        if (mr == 2 && stream)
          micro_kernel<T, 2, Bytes, 2, true>(K, a, sa, panels, lds, c, ldc, 2 * NR, accumulate);
        else if (mr == 2)
          micro_kernel<T, 2, Bytes, 2>(K, a, sa, panels, lds, c, ldc, 2 * NR, accumulate);
        else if (stream)
          micro_kernel<T, 1, Bytes, 2, true>(K, a, sa, panels, lds, c, ldc, 2 * NR, accumulate);
        else
          micro_kernel<T, 1, Bytes, 2>(K, a, sa, panels, lds, c, ldc, 2 * NR, accumulate);
      }
    }
    for (; p < p1; ++p) {
      const int64_t n0 = p * NR;
      const int64_t nc = std::min<int64_t>(NR, N - n0);
      const T* panel = B.panel(p);
      const int64_t ld = B.panel_ld(p);
      micro_kernel_rows<T, Bytes, 1>(mr, K, a, sa, &panel, &ld, C + i * ldc + n0, ldc, nc,
                                     accumulate, prefetch_panel);
    }
  }
}

// Rows per micro-panel of a packed A (pack_a_block): the micro-kernel's rows
// at that width.  With 512-bit vectors 8 rows (16 accumulators) where 6 left
// 12: a weight gradient's product ran 7-10% faster (M=1152 K=8192 N=256: 141
// -> 152 GFLOP/s; N=64: 109-117 -> 125-130; one thread, Intel Xeon with
// AVX-512 on two 512-bit FMA pipes).  Each element of C sums in the same order.
template <int Bytes>
constexpr int64_t kPackedRows = Bytes == kWide ? kMRWide : kMR;

// C[m rows, panels p0..p1) (+)= packed A block (from pack_a_block) * packed B.
template <typename T, int Bytes>
RNNKERN_ALWAYS_INLINE void multiply_packed_impl(int64_t m, const T* a_packed, const PackedB<T>& B,
                                                T* C, int64_t ldc, bool accumulate, int64_t p0,
                                                int64_t p1) {
  constexpr int64_t NR = kNR<T, Bytes>;
  constexpr int64_t MR = kPackedRows<Bytes>;
  const bool prefetch_panel = Bytes == kWide && prefetches_panels();
  const int64_t K = B.K, N = B.N;
  const StridesA sa{1, MR};
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * NR;
    const int64_t nc = std::min<int64_t>(NR, N - n0);
    const T* panel = B.panel(p);
    const int64_t ldb = B.panel_ld(p);
    for (int64_t i = 0; i < m; i += MR) {
      const int64_t mr = std::min<int64_t>(MR, m - i);
      const T* a = a_packed + (i / MR) * K * MR;
      micro_kernel_rows<T, Bytes, 1>(mr, K, a, sa, &panel, &ldb, C + i * ldc + n0, ldc, nc,
                                     accumulate, prefetch_panel);
    }
  }
}

// ---- a step's product with the input projection carried along -------------
// K of the large products in chunks of this many (linear.cpp's blocking): an
// element of C is the sum of its chunks' sums, each from zero, chunk by chunk.
constexpr int64_t kKC = 256;

// Rows of X per projection tile (row_with_tiles_impl): 8 x 2 accumulators,
// beside the matrix-vector product's four, of the 32 512-bit registers.  (In
// 256-bit vectors, whose 16 registers hold 4 x 2 beside two, the tiles made a
// Zen 4 step 6-19% slower: the product's two accumulators bound it by their
// FMA latency.  Only the 512-bit kernels carry tiles.)
constexpr int kProjectionTileRows = 8;

// Projection tiles that one step's matrix-vector product h W_hh^T carries
// along: Y[r, panels p0..p1) = X[r, :] W^T for kProjectionTileRows rows of X,
// given transposed (xt[k * kProjectionTileRows + r]: one broadcast base for
// all rows), W^T packed (w, PackedB::pack: panels nr apart), row r of Y at
// y + r * ldy.
// Each element of Y sums as blocked_gemm's would (linear.cpp): k in order
// from zero within each chunk of kKC, the chunks' sums added in order, so the
// projection has the same bits made here as by rnnkern::linear.
template <typename T>
struct ProjectionTiles {
  const T* xt = nullptr;
  const PackedB<T>* w = nullptr;
  T* y = nullptr;
  int64_t ldy = 0;
  int64_t p0 = 0, p1 = 0;
};

// Product k range [k0, k1) of c (+)= a B over NQ panels (the first at b, the
// next K * 2L on; their sums in s: loaded, added to, stored), with `steps` k
// of one projection tile along (its sums in acc; X^T and W^T's rows from xt
// and w, both at the tile's first k here), `rate` of them after every four k
// of the product.  Every sum stays in registers through the loop; the caller
// keeps them in memory between segments, where a chunk's sums may go to Y.
template <typename T, int Bytes, int NQ>  // NQ = 0: the tile's k alone
RNNKERN_ALWAYS_INLINE void row_segment(int64_t k0, int64_t k1, const T* a, const T* b, int64_t K,
                                       T* s_buf, const T* xt, const T* w, int64_t steps,
                                       int64_t rate, T* acc_buf) {
  using V = typename Vec<T, Bytes>::type;
  constexpr int L = Vec<T, Bytes>::kLanes;
  constexpr int R = kProjectionTileRows;
  V s[NQ > 0 ? 2 * NQ : 1], acc[R][2];
  if constexpr (NQ > 0) std::memcpy(s, s_buf, sizeof(s));
  std::memcpy(acc, acc_buf, sizeof(acc));
  auto product = [&](int64_t k) {
    const T ak = a[k];
    for (int q = 0; q < NQ; ++q) {
      V b0, b1;
      std::memcpy(&b0, b + q * K * 2 * L + k * 2 * L, sizeof(V));
      std::memcpy(&b1, b + q * K * 2 * L + k * 2 * L + L, sizeof(V));
      s[2 * q] += ak * b0;
      s[2 * q + 1] += ak * b1;
    }
  };
  int64_t t = 0;
  auto tile = [&]() {
    for (int64_t i = 0; i < rate && t < steps; ++i, ++t) {
      V b0, b1;
      std::memcpy(&b0, w + t * 2 * L, sizeof(V));
      std::memcpy(&b1, w + t * 2 * L + L, sizeof(V));
      for (int r = 0; r < R; ++r) {
        const T xv = xt[t * R + r];
        acc[r][0] += xv * b0;
        acc[r][1] += xv * b1;
      }
    }
  };
  if constexpr (NQ == 0) {
    while (t < steps) tile();
  } else {
    int64_t k = k0;
    for (; k + 4 <= k1; k += 4) {
      product(k);
      product(k + 1);
      product(k + 2);
      product(k + 3);
      tile();
    }
    if (k < k1) {
      for (; k < k1; ++k) product(k);
      tile();
    }
  }
  if constexpr (NQ > 0) std::memcpy(s_buf, s, sizeof(s));
  std::memcpy(acc_buf, acc, sizeof(acc));
}

// c[N] = a[K] B (B packed by PackedB::pack), with the projection tiles
// computed along the way: the product of one row streams B from L2 or beyond
// and leaves the FMA units mostly idle, which the tiles' multiply-adds (each
// load of their W^T serving kProjectionTileRows rows) fill.  The tiles' k are
// spread evenly over the product's passes (two panels each: four
// accumulators, as multiply()'s micro-kernel at one row); what is left at its
// end is finished after it.  B without panels: the tiles alone.  Each element
// of c sums k in order from zero, as multiply()'s micro-kernel does.  (Kept
// in one function, the tiles' sums went to the stack in the product's loop,
// which ran 0.6x; in segments they stay in registers.)  Neither four panels a
// pass (eight accumulators, the same sums) nor prefetching B's rows 8-32 k
// ahead paid on an Intel Xeon (model 207, one thread, LSTM forward B=1 T=256
// against torch.nn in one process): four panels 1.45 -> 1.46x at H=128, 1.37
// -> 1.41x at 256, 1.27 -> 1.30x at 512; the prefetches 1.46 -> 1.32-1.39x at
// H=128.  There a step reads W_hh^T's 256 KB and 32 KB of the tiles' W^T from
// L2 in 3.5 us (82 GB/s, where a plain read of L2 reaches 120-150) and issues
// 8K multiply-adds (1.3-1.6 us of the two FMA pipes): no single floor binds.
template <typename T, int Bytes>
RNNKERN_ALWAYS_INLINE void row_with_tiles_impl(const T* a, const PackedB<T>& B, T* c,
                                               const ProjectionTiles<T>& t) {
  constexpr int L = Vec<T, Bytes>::kLanes;
  constexpr int R = kProjectionTileRows;
  constexpr int NP = 2;
  const int64_t K = B.K, Kx = t.w != nullptr ? t.w->K : 0;
  const int64_t panels = B.N > 0 ? B.panels() : 0;
  const int64_t groups = (K + 3) / 4;  // a pass's groups of four k
  const int64_t passes = (panels + NP - 1) / NP;
  const int64_t work = (t.p1 - t.p0) * Kx;
  const int64_t rate = passes * groups > 0 ? (work + passes * groups - 1) / (passes * groups) : 0;
  alignas(64) T acc[R * 2 * L] = {};
  int64_t tp = t.p0, tk = 0;  // the tiles' panel and k
  // The tiles' next `steps` k have been summed into acc; at the end of a
  // chunk of kKC or of the panel, the sums go to Y.
  auto tiles_advanced = [&](int64_t steps) {
    tk += steps;
    if (tk % kKC != 0 && tk != Kx) return;
    const bool first = tk <= kKC;
    const int64_t n0 = tp * 2 * L, nc = std::min<int64_t>(2 * L, t.w->N - n0);
    for (int r = 0; r < R; ++r) {
      T* y = t.y + r * t.ldy + n0;
      const T* sums = acc + r * 2 * L;
      if (first && nc == 2 * L) {
        std::memcpy(y, sums, 2 * L * sizeof(T));
        continue;
      }
      for (int64_t j = 0; j < nc; ++j) y[j] = first ? sums[j] : sums[j] + y[j];
    }
    std::fill_n(acc, R * 2 * L, T(0));
    if (tk == Kx) tk = 0, ++tp;
  };
  // The tiles' k that one segment may take: up to the next flush.
  auto tile_span = [&]() { return tp >= t.p1 ? 0 : std::min(Kx, (tk / kKC + 1) * kKC) - tk; };
  auto tile_w = [&]() { return t.w->panel(tp) + tk * 2 * L; };
  for (int64_t p = 0; p < panels; p += NP) {
    const bool whole = p + NP <= panels;
    const T* b = B.panel(p);
    alignas(64) T s[2 * NP * L] = {};
    for (int64_t g = 0; g < groups;) {
      const int64_t span = std::min(tile_span(), rate * (groups - g));
      // The groups that take this span's k (rate a group), or all that are left.
      const int64_t g1 = span > 0 ? std::min(groups, g + (span + rate - 1) / rate) : groups;
      const T* xt = t.xt + tk * R;
      const T* w = span > 0 ? tile_w() : nullptr;
      if (whole)
        row_segment<T, Bytes, NP>(4 * g, std::min(K, 4 * g1), a, b, K, s, xt, w, span, rate, acc);
      else
        row_segment<T, Bytes, 1>(4 * g, std::min(K, 4 * g1), a, b, K, s, xt, w, span, rate, acc);
      if (span > 0) tiles_advanced(span);
      g = g1;
    }
    for (int64_t q = 0; q < (whole ? NP : 1); ++q) {
      const int64_t n0 = (p + q) * 2 * L, nc = std::min<int64_t>(2 * L, B.N - n0);
      if (nc == 2 * L)  // (a call of fixed size: a copy of two vectors, not memcpy's)
        std::memcpy(c + n0, s + q * 2 * L, 2 * L * sizeof(T));
      else
        std::memcpy(c + n0, s + q * 2 * L, static_cast<size_t>(nc) * sizeof(T));
    }
  }
  for (int64_t span; (span = tile_span()) > 0;) {  // the rest (or all) of the tiles
    row_segment<T, Bytes, 0>(0, 0, nullptr, nullptr, 0, nullptr, t.xt + tk * R, tile_w(), span, 1, acc);
    tiles_advanced(span);
  }
}

// A vector of W's values as float: W's own type loaded as it lies, or
// float16 values (their bits, uint16_t) converted on the way by F16C's
// vcvtph2ps, exactly.  The conversion is written as inline assembly: the
// intrinsics cannot inline into these portable templates, whose target is
// the baseline's; the instruction is only ever compiled into the x86-64-v3
// and v4 functions that instantiate the templates with float16 weights
// (linear.cpp's multiply_nt_half), which run only on CPUs with F16C.
template <typename T, int Bytes, typename W_t>
RNNKERN_ALWAYS_INLINE typename Vec<T, Bytes>::type load_w(const W_t* w) {
  typename Vec<T, Bytes>::type v;
  if constexpr (std::is_same_v<W_t, T>) {
    std::memcpy(&v, w, sizeof(v));
  } else {
    static_assert(std::is_same_v<T, float> && std::is_same_v<W_t, uint16_t>, "float16 bits into float");
    asm("vcvtph2ps %1, %0" : "=v"(v) : "m"(*reinterpret_cast<const W_t(*)[Vec<T, Bytes>::kLanes]>(w)));
  }
  return v;
}

// One value of W as T (float16 bits widened exactly, as c10 does).
template <typename T, typename W_t>
RNNKERN_ALWAYS_INLINE T w_value(W_t w) {
  if constexpr (std::is_same_v<W_t, T>) {
    return w;
  } else {
    return c10::detail::fp16_ieee_to_fp32_value(w);
  }
}

// C[M, N] (+)= A[M, K] W^T for a row-major W [N, K] (row n at W + n*ldw), W
// unpacked: dot products of the rows of A with the rows of W, NB rows of W at
// a time so that each load of A serves NB of them.  The per-step product of a
// call of one step, where packing W would cost about two passes over it, more
// than the product.  W may be float16 for a float T (load_w): every product
// and sum as for W's values in float.
template <typename T, int MB, int NB, int Bytes, typename W_t = T>
RNNKERN_ALWAYS_INLINE void dot_block(int64_t K, const T* A, int64_t lda, const W_t* W, int64_t ldw,
                                     T* C, int64_t ldc, bool accumulate) {
  using V = typename Vec<T, Bytes>::type;
  constexpr int L = Vec<T, Bytes>::kLanes;
  V acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = V{};
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    V a[MB];
    for (int m = 0; m < MB; ++m) std::memcpy(&a[m], A + m * lda + k, sizeof(V));
    for (int n = 0; n < NB; ++n) {
      const V w = load_w<T, Bytes>(W + n * ldw + k);
      for (int m = 0; m < MB; ++m) acc[m][n] += a[m] * w;
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int n = 0; n < NB; ++n) {
      T sum = 0;
      for (int l = 0; l < L; ++l) sum += acc[m][n][l];
      for (int64_t kk = k; kk < K; ++kk) sum += A[m * lda + kk] * w_value<T>(W[n * ldw + kk]);
      T& c = C[m * ldc + n];
      c = accumulate ? c + sum : sum;
    }
  }
}

template <typename T, int Bytes, typename W_t = T>
RNNKERN_ALWAYS_INLINE void multiply_nt_impl(int64_t M, const T* A, int64_t lda, const W_t* W,
                                            int64_t ldw, int64_t N, int64_t K, T* C, int64_t ldc,
                                            bool accumulate) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) {
    int64_t n = 0;
    for (; n + 4 <= N; n += 4)
      dot_block<T, 2, 4, Bytes, W_t>(K, A + m * lda, lda, W + n * ldw, ldw, C + m * ldc + n,
                                     ldc, accumulate);
    for (; n < N; ++n)
      dot_block<T, 2, 1, Bytes, W_t>(K, A + m * lda, lda, W + n * ldw, ldw, C + m * ldc + n,
                                     ldc, accumulate);
  }
  if (m < M) {
    int64_t n = 0;
    for (; n + 8 <= N; n += 8)
      dot_block<T, 1, 8, Bytes, W_t>(K, A + m * lda, lda, W + n * ldw, ldw, C + m * ldc + n,
                                     ldc, accumulate);
    for (; n < N; ++n)
      dot_block<T, 1, 1, Bytes, W_t>(K, A + m * lda, lda, W + n * ldw, ldw, C + m * ldc + n,
                                     ldc, accumulate);
  }
}

// C[M, N] = A[M, K] W^T for a row-major W [N, K] and a batch of M rows (one
// step of a batch): computed as C^T = W A^T.  W's rows are the broadcast
// operand, read once where they lie; A^T is packed as one panel of V vectors
// holding M columns (V = ceil(M / lanes), up to 4; wider M in chunks).  The
// accumulators fill the registers whatever V is (R * V = 24 of 32, 12 of 16),
// so no lane is spent on padding beyond M's last vector: the general
// micro-kernel's two-vector panels leave half of every FMA idle at M = 16 with
// 512-bit vectors.  C^T lands in scratch, row n's M values contiguous, and is
// transposed into C a cache line of C at a time: written straight from the
// accumulators, C's column n would touch M lines N floats apart, which at
// N = 512 or 256 share a few cache sets and evict each other (an LSTM step at
// B=64 H=128 ran 5x slower than a GRU step at H=170).
template <typename T, int R, int Bytes, int V>
RNNKERN_ALWAYS_INLINE void rows_block(int64_t K, const T* W, int64_t ldw, const T* at, T* ct) {
  using Vt = typename Vec<T, Bytes>::type;
  constexpr int L = Vec<T, Bytes>::kLanes;
  // (unrolled by pragma: past 16 iterations GCC would keep acc in memory)
  Vt acc[R][V];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = Vt{};
  for (int64_t k = 0; k < K; ++k) {
    Vt b[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) std::memcpy(&b[v], at + (k * V + v) * L, sizeof(Vt));
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const T w = W[r * ldw + k];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] += w * b[v];
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) std::memcpy(ct + (r * V + v) * L, &acc[r][v], sizeof(Vt));
}

// C^T[N, V*L] (row n at ct + n*V*L) = W[N, K] A^T, A^T packed [K, V*L].
template <typename T, int Bytes, int V>
RNNKERN_ALWAYS_INLINE void rows_product(int64_t N, const T* W, int64_t ldw, int64_t K,
                                        const T* at, T* ct) {
  constexpr int L = Vec<T, Bytes>::kLanes;
  constexpr int R = (Bytes == kWide ? 24 : 12) / V;
  int64_t n = 0;
  for (; n + R <= N; n += R) rows_block<T, R, Bytes, V>(K, W + n * ldw, ldw, at, ct + n * V * L);
  if constexpr (R > 4)
    for (; n + 4 <= N; n += 4) rows_block<T, 4, Bytes, V>(K, W + n * ldw, ldw, at, ct + n * V * L);
  for (; n < N; ++n) rows_block<T, 1, Bytes, V>(K, W + n * ldw, ldw, at, ct + n * V * L);
}

template <typename T, int Bytes>
RNNKERN_ALWAYS_INLINE void multiply_nt_rows_impl(int64_t M, const T* A, int64_t lda, const T* W,
                                                 int64_t ldw, int64_t N, int64_t K, T* C,
                                                 int64_t ldc) {
  constexpr int L = Vec<T, Bytes>::kLanes;
  constexpr int64_t kLine = 64 / sizeof(T);  // C's columns per transposed tile
  thread_local std::vector<T> at, ct;  // grown as needed and kept: no allocation per step
  at.resize(std::max<size_t>(at.size(), static_cast<size_t>(K * 4 * L)));
  ct.resize(std::max<size_t>(ct.size(), static_cast<size_t>(N * 4 * L)));
  for (int64_t m0 = 0; m0 < M; m0 += 4 * L) {
    const int64_t m = std::min<int64_t>(4 * L, M - m0);
    const int64_t V = (m + L - 1) / L, VL = V * L;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < VL; ++j) at[k * VL + j] = j < m ? A[(m0 + j) * lda + k] : T(0);
    switch (V) {
      case 1: rows_product<T, Bytes, 1>(N, W, ldw, K, at.data(), ct.data()); break;
      case 2: rows_product<T, Bytes, 2>(N, W, ldw, K, at.data(), ct.data()); break;
      case 3: rows_product<T, Bytes, 3>(N, W, ldw, K, at.data(), ct.data()); break;
      default: rows_product<T, Bytes, 4>(N, W, ldw, K, at.data(), ct.data()); break;
    }
    for (int64_t n0 = 0; n0 < N; n0 += kLine) {
      const int64_t nn = std::min<int64_t>(kLine, N - n0);
      const T* src = ct.data() + n0 * VL;
      for (int64_t j = 0; j < m; ++j) {
        T* c = C + (m0 + j) * ldc + n0;
        for (int64_t t = 0; t < nn; ++t) c[t] = src[t * VL + j];
      }
    }
  }
}

#if defined(RNNKERN_CPU_WIDE_VECTORS)
// The 512-bit versions, compiled for x86-64-v4 whatever the caller's target
// (not inlined into it: a v4 body cannot inline into a baseline function).
template <typename T>
RNNKERN_CPU_WIDE_TARGET void multiply_wide(int64_t M, const T* A, StridesA sa, const PackedB<T>& B,
                                           T* C, int64_t ldc, bool accumulate, int64_t p0,
                                           int64_t p1, bool step_product) {
  multiply_impl<T, kWide>(M, A, sa, B, C, ldc, accumulate, p0, p1, step_product);
}
template <typename T>
RNNKERN_CPU_WIDE_TARGET void multiply_packed_wide(int64_t m, const T* a_packed,
                                                  const PackedB<T>& B, T* C, int64_t ldc,
                                                  bool accumulate, int64_t p0, int64_t p1) {
  multiply_packed_impl<T, kWide>(m, a_packed, B, C, ldc, accumulate, p0, p1);
}
template <typename T>
RNNKERN_CPU_WIDE_TARGET void multiply_nt_wide(int64_t M, const T* A, int64_t lda, const T* W,
                                              int64_t ldw, int64_t N, int64_t K, T* C,
                                              int64_t ldc, bool accumulate) {
  multiply_nt_impl<T, kWide>(M, A, lda, W, ldw, N, K, C, ldc, accumulate);
}
template <typename T>
RNNKERN_CPU_WIDE_TARGET void multiply_nt_rows_wide(int64_t M, const T* A, int64_t lda, const T* W,
                                                   int64_t ldw, int64_t N, int64_t K, T* C,
                                                   int64_t ldc) {
  multiply_nt_rows_impl<T, kWide>(M, A, lda, W, ldw, N, K, C, ldc);
}
// (B and the tiles' W^T packed for 512 bits: PackedB::wide().)
template <typename T>
RNNKERN_CPU_WIDE_TARGET void row_with_tiles_wide(const T* a, const PackedB<T>& B, T* c,
                                                 const ProjectionTiles<T>& t) {
  row_with_tiles_impl<T, kWide>(a, B, c, t);
}
#endif

// The drivers: the width B was packed for (PackedB::nr), or the process's.
// C[M, N] (+)= A[M, K] B[:, panels p0..p1).  step_product: a recurrence
// step's product (its rows the batch's, B a weight packed once per call),
// which runs panel by panel past kPanelOuterBytes.
template <typename T>
RNNKERN_ALWAYS_INLINE void multiply(int64_t M, const T* A, StridesA sa, const PackedB<T>& B,
                                    T* C, int64_t ldc, bool accumulate, int64_t p0 = 0,
                                    int64_t p1 = -1, bool step_product = false) {
  if (p1 < 0) p1 = B.panels();
#if defined(RNNKERN_CPU_WIDE_VECTORS)
  if (B.wide()) return multiply_wide<T>(M, A, sa, B, C, ldc, accumulate, p0, p1, step_product);
#endif
  multiply_impl<T, kNarrow>(M, A, sa, B, C, ldc, accumulate, p0, p1, step_product);
}

template <typename T>
RNNKERN_ALWAYS_INLINE void multiply_packed(int64_t m, const T* a_packed, const PackedB<T>& B,
                                           T* C, int64_t ldc, bool accumulate, int64_t p0,
                                           int64_t p1) {
#if defined(RNNKERN_CPU_WIDE_VECTORS)
  if (B.wide()) return multiply_packed_wide<T>(m, a_packed, B, C, ldc, accumulate, p0, p1);
#endif
  multiply_packed_impl<T, kNarrow>(m, a_packed, B, C, ldc, accumulate, p0, p1);
}

template <typename T>
RNNKERN_ALWAYS_INLINE void multiply_nt(int64_t M, const T* A, int64_t lda, const T* W,
                                       int64_t ldw, int64_t N, int64_t K, T* C, int64_t ldc,
                                       bool accumulate) {
#if defined(RNNKERN_CPU_WIDE_VECTORS)
  if (wide_vectors()) return multiply_nt_wide<T>(M, A, lda, W, ldw, N, K, C, ldc, accumulate);
#endif
  multiply_nt_impl<T, kNarrow>(M, A, lda, W, ldw, N, K, C, ldc, accumulate);
}

// C[M, N] = A[M, K] W^T (W row-major [N, K]), W read where it lies, for a
// step's batch of M rows: W's rows broadcast from kMinBroadcastRows rows on,
// multiply_nt's dot products below (their cost grows with M where the
// broadcast one's holds until M fills a vector; an LSTM step at H = 256, Zen
// 5: even at 6 rows, 121 us at 7 by dot products against 90 us at 8
// broadcast).
// batch_rows: the rows of the whole batch when A is a block of them (a split
// between threads), which picks the method: each element then sums in the
// order it would for the whole batch (both methods give every element its
// own fixed order, whatever the rows beside it), so any split gives the
// same bits.
constexpr int64_t kMinBroadcastRows = 6;
template <typename T>
RNNKERN_ALWAYS_INLINE void multiply_nt_rows(int64_t M, const T* A, int64_t lda, const T* W,
                                            int64_t ldw, int64_t N, int64_t K, T* C,
                                            int64_t ldc, int64_t batch_rows = -1) {
  if ((batch_rows < 0 ? M : batch_rows) < kMinBroadcastRows)
    return multiply_nt(M, A, lda, W, ldw, N, K, C, ldc, false);
#if defined(RNNKERN_CPU_WIDE_VECTORS)
  if (wide_vectors()) return multiply_nt_rows_wide<T>(M, A, lda, W, ldw, N, K, C, ldc);
#endif
  multiply_nt_rows_impl<T, kNarrow>(M, A, lda, W, ldw, N, K, C, ldc);
}

// FLOP/s of `iterations` rounds of float32 multiply-adds on independent
// accumulators, in this process's vectors, on the calling thread: the core's
// FMA peak at the clock it runs (linear.cpp; the bench's %peak).
double fma_rate(int64_t iterations);

// Whether this CPU converts float16 to float32 in its vector instructions
// (F16C: x86-64-v3 and up, and a build not pinned below v3).
bool widens_half_natively();

// C[M, N] (+)= A[M, K] W^T for a row-major float16 W (its bits, row n at
// W + n*ldw) and fewer than kMinBroadcastRows rows of A: multiply_nt's dot
// products with W's vectors converted as they are loaded (load_w), where
// widens_half_natively().  The same bits as multiply_nt on a float32 copy of
// W (the conversion is exact), without the copy: a float16 LSTMCell at B=1
// H=256 spent a quarter of its time in torch's conversion of its weights to
// float32, then read twice the bytes.  (linear.cpp.)
void multiply_nt_half(int64_t M, const float* A, int64_t lda, const uint16_t* W, int64_t ldw,
                      int64_t N, int64_t K, float* C, int64_t ldc, bool accumulate);

// ---- blocked large products ----------------------------------------------
// A block of rows [m0, m0 + m) and of K [k0, k0 + kc), packed as micro-panels
// of MR rows (kPackedRows of B's width): dst[(i / MR) * kc * MR
// + k * MR + i % MR], zero past M.
// A transposed A (A[r][k] at A[r + k * ks]: the weight gradients' dY^T) is
// read kRowsAtOnce source rows at a time, whose lines then serve every
// micro-panel from L1: panel by panel over all of K, each k jumped a row of
// the source, and each line came back from L2 once per panel it touches.
// (dW of an LSTM at B=64 T=64 H=128, M=512 K=4096 N=128, one thread, Zen 3:
// 0.65-0.70x of torch's mm -> 0.72-0.80x; at M=1024 K=8192 N=256 1.01-1.14x ->
// 1.05-1.37x, same-session A/B runs.)  A source row at a time, dealt out to
// all panels, was slower: 16 write streams 6 KB apart.
template <int64_t MR, typename T>
RNNKERN_ALWAYS_INLINE void pack_a_block_of(const T* A, StridesA sa, int64_t m0, int64_t m, int64_t M,
                                           int64_t k0, int64_t kc, T* dst) {
  if (sa.rows == 1) {
    constexpr int64_t kRowsAtOnce = 16;  // source rows (k) per pass: their lines stay in L1
    for (int64_t kb = 0; kb < kc; kb += kRowsAtOnce) {
      const int64_t ke = std::min(kc, kb + kRowsAtOnce);
      for (int64_t i0 = 0; i0 < m; i0 += MR) {
        T* panel = dst + (i0 / MR) * kc * MR;
        const int64_t rows = std::min<int64_t>({MR, m - i0, M - m0 - i0});
        if (rows == MR) {  // (a fixed-size copy: vector moves, where the loop below copied a value at a time)
          for (int64_t k = kb; k < ke; ++k)
            std::memcpy(panel + k * MR, A + m0 + i0 + (k0 + k) * sa.ks, MR * sizeof(T));
          continue;
        }
        for (int64_t k = kb; k < ke; ++k) {
          const T* a = A + m0 + i0 + (k0 + k) * sa.ks;
          for (int r = 0; r < MR; ++r) panel[k * MR + r] = r < rows ? a[r] : T(0);
        }
      }
    }
    return;
  }
  for (int64_t i0 = 0; i0 < m; i0 += MR) {
    T* panel = dst + (i0 / MR) * kc * MR;
    const int64_t rows = std::min<int64_t>({MR, m - i0, M - m0 - i0});
    const T* a = A + (m0 + i0) * sa.rows + k0 * sa.ks;
    // (Any other strides: MR values per k, panel by panel.)
    for (int64_t k = 0; k < kc; ++k) {
      for (int r = 0; r < MR; ++r) panel[k * MR + r] = r < rows ? a[r * sa.rows + k * sa.ks] : T(0);
    }
  }
}

// The block packed for the micro-kernel of B's width (kPackedRows rows a micro-panel).
template <typename T>
RNNKERN_ALWAYS_INLINE void pack_a_block(const T* A, StridesA sa, int64_t m0, int64_t m, int64_t M,
                                        int64_t k0, int64_t kc, T* dst, const PackedB<T>& B) {
  if (B.wide()) return pack_a_block_of<kPackedRows<kWide>>(A, sa, m0, m, M, k0, kc, dst);
  pack_a_block_of<kPackedRows<kNarrow>>(A, sa, m0, m, M, k0, kc, dst);
}

}  // namespace rnnkern::cpu::gemm

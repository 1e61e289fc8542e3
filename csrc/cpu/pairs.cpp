// The bf16 pair products (pairs.h): the choice of version, the kernel in its
// two versions, and the drivers.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "pairs.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <type_traits>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "gemm.h"  // RNNKERN_ALWAYS_INLINE
#include "isa.h"
#include "parallel.h"

namespace rnnkern::cpu::pairs {

namespace {

typedef float F __attribute__((vector_size(64)));
typedef uint32_t U __attribute__((vector_size(64)));

// The instruction is written as inline assembly rather than its intrinsic:
// GCC refuses to inline an AVX512_BF16 intrinsic into the kernel template,
// which is compiled for the caller's target, and the template is shared with
// the emulation.  Only the native driver, compiled for x86-64-v4 +
// avx512bf16, instantiates it.
#if defined(RNNKERN_CPU_WIDE_VECTORS)
#define RNNKERN_PAIRS_NATIVE 1
struct Native {
  static RNNKERN_ALWAYS_INLINE void dot(F& acc, uint32_t a, const U& b) {
    const U av = U{} + a;
    asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(b), "v"(av));
  }
};
#endif

// vdpbf16ps lane by lane: acc + a_odd b_odd, then + a_even b_even.  A bf16
// value is the high half of its float32, so each half of a pair becomes a
// float32 by a mask or a shift; the products of two bf16 values are exact in
// float32, so fused or not, each addition rounds once, as the instruction's.
struct Emulated {
  static RNNKERN_ALWAYS_INLINE void dot(F& acc, uint32_t a, const U& b) {
    const F a_hi = (F)(U{} + (a & 0xffff0000u)), a_lo = (F)(U{} + (a << 16));
    acc += a_hi * (F)(b & 0xffff0000u);
    acc += a_lo * (F)(b << 16);
  }
};

// Rows of C per kernel call: 8 rows x 2 vectors = 16 accumulators of the 32
// registers (as gemm.h's 512-bit per-step products).
constexpr int kMR = 8;

// C[MR, NP panels] (+)= A[MR rows of KP pairs, row stride lda] * NP panels
// (ncols: C's columns there).  NP = 2 for one or two rows (a batch of one):
// four or eight independent sums, so that the instruction's latency does not
// bound the product, as gemm.h's micro-kernel.
template <class Dot, int MR, int NP>
RNNKERN_ALWAYS_INLINE void kernel(int64_t KP, const uint32_t* a, int64_t lda, const uint32_t* const* panel,
                                  float* c, int64_t ldc, int64_t ncols, bool accumulate) {
  constexpr int NV = 2 * NP;  // vectors of C per row
  // Unrolled by pragma: without it GCC keeps acc in memory (a load and a
  // store around every instruction, half the speed on a Zen 4).
  F acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = F{};
  for (int64_t kp = 0; kp < KP; ++kp) {
    U b[NV];
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      std::memcpy(&b[2 * q], panel[q] + kp * kNR, sizeof(U));
      std::memcpy(&b[2 * q + 1], panel[q] + kp * kNR + kLanes, sizeof(U));
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const uint32_t ar = a[r * lda + kp];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) Dot::dot(acc[r][v], ar, b[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    if (ncols == NV * kLanes) {  // whole panels: vector by vector
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        F out = acc[r][v];
        if (accumulate) {
          F prev;
          std::memcpy(&prev, cr + v * kLanes, sizeof(F));
          out = prev + out;
        }
        std::memcpy(cr + v * kLanes, &out, sizeof(F));
      }
      continue;
    }
    float out[NV * kLanes];
    for (int v = 0; v < NV; ++v) std::memcpy(out + v * kLanes, &acc[r][v], sizeof(F));
    for (int64_t j = 0; j < ncols; ++j) cr[j] = accumulate ? cr[j] + out[j] : out[j];
  }
}

// C[M, N] (+)= A[M rows of KP pairs, lda apart] B, rows in near-equal
// blocks of up to kMR.
template <class Dot>
RNNKERN_ALWAYS_INLINE void run(int64_t M, const uint32_t* a, int64_t lda, const PackedPairs& b,
                               float* c, int64_t ldc, bool accumulate) {
  const int64_t KP = b.pairs(), P = b.panels();
  const int64_t blocks = (M + kMR - 1) / kMR;
  for (int64_t bi = 0, i = 0, mr = 0; bi < blocks; ++bi, i += mr) {
    mr = (M - i + (blocks - bi) - 1) / (blocks - bi);
    const uint32_t* ai = a + i * lda;
    float* ci = c + i * ldc;
    int64_t p = 0;
    if (mr <= 2) {  // two panels per call while both are whole
      for (; p + 2 <= P && (p + 2) * kNR <= b.N; p += 2) {
        const uint32_t* two[2] = {b.panel(p), b.panel(p + 1)};
        if (mr == 2)
          kernel<Dot, 2, 2>(KP, ai, lda, two, ci + p * kNR, ldc, 2 * kNR, accumulate);
        else
          kernel<Dot, 1, 2>(KP, ai, lda, two, ci + p * kNR, ldc, 2 * kNR, accumulate);
      }
    }
    for (; p < P; ++p) {
      const uint32_t* const one[1] = {b.panel(p)};
      float* cp = ci + p * kNR;
      const int64_t nc = std::min<int64_t>(kNR, b.N - p * kNR);
      switch (mr) {
        case 8: kernel<Dot, 8, 1>(KP, ai, lda, one, cp, ldc, nc, accumulate); break;
        case 7: kernel<Dot, 7, 1>(KP, ai, lda, one, cp, ldc, nc, accumulate); break;
        case 6: kernel<Dot, 6, 1>(KP, ai, lda, one, cp, ldc, nc, accumulate); break;
        case 5: kernel<Dot, 5, 1>(KP, ai, lda, one, cp, ldc, nc, accumulate); break;
        case 4: kernel<Dot, 4, 1>(KP, ai, lda, one, cp, ldc, nc, accumulate); break;
        case 3: kernel<Dot, 3, 1>(KP, ai, lda, one, cp, ldc, nc, accumulate); break;
        case 2: kernel<Dot, 2, 1>(KP, ai, lda, one, cp, ldc, nc, accumulate); break;
        default: kernel<Dot, 1, 1>(KP, ai, lda, one, cp, ldc, nc, accumulate); break;
      }
    }
  }
}
static_assert(kMR == 8, "run dispatches up to 8 rows");

#if defined(RNNKERN_PAIRS_NATIVE)
__attribute__((target("arch=x86-64-v4,avx512bf16"), noinline)) void run_native(
    int64_t M, const uint32_t* a, int64_t lda, const PackedPairs& b, float* c, int64_t ldc,
    bool accumulate) {
  run<Native>(M, a, lda, b, c, ldc, accumulate);
}
#endif

__attribute__((noinline)) void run_emulated(int64_t M, const uint32_t* a, int64_t lda,
                                            const PackedPairs& b, float* c, int64_t ldc,
                                            bool accumulate) {
  run<Emulated>(M, a, lda, b, c, ldc, accumulate);
}

// ---- AMX tiles --------------------------------------------------------------
// Tiles 0-3 hold C (a block of up to 32 rows x one panel: rows [0, 16) x
// the panel's two halves in 0 and 1, rows [16, 32) in 2 and 3), 4 and 5 A's
// two groups of rows, 6 and 7 B's two halves: each loaded tile of A or B
// serves two products, the most that eight tiles allow.
struct TileConfig {  // ldtilecfg's 64 bytes, palette 1
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// Up to 32 rows of C: r0 in the first group of 16, r1 in the second.
inline TileConfig tile_config(int r0, int r1) {
  TileConfig t;
  for (int i : {0, 1, 4}) t.rows[i] = static_cast<uint8_t>(r0), t.colsb[i] = 64;
  if (r1 > 0)
    for (int i : {2, 3, 5}) t.rows[i] = static_cast<uint8_t>(r1), t.colsb[i] = 64;
  for (int i : {6, 7}) t.rows[i] = kTilePairs, t.colsb[i] = 64;
  return t;
}

#if defined(RNNKERN_PAIRS_NATIVE)
// The instructions as inline assembly (tile numbers are part of the
// instruction): the assembler takes them whatever the function's target.
struct AmxTiles {
  static void configure(const TileConfig& t) { asm volatile("ldtilecfg %0" ::"m"(t)); }
  static void release() { asm volatile("tilerelease" ::); }
  template <int T>
  static RNNKERN_ALWAYS_INLINE void load(const void* p, int64_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static RNNKERN_ALWAYS_INLINE void store(void* p, int64_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static RNNKERN_ALWAYS_INLINE void zero() {
    asm volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int C, int A, int B>
  static RNNKERN_ALWAYS_INLINE void dot() {
    // AT&T order: B's tile, A's, then C's
    asm volatile("tdpbf16ps %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
  }
};
#endif

// The tiles in memory, per thread, with the instruction's pseudocode
// (Intel SDM, TDPBF16PS: per pair, in order, the even product then the odd
// one, each addition rounded; no flushing of denormals): every line of the
// tile driver runs on any CPU.  The hardware's sums differ in their last bits
// (its own order within a block of 16 pairs).
struct EmulatedTiles {
  struct State {
    TileConfig config;
    alignas(64) uint8_t tile[8][16][64];
  };
  static State& state() {
    thread_local State s;
    return s;
  }
  static void configure(const TileConfig& t) {
    State& s = state();
    s.config = t;
    std::memset(s.tile, 0, sizeof(s.tile));  // as ldtilecfg
  }
  static void release() { configure(TileConfig{}); }
  template <int T>
  static void load(const void* p, int64_t stride) {
    State& s = state();
    for (int r = 0; r < s.config.rows[T]; ++r)
      std::memcpy(s.tile[T][r], static_cast<const char*>(p) + r * stride, s.config.colsb[T]);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    State& s = state();
    for (int r = 0; r < s.config.rows[T]; ++r)
      std::memcpy(static_cast<char*>(p) + r * stride, s.tile[T][r], s.config.colsb[T]);
  }
  template <int T>
  static void zero() {
    std::memset(state().tile[T], 0, sizeof(state().tile[T]));
  }
  template <int C, int A, int B>
  static void dot() {
    State& s = state();
    const int rows = s.config.rows[C], cols = s.config.colsb[C] / 4, pairs = s.config.colsb[A] / 4;
    for (int m = 0; m < rows; ++m)
      for (int k = 0; k < pairs; ++k) {
        uint32_t a;
        std::memcpy(&a, s.tile[A][m] + 4 * k, 4);
        const float a_lo = from_bf16(uint16_t(a)), a_hi = from_bf16(uint16_t(a >> 16));
        for (int n = 0; n < cols; ++n) {
          uint32_t b;
          float c;
          std::memcpy(&b, s.tile[B][k] + 4 * n, 4);
          std::memcpy(&c, s.tile[C][m] + 4 * n, 4);
          c += a_lo * from_bf16(uint16_t(b));
          c += a_hi * from_bf16(uint16_t(b >> 16));
          std::memcpy(s.tile[C][m] + 4 * n, &c, 4);
        }
      }
  }
};

// C[M, N] (+)= A[M rows of pair_rows() pairs, lda apart, zeros past pairs()]
// B on tiles: blocks of 32 rows (two tiles of A) by panels (two tiles of
// B), K by blocks of 16 pairs.  The whole blocks of 32 rows take a panel at
// a time, all of them, so that B passes once through the cache (an LSTM's
// W_hh at H=512 is 2 MiB: a pass per block of rows doubled a B=64 step's
// traffic); the rows past them follow, under their own tile configuration.
// A panel's C goes through `edge` where N cuts the panel (a tile's store
// writes all its 16 columns).
//
// In a bf16 LSTM's steps (B=32 H=256, x W_ih^T inside: 1 MB of pairs a step)
// this loop is ~63% of the call and issues a tdpbf16ps every ~37 cycles
// against the 16 it needs, its time on the loads of B.  Tried on the
// model-207 Xeon, each in one process against this loop (bits equal): B
// loaded with tileloaddt1 (no reuse) +2% / -1%; B prefetched 2, 4 or 8 KB
// ahead -1% to -9%; K in chunks of 32, 64 or 128 pairs so that A's chunk
// stays in L1 between panels -29%, -17%, level (C's extra store and load
// cost more than A's reloads).  None kept.
template <class Tiles>
RNNKERN_ALWAYS_INLINE void run_tiles(int64_t M, const uint32_t* a, int64_t lda, const PackedPairs& b,
                                     float* c, int64_t ldc, bool accumulate) {
  const int64_t KB = b.pair_rows() / kTilePairs, P = b.panels();
  const int64_t sa = lda * 4, sb = kNR * 4;
  alignas(64) float edge[32 * kNR];
  // Rows [i, i + r0 + r1) of C, panel p.
  auto block = [&](int64_t i, int r0, int r1, int64_t p) {
    const int r = r0 + r1;
    const uint32_t* a0 = a + i * lda;
    const uint32_t* a1 = a0 + 16 * lda;
    const int64_t nc = std::min<int64_t>(kNR, b.N - p * kNR);
    float* cp = c + i * ldc + p * kNR;
    float* ct = cp;
    int64_t ldt = ldc;
    if (nc < kNR) {  // the panel's C through `edge`, 32 columns a row
      ct = edge, ldt = kNR;
      if (accumulate)
        for (int rr = 0; rr < r; ++rr) {
          std::memcpy(edge + rr * kNR, cp + rr * ldc, nc * 4);
          std::memset(edge + rr * kNR + nc, 0, (kNR - nc) * 4);
        }
    }
    const int64_t sc = ldt * 4;
    if (accumulate) {
      Tiles::template load<0>(ct, sc);
      Tiles::template load<1>(ct + kLanes, sc);
      if (r1 > 0) {
        Tiles::template load<2>(ct + 16 * ldt, sc);
        Tiles::template load<3>(ct + 16 * ldt + kLanes, sc);
      }
    } else {
      Tiles::template zero<0>();
      Tiles::template zero<1>();
      if (r1 > 0) Tiles::template zero<2>(), Tiles::template zero<3>();
    }
    const uint32_t* bp = b.panel(p);
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint32_t* bk = bp + kb * kTilePairs * kNR;
      Tiles::template load<4>(a0 + kb * kTilePairs, sa);
      Tiles::template load<6>(bk, sb);
      Tiles::template load<7>(bk + kLanes, sb);
      Tiles::template dot<0, 4, 6>();
      Tiles::template dot<1, 4, 7>();
      if (r1 > 0) {
        Tiles::template load<5>(a1 + kb * kTilePairs, sa);
        Tiles::template dot<2, 5, 6>();
        Tiles::template dot<3, 5, 7>();
      }
    }
    Tiles::template store<0>(ct, sc);
    Tiles::template store<1>(ct + kLanes, sc);
    if (r1 > 0) {
      Tiles::template store<2>(ct + 16 * ldt, sc);
      Tiles::template store<3>(ct + 16 * ldt + kLanes, sc);
    }
    if (nc < kNR)
      for (int rr = 0; rr < r; ++rr) std::memcpy(cp + rr * ldc, edge + rr * kNR, nc * 4);
  };
  const int64_t whole = M / 32 * 32;
  if (whole > 0) {
    Tiles::configure(tile_config(16, 16));
    for (int64_t p = 0; p < P; ++p)
      for (int64_t i = 0; i < whole; i += 32) block(i, 16, 16, p);
  }
  if (whole < M) {
    const int r = static_cast<int>(M - whole), r0 = std::min(r, 16);
    Tiles::configure(tile_config(r0, r - r0));
    for (int64_t p = 0; p < P; ++p) block(whole, r0, r - r0, p);
  }
  Tiles::release();
}

// A's rows as the tiles read them: pair_rows() pairs a row, zeros past
// pairs(), each row on a cache line's boundary (a copy where A's rows are not
// so already): a tile's row that straddles two lines loads at a third of the
// speed (1 KiB tiles from L1, this Xeon: 14.7 ns a load across lines, 2.2 ns
// on them).
template <class Tiles>
void run_tiles_padded(int64_t M, const uint32_t* a, int64_t lda, const PackedPairs& b, float* c,
                      int64_t ldc, bool accumulate) {
  const int64_t KP = b.pairs(), KPs = b.pair_rows();
  if (KP == KPs && reinterpret_cast<uintptr_t>(a) % 64 == 0 && (lda * 4) % 64 == 0)
    return run_tiles<Tiles>(M, a, lda, b, c, ldc, accumulate);
  thread_local std::vector<uint32_t, gemm::UninitAllocator<uint32_t>> padded;
  if (static_cast<int64_t>(padded.size()) < M * KPs) padded.resize(static_cast<size_t>(M * KPs));
  for (int64_t m = 0; m < M; ++m) {
    std::memcpy(padded.data() + m * KPs, a + m * lda, static_cast<size_t>(KP) * 4);
    std::memset(padded.data() + m * KPs + KP, 0, static_cast<size_t>(KPs - KP) * 4);
  }
  run_tiles<Tiles>(M, padded.data(), KPs, b, c, ldc, accumulate);
}

#if defined(RNNKERN_PAIRS_NATIVE)
__attribute__((noinline)) void run_amx(int64_t M, const uint32_t* a, int64_t lda,
                                       const PackedPairs& b, float* c, int64_t ldc, bool accumulate) {
  run_tiles_padded<AmxTiles>(M, a, lda, b, c, ldc, accumulate);
}
#endif

__attribute__((noinline)) void run_tiles_emulated(int64_t M, const uint32_t* a, int64_t lda,
                                                  const PackedPairs& b, float* c, int64_t ldc,
                                                  bool accumulate) {
  run_tiles_padded<EmulatedTiles>(M, a, lda, b, c, ldc, accumulate);
}

// C[M, N] (+)= A[M rows of pairs, lda apart] B by the process's mode.
void run_mode(int64_t M, const uint32_t* a, int64_t lda, const PackedPairs& b, float* c,
              int64_t ldc, bool accumulate) {
  if (M <= 0) return;
  switch (mode()) {
#if defined(RNNKERN_PAIRS_NATIVE)
    case Mode::Native: return run_native(M, a, lda, b, c, ldc, accumulate);
    case Mode::Tiles: return run_amx(M, a, lda, b, c, ldc, accumulate);
#endif
    case Mode::TilesEmulated: return run_tiles_emulated(M, a, lda, b, c, ldc, accumulate);
    default: return run_emulated(M, a, lda, b, c, ldc, accumulate);
  }
}

// A row of K contiguous floats as (K + 1) / 2 pairs, compiled per ISA level:
// the per-step products convert the whole state every step (B x H floats).
RNNKERN_CPU_CLONES void floats_to_pairs(int64_t K, const float* __restrict a, uint32_t* __restrict dst) {
  const int64_t whole = K / 2;
  for (int64_t kp = 0; kp < whole; ++kp)
    dst[kp] = to_bf16(a[2 * kp]) | uint32_t(to_bf16(a[2 * kp + 1])) << 16;
  if (K % 2 != 0) dst[whole] = to_bf16(a[K - 1]);
}


// A^T of a row-major matrix as rows of pairs (the weight gradients' dY^T, K
// = the call's rows): dst[m][kp] = (a[2kp][m], a[2kp + 1][m]), m < M, for
// rows 2kp of `a` a_ks apart; compiled per ISA level.  A pair's halves lie in
// two rows of `a`: kQ pairs' row segments are read along m, in cache lines,
// and interleaved into `lines` (vectorised), then `lines` is transposed into
// dst by register tiles of kQ x kQ, the rows two groups ahead prefetched.  A
// scalar scatter of each pair to its row, and a call per pair's rows, made
// dW = dY^T X of M=4096 rows, 1024 x 256 (an LSTM's dW_ih at B=32 T=128
// H=256; Zen 4) 1.19x the time of the forward product of that size at one
// thread (12.6 ms), 1.28x at two (7.7 ms); now 1.12x (11.8-12.4 ms) and 1.10x
// (6.0-6.4 ms).
template <typename Src>
RNNKERN_CPU_CLONES void transposed_to_pairs(int64_t M, int64_t K, const Src* a, int64_t a_ks,
                                            uint32_t* __restrict dst) {
  constexpr int64_t kQ = gemm::kTileLanes<uint32_t>;
  const int64_t KP = (K + 1) / 2;
  thread_local std::vector<uint32_t> lines;  // kQ pairs' lines of M: 3 KiB in gemm's blocks
  if (static_cast<int64_t>(lines.size()) < kQ * M) lines.resize(static_cast<size_t>(kQ * M));
  uint32_t* __restrict lq = lines.data();
  for (int64_t kp0 = 0; kp0 < KP; kp0 += kQ) {
    const int64_t q1 = std::min(kQ, KP - kp0);
    for (int64_t q = 0; q < q1; ++q) {
      const int64_t k = 2 * (kp0 + q);
      const Src* __restrict lo = a + k * a_ks;
      if (k + 4 * kQ + 1 < K)  // two groups ahead
        for (int64_t off = 0; off < M * int64_t(sizeof(Src)); off += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(lo + 4 * kQ * a_ks) + off);
          __builtin_prefetch(reinterpret_cast<const char*>(lo + (4 * kQ + 1) * a_ks) + off);
        }
      uint32_t* __restrict line = lq + q * M;
      if (k + 1 < K) {
        const Src* __restrict hi = lo + a_ks;
        for (int64_t m = 0; m < M; ++m)
          line[m] = PackedPairs::bits(lo[m]) | uint32_t(PackedPairs::bits(hi[m])) << 16;
      } else {
        for (int64_t m = 0; m < M; ++m) line[m] = PackedPairs::bits(lo[m]);
      }
    }
    uint32_t* d = dst + kp0;
    int64_t m = 0;
    if (q1 == kQ)
      for (; m + kQ <= M; m += kQ) gemm::transpose_tile(lq + m, M, d + m * KP, KP);
    for (; m < M; ++m)
      for (int64_t q = 0; q < q1; ++q) d[m * KP + q] = lq[q * M + m];
  }
}

// The pairs of B[k][n] = b[k*sk + n*sn] into PackedPairs' panels (data:
// panels() x KPs (its pair_rows()) x kNR), every element written, zeros past
// N, past an odd K and past the pairs; compiled per ISA level.  Rows of B contiguous (sn = 1): a pair's
// halves two rows apart, panel by panel with contiguous inner loops.  B = W^T
// of a row-major W (sk = 1): a pair's halves neighbours in a row of W, so a
// row's pairs are read as they lie (bf16 bits) or made from its floats, and
// the [N, K/2] matrix of pairs is transposed by tiles (gemm::transpose_tile):
// one pair at a time, the per-call packing of a one-step call's weights (a
// bf16 cell's two products) cost more than the products.
template <typename Src>
RNNKERN_CPU_CLONES void pack_pairs(const Src* b, int64_t sk, int64_t sn, int64_t K, int64_t N,
                                   int64_t KPs, uint32_t* data) {
  const int64_t KP = (K + 1) / 2, panels = (N + kNR - 1) / kNR;
  constexpr int64_t kTile = gemm::kTileLanes<uint32_t>;
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * kNR, nc = std::min<int64_t>(kNR, N - n0);
    uint32_t* dst = data + p * KPs * kNR;
    std::memset(dst + KP * kNR, 0, static_cast<size_t>((KPs - KP) * kNR) * 4);
    int64_t kp = 0;
    if (sn == 1) {
      for (; kp < KP; ++kp) {
        uint32_t* d = dst + kp * kNR;
        const Src* lo = b + 2 * kp * sk + n0;
        if (2 * kp + 1 < K) {
          const Src* hi = lo + sk;
          for (int64_t l = 0; l < nc; ++l) d[l] = PackedPairs::bits(lo[l]) | uint32_t(PackedPairs::bits(hi[l])) << 16;
        } else {
          for (int64_t l = 0; l < nc; ++l) d[l] = PackedPairs::bits(lo[l]);
        }
        for (int64_t l = nc; l < kNR; ++l) d[l] = 0u;
      }
      continue;
    }
    if (sk == 1 && nc == kNR) {
      for (; kp + kTile <= K / 2; kp += kTile) {
        for (int64_t c = 0; c < kNR; c += kTile) {
          uint32_t tile[kTile * kTile];  // row i: the kTile pairs of W's row n0 + c + i
          for (int64_t i = 0; i < kTile; ++i) {
            const Src* w = b + (n0 + c + i) * sn + 2 * kp;
            if constexpr (std::is_same_v<Src, uint16_t>) {
              std::memcpy(tile + i * kTile, w, kTile * sizeof(uint32_t));  // little-endian pairs
            } else {
              for (int64_t j = 0; j < kTile; ++j)
                tile[i * kTile + j] = to_bf16(w[2 * j]) | uint32_t(to_bf16(w[2 * j + 1])) << 16;
            }
          }
          gemm::transpose_tile(tile, kTile, dst + kp * kNR + c, kNR);
        }
      }
    }
    for (; kp < KP; ++kp)
      for (int64_t l = 0; l < kNR; ++l)
        dst[kp * kNR + l] = l < nc ? PackedPairs::pair_of(b + (n0 + l) * sn, 2 * kp, K, sk) : 0u;
  }
}

// Rows [0, M) of A, columns [0, K): A[m][k] = a[m*a_rows + k*a_ks] (float or
// bf16 bits), as rows of (K + 1) / 2 pairs.
template <typename Src>
void rows_to_pairs(int64_t M, int64_t K, const Src* a, int64_t a_rows, int64_t a_ks, uint32_t* dst) {
  const int64_t KP = (K + 1) / 2;
  if (a_rows == 1 && a_ks != 1) return transposed_to_pairs(M, K, a, a_ks, dst);
  if (a_ks == 1) {
    if constexpr (std::is_same_v<Src, float>) {
      for (int64_t m = 0; m < M; ++m) floats_to_pairs(K, a + m * a_rows, dst + m * KP);
    } else {  // bf16 bits: a row's pairs are its bytes (little-endian: element 2kp low)
      for (int64_t m = 0; m < M; ++m) {
        std::memcpy(dst + m * KP, a + m * a_rows, static_cast<size_t>(K / 2) * 4);
        if (K % 2 != 0) dst[m * KP + K / 2] = a[m * a_rows + K - 1];
      }
    }
    return;
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t kp = 0; kp < KP; ++kp)
      dst[m * KP + kp] = PackedPairs::pair_of(a + m * a_rows, 2 * kp, K, a_ks);
}

Mode initial_mode() {
  // RNNKERN_CPU_BF16_PRODUCTS=float32 keeps the float32 products on a CPU
  // with the instruction (A/B timings), as RNNKERN_CPU_VECTOR_BITS=256 does
  // for the vector width.
  const char* env = std::getenv("RNNKERN_CPU_BF16_PRODUCTS");
  const std::string want = env != nullptr ? env : "";
  if (want == "float32") return Mode::Float32;
  if (want == "emulated") return Mode::Emulated;
  if (want == "native" && native_available()) return Mode::Native;
  if (want == "amx_emulated") return Mode::TilesEmulated;
  return tiles_available() ? Mode::Tiles : native_available() ? Mode::Native : Mode::Float32;
}

std::atomic<int>& mode_slot() {
  static std::atomic<int> slot{static_cast<int>(initial_mode())};
  return slot;
}

// Blocking of gemm: K in chunks of kKC (256 pairs: a panel's chunk is 32 KiB),
// rows of A converted kRowBlock at a time (96 rows x 256 pairs: 96 KiB, in L2).
constexpr int64_t kKC = kChunk;
constexpr int64_t kRowBlock = 12 * kMR;
// A transposed (the weight gradients' dY^T, a column of a row-major [K, M]
// matrix a row: transposed_to_pairs) past kSweepBytes: each block of rows is
// a strided sweep over all of K, reading its few lines of each of K rows
// from memory, so kSweepRowBlock rows a block -- a third of the sweeps.
// dW = dY^T X on this Xeon (AMX, one thread, separate processes alternated,
// medians): M=1024 K=4096 N=256 (an LSTM's dW_ih at B=32 T=128 H=256, 8 MB)
// 3.9 -> 3.4 ms, M=2048 K=4096 N=512 13.2 -> 11.4 ms, M=768 K=8192 5.6 ->
// 5.2 ms, M=512 K=4096 N=128 (4 MB) 1.28 -> 1.20 ms; at 2 MB (M=1024
// K=1024) 5% slower: there the sweeps stay in L2.
constexpr int64_t kSweepBytes = int64_t(2) << 20;
constexpr int64_t kSweepRowBlock = 32 * kMR;
// B's columns in blocks of kColumnBlockBytes where a chunk of B as pairs
// takes more: each block of rows streams all of a chunk's panels, which came
// from L3 for every block of rows; a block of columns stays in L2 for all the
// rows of a worker, at the price of converting A's rows once per block of
// columns.  rnnkern::linear on this Xeon (AMX, L2 2 MB; the same process,
// interleaved, the fastest of 11, one thread, whole chunk -> blocks of 1 MB):
// M=4096 K=512 N=2048 (an LSTM's input projection at B=64 T=64 H=512: a 2 MB
// chunk) 12.3 -> 10.4 ms, M=2048 K=512 N=3072 10.3 -> 8.2, M=8192 K=512
// N=2048 25.5 -> 20.7, M=4096 K=1024 N=3072 38.7 -> 35.8; blocks of 256 and
// 512 KB converted A's rows more often and gained less or lost.  Two
// threads: 12.9 -> 12.5, 10.4 -> 9.9, 27.5 -> 23.0, and 39.1 -> 41.2 ms.
constexpr int64_t kColumnBlockBytes = int64_t(1) << 20;

// Columns per block of B (a multiple of kNR, so that its panels are the
// whole B's: the same sums), N where a chunk of B is within
// kColumnBlockBytes, A has one block of rows, or A's rows are a strided
// sweep (kSweepRowBlock: converting them again per block of columns would
// repeat the sweeps from memory; not measured).
int64_t column_block(int64_t M, int64_t N, int64_t K, int64_t row_block) {
  if (row_block == kSweepRowBlock) return N;
  const int64_t chunk_pairs = (std::min(K, kKC) + 1) / 2;
  const int64_t panel_bytes =
      (chunk_pairs + kTilePairs - 1) / kTilePairs * kTilePairs * kNR * int64_t(sizeof(uint32_t));
  const int64_t panels = (N + kNR - 1) / kNR;
  if (M <= row_block || panels * panel_bytes <= kColumnBlockBytes) return N;
  return std::max<int64_t>(1, kColumnBlockBytes / panel_bytes) * kNR;
}

}  // namespace

RNNKERN_CPU_CLONES void narrow_bf16(int64_t n, const float* __restrict src, uint16_t* __restrict dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = to_bf16(src[j]);
}

RNNKERN_CPU_CLONES void round_to_bf16(int64_t n, const float* __restrict src, float* __restrict dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = from_bf16(to_bf16(src[j]));
}

RNNKERN_CPU_CLONES void widen_bf16(int64_t n, const uint16_t* __restrict src, float* __restrict dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = from_bf16(src[j]);
}

bool native_available() {
#if defined(RNNKERN_PAIRS_NATIVE)
  __builtin_cpu_init();
  return __builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// AMX-BF16 in CPUID, and the tile data state granted to this process by the
// kernel (Linux 5.16 and later; asked once, for all threads).
bool tiles_available() {
#if defined(RNNKERN_PAIRS_NATIVE) && defined(__linux__)
  static const bool granted = [] {
    __builtin_cpu_init();
    if (!native_available() || !__builtin_cpu_supports("amx-tile") ||
        !__builtin_cpu_supports("amx-bf16"))
      return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

Mode mode() { return static_cast<Mode>(mode_slot().load(std::memory_order_relaxed)); }

bool set_mode(Mode m) {
  if (m == Mode::Native && !native_available()) return false;
  if (m == Mode::Tiles && !tiles_available()) return false;
  mode_slot().store(static_cast<int>(m), std::memory_order_relaxed);
  return true;
}

namespace {

template <typename Src>
void multiply_rows(int64_t M, const Src* a, int64_t lda, const PackedPairs& b, float* c,
                   int64_t ldc, bool accumulate) {
  if (M <= 0) return;
  if constexpr (std::is_same_v<Src, uint16_t>) {
    // Rows of bf16 values whose pairs are in place: a row of K (even) values
    // is its K / 2 pairs (little-endian, element 2kp in the low half).
    if (b.K % 2 == 0 && lda == b.K && reinterpret_cast<uintptr_t>(a) % alignof(uint32_t) == 0)
      return run_mode(M, reinterpret_cast<const uint32_t*>(a), lda / 2, b, c, ldc, accumulate);
  }
  // grown as needed and kept: no allocation per step; on cache lines (the tiles)
  thread_local std::vector<uint32_t, gemm::UninitAllocator<uint32_t>> rows;
  rows.resize(std::max<size_t>(rows.size(), static_cast<size_t>(M * b.pairs())));
  rows_to_pairs(M, b.K, a, lda, 1, rows.data());
  run_mode(M, rows.data(), b.pairs(), b, c, ldc, accumulate);
}

}  // namespace

void multiply(int64_t M, const float* a, int64_t lda, const PackedPairs& b, float* c, int64_t ldc,
              bool accumulate) {
  multiply_rows(M, a, lda, b, c, ldc, accumulate);
}

void multiply(int64_t M, const uint16_t* a, int64_t lda, const PackedPairs& b, float* c,
              int64_t ldc, bool accumulate) {
  multiply_rows(M, a, lda, b, c, ldc, accumulate);
}

namespace {

// gemm's driver, C float32 (c) or rounded to bf16 as each block of rows is
// done (c16; not accumulating): a float32 copy of the whole C, converted
// afterwards, cost a write and a read of twice C's bytes (the input
// projection's output is a call's largest tensor).
template <typename SrcA, typename SrcB>
void gemm_impl(int64_t M, int64_t N, int64_t K, const SrcA* a, int64_t a_rows, int64_t a_ks,
               const SrcB* b, int64_t b_ks, int64_t b_ns, float* c, uint16_t* c16, int64_t ldc,
               bool accumulate) {
  if (c16 != nullptr) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {  // an empty sum: zeros (bf16 +0 is all bits clear)
      for (int64_t i = 0; i < M; ++i) std::memset(c16 + i * ldc, 0, static_cast<size_t>(N) * 2);
      return;
    }
  } else if (gemm::settle_empty_product(M, N, K, c, ldc, accumulate)) {
    return;
  }
  const int64_t chunks = (K + kKC - 1) / kKC;
  // On the tiles at most one worker per kTileRows rows: split finer, each
  // worker streams all of B for half the products per tile load (a bf16
  // LSTMCell's x W_ih^T at B=16 on two threads went to two workers of 8).
  const int64_t worker_rows = mode() == Mode::Tiles ? kTileRows : kMR;
  const int64_t threads =
      std::min(product_threads(M * N * K), std::max(chunks, (M + worker_rows - 1) / worker_rows));
  // Whole blocks of kMR rows per thread (parallel.h).  Each element of C sums
  // its pairs chunk by chunk in order, each chunk's in order: neither the
  // split nor the blocks of columns change its bits.
  const RowSplit split(M, kMR, threads);
  const int64_t row_block = a_rows == 1 && a_ks != 1 && K * a_ks * int64_t(sizeof(SrcA)) > kSweepBytes
                                ? kSweepRowBlock
                                : kRowBlock;
  const int64_t cols = column_block(M, N, K, row_block);
  const int64_t col_blocks = (N + cols - 1) / cols;
  // packed[ch * col_blocks + cb]: chunk ch of K, block cb of N.
  const int64_t pieces = chunks * col_blocks;
  std::vector<PackedPairs> packed(static_cast<size_t>(pieces));
  for_each_worker(std::min(threads, pieces), [&](int64_t t) {
    for (int64_t q = t; q < pieces; q += std::min(threads, pieces)) {
      const int64_t k0 = q / col_blocks * kKC, n0 = q % col_blocks * cols;
      packed[q].pack(b + k0 * b_ks + n0 * b_ns, b_ks, b_ns, std::min(kKC, K - k0), std::min(cols, N - n0));
    }
  });
  for_each_worker(split.workers, [&](int64_t t) {
    // A's rows copied into pairs block by block even where they are their
    // own pairs (bf16 rows of even K, as multiply_rows reads in place): read
    // in place from memory, the products ran slower than the copy costs
    // (a bf16 RNN's training call, B=32 T=128 H=256, Zen 5: the products
    // 3.4% of the call longer, the copies 2% of it).
    std::vector<uint32_t, gemm::UninitAllocator<uint32_t>> rows(static_cast<size_t>(row_block * (kKC / 2)));
    std::vector<float> block(c16 != nullptr ? static_cast<size_t>(row_block * cols) : 0);
    const int64_t r1 = split.begin(t + 1);
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      const int64_t n0 = cb * cols, nc = std::min(cols, N - n0);
      for (int64_t i = split.begin(t); i < r1; i += row_block) {
        const int64_t m = std::min(row_block, r1 - i);
        float* ci = c16 != nullptr ? block.data() : c + i * ldc + n0;
        const int64_t ldci = c16 != nullptr ? nc : ldc;
        for (int64_t ch = 0; ch < chunks; ++ch) {
          const PackedPairs& bc = packed[ch * col_blocks + cb];
          rows_to_pairs(m, bc.K, a + i * a_rows + ch * kKC * a_ks, a_rows, a_ks, rows.data());
          run_mode(m, rows.data(), bc.pairs(), bc, ci, ldci, accumulate || ch > 0);
        }
        if (c16 != nullptr)
          for (int64_t r = 0; r < m; ++r) narrow_bf16(nc, ci + r * nc, c16 + (i + r) * ldc + n0);
      }
    }
  });
}

}  // namespace

template <typename Src>
void PackedPairs::pack(const Src* b, int64_t sk, int64_t sn, int64_t K_, int64_t N_) {
  K = K_;
  N = N_;
  data.resize(static_cast<size_t>(panels() * pair_rows() * kNR));
  pack_pairs(b, sk, sn, K, N, pair_rows(), data.data());
}

template void PackedPairs::pack<float>(const float*, int64_t, int64_t, int64_t, int64_t);
template void PackedPairs::pack<uint16_t>(const uint16_t*, int64_t, int64_t, int64_t, int64_t);

template <typename SrcA, typename SrcB>
void gemm(int64_t M, int64_t N, int64_t K, const SrcA* a, int64_t a_rows, int64_t a_ks,
          const SrcB* b, int64_t b_ks, int64_t b_ns, float* c, int64_t ldc, bool accumulate) {
  gemm_impl(M, N, K, a, a_rows, a_ks, b, b_ks, b_ns, c, nullptr, ldc, accumulate);
}

template <typename Src>
void gemm_to_bf16(int64_t M, int64_t N, int64_t K, const Src* a, int64_t a_rows, int64_t a_ks,
                  const Src* b, int64_t b_ks, int64_t b_ns, uint16_t* c, int64_t ldc) {
  gemm_impl(M, N, K, a, a_rows, a_ks, b, b_ks, b_ns, nullptr, c, ldc, false);
}

template void gemm_to_bf16<uint16_t>(int64_t, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                                     const uint16_t*, int64_t, int64_t, uint16_t*, int64_t);
template void gemm<float>(int64_t, int64_t, int64_t, const float*, int64_t, int64_t, const float*,
                          int64_t, int64_t, float*, int64_t, bool);
template void gemm<uint16_t>(int64_t, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                             const uint16_t*, int64_t, int64_t, float*, int64_t, bool);
template void gemm<uint16_t, float>(int64_t, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                                    const float*, int64_t, int64_t, float*, int64_t, bool);
template void gemm<float, uint16_t>(int64_t, int64_t, int64_t, const float*, int64_t, int64_t,
                                    const uint16_t*, int64_t, int64_t, float*, int64_t, bool);

}  // namespace rnnkern::cpu::pairs

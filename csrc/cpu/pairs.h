// bfloat16 products on the bf16 dot-product instruction (AVX512_BF16's
// vdpbf16ps): each float32 lane of C gains a[k] b[k] + a[k+1] b[k+1] per
// instruction, from bf16 pairs (k, k+1) of both operands, accumulating in
// float32.  Twice the multiply-adds of a float32 FMA per instruction, half
// the bytes of the weights: what oneDNN runs for torch.nn's bf16 RNNs on the
// CPUs that have it (Zen 4 and 5, Intel Cooper Lake, Sapphire Rapids and
// later), where rnnkern's float32 products of bf16 values ran at half its
// speed.
//
// Used by the CPU backend for bfloat16 calls (pairs.cpp holds the choice):
//  * the recurrence's per-step products h_{t-1} W^T (products.h, step_gemm):
//    W packed into pairs once per call, the float32 state rounded to bf16
//    (round to nearest even): as the step writes it into the bf16 output
//    where that is the state (recurrence.h, rounds_rows_in_steps), else as
//    the product reads it; the state itself stays float32 between steps;
//  * the backward's per-step products dh += dA W (the float32 gate
//    gradients rounded to bf16, as oneDNN's bf16 backward keeps them: once,
//    as the step writes them, where rounds_rows_in_steps) and the weight
//    gradients dW_hh, dW_hr (gemm below);
//  * rnnkern::linear and its backward: the input projection x W_ih^T (x
//    and W_ih already bf16: exact pairs), dX and dW_ih.
// Calls of one step (the cells, a sequence of one step) too: their weights
// packed from their bf16 bits each call (PackedPairs::pack), which costs less
// than the float32 copies the float32 products would read.
//
// Layout: B[K, N] in column panels of kNR = 32 columns (two 16-lane
// vectors); panel p holds, for each pair kp, the 32 columns' pairs as uint32
// (low half b[2kp][n], high half b[2kp+1][n]), zero past N and past an odd K,
// and rows of zero pairs up to a multiple of kTilePairs.  A's rows become rows
// of pairs the same way.  Each element of C sums its pairs in order kp = 0,
// 1, ...: the split of rows between threads never changes its bits.
//
// That layout is also AMX's (Intel Sapphire Rapids and later): a tile of B
// is 16 pairs of 16 columns, a row per pair, 64 bytes each, read from half a
// panel with a stride of 128 bytes; a tile of A is up to 16 rows of 16 pairs,
// of C up to 16 rows of 16 floats.  One tdpbf16ps adds a 16 x 16 x 32
// product to a tile of C: 16 times the multiply-adds of a vdpbf16ps, which
// is what oneDNN runs torch.nn's bf16 RNNs on there (torch.nn 6x faster than
// rnnkern's vdpbf16ps for an LSTM at B=32 H=256).  The tile's order of the
// 32 products within a block of 16 pairs is the hardware's own (not the
// instruction's pseudocode order; within the float32 sums' error of it), the
// same for every row: blocks of K in order, so the split of rows between
// threads never changes a bit either.  Mode::Tiles runs it where the CPU has
// AMX-BF16 and Linux grants the process the tile state (arch_prctl); every
// product of a call on tiles, whatever its rows, since a choice by rows would
// make a row's bits depend on the thread split.
//
// Two versions of the same kernel: the instruction itself (compiled for
// x86-64-v4 + avx512bf16, run only on CPUs that report it), and an emulation
// of it in portable vector code, exact for normal numbers (the instruction
// adds the odd product then the even one, each product exact in float32; it
// also flushes denormals, which the emulation does not).  The emulation lets
// CPUs without the instruction (this project's CI) run and test every line of
// the layout, packing and drivers; it is never chosen by default.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm.h"  // UninitAllocator, transpose_tile

namespace rnnkern::cpu::pairs {

// How the CPU backend multiplies bfloat16 operands in this process:
//  * Float32: converted to float32, float32 products (CPUs without the
//    instruction, or chosen);
//  * Native: vdpbf16ps (the default where the CPU has it);
//  * Emulated: the emulation (tests);
//  * Tiles: AMX's tile multiply (tdpbf16ps; the default where the CPU has
//    AMX-BF16 and the kernel grants the process its tile state);
//  * TilesEmulated: the tile driver on a portable emulation of the tiles
//    (tests: its layout, padding and edges on every CPU).
enum class Mode { Float32, Native, Emulated, Tiles, TilesEmulated };
Mode mode();
// Sets the mode (rnnkern._C.set_cpu_bf16_products); false, and nothing
// changed, for Native on a CPU or build without the instruction.
bool set_mode(Mode m);
bool native_available();
bool tiles_available();

constexpr int kLanes = 16;
constexpr int kNR = 2 * kLanes;
// Pairs per tile row (64 bytes): a panel's pairs are padded with zeros to a
// multiple of it, so that AMX's tiles of B read whole blocks of K.
constexpr int kTilePairs = 16;
// Rows of C a block of tiles covers (two tiles of A, each of whose loads of B
// then serves two products): a worker of fewer rows loads each tile of B for
// one product.
constexpr int64_t kTileRows = 32;

// float32 -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN):
// c10::BFloat16's rounding, branch-free so that loops of it vectorise.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t nearest = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : nearest);
}

// dst[j] = src[j] rounded to bf16 (to_bf16), and bf16 bits widened to
// float32 (exact), n values; vectorised per ISA level (pairs.cpp).  Loops
// over a half type's values compiled for the baseline ISA ran 16 bytes at a
// time (the forward's bf16 xproj widened so: ~4% of an LSTM call).
void narrow_bf16(int64_t n, const float* src, uint16_t* dst);
void widen_bf16(int64_t n, const uint16_t* src, float* dst);
// dst[j] = src[j] rounded to bf16 (to_bf16), as float32: the value of
// narrow_bf16 then widen_bf16.
void round_to_bf16(int64_t n, const float* src, float* dst);

// A bfloat16 tensor's values as their bits, as the packing reads them.
inline const uint16_t* bf16_bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.const_data_ptr());
}

// bfloat16 bits -> float32 (exact: a bf16 value is the high half of its float).
inline float from_bf16(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// B[k][n] as bf16 pairs in panels (see the layout above).
struct PackedPairs {
  int64_t K = 0, N = 0;
  std::vector<uint32_t, gemm::UninitAllocator<uint32_t>> data;
  int64_t pairs() const { return (K + 1) / 2; }
  // A panel's rows of pairs: pairs() and zeros up to a multiple of kTilePairs.
  int64_t pair_rows() const { return (pairs() + kTilePairs - 1) / kTilePairs * kTilePairs; }
  int64_t panels() const { return (N + kNR - 1) / kNR; }
  const uint32_t* panel(int64_t p) const { return data.data() + p * pair_rows() * kNR; }

  // B[k][n] = b[k*sk + n*sn]; Src: float or uint16_t (bf16 bits).  Every
  // element written, padding included (pairs.cpp).
  template <typename Src>
  void pack(const Src* b, int64_t sk, int64_t sn, int64_t K_, int64_t N_);
  // B = W^T for a row-major W [N, K] (row n at w + n*ldw).
  template <typename Src>
  void pack_transposed(const Src* w, int64_t ldw, int64_t N_, int64_t K_) {
    pack(w, 1, ldw, K_, N_);
  }
  // B itself, row-major [K, N] (row k at b + k*ldb).
  template <typename Src>
  void pack_rows(const Src* b, int64_t ldb, int64_t K_, int64_t N_) {
    pack(b, ldb, 1, K_, N_);
  }

  static uint16_t bits(float v) { return to_bf16(v); }
  static uint16_t bits(uint16_t v) { return v; }
  // Elements k and k + 1 of a vector with stride s (the second zero past K).
  template <typename Src>
  static uint32_t pair_of(const Src* v, int64_t k, int64_t K, int64_t s = 1) {
    const uint32_t lo = bits(v[k * s]);
    const uint32_t hi = k + 1 < K ? bits(v[(k + 1) * s]) : 0u;
    return lo | hi << 16;
  }
};

// C[M, N] (+)= A[M, K] B for float32 rows of A (row m at a + m*lda), rounded
// to bf16 as they are read; C row-major, leading dimension ldc.  One thread.
void multiply(int64_t M, const float* a, int64_t lda, const PackedPairs& b, float* c, int64_t ldc,
              bool accumulate);
// The same for rows of A already bf16 (their bits; the backward's gate
// gradients as it rounds them once per step, BackwardArgs): their pairs are
// their bytes, read in place where a row holds B's K values (K even).
void multiply(int64_t M, const uint16_t* a, int64_t lda, const PackedPairs& b, float* c,
              int64_t ldc, bool accumulate);

// K per chunk of gemm: each element of C sums a chunk's pairs in order, then
// adds the chunk's sum to C's (a K of at most kChunk: one chain, as
// multiply's).
constexpr int64_t kChunk = 512;

// C[M, N] (+)= A[M, K] B[K, N] on all threads, A[m][k] = a[m*a_rows + k*a_ks],
// B[k][n] = b[k*b_ks + n*b_ns], of bf16 values (SrcA, SrcB = uint16_t: their
// bits; float: rounded to bf16 as read), C float32, row-major with leading
// dimension ldc: the large products (the input projection, dX, the weight
// gradients), blocked like linear.cpp's blocked_gemm: K in chunks, B packed
// once, rows split between the threads.  (Mode::Float32 is the caller's
// business.)
template <typename SrcA, typename SrcB = SrcA>
void gemm(int64_t M, int64_t N, int64_t K, const SrcA* a, int64_t a_rows, int64_t a_ks,
          const SrcB* b, int64_t b_ks, int64_t b_ns, float* c, int64_t ldc, bool accumulate);
// The same product, C rounded to bf16 (c: its bits) block of rows by block as
// it is done, without a float32 C: the same values as gemm then rounding.
template <typename Src>
void gemm_to_bf16(int64_t M, int64_t N, int64_t K, const Src* a, int64_t a_rows, int64_t a_ks,
                  const Src* b, int64_t b_ks, int64_t b_ns, uint16_t* c, int64_t ldc);

}  // namespace rnnkern::cpu::pairs

// The CPU recurrence's per-step products: a slice of the gate-stacked
// weights, packed or read in place, times the state rows (gemm.h), and the
// pointers into tensors that the drivers pass around.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <type_traits>

#include "gemm.h"
#include "isa.h"
#include "pairs.h"
#include "schedule.h"

namespace rnnkern::cpu {

// Rows of a [G*H, K] gate-stacked weight for the units of one slice: [G*n, K].
inline Tensor gate_rows(const Tensor& w, int64_t G, const Slice& s) {
  return w.view({G, w.size(0) / G, w.size(1)}).narrow(1, s.j0, s.n).reshape({G * s.n, w.size(1)}).contiguous();
}

// Outputs and scratch buffers.
template <typename A>
A* ptr(const Tensor& t) {
  return t.defined() ? t.template data_ptr<A>() : nullptr;
}

// Inputs, read only: a const pointer leaves a copy-on-write input (the output
// the autograd formula saves, rnnkern/ops.py) shared; data_ptr() would copy it.
template <typename A>
const A* cptr(const Tensor& t) {
  return t.defined() ? t.template const_data_ptr<A>() : nullptr;
}

// The fewest batch rows a worker split by rows takes (Split's min_rows).  A
// call of one step on AMX's tiles is mostly the packing of its weights (one
// thread) and each worker's stream of all of W for its rows: split below a
// block of tiles' rows it ran slower than on one thread where W_hh as pairs
// has 64 KB or more (bf16, B=16, this Xeon, two threads, the two alternated
// five times: LSTMCell H=256 186 -> 143 us, H=128 62 -> 40 us, RNNCell H=256
// 50 -> 36 us); with less, the two workers gain (LSTMCell H=64 24.1 us, 25.7
// on one; RNNCell H=128 23.1, 24.2).
inline int64_t min_rows_per_worker(const RecurrenceSizes& z, bool bf16_products) {
  const int64_t w_hh_bytes = z.G * z.H * z.P * int64_t(sizeof(uint16_t));
  return z.T == 1 && bf16_products && pairs::mode() == pairs::Mode::Tiles &&
                 w_hh_bytes >= (int64_t(64) << 10)
             ? pairs::kTileRows
             : kMinRowsPerThread;
}

// The forward's per-step product  C[M, cols] (+)= A[M, K] W_s^T, where W_s is
// rows [j0, j0 + n) of each of `blocks` gate blocks of a row-major
// [blocks*H, K] weight (one unit slice's gates, in gate order).  A bfloat16
// call's weight (bf16 values held as float) may be packed as bf16 pairs
// instead (pairs.h): the product then rounds the rows of A to bf16.
template <typename A>
struct StepWeightT {
  bool in_place = false;
  // in_place, a float16 weight (its bits) where w would be its float32 copy:
  // converted as the product loads it (gemm::multiply_nt_half),
  // for fewer than gemm::kMinBroadcastRows batch rows.
  const uint16_t* w_half = nullptr;
  bool bf16_pairs = false;
  gemm::PackedB<A> packed;  // !in_place && !bf16_pairs
  pairs::PackedPairs pair_panels;  // bf16_pairs
  const A* w = nullptr;     // in_place: the weight itself
  // in_place: the rows of the whole batch, of which a call's A may be a block
  // (a split between threads): they pick multiply_nt_rows' method, so that a
  // row's bits do not depend on the block it falls in.
  int64_t batch_rows = 0;
  int64_t K = 0, blocks = 0, H = 0, j0 = 0, n = 0;
  int64_t cols() const { return blocks * n; }
};

template <typename A>
RNNKERN_CPU_CLONES void step_gemm(int64_t M, const A* a, int64_t lda, const StepWeightT<A>& w,
                                  A* c, bool accumulate) {
  if constexpr (std::is_same_v<A, float>)
    if (w.bf16_pairs) return pairs::multiply(M, a, lda, w.pair_panels, c, w.cols(), accumulate);
  if (!w.in_place) {
    gemm::multiply(M, a, gemm::StridesA{lda, 1}, w.packed, c, w.packed.N, accumulate, 0, -1,
                   /*step_product=*/true);
  } else {
    // The whole weight (its gate blocks contiguous) as one block, or the slice's
    // rows of each gate block.
    const bool whole = w.n == w.H;
    for (int64_t g = 0; g < (whole ? 1 : w.blocks); ++g) {
      const int64_t first = whole ? 0 : (g * w.H + w.j0) * w.K;  // the block's first value
      const int64_t n = whole ? w.blocks * w.H : w.n;
      A* cg = c + g * w.n;
      if constexpr (std::is_same_v<A, float>) {
        if (w.w_half != nullptr) {  // (multiply_nt_rows takes multiply_nt's path at these rows)
          gemm::multiply_nt_half(M, a, lda, w.w_half + first, w.K, n, w.K, cg, w.cols(), accumulate);
          continue;
        }
      }
      const A* rows = w.w + first;
      if (accumulate)
        gemm::multiply_nt(M, a, lda, rows, w.K, n, w.K, cg, w.cols(), true);
      else
        gemm::multiply_nt_rows(M, a, lda, rows, w.K, n, w.K, cg, w.cols(), w.batch_rows);
    }
  }
}

// The same product for rows of A already bf16 (their bits), W on pairs.
inline void step_gemm(int64_t M, const uint16_t* a, int64_t lda, const StepWeightT<float>& w,
                      float* c, bool accumulate) {
  TORCH_CHECK(w.bf16_pairs, "rnnkern internal: bf16 rows of A multiply bf16 pairs only");
  pairs::multiply(M, a, lda, w.pair_panels, c, w.cols(), accumulate);
}

// The backward's per-step B: packed or a view (PackedB), or for a bfloat16
// call bf16 pairs (the rows of A then rounded to bf16).
template <typename A>
struct StepWeightCols {
  bool bf16_pairs = false;
  gemm::PackedB<A> packed;         // !bf16_pairs
  pairs::PackedPairs pair_panels;  // bf16_pairs
};

// The backward's per-step product  C[M, N] (+)= A[M, K] B.
template <typename A>
RNNKERN_CPU_CLONES void step_gemm(int64_t M, const A* a, int64_t lda, const StepWeightCols<A>& b,
                                  A* c, bool accumulate) {
  if constexpr (std::is_same_v<A, float>)
    if (b.bf16_pairs) return pairs::multiply(M, a, lda, b.pair_panels, c, b.pair_panels.N, accumulate);
  gemm::multiply(M, a, gemm::StridesA{lda, 1}, b.packed, c, b.packed.N, accumulate, 0, -1,
                 /*step_product=*/true);
}

// The same product for rows of A already bf16 (their bits), B on pairs.
inline void step_gemm(int64_t M, const uint16_t* a, int64_t lda, const StepWeightCols<float>& b,
                      float* c, bool accumulate) {
  TORCH_CHECK(b.bf16_pairs, "rnnkern internal: bf16 rows of A multiply bf16 pairs only");
  pairs::multiply(M, a, lda, b.pair_panels, c, b.pair_panels.N, accumulate);
}

// W_s^T for hproj = h W_s^T: gate rows [j0, j0 + n) of a contiguous
// [G*H, K] weight; as bf16 pairs from its bits where bf16_pairs (w is then
// bfloat16: bindings.cpp's product_weight), packed at any T; else a call of
// one step keeps the weight in place, for a batch of batch_rows rows.
template <typename A>
StepWeightT<A> gate_rows_t(const Tensor& w, int64_t G, const Slice& sl, bool in_place,
                           int64_t batch_rows, bool bf16_pairs) {
  StepWeightT<A> s;
  s.in_place = in_place;
  s.batch_rows = batch_rows;
  if constexpr (std::is_same_v<A, float>) s.bf16_pairs = bf16_pairs && !in_place;
  s.K = w.size(1);
  s.blocks = G;
  s.H = w.size(0) / G;
  s.j0 = sl.j0;
  s.n = sl.n;
  TORCH_CHECK((w.scalar_type() == at::kBFloat16) == s.bf16_pairs,
              "rnnkern internal: the bf16 pair products take the bfloat16 weight, and only they");
  if (in_place && w.scalar_type() == at::kHalf) {
    TORCH_CHECK((std::is_same_v<A, float>) && batch_rows < gemm::kMinBroadcastRows,
                "rnnkern internal: a float16 weight is read in place by float32 products of fewer than ",
                gemm::kMinBroadcastRows, " rows");
    s.w_half = reinterpret_cast<const uint16_t*>(w.const_data_ptr());
  } else if (in_place) {
    s.w = cptr<A>(w);
  } else if (s.bf16_pairs) {
    s.pair_panels.pack_transposed(pairs::bf16_bits(gate_rows(w, G, sl)), s.K, G * sl.n, s.K);
  } else {
    s.packed.resize(s.K, G * sl.n);
    gemm::pack_panels(s.packed, cptr<A>(gate_rows(w, G, sl)), 1, s.K, 0, s.packed.panels());
  }
  return s;
}

// Columns [j0, j0 + n) of a contiguous [K, C] weight: the B of  dh = da W[:, slice];
// as bf16 pairs from its bits where bf16_pairs (w is then bfloat16), in
// place of either: the pairs are packed at any batch.
template <typename A>
StepWeightCols<A> weight_cols(const Tensor& w, const Slice& sl, bool in_place,
                              bool bf16_pairs = false) {
  StepWeightCols<A> b;
  TORCH_CHECK((w.scalar_type() == at::kBFloat16) == bf16_pairs,
              "rnnkern internal: the bf16 pair products take the bfloat16 weight, and only they");
  if (bf16_pairs) {
    b.bf16_pairs = true;
    b.pair_panels.pack_rows(pairs::bf16_bits(w) + sl.j0, w.size(1), w.size(0), sl.n);
    return b;
  }
  if (in_place) {
    b.packed = gemm::PackedB<A>::view_rows(cptr<A>(w) + sl.j0, w.size(0), sl.n, w.size(1));
  } else {
    b.packed.resize(w.size(0), sl.n);
    gemm::pack_panels(b.packed, cptr<A>(w) + sl.j0, w.size(1), 1, 0, b.packed.panels());
  }
  return b;
}

}  // namespace rnnkern::cpu

// The CPU recurrence's backward driver (BPTT).  Per step in reverse: one
// pass of the cell's pointwise backward (rows.h) that writes the gate
// gradients, then one GEMM  dH_{t-1} += dA W_hh.  The weight gradients are
// one large GEMM over all steps at the end, from the gate gradients and the
// h_{t-1} the pass collected in time order.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers: a much faster compile
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "buffers.h"
#include "linear.h"
#include "products.h"
#include "recurrence.h"
#include "rows.h"
#include "schedule.h"

namespace rnnkern::cpu {
namespace {

// dW = sum over steps and rows of d[p, b]^T h_{t-1}[p, b], where h_{t-1} of
// position p is the output one step earlier (p - 1, or p + 1 in reverse) and
// h0 at each sequence's first position.  Padding positions have d = 0 and
// output 0, so two GEMMs cover every case without gathering h_{t-1}:
//   forward:  d[1:]^T out[:-1] + d[0]^T h0
//   reverse:  d[:-1]^T out[1:] + sum_b d[len_b - 1, b]^T h0[b]
// With resets, a step that restarts its row started from the reset state
// (reset_h: h0 unless given) instead: a third GEMM over those positions alone
// (gathered) adds d^T (reset_h - h_{t-1}).
// d: [T, B, N] with unit stride along N (it may be a column slice),
// out: [T, B, P] and h0: [B, P] contiguous, dw: [N, P] with rows contiguous;
// resets: [T, B] or null.
// With lengths the [T, B] grid may be mostly padding (a packed batch of a few
// long and many short sequences): then the weight gradients' GEMMs run over
// the real positions alone, gathered into contiguous rows first (a copy of
// one row of each operand per position, where the GEMM multiplies each by a
// whole matrix).  Below four fifths of the grid real, say.
bool gathers_real_positions(const Positions& pos, int64_t T, int64_t B) {
  if (!pos.padded()) return true;  // packed rows: a row's earlier output is no fixed stride away
  if (!pos.lengths || T * B == 0) return false;
  int64_t real = 0;
  for (int64_t b = 0; b < B; ++b) real += pos.length(b);
  return real * 5 < T * B * 4;
}

// The weight gradients' products: blocked_gemm, or for a bfloat16 call
// (BackwardArgs::bf16_products) on bf16 pairs (pairs.h).
template <typename A>
void weight_product(bool bf16, int64_t M, int64_t N, int64_t K, const A* a, int64_t a_rows,
                    int64_t a_ks, const A* b, int64_t b_ks, int64_t b_ns, A* c, int64_t ldc,
                    bool accumulate) {
  if constexpr (std::is_same_v<A, float>)
    if (bf16) return pairs::gemm<float>(M, N, K, a, a_rows, a_ks, b, b_ks, b_ns, c, ldc, accumulate);
  blocked_gemm<A>(M, N, K, a, a_rows, a_ks, b, b_ks, b_ns, c, ldc, accumulate);
}

// C[N, P] (+)= sum over pairs (i, j) of d_i^T x_j: rows i of d (stride ld_d)
// and j of x (stride ld_x), gathered into contiguous blocks, one GEMM.
template <typename A>
void gathered_weight_gemm(bool bf16, int64_t N, int64_t P,
                          const std::vector<std::pair<int64_t, int64_t>>& pairs, const A* d,
                          int64_t ld_d, const A* x, int64_t ld_x, A* c, int64_t ldc,
                          bool accumulate, const at::TensorOptions& opt) {
  const int64_t R = static_cast<int64_t>(pairs.size());
  if (R == 0) {
    if (!accumulate)
      for (int64_t m = 0; m < N; ++m) zero_row(c + m * ldc, P);
    return;
  }
  Tensor dg = at::empty({R, N}, opt), xg = at::empty({R, P}, opt);
  for (int64_t i = 0; i < R; ++i) {
    copy_row(ptr<A>(dg) + i * N, d + pairs[i].first * ld_d, N);
    copy_row(ptr<A>(xg) + i * P, x + pairs[i].second * ld_x, P);
  }
  weight_product<A>(bf16, N, P, R, cptr<A>(dg), 1, N, cptr<A>(xg), P, 1, c, ldc, accumulate);
}

// The rows of the real positions (Positions::row), time-major.
std::vector<std::pair<int64_t, int64_t>> real_positions(const Positions& pos, int64_t T, int64_t B) {
  std::vector<std::pair<int64_t, int64_t>> rows;
  for (int64_t p = 0; p < T; ++p)
    for (int64_t b = 0; b < B; ++b)
      if (p < pos.length(b)) rows.emplace_back(pos.row(p, b), pos.row(p, b));
  return rows;
}

// d: the gradients of the N rows of W (unit stride, row stride ld) at every
// row of the layout (Positions::row), out: the output (row stride P) in
// float32, or undefined where out16 carries it (widened_output: the grid
// without resets, on pairs).
// d16: d rounded to bf16 (its bits, the same layout) where the backward
// rounded it (rounds_rows_in_steps), else null: the products read it in
// place of d, the same values their pairs would round d to; d is then null
// where the backward kept no float32 copy (the grid without lengths).  out16: the
// output's bf16 bits (BackwardArgs::output_bf16) or undefined: the main
// product's other operand with d16, the same values as out's.
template <typename A>
void weight_grad_by_prev_state(bool bf16, Tensor& dw, const A* d, const uint16_t* d16, int64_t ld,
                               int64_t N, const Tensor& out, const Tensor& out16,
                               const Tensor& h0, const Positions& pos, int64_t T, int64_t B,
                               const bool* resets, const Tensor& reset_h) {
  const int64_t P = (out.defined() ? out : out16).size(-1);
  A* c = ptr<A>(dw);
  if (T == 0 || B == 0) {
    dw.zero_();
    return;
  }
  TORCH_CHECK(d != nullptr || (bf16 && d16 != nullptr && !gathers_real_positions(pos, T, B)),
              "rnnkern internal: the weight gradient's rows in float32, or bf16 on the grid");
  TORCH_CHECK(out.defined() || (bf16 && out16.defined() && !gathers_real_positions(pos, T, B) &&
                                resets == nullptr),
              "rnnkern internal: the output in float32 but on pairs, on the grid, without resets");
  // Row `row` of d as float32: d16's values widened where d is null (the
  // products round them to the same pairs).
  auto copy_d_row = [&](A* dst, int64_t row) {
    if constexpr (std::is_same_v<A, float>)
      if (d == nullptr) return pairs::widen_bf16(N, d16 + row * ld, dst);
    copy_row(dst, d + row * ld, N);
  };
  if (gathers_real_positions(pos, T, B)) {
    // (d at p, output at the row's earlier position) for every real p but a row's first.
    std::vector<std::pair<int64_t, int64_t>> pairs;
    for (int64_t p = 0; p < T; ++p)
      for (int64_t b = 0; b < B; ++b) {
        const int64_t earlier = pos.reverse ? p + 1 : p - 1;
        if (p < pos.length(b) && earlier >= 0 && earlier < pos.length(b))
          pairs.emplace_back(pos.row(p, b), pos.row(earlier, b));
      }
    gathered_weight_gemm<A>(bf16, N, P, pairs, d, ld, cptr<A>(out), P, c, dw.stride(0), false,
                            out.options());
  } else {
    const int64_t later = pos.reverse ? 0 : B * ld;
    const int64_t earlier = pos.reverse ? B * P : 0;
    const int64_t K = (T - 1) * B;
    bool done = false;
    if constexpr (std::is_same_v<A, float>) {
      if (bf16) {
        const uint16_t* o16 = out16.defined() ? pairs::bf16_bits(out16) + earlier : nullptr;
        const int64_t ldc = dw.stride(0);
        if (d16 != nullptr && o16 != nullptr)
          pairs::gemm<uint16_t>(N, P, K, d16 + later, 1, ld, o16, P, 1, c, ldc, false);
        else if (d16 != nullptr)
          pairs::gemm<uint16_t, float>(N, P, K, d16 + later, 1, ld, cptr<A>(out) + earlier, P, 1,
                                       c, ldc, false);
        else if (o16 != nullptr)
          pairs::gemm<float, uint16_t>(N, P, K, d + later, 1, ld, o16, P, 1, c, ldc, false);
        done = d16 != nullptr || o16 != nullptr;
      }
    }
    if (!done)
      weight_product<A>(bf16, N, P, K, d + later, 1, ld, cptr<A>(out) + earlier, P, 1, c,
                        dw.stride(0), false);
  }
  // Each sequence's gradient at its first step, against h0.
  Tensor d_first = at::zeros({B, N}, h0.options());
  A* df = ptr<A>(d_first);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = pos.reverse ? pos.length(b) - 1 : (pos.length(b) > 0 ? 0 : -1);
    if (first >= 0) copy_d_row(df + b * N, pos.row(first, b));
  }
  weight_product<A>(bf16, N, P, B, df, 1, N, cptr<A>(h0), P, 1, c, dw.stride(0), true);
  if (resets == nullptr) return;
  std::vector<int64_t> restarted;  // p * B + b
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = pos.length(b);
    for (int64_t p = 0; p < n; ++p)
      if (resets[p * B + b] && p != (pos.reverse ? n - 1 : 0)) restarted.push_back(p * B + b);
  }
  if (restarted.empty()) return;
  const int64_t R = static_cast<int64_t>(restarted.size());
  Tensor d_r = at::empty({R, N}, h0.options()), x_r = at::empty({R, P}, h0.options());
  const A* o = cptr<A>(out);
  const A* h = cptr<A>(reset_h);
  for (int64_t i = 0; i < R; ++i) {
    const int64_t p = restarted[i] / B, b = restarted[i] % B;
    const A* earlier = o + pos.row(pos.reverse ? p + 1 : p - 1, b) * P;
    copy_d_row(ptr<A>(d_r) + i * N, pos.row(p, b));
    A* x = ptr<A>(x_r) + i * P;
    for (int64_t k = 0; k < P; ++k) x[k] = h[b * P + k] - earlier[k];
  }
  weight_product<A>(bf16, N, P, R, cptr<A>(d_r), 1, N, cptr<A>(x_r), P, 1, c, dw.stride(0), true);
}

// acc[j] += row[j], j < n, in double: a batch row's share of the bias
// gradients, added as a step's pointwise phase leaves its gate gradients
// (in cache).  Compiled per ISA level: a loop inside a worker's lambda is
// compiled for the baseline (two doubles an SSE2 instruction).  The floats
// are read 8 at a time: the row kernel has just stored them, and on a Zen 5
// (whose 512-bit stores are two 256-bit halves) the 512-bit loads GCC chose
// waited for those stores to retire (two thirds of this loop's samples on
// the load; a bf16 RNN's training call at B=32 T=128 H=256: 2.4% of it, 1.6%
// read by halves).
template <typename A>
RNNKERN_CPU_CLONES void add_to_sums(int64_t n, const A* __restrict row, double* __restrict acc) {
  int64_t j = 0;
  if constexpr (std::is_same_v<A, float>) {
    typedef float F8 __attribute__((vector_size(32)));
    typedef double D8 __attribute__((vector_size(64)));
    for (; j + 8 <= n; j += 8) {
      F8 f;
      D8 d;
      std::memcpy(&f, row + j, sizeof(f));
      std::memcpy(&d, acc + j, sizeof(d));
      d += __builtin_convertvector(f, D8);
      std::memcpy(acc + j, &d, sizeof(d));
    }
  }
  for (; j < n; ++j) acc[j] += static_cast<double>(row[j]);
}

// sum[j] = sum over b in order of acc[b * N + j], j < N.
void sum_rows(const std::vector<double>& acc, int64_t B, int64_t N, double* sum) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < N; ++j) sum[j] += acc[static_cast<size_t>(b * N + j)];
}

// acc += src; src = 0.
template <typename A>
void move_row(A* __restrict acc, A* __restrict src, int64_t n) {
  for (int64_t j = 0; j < n; ++j) acc[j] += src[j];
  zero_row(src, n);
}

// acc += src.
template <typename A>
void add_row(A* __restrict acc, const A* __restrict src, int64_t n) {
  for (int64_t j = 0; j < n; ++j) acc[j] += src[j];
}

}  // namespace

// ------------------------------------------------------------------------
// Backward driver.  Per step, each worker first adds the GEMM part of its
// carried dh (from the previous step's gate gradients, ping-pong buffered so
// that, split by units, no thread overwrites what another still reads), then
// runs its pointwise backward.
//
// Options, backward:
//  * resets: a restarting step's h_{t-1} (c_{t-1}) is the reset state
//    (reset_h, reset_c: h0, c0 unless given), in its pointwise backward and
//    in the weight gradients; the carry it leaves (direct part and, once the
//    next step has added it, GEMM part) is the gradient of that state: it
//    moves to d_reset_h (d_reset_c), or d_h0 (d_c0), and the carry goes on
//    from zero.
//  * zoneout: the row kernels split each state's gradient between the state
//    the step started from and the cell's update.
//  * lstm_ln: the carry's GEMM part by units, the layer norms' backward by
//    rows (as the forward, ln_product); the gate gradient the next GEMM and
//    dW_hh take is that of h_{t-1} W_hh^T (through LN_h), kept in time order.
template <typename A>
void backward_impl(const BackwardArgs<A>& a, Tensor& d_xproj, Tensor& d_h0, Tensor& d_c0,
                   Tensor& d_w_hh, Tensor& d_b_ih, Tensor& d_b_hh, Tensor& d_w_hr,
                   Tensor& d_ln, Tensor& d_reset_h, Tensor& d_reset_c, Tensor& d_xproj_bf16) {
  const RecurrenceSizes& z = a.z;
  const int64_t T = z.T, B = z.B, H = z.H, P = z.P, G = z.G;
  const int64_t GH = G * H;
  const int64_t W = workspace_size(z.cell, H, z.has_zoneout);  // per row and step
  const int64_t rows = z.packed_rows ? z.N : T * B;  // of the layout (Positions::row)
  const auto opt = a.h0.options();  // (the accumulate dtype's; output may be undefined)
  const bool lstm = has_cell_state(z.cell);
  const bool gru = z.cell == Cell::Gru;
  const bool reset_before = z.cell == Cell::GruResetBefore;
  const bool ln_cell = z.cell == Cell::LstmLn;
  const Options<A> opts = options_of<A>(z, a.resets, a.zoneout);
  const bool resets = opts.resets != nullptr, zone = opts.zone != nullptr;

  // The carried dh lives in per-worker buffers: over hidden units, or over
  // the projected outputs with a projection.
  const Split split(z, a.bf16_products ? sizeof(uint16_t) : sizeof(A), a.pos.lengths, 0,
                    min_rows_per_worker(z, a.bf16_products));
  const std::vector<Slice>& units = split.units;
  const std::vector<Slice>& carry = z.has_proj ? split.outs : split.units;
  const size_t unit_workers = split.unit_workers();
  const size_t carry_workers = z.has_proj ? split.out_workers() : unit_workers;
  auto carry_work = [&](size_t t) { return z.has_proj ? split.out_work(t) : split.unit_work(t); };
  // Rows of W_hh whose gradient feeds dh through the per-step GEMM: all, or
  // r, z for reset-before (the candidate's part goes through drh).
  const Tensor w_dh = reset_before ? a.w_hh.narrow(0, 0, 2 * H) : a.w_hh;
  std::vector<Tensor> dh, drh, dh_full;
  std::vector<StepWeightCols<A>> w_dh_cols, w_n_cols, w_r_cols;
  const bool in_place = split.weights_in_place(T);
  const bool bf16 = a.bf16_products;  // (its weights are bf16 then: see bindings.cpp)
  for (const Slice& sl : carry) w_dh_cols.push_back(weight_cols<A>(w_dh, sl, in_place, bf16));
  for (const Slice& sl : units) {
    if (reset_before)
      w_n_cols.push_back(weight_cols<A>(a.w_hh.narrow(0, 2 * H, H), sl, in_place, bf16));
    if (z.has_proj) w_r_cols.push_back(weight_cols<A>(a.w_hr, sl, in_place, bf16));
  }
  for (size_t t = 0; t < carry_workers; ++t) {
    const auto [r, ci, c] = carry_work(t);
    // a carry we update
    dh.push_back(a.grad_h_n.narrow(0, r.b0, r.nb).narrow(1, c.j0, c.n).clone(at::MemoryFormat::Contiguous));
  }
  for (size_t t = 0; t < unit_workers; ++t) {
    const auto [r, u, sl] = split.unit_work(t);
    if (reset_before) drh.push_back(at::empty({r.nb, sl.n}, opt));
    if (z.has_proj) dh_full.push_back(at::empty({r.nb, sl.n}, opt));
  }
  // With cell_steps grad_c_n is [T, B, H]: each step's part joins the carry
  // at that step (the pointwise phase), so the carry starts at zero.
  if (lstm) z.cell_steps ? d_c0.zero_() : d_c0.copy_(a.grad_c_n);
  const A* gc_steps = z.cell_steps ? cptr<A>(a.grad_c_n) : nullptr;
  // lstm_ln, per worker of the rows' phase (all split by rows, one split by
  // units): scratch, and split by units the row's carry gathered from the
  // slices.
  const size_t ln_row_workers = split.by_rows ? split.rows.size() : 1;
  // The parameters' sums per batch row (added up in row order at the end: no
  // sum's order depends on the split between threads).
  std::vector<double> ln_sum(ln_cell ? static_cast<size_t>(B * 14 * H) : 0, 0.0);
  // The other cells' bias gradients likewise: the gate gradients summed per
  // batch row as each step leaves them (and the reset-after GRU's dhn, its
  // candidate's hidden part).  A pass over d_xproj after the steps read it
  // back from memory in a parallel region of its own: 4-5% of a bf16 LSTM's
  // or GRU's training call at B=32 T=128 H=256 on two threads (Zen 5), which
  // now run 5-6% faster (float32 GRU 5%; level at one thread).  Each row's
  // sum runs over its steps in the backward's order, whichever worker owns
  // the row or the units.
  std::vector<double> gate_sum(ln_cell ? 0 : static_cast<size_t>(B * GH), 0.0);
  std::vector<double> hn_sum(gru ? static_cast<size_t>(B * H) : 0, 0.0);
  std::vector<Tensor> ln_scratch, ln_dh;
  for (size_t t = 0; ln_cell && t < ln_row_workers; ++t) {
    ln_scratch.push_back(at::empty({H}, opt));
    if (!split.by_rows) ln_dh.push_back(at::empty({H}, opt));
  }
  // Gate gradients of the step, the next step's GEMM input (ping-pong).
  const int64_t da_width = reset_before ? 2 * H : GH;
  // Without lengths every row of a step is at the same time position, so for
  // RNN and LSTM (da = dx) the step's rows of d_xproj are its da: no copy,
  // and the next step's GEMM reads what this step left in cache.  lstm_ln
  // keeps its da (the gradient of h W_hh^T) in time order for dW_hh: without
  // lengths that is the step's da likewise.
  const bool da_in_dx = !a.pos.lengths && !gru && !reset_before && !ln_cell;
  const bool da_in_dhp = !a.pos.lengths && ln_cell;
  Tensor dhp_all = ln_cell ? pooled_empty({rows, GH}, opt) : Tensor();
  // d_xproj rounded to bf16 as each step's pointwise phase leaves it
  // (rounds_rows_in_steps); where da is d_xproj's rows, the next step's
  // product reads the rounded rows as its pairs.
  uint16_t* dx16 = nullptr;
  if constexpr (std::is_same_v<A, float>) {
    if (rounds_rows_in_steps(z, a.bf16_products)) {
      d_xproj_bf16 = pooled_empty(layout_sizes(z, GH), opt.dtype(at::kBFloat16));
      dx16 = reinterpret_cast<uint16_t*>(d_xproj_bf16.data_ptr());
    }
  }
  const bool da16 = dx16 != nullptr && da_in_dx;
  // d_xproj, the gate gradients at every position (what dX, dW_ih and dW_hh
  // take).  Where the next step's product reads them rounded (da16), the
  // rounded rows are what every later reader takes (d_xproj_bf16: dW_hh and
  // the caller), and the float32 rows live one step, in one [B, GH] buffer
  // the step's worker reads back in cache (its bias sums, its rounding): a
  // tensor of the whole call was written and never read again (16 MB at
  // LSTM B=32 T=128 H=256).
  d_xproj = da16 ? pooled_empty({B, GH}, opt) : pooled_empty(layout_sizes(z, GH), opt);
  Tensor da[2];
  if (!da_in_dx && !da_in_dhp)
    da[0] = at::zeros({B, da_width}, opt), da[1] = at::zeros({B, da_width}, opt);
  auto da_of = [&](int64_t s) {
    return da_in_dx    ? ptr<A>(d_xproj) + (da16 ? 0 : a.pos.at(0, s) * B * GH)
           : da_in_dhp ? ptr<A>(dhp_all) + a.pos.at(0, s) * B * GH
                       : ptr<A>(da[s & 1]);
  };
  // dh(t) += da(s) W[:, carry slice c] for rows [b0, b0 + nb) live at step s.
  auto add_da_product = [&](int64_t s, int64_t b0, int64_t nb, size_t ci, const Tensor& dh_t) {
    const int64_t live = a.pos.live_rows(b0, nb, s);
    if constexpr (std::is_same_v<A, float>) {
      if (da16)
        return step_gemm(live, dx16 + a.pos.at(0, s) * B * GH + b0 * GH, GH, w_dh_cols[ci],
                         ptr<A>(dh_t), true);
    }
    step_gemm<A>(live, da_of(s) + b0 * da_width, da_width, w_dh_cols[ci], ptr<A>(dh_t), true);
  };
  // Time-ordered inputs of the final weight GEMMs, a row per row of the
  // layout (Positions::row).
  Tensor dhn_all = gru ? pooled_empty({rows, H}, opt) : Tensor();
  Tensor rh_all = reset_before ? pooled_empty({rows, H}, opt) : Tensor();
  Tensor dn = reset_before ? at::empty({B, H}, opt) : Tensor();
  Tensor dh_tot = z.has_proj ? at::empty({B, P}, opt) : Tensor();
  Tensor dh_tot_all = z.has_proj ? pooled_empty({rows, P}, opt) : Tensor();
  Tensor h_full_all = z.has_proj ? pooled_empty({rows, H}, opt) : Tensor();
  // With resets: the gradients of the reset state the restarting steps leave.
  Tensor dh0_acc = resets ? at::zeros({B, P}, opt) : Tensor();
  Tensor dc0_acc = resets && lstm ? at::zeros({B, H}, opt) : Tensor();

  A* dc = lstm ? ptr<A>(d_c0) : nullptr;
  A* dx = ptr<A>(d_xproj);
  const A* gout = cptr<A>(a.grad_output);
  const A* out = cptr<A>(a.output);
  // grad_output's and output's rows where the call passed them as bf16 only
  // (BackwardArgs): widened into the worker's buffer as a row kernel reads
  // them.
  const uint16_t* gout16 = a.grad_output_bf16.defined() ? pairs::bf16_bits(a.grad_output_bf16) : nullptr;
  const uint16_t* out16 = a.output.defined() ? nullptr : pairs::bf16_bits(a.output_bf16);
  TORCH_CHECK(a.grad_output.defined() != a.grad_output_bf16.defined() &&
                  (a.output.defined() || a.output_bf16.defined()),
              "rnnkern internal: grad_output and output in float32 or as bf16");
  // Columns [j0, j0 + n) of row `row` of a [rows, P] tensor, float32 (f) or
  // bf16 (f16), as A; slot 0 or 1 of the thread's buffer (a row kernel reads
  // two such rows at once).
  auto row_of = [&](const A* f, const uint16_t* f16, int64_t row, int64_t j0, int64_t n,
                    int slot) -> const A* {
    if (f != nullptr) return f + row * P + j0;
    thread_local std::vector<A> wide;
    if (static_cast<int64_t>(wide.size()) < 2 * P) wide.resize(static_cast<size_t>(2 * P));
    A* dst = wide.data() + slot * P;
    if constexpr (std::is_same_v<A, float>)
      pairs::widen_bf16(n, f16 + row * P + j0, dst);
    else
      TORCH_CHECK(false, "rnnkern internal: bf16 rows widen to float32 only");
    return dst;
  };
  const A* wsp = W > 0 ? cptr<A>(a.ws) : nullptr;
  const A* h0 = cptr<A>(a.h0);
  const A* c0 = lstm ? cptr<A>(a.c0) : nullptr;
  const A* reset_hp = cptr<A>(a.reset_h);
  const A* reset_cp = lstm ? cptr<A>(a.reset_c) : nullptr;
  const A* lnp = cptr<A>(a.ln);

  // h_{t-1} of row b at step s: its state one step earlier (c_{t-1}
  // likewise), or h0 at its first step (q = -1), the reset state where it
  // restarts (q = -2).
  auto prev_pos = [&](int64_t b, int64_t s) {
    return s == 0                             ? int64_t(-1)
           : opts.restart(a.pos.at(b, s), b) ? int64_t(-2)
                                             : a.pos.at(b, s - 1);
  };
  // Columns [j0, j0 + n) of it.
  auto h_prev_of = [&](int64_t b, int64_t s, int64_t j0, int64_t n) {
    const int64_t q = prev_pos(b, s);
    return q == -1   ? h0 + b * P + j0
           : q == -2 ? reset_hp + b * P + j0
                     : row_of(out, out16, a.pos.row(q, b), j0, n, 1);
  };
  auto c_prev_of = [&](int64_t b, int64_t s) {
    const int64_t q = prev_pos(b, s);
    return q == -1 ? c0 + b * H : q == -2 ? reset_cp + b * H : wsp + a.pos.row(q, b) * W + 4 * H;
  };
  // Whether row b restarted at step s + 1: its carry at step s, once the
  // GEMM part is in, belongs to h0 (c0).
  auto restarted_after = [&](int64_t b, int64_t s) {
    return s + 1 < T && opts.restart(a.pos.at(b, s + 1), b);
  };
  // dh += (gate gradients of step s + 1) W_hh[:, slice], carry worker t.
  // Rows past the last one still running at step s + 1 have no gate gradient
  // there (zeros): the product skips them (Positions::live_rows).
  auto add_gemm_part = [&](size_t t, int64_t s) {
    const auto [r, ci, c] = carry_work(t);
    if (s + 1 < T) add_da_product(s + 1, r.b0, r.nb, ci, dh[t]);
  };

  // With a projection, phase 0 per output slice: the total gradient of the
  // projected h_t.
  auto total = [&](size_t t, int64_t s) {
    const auto [r, ci, c] = carry_work(t);
    add_gemm_part(t, s);
    A* d = ptr<A>(dh[t]);
    A* dt = ptr<A>(dh_tot);
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) {
        zero_row(dt + b * P + c.j0, c.n);
        if (a.pos.padded()) zero_row(ptr<A>(dh_tot_all) + (s * B + b) * P + c.j0, c.n);
        continue;
      }
      const int64_t row = a.pos.row(p, b);
      A* di = d + (b - r.b0) * c.n;
      if (restarted_after(b, s)) move_row(ptr<A>(dh0_acc) + b * P + c.j0, di, c.n);
      if (zone) {
        zoneout_total_row<A>(c.n, di, gout + row * P + c.j0, opts.mask(p, b) + c.j0,
                             dt + b * P + c.j0);
      } else {
        for (int64_t k = 0; k < c.n; ++k) dt[b * P + c.j0 + k] = di[k] + gout[row * P + c.j0 + k];
        zero_row(di, c.n);  // LSTM: no direct path from h_t to h_{t-1}
      }
      copy_row(ptr<A>(dh_tot_all) + row * P + c.j0, dt + b * P + c.j0, c.n);
    }
  };

  // Phase 1, per unit slice: the pointwise backward of the step.
  // The rows of a step's da (and dn) that a product reads: up to the last row
  // still running at that step, in whichever worker's block (Positions::
  // live_rows).  A finished row past them needs no zeros there: a packed
  // batch's finished rows (most of its rows, most of the time) cost nothing.
  auto read_rows = [&](int64_t s) { return a.pos.live_rows(0, B, s); };
  auto pointwise = [&](size_t t, int64_t s) {
    const auto [r, u, sl] = split.unit_work(t);
    const int64_t j0 = sl.j0, n = sl.n;
    A* da_s = da_of(s);
    const int64_t read = read_rows(s);
    if (z.has_proj) {
      step_gemm<A>(a.pos.live_rows(r.b0, r.nb, s), ptr<A>(dh_tot) + r.b0 * P, P, w_r_cols[u],
                   ptr<A>(dh_full[t]), false);
    } else {
      add_gemm_part(t, s);
    }
    A* dht = z.has_proj ? ptr<A>(dh_full[t]) : ptr<A>(dh[t]);
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) {
        // Finished sequence: no gradient here, the carry passes through.
        if (b < read) {
          for (int64_t k = 0; k < da_width / H; ++k) zero_row(da_s + b * da_width + k * H + j0, n);
          if (reset_before) zero_row(ptr<A>(dn) + b * H + j0, n);
        }
        if (!a.pos.padded()) continue;  // (no position s for the row)
        for (int64_t k = 0; k < G; ++k) zero_row(dx + (s * B + b) * GH + k * H + j0, n);
        if (dx16 != nullptr)
          for (int64_t k = 0; k < G; ++k) zero_row(dx16 + (s * B + b) * GH + k * H + j0, n);
        if (gru) zero_row(ptr<A>(dhn_all) + (s * B + b) * H + j0, n);
        if (reset_before) zero_row(ptr<A>(rh_all) + (s * B + b) * H + j0, n);
        if (z.has_proj) zero_row(ptr<A>(h_full_all) + (s * B + b) * H + j0, n);
        continue;
      }
      const int64_t row = a.pos.row(p, b);
      A* d = dht + (b - r.b0) * n;
      const A* g = z.has_proj ? nullptr : row_of(gout, gout16, row, j0, n, 0);
      const A* w = wsp + row * W + j0;
      A* dar = da_s + b * da_width + j0;
      A* dxr = da_in_dx ? dar : dx + row * GH + j0;  // (the same row unless da16)
      if (restarted_after(b, s)) {
        if (!z.has_proj) move_row(ptr<A>(dh0_acc) + b * P + j0, d, n);
        if (lstm) move_row(ptr<A>(dc0_acc) + b * H + j0, dc + b * H + j0, n);
      }
      if (gc_steps) add_row(dc + b * H + j0, gc_steps + row * H + j0, n);
      const A* m = opts.mask(p, b);
      const A* mh = zone ? m + j0 : nullptr;
      const A* mc = zone ? m + opts.zc + j0 : nullptr;
      switch (z.cell) {
        case Cell::RnnTanh:
        case Cell::RnnRelu: {
          // With zoneout the output is blended: the candidate is in the workspace.
          const A* h = zone ? w : row_of(out, out16, row, j0, n, 1);
          bool_switch(zone, [&](auto kZone) {
            constexpr bool Z = decltype(kZone)::value;
            if (z.cell == Cell::RnnRelu)
              rnn_backward_row<A, true, Z>(n, d, g, h, dar, mh);
            else
              rnn_backward_row<A, false, Z>(n, d, g, h, dar, mh);
          });
          break;
        }
        case Cell::Lstm: {
          const A* c_prev = c_prev_of(b, s) + j0;
          bool_switch(zone, [&](auto kZone) {
            constexpr bool Z = decltype(kZone)::value;
            if (z.has_proj)
              lstm_backward_row<A, true, Z>(n, H, d, nullptr, dc + b * H + j0, w, c_prev, dar,
                                            ptr<A>(h_full_all) + row * H + j0, nullptr, mc);
            else
              lstm_backward_row<A, false, Z>(n, H, d, g, dc + b * H + j0, w, c_prev, dar,
                                             nullptr, mh, mc);
          });
          break;
        }
        case Cell::Gru:
          bool_switch(zone, [&](auto kZone) {
            gru_backward_row<A, decltype(kZone)::value>(n, H, d, g, w, h_prev_of(b, s, j0, n), dxr, dar,
                                                        ptr<A>(dhn_all) + row * H + j0, mh);
          });
          break;
        case Cell::GruResetBefore:
          bool_switch(zone, [&](auto kZone) {
            gru_rb_backward_candidate_row<A, decltype(kZone)::value>(
                n, H, d, g, w, h_prev_of(b, s, j0, n), dxr, dar, ptr<A>(dn) + b * H + j0, mh);
          });
          break;
        case Cell::LstmLn:
          break;  // ln_carry and ln_pointwise
      }
      if (!gru && !reset_before && !da_in_dx)
        for (int64_t k = 0; k < G; ++k) copy_row(dxr + k * H, dar + k * H, n);
      if (!reset_before)  // (its dr comes in phase 2)
        for (int64_t k = 0; k < G; ++k)
          add_to_sums(n, dxr + k * H, gate_sum.data() + b * GH + k * H + j0);
      if (gru) add_to_sums(n, ptr<A>(dhn_all) + row * H + j0, hn_sum.data() + b * H + j0);
      if constexpr (std::is_same_v<A, float>)
        if (dx16 != nullptr)
          for (int64_t k = 0; k < G; ++k)
            pairs::narrow_bf16(n, dxr + k * H, dx16 + row * GH + k * H + j0);
    }
  };

  // Reset-before GRU, phase 2: drh = dn W_hn (all units of dn), then the reset gate.
  auto reset = [&](size_t t, int64_t s) {
    const auto [r, u, sl] = split.unit_work(t);
    const int64_t j0 = sl.j0, n = sl.n;
    A* da_s = da_of(s);
    step_gemm<A>(a.pos.live_rows(r.b0, r.nb, s), ptr<A>(dn) + r.b0 * H, H, w_n_cols[u],
                 ptr<A>(drh[t]), false);
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) continue;
      const int64_t row = a.pos.row(p, b), i = b - r.b0;
      gru_rb_backward_reset_row<A>(n, ptr<A>(dh[t]) + i * n, ptr<A>(drh[t]) + i * n,
                                   wsp + row * W + j0, h_prev_of(b, s, j0, n), dx + row * GH + j0,
                                   da_s + b * da_width + j0, ptr<A>(rh_all) + row * H + j0);
      for (int64_t k = 0; k < G; ++k)
        add_to_sums(n, dx + row * GH + k * H + j0, gate_sum.data() + b * GH + k * H + j0);
    }
  };

  // lstm_ln: the carry's GEMM part per unit slice, then the rows' backward
  // (whole rows: the layer norms), on the rows' workers (see ln_product).
  auto ln_carry = [&](size_t t, int64_t s) { add_gemm_part(t, s); };
  auto ln_pointwise = [&](size_t t, int64_t s) {
    const Rows r = split.rows_of(t);
    A* da_s = da_of(s);
    A* dchat = ptr<A>(ln_scratch[t]);
    const int64_t read = read_rows(s);
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) {
        if (b < read) zero_row(da_s + b * GH, GH);
        if (!a.pos.padded()) continue;
        zero_row(dx + (s * B + b) * GH, GH);
        zero_row(ptr<A>(dhp_all) + (s * B + b) * GH, GH);
        continue;
      }
      const int64_t row = a.pos.row(p, b);
      // The row's carry: the worker's own (all units), or gathered from the slices.
      A* d = split.by_rows ? ptr<A>(dh[t]) + (b - r.b0) * H : ptr<A>(ln_dh[t]);
      if (!split.by_rows)
        for (size_t u = 0; u < units.size(); ++u)
          copy_row(d + units[u].j0, ptr<A>(dh[u]) + b * units[u].n, units[u].n);
      if (restarted_after(b, s)) {
        move_row(ptr<A>(dh0_acc) + b * P, d, H);
        move_row(ptr<A>(dc0_acc) + b * H, dc + b * H, H);
      }
      const A* c_prev = c_prev_of(b, s);
      const A* m = opts.mask(p, b);
      bool_switch(zone, [&](auto kZone) {
        lstm_ln_backward_row<A, decltype(kZone)::value>(
            H, d, gout + row * H, dc + b * H, wsp + row * W, c_prev, lnp, zone ? m : nullptr,
            zone ? m + opts.zc : nullptr, dchat, dx + row * GH, da_s + b * GH,
            ln_sum.data() + b * 14 * H);
      });
      if (!da_in_dhp) copy_row(ptr<A>(dhp_all) + row * GH, da_s + b * GH, GH);
      if (!split.by_rows)
        for (size_t u = 0; u < units.size(); ++u)
          copy_row(ptr<A>(dh[u]) + b * units[u].n, d + units[u].j0, units[u].n);
    }
  };

  if (ln_cell) {
    run_steps(split, T, true, phase(true, carry_workers, ln_carry),
              phase(true, ln_row_workers, ln_pointwise));
  } else {
    run_steps(split, T, true, phase(z.has_proj, carry_workers, total),
              phase(true, unit_workers, pointwise), phase(reset_before, unit_workers, reset));
  }

  // The GEMM part of dh_0, then the carry into d_h0.
  for_each_worker(carry_workers, [&](size_t t) {
    const auto [r, ci, c] = carry_work(t);
    if (T > 0) add_da_product(0, r.b0, r.nb, ci, dh[t]);
    d_h0.narrow(0, r.b0, r.nb).narrow(1, c.j0, c.n).copy_(dh[t]);
  });
  if (resets && z.has_reset_state) {
    d_reset_h.copy_(dh0_acc);
    if (lstm) d_reset_c.copy_(dc0_acc);
  } else if (resets) {
    d_h0.add_(dh0_acc);
    if (lstm) d_c0.add_(dc0_acc);
  }

  // Bias gradients: d_b_hh equals d_b_ih but for the reset-after GRU's
  // candidate, whose hidden part is dhn.  lstm_ln: both are the sums of the
  // pre-activation gradients, and the sums after them are d_ln.
  if (ln_cell) {
    std::vector<double> sum(static_cast<size_t>(14 * H), 0.0);
    sum_rows(ln_sum, B, 14 * H, sum.data());
    A* dbi = ptr<A>(d_b_ih);
    A* dbh = ptr<A>(d_b_hh);
    A* dl = ptr<A>(d_ln);
    for (int64_t i = 0; i < GH; ++i) dbi[i] = dbh[i] = static_cast<A>(sum[i]);
    for (int64_t i = 0; i < 10 * H; ++i) dl[i] = static_cast<A>(sum[GH + i]);
  } else {
    // The rows' sums of the gate gradients (and of dhn, the reset-after GRU
    // candidate's hidden part), added up in row order.
    std::vector<double> sum_ih(static_cast<size_t>(G * H), 0.0), sum_hh;
    sum_rows(gate_sum, B, GH, sum_ih.data());
    sum_hh = sum_ih;
    if (gru) {
      std::fill(sum_hh.begin() + 2 * H, sum_hh.end(), 0.0);
      sum_rows(hn_sum, B, H, sum_hh.data() + 2 * H);
    }
    A* dbi = ptr<A>(d_b_ih);
    A* dbh = ptr<A>(d_b_hh);
    for (int64_t i = 0; i < G * H; ++i) {
      dbi[i] = static_cast<A>(sum_ih[i]);
      dbh[i] = static_cast<A>(sum_hh[i]);
    }
  }

  // Weight gradients: one GEMM over all steps each.
  // sum over the real positions of d^T x, both by row of the layout: packed
  // rows are all real, in time order; the grid's are gathered where mostly
  // padding.
  auto real_rows_gemm = [&](int64_t M, int64_t K, const A* d, int64_t ld_d, const A* x,
                            int64_t ld_x, A* c) {
    if (!a.pos.padded())
      weight_product<A>(a.bf16_products, M, K, rows, d, 1, ld_d, x, ld_x, 1, c, K, false);
    else if (gathers_real_positions(a.pos, T, B))
      gathered_weight_gemm<A>(a.bf16_products, M, K, real_positions(a.pos, T, B), d, ld_d, x, ld_x,
                              c, K, false, opt);
    else
      weight_product<A>(a.bf16_products, M, K, T * B, d, 1, ld_d, x, ld_x, 1, c, K, false);
  };
  if (gru || reset_before) {
    // Rows [0, 2H) (r, z) multiply h_{t-1}; rows [2H, 3H) (n) multiply h_{t-1}
    // (reset after, gradient dhn) or r * h_{t-1} (reset before, gradient dn).
    Tensor dw_rz = d_w_hh.narrow(0, 0, 2 * H), dw_n = d_w_hh.narrow(0, 2 * H, H);
    const bool bf16 = a.bf16_products;
    weight_grad_by_prev_state<A>(bf16, dw_rz, dx, dx16, GH, 2 * H, a.output, a.output_bf16, a.h0,
                                 a.pos, T, B, opts.resets, a.reset_h);
    if (gru) {
      weight_grad_by_prev_state<A>(bf16, dw_n, cptr<A>(dhn_all), nullptr, H, H, a.output,
                                   a.output_bf16, a.h0, a.pos, T, B, opts.resets, a.reset_h);
    } else {
      // dW_hn = sum dn^T (r * h_{t-1}), collected in time order by the backward.
      real_rows_gemm(H, H, dx + 2 * H, GH, cptr<A>(rh_all), H, ptr<A>(dw_n));
    }
  } else {
    weight_grad_by_prev_state<A>(a.bf16_products, d_w_hh,
                                 ln_cell ? cptr<A>(dhp_all) : da16 ? nullptr : dx,
                                 ln_cell ? nullptr : dx16, GH, GH, a.output, a.output_bf16, a.h0,
                                 a.pos, T, B, opts.resets, a.reset_h);
  }
  if (z.has_proj)
    real_rows_gemm(P, H, cptr<A>(dh_tot_all), P, cptr<A>(h_full_all), H, ptr<A>(d_w_hr));
}

template void backward_impl<float>(const BackwardArgs<float>&, Tensor&, Tensor&, Tensor&, Tensor&,
                                   Tensor&, Tensor&, Tensor&, Tensor&, Tensor&, Tensor&, Tensor&);
template void backward_impl<double>(const BackwardArgs<double>&, Tensor&, Tensor&, Tensor&,
                                    Tensor&, Tensor&, Tensor&, Tensor&, Tensor&, Tensor&, Tensor&,
                                    Tensor&);

}  // namespace rnnkern::cpu

// The pointwise part of one time step, per (batch row b, hidden unit j):
// everything around a cell's gate math (cells.h) -- biases, the row's time
// position (lengths, reverse), finished sequences, the state, output and
// workspace writes -- for the forward and the backward of every cell.
//
// The functions take the recurrent projection of the unit as values
// (`hh[k]`, gate k) where they need it, so a kernel that computes h W_hh^T
// itself (the later persistent kernel, with W_hh on chip) calls them just as
// the GEMM-then-pointwise kernels of this family do.
//
// Index conventions (row-major, the op's): gate k of unit j lives at k*H + j
// in every [.., G*H] row; the workspace row of (position p, row b) is
// ws[(p*B + b) * W*H + ...] (cells.h lists its values).
//
// The options of issue #16 are template parameters (kResets, kZoneout) of
// every unit function, so the code without them is the code of before:
//   * resets: the step that writes the state slot of row b's next step
//     writes h0[b] (c0[b]) there instead when that step resets (reset_next),
//     so the next GEMM and pointwise read the state the step starts from;
//     the backward moves the carried gradient of such a step's starting
//     state to dh0_reset / dc0_reset and restarts the carry at 0 (take_dh,
//     take_dc), and reads h0 / c0 as the previous state of a reset step;
//   * zoneout: the blend of cells.h's Zoneout after the cell (the RNN keeps
//     its candidate in the workspace, the LSTMs recompute c~ = f c_prev + i g
//     in the backward), the mask read through its strides.
// LSTM-LN works on whole rows (its layer norms): lstm_ln_forward_row and
// lstm_ln_backward_row, run by one block per batch row.
#pragma once

#include "common.cuh"

namespace rnnkern::cuda {

// ------------------------------------------------------------ forward ----

// The pointers of one forward step.  S storage, A = acc_t<S>.
template <typename S>
struct ForwardStep {
  using A = acc_t<S>;
  int64_t T, B, H, P;
  bool reverse;
  const int64_t* lengths;  // device or null
  int64_t s;               // the step (not the time position)

  const S* xproj;  // row (t, b) at t*x_st + b*x_sb
  int64_t x_st, x_sb;
  const S* b_ih;  // or null
  const S* b_hh;  // or null

  const S* h_prev;  // [B, P] state before the step
  S* h_next;        // [B, P] state after it, or null: the output row is the state (no lengths)
  S* out;           // [T, B, P]
  const A* c_prev;  // [B, H] (LSTM)
  A* c_next;        // [B, H] (LSTM)
  A* ws;            // [T, B, W*H] or null (inference)
  S* h_full;        // [B, H] LSTM with projection: o * tanh(c), projected by a GEMM
  S* rh;            // [B, H] reset-before GRU: r * h_prev, the A of the candidate's GEMM
  const A* hn;      // [B, H] reset-before GRU: rh W_hn^T
  A* rz;            // [B, 2H] reset-before GRU: r, z of the step (written over hproj)

  // The options (null when not given).
  const bool* resets;  // [T, B]
  const S* h0;         // [B, P]  what a reset restarts from
  const S* c0;         // [B, H]
  const S* zo;         // [T, B, Z] zoneout mask, (t, b, k) at t*zo_st + b*zo_sb + k
  int64_t zo_st, zo_sb;
  const S* ln;         // [10H] LSTM-LN's gains and shift

  __device__ int64_t pos(int64_t b) const { return position(lengths, T, reverse, b, s); }
  __device__ const S* x_row(int64_t p, int64_t b) const { return xproj + p * x_st + b * x_sb; }
  __device__ A h_prev_at(int64_t b, int64_t j) const { return load_at<A>(h_prev, b * P + j); }
  __device__ A bias(int64_t k, int64_t j) const {  // b_ih + b_hh of gate k
    return load_or_zero<A>(b_ih, k * H + j) + load_or_zero<A>(b_hh, k * H + j);
  }
  // Whether row b's next step (s + 1) starts from h0, c0: it resets (and runs).
  __device__ bool reset_next(int64_t b) const {
    const int64_t q = position(lengths, T, reverse, b, s + 1);
    return q >= 0 && resets[q * B + b];
  }
  // The zoneout mask of unit k (h's first, then c's) at position p.
  __device__ A mask(int64_t p, int64_t b, int64_t k) const {
    return load_at<A>(zo, p * zo_st + b * zo_sb + k);
  }
  // h_t of an unprojected cell: the output at position p and the state (h0's
  // row instead when the next step resets).
  template <bool kResets = false>
  __device__ void write_h(int64_t p, int64_t b, int64_t j, A h) const {
    const S v = Storage<S>::store(h);
    out[(p * B + b) * P + j] = v;
    if constexpr (kResets) {
      h_next[b * P + j] = reset_next(b) ? h0[b * P + j] : v;
    } else {
      if (h_next != nullptr) h_next[b * P + j] = v;
    }
  }
  // c_t: the state (c0's row instead when the next step resets).
  template <bool kResets = false>
  __device__ void write_c(int64_t b, int64_t j, A c) const {
    if constexpr (kResets) {
      c_next[b * H + j] = reset_next(b) ? load_at<A>(c0, b * H + j) : c;
    } else {
      c_next[b * H + j] = c;
    }
  }
  __device__ void write_ws(int64_t p, int64_t b, int64_t k, int64_t j, int64_t W, A v) const {
    if (ws != nullptr) ws[(p * B + b) * W * H + k * H + j] = v;
  }
};

// A finished sequence at step s: its state stays, its output at the padding
// position s is 0, its workspace there is 0.  `owns_h`: this unit also owns
// h (false for a projected LSTM, whose h the projection epilogue handles).
template <typename S>
__device__ void forward_finished(const ForwardStep<S>& st, Cell cell, int64_t b, int64_t j,
                                 bool owns_h, bool zoneout = false) {
  using A = acc_t<S>;
  const int64_t H = st.H, B = st.B, P = st.P, s = st.s;
  if (owns_h) {
    if (st.h_next != nullptr) st.h_next[b * P + j] = st.h_prev[b * P + j];
    st.out[(s * B + b) * P + j] = Storage<S>::store(A(0));
  }
  if (has_cell_state(cell)) st.c_next[b * H + j] = st.c_prev[b * H + j];
  const int64_t W = workspace_width(cell, zoneout);
  for (int64_t k = 0; k < W; ++k) st.write_ws(s, b, k, j, W, A(0));
}

// tanh / ReLU RNN.  hh: h_prev W_hh^T of the unit.  With zoneout the
// workspace keeps the candidate (the output is the blend).
template <bool kRelu, bool kResets, bool kZoneout, typename S>
__device__ void rnn_forward_unit(const ForwardStep<S>& st, int64_t b, int64_t j,
                                 const acc_t<S> (&hh)[1]) {
  using A = acc_t<S>;
  const int64_t p = st.pos(b);
  if (p < 0)
    return forward_finished(st, kRelu ? Cell::RnnRelu : Cell::RnnTanh, b, j, true, kZoneout);
  const A x = load_at<A>(st.x_row(p, b), j);
  const A h = RnnUnit<A, kRelu>::forward(x, hh[0] + st.bias(0, j));
  if constexpr (kZoneout) {
    st.write_ws(p, b, 0, j, 1, h);
    const A blended = Zoneout<A>::forward(st.mask(p, b, j), st.h_prev_at(b, j), h);
    st.template write_h<kResets>(p, b, j, blended);
  } else {
    st.template write_h<kResets>(p, b, j, h);
  }
}

// LSTM (with or without projection).  hh: the 4 gates' h_prev W_hh^T.
// With zoneout the workspace keeps the blended c (the state); h is blended
// here, or after the projection (projection_epilogue_unit).
template <bool kResets, bool kZoneout, typename S>
__device__ void lstm_forward_unit(const ForwardStep<S>& st, int64_t b, int64_t j,
                                  const acc_t<S> (&hh)[4]) {
  using A = acc_t<S>;
  const int64_t H = st.H, P = st.P;
  const bool proj = st.h_full != nullptr;
  const int64_t p = st.pos(b);
  if (p < 0) {
    if (proj) st.h_full[b * H + j] = Storage<S>::store(A(0));  // the GEMM's row; discarded
    return forward_finished(st, Cell::Lstm, b, j, !proj);
  }
  const S* x = st.x_row(p, b);
  A pre[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) pre[k] = load_at<A>(x, k * H + j) + hh[k] + st.bias(k, j);
  const A c_prev = st.c_prev[b * H + j];
  const auto r = LstmUnit<A>::forward(pre[0], pre[1], pre[2], pre[3], c_prev);
  A c = r.c, h = r.h;
  if constexpr (kZoneout) {
    c = Zoneout<A>::forward(st.mask(p, b, P + j), c_prev, r.c);
    if (!proj) h = Zoneout<A>::forward(st.mask(p, b, j), st.h_prev_at(b, j), r.h);
  }
  st.template write_c<kResets>(b, j, c);
  if (proj) {
    st.h_full[b * H + j] = Storage<S>::store(r.h);
  } else {
    st.template write_h<kResets>(p, b, j, h);
  }
  st.write_ws(p, b, 0, j, 5, r.i);
  st.write_ws(p, b, 1, j, 5, r.f);
  st.write_ws(p, b, 2, j, 5, r.g);
  st.write_ws(p, b, 3, j, 5, r.o);
  st.write_ws(p, b, 4, j, 5, c);
}

// GRU, reset after (torch's).  hh: h_prev W_hh^T of r, z, n (without b_hh).
template <bool kResets, bool kZoneout, typename S>
__device__ void gru_forward_unit(const ForwardStep<S>& st, int64_t b, int64_t j,
                                 const acc_t<S> (&hh)[3]) {
  using A = acc_t<S>;
  const int64_t H = st.H;
  const int64_t p = st.pos(b);
  if (p < 0) return forward_finished(st, Cell::Gru, b, j, true);
  const S* x = st.x_row(p, b);
  A xg[3], hg[3];
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    xg[k] = load_at<A>(x, k * H + j) + load_or_zero<A>(st.b_ih, k * H + j);
    hg[k] = hh[k] + load_or_zero<A>(st.b_hh, k * H + j);
  }
  const A h_prev = st.h_prev_at(b, j);
  const auto r = GruUnit<A>::forward(xg[0], xg[1], xg[2], hg[0], hg[1], hg[2], h_prev);
  if constexpr (kZoneout) {
    st.template write_h<kResets>(p, b, j, Zoneout<A>::forward(st.mask(p, b, j), h_prev, r.h));
  } else {
    st.template write_h<kResets>(p, b, j, r.h);
  }
  st.write_ws(p, b, 0, j, 4, r.r);
  st.write_ws(p, b, 1, j, 4, r.z);
  st.write_ws(p, b, 2, j, 4, r.n);
  st.write_ws(p, b, 3, j, 4, hg[2]);
}

// GRU, reset before, stage 1: r, z (kept in st.rz) and r * h_prev (st.rh,
// 0 for a finished row so the candidate's GEMM reads defined values).
template <typename S>
__device__ void gru_rb_gates_unit(const ForwardStep<S>& st, int64_t b, int64_t j,
                                  const acc_t<S> (&hh)[2]) {
  using A = acc_t<S>;
  const int64_t H = st.H;
  const int64_t p = st.pos(b);
  if (p < 0) {
    st.rh[b * H + j] = Storage<S>::store(A(0));
    return;
  }
  const S* x = st.x_row(p, b);
  const auto g = GruResetBeforeUnit<A>::gates(load_at<A>(x, j), load_at<A>(x, H + j), hh[0] + st.bias(0, j),
                                              hh[1] + st.bias(1, j), st.h_prev_at(b, j));
  st.rz[b * 2 * H + j] = g.r;
  st.rz[b * 2 * H + H + j] = g.z;
  st.rh[b * H + j] = Storage<S>::store(g.rh);
}

// Stage 2: the candidate from hn = (r * h_prev) W_hn^T (st.hn), then h.
template <bool kResets, bool kZoneout, typename S>
__device__ void gru_rb_candidate_unit(const ForwardStep<S>& st, int64_t b, int64_t j) {
  using A = acc_t<S>;
  const int64_t H = st.H;
  const int64_t p = st.pos(b);
  if (p < 0) return forward_finished(st, Cell::GruResetBefore, b, j, true);
  const A r = st.rz[b * 2 * H + j], z = st.rz[b * 2 * H + H + j];
  const A h_prev = st.h_prev_at(b, j);
  const auto c = GruResetBeforeUnit<A>::candidate(load_at<A>(st.x_row(p, b), 2 * H + j),
                                                  st.hn[b * H + j] + st.bias(2, j), z, h_prev);
  if constexpr (kZoneout) {
    st.template write_h<kResets>(p, b, j, Zoneout<A>::forward(st.mask(p, b, j), h_prev, c.h));
  } else {
    st.template write_h<kResets>(p, b, j, c.h);
  }
  st.write_ws(p, b, 0, j, 3, r);
  st.write_ws(p, b, 1, j, 3, z);
  st.write_ws(p, b, 2, j, 3, c.n);
}

// LSTM projection, per (b, k < P), after the GEMM wrote h_full W_hr^T into
// h_next (lengths or resets) or into the output row (zoneout alone): the
// output row and the state, or the kept state of a finished row.  With
// zoneout the projected h is the candidate of the blend.
template <bool kResets, bool kZoneout, typename S>
__device__ void projection_epilogue_unit(const ForwardStep<S>& st, int64_t b, int64_t k) {
  using A = acc_t<S>;
  const int64_t B = st.B, P = st.P;
  const int64_t p = st.pos(b);
  if (p < 0) {
    st.h_next[b * P + k] = st.h_prev[b * P + k];
    st.out[(st.s * B + b) * P + k] = Storage<S>::store(A(0));
  } else if constexpr (!kResets && !kZoneout) {
    st.out[(p * B + b) * P + k] = st.h_next[b * P + k];
  } else if constexpr (kResets) {  // the state is in the slots
    S v = st.h_next[b * P + k];
    if constexpr (kZoneout)
      v = Storage<S>::store(
          Zoneout<A>::forward(st.mask(p, b, k), st.h_prev_at(b, k), Storage<S>::load(v)));
    st.out[(p * B + b) * P + k] = v;
    st.h_next[b * P + k] = st.reset_next(b) ? st.h0[b * P + k] : v;
  } else {  // zoneout alone: the GEMM wrote the next slot (lengths) or the output row
    S* out = st.out + (p * B + b) * P + k;
    S* next = st.h_next != nullptr ? st.h_next + b * P + k : nullptr;
    const S v = Storage<S>::store(Zoneout<A>::forward(st.mask(p, b, k), st.h_prev_at(b, k),
                                                      Storage<S>::load(next ? *next : *out)));
    *out = v;
    if (next != nullptr) *next = v;
  }
}

// ------------------------------------------------------- LSTM-LN rows ----

// The workspace row of LSTM-LN at (position p, row b): cells.h's 14 blocks
// of H (i f g o c, x^ of the 4 gates, h^ of the 4 gates, c^) and the 3 row
// statistics (reciprocal standard deviations of x W_ih^T, h W_hh^T, c~).
template <typename A>
__device__ __forceinline__ A* ln_ws_row(A* ws, int64_t p, int64_t b, int64_t B, int64_t H) {
  return ws + (p * B + b) * workspace_size(Cell::LstmLn, H);
}

// A finished row: the state stays, output and workspace 0.  Whole block.
template <typename S>
__device__ void lstm_ln_forward_finished(const ForwardStep<S>& st, int64_t b) {
  using A = acc_t<S>;
  const int64_t H = st.H, B = st.B;
  for (int64_t j = threadIdx.x; j < H; j += kRowThreads) {
    if (st.h_next != nullptr) st.h_next[b * H + j] = st.h_prev[b * H + j];
    st.out[(st.s * B + b) * H + j] = Storage<S>::store(A(0));
    st.c_next[b * H + j] = st.c_prev[b * H + j];
  }
  if (st.ws != nullptr) {
    A* w = ln_ws_row(st.ws, st.s, b, B, H);
    const int64_t W = workspace_size(Cell::LstmLn, H);
    for (int64_t e = threadIdx.x; e < W; e += kRowThreads) w[e] = A(0);
  }
}

// One step of row b at position p, by the whole block: the statistics of
// x W_ih^T (st.xproj, raw) and of hh = h_prev W_hh^T (the row of the step's
// GEMM output) over 4H, the gates and c~ per unit, the statistics of c~ over
// H, then h~, zoneout and the state.  Between the two passes over the units
// each thread keeps its units' c~ and o in its own columns of hh (j and 3H + j,
// read only by itself after the first reduction), so nothing else is needed
// without a workspace.  smem: 2 * kRowThreads RowMoments.
template <bool kResets, bool kZoneout, typename S>
__device__ void lstm_ln_forward_row(const ForwardStep<S>& st, int64_t b, int64_t p, acc_t<S>* hh,
                                    RowMoments<acc_t<S>>* smem) {
  using A = acc_t<S>;
  using LN = LayerNorm<A>;
  const int64_t H = st.H;
  const S* x = st.x_row(p, b);
  const S *g_ih = st.ln, *g_hh = st.ln + 4 * H, *g_c = st.ln + 8 * H, *beta_c = st.ln + 9 * H;
  A* w = st.ws != nullptr ? ln_ws_row(st.ws, p, b, st.B, H) : nullptr;

  RowMoments<A> m[2] = {{A(0), A(0), A(0)}, {A(0), A(0), A(0)}};
  for (int64_t e = threadIdx.x; e < 4 * H; e += kRowThreads) {
    m[0].add(load_at<A>(x, e));
    m[1].add(hh[e]);
  }
  block_allreduce<kRowThreads>(m, smem);
  const A mean_x = m[0].mean, rstd_x = LN::rstd(m[0].variance());
  const A mean_h = m[1].mean, rstd_h = LN::rstd(m[1].variance());

  RowMoments<A> mc[1] = {{A(0), A(0), A(0)}};
  for (int64_t j = threadIdx.x; j < H; j += kRowThreads) {
    A pre[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t e = k * H + j;
      const A xhat = LN::normalize(load_at<A>(x, e), mean_x, rstd_x);
      const A hhat = LN::normalize(hh[e], mean_h, rstd_h);
      pre[k] = LstmLnUnit<A>::pre_activation(xhat, hhat, load_at<A>(g_ih, e), load_at<A>(g_hh, e),
                                             st.bias(k, j));
      if (w != nullptr) w[(5 + k) * H + j] = xhat, w[(9 + k) * H + j] = hhat;
    }
    const auto r = LstmUnit<A>::forward(pre[0], pre[1], pre[2], pre[3], st.c_prev[b * H + j]);
    if (w != nullptr) w[j] = r.i, w[H + j] = r.f, w[2 * H + j] = r.g, w[3 * H + j] = r.o;
    hh[j] = r.c;  // c~, before zoneout
    hh[3 * H + j] = r.o;
    mc[0].add(r.c);
  }
  block_allreduce<kRowThreads>(mc, smem);
  const A mean_c = mc[0].mean, rstd_c = LN::rstd(mc[0].variance());

  for (int64_t j = threadIdx.x; j < H; j += kRowThreads) {
    const A c_cand = hh[j];
    const A chat = LN::normalize(c_cand, mean_c, rstd_c);
    A h = LstmLnUnit<A>::output(hh[3 * H + j], chat, load_at<A>(g_c, j), load_at<A>(beta_c, j));
    A c = c_cand;
    if constexpr (kZoneout) {
      h = Zoneout<A>::forward(st.mask(p, b, j), st.h_prev_at(b, j), h);
      c = Zoneout<A>::forward(st.mask(p, b, H + j), st.c_prev[b * H + j], c_cand);
    }
    st.template write_c<kResets>(b, j, c);
    st.template write_h<kResets>(p, b, j, h);
    if (w != nullptr) w[4 * H + j] = c, w[13 * H + j] = chat;
  }
  if (w != nullptr && threadIdx.x == 0) {
    w[14 * H] = rstd_x;
    w[14 * H + 1] = rstd_h;
    w[14 * H + 2] = rstd_c;
  }
}

// ----------------------------------------------------------- backward ----

template <typename S>
struct BackwardStep {
  using A = acc_t<S>;
  int64_t T, B, H, P;
  bool reverse;
  const int64_t* lengths;
  int64_t s;

  const S* gout;  // row (t, b) at t*g_st + b*g_sb, or null (zeros)
  int64_t g_st, g_sb;
  const S* h0;
  const S* c0;
  const S* out;
  const A* ws;

  int64_t G;          // gates per unit
  S* dx;              // [T, B, G*H]
  A* dh;              // [B, P] carry
  A* dc;              // [B, H] carry (LSTM)
  S* da;              // [B, da_width]
  int64_t da_width;   // G*H, or 2H (reset-before)
  S* dhn_all;         // [T, B, H] (GRU)
  S* dn;              // [B, H] (reset-before)
  const A* drh;       // [B, H] (reset-before)
  S* rh_all;          // [T, B, H] (reset-before)
  S* dh_tot;          // [B, P] (projection)
  S* dh_tot_all;      // [T, B, P] (projection)
  const A* dh_full;   // [B, H] (projection)
  S* h_full_all;      // [T, B, H] (projection)

  // The options (null when not given).
  const bool* resets;  // [T, B]
  A* dh0_reset;        // [B, P] gradient of h0 through the reset steps
  A* dc0_reset;        // [B, H] of c0
  const S* zo;         // [T, B, Z] zoneout mask with strides zo_st, zo_sb
  int64_t zo_st, zo_sb;
  const S* ln;         // [10H] LSTM-LN
  S* dhproj_all;       // [T, B, 4H] LSTM-LN
  A* ln_scratch;       // [B, 4H] LSTM-LN
  A* ln_grads;         // [B, 14H] LSTM-LN
  A inv_h, inv_4h;     // LSTM-LN: 1 / H, 1 / (4H), divided on the host (no division
                       // subroutine in the row kernel, whose call would save registers)

  __device__ int64_t pos(int64_t b) const { return position(lengths, T, reverse, b, s); }
  // Position of the row's previous step (its h_{t-1}), or -1: h0 (the row's
  // first step, or with kResets a step that resets).  For a running row.
  template <bool kResets = false>
  __device__ int64_t prev_pos(int64_t b) const {
    if constexpr (kResets) {
      if (resets[pos(b) * B + b]) return -1;
    }
    return s == 0 ? -1 : position(lengths, T, reverse, b, s - 1);
  }
  template <bool kResets = false>
  __device__ A h_prev_at(int64_t b, int64_t j) const {
    const int64_t q = prev_pos<kResets>(b);
    return q < 0 ? load_at<A>(h0, b * P + j) : load_at<A>(out, (q * B + b) * P + j);
  }
  // Whether row b's step s + 1 (processed just before this one) reset.
  __device__ bool reset_next(int64_t b) const {
    const int64_t q = position(lengths, T, reverse, b, s + 1);
    return q >= 0 && resets[q * B + b];
  }
  // The carried gradient of the state row b's step s + 1 started from, as
  // the gradient of the state step s ends with: with kResets, 0 where that
  // step reset (its starting state was h0, c0: the carry goes to dh0_reset,
  // dc0_reset).  The first kernel of a step that reads the carry takes it.
  template <bool kResets>
  __device__ A take_dh(int64_t b, int64_t k) const {
    const A d = dh[b * P + k];
    if constexpr (kResets) {
      if (reset_next(b)) {
        dh0_reset[b * P + k] += d;
        return A(0);
      }
    }
    return d;
  }
  template <bool kResets>
  __device__ A take_dc(int64_t b, int64_t j) const {
    const A d = dc[b * H + j];
    if constexpr (kResets) {
      if (reset_next(b)) {
        dc0_reset[b * H + j] += d;
        return A(0);
      }
    }
    return d;
  }
  __device__ A mask(int64_t p, int64_t b, int64_t k) const {
    return load_at<A>(zo, p * zo_st + b * zo_sb + k);
  }
  __device__ A grad_out(int64_t p, int64_t b, int64_t k) const {
    return gout == nullptr ? A(0) : load_at<A>(gout, p * g_st + b * g_sb + k);
  }
  // Gradient of gate k's pre-activation: into d_xproj at (p, b) and, when
  // to_da, into the GEMM input of the step.
  __device__ void write_gate(int64_t p, int64_t b, int64_t k, int64_t j, A v, bool to_da) const {
    const S sv = Storage<S>::store(v);
    dx[(p * B + b) * G * H + k * H + j] = sv;
    if (to_da) da[b * da_width + k * H + j] = sv;
  }
};

// A finished row at step s: no gradient here (its carried dh, dc pass
// through); zeros at the padding position s and in the GEMM's row.
template <typename S>
__device__ void backward_finished(const BackwardStep<S>& st, int64_t b, int64_t j) {
  using A = acc_t<S>;
  const int64_t H = st.H, B = st.B, s = st.s, G = st.G;
  const S zero = Storage<S>::store(A(0));
  for (int64_t k = 0; k < G; ++k) st.dx[(s * B + b) * G * H + k * H + j] = zero;
  for (int64_t k = 0; k < st.da_width / H; ++k) st.da[b * st.da_width + k * H + j] = zero;
  if (st.dhn_all != nullptr) st.dhn_all[(s * B + b) * H + j] = zero;
  if (st.dn != nullptr) st.dn[b * H + j] = zero;
  if (st.rh_all != nullptr) st.rh_all[(s * B + b) * H + j] = zero;
  if (st.h_full_all != nullptr) st.h_full_all[(s * B + b) * H + j] = zero;
  if (st.dhproj_all != nullptr)
    for (int64_t k = 0; k < 4; ++k) st.dhproj_all[(s * B + b) * 4 * H + k * H + j] = zero;
}

// With zoneout the gradient d of the blended h_t splits: (1 - m) d into the
// candidate (the cell's backward), m d straight into h_{t-1} (the carry).
template <bool kRelu, bool kResets, bool kZoneout, typename S>
__device__ void rnn_backward_unit(const BackwardStep<S>& st, int64_t b, int64_t j) {
  using A = acc_t<S>;
  const int64_t B = st.B, H = st.H;
  const int64_t p = st.pos(b);
  if (p < 0) return backward_finished(st, b, j);
  const int64_t row = p * B + b;
  const A d = st.template take_dh<kResets>(b, j) + st.grad_out(p, b, j);
  if constexpr (kZoneout) {
    const A m = st.mask(p, b, j);
    const A g = RnnUnit<A, kRelu>::backward(Zoneout<A>::to_candidate(m, d), st.ws[row * H + j]);
    st.write_gate(p, b, 0, j, g, true);
    st.dh[b * H + j] = Zoneout<A>::to_prev(m, d);  // the GEMM adds the rest
  } else {
    const A g = RnnUnit<A, kRelu>::backward(d, load_at<A>(st.out, row * H + j));
    st.write_gate(p, b, 0, j, g, true);
    st.dh[b * H + j] = A(0);  // no direct path: all of dh_{t-1} comes from the GEMM
  }
}

// With a projection, dh is st.dh_full (the gradient of the unprojected h_t,
// already the whole of it, zoneout's split done by projection_backward_unit),
// and o * tanh(c~) is recorded for dW_hr.  With zoneout the workspace holds
// the blended c: c~ is recomputed (LstmUnit::candidate).
template <bool kResets, bool kZoneout, typename S>
__device__ void lstm_backward_unit(const BackwardStep<S>& st, int64_t b, int64_t j) {
  using A = acc_t<S>;
  const int64_t B = st.B, H = st.H, P = st.P;
  const bool proj = st.dh_full != nullptr;
  const int64_t p = st.pos(b);
  if (p < 0) return backward_finished(st, b, j);
  const int64_t row = p * B + b;
  const A* w = st.ws + row * 5 * H;
  const A i = w[j], f = w[H + j], g = w[2 * H + j], o = w[3 * H + j];
  const int64_t q = st.template prev_pos<kResets>(b);
  const A c_prev = q < 0 ? load_at<A>(st.c0, b * H + j) : st.ws[(q * B + b) * 5 * H + 4 * H + j];
  const A dc = st.template take_dc<kResets>(b, j);
  const A dh = proj ? st.dh_full[b * H + j]
                    : st.template take_dh<kResets>(b, j) + st.grad_out(p, b, j);
  if constexpr (kZoneout) {
    const A c = LstmUnit<A>::candidate(i, f, g, c_prev);
    const A mc = st.mask(p, b, P + j);
    const A mh = proj ? A(0) : st.mask(p, b, j);
    const auto r = LstmUnit<A>::backward(Zoneout<A>::to_candidate(mh, dh),
                                         Zoneout<A>::to_candidate(mc, dc), i, f, g, o, c, c_prev);
    st.write_gate(p, b, 0, j, r.di, true);
    st.write_gate(p, b, 1, j, r.df, true);
    st.write_gate(p, b, 2, j, r.dg, true);
    st.write_gate(p, b, 3, j, r.do_, true);
    st.dc[b * H + j] = r.dc_prev + Zoneout<A>::to_prev(mc, dc);
    if (proj) {
      st.h_full_all[row * H + j] = Storage<S>::store(o * Math<A>::tanh(c));
    } else {
      st.dh[b * P + j] = Zoneout<A>::to_prev(mh, dh);
    }
  } else {
    const A c = w[4 * H + j];
    const auto r = LstmUnit<A>::backward(dh, dc, i, f, g, o, c, c_prev);
    st.write_gate(p, b, 0, j, r.di, true);
    st.write_gate(p, b, 1, j, r.df, true);
    st.write_gate(p, b, 2, j, r.dg, true);
    st.write_gate(p, b, 3, j, r.do_, true);
    st.dc[b * H + j] = r.dc_prev;
    if (proj) {
      st.h_full_all[row * H + j] = Storage<S>::store(o * Math<A>::tanh(c));
    } else {
      st.dh[b * P + j] = A(0);
    }
  }
}

template <bool kResets, bool kZoneout, typename S>
__device__ void gru_backward_unit(const BackwardStep<S>& st, int64_t b, int64_t j) {
  using A = acc_t<S>;
  const int64_t B = st.B, H = st.H;
  const int64_t p = st.pos(b);
  if (p < 0) return backward_finished(st, b, j);
  const int64_t row = p * B + b;
  const A* w = st.ws + row * 4 * H;
  const A d = st.template take_dh<kResets>(b, j) + st.grad_out(p, b, j);
  const A m = kZoneout ? st.mask(p, b, j) : A(0);
  const auto r = GruUnit<A>::backward(kZoneout ? Zoneout<A>::to_candidate(m, d) : d, w[j],
                                      w[H + j], w[2 * H + j], w[3 * H + j],
                                      st.template h_prev_at<kResets>(b, j));
  st.write_gate(p, b, 0, j, r.dr, true);
  st.write_gate(p, b, 1, j, r.dz, true);
  st.write_gate(p, b, 2, j, r.dxn, false);
  const S dhn = Storage<S>::store(r.dhn);
  st.da[b * st.da_width + 2 * H + j] = dhn;
  st.dhn_all[row * H + j] = dhn;
  // the direct path; the GEMM adds da W_hh
  st.dh[b * H + j] = kZoneout ? r.dh_prev + Zoneout<A>::to_prev(m, d) : r.dh_prev;
}

// Reset-before GRU, stage 1: z and the candidate; dn feeds drh = dn W_hn.
template <bool kResets, bool kZoneout, typename S>
__device__ void gru_rb_backward_candidate_unit(const BackwardStep<S>& st, int64_t b, int64_t j) {
  using A = acc_t<S>;
  const int64_t B = st.B, H = st.H;
  const int64_t p = st.pos(b);
  if (p < 0) return backward_finished(st, b, j);
  const A* w = st.ws + (p * B + b) * 3 * H;
  const A d = st.template take_dh<kResets>(b, j) + st.grad_out(p, b, j);
  const A m = kZoneout ? st.mask(p, b, j) : A(0);
  const auto r = GruResetBeforeUnit<A>::backward_candidate(
      kZoneout ? Zoneout<A>::to_candidate(m, d) : d, w[H + j], w[2 * H + j],
      st.template h_prev_at<kResets>(b, j));
  st.write_gate(p, b, 1, j, r.dz, true);
  st.write_gate(p, b, 2, j, r.dn, false);
  st.dn[b * H + j] = Storage<S>::store(r.dn);
  st.dh[b * H + j] = kZoneout ? r.dh_prev + Zoneout<A>::to_prev(m, d) : r.dh_prev;
}

// Stage 2, after drh = dn W_hn: the reset gate; records r * h_prev for dW_hn.
template <bool kResets, typename S>
__device__ void gru_rb_backward_reset_unit(const BackwardStep<S>& st, int64_t b, int64_t j) {
  using A = acc_t<S>;
  const int64_t B = st.B, H = st.H;
  const int64_t p = st.pos(b);
  if (p < 0) return;  // stage 1 wrote the zeros
  const int64_t row = p * B + b;
  const A r = st.ws[row * 3 * H + j];
  const A h_prev = st.template h_prev_at<kResets>(b, j);
  const auto g = GruResetBeforeUnit<A>::backward_reset(st.drh[b * H + j], r, h_prev);
  st.write_gate(p, b, 0, j, g.dr, true);
  st.dh[b * H + j] += g.dh_prev;
  st.rh_all[row * H + j] = Storage<S>::store(r * h_prev);
}

// LSTM projection, per (b, k < P), before the cell's backward: the total
// gradient of the projected h_t (with zoneout: of its candidate), the A of
// dh_full = dh_tot W_hr.
template <bool kResets, bool kZoneout, typename S>
__device__ void projection_backward_unit(const BackwardStep<S>& st, int64_t b, int64_t k) {
  using A = acc_t<S>;
  const int64_t B = st.B, P = st.P;
  const int64_t p = st.pos(b);
  const S zero = Storage<S>::store(A(0));
  if (p < 0) {
    st.dh_tot[b * P + k] = zero;
    st.dh_tot_all[(st.s * B + b) * P + k] = zero;
    return;  // the carry passes through
  }
  const A d = st.template take_dh<kResets>(b, k) + st.grad_out(p, b, k);
  A t = d, carry = A(0);  // LSTM: h_t reaches h_{t-1} only through the gates
  if constexpr (kZoneout) {
    const A m = st.mask(p, b, k);
    t = Zoneout<A>::to_candidate(m, d);
    carry = Zoneout<A>::to_prev(m, d);
  }
  const S ts = Storage<S>::store(t);
  st.dh_tot[b * P + k] = ts;
  st.dh_tot_all[(p * B + b) * P + k] = ts;
  st.dh[b * P + k] = carry;
}

// ---------------------------------------------------- LSTM-LN, backward ----

// A finished row: zeros at the padding position and in the GEMM's row; the
// carried gradients pass through.  Whole block.
template <typename S>
__device__ void lstm_ln_backward_finished(const BackwardStep<S>& st, int64_t b) {
  for (int64_t j = threadIdx.x; j < st.H; j += kRowThreads) backward_finished(st, b, j);
}

// One step of row b at position p backwards, by the whole block, in three
// passes separated by row reductions: (1) per unit, zoneout's split of dh,
// the output's backward (d o, d c^, and d g_c, d beta_c); (2) per unit, the
// cell layer norm's backward with the means over H of d c^ and d c^ c^, then
// the gates' (d a of the 4 gates, d c_{t-1}) and the gains' and biases'
// gradients; (3) per gate value, the input and recurrent layer norms'
// backward with the means over 4H: d xproj, and d hproj (the A of the step's
// GEMM dh_{t-1} += d hproj W_hh, and of dW_hh after the loop).  Between the
// passes each thread keeps its values in its own columns of `scratch` (d c^
// and d o at j, 3H + j; then d a_k at k*H + j), read back by the same thread
// except in pass 3, after a reduction's barriers.  The gains' and biases'
// gradients are summed per row over the steps in `grads` (each value owned
// by one thread).  smem: 4 * kRowThreads values of A.
template <bool kResets, bool kZoneout, typename S>
__device__ void lstm_ln_backward_row(const BackwardStep<S>& st, int64_t b, int64_t p,
                                     acc_t<S>* scratch, acc_t<S>* grads, RowSum<acc_t<S>>* smem) {
  using A = acc_t<S>;
  using LN = LayerNorm<A>;
  const int64_t B = st.B, H = st.H;
  const S *g_ih = st.ln, *g_hh = st.ln + 4 * H, *g_c = st.ln + 8 * H, *beta_c = st.ln + 9 * H;
  const A* w = ln_ws_row(st.ws, p, b, B, H);
  RowSum<A> sc[2] = {{A(0)}, {A(0)}};
  for (int64_t j = threadIdx.x; j < H; j += kRowThreads) {
    const A d = st.template take_dh<kResets>(b, j) + st.grad_out(p, b, j);
    A dh = d, carry = A(0);  // h_t reaches h_{t-1} through the gates (the GEMM) only
    if constexpr (kZoneout) {
      const A m = st.mask(p, b, j);
      dh = Zoneout<A>::to_candidate(m, d);
      carry = Zoneout<A>::to_prev(m, d);
    }
    st.dh[b * H + j] = carry;
    const A chat = w[13 * H + j];
    const auto r = LstmLnUnit<A>::backward_output(dh, w[3 * H + j], chat, load_at<A>(g_c, j),
                                                   load_at<A>(beta_c, j));
    grads[8 * H + j] += r.dy * chat;
    grads[9 * H + j] += r.dy;
    scratch[j] = r.dchat;
    scratch[3 * H + j] = r.do_;
    sc[0].v += r.dchat;
    sc[1].v += r.dchat * chat;
  }
  block_allreduce<kRowThreads>(sc, smem);
  const A mean_dchat = sc[0].v * st.inv_h, mean_dchat_chat = sc[1].v * st.inv_h;

  // c_{t-1}: c0, or the c of the row's previous position (computed here,
  // not before pass 1: live across it, the pointer spills in double)
  const int64_t q = st.template prev_pos<kResets>(b);
  const A rstd_c = w[14 * H + 2];
  RowSum<A> sg[4] = {{A(0)}, {A(0)}, {A(0)}, {A(0)}};
  for (int64_t j = threadIdx.x; j < H; j += kRowThreads) {
    const A chat = w[13 * H + j];
    A dcand = LN::backward(scratch[j], chat, rstd_c, mean_dchat, mean_dchat_chat);
    const A dc = st.template take_dc<kResets>(b, j);
    A direct = A(0);
    if constexpr (kZoneout) {
      const A m = st.mask(p, b, H + j);
      dcand += Zoneout<A>::to_candidate(m, dc);
      direct = Zoneout<A>::to_prev(m, dc);
    } else {
      dcand += dc;
    }
    const A c_prev = q < 0 ? load_at<A>(st.c0, b * H + j) : ln_ws_row(st.ws, q, b, B, H)[4 * H + j];
    const auto r = LstmLnUnit<A>::backward_gates(dcand, w[j], w[H + j], w[2 * H + j], c_prev);
    st.dc[b * H + j] = r.dc_prev + direct;
    scratch[j] = r.di;  // d o is at 3H + j already
    scratch[H + j] = r.df;
    scratch[2 * H + j] = r.dg;
    // Not unrolled: four gates' worth of 64-bit addresses at once spill in double.
#pragma unroll 1
    for (int64_t e = j; e < 4 * H; e += H) {
      const A da = scratch[e], xhat = w[5 * H + e], hhat = w[9 * H + e];
      grads[e] += da * xhat;           // g_ih
      grads[4 * H + e] += da * hhat;   // g_hh
      grads[10 * H + e] += da;         // b_ih, b_hh
      const A dx = da * load_at<A>(g_ih, e), dhh = da * load_at<A>(g_hh, e);
      sg[0].v += dx;
      sg[1].v += dx * xhat;
      sg[2].v += dhh;
      sg[3].v += dhh * hhat;
    }
  }
  block_allreduce<kRowThreads>(sg, smem);
  const A mx = sg[0].v * st.inv_4h, mxx = sg[1].v * st.inv_4h;
  const A mh = sg[2].v * st.inv_4h, mhh = sg[3].v * st.inv_4h;

  const int64_t row = p * B + b;
  const A rstd_x = w[14 * H], rstd_h = w[14 * H + 1];
  for (int64_t e = threadIdx.x; e < 4 * H; e += kRowThreads) {
    const A da = scratch[e];
    const A dx = LN::backward(da * load_at<A>(g_ih, e), w[5 * H + e], rstd_x, mx, mxx);
    const A dhp = LN::backward(da * load_at<A>(g_hh, e), w[9 * H + e], rstd_h, mh, mhh);
    st.dx[row * 4 * H + e] = Storage<S>::store(dx);
    const S v = Storage<S>::store(dhp);
    st.da[b * 4 * H + e] = v;
    st.dhproj_all[row * 4 * H + e] = v;
  }
}

}  // namespace rnnkern::cuda

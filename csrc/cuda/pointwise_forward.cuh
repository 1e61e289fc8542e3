// The pointwise part of one forward time step, per (batch row b, hidden
// unit j): everything around a cell's gate math (cells.h) -- biases, the
// row's time position (lengths, reverse), finished sequences, the state,
// output and workspace writes -- for every cell; run by the kernels of
// recurrence_forward.cuh (the backward's twin: pointwise_backward.cuh).
//
// The functions take the recurrent projection of the unit as values
// (`hh[k]`, gate k) where they need it, so a kernel that computes h W_hh^T
// itself would call them just as the GEMM-then-pointwise kernels do.
//
// Index conventions (row-major, the op's): gate k of unit j lives at k*H + j
// in every [.., G*H] row; the workspace row of (position p, row b) is
// ws[(p*B + b) * W*H + ...] (cells.h lists its values).
//
// The step options are template parameters (kResets, kZoneout) of every
// unit function, so the code without them is the code of before:
//   * resets: the step that writes the state slot of row b's next step
//     writes the reset state's row b (reset_h, reset_c: h0, c0 unless given)
//     there instead when that step resets (reset_next),
//     so the next GEMM and pointwise read the state the step starts from;
//   * zoneout: the blend of cells.h's Zoneout after the cell (the RNN keeps
//     its candidate in the workspace), the mask read through its strides.
// The LayerNorm cell (LSTM-LN) works on whole rows (its layer norms):
// lstm_ln_forward_row, run by one block per batch row.
#pragma once

#include "common.cuh"

namespace rnnkern::cuda {

// The per-unit stages of a forward step, as kernels' template parameters.
enum class ForwardPhase { RnnTanh, RnnRelu, Lstm, Gru, GruRbGates, GruRbCandidate, Projection };

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
  S* c_steps;       // [T, B, H] every step's c (LSTM with cell_steps), or null
  A* ws;            // [T, B, W*H] or null (inference)
  S* h_full;        // [B, H] LSTM with projection: o * tanh(c), projected by a GEMM
  S* rh;            // [B, H] reset-before GRU: r * h_prev, the A of the candidate's GEMM
  const A* hn;      // [B, H] reset-before GRU: rh W_hn^T
  A* rz;            // [B, 2H] reset-before GRU: r, z of the step (written over hproj)

  // The options (null when not given).
  const bool* resets;  // [T, B]
  const S* h0;         // [B, P]  the state of each row's first step
  const S* reset_h;    // [B, P]  what a reset restarts from (h0 unless given)
  const S* reset_c;    // [B, H]  (c0 unless given)
  const S* zo;         // [T, B, Z] zoneout mask, (t, b, k) at t*zo_st + b*zo_sb + k
  int64_t zo_st, zo_sb;
  const S* ln;         // [10H] LSTM-LN's gains and shift

  __device__ int64_t pos(int64_t b) const { return position(lengths, T, reverse, b, s); }
  __device__ const S* x_row(int64_t p, int64_t b) const { return xproj + p * x_st + b * x_sb; }
  __device__ A h_prev_at(int64_t b, int64_t j) const { return load_at<A>(h_prev, b * P + j); }
  __device__ A bias(int64_t k, int64_t j) const {  // b_ih + b_hh of gate k
    return load_or_zero<A>(b_ih, k * H + j) + load_or_zero<A>(b_hh, k * H + j);
  }
  // Whether row b's next step (s + 1) starts from the reset state: it resets (and runs).
  __device__ bool reset_next(int64_t b) const {
    const int64_t q = position(lengths, T, reverse, b, s + 1);
    return q >= 0 && resets[q * B + b];
  }
  // The zoneout mask of unit k (h's first, then c's) at position p.
  __device__ A mask(int64_t p, int64_t b, int64_t k) const {
    return load_at<A>(zo, p * zo_st + b * zo_sb + k);
  }
  // h_t of an unprojected cell: the output at position p and the state
  // (reset_h's row instead when the next step resets).
  template <bool kResets = false>
  __device__ void write_h(int64_t p, int64_t b, int64_t j, A h) const {
    const S v = Storage<S>::store(h);
    out[(p * B + b) * P + j] = v;
    if constexpr (kResets) {
      h_next[b * P + j] = reset_next(b) ? reset_h[b * P + j] : v;
    } else {
      if (h_next != nullptr) h_next[b * P + j] = v;
    }
  }
  // c_t: the state (reset_c's row instead when the next step resets).
  template <bool kResets = false>
  __device__ void write_c(int64_t b, int64_t j, A c) const {
    if constexpr (kResets) {
      c_next[b * H + j] = reset_next(b) ? load_at<A>(reset_c, b * H + j) : c;
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
  if (st.c_steps != nullptr) st.c_steps[(s * B + b) * H + j] = Storage<S>::store(A(0));
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
  if (st.c_steps != nullptr) st.c_steps[(p * st.B + b) * H + j] = Storage<S>::store(c);
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
    st.h_next[b * P + k] = st.reset_next(b) ? st.reset_h[b * P + k] : v;
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

}  // namespace rnnkern::cuda

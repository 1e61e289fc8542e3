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

  __device__ int64_t pos(int64_t b) const { return position(lengths, T, reverse, b, s); }
  __device__ const S* x_row(int64_t p, int64_t b) const { return xproj + p * x_st + b * x_sb; }
  __device__ A h_prev_at(int64_t b, int64_t j) const { return load_at<A>(h_prev, b * P + j); }
  __device__ A bias(int64_t k, int64_t j) const {  // b_ih + b_hh of gate k
    return load_or_zero<A>(b_ih, k * H + j) + load_or_zero<A>(b_hh, k * H + j);
  }
  // h_t of an unprojected cell: the output at position p and the state.
  __device__ void write_h(int64_t p, int64_t b, int64_t j, A h) const {
    const S v = Storage<S>::store(h);
    out[(p * B + b) * P + j] = v;
    if (h_next != nullptr) h_next[b * P + j] = v;
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
                                 bool owns_h) {
  using A = acc_t<S>;
  const int64_t H = st.H, B = st.B, P = st.P, s = st.s;
  if (owns_h) {
    if (st.h_next != nullptr) st.h_next[b * P + j] = st.h_prev[b * P + j];
    st.out[(s * B + b) * P + j] = Storage<S>::store(A(0));
  }
  if (cell == Cell::Lstm) st.c_next[b * H + j] = st.c_prev[b * H + j];
  const int64_t W = workspace_width(cell);
  for (int64_t k = 0; k < W; ++k) st.write_ws(s, b, k, j, W, A(0));
}

// tanh / ReLU RNN.  hh: h_prev W_hh^T of the unit.
template <bool kRelu, typename S>
__device__ void rnn_forward_unit(const ForwardStep<S>& st, int64_t b, int64_t j,
                                 const acc_t<S> (&hh)[1]) {
  using A = acc_t<S>;
  const int64_t p = st.pos(b);
  if (p < 0) return forward_finished(st, kRelu ? Cell::RnnRelu : Cell::RnnTanh, b, j, true);
  const A x = load_at<A>(st.x_row(p, b), j);
  st.write_h(p, b, j, RnnUnit<A, kRelu>::forward(x, hh[0] + st.bias(0, j)));
}

// LSTM (with or without projection).  hh: the 4 gates' h_prev W_hh^T.
template <typename S>
__device__ void lstm_forward_unit(const ForwardStep<S>& st, int64_t b, int64_t j,
                                  const acc_t<S> (&hh)[4]) {
  using A = acc_t<S>;
  const int64_t H = st.H;
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
  const auto r = LstmUnit<A>::forward(pre[0], pre[1], pre[2], pre[3], st.c_prev[b * H + j]);
  st.c_next[b * H + j] = r.c;
  if (proj) {
    st.h_full[b * H + j] = Storage<S>::store(r.h);
  } else {
    st.write_h(p, b, j, r.h);
  }
  st.write_ws(p, b, 0, j, 5, r.i);
  st.write_ws(p, b, 1, j, 5, r.f);
  st.write_ws(p, b, 2, j, 5, r.g);
  st.write_ws(p, b, 3, j, 5, r.o);
  st.write_ws(p, b, 4, j, 5, r.c);
}

// GRU, reset after (torch's).  hh: h_prev W_hh^T of r, z, n (without b_hh).
template <typename S>
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
  const auto r = GruUnit<A>::forward(xg[0], xg[1], xg[2], hg[0], hg[1], hg[2], st.h_prev_at(b, j));
  st.write_h(p, b, j, r.h);
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
template <typename S>
__device__ void gru_rb_candidate_unit(const ForwardStep<S>& st, int64_t b, int64_t j) {
  using A = acc_t<S>;
  const int64_t H = st.H;
  const int64_t p = st.pos(b);
  if (p < 0) return forward_finished(st, Cell::GruResetBefore, b, j, true);
  const A r = st.rz[b * 2 * H + j], z = st.rz[b * 2 * H + H + j];
  const auto c = GruResetBeforeUnit<A>::candidate(load_at<A>(st.x_row(p, b), 2 * H + j),
                                                  st.hn[b * H + j] + st.bias(2, j), z,
                                                  st.h_prev_at(b, j));
  st.write_h(p, b, j, c.h);
  st.write_ws(p, b, 0, j, 3, r);
  st.write_ws(p, b, 1, j, 3, z);
  st.write_ws(p, b, 2, j, 3, c.n);
}

// LSTM projection with lengths, per (b, k < P), after the GEMM wrote
// h_full W_hr^T into h_next: the output row, or the kept state of a finished row.
template <typename S>
__device__ void projection_epilogue_unit(const ForwardStep<S>& st, int64_t b, int64_t k) {
  using A = acc_t<S>;
  const int64_t B = st.B, P = st.P;
  const int64_t p = st.pos(b);
  if (p < 0) {
    st.h_next[b * P + k] = st.h_prev[b * P + k];
    st.out[(st.s * B + b) * P + k] = Storage<S>::store(A(0));
  } else {
    st.out[(p * B + b) * P + k] = st.h_next[b * P + k];
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

  __device__ int64_t pos(int64_t b) const { return position(lengths, T, reverse, b, s); }
  // Position of the row's previous step (its h_{t-1}), or -1: h0.
  __device__ int64_t prev_pos(int64_t b) const {
    return s == 0 ? -1 : position(lengths, T, reverse, b, s - 1);
  }
  __device__ A h_prev_at(int64_t b, int64_t j) const {
    const int64_t q = prev_pos(b);
    return q < 0 ? load_at<A>(h0, b * P + j) : load_at<A>(out, (q * B + b) * P + j);
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
}

template <bool kRelu, typename S>
__device__ void rnn_backward_unit(const BackwardStep<S>& st, int64_t b, int64_t j) {
  using A = acc_t<S>;
  const int64_t B = st.B, H = st.H;
  const int64_t p = st.pos(b);
  if (p < 0) return backward_finished(st, b, j);
  const int64_t row = p * B + b;
  const A g = RnnUnit<A, kRelu>::backward(st.dh[b * H + j] + st.grad_out(p, b, j),
                                          load_at<A>(st.out, row * H + j));
  st.write_gate(p, b, 0, j, g, true);
  st.dh[b * H + j] = A(0);  // no direct path: all of dh_{t-1} comes from the GEMM
}

// With a projection, dh is st.dh_full (the gradient of the unprojected h_t,
// already the whole of it), and o * tanh(c) is recorded for dW_hr.
template <typename S>
__device__ void lstm_backward_unit(const BackwardStep<S>& st, int64_t b, int64_t j) {
  using A = acc_t<S>;
  const int64_t B = st.B, H = st.H, P = st.P;
  const bool proj = st.dh_full != nullptr;
  const int64_t p = st.pos(b);
  if (p < 0) return backward_finished(st, b, j);
  const int64_t row = p * B + b;
  const A* w = st.ws + row * 5 * H;
  const A i = w[j], f = w[H + j], g = w[2 * H + j], o = w[3 * H + j], c = w[4 * H + j];
  const int64_t q = st.prev_pos(b);
  const A c_prev = q < 0 ? load_at<A>(st.c0, b * H + j) : st.ws[(q * B + b) * 5 * H + 4 * H + j];
  const A dh = proj ? st.dh_full[b * H + j] : st.dh[b * P + j] + st.grad_out(p, b, j);
  const auto r = LstmUnit<A>::backward(dh, st.dc[b * H + j], i, f, g, o, c, c_prev);
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

template <typename S>
__device__ void gru_backward_unit(const BackwardStep<S>& st, int64_t b, int64_t j) {
  using A = acc_t<S>;
  const int64_t B = st.B, H = st.H;
  const int64_t p = st.pos(b);
  if (p < 0) return backward_finished(st, b, j);
  const int64_t row = p * B + b;
  const A* w = st.ws + row * 4 * H;
  const auto r = GruUnit<A>::backward(st.dh[b * H + j] + st.grad_out(p, b, j), w[j], w[H + j],
                                      w[2 * H + j], w[3 * H + j], st.h_prev_at(b, j));
  st.write_gate(p, b, 0, j, r.dr, true);
  st.write_gate(p, b, 1, j, r.dz, true);
  st.write_gate(p, b, 2, j, r.dxn, false);
  const S dhn = Storage<S>::store(r.dhn);
  st.da[b * st.da_width + 2 * H + j] = dhn;
  st.dhn_all[row * H + j] = dhn;
  st.dh[b * H + j] = r.dh_prev;  // the direct path; the GEMM adds da W_hh
}

// Reset-before GRU, stage 1: z and the candidate; dn feeds drh = dn W_hn.
template <typename S>
__device__ void gru_rb_backward_candidate_unit(const BackwardStep<S>& st, int64_t b, int64_t j) {
  using A = acc_t<S>;
  const int64_t B = st.B, H = st.H;
  const int64_t p = st.pos(b);
  if (p < 0) return backward_finished(st, b, j);
  const A* w = st.ws + (p * B + b) * 3 * H;
  const auto r = GruResetBeforeUnit<A>::backward_candidate(
      st.dh[b * H + j] + st.grad_out(p, b, j), w[H + j], w[2 * H + j], st.h_prev_at(b, j));
  st.write_gate(p, b, 1, j, r.dz, true);
  st.write_gate(p, b, 2, j, r.dn, false);
  st.dn[b * H + j] = Storage<S>::store(r.dn);
  st.dh[b * H + j] = r.dh_prev;
}

// Stage 2, after drh = dn W_hn: the reset gate; records r * h_prev for dW_hn.
template <typename S>
__device__ void gru_rb_backward_reset_unit(const BackwardStep<S>& st, int64_t b, int64_t j) {
  using A = acc_t<S>;
  const int64_t B = st.B, H = st.H;
  const int64_t p = st.pos(b);
  if (p < 0) return;  // stage 1 wrote the zeros
  const int64_t row = p * B + b;
  const A r = st.ws[row * 3 * H + j];
  const A h_prev = st.h_prev_at(b, j);
  const auto g = GruResetBeforeUnit<A>::backward_reset(st.drh[b * H + j], r, h_prev);
  st.write_gate(p, b, 0, j, g.dr, true);
  st.dh[b * H + j] += g.dh_prev;
  st.rh_all[row * H + j] = Storage<S>::store(r * h_prev);
}

// LSTM projection, per (b, k < P), before the cell's backward: the total
// gradient of the projected h_t, the A of  dh_full = dh_tot W_hr.
template <typename S>
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
  const S t = Storage<S>::store(st.dh[b * P + k] + st.grad_out(p, b, k));
  st.dh_tot[b * P + k] = t;
  st.dh_tot_all[(p * B + b) * P + k] = t;
  st.dh[b * P + k] = A(0);  // LSTM: h_t reaches h_{t-1} only through the gates
}

}  // namespace rnnkern::cuda

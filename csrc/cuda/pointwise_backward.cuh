// The pointwise part of one backward time step, per (batch row b, hidden
// unit j): the cell's gate gradients (cells.h) around the carried gradients
// of the state, finished sequences and the GEMMs' inputs, for every cell; run
// by the kernels of recurrence_backward.cuh.  Conventions as in
// pointwise_forward.cuh; the step options:
//   * resets: the carried gradient of a reset step's starting state moves to
//     dh0_reset / dc0_reset and the carry restarts at 0 (take_dh, take_dc);
//     reset_h / reset_c (h0 / c0 unless given) are the previous state of a
//     reset step (h_start / c_start, set per step);
//   * zoneout: the gradient of the blend splits between the state the step
//     started from and the cell (the LSTMs recompute c~ = f c_prev + i g).
// The LayerNorm cell (LSTM-LN): lstm_ln_backward_row, one block per batch row.
#pragma once

#include "common.cuh"

namespace rnnkern::cuda {

// The per-unit stages of a backward step, as kernels' template parameters.
enum class BackwardPhase { RnnTanh, RnnRelu, Lstm, Gru, GruRbCandidate, GruRbReset, Projection };

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
  const S* reset_h;  // h0 unless given
  const S* reset_c;  // c0 unless given
  // The state of a step that has no previous one, set with s (start_at): h0
  // (c0) at step 0, the reset state after.  One pointer, chosen by the loop,
  // not two chosen per unit: that select cost the LSTM-LN row kernel a spill.
  const S* h_start;
  const S* c_start;
  const S* out;
  const A* ws;

  int64_t G;          // gates per unit
  S* dx;              // [T, B, G*H]
  A* dh;              // [B, P] carry
  A* dc;              // [B, H] carry (LSTM)
  const S* gc_steps;  // [T, B, H] gradient of every step's c (cell_steps), or null
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
  A* dh0_reset;        // [B, P] gradient of reset_h through the reset steps
  A* dc0_reset;        // [B, H] of reset_c
  const S* zo;         // [T, B, Z] zoneout mask with strides zo_st, zo_sb
  int64_t zo_st, zo_sb;
  const S* ln;         // [10H] LSTM-LN
  S* dhproj_all;       // [T, B, 4H] LSTM-LN
  A* ln_scratch;       // [B, 4H] LSTM-LN
  A* ln_grads;         // [B, 14H] LSTM-LN
  A inv_h, inv_4h;     // LSTM-LN: 1 / H, 1 / (4H), divided on the host (no division
                       // subroutine in the row kernel, whose call would save registers)

  __device__ int64_t pos(int64_t b) const { return position(lengths, T, reverse, b, s); }
  // Step s and the start states it reads.
  __host__ __device__ void start_at(int64_t step) {
    s = step;
    h_start = step == 0 ? h0 : reset_h;
    c_start = step == 0 ? c0 : reset_c;
  }
  // Position of the row's previous step (its h_{t-1}), or -1: h_start (the
  // row's first step, or with kResets a step that resets).  For a running row.
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
    return q < 0 ? load_at<A>(h_start, b * P + j) : load_at<A>(out, (q * B + b) * P + j);
  }
  // Whether row b's step s + 1 (processed just before this one) reset.
  __device__ bool reset_next(int64_t b) const {
    const int64_t q = position(lengths, T, reverse, b, s + 1);
    return q >= 0 && resets[q * B + b];
  }
  // The carried gradient of the state row b's step s + 1 started from, as
  // the gradient of the state step s ends with: with kResets, 0 where that
  // step reset (its starting state was the reset state: the carry goes to
  // dh0_reset, dc0_reset).  The first kernel of a step that reads the carry takes it.
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
  const A c_prev = q < 0 ? load_at<A>(st.c_start, b * H + j) : st.ws[(q * B + b) * 5 * H + 4 * H + j];
  const A dc = st.template take_dc<kResets>(b, j) +
               (st.gc_steps != nullptr ? load_at<A>(st.gc_steps, row * H + j) : A(0));
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
    const A c_prev = q < 0 ? load_at<A>(st.c_start, b * H + j) : ln_ws_row(st.ws, q, b, B, H)[4 * H + j];
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

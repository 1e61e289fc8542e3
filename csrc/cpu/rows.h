// The CPU recurrence's pointwise row kernels: one batch row of one step,
// forward and backward, for every cell (the formulas are cells.h's), and the
// per-row inputs they are driven with (time positions, resets, zoneout).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../cells.h"
#include "isa.h"

namespace rnnkern::cpu {

// ------------------------------------------------------------------------
// Which time position each batch row works on at step s.
struct Positions {
  const int64_t* lengths;  // null: every sequence has T steps
  int64_t T;
  bool reverse;
  int64_t B;                         // batch rows: the grid's stride along T
  const int64_t* offsets = nullptr;  // packed rows: each step's first row; null: the grid

  // The row of time position p of sequence b in xproj, the output, the
  // workspace and their gradients: p * B + b in the [T, B] grid, or with packed
  // rows (RecurrenceSizes::packed_rows: lengths sorted longest first) the
  // rows of the steps before p, plus b.
  int64_t row(int64_t p, int64_t b) const { return offsets ? offsets[p] + b : p * B + b; }
  // Whether the layout holds the positions past a sequence's length (the
  // grid), which a finished row fills with zeros.  Packed rows have none.
  bool padded() const { return offsets == nullptr; }

  int64_t length(int64_t b) const { return lengths ? lengths[b] : T; }
  // Time position of sequence b at step s, or -1 once the sequence has ended.
  int64_t at(int64_t b, int64_t s) const {
    const int64_t n = length(b);
    return s < n ? (reverse ? n - 1 - s : s) : -1;
  }
  // Of rows [b0, b0 + nb), how many from b0 on a step's products must cover:
  // up to the last row still running at step s (in either direction a row
  // runs while s < its length).  A finished row keeps its state without a
  // product, so a batch whose lengths fall along its rows -- a packed batch,
  // sorted longest first -- costs its real steps, not rows x longest.
  int64_t live_rows(int64_t b0, int64_t nb, int64_t s) const {
    if (!lengths) return nb;
    int64_t k = nb;
    while (k > 0 && lengths[b0 + k - 1] <= s) --k;
    return k;
  }
};

template <typename A>
void copy_row(A* dst, const A* src, int64_t n) {
  std::memcpy(dst, src, sizeof(A) * n);
}
template <typename A>
void zero_row(A* dst, int64_t n) {
  std::memset(dst, 0, sizeof(A) * n);
}

// ------------------------------------------------------------------------
// The options of a call (resets, zoneout), read per batch row at its time
// position.  Absent options are null pointers; the drivers test them once per
// row, never per element (the row kernels take them as template flags).
template <typename A>
struct Options {
  const bool* resets = nullptr;  // [T, B] contiguous
  int64_t B = 0;
  const A* zone = nullptr;       // zoneout mask: unit k of row (p, b) at zone[p*zt + b*zb + k]
  int64_t zt = 0, zb = 0;        // its strides along T and B (0 for an evaluation-mode mask)
  int64_t zc = 0;                // where its c part starts (P; cells with a cell state)

  // Whether the step at time position p of row b restarts: from the reset
  // state (ForwardArgs::reset_h; h0 unless given), at any step but the row's
  // first (the drivers check that).
  bool restart(int64_t p, int64_t b) const { return resets != nullptr && p >= 0 && resets[p * B + b]; }
  // The mask row of (p, b): h part at [0, P), c part at [zc, zc + H).
  const A* mask(int64_t p, int64_t b) const { return zone ? zone + p * zt + b * zb : nullptr; }
};

// Calls f(std::bool_constant<v>{}): a runtime flag as a template argument.
template <typename F>
decltype(auto) bool_switch(bool v, F&& f) {
  return v ? f(std::true_type{}) : f(std::false_type{});
}

// ------------------------------------------------------------------------
// Row kernels: one batch row, the hidden units [j0, j0 + n) of one step.
// Arrays with one value per gate and unit (xproj, bias, workspace, gate
// gradients) hold gate k of unit j at k*ld + j (ld = H; pointers offset by
// j0); the thread's own hproj slice holds it at k*ldh + j (ldh = n).  Arrays
// with one value per unit (h, c, dh) are plain.
//
// With zoneout (kZone) the state a step ends with blends the state it started
// from (h_prev, c_prev: h0, c0 after a reset) with the cell's update, per
// unit with the mask row m (mh, mc: its h and c parts), as Zoneout in cells.h.

template <typename A, bool kRelu, bool kSave, bool kZone>
RNNKERN_CPU_CLONES void rnn_forward_row(int64_t n, const A* __restrict x, const A* __restrict hh,
                                        const A* __restrict bias, A* __restrict h,
                                        const A* __restrict h_prev, const A* __restrict m,
                                        A* __restrict ws) {
  for (int64_t j = 0; j < n; ++j) {
    const A cand = RnnUnit<A, kRelu>::forward(x[j], hh[j] + bias[j]);
    if constexpr (kZone) {
      if constexpr (kSave) ws[j] = cand;  // the backward needs h~, the output is blended
      h[j] = Zoneout<A>::forward(m[j], h_prev[j], cand);
    } else {
      h[j] = cand;
    }
  }
}

// kZoneC blends c, kZoneH blends h (not with a projection: the projected h is
// blended after its product).  The workspace keeps the blended c.
//
// In two passes over the row (chunks of up to 512 units): each gate's
// activations, one stream of xproj, hproj and the bias in order, then c and
// h.  Unit by unit, all five of a unit's exp and tanh and its c, h formed a
// chain of dependent operations longer than the core's out-of-order window
// holds, and its eight streams of inputs (4 gates of xproj and hproj) outran
// the hardware prefetchers.  Gate math alone on Zen 3, ns a unit with xproj
// from memory, without / with the workspace: B=64 H=128 8.9 / 15.0 -> 6.3 /
// 7.4; B=32 H=256 8.7 / 14.6 -> 6.1 / 6.8; B=8 H=512 5.6 / 7.2 -> 4.8 / 5.6.
// Shorter chunks were slower where they cut a gate's stream into pieces
// (64 units at B=32 H=256: 9.8 / 14.0).  The gates go where the backward wants
// them (the workspace) or to a chunk on the stack.
template <typename A, int kGate>
RNNKERN_CPU_CLONES void lstm_gate_pass(int64_t n, const A* __restrict x, const A* __restrict hh,
                                       const A* __restrict bias, A* __restrict gate) {
  for (int64_t j = 0; j < n; ++j) gate[j] = LstmUnit<A>::template gate<kGate>(x[j] + hh[j] + bias[j]);
}

template <typename A, bool kSave, bool kZoneC, bool kZoneH>
RNNKERN_CPU_CLONES void lstm_forward_row(int64_t n, int64_t ld, int64_t ldh,
                                         const A* __restrict x, const A* __restrict hh,
                                         const A* __restrict bias, const A* __restrict c_prev,
                                         A* __restrict c, A* __restrict h, A* __restrict ws,
                                         const A* __restrict h_prev, const A* __restrict mh,
                                         const A* __restrict mc) {
  constexpr int64_t kChunk = 512;
  A scratch[kSave ? 1 : 4 * kChunk];
  for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
    const int64_t m = std::min(kChunk, n - j0);
    // Gate k of unit j0 + j at g + k * ldg + j.
    A* g = kSave ? ws + j0 : scratch;
    const int64_t ldg = kSave ? ld : kChunk;
    lstm_gate_pass<A, 0>(m, x + j0, hh + j0, bias + j0, g);
    lstm_gate_pass<A, 1>(m, x + ld + j0, hh + ldh + j0, bias + ld + j0, g + ldg);
    lstm_gate_pass<A, 2>(m, x + 2 * ld + j0, hh + 2 * ldh + j0, bias + 2 * ld + j0, g + 2 * ldg);
    lstm_gate_pass<A, 3>(m, x + 3 * ld + j0, hh + 3 * ldh + j0, bias + 3 * ld + j0, g + 3 * ldg);
    const A* __restrict gi = g;
    const A* __restrict gf = g + ldg;
    const A* __restrict gg = g + 2 * ldg;
    const A* __restrict go = g + 3 * ldg;
    for (int64_t j = 0; j < m; ++j) {
      const int64_t u = j0 + j;
      const A c_cand = LstmUnit<A>::candidate(gi[j], gf[j], gg[j], c_prev[u]);
      const A h_cand = LstmUnit<A>::hidden(go[j], c_cand);
      A c_new = c_cand, h_new = h_cand;
      if constexpr (kZoneC) c_new = Zoneout<A>::forward(mc[u], c_prev[u], c_cand);
      if constexpr (kZoneH) h_new = Zoneout<A>::forward(mh[u], h_prev[u], h_cand);
      c[u] = c_new;
      h[u] = h_new;
      if constexpr (kSave) ws[4 * ld + u] = c_new;
    }
  }
}

// The candidate keeps b_in (bx) and b_hn (bh) apart: n = tanh(xn + b_in + r * (hn + b_hn)).
template <typename A, bool kSave, bool kZone>
RNNKERN_CPU_CLONES void gru_forward_row(int64_t n, int64_t ld, int64_t ldh,
                                        const A* __restrict x, const A* __restrict hh,
                                        const A* __restrict bx, const A* __restrict bh,
                                        const A* __restrict h_prev, A* __restrict h,
                                        A* __restrict ws, const A* __restrict m) {
  for (int64_t j = 0; j < n; ++j) {
    const A hn = hh[2 * ldh + j] + bh[2 * ld + j];
    const auto r = GruUnit<A>::forward(x[j] + bx[j], x[ld + j] + bx[ld + j],
                                       x[2 * ld + j] + bx[2 * ld + j], hh[j] + bh[j],
                                       hh[ldh + j] + bh[ld + j], hn, h_prev[j]);
    if constexpr (kZone)
      h[j] = Zoneout<A>::forward(m[j], h_prev[j], r.h);
    else
      h[j] = r.h;
    if constexpr (kSave) {
      ws[j] = r.r;
      ws[ld + j] = r.z;
      ws[2 * ld + j] = r.n;
      ws[3 * ld + j] = hn;
    }
  }
}

// Reset-before GRU, stage 1: r and z (kept in rz, stride ldh) and r * h_prev.
// rz overwrites hh in place (element by element), so the two are not restrict.
template <typename A>
RNNKERN_CPU_CLONES void gru_rb_gates_row(int64_t n, int64_t ld, int64_t ldh,
                                         const A* __restrict x, const A* hh,
                                         const A* __restrict bias, const A* __restrict h_prev,
                                         A* rz, A* __restrict rh) {
  for (int64_t j = 0; j < n; ++j) {
    const auto g = GruResetBeforeUnit<A>::gates(x[j], x[ld + j], hh[j] + bias[j],
                                                hh[ldh + j] + bias[ld + j], h_prev[j]);
    rz[j] = g.r;
    rz[ldh + j] = g.z;
    rh[j] = g.rh;
  }
}

// Stage 2: hn = (r * h_prev) W_hn^T, the candidate and h.
template <typename A, bool kSave, bool kZone>
RNNKERN_CPU_CLONES void gru_rb_candidate_row(int64_t n, int64_t ld, int64_t ldh,
                                             const A* __restrict x, const A* __restrict hn,
                                             const A* __restrict bias, const A* __restrict rz,
                                             const A* __restrict h_prev, A* __restrict h,
                                             A* __restrict ws, const A* __restrict m) {
  for (int64_t j = 0; j < n; ++j) {
    const auto c = GruResetBeforeUnit<A>::candidate(x[2 * ld + j], hn[j] + bias[2 * ld + j],
                                                    rz[ldh + j], h_prev[j]);
    if constexpr (kZone)
      h[j] = Zoneout<A>::forward(m[j], h_prev[j], c.h);
    else
      h[j] = c.h;
    if constexpr (kSave) {
      ws[j] = rz[j];
      ws[ld + j] = rz[ldh + j];
      ws[2 * ld + j] = c.n;
    }
  }
}

// Zoneout of a whole row of values: out = m prev + (1 - m) cand (the
// projected h of an LSTM with a projection).
template <typename A>
RNNKERN_CPU_CLONES void zoneout_row(int64_t n, const A* __restrict m, const A* __restrict prev,
                                    const A* __restrict cand, A* __restrict out) {
  for (int64_t j = 0; j < n; ++j) out[j] = Zoneout<A>::forward(m[j], prev[j], cand[j]);
}

// Mean and (biased) variance of v[0, n), in double: a layer norm's row statistics.
template <typename A>
RNNKERN_CPU_CLONES void row_moments(int64_t n, const A* __restrict v, double& mean, double& var) {
  double s = 0.0;
  for (int64_t j = 0; j < n; ++j) s += static_cast<double>(v[j]);
  const double mu = n > 0 ? s / static_cast<double>(n) : 0.0;
  double q = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const double d = static_cast<double>(v[j]) - mu;
    q += d * d;
  }
  mean = mu;
  var = n > 0 ? q / static_cast<double>(n) : 0.0;
}

// LSTM-LN, one batch row, all H units (its layer norms need whole rows):
// x, hh: the row's raw x W_ih^T and h_{t-1} W_hh^T (gate k of unit j at
// k*H + j); bias: b_ih + b_hh; ln: [g_ih (4H), g_hh (4H), g_c (H), beta_c (H)];
// ws: the row's workspace (cells.h layout: i, f, g, o, c, x^ (4), h^ (4), c^,
// then the three rstd), a scratch row when not training.
template <typename A, bool kZone>
RNNKERN_CPU_CLONES void lstm_ln_forward_row(int64_t H, const A* __restrict x,
                                            const A* __restrict hh, const A* __restrict bias,
                                            const A* __restrict ln, const A* __restrict h_prev,
                                            const A* __restrict c_prev, const A* __restrict mh,
                                            const A* __restrict mc, A* __restrict ws,
                                            A* __restrict c, A* __restrict h) {
  const int64_t G4 = 4 * H;
  const A *g_ih = ln, *g_hh = ln + G4, *g_c = ln + 2 * G4, *beta_c = ln + 2 * G4 + H;
  A *xhat = ws + 5 * H, *hhat = ws + 9 * H, *chat = ws + 13 * H;
  double mean, var;
  row_moments(G4, x, mean, var);
  const A mean_x = static_cast<A>(mean), rstd_x = LayerNorm<A>::rstd(static_cast<A>(var));
  row_moments(G4, hh, mean, var);
  const A mean_h = static_cast<A>(mean), rstd_h = LayerNorm<A>::rstd(static_cast<A>(var));
  for (int64_t k = 0; k < G4; ++k) {
    xhat[k] = LayerNorm<A>::normalize(x[k], mean_x, rstd_x);
    hhat[k] = LayerNorm<A>::normalize(hh[k], mean_h, rstd_h);
  }
  // Gates, and the candidate cell c~ (in c^'s place until its statistics are known).
  for (int64_t j = 0; j < H; ++j) {
    A pre[4];
    for (int64_t k = 0; k < 4; ++k) {
      const int64_t e = k * H + j;
      pre[k] = LstmLnUnit<A>::pre_activation(xhat[e], hhat[e], g_ih[e], g_hh[e], bias[e]);
    }
    const A i = sigmoid(pre[0]), f = sigmoid(pre[1]), g = Math<A>::tanh(pre[2]),
            o = sigmoid(pre[3]);
    ws[j] = i;
    ws[H + j] = f;
    ws[2 * H + j] = g;
    ws[3 * H + j] = o;
    chat[j] = LstmUnit<A>::candidate(i, f, g, c_prev[j]);
  }
  row_moments(H, chat, mean, var);
  const A mean_c = static_cast<A>(mean), rstd_c = LayerNorm<A>::rstd(static_cast<A>(var));
  for (int64_t j = 0; j < H; ++j) {
    const A cand = chat[j];
    const A ch = LayerNorm<A>::normalize(cand, mean_c, rstd_c);
    chat[j] = ch;
    const A h_new = LstmLnUnit<A>::output(ws[3 * H + j], ch, g_c[j], beta_c[j]);
    const A c_new = kZone ? Zoneout<A>::forward(mc[j], c_prev[j], cand) : cand;
    ws[4 * H + j] = c_new;
    c[j] = c_new;
    h[j] = kZone ? Zoneout<A>::forward(mh[j], h_prev[j], h_new) : h_new;
  }
  ws[14 * H] = rstd_x;
  ws[14 * H + 1] = rstd_h;
  ws[14 * H + 2] = rstd_c;
}

// Backward row kernels.  dh_io holds the gradient carried from step t+1 on
// entry (gout, the gradient of this step's output, is added) and the direct
// part of dh_{t-1} on exit; the GEMM part is added by the next step.
// dx: the xproj-gradient row at the time position; da: the gradient of the
// recurrent projection, which the next step's GEMM reads.  Both stride ld.
// For RNN and LSTM the two are the same numbers: those row kernels write da
// only, and the driver either has da point into d_xproj or copies it there.
// With zoneout the gradient d of a state splits into m d, straight to the
// state the step started from (the direct part), and (1 - m) d into the cell.

// h: the output h_t, or with zoneout the candidate h~_t (from the workspace).
template <typename A, bool kRelu, bool kZone>
RNNKERN_CPU_CLONES void rnn_backward_row(int64_t n, A* __restrict dh_io, const A* __restrict gout,
                                         const A* __restrict h, A* __restrict da,
                                         const A* __restrict m) {
  for (int64_t j = 0; j < n; ++j) {
    const A d = dh_io[j] + gout[j];
    if constexpr (kZone) {
      da[j] = RnnUnit<A, kRelu>::backward(Zoneout<A>::to_candidate(m[j], d), h[j]);
      dh_io[j] = Zoneout<A>::to_prev(m[j], d);
    } else {
      da[j] = RnnUnit<A, kRelu>::backward(d, h[j]);
      dh_io[j] = A(0);
    }
  }
}

// With a projection, dh is the gradient of the unprojected h_t (already the
// whole of it, zoneout applied) and h_full receives o * tanh(c) for the
// gradient of W_hr.  With zoneout the workspace holds the blended c_t: the
// candidate c~ that h_t was computed from is recomputed (LstmUnit::candidate).
template <typename A, bool kProj, bool kZone>
RNNKERN_CPU_CLONES void lstm_backward_row(int64_t n, int64_t ld, A* __restrict dh_io,
                                          const A* __restrict gout, A* __restrict dc_io,
                                          const A* __restrict ws, const A* __restrict c_prev,
                                          A* __restrict da, A* __restrict h_full,
                                          const A* __restrict mh, const A* __restrict mc) {
  for (int64_t j = 0; j < n; ++j) {
    const A dh = kProj ? dh_io[j] : dh_io[j] + gout[j];
    const A i = ws[j], f = ws[ld + j], g = ws[2 * ld + j], o = ws[3 * ld + j];
    const A dc = dc_io[j];
    A c = ws[4 * ld + j], dh_cand = dh, dc_cand = dc;
    if constexpr (kZone) {
      c = LstmUnit<A>::candidate(i, f, g, c_prev[j]);
      dc_cand = Zoneout<A>::to_candidate(mc[j], dc);
      if constexpr (!kProj) dh_cand = Zoneout<A>::to_candidate(mh[j], dh);
    }
    const auto r = LstmUnit<A>::backward(dh_cand, dc_cand, i, f, g, o, c, c_prev[j]);
    da[j] = r.di;
    da[ld + j] = r.df;
    da[2 * ld + j] = r.dg;
    da[3 * ld + j] = r.do_;
    if constexpr (kZone)
      dc_io[j] = r.dc_prev + Zoneout<A>::to_prev(mc[j], dc);
    else
      dc_io[j] = r.dc_prev;
    if constexpr (kProj) {
      h_full[j] = o * Math<A>::tanh(c);
    } else if constexpr (kZone) {
      dh_io[j] = Zoneout<A>::to_prev(mh[j], dh);
    } else {
      dh_io[j] = A(0);
    }
  }
}

// dhn: the gradient of W_hn h + b_hn, kept in time order for dW_hn.
template <typename A, bool kZone>
RNNKERN_CPU_CLONES void gru_backward_row(int64_t n, int64_t ld, A* __restrict dh_io,
                                         const A* __restrict gout, const A* __restrict ws,
                                         const A* __restrict h_prev, A* __restrict dx,
                                         A* __restrict da, A* __restrict dhn,
                                         const A* __restrict m) {
  for (int64_t j = 0; j < n; ++j) {
    const A d = dh_io[j] + gout[j];
    const A d_cand = kZone ? Zoneout<A>::to_candidate(m[j], d) : d;
    const auto r = GruUnit<A>::backward(d_cand, ws[j], ws[ld + j], ws[2 * ld + j],
                                        ws[3 * ld + j], h_prev[j]);
    dx[j] = da[j] = r.dr;
    dx[ld + j] = da[ld + j] = r.dz;
    dx[2 * ld + j] = r.dxn;
    da[2 * ld + j] = dhn[j] = r.dhn;
    if constexpr (kZone)
      dh_io[j] = r.dh_prev + Zoneout<A>::to_prev(m[j], d);
    else
      dh_io[j] = r.dh_prev;
  }
}

// Reset-before GRU, stage 1: z and the candidate; dn (plain) feeds the GEMM
// drh = dn W_hn between the stages.  da holds [dr, dz] (stride ld).
template <typename A, bool kZone>
RNNKERN_CPU_CLONES void gru_rb_backward_candidate_row(int64_t n, int64_t ld, A* __restrict dh_io,
                                                      const A* __restrict gout,
                                                      const A* __restrict ws,
                                                      const A* __restrict h_prev,
                                                      A* __restrict dx, A* __restrict da,
                                                      A* __restrict dn, const A* __restrict m) {
  for (int64_t j = 0; j < n; ++j) {
    const A d = dh_io[j] + gout[j];
    const A d_cand = kZone ? Zoneout<A>::to_candidate(m[j], d) : d;
    const auto r = GruResetBeforeUnit<A>::backward_candidate(d_cand, ws[ld + j],
                                                             ws[2 * ld + j], h_prev[j]);
    dx[ld + j] = da[ld + j] = r.dz;
    dx[2 * ld + j] = dn[j] = r.dn;
    if constexpr (kZone)
      dh_io[j] = r.dh_prev + Zoneout<A>::to_prev(m[j], d);
    else
      dh_io[j] = r.dh_prev;
  }
}

// Stage 2: the reset gate from drh.  Also records r * h_prev, the input of
// W_hn, in time order for dW_hn.
template <typename A>
RNNKERN_CPU_CLONES void gru_rb_backward_reset_row(int64_t n, A* __restrict dh_io,
                                                  const A* __restrict drh, const A* __restrict ws,
                                                  const A* __restrict h_prev, A* __restrict dx,
                                                  A* __restrict da, A* __restrict rh) {
  for (int64_t j = 0; j < n; ++j) {
    const A r = ws[j];
    const auto g = GruResetBeforeUnit<A>::backward_reset(drh[j], r, h_prev[j]);
    dx[j] = da[j] = g.dr;
    dh_io[j] += g.dh_prev;
    rh[j] = r * h_prev[j];
  }
}

// LSTM with a projection and zoneout, the total gradient of the projected h_t
// (carry d_io plus gout): (1 - m) d into the projection (dt), m d carried on
// to h_{t-1} (the direct part, left in d_io).
template <typename A>
RNNKERN_CPU_CLONES void zoneout_total_row(int64_t n, A* __restrict d_io, const A* __restrict gout,
                                          const A* __restrict m, A* __restrict dt) {
  for (int64_t j = 0; j < n; ++j) {
    const A d = d_io[j] + gout[j];
    dt[j] = Zoneout<A>::to_candidate(m[j], d);
    d_io[j] = Zoneout<A>::to_prev(m[j], d);
  }
}

// LSTM-LN backward, one batch row, all H units (the layer norms' backward
// needs the row means of their gradients).  dh_io, dc_io: as in
// lstm_backward_row (dc_io: the gradient of c_t in, of c_{t-1} out); ws: the
// row's workspace; dchat: scratch [H]; dx: the row of d xproj (the raw
// x W_ih^T, through LN_x's backward), da: the gradient of the raw
// h_{t-1} W_hh^T (through LN_h's backward), the next step's GEMM input; both
// 4H.  acc: the row's share of the parameters' sums, in double:
// [d pre-activation (4H: the bias gradient), d g_ih (4H), d g_hh (4H),
//  d g_c (H), d beta_c (H)].
template <typename A, bool kZone>
RNNKERN_CPU_CLONES void lstm_ln_backward_row(int64_t H, A* __restrict dh_io,
                                             const A* __restrict gout, A* __restrict dc_io,
                                             const A* __restrict ws, const A* __restrict c_prev,
                                             const A* __restrict ln, const A* __restrict mh,
                                             const A* __restrict mc, A* __restrict dchat,
                                             A* __restrict dx, A* __restrict da,
                                             double* __restrict acc) {
  const int64_t G4 = 4 * H;
  const A *g_ih = ln, *g_hh = ln + G4, *g_c = ln + 2 * G4, *beta_c = ln + 2 * G4 + H;
  const A *xhat = ws + 5 * H, *hhat = ws + 9 * H, *chat = ws + 13 * H;
  const A rstd_x = ws[14 * H], rstd_h = ws[14 * H + 1], rstd_c = ws[14 * H + 2];
  const double inv_h = H > 0 ? 1.0 / static_cast<double>(H) : 0.0;
  const double inv_g = H > 0 ? 1.0 / static_cast<double>(G4) : 0.0;
  double* acc_pre = acc;
  double* acc_g_ih = acc + G4;
  double* acc_g_hh = acc + 2 * G4;
  double* acc_g_c = acc + 3 * G4;
  double* acc_beta_c = acc + 3 * G4 + H;
  // h~ = o tanh(c^ g_c + beta_c): the output gate (its pre-activation
  // gradient waits in dx's o block) and the gradient of c^.
  double s1 = 0.0, s2 = 0.0;
  for (int64_t j = 0; j < H; ++j) {
    const A d = dh_io[j] + gout[j];
    A d_cand = d;
    if constexpr (kZone) {
      d_cand = Zoneout<A>::to_candidate(mh[j], d);
      dh_io[j] = Zoneout<A>::to_prev(mh[j], d);
    } else {
      dh_io[j] = A(0);
    }
    const auto r = LstmLnUnit<A>::backward_output(d_cand, ws[3 * H + j], chat[j], g_c[j], beta_c[j]);
    dx[3 * H + j] = r.do_;
    dchat[j] = r.dchat;
    acc_g_c[j] += static_cast<double>(r.dy) * static_cast<double>(chat[j]);
    acc_beta_c[j] += static_cast<double>(r.dy);
    s1 += static_cast<double>(r.dchat);
    s2 += static_cast<double>(r.dchat) * static_cast<double>(chat[j]);
  }
  const A m1 = static_cast<A>(s1 * inv_h), m2 = static_cast<A>(s2 * inv_h);
  // c~ through LN_c, plus (zoneout's share of) the carried gradient of c_t.
  for (int64_t j = 0; j < H; ++j) {
    const A dc = dc_io[j];
    const A d_cand = LayerNorm<A>::backward(dchat[j], chat[j], rstd_c, m1, m2) +
                     (kZone ? Zoneout<A>::to_candidate(mc[j], dc) : dc);
    const auto r = LstmLnUnit<A>::backward_gates(d_cand, ws[j], ws[H + j], ws[2 * H + j], c_prev[j]);
    dx[j] = r.di;
    dx[H + j] = r.df;
    dx[2 * H + j] = r.dg;
    dc_io[j] = kZone ? r.dc_prev + Zoneout<A>::to_prev(mc[j], dc) : r.dc_prev;
  }
  // The pre-activations a = x^ g_ih + h^ g_hh + b: the parameters' sums and
  // the statistics of both layer norms' backward.
  double sx1 = 0.0, sx2 = 0.0, sh1 = 0.0, sh2 = 0.0;
  for (int64_t k = 0; k < G4; ++k) {
    const A dp = dx[k];
    const double dpd = static_cast<double>(dp);
    acc_pre[k] += dpd;
    acc_g_ih[k] += dpd * static_cast<double>(xhat[k]);
    acc_g_hh[k] += dpd * static_cast<double>(hhat[k]);
    const double dxh = static_cast<double>(dp * g_ih[k]), dhh = static_cast<double>(dp * g_hh[k]);
    sx1 += dxh;
    sx2 += dxh * static_cast<double>(xhat[k]);
    sh1 += dhh;
    sh2 += dhh * static_cast<double>(hhat[k]);
  }
  const A mx1 = static_cast<A>(sx1 * inv_g), mx2 = static_cast<A>(sx2 * inv_g);
  const A mh1 = static_cast<A>(sh1 * inv_g), mh2 = static_cast<A>(sh2 * inv_g);
  for (int64_t k = 0; k < G4; ++k) {
    const A dp = dx[k];
    da[k] = LayerNorm<A>::backward(dp * g_hh[k], hhat[k], rstd_h, mh1, mh2);
    dx[k] = LayerNorm<A>::backward(dp * g_ih[k], xhat[k], rstd_x, mx1, mx2);
  }
}

}  // namespace rnnkern::cpu

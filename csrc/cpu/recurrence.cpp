// CPU implementations of rnnkern::recurrence, recurrence_backward, step and
// step_backward (schemas and conventions in ops.cpp).
//
// Forward, per time step: one GEMM  hproj = H_{t-1} W_hh^T  into a buffer
// allocated once, then one pass over the batch rows that adds xproj, the
// bias and applies the cell's gate math (cells.h), writing h_t, c_t and the
// workspace.  GRU with the reset gate before the product needs a second
// GEMM (on r * h) and pass; an LSTM projection a GEMM h = (o * tanh c) W_hr^T.
//
// Backward (BPTT), per step in reverse: one pass of the cell's pointwise
// backward that writes the gate gradients, then one GEMM  dH_{t-1} += dA W_hh.
// The weight gradients are one large GEMM over all steps at the end, from the
// gate gradients and the h_{t-1} the pass collected in time order.
//
// Gate math runs in float (for float, bfloat16, float16) or double; half
// inputs are converted on entry and outputs converted back.  The row loops
// are compiled for several x86 ISA levels (target_clones) and vectorise.
//
// The options beyond torch.nn (resets, zoneout, the lstm_ln cell; formulas
// in rnnkern/reference.py) run inside the same loops: per-row choices of
// the state a step starts from, template flags of the row kernels, and for
// lstm_ln row kernels of its own (see forward_impl and backward_impl).  A
// call without them runs the code it ran before they existed.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers: a much faster compile
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../cells.h"
#include "../ops.h"
#include "buffers.h"
#include "gemm.h"
#include "linear.h"
#include "parallel.h"

namespace rnnkern::cpu {
namespace {

// ------------------------------------------------------------------------
// Which time position each batch row works on at step s.
struct Positions {
  const int64_t* lengths;  // null: every sequence has T steps
  int64_t T;
  bool reverse;

  int64_t length(int64_t b) const { return lengths ? lengths[b] : T; }
  // Time position of sequence b at step s, or -1 once the sequence has ended.
  int64_t at(int64_t b, int64_t s) const {
    const int64_t n = length(b);
    return s < n ? (reverse ? n - 1 - s : s) : -1;
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

  // Whether the step at time position p of row b starts from h0 (and c0).
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
template <typename A, bool kSave, bool kZoneC, bool kZoneH>
RNNKERN_CPU_CLONES void lstm_forward_row(int64_t n, int64_t ld, int64_t ldh,
                                         const A* __restrict x, const A* __restrict hh,
                                         const A* __restrict bias, const A* __restrict c_prev,
                                         A* __restrict c, A* __restrict h, A* __restrict ws,
                                         const A* __restrict h_prev, const A* __restrict mh,
                                         const A* __restrict mc) {
  for (int64_t j = 0; j < n; ++j) {
    const auto r = LstmUnit<A>::forward(x[j] + hh[j] + bias[j],
                                        x[ld + j] + hh[ldh + j] + bias[ld + j],
                                        x[2 * ld + j] + hh[2 * ldh + j] + bias[2 * ld + j],
                                        x[3 * ld + j] + hh[3 * ldh + j] + bias[3 * ld + j],
                                        c_prev[j]);
    A c_new = r.c, h_new = r.h;
    if constexpr (kZoneC) c_new = Zoneout<A>::forward(mc[j], c_prev[j], r.c);
    if constexpr (kZoneH) h_new = Zoneout<A>::forward(mh[j], h_prev[j], r.h);
    c[j] = c_new;
    h[j] = h_new;
    if constexpr (kSave) {
      ws[j] = r.i;
      ws[ld + j] = r.f;
      ws[2 * ld + j] = r.g;
      ws[3 * ld + j] = r.o;
      ws[4 * ld + j] = c_new;
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

// The bias gradients are sums over all steps and rows of the gate
// gradients; each slice adds its rows while they are still in cache (a pass
// over d_xproj afterwards would read it from memory once more).  Double
// accumulators keep sums over long sequences accurate.
template <typename A>
RNNKERN_CPU_CLONES void add_row_to_sum(int64_t n, const A* __restrict src, double* __restrict sum) {
  for (int64_t j = 0; j < n; ++j) sum[j] += static_cast<double>(src[j]);
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

// ------------------------------------------------------------------------
// Work split, one of two ways:
//  * by hidden units: each thread owns a slice of the units (or of the
//    projected outputs) for the whole call and per step runs its slice of the
//    recurrent GEMM (single-threaded) and of the gate math on data still in
//    its cache; the threads meet at the end of every phase of every step
//    (they read the previous step's full state from ping-pong buffers);
//  * by batch rows: the sequences are independent, so each thread runs the
//    whole recurrence of its rows, with all units, and the threads meet once,
//    at the end.  Each thread then reads all of W_hh every step, so this is
//    chosen when every thread gets rows enough for an efficient GEMM and
//    either W_hh is small enough to stay in cache or a step has too little
//    work to split by units.  Without the per-step meetings a thread that is
//    slowed down (a shared machine) no longer stalls the others at every
//    step: at B=32 H=256 the threads waited for each other 10-13% of the
//    time.
//  Otherwise by units only when each worker's share of a step is large
//  (kMinStepMacsPerWorker), else one thread runs the recurrence: with a
//  `while 1: pass` neighbour on one of two cores, per-step meetings made a
//  GRU on two threads 3x (B=8 H=1024) to 27x (B=1 H=1024) slower than on one.

struct Slice {
  int64_t j0, n;  // units [j0, j0 + n)
};

struct Rows {
  int64_t b0, nb;  // batch rows [b0, b0 + nb)
};

// At most max_parts slices, each at least 32 units, boundaries on
// multiples of 16 so each slice starts on a vector boundary.
std::vector<Slice> split_units(int64_t H, int64_t max_parts) {
  const int64_t parts = std::clamp<int64_t>(H / 32, 1, std::max<int64_t>(max_parts, 1));
  std::vector<Slice> slices;
  int64_t j0 = 0;
  for (int64_t t = 0; t < parts; ++t) {
    const int64_t j1 = t + 1 == parts ? H : (H * (t + 1) / parts) / 16 * 16;
    slices.push_back({j0, j1 - j0});
    j0 = j1;
  }
  return slices;
}

// Split by rows, each worker reads all of W_hh every step for its own rows (one
// parallel region per call, no meeting per step): worth it down to 2 rows a
// worker.  LSTM B=4 T=2048 H=128, 2 threads, Zen 3, vs torch.nn: one thread (the
// step too small to split by units) 0.87x fwd / 1.35x fwd+bwd; by rows of 2,
// 1.07x / 1.54x.
constexpr int64_t kMinRowsPerThread = 2;
constexpr int64_t kMaxSharedWeightBytes = int64_t(2) << 20;
// Split by units, the threads meet at every phase of every step: a worker
// takes a slice only if its share of a step's recurrent GEMM has this many
// multiply-adds.  Below, one thread runs the step faster than two that wait
// for each other, and on a machine where a core is taken by another process
// each meeting can cost a scheduler time slice (parallel.h).
constexpr int64_t kMinStepMacsPerWorker = int64_t(1) << 24;
// The weights of the per-step products are packed once per call when its
// steps reuse them, and read where they lie when the call has a single step.
// Packing costs about two passes over a weight: at T = 1 more than the
// product itself (GRU B=1 H=256 T=1 ran at 0.35x torch.nn's speed).  The
// forward packs W_hh^T at any batch when T > 1: with one or two rows a step
// (a matrix-vector product) the packed kernel's two-panel form beats dot
// products with the rows of W_hh, which end in a horizontal sum per output
// (LSTM H = 128: 1.1 us against 2.5 us a step on Zen 5).  The backward's
// W_hh is row-major already, so with at most kMaxInPlaceRows rows a step it
// reads its panels in place.  Not cached between calls: a weight can change
// without its version counter noticing (writes through .data or numpy), and a
// stale cache would be a silently wrong answer.
constexpr int64_t kMaxInPlaceRows = 2;

struct Split {
  bool by_rows = false;
  std::vector<Rows> rows;    // per worker (by rows), else {0, B}
  std::vector<Slice> units;  // per worker (by units), else {0, H}
  std::vector<Slice> outs;   // the projection's outputs, likewise; empty without one

  Split(const RecurrenceSizes& z, size_t elem_bytes) {
    const int64_t threads = at::get_num_threads();
    const int64_t step_macs = z.B * (z.G * z.H * z.P + (z.has_proj ? z.P * z.H : 0));
    const int64_t step_workers = std::min<int64_t>(threads, step_macs / kMinStepMacsPerWorker);
    const int64_t parts = std::min<int64_t>(threads, z.B / kMinRowsPerThread);
    const int64_t weight_bytes = (z.G * z.H * z.P + (z.has_proj ? z.P * z.H : 0)) * elem_bytes;
    // By rows when W_hh stays in cache, or when a step has too little work
    // to split by units.
    by_rows = parts > 1 && (weight_bytes <= kMaxSharedWeightBytes || step_workers < 2);
    if (by_rows) {
      for (int64_t t = 0; t < parts; ++t) rows.push_back({z.B * t / parts, z.B * (t + 1) / parts - z.B * t / parts});
      units = {{0, z.H}};
      if (z.has_proj) outs = {{0, z.P}};
    } else {
      rows = {{0, z.B}};
      units = split_units(z.H, step_workers);
      if (z.has_proj) outs = split_units(z.P, step_workers);
    }
  }
  // Workers of the phases over units and over projected outputs; worker t's
  // rows and the index of its unit (output) slice.
  size_t unit_workers() const { return by_rows ? rows.size() : units.size(); }
  size_t out_workers() const { return outs.empty() ? 0 : by_rows ? rows.size() : outs.size(); }
  const Rows& rows_of(size_t t) const { return rows[by_rows ? t : 0]; }
  size_t slice_of(size_t t) const { return by_rows ? 0 : t; }
  // What worker t of a phase covers: its rows, and its slice with the
  // slice's index (for the per-slice packed weights).
  struct Work {
    Rows r;
    size_t i;
    Slice sl;
  };
  Work unit_work(size_t t) const { return {rows_of(t), slice_of(t), units[slice_of(t)]}; }
  // Whether the backward's per-step products read W_hh in place (kMaxInPlaceRows).
  bool weights_in_place(int64_t T) const {
    int64_t most = 0;
    for (const Rows& r : rows) most = std::max(most, r.nb);
    return T == 1 || most <= kMaxInPlaceRows;
  }
  Work out_work(size_t t) const { return {rows_of(t), slice_of(t), outs[slice_of(t)]}; }
};

// One phase of a step: run(t, s) on workers 0 .. workers - 1 (none: skipped).
template <typename F>
struct Phase {
  size_t workers;
  F run;
};
template <typename F>
Phase<F> phase(bool active, size_t workers, F run) {
  return {active ? workers : 0, run};
}

// The time loop: by rows, each worker runs every step of its rows; by units,
// every step runs each phase on all workers before the next phase.
template <typename... F>
void run_steps(const Split& split, int64_t T, bool reverse_steps, const Phase<F>&... phases) {
  auto step_at = [&](int64_t i) { return reverse_steps ? T - 1 - i : i; };
  if (split.by_rows) {
    for_each_worker(split.rows.size(), [&](size_t t) {
      for (int64_t i = 0; i < T; ++i) ((phases.workers ? phases.run(t, step_at(i)) : void()), ...);
    });
  } else {
    for (int64_t i = 0; i < T; ++i)
      (for_each_worker(phases.workers, [&](size_t t) { phases.run(t, step_at(i)); }), ...);
  }
}

// Rows of a [G*H, K] gate-stacked weight for the units of one slice: [G*n, K].
Tensor gate_rows(const Tensor& w, int64_t G, const Slice& s) {
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

// The forward's per-step product  C[M, cols] (+)= A[M, K] W_s^T, where W_s is
// rows [j0, j0 + n) of each of `blocks` gate blocks of a row-major
// [blocks*H, K] weight (one unit slice's gates, in gate order).
template <typename A>
struct StepWeightT {
  bool in_place = false;
  gemm::PackedB<A> packed;  // !in_place
  const A* w = nullptr;     // in_place: the weight itself
  int64_t K = 0, blocks = 0, H = 0, j0 = 0, n = 0;
  int64_t cols() const { return blocks * n; }
};

template <typename A>
RNNKERN_CPU_CLONES void step_gemm(int64_t M, const A* a, int64_t lda, const StepWeightT<A>& w,
                                  A* c, bool accumulate) {
  if (!w.in_place) {
    gemm::multiply(M, a, gemm::StridesA{lda, 1}, w.packed, c, w.packed.N, accumulate);
  } else {
    // The whole weight (its gate blocks contiguous) as one block, or the slice's
    // rows of each gate block.
    const bool whole = w.n == w.H;
    for (int64_t g = 0; g < (whole ? 1 : w.blocks); ++g) {
      const A* rows = whole ? w.w : w.w + (g * w.H + w.j0) * w.K;
      const int64_t n = whole ? w.blocks * w.H : w.n;
      A* cg = c + g * w.n;
      if (accumulate)
        gemm::multiply_nt(M, a, lda, rows, w.K, n, w.K, cg, w.cols(), true);
      else
        gemm::multiply_nt_rows(M, a, lda, rows, w.K, n, w.K, cg, w.cols());
    }
  }
}

// The backward's per-step product  C[M, N] (+)= A[M, K] B, B packed or a view.
template <typename A>
RNNKERN_CPU_CLONES void step_gemm(int64_t M, const A* a, int64_t lda, const gemm::PackedB<A>& b,
                                  A* c, bool accumulate) {
  gemm::multiply(M, a, gemm::StridesA{lda, 1}, b, c, b.N, accumulate);
}

// W_s^T for hproj = h W_s^T: gate rows [j0, j0 + n) of a contiguous
// [G*H, K] weight.
template <typename A>
StepWeightT<A> gate_rows_t(const Tensor& w, int64_t G, const Slice& sl, bool in_place) {
  StepWeightT<A> s;
  s.in_place = in_place;
  s.K = w.size(1);
  s.blocks = G;
  s.H = w.size(0) / G;
  s.j0 = sl.j0;
  s.n = sl.n;
  if (in_place)
    s.w = cptr<A>(w);
  else
    s.packed.pack(cptr<A>(gate_rows(w, G, sl)), s.K, G * sl.n, 1, s.K);
  return s;
}

// Columns [j0, j0 + n) of a contiguous [K, C] weight: the B of  dh = da W[:, slice].
template <typename A>
gemm::PackedB<A> weight_cols(const Tensor& w, const Slice& sl, bool in_place) {
  if (in_place) return gemm::PackedB<A>::view_rows(cptr<A>(w) + sl.j0, w.size(0), sl.n, w.size(1));
  gemm::PackedB<A> p;
  p.pack(cptr<A>(w) + sl.j0, w.size(0), sl.n, w.size(1), 1);
  return p;
}

// ------------------------------------------------------------------------
// Forward driver.  All tensors are contiguous, of dtype A (the zoneout mask:
// unit stride along Z, any strides along T and B).
template <typename A>
struct ForwardArgs {
  const RecurrenceSizes& z;
  Tensor xproj, h0, c0, w_hh, b_x, b_h, w_hr;  // b_x, b_h: b_ih, b_hh or zeros
  Positions pos;
  bool train;
  Tensor resets, zoneout, ln;  // undefined when not given
};

template <typename A>
Options<A> options_of(const RecurrenceSizes& z, const Tensor& resets, const Tensor& zoneout) {
  Options<A> o;
  o.B = z.B;
  if (resets.defined()) o.resets = resets.template const_data_ptr<bool>();
  if (zoneout.defined()) {
    o.zone = zoneout.template const_data_ptr<A>();
    o.zt = zoneout.stride(0);
    o.zb = zoneout.stride(1);
    o.zc = z.P;
  }
  return o;
}

// Options per step, forward:
//  * resets: a restarting row reads h0, c0 where it would read the previous
//    state, and h0 W_hh^T (step 0's product of the row, kept at step 0) in
//    place of its row of the step's product: the product itself and the
//    state buffers are those of a call without resets.
//  * zoneout: the row kernels blend each new state with the one the step
//    started from (the projected h of an LSTM with a projection after its
//    product); the mask rows are read where they lie.
//  * lstm_ln: see ln_product below.
template <typename A>
void forward_impl(const ForwardArgs<A>& a, Tensor& output, Tensor& h_n, Tensor& c_n,
                  Tensor& ws) {
  const RecurrenceSizes& z = a.z;
  const int64_t T = z.T, B = z.B, H = z.H, P = z.P, G = z.G;
  const int64_t GH = G * H;
  const int64_t W = workspace_size(z.cell, H, z.has_zoneout);  // per row and step
  const int64_t nsave = workspace_width(z.cell, z.has_zoneout);
  const auto opt = a.xproj.options();
  const bool lstm = has_cell_state(z.cell);
  const bool ln_cell = z.cell == Cell::LstmLn;
  const bool reset_before = z.cell == Cell::GruResetBefore;
  const bool save = a.train;
  const Options<A> opts = options_of<A>(z, a.resets, a.zoneout);
  const bool resets = opts.resets != nullptr, zone = opts.zone != nullptr;

  // Packed weights per unit (output) slice, scratch per worker, allocated once.
  const Split split(z, sizeof(A));
  const bool in_place = T == 1;  // see kMaxInPlaceRows
  std::vector<StepWeightT<A>> w_slice, w_n_slice, w_r_slice;
  for (const Slice& sl : split.units) {
    // reset-before: the slice's r, z rows; W_hn multiplies r * h separately.
    w_slice.push_back(gate_rows_t<A>(reset_before ? a.w_hh.narrow(0, 0, 2 * H) : a.w_hh,
                                     reset_before ? 2 : G, sl, in_place));
    if (reset_before) w_n_slice.push_back(gate_rows_t<A>(a.w_hh.narrow(0, 2 * H, H), 1, sl, in_place));
  }
  for (const Slice& sl : split.outs) w_r_slice.push_back(gate_rows_t<A>(a.w_hr, 1, sl, in_place));
  std::vector<Tensor> hproj, hproj0, hn, hq;
  for (size_t t = 0; t < split.unit_workers(); ++t) {
    const auto [r, u, sl] = split.unit_work(t);
    hproj.push_back(at::empty({r.nb, w_slice[u].cols()}, opt));
    if (resets && !ln_cell) hproj0.push_back(at::empty({r.nb, w_slice[u].cols()}, opt));
    if (reset_before) hn.push_back(at::empty({r.nb, sl.n}, opt));
  }
  for (size_t t = 0; t < split.out_workers(); ++t)
    hq.push_back(at::empty({split.out_work(t).r.nb, split.out_work(t).sl.n}, opt));
  // lstm_ln: the rows' workers (all of them split by rows, one split by
  // units), the whole product's rows split by units, h0 W_hh^T with resets,
  // and a workspace row per worker for calls that keep none.
  const size_t ln_row_workers = split.by_rows ? split.rows.size() : 1;
  const Tensor hfull = ln_cell && !split.by_rows ? at::empty({B, GH}, opt) : Tensor();
  const Tensor hproj0_ln = ln_cell && resets ? at::empty({B, GH}, opt) : Tensor();
  std::vector<Tensor> ln_scratch;
  for (size_t t = 0; ln_cell && !save && t < ln_row_workers; ++t)
    ln_scratch.push_back(at::empty({W}, opt));
  // Without lengths or a projection, h_t is written straight into the
  // output (all rows of a step at one position), which is then the next
  // step's h_{t-1}: no state buffer and no copy.
  const bool h_in_out = !a.pos.lengths && !z.has_proj;
  Tensor h_buf[2] = {a.h0.clone(), h_in_out ? Tensor() : at::empty({B, P}, opt)};
  Tensor c_buf[2];
  if (lstm) c_buf[0] = a.c0.clone(), c_buf[1] = at::empty({B, H}, opt);
  const Tensor rh = reset_before ? at::empty({B, H}, opt) : Tensor();
  const Tensor h_full = z.has_proj ? at::empty({B, H}, opt) : Tensor();

  const A* xp = cptr<A>(a.xproj);
  // Every cell but the GRU candidate needs only the sum of the two biases.
  const Tensor bias_sum = a.b_x.add(a.b_h);
  const A* bias = cptr<A>(bias_sum);
  const A* bx = cptr<A>(a.b_x);
  const A* bh = cptr<A>(a.b_h);
  const A* lnp = cptr<A>(a.ln);
  // The initial states as given (h_buf[0], c_buf[0] are overwritten from step 2 on).
  const A* h0p = cptr<A>(a.h0);
  const A* c0p = lstm ? cptr<A>(a.c0) : nullptr;
  A* out = ptr<A>(output);
  A* wsp = save ? ptr<A>(ws) : nullptr;
  // The state buffers of step s.
  auto h_next_of = [&](int64_t s) {
    return h_in_out ? out + a.pos.at(0, s) * B * P : ptr<A>(h_buf[(s + 1) & 1]);
  };
  auto h_prev_of = [&](int64_t s) -> const A* {
    return h_in_out && s > 0 ? h_next_of(s - 1) : ptr<A>(h_buf[s & 1]);
  };
  auto c_prev_of = [&](int64_t s) { return lstm ? ptr<A>(c_buf[s & 1]) : nullptr; };
  auto c_next_of = [&](int64_t s) { return lstm ? ptr<A>(c_buf[(s + 1) & 1]) : nullptr; };
  // Whether row b (at time position p) restarts from h0, c0 at step s (at
  // step 0 every row starts from them anyway).
  auto restarts = [&](int64_t p, int64_t b, int64_t s) { return s > 0 && opts.restart(p, b); };

  // Phase 1, per unit slice: the slice's recurrent GEMM and gate math.
  auto gates = [&](size_t t, int64_t s) {
    const auto [r, u, sl] = split.unit_work(t);
    const int64_t j0 = sl.j0, n = sl.n;
    const A* h_prev = h_prev_of(s);
    A* h_next = h_next_of(s);
    const A* c_prev = c_prev_of(s);
    A* c_next = c_next_of(s);
    // The next step's rows of xproj, from memory into cache while this step's
    // GEMM computes: a call's xproj outgrows the caches (LSTM B=32 T=256
    // H=256: 32 MB), and a step's rows span more pages than the hardware
    // prefetchers follow.
    if (s + 1 < T) {
      for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
        const int64_t p = a.pos.at(b, s + 1);
        if (p < 0) continue;
        const char* row = reinterpret_cast<const char*>(xp + (p * B + b) * GH + j0);
        for (int64_t k = 0; k < G; ++k)
          for (int64_t off = 0; off < n * int64_t(sizeof(A)); off += 64)
            __builtin_prefetch(row + k * H * int64_t(sizeof(A)) + off);
      }
    }
    step_gemm<A>(r.nb, h_prev + r.b0 * P, P, w_slice[u], ptr<A>(hproj[t]), false);
    A* hp = ptr<A>(hproj[t]);
    const int64_t ldh = n;
    const int64_t hrow = hproj[t].size(1);
    if (resets && s == 0) copy_row(ptr<A>(hproj0[t]), hp, r.nb * hrow);  // h0 W_hh^T
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) {
        // Finished sequence: state unchanged, zeros at the padding position s.
        if (!z.has_proj) {
          copy_row(h_next + b * H + j0, h_prev + b * H + j0, n);
          zero_row(out + (s * B + b) * H + j0, n);
        }
        if (lstm) copy_row(c_next + b * H + j0, c_prev + b * H + j0, n);
        if (reset_before) zero_row(ptr<A>(rh) + b * H + j0, n);
        for (int64_t k = 0; k < nsave && save; ++k) zero_row(wsp + (s * B + b) * W + k * H + j0, n);
        continue;
      }
      const int64_t row = p * B + b;
      const A* x = xp + row * GH + j0;
      A* hh = hp + (b - r.b0) * hrow;
      A* w = save ? wsp + row * W + j0 : nullptr;
      A* h = z.has_proj ? ptr<A>(h_full) + b * H + j0 : h_next + b * P + j0;
      // The state the step starts from (h_s: unprojected cells only).
      const bool restart = restarts(p, b, s);
      if (restart) copy_row(hh, ptr<A>(hproj0[t]) + (b - r.b0) * hrow, hrow);
      const A* h_s = z.has_proj ? nullptr : (restart ? h0p : h_prev) + b * H + j0;
      const A* c_s = lstm ? (restart ? c0p : c_prev) + b * H + j0 : nullptr;
      const A* m = opts.mask(p, b);
      const A* mh = zone ? m + j0 : nullptr;
      const A* mc = zone ? m + opts.zc + j0 : nullptr;
      switch (z.cell) {
        case Cell::RnnTanh:
        case Cell::RnnRelu:
          bool_switch(save, [&](auto kSave) {
            bool_switch(zone, [&](auto kZone) {
              constexpr bool S = decltype(kSave)::value, Z = decltype(kZone)::value;
              if (z.cell == Cell::RnnRelu)
                rnn_forward_row<A, true, S, Z>(n, x, hh, bias + j0, h, h_s, mh, w);
              else
                rnn_forward_row<A, false, S, Z>(n, x, hh, bias + j0, h, h_s, mh, w);
            });
          });
          break;
        case Cell::Lstm:
          bool_switch(save, [&](auto kSave) {
            bool_switch(zone, [&](auto kZone) {
              bool_switch(zone && !z.has_proj, [&](auto kZoneH) {
                lstm_forward_row<A, decltype(kSave)::value, decltype(kZone)::value,
                                 decltype(kZoneH)::value>(n, H, ldh, x, hh, bias + j0, c_s,
                                                          c_next + b * H + j0, h, w, h_s, mh, mc);
              });
            });
          });
          break;
        case Cell::Gru:
          bool_switch(save, [&](auto kSave) {
            bool_switch(zone, [&](auto kZone) {
              gru_forward_row<A, decltype(kSave)::value, decltype(kZone)::value>(
                  n, H, ldh, x, hh, bx + j0, bh + j0, h_s, h, w, mh);
            });
          });
          break;
        case Cell::GruResetBefore:
          gru_rb_gates_row<A>(n, H, ldh, x, hh, bias + j0, h_s, hh, ptr<A>(rh) + b * H + j0);
          continue;  // h comes in phase 2
        case Cell::LstmLn:
          continue;  // ln_product and ln_rows
      }
      if (!z.has_proj && !h_in_out) copy_row(out + row * H + j0, h, n);
    }
  };

  // Reset-before GRU, phase 2: the candidate's GEMM on r * h (all units), then h.
  auto candidate = [&](size_t t, int64_t s) {
    const auto [r, u, sl] = split.unit_work(t);
    const int64_t j0 = sl.j0, n = sl.n;
    const A* h_prev = h_prev_of(s);
    A* h_next = h_next_of(s);
    step_gemm<A>(r.nb, ptr<A>(rh) + r.b0 * H, H, w_n_slice[u], ptr<A>(hn[t]), false);
    const A* rz = ptr<A>(hproj[t]);  // r, z of the slice, from phase 1
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) continue;
      const int64_t row = p * B + b;
      const int64_t i = b - r.b0;
      A* h = h_next + b * H + j0;
      A* w = save ? wsp + row * W + j0 : nullptr;
      const A* h_s = (restarts(p, b, s) ? h0p : h_prev) + b * H + j0;
      const A* mh = zone ? opts.mask(p, b) + j0 : nullptr;
      bool_switch(save, [&](auto kSave) {
        bool_switch(zone, [&](auto kZone) {
          gru_rb_candidate_row<A, decltype(kSave)::value, decltype(kZone)::value>(
              n, H, n, xp + row * GH + j0, ptr<A>(hn[t]) + i * n, bias + j0, rz + i * 2 * n, h_s,
              h, w, mh);
        });
      });
      if (!h_in_out) copy_row(out + row * H + j0, h, n);
    }
  };

  // LSTM projection, phase 2, per output slice: h_t = (o * tanh c) W_hr^T.
  auto project = [&](size_t t, int64_t s) {
    const auto [r, oi, o] = split.out_work(t);
    const A* h_prev = h_prev_of(s);
    A* h_next = h_next_of(s);
    step_gemm<A>(r.nb, ptr<A>(h_full) + r.b0 * H, H, w_r_slice[oi], ptr<A>(hq[t]), false);
    const A* q = ptr<A>(hq[t]);
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) {
        copy_row(h_next + b * P + o.j0, h_prev + b * P + o.j0, o.n);
        zero_row(out + (s * B + b) * P + o.j0, o.n);
        continue;
      }
      if (zone) {
        const A* h_s = (restarts(p, b, s) ? h0p : h_prev) + b * P + o.j0;
        zoneout_row<A>(o.n, opts.mask(p, b) + o.j0, h_s, q + (b - r.b0) * o.n,
                       h_next + b * P + o.j0);
      } else {
        copy_row(h_next + b * P + o.j0, q + (b - r.b0) * o.n, o.n);
      }
      copy_row(out + (p * B + b) * P + o.j0, h_next + b * P + o.j0, o.n);
    }
  };

  // lstm_ln.  Its layer norms need whole rows: of h_{t-1} W_hh^T (4H) and of
  // c~ (H).  Split by rows, every worker has them (its slice is all units)
  // and runs both phases back to back.  Split by units, each worker runs its
  // slice of the product (the step's bulk: at least kMinStepMacsPerWorker
  // multiply-adds a worker) and copies it into a buffer of whole rows; then
  // one thread runs the rows' layer norms and gate math, O(B H) against each
  // worker's O(B H H / workers) product.  So a step still has one meeting of
  // the threads (its product), where splitting the layer norms by units too
  // would add a reduction phase, and a meeting, per layer norm.
  auto ln_product = [&](size_t t, int64_t s) {
    const auto [r, u, sl] = split.unit_work(t);
    step_gemm<A>(r.nb, h_prev_of(s) + r.b0 * P, P, w_slice[u], ptr<A>(hproj[t]), false);
    if (split.by_rows) return;
    const A* hp = ptr<A>(hproj[t]);  // [B, G*n]: gate k of unit j0 + j at k*n + j
    for (int64_t b = 0; b < B; ++b)
      for (int64_t k = 0; k < G; ++k)
        copy_row(ptr<A>(hfull) + b * GH + k * H + sl.j0, hp + (b * G + k) * sl.n, sl.n);
  };
  auto ln_rows = [&](size_t t, int64_t s) {
    const Rows r = split.rows_of(t);
    const A* h_prev = h_prev_of(s);
    A* h_next = h_next_of(s);
    const A* c_prev = c_prev_of(s);
    A* c_next = c_next_of(s);
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) {
        copy_row(h_next + b * H, h_prev + b * H, H);
        zero_row(out + (s * B + b) * H, H);
        copy_row(c_next + b * H, c_prev + b * H, H);
        if (save) zero_row(wsp + (s * B + b) * W, W);
        continue;
      }
      const int64_t row = p * B + b;
      A* hh = split.by_rows ? ptr<A>(hproj[t]) + (b - r.b0) * GH : ptr<A>(hfull) + b * GH;
      const bool restart = restarts(p, b, s);
      if (resets && s == 0) copy_row(ptr<A>(hproj0_ln) + b * GH, hh, GH);  // h0 W_hh^T
      if (restart) copy_row(hh, ptr<A>(hproj0_ln) + b * GH, GH);
      const A* h_s = (restart ? h0p : h_prev) + b * H;
      const A* c_s = (restart ? c0p : c_prev) + b * H;
      const A* m = opts.mask(p, b);
      A* w = save ? wsp + row * W : ptr<A>(ln_scratch[t]);
      A* h = h_next + b * H;
      bool_switch(zone, [&](auto kZone) {
        lstm_ln_forward_row<A, decltype(kZone)::value>(H, xp + row * GH, hh, bias, lnp, h_s, c_s,
                                                       zone ? m : nullptr,
                                                       zone ? m + opts.zc : nullptr, w,
                                                       c_next + b * H, h);
      });
      if (!h_in_out) copy_row(out + row * H, h, H);
    }
  };

  if (ln_cell) {
    run_steps(split, T, false, phase(true, split.unit_workers(), ln_product),
              phase(true, ln_row_workers, ln_rows));
  } else {
    run_steps(split, T, false, phase(true, split.unit_workers(), gates),
              phase(reset_before, split.unit_workers(), candidate),
              phase(z.has_proj, split.out_workers(), project));
  }
  if (h_in_out && T > 0)
    h_n.copy_(output[a.pos.at(0, T - 1)]);
  else
    h_n.copy_(h_buf[h_in_out ? 0 : T & 1]);
  if (lstm) c_n.copy_(c_buf[T & 1]);
}

// dW = sum over steps and rows of d[p, b]^T h_{t-1}[p, b], where h_{t-1} of
// position p is the output one step earlier (p - 1, or p + 1 in reverse) and
// h0 at each sequence's first position.  Padding positions have d = 0 and
// output 0, so two GEMMs cover every case without gathering h_{t-1}:
//   forward:  d[1:]^T out[:-1] + d[0]^T h0
//   reverse:  d[:-1]^T out[1:] + sum_b d[len_b - 1, b]^T h0[b]
// With resets, a step that restarts its row started from h0 instead: a third
// GEMM over those positions alone (gathered) adds d^T (h0 - h_{t-1}).
// d: [T, B, N] with unit stride along N (it may be a column slice),
// out: [T, B, P] and h0: [B, P] contiguous, dw: [N, P] with rows contiguous;
// resets: [T, B] or null.
template <typename A>
void weight_grad_by_prev_state(Tensor& dw, const Tensor& d, const Tensor& out, const Tensor& h0,
                               const Positions& pos, const bool* resets) {
  const int64_t T = d.size(0), B = d.size(1), N = d.size(2), P = out.size(2);
  const int64_t ld = d.stride(1);
  A* c = ptr<A>(dw);
  if (T == 0 || B == 0) {
    dw.zero_();
    return;
  }
  const A* d_later = cptr<A>(d) + (pos.reverse ? 0 : B * ld);
  const A* out_earlier = cptr<A>(out) + (pos.reverse ? B * P : 0);
  blocked_gemm<A>(N, P, (T - 1) * B, d_later, 1, ld, out_earlier, P, 1, c, dw.stride(0), false);
  // Each sequence's gradient at its first step, against h0.
  Tensor d_first = at::zeros({B, N}, d.options());
  A* df = ptr<A>(d_first);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = pos.reverse ? pos.length(b) - 1 : (pos.length(b) > 0 ? 0 : -1);
    if (first >= 0) copy_row(df + b * N, cptr<A>(d) + (first * B + b) * ld, N);
  }
  blocked_gemm<A>(N, P, B, df, 1, N, cptr<A>(h0), P, 1, c, dw.stride(0), true);
  if (resets == nullptr) return;
  std::vector<int64_t> restarted;  // p * B + b
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = pos.length(b);
    for (int64_t p = 0; p < n; ++p)
      if (resets[p * B + b] && p != (pos.reverse ? n - 1 : 0)) restarted.push_back(p * B + b);
  }
  if (restarted.empty()) return;
  const int64_t R = static_cast<int64_t>(restarted.size());
  Tensor d_r = at::empty({R, N}, d.options()), x_r = at::empty({R, P}, d.options());
  const A* o = cptr<A>(out);
  const A* h = cptr<A>(h0);
  for (int64_t i = 0; i < R; ++i) {
    const int64_t p = restarted[i] / B, b = restarted[i] % B;
    const A* earlier = o + ((pos.reverse ? p + 1 : p - 1) * B + b) * P;
    copy_row(ptr<A>(d_r) + i * N, cptr<A>(d) + (p * B + b) * ld, N);
    A* x = ptr<A>(x_r) + i * P;
    for (int64_t k = 0; k < P; ++k) x[k] = h[b * P + k] - earlier[k];
  }
  blocked_gemm<A>(N, P, R, cptr<A>(d_r), 1, N, cptr<A>(x_r), P, 1, c, dw.stride(0), true);
}

// ------------------------------------------------------------------------
// Backward driver.  Per step, each worker first adds the GEMM part of its
// carried dh (from the previous step's gate gradients, ping-pong buffered so
// that, split by units, no thread overwrites what another still reads), then
// runs its pointwise backward.
//
// Options, backward:
//  * resets: a restarting step's h_{t-1} (c_{t-1}) is h0 (c0), in its
//    pointwise backward and in the weight gradients; the carry it leaves
//    (direct part and, once the next step has added it, GEMM part) is the
//    gradient of h0 (c0): it moves to d_h0 (d_c0) and the carry goes on from
//    zero.
//  * zoneout: the row kernels split each state's gradient between the state
//    the step started from and the cell's update.
//  * lstm_ln: the carry's GEMM part by units, the layer norms' backward by
//    rows (as the forward, ln_product); the gate gradient the next GEMM and
//    dW_hh take is that of h_{t-1} W_hh^T (through LN_h), kept in time order.
template <typename A>
struct BackwardArgs {
  const RecurrenceSizes& z;
  Tensor grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output, ws;
  Positions pos;
  Tensor resets, zoneout, ln;  // undefined when not given
};

// acc += src; src = 0.
template <typename A>
void move_row(A* __restrict acc, A* __restrict src, int64_t n) {
  for (int64_t j = 0; j < n; ++j) acc[j] += src[j];
  zero_row(src, n);
}

template <typename A>
void backward_impl(const BackwardArgs<A>& a, Tensor& d_xproj, Tensor& d_h0, Tensor& d_c0,
                   Tensor& d_w_hh, Tensor& d_b_ih, Tensor& d_b_hh, Tensor& d_w_hr,
                   Tensor& d_ln) {
  const RecurrenceSizes& z = a.z;
  const int64_t T = z.T, B = z.B, H = z.H, P = z.P, G = z.G;
  const int64_t GH = G * H;
  const int64_t W = workspace_size(z.cell, H, z.has_zoneout);  // per row and step
  const auto opt = a.output.options();
  const bool lstm = has_cell_state(z.cell);
  const bool gru = z.cell == Cell::Gru;
  const bool reset_before = z.cell == Cell::GruResetBefore;
  const bool ln_cell = z.cell == Cell::LstmLn;
  const Options<A> opts = options_of<A>(z, a.resets, a.zoneout);
  const bool resets = opts.resets != nullptr, zone = opts.zone != nullptr;

  // The carried dh lives in per-worker buffers: over hidden units, or over
  // the projected outputs with a projection.
  const Split split(z, sizeof(A));
  const std::vector<Slice>& units = split.units;
  const std::vector<Slice>& carry = z.has_proj ? split.outs : split.units;
  const size_t unit_workers = split.unit_workers();
  const size_t carry_workers = z.has_proj ? split.out_workers() : unit_workers;
  auto carry_work = [&](size_t t) { return z.has_proj ? split.out_work(t) : split.unit_work(t); };
  // Rows of W_hh whose gradient feeds dh through the per-step GEMM: all, or
  // r, z for reset-before (the candidate's part goes through drh).
  const Tensor w_dh = reset_before ? a.w_hh.narrow(0, 0, 2 * H) : a.w_hh;
  std::vector<Tensor> dh, drh, dh_full;
  std::vector<gemm::PackedB<A>> w_dh_cols, w_n_cols, w_r_cols;
  const bool in_place = split.weights_in_place(T);
  for (const Slice& sl : carry) w_dh_cols.push_back(weight_cols<A>(w_dh, sl, in_place));
  for (const Slice& sl : units) {
    if (reset_before) w_n_cols.push_back(weight_cols<A>(a.w_hh.narrow(0, 2 * H, H), sl, in_place));
    if (z.has_proj) w_r_cols.push_back(weight_cols<A>(a.w_hr, sl, in_place));
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
  if (lstm) d_c0.copy_(a.grad_c_n);
  // Per worker: sums of the gate gradients of its rows and units (gate k of
  // unit j at k*n + j) and, for GRU, of dhn after them.
  std::vector<std::vector<double>> bias_sum;
  for (size_t t = 0; t < unit_workers && !ln_cell; ++t)
    bias_sum.emplace_back(static_cast<size_t>((G + (gru ? 1 : 0)) * split.unit_work(t).sl.n), 0.0);
  // lstm_ln, per worker of the rows' phase (all split by rows, one split by
  // units): the parameters' sums (lstm_ln_backward_row's acc), scratch, and
  // split by units the row's carry gathered from the slices.
  const size_t ln_row_workers = split.by_rows ? split.rows.size() : 1;
  std::vector<std::vector<double>> ln_sum;
  std::vector<Tensor> ln_scratch, ln_dh;
  for (size_t t = 0; ln_cell && t < ln_row_workers; ++t) {
    ln_sum.emplace_back(static_cast<size_t>(14 * H), 0.0);
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
  Tensor dhp_all = ln_cell ? pooled_empty({T, B, GH}, opt) : Tensor();
  Tensor da[2];
  if (!da_in_dx && !da_in_dhp)
    da[0] = at::zeros({B, da_width}, opt), da[1] = at::zeros({B, da_width}, opt);
  auto da_of = [&](int64_t s) {
    return da_in_dx    ? ptr<A>(d_xproj) + a.pos.at(0, s) * B * GH
           : da_in_dhp ? ptr<A>(dhp_all) + a.pos.at(0, s) * B * GH
                       : ptr<A>(da[s & 1]);
  };
  // Time-ordered inputs of the final weight GEMMs.
  Tensor dhn_all = gru ? pooled_empty({T, B, H}, opt) : Tensor();
  Tensor rh_all = reset_before ? pooled_empty({T, B, H}, opt) : Tensor();
  Tensor dn = reset_before ? at::empty({B, H}, opt) : Tensor();
  Tensor dh_tot = z.has_proj ? at::empty({B, P}, opt) : Tensor();
  Tensor dh_tot_all = z.has_proj ? pooled_empty({T, B, P}, opt) : Tensor();
  Tensor h_full_all = z.has_proj ? pooled_empty({T, B, H}, opt) : Tensor();
  // With resets: the gradients of h0 and c0 the restarting steps leave.
  Tensor dh0_acc = resets ? at::zeros({B, P}, opt) : Tensor();
  Tensor dc0_acc = resets && lstm ? at::zeros({B, H}, opt) : Tensor();

  A* dc = lstm ? ptr<A>(d_c0) : nullptr;
  A* dx = ptr<A>(d_xproj);
  const A* gout = cptr<A>(a.grad_output);
  const A* out = cptr<A>(a.output);
  const A* wsp = W > 0 ? cptr<A>(a.ws) : nullptr;
  const A* h0 = cptr<A>(a.h0);
  const A* c0 = lstm ? cptr<A>(a.c0) : nullptr;
  const A* lnp = cptr<A>(a.ln);

  // h_{t-1} of row b at step s: its state one step earlier (c_{t-1}
  // likewise), or h0 at its first step and where it restarts.
  auto prev_pos = [&](int64_t b, int64_t s) {
    return s == 0 || opts.restart(a.pos.at(b, s), b) ? int64_t(-1) : a.pos.at(b, s - 1);
  };
  auto h_prev_of = [&](int64_t b, int64_t s) {
    const int64_t q = prev_pos(b, s);
    return q < 0 ? h0 + b * P : out + (q * B + b) * P;
  };
  // Whether row b restarted at step s + 1: its carry at step s, once the
  // GEMM part is in, belongs to h0 (c0).
  auto restarted_after = [&](int64_t b, int64_t s) {
    return s + 1 < T && opts.restart(a.pos.at(b, s + 1), b);
  };
  // dh += (gate gradients of step s + 1) W_hh[:, slice], carry worker t.
  auto add_gemm_part = [&](size_t t, int64_t s) {
    const auto [r, ci, c] = carry_work(t);
    if (s + 1 < T)
      step_gemm<A>(r.nb, da_of(s + 1) + r.b0 * da_width, da_width, w_dh_cols[ci], ptr<A>(dh[t]), true);
  };

  // Adds worker t's gate gradients of step s (complete) to its bias sums.
  auto add_bias_part = [&](size_t t, int64_t s) {
    const auto [r, u, sl] = split.unit_work(t);
    double* sum = bias_sum[t].data();
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) continue;
      const int64_t row = p * B + b;
      for (int64_t k = 0; k < G; ++k) add_row_to_sum<A>(sl.n, dx + row * GH + k * H + sl.j0, sum + k * sl.n);
      if (gru) add_row_to_sum<A>(sl.n, ptr<A>(dhn_all) + row * H + sl.j0, sum + G * sl.n);
    }
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
        zero_row(ptr<A>(dh_tot_all) + (s * B + b) * P + c.j0, c.n);
        continue;
      }
      A* di = d + (b - r.b0) * c.n;
      if (restarted_after(b, s)) move_row(ptr<A>(dh0_acc) + b * P + c.j0, di, c.n);
      if (zone) {
        zoneout_total_row<A>(c.n, di, gout + (p * B + b) * P + c.j0, opts.mask(p, b) + c.j0,
                             dt + b * P + c.j0);
      } else {
        for (int64_t k = 0; k < c.n; ++k) dt[b * P + c.j0 + k] = di[k] + gout[(p * B + b) * P + c.j0 + k];
        zero_row(di, c.n);  // LSTM: no direct path from h_t to h_{t-1}
      }
      copy_row(ptr<A>(dh_tot_all) + (p * B + b) * P + c.j0, dt + b * P + c.j0, c.n);
    }
  };

  // Phase 1, per unit slice: the pointwise backward of the step.
  auto pointwise = [&](size_t t, int64_t s) {
    const auto [r, u, sl] = split.unit_work(t);
    const int64_t j0 = sl.j0, n = sl.n;
    A* da_s = da_of(s);
    if (z.has_proj) {
      step_gemm<A>(r.nb, ptr<A>(dh_tot) + r.b0 * P, P, w_r_cols[u], ptr<A>(dh_full[t]), false);
    } else {
      add_gemm_part(t, s);
    }
    A* dht = z.has_proj ? ptr<A>(dh_full[t]) : ptr<A>(dh[t]);
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) {
        // Finished sequence: no gradient here, the carry passes through.
        for (int64_t k = 0; k < G; ++k) {
          if (k < da_width / H) zero_row(da_s + b * da_width + k * H + j0, n);
          zero_row(dx + (s * B + b) * GH + k * H + j0, n);
        }
        if (gru) zero_row(ptr<A>(dhn_all) + (s * B + b) * H + j0, n);
        if (reset_before) {
          zero_row(ptr<A>(dn) + b * H + j0, n);
          zero_row(ptr<A>(rh_all) + (s * B + b) * H + j0, n);
        }
        if (z.has_proj) zero_row(ptr<A>(h_full_all) + (s * B + b) * H + j0, n);
        continue;
      }
      const int64_t row = p * B + b;
      const A* hprev = h_prev_of(b, s) + j0;
      A* d = dht + (b - r.b0) * n;
      const A* g = gout + row * P + j0;
      const A* w = wsp + row * W + j0;
      A* dxr = dx + row * GH + j0;
      A* dar = da_s + b * da_width + j0;
      if (restarted_after(b, s)) {
        if (!z.has_proj) move_row(ptr<A>(dh0_acc) + b * P + j0, d, n);
        if (lstm) move_row(ptr<A>(dc0_acc) + b * H + j0, dc + b * H + j0, n);
      }
      const A* m = opts.mask(p, b);
      const A* mh = zone ? m + j0 : nullptr;
      const A* mc = zone ? m + opts.zc + j0 : nullptr;
      switch (z.cell) {
        case Cell::RnnTanh:
        case Cell::RnnRelu: {
          // With zoneout the output is blended: the candidate is in the workspace.
          const A* h = zone ? w : out + row * H + j0;
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
          const int64_t q = prev_pos(b, s);
          const A* c_prev = (q < 0 ? c0 + b * H : wsp + (q * B + b) * W + 4 * H) + j0;
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
            gru_backward_row<A, decltype(kZone)::value>(n, H, d, g, w, hprev, dxr, dar,
                                                        ptr<A>(dhn_all) + row * H + j0, mh);
          });
          break;
        case Cell::GruResetBefore:
          bool_switch(zone, [&](auto kZone) {
            gru_rb_backward_candidate_row<A, decltype(kZone)::value>(
                n, H, d, g, w, hprev, dxr, dar, ptr<A>(dn) + b * H + j0, mh);
          });
          break;
        case Cell::LstmLn:
          break;  // ln_carry and ln_pointwise
      }
      if (!gru && !reset_before && !da_in_dx)
        for (int64_t k = 0; k < G; ++k) copy_row(dxr + k * H, dar + k * H, n);
    }
    if (!reset_before) add_bias_part(t, s);
  };

  // Reset-before GRU, phase 2: drh = dn W_hn (all units of dn), then the reset gate.
  auto reset = [&](size_t t, int64_t s) {
    const auto [r, u, sl] = split.unit_work(t);
    const int64_t j0 = sl.j0, n = sl.n;
    A* da_s = da_of(s);
    step_gemm<A>(r.nb, ptr<A>(dn) + r.b0 * H, H, w_n_cols[u], ptr<A>(drh[t]), false);
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) continue;
      const int64_t row = p * B + b, i = b - r.b0;
      gru_rb_backward_reset_row<A>(n, ptr<A>(dh[t]) + i * n, ptr<A>(drh[t]) + i * n,
                                   wsp + row * W + j0, h_prev_of(b, s) + j0, dx + row * GH + j0,
                                   da_s + b * da_width + j0, ptr<A>(rh_all) + row * H + j0);
    }
    add_bias_part(t, s);
  };

  // lstm_ln: the carry's GEMM part per unit slice, then the rows' backward
  // (whole rows: the layer norms), on the rows' workers (see ln_product).
  auto ln_carry = [&](size_t t, int64_t s) { add_gemm_part(t, s); };
  auto ln_pointwise = [&](size_t t, int64_t s) {
    const Rows r = split.rows_of(t);
    A* da_s = da_of(s);
    A* dchat = ptr<A>(ln_scratch[t]);
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) {
        zero_row(da_s + b * GH, GH);
        zero_row(dx + (s * B + b) * GH, GH);
        zero_row(ptr<A>(dhp_all) + (s * B + b) * GH, GH);
        continue;
      }
      const int64_t row = p * B + b;
      // The row's carry: the worker's own (all units), or gathered from the slices.
      A* d = split.by_rows ? ptr<A>(dh[t]) + (b - r.b0) * H : ptr<A>(ln_dh[t]);
      if (!split.by_rows)
        for (size_t u = 0; u < units.size(); ++u)
          copy_row(d + units[u].j0, ptr<A>(dh[u]) + b * units[u].n, units[u].n);
      if (restarted_after(b, s)) {
        move_row(ptr<A>(dh0_acc) + b * P, d, H);
        move_row(ptr<A>(dc0_acc) + b * H, dc + b * H, H);
      }
      const int64_t q = prev_pos(b, s);
      const A* c_prev = q < 0 ? c0 + b * H : wsp + (q * B + b) * W + 4 * H;
      const A* m = opts.mask(p, b);
      bool_switch(zone, [&](auto kZone) {
        lstm_ln_backward_row<A, decltype(kZone)::value>(
            H, d, gout + row * H, dc + b * H, wsp + row * W, c_prev, lnp, zone ? m : nullptr,
            zone ? m + opts.zc : nullptr, dchat, dx + row * GH, da_s + b * GH,
            ln_sum[t].data());
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
    if (T > 0) step_gemm<A>(r.nb, da_of(0) + r.b0 * da_width, da_width, w_dh_cols[ci], ptr<A>(dh[t]), true);
    d_h0.narrow(0, r.b0, r.nb).narrow(1, c.j0, c.n).copy_(dh[t]);
  });
  if (resets) {
    d_h0.add_(dh0_acc);
    if (lstm) d_c0.add_(dc0_acc);
  }

  // Bias gradients: d_b_hh equals d_b_ih but for the reset-after GRU's
  // candidate, whose hidden part is dhn.  lstm_ln: both are the sums of the
  // pre-activation gradients, and the sums after them are d_ln.
  if (ln_cell) {
    std::vector<double> sum(static_cast<size_t>(14 * H), 0.0);
    for (const auto& s : ln_sum)
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += s[i];
    A* dbi = ptr<A>(d_b_ih);
    A* dbh = ptr<A>(d_b_hh);
    A* dl = ptr<A>(d_ln);
    for (int64_t i = 0; i < GH; ++i) dbi[i] = dbh[i] = static_cast<A>(sum[i]);
    for (int64_t i = 0; i < 10 * H; ++i) dl[i] = static_cast<A>(sum[GH + i]);
  } else {
    std::vector<double> sum_ih(static_cast<size_t>(G * H), 0.0), sum_hh(sum_ih.size(), 0.0);
    for (size_t t = 0; t < unit_workers; ++t) {
      const int64_t j0 = split.unit_work(t).sl.j0, n = split.unit_work(t).sl.n;
      const double* sum = bias_sum[t].data();
      for (int64_t k = 0; k < G; ++k) {
        const int64_t hk = gru && k == 2 ? G : k;  // where the hidden part's sum is
        for (int64_t j = 0; j < n; ++j) {
          sum_ih[k * H + j0 + j] += sum[k * n + j];
          sum_hh[k * H + j0 + j] += sum[hk * n + j];
        }
      }
    }
    A* dbi = ptr<A>(d_b_ih);
    A* dbh = ptr<A>(d_b_hh);
    for (int64_t i = 0; i < G * H; ++i) {
      dbi[i] = static_cast<A>(sum_ih[i]);
      dbh[i] = static_cast<A>(sum_hh[i]);
    }
  }

  // Weight gradients: one GEMM over all steps each.
  const Tensor dx3 = d_xproj.view({T, B, GH});
  if (gru || reset_before) {
    // Rows [0, 2H) (r, z) multiply h_{t-1}; rows [2H, 3H) (n) multiply h_{t-1}
    // (reset after, gradient dhn) or r * h_{t-1} (reset before, gradient dn).
    Tensor dw_rz = d_w_hh.narrow(0, 0, 2 * H), dw_n = d_w_hh.narrow(0, 2 * H, H);
    const Tensor d_rz = dx3.narrow(2, 0, 2 * H);
    weight_grad_by_prev_state<A>(dw_rz, d_rz, a.output, a.h0, a.pos, opts.resets);
    if (gru) {
      weight_grad_by_prev_state<A>(dw_n, dhn_all, a.output, a.h0, a.pos, opts.resets);
    } else {
      // dW_hn = sum dn^T (r * h_{t-1}), collected in time order by the backward.
      blocked_gemm<A>(H, H, T * B, ptr<A>(dx3) + 2 * H, 1, GH, ptr<A>(rh_all), H, 1, ptr<A>(dw_n),
                      H, false);
    }
  } else {
    weight_grad_by_prev_state<A>(d_w_hh, ln_cell ? dhp_all : dx3, a.output, a.h0, a.pos,
                                 opts.resets);
  }
  if (z.has_proj) {
    blocked_gemm<A>(P, H, T * B, ptr<A>(dh_tot_all), 1, P, ptr<A>(h_full_all), H, 1,
                    ptr<A>(d_w_hr), H, false);
  }
}

// ------------------------------------------------------------------------
// Op entry points: checks, conversion to the accumulate dtype, dispatch on
// float / double, conversion back.

Tensor to_acc(const Tensor& t, at::ScalarType acc) { return t.to(acc).contiguous(); }
Tensor to_acc(const OptTensor& t, at::ScalarType acc) {
  return t.has_value() ? to_acc(*t, acc) : Tensor();
}

// The zoneout mask in the accumulate dtype with unit stride along Z, read
// through its strides along T and B (ops.cpp): a mask expanded along them (an
// evaluation-mode mask is a [Z] vector with strides (0, 0, 1)) is converted
// once per distinct row and stays expanded, never copied T*B times.
Tensor mask_to_acc(const OptTensor& m, at::ScalarType acc) {
  if (!m.has_value()) return Tensor();
  Tensor base = *m;
  for (int64_t d = 0; d < 2; ++d)
    if (base.stride(d) == 0) base = base.narrow(d, 0, std::min<int64_t>(base.size(d), 1));
  return base.to(acc).contiguous().expand(m->sizes());
}

Tensor bools(const OptTensor& t) { return t.has_value() ? t->contiguous() : Tensor(); }

struct LengthsHolder {
  Tensor lengths;  // keeps the contiguous copy alive while Positions points into it
  Positions positions(const OptTensor& l, int64_t T, bool reverse) {
    if (!l.has_value()) return Positions{nullptr, T, reverse};
    lengths = l->contiguous();
    return Positions{lengths.const_data_ptr<int64_t>(), T, reverse};
  }
};

Tensor bias_or_zeros(const OptTensor& b, int64_t n, const at::TensorOptions& opt) {
  return b.has_value() ? to_acc(*b, opt.dtype().toScalarType()) : at::zeros({n}, opt);
}

// Forward on tensors of any floating dtype; results in the accumulate dtype.
std::tuple<Tensor, Tensor, Tensor, Tensor> run_forward(
    const RecurrenceSizes& z, const Tensor& xproj, const Tensor& h0, const OptTensor& c0,
    const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh, const OptTensor& w_hr,
    const Positions& pos, bool train, const OptTensor& resets, const OptTensor& zoneout,
    const OptTensor& ln) {
  const auto acc = acc_type(h0.scalar_type());
  const auto opt = h0.options().dtype(acc);
  const bool lstm = has_cell_state(z.cell);
  Tensor output = pooled_empty({z.T, z.B, z.P}, opt);
  Tensor h_n = at::empty({z.B, z.P}, opt);
  Tensor c_n = lstm ? at::empty({z.B, z.H}, opt) : empty_like_options(h0, acc);
  Tensor ws = train ? pooled_empty({z.T, z.B, workspace_size(z.cell, z.H, z.has_zoneout)}, opt)
                    : empty_like_options(h0, acc);
  AT_DISPATCH_FLOATING_TYPES(acc, "rnnkern_recurrence_cpu", [&] {
    ForwardArgs<scalar_t> a{z,
                            to_acc(xproj, acc),
                            to_acc(h0, acc),
                            to_acc(c0, acc),
                            to_acc(w_hh, acc),
                            bias_or_zeros(b_ih, z.G * z.H, opt),
                            bias_or_zeros(b_hh, z.G * z.H, opt),
                            to_acc(w_hr, acc),
                            pos,
                            train,
                            bools(resets),
                            mask_to_acc(zoneout, acc),
                            to_acc(ln, acc)};
    forward_impl<scalar_t>(a, output, h_n, c_n, ws);
  });
  return {output, h_n, c_n, ws};
}

struct BackwardResult {
  Tensor d_xproj, d_h0, d_c0, d_w_hh, d_b_ih, d_b_hh, d_w_hr, d_ln;
};

// Backward on tensors of any floating dtype; results in the accumulate dtype.
BackwardResult run_backward(const RecurrenceSizes& z, const Tensor& grad_output,
                            const Tensor& grad_h_n, const OptTensor& grad_c_n, const Tensor& h0,
                            const OptTensor& c0, const Tensor& w_hh, const OptTensor& w_hr,
                            const Tensor& output, const Tensor& workspace,
                            const Positions& pos, const OptTensor& resets,
                            const OptTensor& zoneout, const OptTensor& ln) {
  const auto acc = acc_type(h0.scalar_type());
  const auto opt = h0.options().dtype(acc);
  const bool lstm = has_cell_state(z.cell);
  BackwardResult r;
  r.d_xproj = pooled_empty({z.T, z.B, z.G * z.H}, opt);
  r.d_h0 = at::empty({z.B, z.P}, opt);
  r.d_c0 = lstm ? at::empty({z.B, z.H}, opt) : empty_like_options(h0, acc);
  r.d_w_hh = pooled_empty({z.G * z.H, z.P}, opt);  // 1 MiB at LSTM H = 256: fresh pages cost
  r.d_b_ih = at::empty({z.G * z.H}, opt);
  r.d_b_hh = at::empty({z.G * z.H}, opt);
  r.d_w_hr = z.has_proj ? at::empty({z.P, z.H}, opt) : empty_like_options(h0, acc);
  r.d_ln = ln.has_value() ? at::empty({ln->size(0)}, opt) : empty_like_options(h0, acc);
  AT_DISPATCH_FLOATING_TYPES(acc, "rnnkern_recurrence_backward_cpu", [&] {
    BackwardArgs<scalar_t> a{z,
                             to_acc(grad_output, acc),
                             to_acc(grad_h_n, acc),
                             to_acc(grad_c_n, acc),
                             to_acc(h0, acc),
                             to_acc(c0, acc),
                             to_acc(w_hh, acc),
                             to_acc(w_hr, acc),
                             to_acc(output, acc),
                             workspace.contiguous(),
                             pos,
                             bools(resets),
                             mask_to_acc(zoneout, acc),
                             to_acc(ln, acc)};
    backward_impl<scalar_t>(a, r.d_xproj, r.d_h0, r.d_c0, r.d_w_hh, r.d_b_ih, r.d_b_hh,
                            r.d_w_hr, r.d_ln);
  });
  return r;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> recurrence_cpu(
    c10::string_view cell, const Tensor& xproj, const Tensor& h0, const OptTensor& c0,
    const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh, const OptTensor& w_hr,
    const OptTensor& lengths, bool reverse, bool train, const OptTensor& resets,
    const OptTensor& zoneout, const OptTensor& ln) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // inner ATen calls record no graph
  const RecurrenceSizes z = check_recurrence(cell, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, lengths,
                                             resets, zoneout, ln);
  LengthsHolder holder;
  auto [output, h_n, c_n, ws] =
      run_forward(z, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr,
                  holder.positions(lengths, z.T, reverse), train, resets, zoneout, ln);
  const auto dtype = xproj.scalar_type();
  return {output.to(dtype), h_n.to(dtype), c_n.to(dtype), ws};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> recurrence_backward_cpu(
    c10::string_view cell, const Tensor& grad_output, const Tensor& grad_h_n,
    const OptTensor& grad_c_n, const Tensor& h0, const OptTensor& c0, const Tensor& w_hh,
    const OptTensor& w_hr, const Tensor& output, const Tensor& workspace,
    const OptTensor& lengths, bool reverse, const OptTensor& resets, const OptTensor& zoneout,
    const OptTensor& ln) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // inner ATen calls record no graph
  const RecurrenceSizes z =
      check_recurrence_backward(cell, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output,
                                workspace, lengths, resets, zoneout, ln);
  LengthsHolder holder;
  const BackwardResult r =
      run_backward(z, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output, workspace,
                   holder.positions(lengths, z.T, reverse), resets, zoneout, ln);
  const auto dtype = output.scalar_type();
  return {r.d_xproj.to(dtype), r.d_h0.to(dtype),   r.d_c0.to(dtype),  r.d_w_hh.to(dtype),
          r.d_b_ih.to(dtype),  r.d_b_hh.to(dtype), r.d_w_hr.to(dtype), r.d_ln.to(dtype)};
}

// ------------------------------------------------------------------------
// The single step of a small call (one token, one observation of an RL
// policy, one streaming frame), for the torch.nn cells without options:
// the recurrence driver's machinery (work split, weight slices, state
// buffers, a dozen ATen calls converting and allocating) costs several
// times the arithmetic there (44k instructions for an RNNCell step at H = 8,
// which torch.nn runs in 4 us).  Single-threaded, scratch per thread, the
// same row kernels and cells.h formulas as the driver; the outputs and
// workspace in the driver's layouts, so each path's backward serves the
// other's forward.

// Whether step(cell ...) takes the lean path: a cell without options, inputs
// already contiguous in the accumulate type, and a step the driver would run
// on one thread anyway: one thread (whatever the size: the driver's T = 1
// input projection packs W_ih, which made an LSTM step at B=32 H=256 take
// 324 us against the lean path's 168 at B=31), or fewer rows than a split by
// rows takes and far below a split by units.  Its scratch is kept per thread,
// so a step with more than kMaxLeanGateValues gate pre-activations (B x G x H;
// 16 MiB of float32 scratch) goes to the driver, whose buffers are pooled.
constexpr int64_t kMaxLeanGateValues = int64_t(1) << 21;
bool lean_step(const StepSizes& s, std::initializer_list<const Tensor*> ts,
               std::initializer_list<const OptTensor*> opts) {
  if (s.cell == Cell::GruResetBefore || s.cell == Cell::LstmLn) return false;
  if (s.B * s.G * s.H > kMaxLeanGateValues) return false;
  if (at::get_num_threads() > 1 &&
      (s.B >= 2 * kMinRowsPerThread || s.B * s.G * s.H * (s.I + s.H) >= kMinStepMacsPerWorker))
    return false;
  for (const Tensor* t : ts) {
    const auto st = t->scalar_type();
    if ((st != at::kFloat && st != at::kDouble) || !t->is_contiguous()) return false;
  }
  for (const OptTensor* t : opts)
    if (t->has_value() && !(*t)->is_contiguous()) return false;
  return true;
}

// Scratch of the lean step, per thread, grown as needed and kept.
template <typename A>
A* lean_scratch(size_t n) {
  thread_local std::vector<A> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// A second one: the LSTM's dc carry when grad_c is not wanted.
template <typename A>
A* lean_scratch_c(size_t n) {
  thread_local std::vector<A> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

template <typename A>
RNNKERN_CPU_CLONES void lean_step_forward(const StepSizes& s, const A* x, const A* h, const A* c,
                                          const A* w_ih, const A* w_hh, const A* b_ih,
                                          const A* b_hh, A* h_new, A* c_new, A* ws) {
  const int64_t B = s.B, I = s.I, H = s.H, GH = s.G * H, W = workspace_size(s.cell, H);
  A* xp = lean_scratch<A>(2 * B * GH + 3 * GH);
  A* hp = xp + B * GH;
  A* bx = hp + B * GH;  // b_ih, b_hh (zeros when absent) and their sum
  A* bh = bx + GH;
  A* bsum = bh + GH;
  for (int64_t j = 0; j < GH; ++j) {
    bx[j] = b_ih ? b_ih[j] : A(0);
    bh[j] = b_hh ? b_hh[j] : A(0);
    bsum[j] = bx[j] + bh[j];
  }
  gemm::multiply_nt_rows(B, x, I, w_ih, I, GH, I, xp, GH);  // x W_ih^T
  gemm::multiply_nt_rows(B, h, H, w_hh, H, GH, H, hp, GH);  // h W_hh^T
  for (int64_t b = 0; b < B; ++b) {
    const A* xr = xp + b * GH;
    const A* hr = hp + b * GH;
    A* w = ws + b * W;
    switch (s.cell) {
      case Cell::RnnTanh:
        rnn_forward_row<A, false, true, false>(H, xr, hr, bsum, h_new + b * H, nullptr, nullptr, w);
        break;
      case Cell::RnnRelu:
        rnn_forward_row<A, true, true, false>(H, xr, hr, bsum, h_new + b * H, nullptr, nullptr, w);
        break;
      case Cell::Lstm:
        lstm_forward_row<A, true, false, false>(H, H, H, xr, hr, bsum, c + b * H, c_new + b * H,
                                                h_new + b * H, w, nullptr, nullptr, nullptr);
        break;
      case Cell::Gru:
        gru_forward_row<A, true, false>(H, H, H, xr, hr, bx, bh, h + b * H, h_new + b * H, w,
                                        nullptr);
        break;
      default: TORCH_INTERNAL_ASSERT(false, "lean_step_forward: ", cell_name(s.cell));
    }
  }
}

// Outputs given as null are not wanted (step_backward's `needs`): their
// products are skipped.  d_h always receives the carry; need_dh adds the
// product through W_hh.
template <typename A>
RNNKERN_CPU_CLONES void lean_step_backward(const StepSizes& s, const A* grad_h, const A* grad_c,
                                           const A* x, const A* h, const A* c, const A* w_ih,
                                           const A* w_hh, const A* h_new, const A* ws, A* d_x,
                                           A* d_h, A* d_c, A* d_w_ih, A* d_w_hh, A* d_b_ih,
                                           A* d_b_hh, bool need_dh) {
  const int64_t B = s.B, I = s.I, H = s.H, GH = s.G * H, W = workspace_size(s.cell, H);
  const bool gru = s.cell == Cell::Gru;
  // dx: gradients of x W_ih^T (+ b_ih); da: of h W_hh^T (+ b_hh) -- the same
  // numbers but for the GRU candidate (dx_n against dhn).
  A* dx = lean_scratch<A>((gru ? 2 : 1) * B * GH + H + B * H);
  A* da = gru ? dx + B * GH : dx;
  A* zero = da + B * GH;  // the step's output gradient: it enters as grad_h only
  A* dhn = zero + H;      // (GRU: the candidate's hidden part, also da's last block)
  std::fill(zero, zero + H, A(0));
  std::copy(grad_h, grad_h + B * H, d_h);  // the carry; the rows leave the direct part
  // (the LSTM's dc carry lives in d_c, or in scratch when it is not wanted)
  A* dc = c == nullptr ? nullptr : d_c != nullptr ? d_c : lean_scratch_c<A>(B * H);
  if (c != nullptr) std::copy(grad_c, grad_c + B * H, dc);
  for (int64_t b = 0; b < B; ++b) {
    const A* w = ws + b * W;
    A* dh = d_h + b * H;
    switch (s.cell) {
      case Cell::RnnTanh:
        rnn_backward_row<A, false, false>(H, dh, zero, h_new + b * H, dx + b * GH, nullptr);
        break;
      case Cell::RnnRelu:
        rnn_backward_row<A, true, false>(H, dh, zero, h_new + b * H, dx + b * GH, nullptr);
        break;
      case Cell::Lstm:
        lstm_backward_row<A, false, false>(H, H, dh, zero, dc + b * H, w, c + b * H,
                                           dx + b * GH, nullptr, nullptr, nullptr);
        break;
      case Cell::Gru:
        gru_backward_row<A, false>(H, H, dh, zero, w, h + b * H, dx + b * GH, da + b * GH,
                                   dhn + b * H, nullptr);
        break;
      default: TORCH_INTERNAL_ASSERT(false, "lean_step_backward: ", cell_name(s.cell));
    }
  }
  // The products: dh += da W_hh, dx = dx W_ih, dW_hh = da^T h, dW_ih = dx^T x.
  if (need_dh)
    gemm::multiply(B, da, gemm::StridesA{GH, 1}, gemm::PackedB<A>::view_rows(w_hh, GH, H, H),
                   d_h, H, true);
  if (d_x != nullptr)
    gemm::multiply(B, dx, gemm::StridesA{GH, 1}, gemm::PackedB<A>::view_rows(w_ih, GH, I, I),
                   d_x, I, false);
  if (d_w_hh != nullptr) blocked_gemm<A>(GH, H, B, da, 1, GH, h, H, 1, d_w_hh, H, false);
  if (d_w_ih != nullptr) blocked_gemm<A>(GH, I, B, dx, 1, GH, x, I, 1, d_w_ih, I, false);
  for (int64_t j = 0; j < GH && (d_b_ih != nullptr || d_b_hh != nullptr); ++j) {
    A si = 0, sh = 0;
    for (int64_t b = 0; b < B; ++b) {
      si += dx[b * GH + j];
      sh += da[b * GH + j];
    }
    if (d_b_ih != nullptr) d_b_ih[j] = si;
    if (d_b_hh != nullptr) d_b_hh[j] = sh;
  }
}

RecurrenceSizes step_as_recurrence(const StepSizes& s) {
  return RecurrenceSizes{s.cell, 1, s.B, s.H, s.H, s.G, false};
}

// The single step: the product [x, h] [W_ih; W_hh]^T is split along K into
// x W_ih^T and h W_hh^T, two GEMMs whose sum (with the biases) the gate pass
// forms: the recurrence above with T = 1 and xproj = x W_ih^T (lstm_ln: its
// layer norm of x W_ih^T is the recurrence's too).
std::tuple<Tensor, Tensor, Tensor> step_cpu(c10::string_view cell, const Tensor& x,
                                            const Tensor& h, const OptTensor& c,
                                            const Tensor& w_ih, const Tensor& w_hh,
                                            const OptTensor& b_ih, const OptTensor& b_hh,
                                            const OptTensor& ln) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // inner ATen calls record no graph
  const StepSizes s = check_step(cell, x, h, c, w_ih, w_hh, b_ih, b_hh, ln);
  const auto dtype = x.scalar_type();
  const auto acc = acc_type(dtype);
  if (lean_step(s, {&x, &h, &w_ih, &w_hh}, {&c, &b_ih, &b_hh})) {
    const auto opt = x.options();
    Tensor h_new = at::empty({s.B, s.H}, opt);
    Tensor c_new = s.cell == Cell::Lstm ? at::empty({s.B, s.H}, opt) : empty_like_options(x, dtype);
    Tensor ws = at::empty({s.B, workspace_size(s.cell, s.H)}, opt);
    AT_DISPATCH_FLOATING_TYPES(acc, "rnnkern_step_cpu", [&] {
      auto opt_ptr = [](const OptTensor& t) { return t.has_value() ? cptr<scalar_t>(*t) : nullptr; };
      lean_step_forward<scalar_t>(s, cptr<scalar_t>(x), cptr<scalar_t>(h), opt_ptr(c),
                                  cptr<scalar_t>(w_ih), cptr<scalar_t>(w_hh), opt_ptr(b_ih),
                                  opt_ptr(b_hh), ptr<scalar_t>(h_new),
                                  c.has_value() ? ptr<scalar_t>(c_new) : nullptr, ptr<scalar_t>(ws));
    });
    return {h_new, c_new, ws};
  }
  const Tensor xa = x.to(acc).contiguous(), wa = w_ih.to(acc).contiguous();
  const Tensor xproj = pooled_empty({s.B, s.G * s.H}, xa.options());
  AT_DISPATCH_FLOATING_TYPES(acc, "rnnkern_step_cpu", [&] {
    blocked_gemm<scalar_t>(s.B, s.G * s.H, s.I, cptr<scalar_t>(xa), s.I, 1, cptr<scalar_t>(wa), 1,
                           s.I, ptr<scalar_t>(xproj), s.G * s.H, false);
  });
  auto [output, h_new, c_new, ws] =
      run_forward(step_as_recurrence(s), xproj.unsqueeze(0), h, c, w_hh, b_ih, b_hh,
                  std::nullopt, Positions{nullptr, 1, false}, true, std::nullopt, std::nullopt,
                  ln);
  return {h_new.to(dtype), c_new.to(dtype), ws.view({s.B, workspace_size(s.cell, s.H)})};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> step_backward_cpu(
    c10::string_view cell, const Tensor& grad_h_new, const OptTensor& grad_c_new, const Tensor& x,
    const Tensor& h, const OptTensor& c, const Tensor& w_ih, const Tensor& w_hh,
    const Tensor& h_new, const Tensor& workspace, const OptTensor& ln, int64_t needs) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // inner ATen calls record no graph
  const StepSizes s = check_step_backward(cell, grad_h_new, grad_c_new, x, h, c, w_ih, w_hh, h_new,
                                          workspace, ln);
  const auto dtype = x.scalar_type();
  const auto acc = acc_type(dtype);
  const auto wanted = [needs](int64_t i) { return (needs >> i & 1) != 0; };
  // The incoming gradients are often expanded (the backward of a sum): made
  // dense here, as the driver would.
  const Tensor gh = grad_h_new.contiguous();
  const OptTensor gc = grad_c_new.has_value() ? OptTensor(grad_c_new->contiguous()) : std::nullopt;
  if (lean_step(s, {&gh, &x, &h, &w_ih, &w_hh, &h_new, &workspace}, {&gc, &c})) {
    const auto opt = x.options();
    const int64_t GH = s.G * s.H;
    const bool lstm = s.cell == Cell::Lstm;
    // (each output its own tensor, empty ones too: outputs must not alias)
    const auto none = [&] { return empty_like_options(x, dtype); };
    // d_h and d_c are the row kernels' carries: computed whatever is wanted.
    Tensor d_x = wanted(0) ? at::empty({s.B, s.I}, opt) : none();
    Tensor d_h = at::empty({s.B, s.H}, opt);
    Tensor d_c = lstm ? at::empty({s.B, s.H}, opt) : none();
    Tensor d_w_ih = wanted(3) ? pooled_empty({GH, s.I}, opt) : none();
    Tensor d_w_hh = wanted(4) ? pooled_empty({GH, s.H}, opt) : none();
    Tensor d_b_ih = wanted(5) ? at::empty({GH}, opt) : none();
    Tensor d_b_hh = wanted(6) ? at::empty({GH}, opt) : none();
    AT_DISPATCH_FLOATING_TYPES(acc, "rnnkern_step_backward_cpu", [&] {
      auto out = [](const Tensor& t) { return t.numel() > 0 ? ptr<scalar_t>(t) : nullptr; };
      lean_step_backward<scalar_t>(
          s, cptr<scalar_t>(gh), lstm ? cptr<scalar_t>(*gc) : nullptr,
          cptr<scalar_t>(x), cptr<scalar_t>(h), lstm ? cptr<scalar_t>(*c) : nullptr,
          cptr<scalar_t>(w_ih), cptr<scalar_t>(w_hh), cptr<scalar_t>(h_new),
          cptr<scalar_t>(workspace), out(d_x), ptr<scalar_t>(d_h), lstm ? out(d_c) : nullptr,
          out(d_w_ih), out(d_w_hh), out(d_b_ih), out(d_b_hh), wanted(1));
    });
    return {d_x,    wanted(1) ? d_h : none(), wanted(2) ? d_c : none(), d_w_ih, d_w_hh, d_b_ih,
            d_b_hh, none()};
  }
  // The step's single output is also its final state: its gradient enters
  // once, as grad_h_n, with a zero grad_output.
  const BackwardResult r = run_backward(
      step_as_recurrence(s), at::zeros({1, s.B, s.H}, h.options().dtype(acc)), grad_h_new,
      grad_c_new, h, c, w_hh, std::nullopt, h_new.unsqueeze(0),
      workspace.view({1, s.B, workspace.size(1)}), Positions{nullptr, 1, false}, std::nullopt,
      std::nullopt, ln);
  // dX = dXproj W_ih, dW_ih = dXproj^T X (the GEMMs of rnnkern::linear's
  // backward: in place at small batch, outputs pooled).
  const int64_t GH = s.G * s.H;
  const Tensor dxp = r.d_xproj.view({s.B, GH});
  const Tensor xa = x.to(acc).contiguous(), wa = w_ih.to(acc).contiguous();
  const Tensor d_x = pooled_empty({s.B, s.I}, xa.options());
  const Tensor d_w_ih = pooled_empty({GH, s.I}, xa.options());
  AT_DISPATCH_FLOATING_TYPES(acc, "rnnkern_step_backward_cpu", [&] {
    blocked_gemm<scalar_t>(s.B, s.I, GH, cptr<scalar_t>(dxp), GH, 1, cptr<scalar_t>(wa), s.I, 1,
                           ptr<scalar_t>(d_x), s.I, false);
    blocked_gemm<scalar_t>(GH, s.I, s.B, cptr<scalar_t>(dxp), 1, GH, cptr<scalar_t>(xa), s.I, 1,
                           ptr<scalar_t>(d_w_ih), s.I, false);
  });
  const Tensor got[8] = {d_x, r.d_h0, r.d_c0, d_w_ih, r.d_w_hh, r.d_b_ih, r.d_b_hh, r.d_ln};
  auto keep = [&](int64_t i) {
    return wanted(i) ? got[i].to(dtype) : empty_like_options(x, dtype);
  };
  return {keep(0), keep(1), keep(2), keep(3), keep(4), keep(5), keep(6), keep(7)};
}

}  // namespace
}  // namespace rnnkern::cpu

TORCH_LIBRARY_IMPL(rnnkern, CPU, m) {
  m.impl("recurrence", &rnnkern::cpu::recurrence_cpu);
  m.impl("recurrence_backward", &rnnkern::cpu::recurrence_backward_cpu);
  m.impl("step", &rnnkern::cpu::step_cpu);
  m.impl("step_backward", &rnnkern::cpu::step_backward_cpu);
}

// The gate math of every cell, forward and backward, for one hidden unit.
//
// This header is the single source of the formulas for the C++ and CUDA
// backends.  It includes no torch headers so that .cu files can use it
// cheaply.  Every function is templated on the accumulate type `A` (float or
// double; half types are computed in float), is `__host__ __device__`, and
// is branch-free on the host so that the CPU backend's loops over hidden
// units vectorise (see host_math.h).
//
// Layout conventions shared by all backends (torch.nn's):
//   * gate pre-activations of unit j live at k*H + j for gate k,
//     gate order   RNN: (a)   LSTM: (i, f, g, o)   GRU: (r, z, n);
//   * "xproj" is X_t W_ih^T + b_ih, "hproj" is H_{t-1} W_hh^T + b_hh;
//   * the workspace saved for the backward holds, per unit, the values
//     listed by `workspace_width()` in this order:
//         LSTM             i, f, g, o, c          (activated gates, cell)
//         GRU reset-after  r, z, n, hn            (hn = W_hn h + b_hn)
//         GRU reset-before r, z, n
//         RNN              nothing (h_t itself is the output); with zoneout
//                          the candidate h~_t (the output is blended)
//         LSTM-LN          i, f, g, o, c, then x^ (4 values: the normalised
//                          x W_ih^T of gates i, f, g, o), h^ (4: the
//                          normalised h W_hh^T), c^ (the normalised c_t);
//                          after the W*H unit values, 3 per row: the
//                          reciprocal standard deviations of x W_ih^T,
//                          h W_hh^T and c_t  (workspace_size)
//     where c is the cell state the step ends with (after zoneout).
#pragma once

#include <cmath>
#include <cstdint>

#include "host_math.h"

#if defined(__CUDACC__) || defined(__HIPCC__)
#define RNNKERN_HD __host__ __device__ __forceinline__
#else
#define RNNKERN_HD inline
#endif

namespace rnnkern {

enum class Cell : int {
  RnnTanh = 0,
  RnnRelu = 1,
  Lstm = 2,
  Gru = 3,             // torch/cuDNN form: n = tanh(x_n + r * (W_hn h + b_hn))
  GruResetBefore = 4,  // reset-before form: n = tanh(x_n + W_hn (r * h) + b_hn)
  LstmLn = 5,          // layer-normalised LSTM (rnnkern/reference.py: lstm_ln_cell)
};

// Whether the cell carries a cell state c (LSTM and LSTM-LN).
RNNKERN_HD constexpr bool has_cell_state(Cell cell) {
  return cell == Cell::Lstm || cell == Cell::LstmLn;
}

// Rows of W_hh per hidden unit.
RNNKERN_HD constexpr int gate_count(Cell cell) {
  return has_cell_state(cell) ? 4 : (cell == Cell::Gru || cell == Cell::GruResetBefore) ? 3 : 1;
}

// Values saved per hidden unit and time step for the backward.  Zoneout
// changes only the RNN's: its backward needs the candidate, no longer the
// output.  (The LSTMs recompute their candidate cell c~ = f c_{t-1} + i g.)
RNNKERN_HD constexpr int workspace_width(Cell cell, bool zoneout = false) {
  return cell == Cell::Lstm             ? 5
         : cell == Cell::LstmLn         ? 14
         : cell == Cell::Gru            ? 4
         : cell == Cell::GruResetBefore ? 3
         : zoneout                      ? 1
                                        : 0;
}

// Values saved per batch row and time step beyond the per-unit ones (the
// layer norms' reciprocal standard deviations of LSTM-LN).
RNNKERN_HD constexpr int workspace_row_extra(Cell cell) { return cell == Cell::LstmLn ? 3 : 0; }

// The workspace's last dimension: values per batch row and time step.
RNNKERN_HD constexpr int64_t workspace_size(Cell cell, int64_t H, bool zoneout = false) {
  return workspace_width(cell, zoneout) * H + workspace_row_extra(cell);
}

// Layer norm's epsilon for LSTM-LN (torch's default; rnnkern/reference.py LN_EPS).
constexpr double kLayerNormEps = 1e-5;

// Elementary functions per accumulate type.
template <typename A>
struct Math;

template <>
struct Math<float> {
#ifdef __CUDA_ARCH__
  static RNNKERN_HD float tanh(float x) { return ::tanhf(x); }
  static RNNKERN_HD float sigmoid(float x) { return 1.f / (1.f + ::expf(-x)); }
#else
  static RNNKERN_HD float tanh(float x) { return host_math::tanhf(x); }
  static RNNKERN_HD float sigmoid(float x) { return host_math::sigmoidf(x); }
#endif
  // x where x > 0 else 0; NaN propagates (as torch.relu).
  static RNNKERN_HD float relu(float x) { return x < 0.f ? 0.f : x; }
  // torch's relu backward: grad where result > 0, else 0 (NaN result passes grad).
  static RNNKERN_HD float relu_grad(float dy, float y) { return y <= 0.f ? 0.f : dy; }
};

template <>
struct Math<double> {
  static RNNKERN_HD double tanh(double x) { return ::tanh(x); }
  static RNNKERN_HD double sigmoid(double x) { return 1.0 / (1.0 + ::exp(-x)); }
  static RNNKERN_HD double relu(double x) { return x < 0.0 ? 0.0 : x; }
  static RNNKERN_HD double relu_grad(double dy, double y) { return y <= 0.0 ? 0.0 : dy; }
};

template <typename A>
RNNKERN_HD A sigmoid(A x) {
  return Math<A>::sigmoid(x);
}

// d sigmoid(a) / da expressed through y = sigmoid(a), times the incoming grad.
template <typename A>
RNNKERN_HD A sigmoid_backward(A dy, A y) {
  return dy * y * (A(1) - y);
}

template <typename A>
RNNKERN_HD A tanh_backward(A dy, A y) {
  return dy * (A(1) - y * y);
}

// ---------------------------------------------------------------- RNN ----
// h = phi(xproj + hproj)
template <typename A, bool Relu>
struct RnnUnit {
  static RNNKERN_HD A forward(A x, A hh) {
    const A pre = x + hh;
    return Relu ? Math<A>::relu(pre) : Math<A>::tanh(pre);
  }
  // Gradient of the pre-activation from dh and the output h.
  static RNNKERN_HD A backward(A dh, A h) {
    return Relu ? Math<A>::relu_grad(dh, h) : tanh_backward(dh, h);
  }
};

// --------------------------------------------------------------- LSTM ----
template <typename A>
struct LstmUnit {
  struct Fwd {
    A i, f, g, o, c, h;  // h is the unprojected o * tanh(c)
  };
  // p* are the gate pre-activations xproj + hproj.
  static RNNKERN_HD Fwd forward(A pi, A pf, A pg, A po, A c_prev) {
    Fwd r;
    r.i = gate<0>(pi);
    r.f = gate<1>(pf);
    r.g = gate<2>(pg);
    r.o = gate<3>(po);
    r.c = candidate(r.i, r.f, r.g, c_prev);
    r.h = hidden(r.o, r.c);
    return r;
  }
  // Gate k's activation in the order i, f, g, o: the candidate g a tanh, the
  // others sigmoids.  (The CPU row kernel applies them a gate at a time.)
  template <int k>
  static RNNKERN_HD A gate(A p) {
    return k == 2 ? Math<A>::tanh(p) : sigmoid(p);
  }
  // The unprojected h from the output gate and the new cell state.
  static RNNKERN_HD A hidden(A o, A c) { return o * Math<A>::tanh(c); }
  // The new cell state before zoneout; the backward of a zoned-out step
  // recomputes it from the saved gates (the workspace keeps the zoned state).
  static RNNKERN_HD A candidate(A i, A f, A g, A c_prev) { return f * c_prev + i * g; }
  struct Bwd {
    A di, df, dg, do_, dc_prev;  // gradients of the pre-activations, and of c_{t-1}
  };
  // dh: gradient of the unprojected h_t; dc: gradient of c_t from step t+1.
  static RNNKERN_HD Bwd backward(A dh, A dc, A i, A f, A g, A o, A c, A c_prev) {
    const A tc = Math<A>::tanh(c);
    const A dc_total = dc + tanh_backward(dh * o, tc);
    Bwd r;
    r.di = sigmoid_backward(dc_total * g, i);
    r.df = sigmoid_backward(dc_total * c_prev, f);
    r.dg = tanh_backward(dc_total * i, g);
    r.do_ = sigmoid_backward(dh * tc, o);
    r.dc_prev = dc_total * f;
    return r;
  }
};

// ----------------------------------------------------- GRU, reset after ----
template <typename A>
struct GruUnit {
  struct Fwd {
    A r, z, n, h;
  };
  // x*: input projections (with b_ih); h*: recurrent projections (with b_hh).
  static RNNKERN_HD Fwd forward(A xr, A xz, A xn, A hr, A hz, A hn, A h_prev) {
    Fwd o;
    o.r = sigmoid(xr + hr);
    o.z = sigmoid(xz + hz);
    o.n = Math<A>::tanh(xn + o.r * hn);
    o.h = (A(1) - o.z) * o.n + o.z * h_prev;
    return o;
  }
  struct Bwd {
    A dr, dz, dxn, dhn, dh_prev;  // dr, dz: pre-activation grads (same for x and h parts)
  };
  static RNNKERN_HD Bwd backward(A dh, A r, A z, A n, A hn, A h_prev) {
    Bwd o;
    const A dn = tanh_backward(dh * (A(1) - z), n);
    o.dz = sigmoid_backward(dh * (h_prev - n), z);
    o.dr = sigmoid_backward(dn * hn, r);
    o.dxn = dn;
    o.dhn = dn * r;
    o.dh_prev = dh * z;  // the direct path; W_hh^T [dr, dz, dhn] is added by a GEMM
    return o;
  }
};

// ---------------------------------------------------- GRU, reset before ----
// Two stages per step, because the reset gate acts before the recurrent GEMM
// of the candidate:  (1) r, z from [xr + hr, xz + hz];  rh = r * h_prev
//                    (2) n = tanh(xn + hn) with hn = W_hn rh + b_hn.
template <typename A>
struct GruResetBeforeUnit {
  struct Gates {
    A r, z, rh;
  };
  static RNNKERN_HD Gates gates(A xr, A xz, A hr, A hz, A h_prev) {
    Gates o;
    o.r = sigmoid(xr + hr);
    o.z = sigmoid(xz + hz);
    o.rh = o.r * h_prev;
    return o;
  }
  struct Cand {
    A n, h;
  };
  static RNNKERN_HD Cand candidate(A xn, A hn, A z, A h_prev) {
    Cand o;
    o.n = Math<A>::tanh(xn + hn);
    o.h = (A(1) - z) * o.n + z * h_prev;
    return o;
  }
  // Backward stage 1: from dh, the candidate's and the update gate's grads.
  struct BwdCand {
    A dz, dn, dh_prev;  // dn: pre-activation grad of n (for both xn and hn)
  };
  static RNNKERN_HD BwdCand backward_candidate(A dh, A z, A n, A h_prev) {
    BwdCand o;
    o.dz = sigmoid_backward(dh * (h_prev - n), z);
    o.dn = tanh_backward(dh * (A(1) - z), n);
    o.dh_prev = dh * z;
    return o;
  }
  // Backward stage 2: drh = W_hn^T dn (a GEMM between the stages).
  struct BwdReset {
    A dr, dh_prev;  // dh_prev: the part through rh = r * h_prev
  };
  static RNNKERN_HD BwdReset backward_reset(A drh, A r, A h_prev) {
    BwdReset o;
    o.dr = sigmoid_backward(drh * h_prev, r);
    o.dh_prev = drh * r;
    return o;
  }
};

// ------------------------------------------------------------ zoneout ----
// The state a step ends with, per unit: h_t = m h_{t-1} + (1 - m) h~_t (and
// c alike), m the mask value (0 or 1 in training, the probability in
// evaluation).  Its gradient d splits into m d for the previous state and
// (1 - m) d for the candidate.  Written as the two products (not
// cand + m (prev - cand)) so that a training mask's 0 and 1 give cand and prev
// exactly, with or without FMA contraction, as the reference does.
template <typename A>
struct Zoneout {
  static RNNKERN_HD A forward(A m, A prev, A cand) { return m * prev + (A(1) - m) * cand; }
  static RNNKERN_HD A to_prev(A m, A d) { return m * d; }
  static RNNKERN_HD A to_candidate(A m, A d) { return (A(1) - m) * d; }
};

// --------------------------------------------------------- layer norm ----
// Per element, given its row's statistics (each backend reduces over the row
// its own way): the normalised value v^ = (v - mean) * rstd, and the backward
// dv = rstd * (dv^ - mean(dv^) - v^ * mean(dv^ * v^)), mean over the row.
// No affine part here: the callers apply their gains and shift.
template <typename A>
struct LayerNorm {
  static RNNKERN_HD A rstd(A variance) {
    return A(1) / std::sqrt(variance + A(kLayerNormEps));
  }
  static RNNKERN_HD A normalize(A v, A mean, A rstd) { return (v - mean) * rstd; }
  static RNNKERN_HD A backward(A dvhat, A vhat, A rstd, A mean_dvhat, A mean_dvhat_vhat) {
    return rstd * (dvhat - mean_dvhat - vhat * mean_dvhat_vhat);
  }
};

// ------------------------------------------------------------ LSTM-LN ----
// Per unit, between the row reductions of the three layer norms:
//   gates:  a_k = x^_k g_ih_k + h^_k g_hh_k + b_k  (k = i, f, g, o), then
//           LstmUnit's activations and candidate c~ (before zoneout);
//   output: h~ = o tanh(c^ g_c + beta_c), c^ the normalised c~.
template <typename A>
struct LstmLnUnit {
  static RNNKERN_HD A pre_activation(A xhat, A hhat, A g_ih, A g_hh, A b) {
    return xhat * g_ih + hhat * g_hh + b;
  }
  static RNNKERN_HD A output(A o, A chat, A g_c, A beta_c) {
    return o * Math<A>::tanh(chat * g_c + beta_c);
  }
  struct BwdOut {
    A do_;     // gradient of o's pre-activation
    A dchat;   // gradient of c^ (into the cell layer norm's backward)
    A dy;      // gradient of c^ g_c + beta_c: d beta_c, and d g_c = dy * c^
  };
  // dh: gradient of h~ (after zoneout's split).
  static RNNKERN_HD BwdOut backward_output(A dh, A o, A chat, A g_c, A beta_c) {
    const A ty = Math<A>::tanh(chat * g_c + beta_c);
    BwdOut r;
    r.do_ = sigmoid_backward(dh * ty, o);
    r.dy = tanh_backward(dh * o, ty);
    r.dchat = r.dy * g_c;
    return r;
  }
  struct BwdGates {
    A di, df, dg, dc_prev;  // pre-activation gradients of i, f, g; gradient of c_{t-1}
  };
  // dc: the whole gradient of c~ (from the cell layer norm and from step t+1).
  static RNNKERN_HD BwdGates backward_gates(A dc, A i, A f, A g, A c_prev) {
    BwdGates r;
    r.di = sigmoid_backward(dc * g, i);
    r.df = sigmoid_backward(dc * c_prev, f);
    r.dg = tanh_backward(dc * i, g);
    r.dc_prev = dc * f;
    return r;
  }
};

}  // namespace rnnkern

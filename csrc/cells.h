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
//         RNN              nothing (h_t itself is the output)
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
  GruResetBefore = 4,  // seed 000 form:    n = tanh(x_n + W_hn (r * h) + b_hn)
};

// Rows of W_hh per hidden unit.
RNNKERN_HD constexpr int gate_count(Cell cell) {
  return cell == Cell::Lstm ? 4 : (cell == Cell::Gru || cell == Cell::GruResetBefore) ? 3 : 1;
}

// Values saved per hidden unit and time step for the backward.
RNNKERN_HD constexpr int workspace_width(Cell cell) {
  return cell == Cell::Lstm ? 5 : cell == Cell::Gru ? 4 : cell == Cell::GruResetBefore ? 3 : 0;
}

// Elementary functions per accumulate type.
template <typename A>
struct Math;

template <>
struct Math<float> {
#ifdef __CUDA_ARCH__
  static RNNKERN_HD float exp(float x) { return ::expf(x); }
  static RNNKERN_HD float tanh(float x) { return ::tanhf(x); }
#else
  static RNNKERN_HD float exp(float x) { return host_math::expf(x); }
  static RNNKERN_HD float tanh(float x) { return host_math::tanhf(x); }
#endif
  // x where x > 0 else 0; NaN propagates (as torch.relu).
  static RNNKERN_HD float relu(float x) { return x < 0.f ? 0.f : x; }
  // torch's relu backward: grad where result > 0, else 0 (NaN result passes grad).
  static RNNKERN_HD float relu_grad(float dy, float y) { return y <= 0.f ? 0.f : dy; }
};

template <>
struct Math<double> {
  static RNNKERN_HD double exp(double x) { return ::exp(x); }
  static RNNKERN_HD double tanh(double x) { return ::tanh(x); }
  static RNNKERN_HD double relu(double x) { return x < 0.0 ? 0.0 : x; }
  static RNNKERN_HD double relu_grad(double dy, double y) { return y <= 0.0 ? 0.0 : dy; }
};

template <typename A>
RNNKERN_HD A sigmoid(A x) {
  return A(1) / (A(1) + Math<A>::exp(-x));
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
    r.i = sigmoid(pi);
    r.f = sigmoid(pf);
    r.g = Math<A>::tanh(pg);
    r.o = sigmoid(po);
    r.c = r.f * c_prev + r.i * r.g;
    r.h = r.o * Math<A>::tanh(r.c);
    return r;
  }
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

}  // namespace rnnkern

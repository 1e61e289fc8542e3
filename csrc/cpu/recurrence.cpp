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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "../cells.h"
#include "../ops.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define RNNKERN_CPU_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define RNNKERN_CPU_CLONES
#endif

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

template <typename F>
void for_each_row(int64_t rows, int64_t units_per_row, const F& f) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, units_per_row));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}

template <typename A>
void copy_row(A* dst, const A* src, int64_t n) {
  std::memcpy(dst, src, sizeof(A) * n);
}
template <typename A>
void zero_row(A* dst, int64_t n) {
  std::memset(dst, 0, sizeof(A) * n);
}

// ------------------------------------------------------------------------
// Forward row kernels: one batch row, all hidden units of one step.
// x: xproj row (G*H), hh: hproj row (G*H), bias: b_hh (G*H).

template <typename A, bool kRelu>
RNNKERN_CPU_CLONES void rnn_forward_row(int64_t H, const A* __restrict x, const A* __restrict hh,
                                        const A* __restrict bias, A* __restrict h) {
  for (int64_t j = 0; j < H; ++j) h[j] = RnnUnit<A, kRelu>::forward(x[j], hh[j] + bias[j]);
}

template <typename A, bool kSave>
RNNKERN_CPU_CLONES void lstm_forward_row(int64_t H, const A* __restrict x, const A* __restrict hh,
                                         const A* __restrict bias, const A* __restrict c_prev,
                                         A* __restrict c, A* __restrict h, A* __restrict ws) {
  for (int64_t j = 0; j < H; ++j) {
    const auto r = LstmUnit<A>::forward(
        x[j] + hh[j] + bias[j], x[H + j] + hh[H + j] + bias[H + j],
        x[2 * H + j] + hh[2 * H + j] + bias[2 * H + j], x[3 * H + j] + hh[3 * H + j] + bias[3 * H + j],
        c_prev[j]);
    c[j] = r.c;
    h[j] = r.h;
    if constexpr (kSave) {
      ws[j] = r.i;
      ws[H + j] = r.f;
      ws[2 * H + j] = r.g;
      ws[3 * H + j] = r.o;
      ws[4 * H + j] = r.c;
    }
  }
}

template <typename A, bool kSave>
RNNKERN_CPU_CLONES void gru_forward_row(int64_t H, const A* __restrict x, const A* __restrict hh,
                                        const A* __restrict bias, const A* __restrict h_prev,
                                        A* __restrict h, A* __restrict ws) {
  for (int64_t j = 0; j < H; ++j) {
    const A hn = hh[2 * H + j] + bias[2 * H + j];
    const auto r = GruUnit<A>::forward(x[j], x[H + j], x[2 * H + j], hh[j] + bias[j],
                                       hh[H + j] + bias[H + j], hn, h_prev[j]);
    h[j] = r.h;
    if constexpr (kSave) {
      ws[j] = r.r;
      ws[H + j] = r.z;
      ws[2 * H + j] = r.n;
      ws[3 * H + j] = hn;
    }
  }
}

// Reset-before GRU, stage 1: r, z (kept in rz for stage 2) and r * h_prev.
template <typename A>
RNNKERN_CPU_CLONES void gru_rb_gates_row(int64_t H, const A* __restrict x, const A* __restrict hh,
                                         const A* __restrict bias, const A* __restrict h_prev,
                                         A* __restrict rz, A* __restrict rh) {
  for (int64_t j = 0; j < H; ++j) {
    const auto g = GruResetBeforeUnit<A>::gates(x[j], x[H + j], hh[j] + bias[j],
                                                hh[H + j] + bias[H + j], h_prev[j]);
    rz[j] = g.r;
    rz[H + j] = g.z;
    rh[j] = g.rh;
  }
}

// Stage 2: hn = (r * h_prev) W_hn^T, the candidate and h.
template <typename A, bool kSave>
RNNKERN_CPU_CLONES void gru_rb_candidate_row(int64_t H, const A* __restrict x,
                                             const A* __restrict hn, const A* __restrict bias,
                                             const A* __restrict rz, const A* __restrict h_prev,
                                             A* __restrict h, A* __restrict ws) {
  for (int64_t j = 0; j < H; ++j) {
    const auto c = GruResetBeforeUnit<A>::candidate(x[2 * H + j], hn[j] + bias[2 * H + j],
                                                    rz[H + j], h_prev[j]);
    h[j] = c.h;
    if constexpr (kSave) {
      ws[j] = rz[j];
      ws[H + j] = rz[H + j];
      ws[2 * H + j] = c.n;
    }
  }
}

// ------------------------------------------------------------------------
// Backward row kernels.  dh_io holds the gradient carried from step t+1 on
// entry (plus gout, the gradient of this step's output, when given) and the
// direct part of dh_{t-1} on exit; the GEMM part is added afterwards.
// dx: the xproj-gradient row (time position), da: the hproj-gradient row
// the step's GEMM reads.

template <typename A, bool kRelu>
RNNKERN_CPU_CLONES void rnn_backward_row(int64_t H, A* __restrict dh_io, const A* __restrict gout,
                                         const A* __restrict h, A* __restrict dx,
                                         A* __restrict da) {
  for (int64_t j = 0; j < H; ++j) {
    const A g = RnnUnit<A, kRelu>::backward(dh_io[j] + gout[j], h[j]);
    dx[j] = g;
    da[j] = g;
    dh_io[j] = A(0);
  }
}

// dh: gradient of the unprojected h_t (dh_io + gout without projection).
template <typename A, bool kProj>
RNNKERN_CPU_CLONES void lstm_backward_row(int64_t H, A* __restrict dh_io, const A* __restrict gout,
                                          A* __restrict dc_io, const A* __restrict ws,
                                          const A* __restrict c_prev, A* __restrict dx,
                                          A* __restrict da, A* __restrict h_full) {
  for (int64_t j = 0; j < H; ++j) {
    const A dh = kProj ? dh_io[j] : dh_io[j] + gout[j];
    const A i = ws[j], f = ws[H + j], g = ws[2 * H + j], o = ws[3 * H + j], c = ws[4 * H + j];
    const auto r = LstmUnit<A>::backward(dh, dc_io[j], i, f, g, o, c, c_prev[j]);
    dx[j] = da[j] = r.di;
    dx[H + j] = da[H + j] = r.df;
    dx[2 * H + j] = da[2 * H + j] = r.dg;
    dx[3 * H + j] = da[3 * H + j] = r.do_;
    dc_io[j] = r.dc_prev;
    if constexpr (kProj) {
      h_full[j] = o * Math<A>::tanh(c);
    } else {
      dh_io[j] = A(0);
    }
  }
}

template <typename A>
RNNKERN_CPU_CLONES void gru_backward_row(int64_t H, A* __restrict dh_io, const A* __restrict gout,
                                         const A* __restrict ws, const A* __restrict h_prev,
                                         A* __restrict dx, A* __restrict da, A* __restrict dhn) {
  for (int64_t j = 0; j < H; ++j) {
    const auto r = GruUnit<A>::backward(dh_io[j] + gout[j], ws[j], ws[H + j], ws[2 * H + j],
                                        ws[3 * H + j], h_prev[j]);
    dx[j] = da[j] = r.dr;
    dx[H + j] = da[H + j] = r.dz;
    dx[2 * H + j] = r.dxn;
    da[2 * H + j] = dhn[j] = r.dhn;
    dh_io[j] = r.dh_prev;
  }
}

// Reset-before GRU, stage 1: z and the candidate.  dn goes to the GEMM
// drh = dn W_hn; da receives dz at [H, 2H).
template <typename A>
RNNKERN_CPU_CLONES void gru_rb_backward_candidate_row(int64_t H, A* __restrict dh_io,
                                                      const A* __restrict gout,
                                                      const A* __restrict ws,
                                                      const A* __restrict h_prev,
                                                      A* __restrict dx, A* __restrict da,
                                                      A* __restrict dn) {
  for (int64_t j = 0; j < H; ++j) {
    const auto r = GruResetBeforeUnit<A>::backward_candidate(dh_io[j] + gout[j], ws[H + j],
                                                             ws[2 * H + j], h_prev[j]);
    dx[H + j] = da[H + j] = r.dz;
    dx[2 * H + j] = dn[j] = r.dn;
    dh_io[j] = r.dh_prev;
  }
}

// Stage 2: the reset gate, from drh = dn W_hn.  Also records r * h_prev,
// the input of W_hn, for the weight gradient.
template <typename A>
RNNKERN_CPU_CLONES void gru_rb_backward_reset_row(int64_t H, A* __restrict dh_io,
                                                  const A* __restrict drh, const A* __restrict ws,
                                                  const A* __restrict h_prev, A* __restrict dx,
                                                  A* __restrict da, A* __restrict rh) {
  for (int64_t j = 0; j < H; ++j) {
    const A r = ws[j];
    const auto g = GruResetBeforeUnit<A>::backward_reset(drh[j], r, h_prev[j]);
    dx[j] = da[j] = g.dr;
    dh_io[j] += g.dh_prev;
    rh[j] = r * h_prev[j];
  }
}

// ------------------------------------------------------------------------
// Forward driver.  All tensors are contiguous, of dtype A.
template <typename A>
struct ForwardArgs {
  const RecurrenceSizes& z;
  Tensor xproj, h0, c0, w_hh, bias, w_hr;  // bias: b_hh or zeros
  Positions pos;
  bool train;
};

template <typename A>
void forward_impl(const ForwardArgs<A>& a, Tensor& output, Tensor& h_n, Tensor& c_n,
                  Tensor& ws) {
  const RecurrenceSizes& z = a.z;
  const int64_t T = z.T, B = z.B, H = z.H, P = z.P, G = z.G;
  const int64_t W = workspace_width(z.cell) * H;
  const auto opt = a.xproj.options();
  const bool lstm = z.cell == Cell::Lstm;
  const bool reset_before = z.cell == Cell::GruResetBefore;

  // State ping-pong buffers and per-step scratch, allocated once.
  Tensor h_buf[2] = {a.h0.clone(), at::empty({B, P}, opt)};
  Tensor c_buf[2];
  if (lstm) c_buf[0] = a.c0.clone(), c_buf[1] = at::empty({B, H}, opt);
  Tensor hproj = at::empty({B, reset_before ? 2 * H : G * H}, opt);
  Tensor rz, rh, hn;
  if (reset_before) rz = at::empty({B, 2 * H}, opt), rh = at::empty({B, H}, opt), hn = at::empty({B, H}, opt);
  Tensor h_full = z.has_proj ? at::empty({B, H}, opt) : Tensor();
  const Tensor w_gemm = reset_before ? a.w_hh.narrow(0, 0, 2 * H).t() : a.w_hh.t();
  const Tensor w_hn_t = reset_before ? a.w_hh.narrow(0, 2 * H, H).t() : Tensor();
  const Tensor w_hr_t = z.has_proj ? a.w_hr.t() : Tensor();

  const A* xp = a.xproj.template data_ptr<A>();
  const A* bias = a.bias.template data_ptr<A>();
  A* out = output.template data_ptr<A>();
  A* wsp = a.train ? ws.template data_ptr<A>() : nullptr;
  const bool save = a.train;

  for (int64_t s = 0; s < T; ++s) {
    const Tensor& h_prev_t = h_buf[s & 1];
    Tensor& h_next_t = h_buf[(s + 1) & 1];
    const A* h_prev = h_prev_t.template data_ptr<A>();
    A* h_next = h_next_t.template data_ptr<A>();
    const A* c_prev = lstm ? c_buf[s & 1].template data_ptr<A>() : nullptr;
    A* c_next = lstm ? c_buf[(s + 1) & 1].template data_ptr<A>() : nullptr;
    A* hf = z.has_proj ? h_full.template data_ptr<A>() : nullptr;

    at::mm_out(hproj, h_prev_t, w_gemm);
    const A* hp = hproj.template data_ptr<A>();

    if (reset_before) {
      A* rzp = rz.template data_ptr<A>();
      A* rhp = rh.template data_ptr<A>();
      for_each_row(B, 2 * H, [&](int64_t b) {
        if (a.pos.at(b, s) < 0) return zero_row(rhp + b * H, H);
        gru_rb_gates_row<A>(H, xp + (a.pos.at(b, s) * B + b) * G * H, hp + b * 2 * H, bias,
                            h_prev + b * H, rzp + b * 2 * H, rhp + b * H);
      });
      at::mm_out(hn, rh, w_hn_t);
      const A* hnp = hn.template data_ptr<A>();
      for_each_row(B, H, [&](int64_t b) {
        const int64_t p = a.pos.at(b, s);
        if (p < 0) return;
        const A* x = xp + (p * B + b) * G * H;
        A* w = save ? wsp + (p * B + b) * W : nullptr;
        if (save)
          gru_rb_candidate_row<A, true>(H, x, hnp + b * H, bias, rzp + b * 2 * H, h_prev + b * H,
                                        h_next + b * H, w);
        else
          gru_rb_candidate_row<A, false>(H, x, hnp + b * H, bias, rzp + b * 2 * H, h_prev + b * H,
                                         h_next + b * H, w);
      });
    } else {
      for_each_row(B, G * H, [&](int64_t b) {
        const int64_t p = a.pos.at(b, s);
        if (p < 0) return;
        const A* x = xp + (p * B + b) * G * H;
        const A* hh = hp + b * G * H;
        A* w = save ? wsp + (p * B + b) * W : nullptr;
        switch (z.cell) {
          case Cell::RnnTanh: return rnn_forward_row<A, false>(H, x, hh, bias, h_next + b * H);
          case Cell::RnnRelu: return rnn_forward_row<A, true>(H, x, hh, bias, h_next + b * H);
          case Cell::Lstm: {
            A* h_dst = z.has_proj ? hf + b * H : h_next + b * P;
            if (save)
              return lstm_forward_row<A, true>(H, x, hh, bias, c_prev + b * H, c_next + b * H, h_dst, w);
            return lstm_forward_row<A, false>(H, x, hh, bias, c_prev + b * H, c_next + b * H, h_dst, w);
          }
          case Cell::Gru:
            if (save) return gru_forward_row<A, true>(H, x, hh, bias, h_prev + b * H, h_next + b * H, w);
            return gru_forward_row<A, false>(H, x, hh, bias, h_prev + b * H, h_next + b * H, w);
          case Cell::GruResetBefore: return;  // handled above
        }
      });
    }
    if (z.has_proj) at::mm_out(h_next_t, h_full, w_hr_t);

    // Outputs at each row's time position; finished rows keep their state and
    // write zeros at the padding position s.
    for_each_row(B, P, [&](int64_t b) {
      const int64_t p = a.pos.at(b, s);
      if (p >= 0) return copy_row(out + (p * B + b) * P, h_next + b * P, P);
      copy_row(h_next + b * P, h_prev + b * P, P);
      if (lstm) copy_row(c_next + b * H, c_prev + b * H, H);
      zero_row(out + (s * B + b) * P, P);
      if (save) zero_row(wsp + (s * B + b) * W, W);
    });
  }
  h_n.copy_(h_buf[T & 1]);
  if (lstm) c_n.copy_(c_buf[T & 1]);
}

// ------------------------------------------------------------------------
// Backward driver.
template <typename A>
struct BackwardArgs {
  const RecurrenceSizes& z;
  Tensor grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output, ws;
  Positions pos;
};

template <typename A>
void backward_impl(const BackwardArgs<A>& a, Tensor& d_xproj, Tensor& d_h0, Tensor& d_c0,
                   Tensor& d_w_hh, Tensor& d_b_hh, Tensor& d_w_hr) {
  const RecurrenceSizes& z = a.z;
  const int64_t T = z.T, B = z.B, H = z.H, P = z.P, G = z.G;
  const int64_t W = workspace_width(z.cell) * H;
  const auto opt = a.output.options();
  const bool lstm = z.cell == Cell::Lstm;
  const bool gru = z.cell == Cell::Gru;
  const bool reset_before = z.cell == Cell::GruResetBefore;

  // Carried gradients (the outputs d_h0 / d_c0 are used as the carry).
  d_h0.copy_(a.grad_h_n);
  if (lstm) d_c0.copy_(a.grad_c_n);
  // Per-step GEMM input, and time-ordered inputs of the final weight GEMMs.
  Tensor da = at::empty({B, G * H}, opt);
  Tensor h_prev_all = at::empty({T, B, P}, opt);
  Tensor dhn_all = gru ? at::empty({T, B, H}, opt) : Tensor();
  Tensor rh_all = reset_before ? at::empty({T, B, H}, opt) : Tensor();
  Tensor dn = reset_before ? at::empty({B, H}, opt) : Tensor();
  Tensor drh = reset_before ? at::empty({B, H}, opt) : Tensor();
  Tensor dh_tot = z.has_proj ? at::empty({B, P}, opt) : Tensor();
  Tensor dh_full = z.has_proj ? at::empty({B, H}, opt) : Tensor();
  Tensor dh_tot_all = z.has_proj ? at::empty({T, B, P}, opt) : Tensor();
  Tensor h_full_all = z.has_proj ? at::empty({T, B, H}, opt) : Tensor();

  A* dh = d_h0.template data_ptr<A>();
  A* dc = lstm ? d_c0.template data_ptr<A>() : nullptr;
  A* dap = da.template data_ptr<A>();
  A* dx = d_xproj.template data_ptr<A>();
  A* hprev_all = h_prev_all.template data_ptr<A>();
  const A* gout = a.grad_output.template data_ptr<A>();
  const A* out = a.output.template data_ptr<A>();
  const A* wsp = W > 0 ? a.ws.template data_ptr<A>() : nullptr;
  const A* h0 = a.h0.template data_ptr<A>();
  const A* c0 = lstm ? a.c0.template data_ptr<A>() : nullptr;

  for (int64_t s = T - 1; s >= 0; --s) {
    // h_{t-1} (and c_{t-1}) of row b: its state one step earlier.
    auto prev_pos = [&](int64_t b) { return s == 0 ? -1 : a.pos.at(b, s - 1); };
    auto h_prev_of = [&](int64_t b) {
      const int64_t q = prev_pos(b);
      return q < 0 ? h0 + b * P : out + (q * B + b) * P;
    };

    if (z.has_proj) {
      // dh of the projected output, then through W_hr to the cell's h.
      A* dt = dh_tot.template data_ptr<A>();
      A* dt_all = dh_tot_all.template data_ptr<A>();
      for_each_row(B, P, [&](int64_t b) {
        const int64_t p = a.pos.at(b, s);
        if (p < 0) {
          zero_row(dt + b * P, P);
          return zero_row(dt_all + (s * B + b) * P, P);
        }
        for (int64_t k = 0; k < P; ++k) dt[b * P + k] = dh[b * P + k] + gout[(p * B + b) * P + k];
        copy_row(dt_all + (p * B + b) * P, dt + b * P, P);
      });
      at::mm_out(dh_full, dh_tot, a.w_hr);
    }

    for_each_row(B, G * H, [&](int64_t b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) {
        zero_row(dap + b * G * H, G * H);
        zero_row(dx + (s * B + b) * G * H, G * H);
        zero_row(hprev_all + (s * B + b) * P, P);
        if (gru) zero_row(dhn_all.template data_ptr<A>() + (s * B + b) * H, H);
        if (reset_before) {
          zero_row(dn.template data_ptr<A>() + b * H, H);
          zero_row(rh_all.template data_ptr<A>() + (s * B + b) * H, H);
        }
        if (z.has_proj) zero_row(h_full_all.template data_ptr<A>() + (s * B + b) * H, H);
        return;
      }
      const int64_t row = p * B + b;
      const A* hprev = h_prev_of(b);
      copy_row(hprev_all + row * P, hprev, P);
      const A* g = gout + row * P;
      switch (z.cell) {
        case Cell::RnnTanh:
          return rnn_backward_row<A, false>(H, dh + b * H, g, out + row * H, dx + row * H, dap + b * H);
        case Cell::RnnRelu:
          return rnn_backward_row<A, true>(H, dh + b * H, g, out + row * H, dx + row * H, dap + b * H);
        case Cell::Lstm: {
          const int64_t q = prev_pos(b);
          const A* c_prev = q < 0 ? c0 + b * H : wsp + (q * B + b) * W + 4 * H;
          if (z.has_proj) {
            // The carried dh is already folded into dh_full; LSTM has no direct
            // path from h_t to h_{t-1}, so the carry restarts at 0.
            lstm_backward_row<A, true>(H, dh_full.template data_ptr<A>() + b * H, nullptr, dc + b * H,
                                       wsp + row * W, c_prev, dx + row * 4 * H, dap + b * 4 * H,
                                       h_full_all.template data_ptr<A>() + row * H);
            return zero_row(dh + b * P, P);
          }
          return lstm_backward_row<A, false>(H, dh + b * H, g, dc + b * H, wsp + row * W, c_prev,
                                             dx + row * 4 * H, dap + b * 4 * H, nullptr);
        }
        case Cell::Gru:
          return gru_backward_row<A>(H, dh + b * H, g, wsp + row * W, hprev, dx + row * 3 * H,
                                     dap + b * 3 * H, dhn_all.template data_ptr<A>() + row * H);
        case Cell::GruResetBefore:
          return gru_rb_backward_candidate_row<A>(H, dh + b * H, g, wsp + row * W, hprev,
                                                  dx + row * 3 * H, dap + b * 3 * H,
                                                  dn.template data_ptr<A>() + b * H);
      }
    });

    if (reset_before) {
      at::mm_out(drh, dn, a.w_hh.narrow(0, 2 * H, H));
      const A* drhp = drh.template data_ptr<A>();
      for_each_row(B, H, [&](int64_t b) {
        const int64_t p = a.pos.at(b, s);
        if (p < 0) return;
        const int64_t row = p * B + b;
        gru_rb_backward_reset_row<A>(H, dh + b * H, drhp + b * H, wsp + row * W, h_prev_of(b),
                                     dx + row * 3 * H, dap + b * 3 * H,
                                     rh_all.template data_ptr<A>() + row * H);
      });
      // dh_{t-1} += [dr, dz] [W_hr; W_hz]
      d_h0.addmm_(da.narrow(1, 0, 2 * H), a.w_hh.narrow(0, 0, 2 * H));
    } else {
      d_h0.addmm_(da, a.w_hh);
    }
  }

  // Weight gradients: one GEMM over all T*B rows each.
  const Tensor dx2 = d_xproj.view({T * B, G * H});
  const Tensor hp2 = h_prev_all.view({T * B, P});
  static const int64_t kRows[] = {0};
  const at::IntArrayRef rows_dim(kRows);
  if (gru || reset_before) {
    // Rows [0, 2H) (r, z) multiply h_{t-1}; rows [2H, 3H) (n) multiply h_{t-1}
    // (reset after) or r * h_{t-1} (reset before), with their own gradient.
    Tensor dw_rz = d_w_hh.narrow(0, 0, 2 * H), dw_n = d_w_hh.narrow(0, 2 * H, H);
    Tensor db_rz = d_b_hh.narrow(0, 0, 2 * H), db_n = d_b_hh.narrow(0, 2 * H, H);
    const Tensor dn2 = gru ? dhn_all.view({T * B, H}) : dx2.narrow(1, 2 * H, H);
    const Tensor in2 = gru ? hp2 : rh_all.view({T * B, H});
    at::mm_out(dw_rz, dx2.narrow(1, 0, 2 * H).t(), hp2);
    at::mm_out(dw_n, dn2.t(), in2);
    at::sum_out(db_rz, dx2.narrow(1, 0, 2 * H), rows_dim);
    at::sum_out(db_n, dn2, rows_dim);
  } else {
    at::mm_out(d_w_hh, dx2.t(), hp2);
    at::sum_out(d_b_hh, dx2, rows_dim);
  }
  if (z.has_proj) {
    at::mm_out(d_w_hr, dh_tot_all.view({T * B, P}).t(), h_full_all.view({T * B, H}));
  }
}

// ------------------------------------------------------------------------
// Op entry points: checks, conversion to the accumulate dtype, dispatch on
// float / double, conversion back.

Tensor to_acc(const Tensor& t, at::ScalarType acc) { return t.to(acc).contiguous(); }
Tensor to_acc(const OptTensor& t, at::ScalarType acc) {
  return t.has_value() ? to_acc(*t, acc) : Tensor();
}

struct LengthsHolder {
  Tensor lengths;  // keeps the contiguous copy alive while Positions points into it
  Positions positions(const OptTensor& l, int64_t T, bool reverse) {
    if (!l.has_value()) return Positions{nullptr, T, reverse};
    lengths = l->contiguous();
    return Positions{lengths.data_ptr<int64_t>(), T, reverse};
  }
};

// Forward on tensors of any floating dtype; results in the accumulate dtype.
std::tuple<Tensor, Tensor, Tensor, Tensor> run_forward(const RecurrenceSizes& z,
                                                       const Tensor& xproj, const Tensor& h0,
                                                       const OptTensor& c0, const Tensor& w_hh,
                                                       const OptTensor& b_hh,
                                                       const OptTensor& w_hr,
                                                       const Positions& pos, bool train) {
  const auto acc = acc_type(h0.scalar_type());
  const auto opt = h0.options().dtype(acc);
  const bool lstm = z.cell == Cell::Lstm;
  Tensor output = at::empty({z.T, z.B, z.P}, opt);
  Tensor h_n = at::empty({z.B, z.P}, opt);
  Tensor c_n = lstm ? at::empty({z.B, z.H}, opt) : empty_like_options(h0, acc);
  Tensor ws = train ? at::empty({z.T, z.B, workspace_width(z.cell) * z.H}, opt)
                    : empty_like_options(h0, acc);
  AT_DISPATCH_FLOATING_TYPES(acc, "rnnkern_recurrence_cpu", [&] {
    ForwardArgs<scalar_t> a{z,
                            to_acc(xproj, acc),
                            to_acc(h0, acc),
                            to_acc(c0, acc),
                            to_acc(w_hh, acc),
                            b_hh.has_value() ? to_acc(*b_hh, acc) : at::zeros({z.G * z.H}, opt),
                            to_acc(w_hr, acc),
                            pos,
                            train};
    forward_impl<scalar_t>(a, output, h_n, c_n, ws);
  });
  return {output, h_n, c_n, ws};
}

// Backward on tensors of any floating dtype; results in the accumulate dtype.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> run_backward(
    const RecurrenceSizes& z, const Tensor& grad_output, const Tensor& grad_h_n,
    const OptTensor& grad_c_n, const Tensor& h0, const OptTensor& c0, const Tensor& w_hh,
    const OptTensor& w_hr, const Tensor& output, const Tensor& workspace, const Positions& pos) {
  const auto acc = acc_type(h0.scalar_type());
  const auto opt = h0.options().dtype(acc);
  const bool lstm = z.cell == Cell::Lstm;
  Tensor d_xproj = at::empty({z.T, z.B, z.G * z.H}, opt);
  Tensor d_h0 = at::empty({z.B, z.P}, opt);
  Tensor d_c0 = lstm ? at::empty({z.B, z.H}, opt) : empty_like_options(h0, acc);
  Tensor d_w_hh = at::empty({z.G * z.H, z.P}, opt);
  Tensor d_b_hh = at::empty({z.G * z.H}, opt);
  Tensor d_w_hr = z.has_proj ? at::empty({z.P, z.H}, opt) : empty_like_options(h0, acc);
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
                             pos};
    backward_impl<scalar_t>(a, d_xproj, d_h0, d_c0, d_w_hh, d_b_hh, d_w_hr);
  });
  return {d_xproj, d_h0, d_c0, d_w_hh, d_b_hh, d_w_hr};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> recurrence_cpu(
    c10::string_view cell, const Tensor& xproj, const Tensor& h0, const OptTensor& c0,
    const Tensor& w_hh, const OptTensor& b_hh, const OptTensor& w_hr, const OptTensor& lengths,
    bool reverse, bool train) {
  const RecurrenceSizes z = check_recurrence(cell, xproj, h0, c0, w_hh, b_hh, w_hr, lengths);
  LengthsHolder holder;
  auto [output, h_n, c_n, ws] = run_forward(z, xproj, h0, c0, w_hh, b_hh, w_hr,
                                            holder.positions(lengths, z.T, reverse), train);
  const auto dtype = xproj.scalar_type();
  return {output.to(dtype), h_n.to(dtype), c_n.to(dtype), ws};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> recurrence_backward_cpu(
    c10::string_view cell, const Tensor& grad_output, const Tensor& grad_h_n,
    const OptTensor& grad_c_n, const Tensor& h0, const OptTensor& c0, const Tensor& w_hh,
    const OptTensor& w_hr, const Tensor& output, const Tensor& workspace,
    const OptTensor& lengths, bool reverse) {
  const RecurrenceSizes z = check_recurrence_backward(cell, grad_output, grad_h_n, grad_c_n, h0,
                                                      c0, w_hh, w_hr, output, workspace, lengths);
  LengthsHolder holder;
  auto [d_xproj, d_h0, d_c0, d_w_hh, d_b_hh, d_w_hr] =
      run_backward(z, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output, workspace,
                   holder.positions(lengths, z.T, reverse));
  const auto dtype = output.scalar_type();
  return {d_xproj.to(dtype), d_h0.to(dtype), d_c0.to(dtype),
          d_w_hh.to(dtype),  d_b_hh.to(dtype), d_w_hr.to(dtype)};
}

RecurrenceSizes step_as_recurrence(const StepSizes& s) {
  return RecurrenceSizes{s.cell, 1, s.B, s.H, s.H, s.G, false};
}

// The single step: the product [x, h] [W_ih; W_hh]^T is split along K into
// x W_ih^T (+ b_ih) and h W_hh^T, two GEMMs whose sum the gate pass forms:
// the recurrence above with T = 1 and xproj = x W_ih^T + b_ih.
std::tuple<Tensor, Tensor, Tensor> step_cpu(c10::string_view cell, const Tensor& x,
                                            const Tensor& h, const OptTensor& c,
                                            const Tensor& w_ih, const Tensor& w_hh,
                                            const OptTensor& b_ih, const OptTensor& b_hh) {
  const StepSizes s = check_step(cell, x, h, c, w_ih, w_hh, b_ih, b_hh);
  const auto dtype = x.scalar_type();
  const auto acc = acc_type(dtype);
  const Tensor xa = x.to(acc), wa = w_ih.to(acc).t();
  const Tensor xproj = b_ih.has_value() ? at::addmm(b_ih->to(acc), xa, wa) : at::mm(xa, wa);
  auto [output, h_new, c_new, ws] =
      run_forward(step_as_recurrence(s), xproj.unsqueeze(0), h, c, w_hh, b_hh, std::nullopt,
                  Positions{nullptr, 1, false}, true);
  return {h_new.to(dtype), c_new.to(dtype), ws.view({s.B, workspace_width(s.cell) * s.H})};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> step_backward_cpu(
    c10::string_view cell, const Tensor& grad_h_new, const OptTensor& grad_c_new, const Tensor& x,
    const Tensor& h, const OptTensor& c, const Tensor& w_ih, const Tensor& w_hh,
    const Tensor& h_new, const Tensor& workspace) {
  const StepSizes s =
      check_step_backward(cell, grad_h_new, grad_c_new, x, h, c, w_ih, w_hh, h_new, workspace);
  const auto dtype = x.scalar_type();
  const auto acc = acc_type(dtype);
  // The step's single output is also its final state: its gradient enters
  // once, as grad_h_n, with a zero grad_output.
  auto [d_xproj, d_h, d_c, d_w_hh, d_b_hh, d_w_hr] = run_backward(
      step_as_recurrence(s), at::zeros({1, s.B, s.H}, h.options().dtype(acc)), grad_h_new,
      grad_c_new, h, c, w_hh, std::nullopt, h_new.unsqueeze(0),
      workspace.view({1, s.B, workspace.size(1)}), Positions{nullptr, 1, false});
  (void)d_w_hr;
  const Tensor dxp = d_xproj.squeeze(0);
  const Tensor d_x = at::mm(dxp, w_ih.to(acc));
  const Tensor d_w_ih = at::mm(dxp.t(), x.to(acc));
  const Tensor d_b_ih = dxp.sum(0);
  return {d_x.to(dtype),    d_h.to(dtype),      d_c.to(dtype),   d_w_ih.to(dtype),
          d_w_hh.to(dtype), d_b_ih.to(dtype), d_b_hh.to(dtype)};
}

}  // namespace
}  // namespace rnnkern::cpu

TORCH_LIBRARY_IMPL(rnnkern, CPU, m) {
  m.impl("recurrence", &rnnkern::cpu::recurrence_cpu);
  m.impl("recurrence_backward", &rnnkern::cpu::recurrence_backward_cpu);
  m.impl("step", &rnnkern::cpu::step_cpu);
  m.impl("step_backward", &rnnkern::cpu::step_backward_cpu);
}

// The CUDA backend's ops, device-independent: argument checks (checks.h), the
// tensors -> params.h structs unpacking, scratch allocation and the weight
// gradients after the time loop.  Instantiated for the real device
// (bindings.cpp) and for the emulated one (csrc/cuda_emu/bindings.cpp), so
// that the emulated tests run this very code.  `Dev` provides:
//   Context context();                          stream, cuBLAS handle, TF32 flag
//   void check_device(const char* op, const Tensor&);
//   Guard (constructed from a c10::Device)      selects the device
//   Tensor empty(IntArrayRef, TensorOptions)    device memory, contents undefined
//   template <S> void step_forward(const StepParams&, const Context&)
//
// The weight and bias gradients are one large GEMM / reduction each, run
// with ATen after the backward's time loop.
#pragma once

#include <algorithm>
#include <vector>

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/where.h>
#include <torch/library.h>

#include "../checks.h"
#include "params.h"

namespace rnnkern::cuda::bindings {


template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<S>{}) with S the kernels' storage type of dtype t.
template <typename F>
void dispatch_storage(at::ScalarType t, const F& f) {
  switch (t) {
    case at::kDouble: return f(Tag<double>{});
    case at::kFloat: return f(Tag<float>{});
    case at::kHalf: return f(Tag<__half>{});
    case at::kBFloat16: return f(Tag<__nv_bfloat16>{});
    default: TORCH_CHECK_TYPE(false, "rnnkern (CUDA): unsupported dtype ", t);
  }
}

// Inputs through const_data_ptr: a copy-on-write input stays shared (see ops.py).
const void* ptr(const Tensor& t) { return t.defined() && t.numel() > 0 ? t.const_data_ptr() : nullptr; }
void* mut_ptr(const Tensor& t) { return t.defined() && t.numel() > 0 ? t.data_ptr() : nullptr; }

Tensor contiguous_or_undefined(const OptTensor& t) {
  return t.has_value() ? t->contiguous() : Tensor();
}

// A per-step row source ([T, B, N] read row by row): kept as is when its
// last dimension is dense (batch-first views need no copy).
Tensor rows_dense(const Tensor& t) { return t.stride(2) == 1 ? t : t.contiguous(); }

// The device copy of the lengths, or an undefined tensor without lengths.
template <typename Dev>
Tensor device_lengths(const OptTensor& lengths, const at::TensorOptions& opt, cudaStream_t stream) {
  if (!lengths.has_value()) return Tensor();
  const Tensor host = lengths->contiguous();
  Tensor dev = Dev::empty({host.size(0)}, opt.dtype(at::kLong));
  upload_lengths(host.const_data_ptr<int64_t>(), host.size(0), dev.data_ptr<int64_t>(), stream);
  return dev;
}

// Per step s, the rows [0, live[s]) its products cover (params.h's live_rows):
// up to the last row still running at s, a row running while s < its length.
// The rows from b on are all finished at s once s reaches the longest of
// their lengths, so live[s] counts the rows whose suffix maximum exceeds s.
// Empty without lengths (every step covers all rows).
std::vector<int64_t> live_rows(const OptTensor& lengths, int64_t T) {
  if (!lengths.has_value()) return {};
  const Tensor host = lengths->contiguous();
  const int64_t* n = host.const_data_ptr<int64_t>();
  const int64_t B = host.size(0);
  std::vector<int64_t> suffix_max(B + 1, 0);
  for (int64_t b = B - 1; b >= 0; --b) suffix_max[b] = std::max(suffix_max[b + 1], n[b]);
  std::vector<int64_t> live(T);
  int64_t k = B;
  for (int64_t s = 0; s < T; ++s) {
    while (k > 0 && suffix_max[k - 1] <= s) --k;
    live[s] = k;
  }
  return live;
}

// live_rows on the device, for the persistent kernels (params.h's live_rows_dev),
// through kernel parameters as the lengths; undefined when empty or not wanted.
template <typename Dev>
Tensor device_live_rows(const std::vector<int64_t>& live, bool wanted, const at::TensorOptions& opt,
                        cudaStream_t stream) {
  if (live.empty() || !wanted) return Tensor();
  Tensor dev = Dev::empty({int64_t(live.size())}, opt.dtype(at::kLong));
  upload_lengths(live.data(), int64_t(live.size()), dev.data_ptr<int64_t>(), stream);
  return dev;
}

const int64_t kStepsAndRows[] = {0, 1};

// A zoneout mask as the kernels read it: strides in elements along T and B
// (an evaluation mask's 0, 0: no copy), the units dense.
Tensor zoneout_rows(const OptTensor& zoneout) {
  return zoneout.has_value() ? rows_dense(*zoneout) : Tensor();
}

// The positions (t, b) [T, B] whose step started from the reset state rather
// than from the row's previous state: resets, within the row's length, not
// at the row's first step (which starts from h0 whatever resets says).  For
// the weight gradients after the loop.
Tensor reset_restarts(const Tensor& resets, const Tensor& lengths_dev, int64_t T, bool reverse) {
  const Tensor t = at::arange(T, resets.options().dtype(at::kLong)).unsqueeze(1);  // [T, 1]
  if (!lengths_dev.defined()) return resets.logical_and(t.ne(reverse ? T - 1 : 0));
  const Tensor n = lengths_dev.unsqueeze(0);  // [1, B]
  const Tensor first = reverse ? t.add(1).eq(n) : t.eq(0);
  return resets.logical_and(t.lt(n)).logical_and(first.logical_not());
}

// dw = sum over positions p and rows b of d[p, b]^T h_{t-1}(p, b), where
// h_{t-1} is the output one step earlier (p - 1, or p + 1 in reverse) and h0
// at each sequence's first step.  As in the CPU backend, padding positions
// have d = 0 and output 0, so two GEMMs cover every case without gathering
// h_{t-1}: the later positions against the shifted output, and each row's
// first step (d_first: the gate gradients of step 0, whatever its position)
// against h0.  d: [T, B, N] (may be a column slice), out: [T, B, P] (the
// states: with zoneout the blended ones).  `restarts` ([T, B] bool, or
// undefined: no resets, reset_restarts) marks the later positions whose
// step started from the reset state `reset_h` ([B, P]): there it replaces the
// shifted output.
void weight_grad_by_prev_state(Tensor dw, const Tensor& d, const Tensor& d_first,
                               const Tensor& out, const Tensor& h0, bool reverse,
                               const Tensor& restarts = Tensor(),
                               const Tensor& reset_h = Tensor()) {
  const int64_t T = d.size(0), B = d.size(1), N = d.size(2), P = out.size(2);
  at::mm_out(dw, d_first.t(), h0);
  if (T > 1) {
    const Tensor d_later = reverse ? d.narrow(0, 0, T - 1) : d.narrow(0, 1, T - 1);
    Tensor out_earlier = reverse ? out.narrow(0, 1, T - 1) : out.narrow(0, 0, T - 1);
    if (restarts.defined()) {
      const Tensor later = reverse ? restarts.narrow(0, 0, T - 1) : restarts.narrow(0, 1, T - 1);
      out_earlier = at::where(later.unsqueeze(2), reset_h.unsqueeze(0), out_earlier);
    }
    dw.addmm_(d_later.reshape({(T - 1) * B, N}).t(), out_earlier.reshape({(T - 1) * B, P}));
  }
}

// ------------------------------------------------------------- forward ----

// The forward of `recurrence` (arguments checked), and of the lstm_ln step
// (T = 1, train).
template <typename Dev>
std::tuple<Tensor, Tensor, Tensor, Tensor> run_forward(
    const RecurrenceSizes& z, const Tensor& xproj, const Tensor& h0, const OptTensor& c0,
    const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh, const OptTensor& w_hr,
    const OptTensor& lengths, bool reverse, bool train, const OptTensor& resets,
    const OptTensor& zoneout, const OptTensor& ln, const OptTensor& reset_h = std::nullopt,
    const OptTensor& reset_c = std::nullopt) {
  const int64_t T = z.T, B = z.B, H = z.H, P = z.P, G = z.G;
  const int64_t W = workspace_size(z.cell, H, z.has_zoneout);
  const bool has_c = has_cell_state(z.cell), reset_before = z.cell == Cell::GruResetBefore;
  const auto dtype = xproj.scalar_type(), acc = acc_type(dtype);
  const auto opt = xproj.options(), acc_opt = opt.dtype(acc);

  Tensor output = Dev::empty({T, B, P}, opt);
  Tensor h_n = Dev::empty({B, P}, opt);
  // With cell_steps c_n is every step's c, [T, B, H] (the kernels write it).
  Tensor c_n = z.cell_steps ? Dev::empty({T, B, H}, opt)
               : has_c      ? Dev::empty({B, H}, opt)
                            : empty_like_options(xproj, dtype);
  Tensor ws = train ? Dev::empty({T, B, W}, acc_opt) : empty_like_options(xproj, acc);
  if (T == 0 || B == 0) {
    h_n.copy_(h0);
    if (has_c && !z.cell_steps) c_n.copy_(*c0);
    return {output, h_n, c_n, ws};
  }

  const Context ctx = Dev::context();
  const Tensor x = rows_dense(xproj);
  const Tensor h0c = h0.contiguous(), w = w_hh.contiguous();
  const Tensor c0c = contiguous_or_undefined(c0);
  const Tensor bi = contiguous_or_undefined(b_ih), bh = contiguous_or_undefined(b_hh);
  const Tensor wr = contiguous_or_undefined(w_hr);
  const Tensor rs = contiguous_or_undefined(resets), zo = zoneout_rows(zoneout);
  const Tensor lnc = contiguous_or_undefined(ln);
  const Tensor rhc = contiguous_or_undefined(reset_h), rcc = contiguous_or_undefined(reset_c);
  const Tensor lengths_dev = device_lengths<Dev>(lengths, opt, ctx.stream);
  const std::vector<int64_t> live = live_rows(lengths, T);
  const Tensor live_dev = device_live_rows<Dev>(
      live, !z.cell_steps && persistent_chosen(ctx, T, B, P, xproj.element_size(), G), opt, ctx.stream);
  // The state lives in ping-pong slots with lengths and with resets.
  const bool slots = lengths.has_value() || resets.has_value();
  // Scratch of the time loop (params.h).
  const Tensor hproj = Dev::empty({B, reset_before ? 2 * H : G * H}, acc_opt);
  Tensor h_state, c_state;
  if (slots) {
    h_state = Dev::empty({2, B, P}, opt);
    h_state[0].copy_(h0);
  }
  if (has_c) {
    c_state = Dev::empty({2, B, H}, acc_opt);
    c_state[0].copy_(*c0);
  }
  const Tensor rh = reset_before ? Dev::empty({B, H}, opt) : Tensor();
  const Tensor hn = reset_before ? Dev::empty({B, H}, acc_opt) : Tensor();
  const Tensor h_full = z.has_proj ? Dev::empty({B, H}, opt) : Tensor();

  RecurrenceForwardParams p{};
  p.cell = z.cell;
  p.T = T, p.B = B, p.H = H, p.P = P;
  p.reverse = reverse;
  p.lengths = lengths_dev.defined() ? lengths_dev.data_ptr<int64_t>() : nullptr;
  p.live_rows = live.empty() ? nullptr : live.data();
  p.live_rows_dev = live_dev.defined() ? live_dev.const_data_ptr<int64_t>() : nullptr;
  p.xproj = ptr(x);
  p.xproj_stride_t = x.stride(0), p.xproj_stride_b = x.stride(1);
  p.h0 = ptr(h0c);
  p.w_hh = ptr(w);
  p.b_ih = ptr(bi), p.b_hh = ptr(bh);
  p.w_hr = ptr(wr);
  p.c0 = ptr(c0c);
  p.resets = rs.defined() ? rs.const_data_ptr<bool>() : nullptr;
  p.reset_h = ptr(rhc), p.reset_c = ptr(rcc);
  p.zoneout = zo.defined() ? ptr(zo) : nullptr;
  p.zoneout_stride_t = zo.defined() ? zo.stride(0) : 0;
  p.zoneout_stride_b = zo.defined() ? zo.stride(1) : 0;
  p.ln = ptr(lnc);
  p.output = mut_ptr(output);
  p.workspace = train ? mut_ptr(ws) : nullptr;
  p.c_steps = z.cell_steps ? mut_ptr(c_n) : nullptr;
  p.hproj = mut_ptr(hproj);
  p.h_state = mut_ptr(h_state);
  p.c_state = mut_ptr(c_state);
  p.rh = mut_ptr(rh), p.hn = mut_ptr(hn);
  p.h_full = mut_ptr(h_full);
  dispatch_storage(dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    recurrence_forward<S>(p, ctx);
  });

  // The final state: the last step's state slot, or (without slots) the
  // output row of the last step.
  h_n.copy_(slots ? h_state[T & 1] : output[reverse ? 0 : T - 1]);
  if (has_c && !z.cell_steps) c_n.copy_(c_state[T & 1]);
  return {output, h_n, c_n, ws};
}

template <typename Dev>
std::tuple<Tensor, Tensor, Tensor, Tensor> recurrence_op(
    c10::string_view cell, const Tensor& xproj, const Tensor& h0, const OptTensor& c0,
    const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh, const OptTensor& w_hr,
    const OptTensor& lengths, bool reverse, bool train, const OptTensor& resets,
    const OptTensor& zoneout, const OptTensor& ln, const OptTensor& reset_h,
    const OptTensor& reset_c, bool cell_steps) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // inner ATen calls record no graph
  const RecurrenceSizes z = check_recurrence(cell, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, lengths,
                                             resets, zoneout, ln, reset_h, reset_c, cell_steps);
  Dev::check_device("rnnkern.recurrence", xproj);
  const typename Dev::Guard device_guard(xproj.device());
  return run_forward<Dev>(z, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, lengths, reverse, train,
                          resets, zoneout, ln, reset_h, reset_c);
}

// ------------------------------------------------------------ backward ----

struct BackwardResult {
  Tensor d_xproj, d_h0, d_c0, d_w_hh, d_b_ih, d_b_hh, d_w_hr, d_ln, d_reset_h, d_reset_c;
};

// The backward of `recurrence`, and (T = 1, no grad_output) of `step`.
// Results in the storage dtype.  grad_output may be undefined (zeros).
template <typename Dev>
BackwardResult run_backward(const RecurrenceSizes& z, const Tensor& grad_output,
                            const Tensor& grad_h_n, const OptTensor& grad_c_n, const Tensor& h0,
                            const OptTensor& c0, const Tensor& w_hh, const OptTensor& w_hr,
                            const Tensor& output, const Tensor& workspace,
                            const OptTensor& lengths, bool reverse,
                            const OptTensor& resets = std::nullopt,
                            const OptTensor& zoneout = std::nullopt,
                            const OptTensor& ln = std::nullopt,
                            const OptTensor& reset_h = std::nullopt,
                            const OptTensor& reset_c = std::nullopt) {
  const int64_t T = z.T, B = z.B, H = z.H, P = z.P, G = z.G;
  const bool has_c = has_cell_state(z.cell), gru = z.cell == Cell::Gru;
  const bool reset_before = z.cell == Cell::GruResetBefore, lstm_ln = z.cell == Cell::LstmLn;
  const auto dtype = output.scalar_type(), acc = acc_type(dtype);
  const auto opt = output.options(), acc_opt = opt.dtype(acc);

  BackwardResult r;
  r.d_xproj = Dev::empty({T, B, G * H}, opt);
  r.d_h0 = Dev::empty({B, P}, opt);
  r.d_c0 = has_c ? Dev::empty({B, H}, opt) : empty_like_options(output, dtype);
  r.d_w_hh = Dev::empty({G * H, P}, opt);
  r.d_b_ih = Dev::empty({G * H}, opt);
  r.d_b_hh = Dev::empty({G * H}, opt);
  r.d_w_hr = z.has_proj ? Dev::empty({P, H}, opt) : empty_like_options(output, dtype);
  r.d_ln = lstm_ln ? Dev::empty({10 * H}, opt) : empty_like_options(output, dtype);
  r.d_reset_h = reset_h.has_value() ? Dev::empty({B, P}, opt) : empty_like_options(output, dtype);
  r.d_reset_c = reset_c.has_value() ? Dev::empty({B, H}, opt) : empty_like_options(output, dtype);
  if (T == 0 || B == 0) {
    r.d_xproj.zero_();
    r.d_h0.copy_(grad_h_n);
    if (has_c) z.cell_steps ? r.d_c0.zero_() : r.d_c0.copy_(*grad_c_n);
    for (Tensor* t : {&r.d_w_hh, &r.d_b_ih, &r.d_b_hh, &r.d_w_hr, &r.d_ln, &r.d_reset_h,
                      &r.d_reset_c})
      t->zero_();
    return r;
  }

  const Context ctx = Dev::context();
  const Tensor gout = grad_output.defined() ? rows_dense(grad_output) : Tensor();
  const Tensor h0c = h0.contiguous(), w = w_hh.contiguous(), out = output.contiguous();
  const Tensor c0c = contiguous_or_undefined(c0), wr = contiguous_or_undefined(w_hr);
  const Tensor wsc = workspace.contiguous();
  const Tensor rs = contiguous_or_undefined(resets), zo = zoneout_rows(zoneout);
  const Tensor lnc = contiguous_or_undefined(ln);
  const Tensor rhc = contiguous_or_undefined(reset_h), rcc = contiguous_or_undefined(reset_c);
  const Tensor lengths_dev = device_lengths<Dev>(lengths, opt, ctx.stream);
  const std::vector<int64_t> live = live_rows(lengths, T);
  // The carried gradients (updated in place: fresh copies) and the scratch.
  Tensor dh = Dev::empty({B, P}, acc_opt);
  dh.copy_(grad_h_n);
  // With cell_steps grad_c_n is [T, B, H]: each step's part joins the carry
  // at that step (lstm_backward_unit), so the carry starts at zero.
  Tensor dc;
  if (has_c) {
    dc = Dev::empty({B, H}, acc_opt);
    z.cell_steps ? dc.zero_() : dc.copy_(*grad_c_n);
  }
  const Tensor gc_steps = z.cell_steps ? grad_c_n->contiguous() : Tensor();
  Tensor dh0_reset, dc0_reset;
  if (resets.has_value()) {
    dh0_reset = Dev::empty({B, P}, acc_opt);
    dh0_reset.zero_();
    if (has_c) {
      dc0_reset = Dev::empty({B, H}, acc_opt);
      dc0_reset.zero_();
    }
  }
  const Tensor da = Dev::empty({B, reset_before ? 2 * H : G * H}, opt);
  // (every step's c gradient, cell_steps, is the host loop's)
  const Tensor da_other = !z.cell_steps && persistent_chosen(ctx, T, B, da.size(1), output.element_size(), 1)
                              ? Dev::empty(da.sizes(), opt)
                              : Tensor();
  const Tensor live_dev = device_live_rows<Dev>(live, da_other.defined(), opt, ctx.stream);
  const Tensor dhn_all = gru ? Dev::empty({T, B, H}, opt) : Tensor();
  const Tensor dn = reset_before ? Dev::empty({B, H}, opt) : Tensor();
  const Tensor drh = reset_before ? Dev::empty({B, H}, acc_opt) : Tensor();
  const Tensor rh_all = reset_before ? Dev::empty({T, B, H}, opt) : Tensor();
  const Tensor dh_tot = z.has_proj ? Dev::empty({B, P}, opt) : Tensor();
  const Tensor dh_tot_all = z.has_proj ? Dev::empty({T, B, P}, opt) : Tensor();
  const Tensor dh_full = z.has_proj ? Dev::empty({B, H}, acc_opt) : Tensor();
  const Tensor h_full_all = z.has_proj ? Dev::empty({T, B, H}, opt) : Tensor();
  const Tensor dhproj_all = lstm_ln ? Dev::empty({T, B, 4 * H}, opt) : Tensor();
  const Tensor ln_scratch = lstm_ln ? Dev::empty({B, 4 * H}, acc_opt) : Tensor();
  Tensor ln_grads;
  if (lstm_ln) {
    ln_grads = Dev::empty({B, 14 * H}, acc_opt);
    ln_grads.zero_();
  }

  RecurrenceBackwardParams p{};
  p.cell = z.cell;
  p.T = T, p.B = B, p.H = H, p.P = P;
  p.reverse = reverse;
  p.lengths = lengths_dev.defined() ? lengths_dev.data_ptr<int64_t>() : nullptr;
  p.live_rows = live.empty() ? nullptr : live.data();
  p.live_rows_dev = live_dev.defined() ? live_dev.const_data_ptr<int64_t>() : nullptr;
  p.grad_output = gout.defined() ? ptr(gout) : nullptr;
  p.grad_output_stride_t = gout.defined() ? gout.stride(0) : 0;
  p.grad_output_stride_b = gout.defined() ? gout.stride(1) : 0;
  p.h0 = ptr(h0c), p.c0 = ptr(c0c);
  p.w_hh = ptr(w), p.w_hr = ptr(wr);
  p.output = ptr(out);
  p.workspace = ptr(wsc);
  p.resets = rs.defined() ? rs.const_data_ptr<bool>() : nullptr;
  p.reset_h = ptr(rhc), p.reset_c = ptr(rcc);
  p.zoneout = zo.defined() ? ptr(zo) : nullptr;
  p.zoneout_stride_t = zo.defined() ? zo.stride(0) : 0;
  p.zoneout_stride_b = zo.defined() ? zo.stride(1) : 0;
  p.ln = ptr(lnc);
  p.d_xproj = mut_ptr(r.d_xproj);
  p.dh = mut_ptr(dh), p.dc = mut_ptr(dc);
  p.gc_steps = gc_steps.defined() ? ptr(gc_steps) : nullptr;
  p.dh0_reset = mut_ptr(dh0_reset), p.dc0_reset = mut_ptr(dc0_reset);
  p.da = mut_ptr(da), p.da_other = mut_ptr(da_other);
  p.dhn_all = mut_ptr(dhn_all);
  p.dn = mut_ptr(dn), p.drh = mut_ptr(drh), p.rh_all = mut_ptr(rh_all);
  p.dh_tot = mut_ptr(dh_tot), p.dh_tot_all = mut_ptr(dh_tot_all);
  p.dh_full = mut_ptr(dh_full), p.h_full_all = mut_ptr(h_full_all);
  p.dhproj_all = mut_ptr(dhproj_all);
  p.ln_scratch = mut_ptr(ln_scratch), p.ln_grads = mut_ptr(ln_grads);
  dispatch_storage(dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    recurrence_backward<S>(p, ctx);
  });

  // h0 (c0) is the starting state of each row's step 0, and of every reset
  // step unless the reset state is given.
  if (reset_h.has_value()) {
    r.d_h0.copy_(dh);
    if (has_c) r.d_c0.copy_(dc);
    r.d_reset_h.copy_(dh0_reset);
    if (has_c) r.d_reset_c.copy_(dc0_reset);
  } else if (resets.has_value()) {
    r.d_h0.copy_(dh.add(dh0_reset));
    if (has_c) r.d_c0.copy_(dc.add(dc0_reset));
  } else {
    r.d_h0.copy_(dh);
    if (has_c) r.d_c0.copy_(dc);
  }

  // Weight and bias gradients: one GEMM or reduction over all steps each.
  const Tensor restarts =
      resets.has_value() ? reset_restarts(rs, lengths_dev, T, reverse) : Tensor();
  const Tensor& restart_h = rhc.defined() ? rhc : h0c;  // the state a reset step starts from
  const Tensor& dx = r.d_xproj;
  const at::IntArrayRef steps_and_rows(kStepsAndRows);
  if (lstm_ln) {
    // The recurrent layer norm's input gradient pairs with h_{t-1}; the gains'
    // and biases' gradients were summed per row by the kernels.
    weight_grad_by_prev_state(r.d_w_hh, dhproj_all, da, out, h0c, reverse, restarts, restart_h);
    const Tensor sums = ln_grads.sum(0);  // [14H]: d ln (10H), d b (4H)
    r.d_ln.copy_(sums.narrow(0, 0, 10 * H));
    r.d_b_ih.copy_(sums.narrow(0, 10 * H, 4 * H));
    r.d_b_hh.copy_(r.d_b_ih);
    return r;
  }
  at::sum_out(r.d_b_ih, dx, steps_and_rows);
  if (gru || reset_before) {
    // Rows [0, 2H) (r, z) multiply h_{t-1}; rows [2H, 3H) (n) multiply h_{t-1}
    // (reset after, gradient dhn) or r * h_{t-1} (reset before, gradient dn).
    weight_grad_by_prev_state(r.d_w_hh.narrow(0, 0, 2 * H), dx.narrow(2, 0, 2 * H),
                              da.narrow(1, 0, 2 * H), out, h0c, reverse, restarts, restart_h);
    Tensor dw_n = r.d_w_hh.narrow(0, 2 * H, H), db_n = r.d_b_hh.narrow(0, 2 * H, H);
    if (gru) {
      weight_grad_by_prev_state(dw_n, dhn_all, da.narrow(1, 2 * H, H), out, h0c, reverse,
                                restarts, restart_h);
      at::sum_out(db_n, dhn_all, steps_and_rows);
    } else {
      at::mm_out(dw_n, dx.narrow(2, 2 * H, H).reshape({T * B, H}).t(), rh_all.view({T * B, H}));
      db_n.copy_(r.d_b_ih.narrow(0, 2 * H, H));
    }
    r.d_b_hh.narrow(0, 0, 2 * H).copy_(r.d_b_ih.narrow(0, 0, 2 * H));
  } else {
    weight_grad_by_prev_state(r.d_w_hh, dx, da, out, h0c, reverse, restarts, restart_h);
    r.d_b_hh.copy_(r.d_b_ih);
  }
  if (z.has_proj) {
    at::mm_out(r.d_w_hr, dh_tot_all.view({T * B, P}).t(), h_full_all.view({T * B, H}));
  }
  return r;
}

template <typename Dev>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>
recurrence_backward_op(c10::string_view cell, const Tensor& grad_output, const Tensor& grad_h_n,
                       const OptTensor& grad_c_n, const Tensor& h0, const OptTensor& c0,
                       const Tensor& w_hh, const OptTensor& w_hr, const Tensor& output,
                       const Tensor& workspace, const OptTensor& lengths, bool reverse,
                       const OptTensor& resets, const OptTensor& zoneout, const OptTensor& ln,
                       const OptTensor& reset_h, const OptTensor& reset_c) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const RecurrenceSizes z =
      check_recurrence_backward(cell, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output,
                                workspace, lengths, resets, zoneout, ln, reset_h, reset_c);
  Dev::check_device("rnnkern.recurrence_backward", output);
  const typename Dev::Guard device_guard(output.device());
  const BackwardResult r = run_backward<Dev>(z, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh,
                                             w_hr, output, workspace, lengths, reverse, resets,
                                             zoneout, ln, reset_h, reset_c);
  return {r.d_xproj, r.d_h0,   r.d_c0, r.d_w_hh,      r.d_b_ih,
          r.d_b_hh,  r.d_w_hr, r.d_ln, r.d_reset_h,   r.d_reset_c};
}

// ---------------------------------------------------------------- step ----

// The lstm_ln step is a composition, not the fused step kernel: its layer
// norms need the statistics of the whole rows x W_ih^T and h W_hh^T (4H
// values each) before any gate, which the fused kernel's blocks (16 rows x
// 16 units, all gates) do not see.  So: x W_ih^T by one GEMM (ATen), then
// the recurrence with T = 1 (h W_hh^T by cuBLAS, then the LSTM-LN row
// kernel); its backward is the recurrence's with T = 1 too (step_backward_op).
template <typename Dev>
std::tuple<Tensor, Tensor, Tensor> lstm_ln_step(const StepSizes& s, const Tensor& x,
                                                const Tensor& h, const OptTensor& c,
                                                const Tensor& w_ih, const Tensor& w_hh,
                                                const OptTensor& b_ih, const OptTensor& b_hh,
                                                const OptTensor& ln) {
  const RecurrenceSizes z{s.cell, 1, s.B, s.H, s.H, s.G, false};
  const Tensor xproj = at::mm(x, w_ih.t()).unsqueeze(0);  // raw: the bias follows the layer norm
  auto [out, h_n, c_n, ws] = run_forward<Dev>(z, xproj, h, c, w_hh, b_ih, b_hh, std::nullopt,
                                              std::nullopt, false, true, std::nullopt,
                                              std::nullopt, ln);
  return {h_n, c_n, ws.select(0, 0)};
}

template <typename Dev>
std::tuple<Tensor, Tensor, Tensor> step_op(c10::string_view cell, const Tensor& x,
                                             const Tensor& h, const OptTensor& c,
                                             const Tensor& w_ih, const Tensor& w_hh,
                                             const OptTensor& b_ih, const OptTensor& b_hh,
                                             const OptTensor& ln) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const StepSizes s = check_step(cell, x, h, c, w_ih, w_hh, b_ih, b_hh, ln);
  Dev::check_device("rnnkern.step", x);
  const typename Dev::Guard device_guard(x.device());
  if (s.cell == Cell::LstmLn) return lstm_ln_step<Dev>(s, x, h, c, w_ih, w_hh, b_ih, b_hh, ln);
  const bool lstm = s.cell == Cell::Lstm;
  const auto dtype = x.scalar_type(), acc = acc_type(dtype);
  const auto opt = x.options();
  Tensor h_new = Dev::empty({s.B, s.H}, opt);
  Tensor c_new = lstm ? Dev::empty({s.B, s.H}, opt) : empty_like_options(x, dtype);
  Tensor ws = Dev::empty({s.B, workspace_size(s.cell, s.H)}, opt.dtype(acc));
  if (s.B == 0) return {h_new, c_new, ws};

  const Context ctx = Dev::context();
  const Tensor xc = x.contiguous(), hc = h.contiguous(), cc = contiguous_or_undefined(c);
  const Tensor wi = w_ih.contiguous(), wh = w_hh.contiguous();
  const Tensor bi = contiguous_or_undefined(b_ih), bh = contiguous_or_undefined(b_hh);
  const Tensor rh = s.cell == Cell::GruResetBefore ? Dev::empty({s.B, s.H}, opt) : Tensor();
  StepParams p{};
  p.cell = s.cell;
  p.B = s.B, p.I = s.I, p.H = s.H;
  p.x = ptr(xc), p.h = ptr(hc), p.c = ptr(cc);
  p.w_ih = ptr(wi), p.w_hh = ptr(wh);
  p.b_ih = ptr(bi), p.b_hh = ptr(bh);
  p.h_new = mut_ptr(h_new), p.c_new = mut_ptr(c_new);
  p.workspace = mut_ptr(ws);
  p.rh = mut_ptr(rh);
  dispatch_storage(dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    Dev::template step_forward<S>(p, ctx);
  });
  return {h_new, c_new, ws};
}

// The step's backward is the recurrence's with T = 1 (its single output is
// also its final state, so its gradient enters once, as grad_h_n), plus the
// input half of the product: dx = dA W_ih, dW_ih = dA^T x (lstm_ln: dA is
// the gradient of the raw x W_ih^T, before its layer norm).
template <typename Dev>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> step_backward_op(
    c10::string_view cell, const Tensor& grad_h_new, const OptTensor& grad_c_new, const Tensor& x,
    const Tensor& h, const OptTensor& c, const Tensor& w_ih, const Tensor& w_hh,
    const Tensor& h_new, const Tensor& workspace, const OptTensor& ln, int64_t needs) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const StepSizes s = check_step_backward(cell, grad_h_new, grad_c_new, x, h, c, w_ih, w_hh, h_new,
                                          workspace, ln);
  Dev::check_device("rnnkern.step_backward", x);
  const typename Dev::Guard device_guard(x.device());
  const RecurrenceSizes z{s.cell, 1, s.B, s.H, s.H, s.G, false};
  const Tensor ws = workspace.contiguous().view({1, s.B, workspace.size(1)});
  const BackwardResult r =
      run_backward<Dev>(z, Tensor(), grad_h_new, grad_c_new, h, c, w_hh, std::nullopt,
                        h_new.unsqueeze(0), ws, std::nullopt, false, std::nullopt, std::nullopt, ln);
  const Tensor dxp = r.d_xproj.select(0, 0);
  // Outputs not in `needs` are empty (schema: csrc/ops.cpp), each its own
  // tensor (outputs must not alias); the two input products are skipped then,
  // the rest comes from the one backward pass.
  auto none = [&] { return empty_like_options(x, x.scalar_type()); };
  auto wanted = [needs](int64_t i) { return (needs >> i & 1) != 0; };
  const Tensor d_x = wanted(0) ? at::mm(dxp, w_ih) : none();
  const Tensor d_w_ih = wanted(3) ? at::mm(dxp.t(), x) : none();
  return {d_x,
          wanted(1) ? r.d_h0 : none(),
          wanted(2) ? r.d_c0 : none(),
          d_w_ih,
          wanted(4) ? r.d_w_hh : none(),
          wanted(5) ? r.d_b_ih : none(),
          wanted(6) ? r.d_b_hh : none(),
          wanted(7) ? r.d_ln : none()};
}

}  // namespace rnnkern::cuda::bindings

// CPU implementations of rnnkern::recurrence, recurrence_backward, step and
// step_backward (schemas and conventions in ops.cpp): the op entry points,
// the twin of cuda/bindings.cpp.  Each checks its arguments (checks.h),
// converts them to the accumulate dtype, dispatches on float / double to the
// drivers (recurrence.h) or the lean single step (lean_step.h) and converts
// the results back.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers: a much faster compile
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../checks.h"
#include "buffers.h"
#include "lean_step.h"
#include "linear.h"
#include "pairs.h"
#include "products.h"
#include "recurrence.h"

namespace rnnkern::cpu {
namespace {

// In the accumulate dtype and dense; a conversion or a copy (an incoming
// gradient in a transposed layout: batch_first callers) goes into a pooled
// buffer, where a fresh one would pay a page fault per 4 KiB (buffers.h).
Tensor to_acc(const Tensor& t, at::ScalarType acc) {
  if (t.scalar_type() == acc && t.is_contiguous()) return t;
  return pooled_empty(t.sizes(), t.options().dtype(acc)).copy_(t);
}
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
  Tensor lengths;                // keeps the contiguous copy alive while Positions points into it
  std::vector<int64_t> offsets;  // packed rows: each step's first row
  Positions positions(const OptTensor& l, const RecurrenceSizes& z, bool reverse) {
    if (!l.has_value()) return Positions{nullptr, z.T, reverse, z.B};
    lengths = l->contiguous();
    const int64_t* n = lengths.const_data_ptr<int64_t>();
    if (!z.packed_rows) return Positions{n, z.T, reverse, z.B};
    // Step p has a row for each sequence longer than p (sorted: the first ones).
    offsets.assign(static_cast<size_t>(z.T) + 1, 0);
    for (int64_t b = 0; b < z.B; ++b)
      for (int64_t p = 0; p < n[b]; ++p) ++offsets[p + 1];
    for (int64_t p = 0; p < z.T; ++p) offsets[p + 1] += offsets[p];
    return Positions{n, z.T, reverse, z.B, offsets.data()};
  }
};

Tensor bias_or_zeros(const OptTensor& b, int64_t n, const at::TensorOptions& opt) {
  return b.has_value() ? to_acc(*b, opt.dtype().toScalarType()) : at::zeros({n}, opt);
}

// Whether a call's products (per-step, weight gradients) run on bf16 pairs
// (pairs.h): a bfloat16 call (its state h0, bf16 whatever a step's float32
// xproj) with bfloat16 weights, and a CPU (or a test) that runs them.
bool bf16_products(const Tensor& state, const Tensor& w_hh, const OptTensor& w_hr) {
  return state.scalar_type() == at::kBFloat16 && w_hh.scalar_type() == at::kBFloat16 &&
         (!w_hr.has_value() || w_hr->scalar_type() == at::kBFloat16) &&
         pairs::mode() != pairs::Mode::Float32;
}

// W_hh or W_hr as the per-step products read it: in the accumulate dtype,
// or bfloat16 as it is where they run on bf16 pairs (packed from its bits:
// a float32 copy was a pass over the weight per call, a one-step call's
// largest cost after its products).
Tensor product_weight(const OptTensor& w, at::ScalarType acc, bool on_pairs) {
  if (!w.has_value()) return Tensor();
  return on_pairs ? w->contiguous() : to_acc(*w, acc);
}

// Whether a forward's float16 W_hh stays float16: a call of one step (its
// products read W in place: forward.cpp) whose batch takes the dot products
// (gemm::multiply_nt_half converts W as its dot products load it).  Same bits as
// reading a float32 copy, which cost a pass over W and twice its bytes.
bool half_weight_in_place(const RecurrenceSizes& z, const Tensor& w_hh, at::ScalarType acc) {
  return z.T == 1 && z.B < gemm::kMinBroadcastRows && w_hh.scalar_type() == at::kHalf &&
         acc == at::kFloat && gemm::widens_half_natively();
}

// Forward on tensors of any floating dtype; results in the accumulate dtype
// (and the output rounded to bf16 where forward_impl rounds it in the steps).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> run_forward(
    const RecurrenceSizes& z, const Tensor& xproj, const Tensor& h0, const OptTensor& c0,
    const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh, const OptTensor& w_hr,
    const Positions& pos, bool train, const OptTensor& resets, const OptTensor& zoneout,
    const OptTensor& ln, const OptTensor& reset_h, const OptTensor& reset_c) {
  const auto acc = acc_type(h0.scalar_type());
  const auto opt = h0.options().dtype(acc);
  const bool lstm = has_cell_state(z.cell);
  Tensor output = pooled_empty(layout_sizes(z, z.P), opt);
  Tensor h_n = at::empty({z.B, z.P}, opt);
  Tensor c_n = z.cell_steps ? at::empty({z.T, z.B, z.H}, opt)
               : lstm       ? at::empty({z.B, z.H}, opt)
                            : empty_like_options(h0, acc);
  const int64_t W = workspace_size(z.cell, z.H, z.has_zoneout);
  Tensor ws = train ? pooled_empty(layout_sizes(z, W), opt) : empty_like_options(h0, acc);
  const bool on_pairs = bf16_products(h0, w_hh, w_hr);
  Tensor output_bf16;
  AT_DISPATCH_FLOATING_TYPES(acc, "rnnkern_recurrence_cpu", [&] {
    const Tensor h0a = to_acc(h0, acc), c0a = to_acc(c0, acc);
    // bf16 xproj is read as it is (forward.cpp widens it row by row).
    const bool x_bf16 = xproj.scalar_type() == at::kBFloat16 && acc == at::kFloat;
    ForwardArgs<scalar_t> a{z,
                            x_bf16 ? xproj.contiguous() : to_acc(xproj, acc),
                            h0a,
                            c0a,
                            half_weight_in_place(z, w_hh, acc) ? w_hh.contiguous()
                                                               : product_weight(w_hh, acc, on_pairs),
                            bias_or_zeros(b_ih, z.G * z.H, opt),
                            bias_or_zeros(b_hh, z.G * z.H, opt),
                            product_weight(w_hr, acc, on_pairs),
                            pos,
                            train,
                            bools(resets),
                            mask_to_acc(zoneout, acc),
                            to_acc(ln, acc),
                            reset_h.has_value() ? to_acc(reset_h, acc) : h0a,
                            reset_h.has_value() ? to_acc(reset_c, acc) : c0a,
                            on_pairs};
    forward_impl<scalar_t>(a, output, h_n, c_n, ws, output_bf16);
  });
  return {output, h_n, c_n, ws, output_bf16};
}

struct BackwardResult {
  Tensor d_xproj, d_h0, d_c0, d_w_hh, d_b_ih, d_b_hh, d_w_hr, d_ln, d_reset_h, d_reset_c;
  Tensor d_xproj_bf16;  // where the backward rounded d_xproj step by step (backward_impl)
  // d_xproj in the call's dtype.
  Tensor d_xproj_in(at::ScalarType dtype) const {
    return d_xproj_bf16.defined() && dtype == at::kBFloat16 ? d_xproj_bf16 : pooled_to(d_xproj, dtype);
  }
};

// Backward on tensors of any floating dtype; results in the accumulate dtype.
BackwardResult run_backward(const RecurrenceSizes& z, const Tensor& grad_output,
                            const Tensor& grad_h_n, const OptTensor& grad_c_n, const Tensor& h0,
                            const OptTensor& c0, const Tensor& w_hh, const OptTensor& w_hr,
                            const Tensor& output, const Tensor& workspace,
                            const Positions& pos, const OptTensor& resets,
                            const OptTensor& zoneout, const OptTensor& ln,
                            const OptTensor& reset_h, const OptTensor& reset_c) {
  const auto acc = acc_type(h0.scalar_type());
  const auto opt = h0.options().dtype(acc);
  const bool lstm = has_cell_state(z.cell);
  BackwardResult r;
  // (r.d_xproj: sized by backward_impl)
  r.d_h0 = at::empty({z.B, z.P}, opt);
  r.d_c0 = lstm ? at::empty({z.B, z.H}, opt) : empty_like_options(h0, acc);
  r.d_w_hh = pooled_empty({z.G * z.H, z.P}, opt);  // 1 MiB at LSTM H = 256: fresh pages cost
  r.d_b_ih = at::empty({z.G * z.H}, opt);
  r.d_b_hh = at::empty({z.G * z.H}, opt);
  r.d_w_hr = z.has_proj ? at::empty({z.P, z.H}, opt) : empty_like_options(h0, acc);
  r.d_ln = ln.has_value() ? at::empty({ln->size(0)}, opt) : empty_like_options(h0, acc);
  r.d_reset_h = reset_h.has_value() ? at::empty({z.B, z.P}, opt) : empty_like_options(h0, acc);
  r.d_reset_c = reset_c.has_value() ? at::empty({z.B, z.H}, opt) : empty_like_options(h0, acc);
  const bool on_pairs = bf16_products(output, w_hh, w_hr);
  const bool bf16_output = output.scalar_type() == at::kBFloat16 && output.is_contiguous();
  const Tensor output_bf16 = on_pairs && bf16_output ? output : Tensor();
  const bool gout_rows = widened_grad_output(z, acc == at::kFloat,
                                             grad_output.scalar_type() == at::kBFloat16);
  const bool out_rows = widened_output(z, output_bf16.defined(), pos.lengths != nullptr,
                                       resets.has_value());
  AT_DISPATCH_FLOATING_TYPES(acc, "rnnkern_recurrence_backward_cpu", [&] {
    const Tensor h0a = to_acc(h0, acc), c0a = to_acc(c0, acc);
    BackwardArgs<scalar_t> a{z,
                             gout_rows ? Tensor() : to_acc(grad_output, acc),
                             to_acc(grad_h_n, acc),
                             to_acc(grad_c_n, acc),
                             h0a,
                             c0a,
                             product_weight(w_hh, acc, on_pairs),
                             product_weight(w_hr, acc, on_pairs),
                             out_rows ? Tensor() : to_acc(output, acc),
                             workspace.contiguous(),
                             pos,
                             bools(resets),
                             mask_to_acc(zoneout, acc),
                             to_acc(ln, acc),
                             reset_h.has_value() ? to_acc(reset_h, acc) : h0a,
                             reset_h.has_value() ? to_acc(reset_c, acc) : c0a,
                             on_pairs,
                             output_bf16,
                             gout_rows ? grad_output.contiguous() : Tensor()};
    backward_impl<scalar_t>(a, r.d_xproj, r.d_h0, r.d_c0, r.d_w_hh, r.d_b_ih, r.d_b_hh,
                            r.d_w_hr, r.d_ln, r.d_reset_h, r.d_reset_c, r.d_xproj_bf16);
  });
  return r;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> recurrence_cpu(
    c10::string_view cell, const Tensor& xproj, const Tensor& h0, const OptTensor& c0,
    const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh, const OptTensor& w_hr,
    const OptTensor& lengths, bool reverse, bool train, const OptTensor& resets,
    const OptTensor& zoneout, const OptTensor& ln, const OptTensor& reset_h,
    const OptTensor& reset_c, bool cell_steps) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // inner ATen calls record no graph
  const RecurrenceSizes z = check_recurrence(cell, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, lengths,
                                             resets, zoneout, ln, reset_h, reset_c, cell_steps,
                                             /*allow_packed_rows=*/true);
  LengthsHolder holder;
  auto [output, h_n, c_n, ws, output_bf16] =
      run_forward(z, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr,
                  holder.positions(lengths, z, reverse), train, resets, zoneout, ln, reset_h,
                  reset_c);
  const auto dtype = xproj.scalar_type();
  const Tensor out = output_bf16.defined() && dtype == at::kBFloat16 ? output_bf16
                                                                    : pooled_to(output, dtype);
  return {out, h_n.to(dtype), pooled_to(c_n, dtype), ws};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>
recurrence_backward_cpu(c10::string_view cell, const Tensor& grad_output, const Tensor& grad_h_n,
                        const OptTensor& grad_c_n, const Tensor& h0, const OptTensor& c0,
                        const Tensor& w_hh, const OptTensor& w_hr, const Tensor& output,
                        const Tensor& workspace, const OptTensor& lengths, bool reverse,
                        const OptTensor& resets, const OptTensor& zoneout, const OptTensor& ln,
                        const OptTensor& reset_h, const OptTensor& reset_c) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // inner ATen calls record no graph
  const RecurrenceSizes z =
      check_recurrence_backward(cell, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output,
                                workspace, lengths, resets, zoneout, ln, reset_h, reset_c,
                                /*allow_packed_rows=*/true);
  LengthsHolder holder;
  const BackwardResult r =
      run_backward(z, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output, workspace,
                   holder.positions(lengths, z, reverse), resets, zoneout, ln, reset_h, reset_c);
  const auto dtype = output.scalar_type();
  return {r.d_xproj_in(dtype), r.d_h0.to(dtype), r.d_c0.to(dtype), pooled_to(r.d_w_hh, dtype),
          r.d_b_ih.to(dtype),  r.d_b_hh.to(dtype), r.d_w_hr.to(dtype), r.d_ln.to(dtype),
          r.d_reset_h.to(dtype), r.d_reset_c.to(dtype)};
}

// W_hh's bytes up to which recurrence_from_input carries the projection in the
// steps' products: where W_hh streams from L2 (Zen 4's is 1 MB), the product
// waits on it, and the tiles' multiply-adds fill the wait (T=256 B=1, one
// thread, Zen 4: LSTM H=128 1.19x, H=192 1.20x; GRU H=256 1.27x).  From L3,
// the tiles' own stream of W_ih competes with it (LSTM H=256 1.01x, H=512
// 0.97x).  Where the FMA pipes are 512 bits wide (gemm::fma_pipe_bits: a Zen
// 5), the projection before the loop costs half as many cycles and the tiles
// slow the stream they were to hide in: there only a W_hh of 64 KB or less
// takes them (one thread, T=256, against the composition: RNN H=128 1.19x,
// LSTM H=64 level; LSTM H=128 0.89x, H=192 0.81x, GRU H=128 0.88x, H=256
// 0.93x, RNN H=256 0.84x).
int64_t max_tiled_weight_bytes() {
  return gemm::fma_pipe_bits() == 512 ? int64_t(64) << 10 : int64_t(768) << 10;
}

// A batch of at least kMinInsideRows rows (per step) whose W_ih and W_hh
// together take at most kMaxInsideWeightBytes: each step makes its
// x_t W_ih^T too (ForwardArgs::x_rows), at the speed of the step's product
// and without xproj's trip through memory (the input projection's output:
// LSTM B=64 T=64 H=128, 8 MB).  A float32 LSTM adds the step's product to
// it; the GRU and RNN, and every cell on bf16 pairs, make it a product of
// its own.  1.5-8% faster at 1.5-4 MB (the float32 LSTM from 768 KB, where
// it stopped before: B=32 T=128 H=256, 2 MB, 1.04x), level at 5-16 MB
// (docs/cpu.md).
constexpr int64_t kMinInsideRows = 16;
constexpr int64_t kMaxInsideWeightBytes = int64_t(4) << 20;

std::tuple<Tensor, Tensor, Tensor> forward_x_inside(const RecurrenceSizes& z, const Tensor& x,
                                                    const Tensor& w_ih, const Tensor& h0,
                                                    const OptTensor& c0, const Tensor& w_hh,
                                                    const OptTensor& b_ih, const OptTensor& b_hh,
                                                    bool reverse) {
  const bool on_pairs = x.scalar_type() == at::kBFloat16;  // (else float32)
  const auto opt = h0.options().dtype(at::kFloat);
  Tensor output = pooled_empty(layout_sizes(z, z.P), opt);
  Tensor h_n = at::empty({z.B, z.P}, opt);
  Tensor c_n = has_cell_state(z.cell) ? at::empty({z.B, z.H}, opt) : empty_like_options(h0, at::kFloat);
  Tensor ws = empty_like_options(h0, at::kFloat);
  const Tensor h0a = to_acc(h0, at::kFloat), c0a = to_acc(c0, at::kFloat);
  ForwardArgs<float> a{z, Tensor(), h0a, c0a, w_hh.contiguous(),
                       bias_or_zeros(b_ih, z.G * z.H, opt), bias_or_zeros(b_hh, z.G * z.H, opt),
                       Tensor(), Positions{nullptr, z.T, reverse, z.B}, false, Tensor(), Tensor(),
                       Tensor(), h0a, c0a, on_pairs,
                       to_acc(x, x.scalar_type()).view({z.T * z.B, x.size(2)}),
                       w_ih.contiguous()};
  Tensor output_bf16;  // where forward_impl rounds the output in the steps
  forward_impl<float>(a, output, h_n, c_n, ws, output_bf16);
  if (!on_pairs) return {output, h_n, c_n};
  return {output_bf16.defined() ? output_bf16 : pooled_to(output, at::kBFloat16),
          h_n.to(at::kBFloat16), pooled_to(c_n, at::kBFloat16)};
}

// recurrence_from_input (ops.cpp): a sequence of batch 1 in float32 with
// kProjectionTileRows steps or more and a W_hh of at most
// max_tiled_weight_bytes() runs forward_from_input on 512-bit vectors (the input
// projection inside the steps' products); a batch of kMinInsideRows or more
// with W_ih and W_hh within the bytes above, forward_x_inside; any other call
// is the composition itself, rnnkern::linear then rnnkern::recurrence.  All
// three give the same bits.
std::tuple<Tensor, Tensor, Tensor> recurrence_from_input_cpu(
    c10::string_view cell, const Tensor& x, const Tensor& w_ih, const Tensor& h0, const OptTensor& c0,
    const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh, bool reverse) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // inner ATen calls record no graph
  const RecurrenceSizes z = check_recurrence_from_input(cell, x, w_ih, h0, c0, w_hh, b_ih, b_hh);
  const bool plain = z.cell == Cell::Lstm || z.cell == Cell::Gru || z.cell == Cell::RnnTanh ||
                     z.cell == Cell::RnnRelu;
  const bool tiles = plain && z.B == 1 && z.T >= gemm::kProjectionTileRows && x.scalar_type() == at::kFloat &&
                     z.G * z.H * z.H * 4 <= max_tiled_weight_bytes() && gemm::wide_vectors();
  const int64_t weight_values = z.G * z.H * (x.size(2) + z.H);
  const bool on_pairs = bf16_products(h0, w_hh, std::nullopt) && x.scalar_type() == at::kBFloat16 &&
                        w_ih.scalar_type() == at::kBFloat16;
  const bool inside =
      plain && z.B >= kMinInsideRows && z.T > 1 &&
      (on_pairs ? x.size(2) <= pairs::kChunk && weight_values * 2 <= kMaxInsideWeightBytes
                : x.scalar_type() == at::kFloat && x.size(2) <= gemm::kKC &&
                      weight_values * 4 <= kMaxInsideWeightBytes);
  if (!tiles && inside) return forward_x_inside(z, x, w_ih, h0, c0, w_hh, b_ih, b_hh, reverse);
  if (!tiles) {
    static const auto linear = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("rnnkern::linear", "")
                                   .typed<Tensor(const Tensor&, const Tensor&)>();
    // (x dense in a pooled buffer where it is not: a batch-first input transposed
    // to time-major, which reshape would copy into fresh memory; ops.rows_of.)
    const Tensor rows = to_acc(x, x.scalar_type()).view({z.T * z.B, x.size(2)});
    const Tensor xproj = linear.call(rows, w_ih).view({z.T, z.B, z.G * z.H});
    auto [output, h_n, c_n, ws] = recurrence_cpu(cell, xproj, h0, c0, w_hh, b_ih, b_hh, std::nullopt,
                                                 std::nullopt, reverse, false, std::nullopt,
                                                 std::nullopt, std::nullopt, std::nullopt,
                                                 std::nullopt, false);
    return {output, h_n, c_n};
  }
  const auto opt = h0.options();
  const Tensor x_rows = x.stride(2) == 1 ? x : x.contiguous();
  FromInputArgs a{z.cell, z.T, x.size(2), z.H, z.G,
                  x_rows.const_data_ptr<float>(), x_rows.stride(0),
                  w_ih.contiguous(), h0.contiguous(), c0.has_value() ? c0->contiguous() : Tensor(),
                  w_hh.contiguous(), bias_or_zeros(b_ih, z.G * z.H, opt),
                  bias_or_zeros(b_hh, z.G * z.H, opt), reverse};
  Tensor output = at::empty({z.T, 1, z.H}, opt);
  Tensor h_n = at::empty({1, z.H}, opt);
  Tensor c_n = z.cell == Cell::Lstm ? at::empty({1, z.H}, opt) : empty_like_options(h0, at::kFloat);
  forward_from_input(a, output, h_n, c_n);
  return {output, h_n, c_n};
}

// Its autograd kernel: no formula (the modules call it without gradients);
// inputs that need one get an error, not results autograd would not see.
// It redispatches below autograd rather than calling the CPU kernel: a Python
// dispatch mode (torch.utils.flop_counter.FlopCounterMode, profilers' modes)
// then sees the op itself, not only the rnnkern::linear it may make inside.
std::tuple<Tensor, Tensor, Tensor> recurrence_from_input_autograd(
    c10::string_view cell, const Tensor& x, const Tensor& w_ih, const Tensor& h0, const OptTensor& c0,
    const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh, bool reverse) {
  if (at::GradMode::is_enabled()) {
    const bool grads = x.requires_grad() || w_ih.requires_grad() || h0.requires_grad() ||
                       w_hh.requires_grad() || (c0.has_value() && c0->requires_grad()) ||
                       (b_ih.has_value() && b_ih->requires_grad()) ||
                       (b_hh.has_value() && b_hh->requires_grad());
    TORCH_CHECK(!grads, "rnnkern.recurrence_from_input is for inference and has no gradient: "
                "under torch.no_grad() or with inputs that do not require grad, else call "
                "rnnkern.linear then rnnkern.recurrence");
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("rnnkern::recurrence_from_input", "")
          .typed<std::tuple<Tensor, Tensor, Tensor>(c10::string_view, const Tensor&, const Tensor&,
                                                    const Tensor&, const OptTensor&, const Tensor&,
                                                    const OptTensor&, const OptTensor&, bool)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(cell, x, w_ih, h0, c0, w_hh, b_ih, b_hh, reverse);
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
  if (lean_step(s, {&x, &h, &w_ih, &w_hh}, {&c, &b_ih, &b_hh}))
    return step_lean(s, x, h, c, w_ih, w_hh, b_ih, b_hh);
  const Tensor xproj = linear_acc(x, w_ih);
  auto [output, h_new, c_new, ws, output_bf16] =  // (T = 1: no output_bf16)
      run_forward(step_as_recurrence(s), xproj.unsqueeze(0), h, c, w_hh, b_ih, b_hh,
                  std::nullopt, Positions{nullptr, 1, false, s.B}, true, std::nullopt, std::nullopt,
                  ln, std::nullopt, std::nullopt);
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
  const Tensor gh = to_acc(grad_h_new, grad_h_new.scalar_type());
  const OptTensor gc = grad_c_new.has_value() ? OptTensor(to_acc(*grad_c_new, grad_c_new->scalar_type()))
                                              : std::nullopt;
  if (lean_step(s, {&gh, &x, &h, &w_ih, &w_hh, &h_new}, {&gc, &c}) &&
      workspace.scalar_type() == acc && workspace.is_contiguous())
    return step_backward_lean(s, gh, gc, x, h, c, w_ih, w_hh, h_new, workspace, needs);
  // The step's single output is also its final state: its gradient enters
  // once, as grad_h_n, with a zero grad_output.
  const BackwardResult r = run_backward(
      step_as_recurrence(s), at::zeros({1, s.B, s.H}, h.options().dtype(acc)), grad_h_new,
      grad_c_new, h, c, w_hh, std::nullopt, h_new.unsqueeze(0),
      workspace.view({1, s.B, workspace.size(1)}), Positions{nullptr, 1, false, s.B}, std::nullopt,
      std::nullopt, ln, std::nullopt, std::nullopt);
  // dX = dXproj W_ih, dW_ih = dXproj^T X: rnnkern::linear's backward, with
  // dXproj rounded to x's dtype as a sequence's backward hands it to that op
  // (on bf16 pairs, its products read it as bf16 anyway).
  const Tensor dxp = r.d_xproj_in(dtype).view({s.B, s.G * s.H});
  const auto [d_x, d_w_ih] = linear_backward_acc(dxp, x, w_ih, true, true);
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
  m.impl("recurrence_from_input", &rnnkern::cpu::recurrence_from_input_cpu);
}

TORCH_LIBRARY_IMPL(rnnkern, AutogradCPU, m) {
  m.impl("recurrence_from_input", &rnnkern::cpu::recurrence_from_input_autograd);
}

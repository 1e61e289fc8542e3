// The CPU backend's lean single step (see lean_step.h): scratch per thread,
// the same row kernels (rows.h) and cells.h formulas as the recurrence
// drivers.  It is taken whatever the thread count, and with more than one
// thread its rows are split between workers: every element of a product is
// one lane's dot product in a fixed order (gemm.h), so any split of the rows
// gives the same bits as one thread (torch.nn's cells are bitwise across
// thread counts; the choice of this path by thread count made rnnkern's not).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers: a much faster compile
#include "lean_step.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "buffers.h"
#include "gemm.h"
#include "linear.h"
#include "parallel.h"
#include "products.h"
#include "rows.h"
#include "schedule.h"

namespace rnnkern::cpu {
namespace {

bool is_half(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

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

// The workers a step's B rows go to: each takes at least kMinRowsPerThread
// rows and the large products' floor of multiply-adds (parallel.h).
int64_t lean_workers(int64_t B, int64_t macs_per_row) {
  return std::max<int64_t>(1, std::min(product_threads(B * macs_per_row), B / kMinRowsPerThread));
}

// f(b0, b1) over consecutive blocks of rows, one per worker.
template <typename F>
void for_row_blocks(int64_t B, int64_t macs_per_row, const F& f) {
  const int64_t workers = lean_workers(B, macs_per_row);
  for_each_worker(workers, [&](int64_t t) { f(B * t / workers, B * (t + 1) / workers); });
}

template <typename A>
RNNKERN_CPU_CLONES void lean_rows_forward(const StepSizes& s, int64_t b0, int64_t b1, const A* x,
                                          const A* h, const A* c, const A* w_ih, const A* w_hh,
                                          const A* bx, const A* bh, const A* bsum, A* xp, A* hp,
                                          A* h_new, A* c_new, A* ws) {
  const int64_t I = s.I, H = s.H, GH = s.G * H, W = workspace_size(s.cell, H);
  const int64_t m = b1 - b0;
  gemm::multiply_nt_rows(m, x + b0 * I, I, w_ih, I, GH, I, xp + b0 * GH, GH, s.B);  // x W_ih^T
  gemm::multiply_nt_rows(m, h + b0 * H, H, w_hh, H, GH, H, hp + b0 * GH, GH, s.B);  // h W_hh^T
  for (int64_t b = b0; b < b1; ++b) {
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
      default: TORCH_INTERNAL_ASSERT(false, "lean_rows_forward: ", cell_name(s.cell));
    }
  }
}

template <typename A>
RNNKERN_CPU_CLONES void lean_step_forward(const StepSizes& s, const A* x, const A* h, const A* c,
                                          const A* w_ih, const A* w_hh, const A* b_ih,
                                          const A* b_hh, A* h_new, A* c_new, A* ws) {
  const int64_t B = s.B, I = s.I, H = s.H, GH = s.G * H;
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
  for_row_blocks(B, GH * (I + H), [&](int64_t b0, int64_t b1) {
    lean_rows_forward<A>(s, b0, b1, x, h, c, w_ih, w_hh, bx, bh, bsum, xp, hp, h_new, c_new, ws);
  });
}

// Rows b0..b1 of the step's backward: the row kernels (the carries dh, dc and
// the gate gradients dx, da), then dh += da W_hh and d_x = dx W_ih for them.
template <typename A>
RNNKERN_CPU_CLONES void lean_rows_backward(const StepSizes& s, int64_t b0, int64_t b1,
                                           const A* h, const A* c, const A* w_ih,
                                           const A* w_hh, const A* h_new, const A* ws,
                                           const A* zero, A* dx, A* da, A* dhn, A* dc, A* d_x,
                                           A* d_h, bool need_dh) {
  const int64_t I = s.I, H = s.H, GH = s.G * H, W = workspace_size(s.cell, H);
  for (int64_t b = b0; b < b1; ++b) {
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
      default: TORCH_INTERNAL_ASSERT(false, "lean_rows_backward: ", cell_name(s.cell));
    }
  }
  const int64_t m = b1 - b0;
  if (need_dh)
    gemm::multiply(m, da + b0 * GH, gemm::StridesA{GH, 1},
                   gemm::PackedB<A>::view_rows(w_hh, GH, H, H), d_h + b0 * H, H, true);
  if (d_x != nullptr)
    gemm::multiply(m, dx + b0 * GH, gemm::StridesA{GH, 1},
                   gemm::PackedB<A>::view_rows(w_ih, GH, I, I), d_x + b0 * I, I, false);
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
  const int64_t B = s.B, I = s.I, H = s.H, GH = s.G * H;
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
  for_row_blocks(B, GH * (I + H), [&](int64_t b0, int64_t b1) {
    lean_rows_backward<A>(s, b0, b1, h, c, w_ih, w_hh, h_new, ws, zero, dx, da, dhn, dc, d_x, d_h,
                          need_dh);
  });
  // The weight gradients dW_hh = da^T h, dW_ih = dx^T x: sums over the rows in
  // their order (blocked_gemm splits the weights' rows between threads).
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

}  // namespace

// Whether step(cell ...) takes the lean path: a cell without options and
// inputs already contiguous in the accumulate type (or bfloat16, below),
// whatever the thread count (the choice must not depend on it: the two paths
// sum in different orders; and the driver's T = 1 input projection packs
// W_ih, which made an LSTM step at B=32 H=256 take 324 us against the lean
// path's 168 at B=31, one thread).  Its scratch is kept per thread, so a
// step with more than kMaxLeanGateValues gate pre-activations (B x G x H;
// 16 MiB of float32 scratch) goes to the driver, whose buffers are pooled.
// A bfloat16 or float16 step takes it where its weights are small (G*H*(I +
// H) up to kMaxLeanHalfWeightValues; with I = H an RNN cell up to H = 128, a
// GRU's up to 73, an LSTM's up to 64): its values widened into float32
// scratch (exact), the float32 step, the results rounded to the half type.
// The driver's path cost 16 us of such a bf16 step's 18 in checks and
// buffers, 0.7x torch.nn's RNNCell (float16: 0.76-0.93x at B=1); the
// widening grows with the weights, where the driver's products (bf16 pairs,
// pooled conversions) pay off.
constexpr int64_t kMaxLeanGateValues = int64_t(1) << 21;
constexpr int64_t kMaxLeanHalfWeightValues = int64_t(1) << 15;
bool lean_step(const StepSizes& s, std::initializer_list<const Tensor*> ts,
               std::initializer_list<const OptTensor*> opts) {
  if (s.cell == Cell::GruResetBefore || s.cell == Cell::LstmLn) return false;
  if (s.B * s.G * s.H > kMaxLeanGateValues) return false;
  const auto dtype = (*ts.begin())->scalar_type();
  if (is_half(dtype) && s.G * s.H * (s.I + s.H) > kMaxLeanHalfWeightValues) return false;
  for (const Tensor* t : ts) {
    const auto st = t->scalar_type();
    if (st != dtype || (st != at::kFloat && st != at::kDouble && !is_half(st)) || !t->is_contiguous())
      return false;
  }
  for (const OptTensor* t : opts)
    if (t->has_value() && ((*t)->scalar_type() != dtype || !(*t)->is_contiguous())) return false;
  return true;
}

namespace {

const Tensor* opt_tensor(const OptTensor& t) { return t.has_value() ? &*t : nullptr; }

// float16 values as float32 and back (c10's roundings), per ISA level (the
// bfloat16 ones: pairs.h).
RNNKERN_CPU_CLONES void widen_f16(int64_t n, const uint16_t* __restrict src, float* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::detail::fp16_ieee_to_fp32_value(src[i]);
}
RNNKERN_CPU_CLONES void narrow_f16(int64_t n, const float* __restrict src, uint16_t* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::detail::fp16_ieee_from_fp32_value(src[i]);
}

// The float32 values of half-type tensors (null: absent), widened one after
// the other into scratch per thread.
std::vector<const float*> widened(std::initializer_list<const Tensor*> ts) {
  thread_local std::vector<float> buf;
  size_t n = 0;
  for (const Tensor* t : ts) n += t != nullptr ? static_cast<size_t>(t->numel()) : 0;
  if (buf.size() < n) buf.resize(n);
  std::vector<const float*> out;
  float* p = buf.data();
  for (const Tensor* t : ts) {
    if (t == nullptr) {
      out.push_back(nullptr);
      continue;
    }
    const uint16_t* src = reinterpret_cast<const uint16_t*>(t->const_data_ptr());
    const int64_t m = t->numel();
    if (t->scalar_type() == at::kBFloat16)
      pairs::widen_bf16(m, src, p);
    else
      widen_f16(m, src, p);
    out.push_back(p);
    p += m;
  }
  return out;
}

// Float32 results per thread, rounded into half-type tensors by narrow_into.
float* results_scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

void narrow_into(const float* src, const Tensor& dst) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst.data_ptr());
  if (dst.scalar_type() == at::kBFloat16)
    pairs::narrow_bf16(dst.numel(), src, bits);
  else
    narrow_f16(dst.numel(), src, bits);
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> step_lean(const StepSizes& s, const Tensor& x, const Tensor& h,
                                             const OptTensor& c, const Tensor& w_ih,
                                             const Tensor& w_hh, const OptTensor& b_ih,
                                             const OptTensor& b_hh) {
  const auto dtype = x.scalar_type();
  const auto acc = acc_type(dtype);
  const auto opt = x.options();
  Tensor h_new = at::empty({s.B, s.H}, opt);
  Tensor c_new = s.cell == Cell::Lstm ? at::empty({s.B, s.H}, opt) : empty_like_options(x, dtype);
  Tensor ws = at::empty({s.B, workspace_size(s.cell, s.H)}, opt.dtype(acc));
  if (is_half(dtype)) {  // widened, the float32 step, rounded (see lean_step)
    const auto in = widened({&x, &h, opt_tensor(c), &w_ih, &w_hh, opt_tensor(b_ih), opt_tensor(b_hh)});
    float* out = results_scratch(static_cast<size_t>(2 * s.B * s.H));
    lean_step_forward<float>(s, in[0], in[1], in[2], in[3], in[4], in[5], in[6], out,
                             c.has_value() ? out + s.B * s.H : nullptr, ptr<float>(ws));
    narrow_into(out, h_new);
    if (c.has_value()) narrow_into(out + s.B * s.H, c_new);
    return {h_new, c_new, ws};
  }
  AT_DISPATCH_FLOATING_TYPES(acc, "rnnkern_step_cpu", [&] {
    auto opt_ptr = [](const OptTensor& t) { return t.has_value() ? cptr<scalar_t>(*t) : nullptr; };
    lean_step_forward<scalar_t>(s, cptr<scalar_t>(x), cptr<scalar_t>(h), opt_ptr(c),
                                cptr<scalar_t>(w_ih), cptr<scalar_t>(w_hh), opt_ptr(b_ih),
                                opt_ptr(b_hh), ptr<scalar_t>(h_new),
                                c.has_value() ? ptr<scalar_t>(c_new) : nullptr, ptr<scalar_t>(ws));
  });
  return {h_new, c_new, ws};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> step_backward_lean(
    const StepSizes& s, const Tensor& gh, const OptTensor& gc, const Tensor& x, const Tensor& h,
    const OptTensor& c, const Tensor& w_ih, const Tensor& w_hh, const Tensor& h_new,
    const Tensor& workspace, int64_t needs) {
  const auto dtype = x.scalar_type();
  const auto acc = acc_type(dtype);
  const auto wanted = [needs](int64_t i) { return (needs >> i & 1) != 0; };
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
  if (is_half(dtype)) {  // widened, the float32 step, rounded (see lean_step)
    const auto in = widened({&gh, lstm ? &*gc : nullptr, &x, &h, lstm ? &*c : nullptr, &w_ih,
                             &w_hh, &h_new});
    const int64_t B = s.B, I = s.I, H = s.H;
    float* d = results_scratch(static_cast<size_t>(B * I + 2 * B * H + GH * (I + H) + 2 * GH));
    float* dx = d;  // the results, one after the other
    float* dh = dx + B * I;
    float* dc = dh + B * H;
    float* dwi = dc + B * H;
    float* dwh = dwi + GH * I;
    float* dbi = dwh + GH * H;
    float* dbh = dbi + GH;
    lean_step_backward<float>(s, in[0], in[1], in[2], in[3], in[4], in[5], in[6], in[7],
                              cptr<float>(workspace), wanted(0) ? dx : nullptr, dh,
                              lstm ? dc : nullptr, wanted(3) ? dwi : nullptr,
                              wanted(4) ? dwh : nullptr, wanted(5) ? dbi : nullptr,
                              wanted(6) ? dbh : nullptr, wanted(1));
    const std::pair<const float*, const Tensor*> results[] = {
        {dx, &d_x}, {dh, &d_h}, {dc, &d_c}, {dwi, &d_w_ih}, {dwh, &d_w_hh}, {dbi, &d_b_ih}, {dbh, &d_b_hh}};
    for (const auto& [src, dst] : results)
      if (dst->numel() > 0) narrow_into(src, *dst);
    return {d_x,    wanted(1) ? d_h : none(), wanted(2) ? d_c : none(), d_w_ih, d_w_hh, d_b_ih,
            d_b_hh, none()};
  }
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

}  // namespace rnnkern::cpu

// The autograd formulas of rnnkern's ops, registered at the Autograd key in C++.
//
// Every op family (torch.ops.rnnkern, and the same schemas under the other
// backends' namespaces: rnnkern_triton, rnnkern_cuda_emu) gets the same
// formulas, by name: rnnkern/ops.py's register_op_family calls
// register_autograd(namespace).  In C++ a call records its graph node without
// entering Python: the Python formula (torch.library.register_autograd) cost
// about 15 us per call with grad and 3.5 us without, more than torch.nn's
// whole RNNCell step at small sizes.
//
// First derivatives come from the family's backward ops (recurrence_backward,
// step_backward).  A backward run with create_graph=True (double backward)
// instead differentiates the reference formulation recomputed from the saved
// inputs: rnnkern::reference_grads, implemented in Python (rnnkern/ops.py) as
// plain torch ops that autograd records.  That is why the forward saves xproj
// and the biases (the biases outside save_for_backward: save_bias below).
//
// Outputs the backward reads are saved as copy-on-write aliases
// (at::_lazy_clone): saving the output itself would make an in-place edit of it
// by the user (`out += x`) fail the backward with torch's version-counter error,
// where torch.nn trains.  The kernels read saved tensors through const
// pointers, which do not materialise the copy.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "autograd.h"
#include "cpu/parallel.h"

namespace rnnkern {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using RecurrenceSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    c10::string_view, const Tensor&, const Tensor&, const OptTensor&, const Tensor&,
    const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, bool, bool,
    const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
    bool);
using RecurrenceBackwardSig =
    std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
        c10::string_view, const Tensor&, const Tensor&, const OptTensor&, const Tensor&,
        const OptTensor&, const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
        const OptTensor&, bool, const OptTensor&, const OptTensor&, const OptTensor&,
        const OptTensor&, const OptTensor&);
using StepSig = std::tuple<Tensor, Tensor, Tensor>(c10::string_view, const Tensor&, const Tensor&,
                                                   const OptTensor&, const Tensor&, const Tensor&,
                                                   const OptTensor&, const OptTensor&,
                                                   const OptTensor&);
using StepBackwardSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
    c10::string_view, const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
    const OptTensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const OptTensor&, int64_t);
using ReferenceGradsSig = std::vector<Tensor>(c10::string_view, c10::string_view,
                                              const c10::List<OptTensor>&,
                                              const c10::List<OptTensor>&,
                                              const c10::List<OptTensor>&, bool, int64_t);

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const std::string& ns, const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow((ns + "::" + name).c_str(), "").typed<Sig>();
}

// The backward ops of one family.
struct Family {
  c10::TypedOperatorHandle<RecurrenceSig> recurrence;
  c10::TypedOperatorHandle<RecurrenceBackwardSig> recurrence_backward;
  c10::TypedOperatorHandle<StepSig> step;
  c10::TypedOperatorHandle<StepBackwardSig> step_backward;
};

OptTensor opt(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }
Tensor def(const OptTensor& t) { return t.has_value() ? *t : Tensor(); }
Tensor zeros_if_undefined(const Tensor& grad, const Tensor& like) {
  return grad.defined() ? grad : at::zeros_like(like);
}
bool requires_grad(const Tensor& t) { return t.defined() && t.requires_grad(); }

Tensor saved_output(const Tensor& output) {
  try {
    return at::_lazy_clone(output);
  } catch (const c10::Error&) {
    // Memory from an allocator whose DataPtr carries its own context (a
    // pluggable allocator) cannot be aliased copy-on-write: save the output
    // itself (an in-place edit then raises torch's error).
    return output;
  }
}

// The biases enter only the create_graph=True backward (the reference
// recomputes the gates from them), never the first-order one, and torch.nn's
// graph saves no bias at all: an optimizer step on a bias between forward and
// backward trains there.  So they are kept out of save_for_backward, whose
// unpack version-checks every saved tensor, and their versions are checked
// here, by the one backward that reads them.
void save_bias(AutogradContext* ctx, const std::string& name, const OptTensor& b) {
  if (!b) return;
  ctx->saved_data[name] = *b;
  if (!b->is_inference())  // (inference tensors have no version counter)
    ctx->saved_data[name + "_version"] = static_cast<int64_t>(b->_version());
}

Tensor saved_bias(AutogradContext* ctx, const std::string& name) {
  const auto it = ctx->saved_data.find(name);
  if (it == ctx->saved_data.end()) return Tensor();
  Tensor b = it->second.toTensor();
  const auto version = ctx->saved_data.find(name + "_version");
  if (version != ctx->saved_data.end()) {
    const int64_t expected = version->second.toInt();
    TORCH_CHECK(b._version() == expected,
                "one of the variables needed for gradient computation has been modified by an "
                "inplace operation: the bias ", name, " [", b.toString(), " ", b.sizes(),
                "] is at version ", b._version(), "; expected version ", expected,
                " instead. (rnnkern's double backward, create_graph=True, recomputes the gates "
                "from the biases as the forward read them; a first-order backward does not read "
                "them.)");
  }
  return b;
}

// The gradients of the reference formulation with respect to `inputs` (those
// that require grad), differentiable: the create_graph=True backward.
std::vector<Tensor> reference_grads(const char* op, const std::string& cell,
                                    const std::vector<Tensor>& inputs,
                                    const std::vector<Tensor>& grads,
                                    const std::vector<Tensor>& constants, bool reverse) {
  static const auto handle = find_op<ReferenceGradsSig>("rnnkern", "reference_grads");
  c10::List<OptTensor> in, gr, co;
  int64_t needs = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    in.push_back(opt(inputs[i]));
    if (requires_grad(inputs[i])) needs |= int64_t(1) << i;
  }
  for (const Tensor& g : grads) gr.push_back(opt(g));
  for (const Tensor& t : constants) co.push_back(opt(t));
  const std::vector<Tensor> wanted = handle.call(op, cell, in, gr, co, reverse, needs);
  std::vector<Tensor> out(inputs.size());
  size_t k = 0;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (needs >> i & 1) out[i] = wanted.at(k++);
  return out;
}

// Recurrences run ahead of their graph node (recurrence_ahead, autograd.h):
// this thread's, each taken by the first recording call of its op with the
// same xproj, w_hh, direction and cell.
struct Ahead {
  Tensor xproj, w_hh;
  bool reverse;
  std::string cell;
  std::tuple<Tensor, Tensor, Tensor, Tensor> outputs;
};
thread_local std::vector<Ahead> ahead;

std::optional<std::tuple<Tensor, Tensor, Tensor, Tensor>> take_ahead(const Tensor& xproj,
                                                                      const Tensor& w_hh,
                                                                      bool reverse,
                                                                      const std::string& cell) {
  for (auto it = ahead.begin(); it != ahead.end(); ++it) {
    if (it->xproj.is_same(xproj) && it->w_hh.is_same(w_hh) && it->reverse == reverse &&
        it->cell == cell) {
      auto outputs = std::move(it->outputs);
      ahead.erase(it);
      return outputs;
    }
  }
  return std::nullopt;
}

// Recurrence backwards run ahead of their node's call by the engine
// (backward_recurrences_at_once, autograd.h): this thread's, each taken by
// its node's call with the very gradient tensors it was computed from.
struct Behind {
  const AutogradContext* ctx;
  variable_list grads;
  variable_list result;
};
thread_local std::vector<Behind> behind;
thread_local size_t behind_missed = 0;  // dropped for other gradients

bool same_tensors(const variable_list& a, const variable_list& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].defined() != b[i].defined() || (a[i].defined() && !a[i].is_same(b[i]))) return false;
  return true;
}

std::optional<variable_list> take_behind(const AutogradContext* ctx, const variable_list& grads) {
  for (auto it = behind.begin(); it != behind.end(); ++it) {
    if (it->ctx == ctx) {
      std::optional<variable_list> result;
      if (same_tensors(it->grads, grads))
        result = std::move(it->result);
      else
        ++behind_missed;
      behind.erase(it);
      return result;
    }
  }
  return std::nullopt;
}

struct RecurrenceFunction : torch::autograd::Function<RecurrenceFunction> {
  static variable_list forward(AutogradContext* ctx, const Family* f, const std::string& cell,
                               const Tensor& xproj, const Tensor& h0, const OptTensor& c0,
                               const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh,
                               const OptTensor& w_hr, const OptTensor& lengths, bool reverse,
                               bool train, const OptTensor& resets, const OptTensor& zoneout,
                               const OptTensor& ln, const OptTensor& reset_h,
                               const OptTensor& reset_c, bool cell_steps) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto ran = train ? take_ahead(xproj, w_hh, reverse, cell) : std::nullopt;
    auto [out, h_n, c_n, ws] =
        ran ? *std::move(ran)
            : f->recurrence.call(cell, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, lengths, reverse,
                                 train, resets, zoneout, ln, reset_h, reset_c, cell_steps);
    ctx->saved_data["family"] = reinterpret_cast<int64_t>(f);
    ctx->saved_data["cell_steps"] = cell_steps;
    ctx->saved_data["cell"] = cell;
    ctx->saved_data["reverse"] = reverse;
    ctx->save_for_backward({xproj, h0, def(c0), w_hh, def(w_hr), saved_output(out), ws,
                            def(lengths), def(resets), def(zoneout), def(ln), def(reset_h),
                            def(reset_c)});
    save_bias(ctx, "b_ih", b_ih);
    save_bias(ctx, "b_hh", b_hh);
    // The workspace is not marked non-differentiable (compiled autograd's
    // CppNode refuses nodes that mark any): no op reads it differentiably, so
    // its gradient is never produced.  Unused outputs get no zero-filled
    // gradient (the workspace alone would cost a pass over T*B*W*H values);
    // missing ones are made in backward.
    ctx->set_materialize_grads(false);
    return {out, h_n, c_n, ws};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* f = reinterpret_cast<const Family*>(ctx->saved_data["family"].toInt());
    const std::string cell = ctx->saved_data["cell"].toStringRef();
    const bool reverse = ctx->saved_data["reverse"].toBool();
    const bool lstm = c10::string_view(cell).substr(0, 4) == "lstm";  // lstm, lstm_ln: a cell state
    const variable_list s = ctx->get_saved_variables();  // (torch's checks: in-place edits, freed graph)
    if (!at::GradMode::is_enabled())
      if (auto ran = take_behind(ctx, grads)) return *std::move(ran);
    const Tensor &xproj = s[0], &h0 = s[1], &c0 = s[2], &w_hh = s[3], &w_hr = s[4],
                 &out = s[5], &ws = s[6], &lengths = s[7], &resets = s[8], &zoneout = s[9],
                 &ln = s[10], &reset_h = s[11], &reset_c = s[12];
    const Tensor &g_out = grads[0], &g_hn = grads[1];
    // With cell_steps c_n is every step's state: its missing gradient is [T, B, H] zeros.
    const Tensor g_cn = grads[2].defined() || !ctx->saved_data["cell_steps"].toBool()
                            ? grads[2]
                            : at::zeros({out.size(0), c0.size(0), c0.size(1)}, c0.options());
    // Gradients per forward argument: family, cell, the 7 inputs, lengths,
    // reverse, train, resets, zoneout, ln, reset_h, reset_c, cell_steps.
    variable_list result(18);
    if (at::GradMode::is_enabled()) {  // create_graph=True
      const Tensor b_ih = saved_bias(ctx, "b_ih"), b_hh = saved_bias(ctx, "b_hh");
      const auto g = reference_grads(
          "recurrence", cell, {xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, ln, reset_h, reset_c},
          {g_out, g_hn, lstm ? g_cn : Tensor()}, {lengths, resets, zoneout}, reverse);
      std::copy(g.begin(), g.begin() + 7, result.begin() + 2);
      std::copy(g.begin() + 7, g.end(), result.begin() + 14);
      return result;
    }
    auto [gx, gh0, gc0, gw, gbi, gbh, gwr, gln, grh, grc] = f->recurrence_backward.call(
        cell, zeros_if_undefined(g_out, out), zeros_if_undefined(g_hn, h0),
        lstm ? opt(zeros_if_undefined(g_cn, c0)) : std::nullopt, h0, opt(c0), w_hh, opt(w_hr),
        out, ws, opt(lengths), reverse, opt(resets), opt(zoneout), opt(ln), opt(reset_h),
        opt(reset_c));
    result[2] = gx;
    result[3] = gh0;
    if (lstm) result[4] = gc0;
    result[5] = gw;
    if (ctx->saved_data.count("b_ih")) result[6] = gbi;
    if (ctx->saved_data.count("b_hh")) result[7] = gbh;
    if (w_hr.defined()) result[8] = gwr;
    if (ln.defined()) result[14] = gln;
    if (reset_h.defined()) result[15] = grh;
    if (reset_c.defined()) result[16] = grc;
    return result;
  }
};

struct StepFunction : torch::autograd::Function<StepFunction> {
  static variable_list forward(AutogradContext* ctx, const Family* f, const std::string& cell,
                               const Tensor& x, const Tensor& h, const OptTensor& c,
                               const Tensor& w_ih, const Tensor& w_hh, const OptTensor& b_ih,
                               const OptTensor& b_hh, const OptTensor& ln) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [h_new, c_new, ws] = f->step.call(cell, x, h, c, w_ih, w_hh, b_ih, b_hh, ln);
    ctx->saved_data["family"] = reinterpret_cast<int64_t>(f);
    ctx->saved_data["cell"] = cell;
    // The gradients the backward computes: of the inputs that require grad
    // (step_backward's `needs`, bit i for x, h, c, w_ih, w_hh, b_ih, b_hh, ln).
    int64_t needs = 0;
    const Tensor inputs[8] = {x, h, def(c), w_ih, w_hh, def(b_ih), def(b_hh), def(ln)};
    for (int64_t i = 0; i < 8; ++i)
      if (requires_grad(inputs[i])) needs |= int64_t(1) << i;
    ctx->saved_data["needs"] = needs;
    ctx->save_for_backward({x, h, def(c), w_ih, w_hh, saved_output(h_new), ws, def(ln)});
    save_bias(ctx, "b_ih", b_ih);
    save_bias(ctx, "b_hh", b_hh);
    // (The workspace stays differentiable, as in RecurrenceFunction: compiled autograd.)
    ctx->set_materialize_grads(false);
    return {h_new, c_new, ws};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* f = reinterpret_cast<const Family*>(ctx->saved_data["family"].toInt());
    const std::string cell = ctx->saved_data["cell"].toStringRef();
    const bool lstm = c10::string_view(cell).substr(0, 4) == "lstm";  // lstm, lstm_ln: a cell state
    const variable_list s = ctx->get_saved_variables();
    const Tensor &x = s[0], &h = s[1], &c = s[2], &w_ih = s[3], &w_hh = s[4], &h_new = s[5],
                 &ws = s[6], &ln = s[7];
    const Tensor &g_h = grads[0], &g_c = grads[1];
    // Gradients per forward argument: family, cell, the 7 inputs, ln.
    variable_list result(10);
    if (at::GradMode::is_enabled()) {  // create_graph=True
      const Tensor b_ih = saved_bias(ctx, "b_ih"), b_hh = saved_bias(ctx, "b_hh");
      const auto g = reference_grads("step", cell, {x, h, c, w_ih, w_hh, b_ih, b_hh, ln},
                                     {g_h, lstm ? g_c : Tensor()}, {}, false);
      std::copy(g.begin(), g.end(), result.begin() + 2);
      return result;
    }
    const int64_t needs = ctx->saved_data["needs"].toInt();
    auto [gx, gh, gc, gw_ih, gw_hh, gb_ih, gb_hh, gln] = f->step_backward.call(
        cell, zeros_if_undefined(g_h, h_new), lstm ? opt(zeros_if_undefined(g_c, c)) : std::nullopt,
        x, h, opt(c), w_ih, w_hh, h_new, ws, opt(ln), needs);
    const Tensor got[8] = {gx, gh, gc, gw_ih, gw_hh, gb_ih, gb_hh, gln};
    for (int64_t i = 0; i < 8; ++i)
      if (needs >> i & 1) result[2 + i] = got[i];  // (needs implies the input exists)
    return result;
  }
};

bool any_requires_grad(std::initializer_list<const Tensor*> ts,
                       std::initializer_list<const OptTensor*> opts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const Tensor* t : ts)
    if (requires_grad(*t)) return true;
  for (const OptTensor* t : opts)
    if (t->has_value() && requires_grad(**t)) return true;
  return false;
}

// rnnkern::linear (CPU backend only, so no family): the input projection.
using LinearSig = Tensor(const Tensor&, const Tensor&);
using LinearBackwardSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                     bool, bool);

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight) {
    static const auto op = find_op<LinearSig>("rnnkern", "linear");
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({x, weight});
    return op.call(x, weight);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = find_op<LinearBackwardSig>("rnnkern", "linear_backward");
    const variable_list s = ctx->get_saved_variables();
    const Tensor &x = s[0], &weight = s[1], &gy = grads[0];
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    if (at::GradMode::is_enabled())  // create_graph=True: the same products, differentiable
      return {need_x ? gy.mm(weight) : Tensor(), need_w ? gy.t().mm(x) : Tensor()};
    auto [gx, gw] = op.call(gy, x, weight, need_x, need_w);
    return {need_x ? gx : Tensor(), need_w ? gw : Tensor()};
  }
};

Tensor linear_autograd(const Tensor& x, const Tensor& weight) {
  if (!any_requires_grad({&x, &weight}, {})) {
    static const auto op = find_op<LinearSig>("rnnkern", "linear");
    at::AutoDispatchBelowADInplaceOrView below;
    return op.call(x, weight);
  }
  return LinearFunction::apply(x, weight);
}

// rnnkern::relayout (CPU): a copy, so its gradient is the incoming one laid
// out as x was (the caller's transposed layout: its own view of the gradient
// is then dense, with no copy of its own), by the same op through autograd so
// that double backward holds.
using RelayoutSig = Tensor(const Tensor&, at::IntArrayRef);

// x's dimensions outermost first: by decreasing stride, ties (sizes of 1) in
// their order.
std::vector<int64_t> layout_order(const Tensor& x) {
  std::vector<int64_t> order(x.dim());
  for (int64_t d = 0; d < x.dim(); ++d) order[d] = d;
  std::stable_sort(order.begin(), order.end(),
                   [&x](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
  return order;
}

struct RelayoutFunction : torch::autograd::Function<RelayoutFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, at::IntArrayRef order) {
    static const auto op = find_op<RelayoutSig>("rnnkern", "relayout");
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->saved_data["order"] = layout_order(x);
    return op.call(x, order);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = find_op<RelayoutSig>("rnnkern", "relayout");
    const std::vector<int64_t> order = ctx->saved_data["order"].toIntVector();
    return {op.call(grads[0], order), Tensor()};
  }
};

Tensor relayout_autograd(const Tensor& x, at::IntArrayRef order) {
  if (!any_requires_grad({&x}, {})) {
    static const auto op = find_op<RelayoutSig>("rnnkern", "relayout");
    at::AutoDispatchBelowADInplaceOrView below;
    return op.call(x, order);
  }
  return RelayoutFunction::apply(x, order);
}

std::mutex registry_mutex;
std::set<std::string> registered;
std::deque<Family> families;  // stable addresses: the kernels keep pointers
std::deque<std::unique_ptr<torch::Library>> libraries;

}  // namespace

void recurrence_ahead(const Tensor& xproj, const Tensor& w_hh, bool reverse,
                      const std::string& cell, const Tensor& out, const Tensor& h_n,
                      const Tensor& c_n, const Tensor& ws) {
  ahead.push_back(Ahead{xproj, w_hh, reverse, cell, {out, h_n, c_n, ws}});
}

size_t clear_recurrences_ahead() {
  const size_t left = ahead.size();
  ahead.clear();
  return left;
}

size_t backward_recurrences_at_once(const std::array<Tensor, 2>& outputs,
                                    const std::array<std::vector<Tensor>, 2>& grads) {
  std::array<AutogradContext*, 2> ctx{};
  for (size_t i = 0; i < 2; ++i) {
    auto* node =
        dynamic_cast<torch::autograd::CppNode<RecurrenceFunction>*>(outputs[i].grad_fn().get());
    if (node == nullptr) return 0;
    ctx[i] = &node->ctx_;
  }
  if (ctx[0] == ctx[1]) return 0;
  for (const AutogradContext* c : ctx)
    behind.erase(std::remove_if(behind.begin(), behind.end(),
                                [&](const Behind& b) { return b.ctx == c; }),
                 behind.end());
  // What an engine's call left (a backward that failed between): at most a
  // few layers' worth is kept.
  if (behind.size() > 8) behind.erase(behind.begin(), behind.end() - 8);
  std::array<std::optional<variable_list>, 2> results;
  const at::ThreadLocalState state;
  cpu::for_each_worker(2, [&](int64_t t) {
    at::ThreadLocalStateGuard guard(state);
    at::NoGradGuard no_grad;
    // An error (an in-place edit of a saved tensor, a graph already freed)
    // is left to the engine's call of the node, which raises it as torch does.
    try {
      results[t] = RecurrenceFunction::backward(ctx[t], grads[t]);
    } catch (...) {
      results[t].reset();
    }
  });
  size_t kept = 0;
  for (size_t i = 0; i < 2; ++i) {
    if (!results[i]) continue;
    behind.push_back(Behind{ctx[i], grads[i], *std::move(results[i])});
    ++kept;
  }
  return kept;
}

size_t clear_recurrence_backwards_ahead() {
  const size_t left = behind.size() + behind_missed;
  behind.clear();
  behind_missed = 0;
  return left;
}

void register_autograd(const std::string& ns) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  if (!registered.insert(ns).second) return;
  families.push_back(Family{find_op<RecurrenceSig>(ns, "recurrence"),
                            find_op<RecurrenceBackwardSig>(ns, "recurrence_backward"),
                            find_op<StepSig>(ns, "step"),
                            find_op<StepBackwardSig>(ns, "step_backward")});
  const Family* f = &families.back();
  libraries.push_back(std::make_unique<torch::Library>(
      torch::Library::IMPL, ns, c10::DispatchKey::Autograd, __FILE__, __LINE__));
  torch::Library& m = *libraries.back();
  m.impl("recurrence", [f](c10::string_view cell, const Tensor& xproj, const Tensor& h0,
                           const OptTensor& c0, const Tensor& w_hh, const OptTensor& b_ih,
                           const OptTensor& b_hh, const OptTensor& w_hr,
                           const OptTensor& lengths, bool reverse, bool train,
                           const OptTensor& resets, const OptTensor& zoneout,
                           const OptTensor& ln, const OptTensor& reset_h,
                           const OptTensor& reset_c, bool cell_steps) {
    // (resets and zoneout are masks: not differentiated)
    if (!any_requires_grad({&xproj, &h0, &w_hh},
                           {&c0, &b_ih, &b_hh, &w_hr, &ln, &reset_h, &reset_c})) {
      at::AutoDispatchBelowADInplaceOrView below;
      return f->recurrence.call(cell, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, lengths, reverse,
                                train, resets, zoneout, ln, reset_h, reset_c, cell_steps);
    }
    const variable_list r =
        RecurrenceFunction::apply(f, std::string(cell), xproj, h0, c0, w_hh, b_ih, b_hh, w_hr,
                                  lengths, reverse, train, resets, zoneout, ln, reset_h, reset_c,
                                  cell_steps);
    return std::make_tuple(r[0], r[1], r[2], r[3]);
  });
  m.impl("step", [f](c10::string_view cell, const Tensor& x, const Tensor& h, const OptTensor& c,
                     const Tensor& w_ih, const Tensor& w_hh, const OptTensor& b_ih,
                     const OptTensor& b_hh, const OptTensor& ln) {
    if (!any_requires_grad({&x, &h, &w_ih, &w_hh}, {&c, &b_ih, &b_hh, &ln})) {
      at::AutoDispatchBelowADInplaceOrView below;
      return f->step.call(cell, x, h, c, w_ih, w_hh, b_ih, b_hh, ln);
    }
    const variable_list r =
        StepFunction::apply(f, std::string(cell), x, h, c, w_ih, w_hh, b_ih, b_hh, ln);
    return std::make_tuple(r[0], r[1], r[2]);
  });
  if (ns == "rnnkern") {
    m.impl("linear", &linear_autograd);
    m.impl("relayout", &relayout_autograd);
  }
}

}  // namespace rnnkern

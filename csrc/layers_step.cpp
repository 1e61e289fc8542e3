// `<ns>::layers_step`: one step of a whole layer stack (every layer and
// direction) by the family's fused step op, as a CompositeImplicitAutograd
// kernel: it calls `<ns>::step` through the dispatcher, so each step records
// its own graph node (autograd.cpp's formulas) and torch.compile sees the
// steps, not this op.
//
// Why an op and not the Python loop it replaces (rnnkern/modules/sequence.py,
// _one_step_layers): a one-step call of a small module (streaming inference,
// an RL rollout's action step) is all overhead.  On a Zen 3 core, an RNN with
// H=8 spent ~19 us in that loop around a 5 us step op -- each Python-level
// view op (x[0], h0[i], unsqueeze, clone) costs 1-3 us, here ~0.3 -- and the
// module's whole call ~45 us, as long as torch.nn's.
//
// Schema (csrc/ops.cpp): input [1, B, I] ([B, 1, I] with batch_first); h0 and
// c0 [L*D, B, H] as torch.nn's hx; weights as torch.nn's _flat_weights: per
// layer and direction w_ih, w_hh[, b_ih, b_hh] (no projection: proj_size
// stays on the sequence path).  Returns output [1, B, D*H] ([B, 1, D*H]),
// h_n, and c_n (LSTM; else an empty [0] tensor).  Dropout between layers and
// resets are the caller's (the Python loop keeps them).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers: a much faster compile
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>
#include <torch/library.h>

#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "module.h"

namespace rnnkern {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using StepSig = std::tuple<Tensor, Tensor, Tensor>(c10::string_view, const Tensor&, const Tensor&,
                                                   const OptTensor&, const Tensor&, const Tensor&,
                                                   const OptTensor&, const OptTensor&,
                                                   const OptTensor&);

std::tuple<Tensor, Tensor, Tensor> layers_step(const c10::TypedOperatorHandle<StepSig>& step,
                                               c10::string_view cell, const Tensor& input,
                                               const Tensor& h0, const OptTensor& c0,
                                               at::TensorList weights, int64_t num_layers,
                                               bool bidirectional, bool batch_first) {
  const bool lstm = cell == "lstm";
  const int64_t D = bidirectional ? 2 : 1;
  const int64_t time_dim = batch_first ? 1 : 0;
  TORCH_CHECK(cell == "rnn_tanh" || cell == "rnn_relu" || cell == "gru" ||
                  cell == "gru_reset_before" || lstm,
              "layers_step: cell must be rnn_tanh, rnn_relu, gru, gru_reset_before or lstm, got ",
              cell);
  TORCH_CHECK(num_layers >= 1, "layers_step: num_layers must be at least 1, got ", num_layers);
  TORCH_CHECK(input.dim() == 3 && input.size(time_dim) == 1, "layers_step: input must be ",
              batch_first ? "[B, 1, I]" : "[1, B, I]", " (one step), got ", input.sizes());
  const int64_t B = input.size(1 - time_dim);
  TORCH_CHECK(h0.dim() == 3 && h0.size(0) == num_layers * D && h0.size(1) == B,
              "layers_step: h0 must be [num_layers * directions, B, H] = [", num_layers * D, ", ",
              B, ", H], got ", h0.sizes());
  TORCH_CHECK(lstm == c0.has_value(), "layers_step: c0 is ", lstm ? "required" : "unused",
              " for cell ", cell);
  if (lstm)
    TORCH_CHECK(c0->sizes() == h0.sizes(), "layers_step: c0 must have h0's shape ", h0.sizes(),
                ", got ", c0->sizes());
  const int64_t groups = num_layers * D;
  const int64_t per = static_cast<int64_t>(weights.size()) / groups;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == per * groups && (per == 2 || per == 4),
              "layers_step: weights must hold (w_ih, w_hh[, b_ih, b_hh]) for each of the ",
              groups, " layers and directions, got ", weights.size(), " tensors");

  Tensor x = input.select(time_dim, 0);  // [B, I]
  std::vector<Tensor> h_n, c_n, outputs;
  Tensor no_cell_state;  // (the step's own empty c_new without a cell state: no allocation)
  h_n.reserve(groups);
  c_n.reserve(lstm ? groups : 0);
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    outputs.clear();
    for (int64_t d = 0; d < D; ++d) {
      const int64_t idx = layer * D + d;
      const Tensor* w = weights.data() + idx * per;
      const OptTensor b_ih = per == 4 ? OptTensor(w[2]) : std::nullopt;
      const OptTensor b_hh = per == 4 ? OptTensor(w[3]) : std::nullopt;
      const OptTensor c = lstm ? OptTensor(c0->select(0, idx)) : std::nullopt;
      auto [h, c_new, workspace] =
          step.call(cell, x, h0.select(0, idx), c, w[0], w[1], b_ih, b_hh, std::nullopt);
      outputs.push_back(h);
      h_n.push_back(h);
      if (lstm)
        c_n.push_back(c_new);
      else
        no_cell_state = c_new;
    }
    x = D == 2 ? at::cat(outputs, -1) : outputs[0];
  }
  const Tensor output = x.unsqueeze(time_dim);
  // h_n apart from the output (an in-place edit of one must not show in the
  // other), as on the sequence path.
  const Tensor h_last = groups == 1 ? x.unsqueeze(0).clone() : at::stack(h_n);
  const Tensor c_last = !lstm ? no_cell_state : groups == 1 ? c_n[0].unsqueeze(0) : at::stack(c_n);
  return {output, h_last, c_last};
}

std::mutex registry_mutex;
std::set<std::string> registered;
std::deque<std::unique_ptr<torch::Library>> libraries;

PyObject* register_layers_step(PyObject*, PyObject* ns_object) {
  return call_with_namespace(ns_object, [](const std::string& ns) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (registered.count(ns) != 0) return;  // (recorded below, once registered)
    const auto step = c10::Dispatcher::singleton()
                          .findSchemaOrThrow((ns + "::step").c_str(), "")
                          .typed<StepSig>();
    libraries.push_back(std::make_unique<torch::Library>(
        torch::Library::IMPL, ns, c10::DispatchKey::CompositeImplicitAutograd, __FILE__, __LINE__));
    libraries.back()->impl(
        "layers_step", [step](c10::string_view cell, const Tensor& input, const Tensor& h0,
                              const OptTensor& c0, at::TensorList weights, int64_t num_layers,
                              bool bidirectional, bool batch_first) {
          return layers_step(step, cell, input, h0, c0, weights, num_layers, bidirectional,
                             batch_first);
        });
    registered.insert(ns);
  });
}

const ModuleFunctions functions({
    {"register_layers_step", register_layers_step, METH_O,
     "Registers the family's layers_step (CompositeImplicitAutograd: its step op per layer "
     "and direction) in the given namespace, whose step and layers_step must be defined."},
});

}  // namespace
}  // namespace rnnkern

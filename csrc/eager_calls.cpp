// rnnkern._C.step and rnnkern._C.layers_step: a family's `step` and
// `layers_step` ops called from Python unboxed, through the dispatcher, so
// that every dispatch key (autograd, Python modes, ...) sees the op exactly as
// a torch.ops call.  rnnkern/ops.py's run_step and run_layers_step use them in
// eager; torch.compile traces torch.ops.
//
// Why: torch.ops' call boxes its arguments into IValues, which costs a
// one-step call of a small module more than the step: ~4 us for a list
// argument (torch.ops.aten.cat against torch.cat, Zen 3), ~2 us for step's
// nine; the cells and the one-step forward exist to be fast on such calls.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers: a much faster compile
#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "autograd.h"
#include "module.h"

namespace rnnkern {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using Result = std::tuple<Tensor, Tensor, Tensor>;
using StepSig = Result(c10::string_view, const Tensor&, const Tensor&, const OptTensor&,
                       const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                       const OptTensor&);
using LayersStepSig = Result(c10::string_view, const Tensor&, const Tensor&, const OptTensor&,
                             at::TensorList, int64_t, bool, bool);

// The typed handle of `ns`::`name`, found once per namespace.
template <typename Sig>
c10::TypedOperatorHandle<Sig> op_handle(const char* ns, const char* name) {
  static std::mutex mutex;
  static std::unordered_map<std::string, c10::TypedOperatorHandle<Sig>> handles;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = handles.find(ns);
  if (it == handles.end()) {
    const std::string qualified = std::string(ns) + "::" + name;
    it = handles
             .emplace(ns, c10::Dispatcher::singleton()
                              .findSchemaOrThrow(qualified.c_str(), "")
                              .typed<Sig>())
             .first;
  }
  return it->second;
}

Tensor tensor_argument(const char* op, PyObject* obj, const std::string& name) {
  TORCH_CHECK_TYPE(THPVariable_Check(obj), op, ": ", name, " must be a Tensor, got ",
                   Py_TYPE(obj)->tp_name);
  return THPVariable_Unpack(obj);
}

OptTensor optional_tensor_argument(const char* op, PyObject* obj, const std::string& name) {
  return obj == Py_None ? OptTensor() : OptTensor(tensor_argument(op, obj, name));
}

const char* string_argument(const char* op, PyObject* obj, const char* name) {
  TORCH_CHECK_TYPE(PyUnicode_Check(obj), op, ": ", name, " must be a str, got ",
                   Py_TYPE(obj)->tp_name);
  const char* s = PyUnicode_AsUTF8(obj);
  if (s == nullptr) throw python_error();
  return s;
}

PyObject* wrap(Result result) {
  PyObject* tuple = PyTuple_New(3);
  if (tuple == nullptr) return nullptr;
  PyTuple_SET_ITEM(tuple, 0, THPVariable_Wrap(std::move(std::get<0>(result))));
  PyTuple_SET_ITEM(tuple, 1, THPVariable_Wrap(std::move(std::get<1>(result))));
  PyTuple_SET_ITEM(tuple, 2, THPVariable_Wrap(std::move(std::get<2>(result))));
  return tuple;
}

// step(ns, cell, x, h, c, w_ih, w_hh, b_ih, b_hh, ln) -> (h_new, c_new, workspace)
PyObject* step_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  constexpr const char* op = "step";
  TORCH_CHECK_TYPE(nargs == 10, "step: expected 10 arguments (ns, cell, x, h, c, w_ih, w_hh, ",
                   "b_ih, b_hh, ln), got ", nargs);
  const char* ns = string_argument(op, args[0], "ns");
  const char* cell = string_argument(op, args[1], "cell");
  const Tensor x = tensor_argument(op, args[2], "x"), h = tensor_argument(op, args[3], "h");
  const OptTensor c = optional_tensor_argument(op, args[4], "c");
  const Tensor w_ih = tensor_argument(op, args[5], "w_ih");
  const Tensor w_hh = tensor_argument(op, args[6], "w_hh");
  const OptTensor b_ih = optional_tensor_argument(op, args[7], "b_ih");
  const OptTensor b_hh = optional_tensor_argument(op, args[8], "b_hh");
  const OptTensor ln = optional_tensor_argument(op, args[9], "ln");
  const auto handle = op_handle<StepSig>(ns, "step");
  Result result;
  {
    pybind11::gil_scoped_release no_gil;  // as torch.ops releases it around an op
    result = handle.call(cell, x, h, c, w_ih, w_hh, b_ih, b_hh, ln);
  }
  return wrap(std::move(result));
  END_HANDLE_TH_ERRORS
}

// layers_step(ns, cell, input, h0, c0, weights, num_layers, bidirectional,
// batch_first) -> (output, h_n, c_n)
PyObject* layers_step_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  constexpr const char* op = "layers_step";
  TORCH_CHECK_TYPE(nargs == 9, "layers_step: expected 9 arguments (ns, cell, input, h0, c0, ",
                   "weights, num_layers, bidirectional, batch_first), got ", nargs);
  const char* ns = string_argument(op, args[0], "ns");
  const char* cell = string_argument(op, args[1], "cell");
  const Tensor input = tensor_argument(op, args[2], "input");
  const Tensor h0 = tensor_argument(op, args[3], "h0");
  const OptTensor c0 = optional_tensor_argument(op, args[4], "c0");
  TORCH_CHECK_TYPE(PyList_Check(args[5]) || PyTuple_Check(args[5]),
                   "layers_step: weights must be a list of Tensors, got ", Py_TYPE(args[5])->tp_name);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(args[5]);
  PyObject** items = PySequence_Fast_ITEMS(args[5]);
  std::vector<Tensor> weights;
  weights.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i)
    weights.push_back(tensor_argument(op, items[i], "weights[" + std::to_string(i) + "]"));
  const int64_t num_layers = PyLong_AsLongLong(args[6]);
  if (num_layers == -1 && PyErr_Occurred()) return nullptr;
  const int bidirectional = PyObject_IsTrue(args[7]), batch_first = PyObject_IsTrue(args[8]);
  if (bidirectional < 0 || batch_first < 0) return nullptr;
  const auto handle = op_handle<LayersStepSig>(ns, "layers_step");
  Result result;
  {
    pybind11::gil_scoped_release no_gil;
    result = handle.call(cell, input, h0, c0, weights, num_layers, bidirectional != 0,
                         batch_first != 0);
  }
  return wrap(std::move(result));
  END_HANDLE_TH_ERRORS
}

// recurrence_ahead(xproj, w_hh, reverse, cell, out, h_n, c_n, ws): autograd.h's
// recurrence_ahead, for ops.recorded_ahead.
PyObject* recurrence_ahead_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  constexpr const char* op = "recurrence_ahead";
  TORCH_CHECK_TYPE(nargs == 8, "recurrence_ahead: expected 8 arguments (xproj, w_hh, reverse, ",
                   "cell, out, h_n, c_n, ws), got ", nargs);
  const int reverse = PyObject_IsTrue(args[2]);
  if (reverse < 0) return nullptr;
  recurrence_ahead(tensor_argument(op, args[0], "xproj"), tensor_argument(op, args[1], "w_hh"),
                   reverse != 0, string_argument(op, args[3], "cell"),
                   tensor_argument(op, args[4], "out"), tensor_argument(op, args[5], "h_n"),
                   tensor_argument(op, args[6], "c_n"), tensor_argument(op, args[7], "ws"));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* clear_recurrences_ahead_call(PyObject*, PyObject*) {
  return PyLong_FromSize_t(clear_recurrences_ahead());
}

// backward_recurrences_at_once(out0, grads0, out1, grads1): autograd.h's, for
// rnnkern/modules' _BackwardsAtOnce; grads*: sequences of Tensors or None.
PyObject* backward_recurrences_at_once_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  constexpr const char* op = "backward_recurrences_at_once";
  TORCH_CHECK_TYPE(nargs == 4, op, ": expected 4 arguments (out0, grads0, out1, grads1), got ",
                   nargs);
  std::array<Tensor, 2> outputs;
  std::array<std::vector<Tensor>, 2> grads;
  for (int i = 0; i < 2; ++i) {
    outputs[i] = tensor_argument(op, args[2 * i], "out");
    PyObject* seq = args[2 * i + 1];
    TORCH_CHECK_TYPE(PyList_Check(seq) || PyTuple_Check(seq), op,
                     ": grads must be a list of Tensors or None, got ", Py_TYPE(seq)->tp_name);
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; k < n; ++k)
      grads[i].push_back(items[k] == Py_None ? Tensor() : tensor_argument(op, items[k], "grads"));
  }
  size_t kept;
  {
    pybind11::gil_scoped_release no_gil;
    kept = backward_recurrences_at_once(outputs, grads);
  }
  return PyLong_FromSize_t(kept);
  END_HANDLE_TH_ERRORS
}

PyObject* clear_recurrence_backwards_ahead_call(PyObject*, PyObject*) {
  return PyLong_FromSize_t(clear_recurrence_backwards_ahead());
}

PyCFunction fastcall(PyObject* (*f)(PyObject*, PyObject* const*, Py_ssize_t)) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

const ModuleFunctions functions({
    {"step", fastcall(step_call), METH_FASTCALL,
     "ns::step(cell, x, h, c, w_ih, w_hh, b_ih, b_hh, ln), called unboxed (eager calls)."},
    {"layers_step", fastcall(layers_step_call), METH_FASTCALL,
     "ns::layers_step(cell, input, h0, c0, weights, num_layers, bidirectional, batch_first), "
     "called unboxed (eager calls)."},
    {"recurrence_ahead", fastcall(recurrence_ahead_call), METH_FASTCALL,
     "recurrence_ahead(xproj, w_hh, reverse, cell, out, h_n, c_n, ws): outputs computed ahead "
     "for this thread's next recording recurrence call with these xproj and w_hh (autograd.h)."},
    {"clear_recurrences_ahead", clear_recurrences_ahead_call, METH_NOARGS,
     "Drops this thread's recurrence outputs computed ahead that no call took; their count."},
    {"backward_recurrences_at_once", fastcall(backward_recurrences_at_once_call), METH_FASTCALL,
     "backward_recurrences_at_once(out0, grads0, out1, grads1): two recurrence nodes' backward "
     "at once, kept for this thread's calls of the nodes with these gradients (autograd.h); "
     "how many were kept."},
    {"clear_recurrence_backwards_ahead", clear_recurrence_backwards_ahead_call, METH_NOARGS,
     "Drops this thread's recurrence backwards computed ahead that no call took; their count "
     "(with those a call found computed for other gradients)."},
});

}  // namespace
}  // namespace rnnkern

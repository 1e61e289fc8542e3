"""PyTorch's own contract for its recurrent modules, run against rnnkern's.

torch.testing._internal.common_modules holds, for nn.RNN, GRU, LSTM, RNNCell,
GRUCell and LSTMCell, the sample inputs (``module_inputs_func``) and error inputs
(``module_error_inputs_func``) that PyTorch's test/test_modules.py runs its
ModuleInfo tests on.  Here every sample runs through rnnkern's twin of the class
on each CPU-runnable backend, on the same weights as torch.nn's module:

- outputs and final states equal torch.nn's (float64, conftest's tolerance),
  and the sample's own reference function (unbatched == batched of one) holds;
- gradients of the input, the initial states and every parameter equal
  torch.nn's, in torch.nn's memory layout (test_memory_format's contract);
- non-contiguous inputs and states give the same results (test_non_contiguous_tensors);
- ``torch.autograd.gradcheck`` and ``gradgradcheck`` in float64 (test_grad,
  test_gradgrad), w.r.t. the input, the states and every parameter;
- each error input raises the exception type torch.nn raises, with a message
  matching the error input's regex (test_errors).

Plus the cell behaviours PyTorch's test_nn.py checks: cells of hidden_size 0.

The Triton backend runs under TRITON_INTERPRET=1 on the samples of one
configuration per class (the interpreter takes seconds per kernel launch).
"""
from __future__ import annotations

import importlib.util
import zlib

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence

# torch's internal test utilities import expecttest, a test-only package that torch does not
# install (requirements-dev.txt has it; the GPU image has not): without it this file is skipped
# with the reason, rather than stopping the whole collection.
pytest.importorskip("expecttest", reason="torch.testing._internal.common_modules needs expecttest "
                    "(pip install expecttest)")
from torch.testing._internal.common_modules import ModuleErrorEnum, module_db  # noqa: E402

import rnnkern
from conftest import TRITON_INTERPRET, assert_close, generator, randn

TWINS = {nn.RNN: rnnkern.RNN, nn.GRU: rnnkern.GRU, nn.LSTM: rnnkern.LSTM,
         nn.RNNCell: rnnkern.RNNCell, nn.GRUCell: rnnkern.GRUCell, nn.LSTMCell: rnnkern.LSTMCell}
INFOS = {info.module_cls: info for info in module_db if info.module_cls in TWINS}
assert set(INFOS) == set(TWINS), "common_modules lost a ModuleInfo entry of a recurrent class"

HAS_TRITON_OPS = importlib.util.find_spec("triton") is not None
BACKENDS = ["reference", "cpu"]
if TRITON_INTERPRET and HAS_TRITON_OPS:
    BACKENDS.append("triton")
if rnnkern.ops.WITH_CUDA_EMULATION:  # the CUDA backend's code on the emulated device
    BACKENDS.append("cuda_emulated")
CLASS_IDS = [cls.__name__ for cls in TWINS]


def sample_inputs(cls, training: bool, requires_grad: bool = True):
    """The ModuleInfo samples of ``cls`` in float64 (RNN and GRU with their
    PackedSequence samples too), drawn under a seed of their own."""
    torch.manual_seed(zlib.crc32(f"{cls.__name__}-{training}".encode()))
    info = INFOS[cls]
    kwargs = {"with_packed_sequence": True} if cls in (nn.RNN, nn.GRU) else {}
    return list(info.module_inputs_func(info, device="cpu", dtype=torch.float64,
                                        requires_grad=requires_grad, training=training, **kwargs))


def subset(cls, backend, samples):
    """Every sample, except under the Triton interpreter and the emulated CUDA
    device (each kernel launch is interpreted, or runs a fiber per CUDA
    thread): the samples of the first constructor configuration (hidden state
    given or not, packed or not); tests/test_cuda_emulated.py covers the rest."""
    if backend not in ("triton", "cuda_emulated"):
        return samples
    first = samples[0].constructor_input.kwargs
    return [s for s in samples if s.constructor_input.kwargs == first] or samples[:2]


def twin_pair(cls, module_input, backend, training):
    """torch.nn's module and rnnkern's twin on the same float64 weights."""
    args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
    theirs = cls(*args, **kwargs).to(torch.float64).train(training)
    ours = TWINS[cls](*args, backend=backend, **kwargs).to(torch.float64).train(training)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def leaves(result):
    """Tensors of a module's result (a PackedSequence counts as its data)."""
    return [t.data if isinstance(t, PackedSequence) else t
            for t in torch.utils._pytree.tree_leaves(
                result, is_leaf=lambda t: isinstance(t, PackedSequence))]


def forward_tensors(module_input):
    """The differentiable tensors among a sample's forward arguments."""
    return [t for t in leaves((module_input.forward_input.args, module_input.forward_input.kwargs))
            if isinstance(t, torch.Tensor) and t.requires_grad]


def run(m, module_input, args=None):
    fi = module_input.forward_input
    return m(*(fi.args if args is None else args), **fi.kwargs)


def outputs_and_grads(m, module_input, key, args=None):
    """Outputs, then gradients of the sample's tensors and of m's parameters
    under random cotangents (drawn from ``key``, the same for both modules)."""
    out = leaves(run(m, module_input, args))
    wrt = forward_tensors(module_input) if args is None else [
        t for t in leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt += list(m.parameters())
    g = generator("contract-cotangent", *key)
    cotangents = [randn(g, *o.shape) for o in out]
    grads = torch.autograd.grad(out, wrt, cotangents, allow_unused=True)
    return out, list(grads)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", list(TWINS), ids=CLASS_IDS)
def test_samples_match_torch_nn(cls, backend, training):
    """test_forward + test_memory_format of PyTorch, against torch.nn itself:
    the same outputs and gradients, the gradients in torch.nn's layout."""
    for i, module_input in enumerate(subset(cls, backend, sample_inputs(cls, training))):
        theirs, ours = twin_pair(cls, module_input, backend, training)
        want_out, want_grads = outputs_and_grads(theirs, module_input, (cls.__name__, i))
        got_out, got_grads = outputs_and_grads(ours, module_input, (cls.__name__, i))
        what = f"{cls.__name__} sample {i} {module_input.constructor_input.kwargs}"
        assert len(got_out) == len(want_out), what
        for k, (got, want) in enumerate(zip(got_out, want_out)):
            assert got.shape == want.shape and got.dtype == want.dtype, f"{what} output {k}"
            assert_close(got, want, what=f"{what} output {k}")
        for k, (got, want) in enumerate(zip(got_grads, want_grads)):
            assert (got is None) == (want is None), f"{what} gradient {k}"
            if want is None:
                continue
            assert_close(got, want, what=f"{what} gradient {k}")
            assert got.stride() == want.stride(), (
                f"{what} gradient {k}: strides {got.stride()}, torch.nn's {want.stride()}")
        fi = module_input.forward_input
        if module_input.reference_fn is not None and not isinstance(fi.args[0], PackedSequence):
            # The sample's own check: unbatched input == a batch of one (the
            # packed samples carry the same function but are batched already).
            expected = module_input.reference_fn(ours, *fi.args, **fi.kwargs)
            for got, want in zip(leaves(run(ours, module_input)), leaves(expected)):
                assert_close(got, want, what=f"{what} reference_fn")


def non_contiguous(t):
    """PyTorch's test_non_contiguous_tensors: the same values, every other element."""
    if isinstance(t, (tuple, list)):
        return type(t)(non_contiguous(u) for u in t)
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    out = torch.repeat_interleave(t, 2, dim=-1)[..., ::2].detach()
    return out.requires_grad_(t.requires_grad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", list(TWINS), ids=CLASS_IDS)
def test_non_contiguous_inputs(cls, backend):
    for i, module_input in enumerate(subset(cls, backend, sample_inputs(cls, True))):
        if any(isinstance(a, PackedSequence) for a in module_input.forward_input.args):
            continue  # a PackedSequence's data is made contiguous by packing
        _, ours = twin_pair(cls, module_input, backend, True)
        args = module_input.forward_input.args
        nc_args = non_contiguous(args)
        assert any(isinstance(t, torch.Tensor) and not t.is_contiguous() for t in leaves(nc_args))
        want_out, want_grads = outputs_and_grads(ours, module_input, ("nc", i), args=args)
        got_out, got_grads = outputs_and_grads(ours, module_input, ("nc", i), args=nc_args)
        for k, (got, want) in enumerate(zip(got_out + got_grads, want_out + want_grads)):
            assert_close(got, want, what=f"{cls.__name__} sample {i} result {k}")


def gradient_function(m, module_input):
    """(f, inputs) for gradcheck: f maps the sample's tensors and m's parameters
    to m's outputs, the parameters substituted by torch.func.functional_call."""
    fi = module_input.forward_input
    names = [n for n, _ in m.named_parameters()]
    flat, spec = torch.utils._pytree.tree_flatten(fi.args)
    tensor_at = [k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]

    def f(*tensors):
        flat_args = list(flat)
        for k, t in zip(tensor_at, tensors):
            flat_args[k] = t
        params = dict(zip(names, tensors[len(tensor_at):]))
        args = torch.utils._pytree.tree_unflatten(flat_args, spec)
        return tuple(leaves(torch.func.functional_call(m, params, args, fi.kwargs)))

    inputs = [flat[k] for k in tensor_at] + [p.detach().requires_grad_() for p in m.parameters()]
    return f, inputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", list(TWINS), ids=CLASS_IDS)
def test_gradcheck(cls, backend):
    """PyTorch's test_grad: float64 gradcheck w.r.t. input, states and weights."""
    for i, module_input in enumerate(subset(cls, backend, sample_inputs(cls, True))):
        _, ours = twin_pair(cls, module_input, backend, True)
        f, inputs = gradient_function(ours, module_input)
        assert torch.autograd.gradcheck(f, inputs, fast_mode=True), f"{cls.__name__} sample {i}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", list(TWINS), ids=CLASS_IDS)
def test_gradgradcheck(cls, backend):
    """PyTorch's test_gradgrad: float64 gradgradcheck (second derivatives: a
    gradient penalty, Hessian-vector products) w.r.t. input, states and weights.
    Every backend differentiates its backward through the same reference
    recomputation (rnnkern/ops.py), so all samples run on the default CPU
    backend and the first one on the others (each numerical Jacobian of a
    Jacobian reruns the module hundreds of times)."""
    samples = sample_inputs(cls, True)
    if backend != "cpu":
        samples = samples[:1]
    for i, module_input in enumerate(samples):
        _, ours = twin_pair(cls, module_input, backend, True)
        f, inputs = gradient_function(ours, module_input)
        assert torch.autograd.gradgradcheck(f, inputs, fast_mode=True), f"{cls.__name__} sample {i}"


def error_inputs(cls, dtype):
    info = INFOS[cls]
    return list(info.module_error_inputs_func(info, device="cpu", dtype=dtype,
                                              requires_grad=False, training=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", list(TWINS), ids=CLASS_IDS)
def test_error_inputs(cls, backend, dtype):
    """PyTorch's test_errors: each error input raises the same exception type
    as torch.nn, with a message matching torch.nn's (the error input's regex);
    torch.nn is run too, so a torch release that changes its own errors shows
    here rather than passing unnoticed.  PyTorch runs it for each dtype of the
    ModuleInfo: the inputs come in that dtype, the module is built in the
    default float32, so float64 inputs also meet a dtype mismatch, and the
    size errors must come first, as torch.nn's do."""
    cases = error_inputs(cls, dtype)
    assert cases
    for error_input in cases:
        module_input = error_input.module_error_input
        c = module_input.constructor_input
        for make in (lambda: cls(*c.args, **c.kwargs),
                     lambda: TWINS[cls](*c.args, backend=backend, **c.kwargs)):
            if error_input.error_on == ModuleErrorEnum.CONSTRUCTION_ERROR:
                with pytest.raises(error_input.error_type, match=error_input.error_regex):
                    make()
            else:
                m = make()
                fi = module_input.forward_input
                with pytest.raises(error_input.error_type, match=error_input.error_regex):
                    m(*fi.args, **fi.kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [nn.RNNCell, nn.GRUCell, nn.LSTMCell], ids=CLASS_IDS[3:])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_cell_of_hidden_size_zero(cls, backend, batched):
    """PyTorch's test_RNN_cell_forward_zero_hidden_size (and LSTMCell): empty
    states of torch.nn's shape, attached to the graph, gradients like torch.nn's."""
    g = generator("zero-hidden", cls.__name__, batched)
    x = randn(g, *((3, 10) if batched else (10,)), requires_grad=True)
    h = randn(g, *((3, 0) if batched else (0,)), requires_grad=True)
    hx = (h, h) if cls is nn.LSTMCell else h
    torch.manual_seed(0)
    theirs = cls(10, 0, dtype=torch.float64)
    ours = TWINS[cls](10, 0, backend=backend, dtype=torch.float64)
    results = []
    for m in (theirs, ours):
        out = leaves(m(x, hx))
        assert all(o.requires_grad for o in out)
        loss = sum(o.sum() for o in out) + (x * randn(generator("zero-hidden-x"), *x.shape)).sum()
        results.append(out + list(torch.autograd.grad(loss, [x, *m.parameters()])))
    for got, want in zip(*results):
        assert got.shape == want.shape
        assert_close(got, want, what=f"{cls.__name__} hidden_size=0")

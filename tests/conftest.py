"""Shared test machinery: NaN poisoning, the tolerance table, input builders.

The conventions every test follows:
- the reference (float64, or float32 for the half types) is the truth;
- every test draws fresh random inputs from a seeded generator, never zeros;
- every tensor allocated without being written is NaN (fixture below), so an
  output element that a kernel forgets to write fails the comparison;
- GPU tests carry the ``gpu`` marker and skip, with the reason, without a GPU.
"""
from __future__ import annotations

import os
import zlib

import pytest
import torch

# Without a GPU, the Triton kernels run on the CPU through Triton's interpreter
# (it must be chosen before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import rnnkern  # noqa: E402
from rnnkern import ops, reference, tolerance  # noqa: E402

CELLS = reference.CELLS

# pytest-xdist runs a worker per core (`./run test`: -n auto) and each worker's
# torch would use every core for its OpenMP threads, which spin at every small
# op's barrier while the other worker holds the core: on CI's two cores a
# float64 gradgradcheck of an LSTM recurrence took 60 s instead of 15.  Each
# worker gets its share of the cores; the thread tests set their own counts.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(min(torch.get_num_threads(),
                              max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

#: The tolerance table (rnnkern/tolerance.py, shared with rnnkern.check): relative
#: tolerance per dtype; half types are judged against the reference's own error.
TOL = tolerance.TOL

HAS_GPU = torch.cuda.is_available()
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _patch_triton_language_once_per_launch() -> None:
    """Triton's interpreter (3.6, 3.8) swaps triton.language's builtins for
    numpy ones at each launch (GridExecutor.__call__) and again at every call of
    a @triton.jit function inside it (InterpretedFunction.__call__: tl.sum,
    tl.zeros, ...): the same swap each time, by inspect.getmembers over the
    modules, ~2 ms.  A kernel calls tl.sum per step and per program, so that
    repetition took a large share of the interpreted tests' time.  Here a call
    inside a launch skips the swap when that launch has already made it for the
    same modules (triton.language, triton.language.core); the functions swapped
    in are the same, so what the kernels compute is unchanged."""
    if not TRITON_INTERPRET:
        return
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    real_patch = getattr(interpreter, "_patch_lang", None)
    launch = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    if real_patch is None or launch is None or getattr(real_patch, "_rnnkern_once", False):
        return  # another interpreter than the one this was written against: leave it as it is
    swapped: list[set[int]] = []  # per launch running: the modules swapped so far

    class NothingToRestore:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if langs and swapped and langs <= swapped[-1]:
            return NothingToRestore()
        scope = real_patch(fn)
        if swapped:
            swapped[-1] |= langs
        return scope

    def launch_once(self, *args, **kwargs):
        swapped.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            swapped.pop()

    patch_lang._rnnkern_once = True
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch_once


_patch_triton_language_once_per_launch()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def poison_uninitialized_memory():
    """Makes torch.empty (also inside the C++ kernels, which allocate through
    aten::empty) return NaN-filled memory for the duration of each test."""
    det, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.use_deterministic_algorithms(det, warn_only=warn)


def generator(*key) -> torch.Generator:
    """A generator seeded from the test's parameters: fresh data per case, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(g: torch.Generator, *shape, dtype=torch.float64, scale=1.0, requires_grad=False):
    t = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def assert_close(actual, expected, dtype=None, what=""):
    """|actual - expected| <= tol * (max(1, max|expected|) + |expected|), tol from TOL."""
    rtol, atol = tolerance.close_tolerances(expected, dtype or expected.dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def assert_low_precision(actual, reference_lp, reference_hp, what="", factor=tolerance.LOW_PRECISION_FACTOR):
    """Half-precision result against a float32/64 reference: its error may be at
    most `factor` times the error of the reference itself run in low precision
    (flash-attention's criterion).  Errors are Frobenius norms: one rounding that
    flips a ReLU mask moves a single element a lot in either computation."""
    allowed = tolerance.low_precision_allowance(reference_lp, reference_hp, factor)
    err = (actual.detach().double() - reference_hp.detach().double()).norm().item()
    assert err <= allowed, f"{what}: error {err:.3e} > {factor} x reference's own error (+ floor) = {allowed:.3e}"


def inference_through_from_input(monkeypatch, module, x):
    """module(x) under no_grad, its outputs as tensors (pytree leaves), and the
    number of ops.run_recurrence_from_input calls it made (one per layer and
    direction where the modules take that op)."""
    calls = []
    real = ops.run_recurrence_from_input
    monkeypatch.setattr(ops, "run_recurrence_from_input", lambda *a: calls.append(a[0]) or real(*a))
    with torch.no_grad():
        out = torch.utils._pytree.tree_leaves(module(x))
    monkeypatch.setattr(ops, "run_recurrence_from_input", real)
    return out, len(calls)


def recurrence_inputs(cell, T, B, H, *, dtype=torch.float64, proj=0, bias=True,
                      requires_grad=False, key=()):
    """Random arguments for rnnkern.ops.recurrence: a dict of tensors.

    Weights are scaled by 1/sqrt(H) (torch.nn's init range) so that long
    sequences stay in a numerically meaningful regime; states are non-zero."""
    g = generator(cell, T, B, H, str(dtype), proj, bias, *key)
    G = reference.gate_count(cell)
    P = proj or H
    s = H ** -0.5
    rg = requires_grad
    return dict(
        xproj=randn(g, T, B, G * H, dtype=dtype, requires_grad=rg),
        h0=randn(g, B, P, dtype=dtype, scale=0.5, requires_grad=rg),
        c0=randn(g, B, H, dtype=dtype, scale=0.5, requires_grad=rg) if cell == "lstm" else None,
        w_hh=randn(g, G * H, P, dtype=dtype, scale=s, requires_grad=rg),
        b_ih=randn(g, G * H, dtype=dtype, scale=s, requires_grad=rg) if bias else None,
        b_hh=randn(g, G * H, dtype=dtype, scale=s, requires_grad=rg) if bias else None,
        w_hr=randn(g, P, H, dtype=dtype, scale=s, requires_grad=rg) if proj else None,
    )


def step_inputs(cell, B, I, H, *, dtype=torch.float64, bias=True, requires_grad=False, key=()):
    """Random arguments for rnnkern.ops.step."""
    g = generator("step", cell, B, I, H, str(dtype), bias, *key)
    G = reference.gate_count(cell)
    s = H ** -0.5
    rg = requires_grad
    return dict(
        x=randn(g, B, I, dtype=dtype, requires_grad=rg),
        h=randn(g, B, H, dtype=dtype, scale=0.5, requires_grad=rg),
        c=randn(g, B, H, dtype=dtype, scale=0.5, requires_grad=rg) if cell == "lstm" else None,
        w_ih=randn(g, G * H, I, dtype=dtype, scale=s, requires_grad=rg),
        w_hh=randn(g, G * H, H, dtype=dtype, scale=s, requires_grad=rg),
        b_ih=randn(g, G * H, dtype=dtype, scale=s, requires_grad=rg) if bias else None,
        b_hh=randn(g, G * H, dtype=dtype, scale=s, requires_grad=rg) if bias else None,
    )


def to_device(args, device):
    """A copy of an inputs dict on `device`, leaves again (requires_grad kept)."""
    return {k: None if v is None else v.detach().to(device).requires_grad_(v.requires_grad)
            for k, v in args.items()}


def run_recurrence(backend, cell, args, lengths=None, reverse=False):
    """rnnkern.ops.recurrence on a recurrence_inputs dict."""
    return ops.recurrence(cell, args["xproj"], args["h0"], args["c0"], args["w_hh"], args["b_ih"],
                          args["b_hh"], args["w_hr"], lengths, reverse, backend=backend)


def differentiable(args):
    return [name for name, t in args.items() if t is not None]


def outputs_and_grads(backend, cell, args, lengths=None, reverse=False, key=()):
    """Outputs, final states and the gradients of every input under a random
    linear functional of all outputs (the cotangents drawn on the CPU)."""
    out = [t for t in run_recurrence(backend, cell, args, lengths, reverse) if t is not None]
    g = generator("cotangent", *key)
    loss = sum((o * randn(g, *o.shape, dtype=o.dtype).to(o.device)).sum() for o in out)
    names = differentiable(args)
    grads = torch.autograd.grad(loss, [args[n] for n in names])
    return dict(zip(["output", "h_n", "c_n"], out)) | {f"grad_{n}": gr for n, gr in zip(names, grads)}


def step_outputs_and_grads(backend, cell, args, key=()):
    """rnnkern.ops.step on a step_inputs dict: h_new, c_new and the gradients of
    every input under a random linear functional of both."""
    h, c = ops.step(cell, args["x"], args["h"], args["c"], args["w_ih"], args["w_hh"],
                    args["b_ih"], args["b_hh"], backend=backend)
    out = [t for t in (h, c) if t is not None]
    g = generator("step-cotangent", *key)
    loss = sum((o * randn(g, *o.shape, dtype=o.dtype)).sum() for o in out)
    names = differentiable(args)
    grads = torch.autograd.grad(loss, [args[n] for n in names])
    return dict(zip(["h_new", "c_new"], out)) | {f"grad_{n}": gr for n, gr in zip(names, grads)}


def assert_half_step_within_reference_error(cell, B, I, H, dtype, key=()):
    """One step of the CPU backend in a half type: h_new, c_new and every gradient
    finite, in that dtype, and within twice the reference's own error in it."""
    args = step_inputs(cell, B, I, H, dtype=dtype, key=key)
    low = {k: None if v is None else v.requires_grad_() for k, v in args.items()}
    high = {k: None if v is None else v.detach().float().requires_grad_() for k, v in args.items()}
    key = (*key, cell, B, I, H)
    want = step_outputs_and_grads("reference", cell, high, key)
    ref_low = step_outputs_and_grads("reference", cell, low, key)
    got = step_outputs_and_grads("cpu", cell, low, key)
    for name in want:
        assert got[name].dtype == dtype, name
        assert torch.isfinite(got[name]).all(), name
        assert_low_precision(got[name], ref_low[name], want[name], what=name)


def torch_module(cell, input_size, hidden_size, **kwargs):
    """The torch.nn module computing `cell` (None for gru_reset_before, which torch lacks)."""
    if cell == "lstm":
        return torch.nn.LSTM(input_size, hidden_size, **kwargs)
    if cell == "gru":
        return torch.nn.GRU(input_size, hidden_size, **kwargs)
    if cell in ("rnn_tanh", "rnn_relu"):
        return torch.nn.RNN(input_size, hidden_size, nonlinearity=cell[4:], **kwargs)
    return None


def rnnkern_module(cell, input_size, hidden_size, **kwargs):
    if cell == "lstm":
        return rnnkern.LSTM(input_size, hidden_size, **kwargs)
    if cell in ("gru", "gru_reset_before"):
        return rnnkern.GRU(input_size, hidden_size, reset_after=cell == "gru", **kwargs)
    return rnnkern.RNN(input_size, hidden_size, nonlinearity=cell[4:], **kwargs)

def require_cuda_emulation() -> None:
    """At a module's top: skip it without the emulated CUDA device, with the reason
    (an error instead under RNNKERN_REQUIRE_CUDA_EMULATION=1, as in CI)."""
    from rnnkern import ops
    if not ops.WITH_CUDA_EMULATION:
        if os.environ.get("RNNKERN_REQUIRE_CUDA_EMULATION") == "1":
            raise RuntimeError("RNNKERN_REQUIRE_CUDA_EMULATION=1 but rnnkern was built without the "
                               "emulated CUDA device: rebuild with RNNKERN_CUDA_EMULATION=1")
        pytest.skip("rnnkern was built without the emulated CUDA device (RNNKERN_CUDA_EMULATION=1)",
                    allow_module_level=True)


def force_triton_path(monkeypatch, path: str) -> None:
    """Runs the Triton recurrence on one path for the rest of a test: "loop" and
    "step" are forced (rnnkern.triton.ops.PATH); "spread" is the automatic
    choice with no room on chip, so the cells a spread kernel runs take it and
    LSTM-LN the per-step path, as beyond the on-chip limit on a GPU."""
    from rnnkern.triton import ops as triton_ops
    if path == "spread":
        monkeypatch.setattr(triton_ops, "PATH", "auto")
        monkeypatch.setattr(triton_ops, "fits_on_chip", lambda *args, **kwargs: False)
    else:
        monkeypatch.setattr(triton_ops, "PATH", path)

"""One case of the self-check: the problem (a differentiable function, its
inputs drawn per case, a cotangent per output), the float64 truth (the
reference) or torch.nn's twin, and the comparison under the test suite's
tolerance table (:mod:`rnnkern.tolerance`); the numerics every case runs under."""
from __future__ import annotations

import contextlib
import math
import time
import traceback
import warnings
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.nn.utils.rnn import pack_padded_sequence

from .. import modules, ops, reference
from ..tolerance import TOL, close_error, low_precision_allowance
from .matrix import SIZES, Case, Target, dtype_name

def _generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _draw(g: torch.Generator, *shape, dtype: torch.dtype, scale: float = 1.0) -> Tensor:
    """Random values on the CPU, representable in ``dtype`` (so every dtype's run
    and the float64 truth see the same numbers)."""
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


@dataclass
class Problem:
    """A differentiable function and its inputs: the leaves (drawn in the case's
    dtype, on the CPU) and a cotangent per output."""
    run: Callable[[str, dict], dict]  # (backend, leaves on the device) -> outputs
    leaves: dict
    cotangents: dict


def _sequence_problem(case: Case) -> Problem:
    s = SIZES[case.size]
    g = _generator(case.op, case.cell, case.proj, str(case.dtype), case.size, case.variant)
    G, H, d = reference.gate_count(case.cell), s.H, case.dtype
    P = s.P if case.proj else H
    w = H ** -0.5  # torch.nn's init range keeps long sequences in a meaningful regime
    lstm = case.cell == "lstm"
    leaves = {"xproj": _draw(g, s.T, s.B, G * H, dtype=d), "h0": _draw(g, s.B, P, dtype=d, scale=0.5)}
    if lstm:
        leaves["c0"] = _draw(g, s.B, H, dtype=d, scale=0.5)
    leaves |= {"w_hh": _draw(g, G * H, P, dtype=d, scale=w), "b_ih": _draw(g, G * H, dtype=d, scale=w),
               "b_hh": _draw(g, G * H, dtype=d, scale=w)}
    if case.proj:
        leaves["w_hr"] = _draw(g, P, H, dtype=d, scale=w)
    cot = {"output": _draw(g, s.T, s.B, P, dtype=d), "h_n": _draw(g, s.B, P, dtype=d)}
    if lstm:
        cot["c_n"] = _draw(g, s.B, H, dtype=d)
    lengths = torch.tensor(s.lengths) if "lengths" in case.variant else None
    reverse = "reverse" in case.variant

    def run(backend, a):
        out, h_n, c_n = ops.recurrence(case.cell, a["xproj"], a["h0"], a.get("c0"), a["w_hh"], a["b_ih"],
                                       a["b_hh"], a.get("w_hr"), lengths, reverse, backend=backend)
        return {"output": out, "h_n": h_n} | ({"c_n": c_n} if lstm else {})

    return Problem(run, leaves, cot)


def _step_problem(case: Case) -> Problem:
    s = SIZES[case.size]
    g = _generator(case.op, case.cell, str(case.dtype), case.size)
    G, H, d = reference.gate_count(case.cell), s.H, case.dtype
    w = H ** -0.5
    lstm = case.cell == "lstm"
    leaves = {"x": _draw(g, s.B, s.I, dtype=d), "h": _draw(g, s.B, H, dtype=d, scale=0.5)}
    if lstm:
        leaves["c"] = _draw(g, s.B, H, dtype=d, scale=0.5)
    leaves |= {"w_ih": _draw(g, G * H, s.I, dtype=d, scale=w), "w_hh": _draw(g, G * H, H, dtype=d, scale=w),
               "b_ih": _draw(g, G * H, dtype=d, scale=w), "b_hh": _draw(g, G * H, dtype=d, scale=w)}
    cot = {"h_new": _draw(g, s.B, H, dtype=d)} | ({"c_new": _draw(g, s.B, H, dtype=d)} if lstm else {})

    def run(backend, a):
        h, c = ops.step(case.cell, a["x"], a["h"], a.get("c"), a["w_ih"], a["w_hh"], a["b_ih"], a["b_hh"],
                        backend=backend)
        return {"h_new": h} | ({"c_new": c} if lstm else {})

    return Problem(run, leaves, cot)


def _evaluate(problem: Problem, backend: str, device: torch.device, dtype: torch.dtype,
              params: Optional[dict] = None) -> dict:
    """Outputs and the gradients of every leaf (and of ``params``, leaves already
    on the device) under ``sum(output * cotangent)``, moved to the CPU."""
    args = {k: v.to(device, dtype).requires_grad_() for k, v in problem.leaves.items()}
    outs = problem.run(backend, args)
    loss = sum((o * problem.cotangents[n].to(o.device, o.dtype)).sum() for n, o in outs.items())
    wrt = args | (params or {})
    grads = torch.autograd.grad(loss, list(wrt.values()))
    results = outs | {f"grad_{n}": gr for n, gr in zip(wrt, grads)}
    return {k: v.detach().cpu() for k, v in results.items()}


def _twins(cell: str, op: str):
    """(torch.nn class, rnnkern class, keyword arguments) of a cell's sequence
    module (op "module") or single-step cell (op "cell")."""
    kw = {"nonlinearity": cell[4:]} if cell.startswith("rnn_") else {}
    if op == "cell":
        classes = {"lstm": (torch.nn.LSTMCell, modules.LSTMCell), "gru": (torch.nn.GRUCell, modules.GRUCell)}
        return *classes.get(cell, (torch.nn.RNNCell, modules.RNNCell)), kw
    classes = {"lstm": (torch.nn.LSTM, modules.LSTM), "gru": (torch.nn.GRU, modules.GRU)}
    return *classes.get(cell, (torch.nn.RNN, modules.RNN)), kw


def _module_pair(cell: str, op: str, I: int, H: int, backend: str, device: torch.device,  # noqa: E741
                 dtype: torch.dtype, g: torch.Generator, **kwargs):
    """(torch.nn's module, rnnkern's) with the same random weights."""
    theirs_cls, ours_cls, kw = _twins(cell, op)
    theirs = theirs_cls(I, H, **kw, **kwargs)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(_draw(g, *p.shape, dtype=p.dtype, scale=H ** -0.5))
    ours = ours_cls(I, H, backend=backend, **kw, **kwargs)
    ours.load_state_dict(theirs.state_dict())
    return theirs.to(device, dtype), ours.to(device, dtype)


def _case_modules(case: Case, backend: str, device: torch.device):
    """The module pair of a "module" case (packed, bidirectional; with a projection
    for the projected LSTM) or a "cell" case."""
    s = SIZES[case.size]
    kwargs = {} if case.op == "cell" else {"bidirectional": True}
    if case.proj:
        kwargs["proj_size"] = s.P
    g = _generator(case.op, case.cell, case.proj, case.size, "weights")
    return _module_pair(case.cell, case.op, s.I, s.H, backend, device, case.dtype, g, **kwargs)


def _module_problem(case: Case, module) -> Problem:
    """The module (a torch.nn one or its rnnkern twin) on random input: a packed
    batch for the sequence modules, one step for the cells."""
    s = SIZES[case.size]
    g = _generator(case.op, case.cell, case.proj, case.size, "inputs")
    d, H = case.dtype, s.H
    lstm = case.cell == "lstm"
    if case.op == "cell":
        leaves = {"input": _draw(g, s.B, s.I, dtype=d), "h0": _draw(g, s.B, H, dtype=d, scale=0.5)}
        if lstm:
            leaves["c0"] = _draw(g, s.B, H, dtype=d, scale=0.5)
        cot = {"h": _draw(g, s.B, H, dtype=d)} | ({"c": _draw(g, s.B, H, dtype=d)} if lstm else {})

        def run(_backend, a):
            out = module(a["input"], (a["h0"], a["c0"]) if lstm else a["h0"])
            return {"h": out[0], "c": out[1]} if lstm else {"h": out}

        return Problem(run, leaves, cot)
    P = s.P if case.proj else H
    lengths = torch.tensor([max(1, n) for n in s.lengths])  # packing needs every length >= 1
    leaves = {"input": _draw(g, s.T, s.B, s.I, dtype=d), "h0": _draw(g, 2, s.B, P, dtype=d, scale=0.5)}
    if lstm:
        leaves["c0"] = _draw(g, 2, s.B, H, dtype=d, scale=0.5)
    cot = {"output": _draw(g, int(lengths.sum()), 2 * P, dtype=d), "h_n": _draw(g, 2, s.B, P, dtype=d)}
    if lstm:
        cot["c_n"] = _draw(g, 2, s.B, H, dtype=d)

    def run(_backend, a):
        packed = pack_padded_sequence(a["input"], lengths, enforce_sorted=False)
        out, hidden = module(packed, (a["h0"], a["c0"]) if lstm else a["h0"])
        if lstm:
            return {"output": out.data, "h_n": hidden[0], "c_n": hidden[1]}
        return {"output": out.data, "h_n": hidden}

    return Problem(run, leaves, cot)


def _compare(got: dict, want: dict, dtype: torch.dtype, low_precision_ref: Optional[dict]) -> list[dict]:
    """Per tensor: error and allowed error.  float64/float32: close_error against
    TOL; half types: Frobenius error relative to |want|, allowed twice the
    reference's own low-precision error (low_precision_ref) plus one rounding
    to the dtype (see tolerance.low_precision_allowance)."""
    rows = []
    for name, w in want.items():
        a = got.get(name)
        row = {"tensor": name, "error": math.inf, "allowed": TOL.get(dtype, 0.0)}
        if a is None:
            row["problem"] = "missing from the results"
        elif a.shape != w.shape or a.dtype != dtype:
            row["problem"] = (f"got shape {list(a.shape)} {a.dtype}, expected {list(w.shape)} {dtype}")
        elif dtype in TOL:
            row["error"] = close_error(a, w, dtype)
        else:
            norm = w.double().norm().item() or 1.0
            row["error"] = (a.double() - w.double()).norm().item() / norm
            row["allowed"] = low_precision_allowance(low_precision_ref[name], w, rounding=dtype) / norm
        if not math.isfinite(row["error"]):
            row["error"] = math.inf
        rows.append(row)
    return rows


def _ratio(row: dict) -> float:
    """How much of its allowance a tensor's error uses (above 1 fails)."""
    return row["error"] / row["allowed"] if row["allowed"] else math.inf


class Checker:
    """Runs cases, caching the float64 truth (and the reference in low precision),
    which does not depend on the backend under test."""

    def __init__(self):
        self._truth: dict = {}

    def _reference(self, case: Case, problem: Problem, dtype: torch.dtype) -> dict:
        key = (case, dtype)
        if key not in self._truth:
            with one_thread():
                self._truth[key] = _evaluate(problem, "reference", torch.device("cpu"), dtype)
        return self._truth[key]

    def run(self, target: Target, case: Case) -> dict:
        """One case on one backend: a JSON-ready record, ``ok`` saying whether it passed."""
        with contextlib.nullcontext() if target.backend == "cpu" else one_thread():
            return self._run(target, case)

    def _run(self, target: Target, case: Case) -> dict:
        start = time.perf_counter()
        record = {"op": case.op, "cell": case.cell, "proj": case.proj, "dtype": dtype_name(case.dtype),
                  "size": case.size, "variant": case.variant or None,
                  "against": "torch.nn" if case.op in ("module", "cell") else "reference float64"}
        try:
            if case.op in ("module", "cell"):
                theirs, ours = _case_modules(case, target.backend, target.device)
                want = _evaluate(_module_problem(case, theirs), "torch.nn", target.device, case.dtype,
                                 dict(theirs.named_parameters()))
                got = _evaluate(_module_problem(case, ours), target.backend, target.device, case.dtype,
                                dict(ours.named_parameters()))
                rows = _compare(got, want, case.dtype, None)
            else:
                problem = (_sequence_problem if case.op == "sequence" else _step_problem)(case)
                want = self._reference(case, problem, torch.float64)
                lp = self._reference(case, problem, case.dtype) if case.dtype not in TOL else None
                got = _evaluate(problem, target.backend, target.device, case.dtype)
                rows = _compare(got, want, case.dtype, lp)
            worst = max(rows, key=_ratio)
            record |= {"ok": all(r["error"] <= r["allowed"] for r in rows), "worst": worst, "tensors": rows}
        except Exception as e:  # a crash is a failed check: reported with its evidence, never hidden
            record |= {"ok": False, "worst": None, "exception": f"{type(e).__name__}: {e}"[:2000],
                       "traceback": traceback.format_exc()[-4000:]}
        record["seconds"] = round(time.perf_counter() - start, 4)
        return record


@contextlib.contextmanager
def one_thread():
    """torch on one CPU thread, for everything but the cpu backend's kernels (whose
    split of work between threads is part of what is checked): the small ops of
    the truth, the reference backend and the Triton interpreter gain nothing from
    more threads, and on a busy machine a thread team waiting for a descheduled
    member made them up to 100x slower (a 2-core VM at load 7)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def strict_numerics():
    """While the correctness cases run: every tensor allocated without being
    written is NaN (torch's fill_uninitialized_memory, which needs deterministic
    mode; warn_only keeps ops without a deterministic implementation running), so
    an output element a kernel forgets to write fails; float32 without TF32 in
    matmuls and cuDNN.  The user's settings come back afterwards."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cuda.matmul.allow_tf32)
    cudnn = torch.backends.cudnn
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        # cuDNN's flags through its context manager: a plain assignment raises
        # once torch's test utilities have frozen the flags (as in PyTorch's suite).
        with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark,
                         deterministic=cudnn.deterministic, allow_tf32=False), \
                warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deterministic.*")
            yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]
        torch.backends.cuda.matmul.allow_tf32 = saved[3]

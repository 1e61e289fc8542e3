"""The field self-check: ``python -m rnnkern.check`` (or ``rnnkern.check()``).

No GPU was available while rnnkern's CUDA and Triton kernels were written, so
the first machines they run on are its users'.  This module runs every backend
that can run on the machine through a compact matrix and says whether each one
computes what it should:

- the ops (:func:`rnnkern.ops.recurrence`, :func:`rnnkern.ops.step`), forward
  and backward, every cell and GRU form and the LSTM projection, in float64,
  float32, bfloat16 and float16, with and without variable lengths (in
  reverse), against :mod:`rnnkern.reference` run in float64 on the CPU;
- the modules (packed, bidirectional) and cells, float32, against torch.nn on
  the same weights;

with the tolerance table of the test suite (:mod:`rnnkern.tolerance`).  Then a
quick speed comparison with torch.nn at one size per cell, and a JSON report a
user can attach to a bug report.  A backend that fails comes with the backend
to use instead.

The schema of the JSON report is documented in README.md ("Field self-check").
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import types
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TextIO

import torch
from torch import Tensor
from torch.nn.utils.rnn import pack_padded_sequence

from . import _C, __version__, modules, ops, reference
from .tolerance import TOL, close_error, low_precision_allowance

__all__ = ["check", "main", "SCHEMA"]

#: Identifies the layout of the JSON report (README.md documents it).
SCHEMA = "rnnkern.check/1"

#: The cells torch.nn has (gru_reset_before has no twin there).
TORCH_CELLS = ("rnn_tanh", "rnn_relu", "lstm", "gru")

#: (cell, with LSTM projection) of the op cases: every cell and GRU form, and the projected LSTM.
SEQUENCE_CELLS = [(cell, False) for cell in reference.CELLS] + [("lstm", True)]

#: Backends to recommend instead of a failing one, best first, per device type.
#: The Triton interpreter is never one: it is a CPU test vehicle, not a way to run models.
PREFERENCE = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpu", "reference")}

WHERE_TO_REPORT = "open an issue on the project's tracker with the JSON report attached"


# ------------------------------------------------------------ the matrix ----

@dataclass(frozen=True)
class Size:
    T: int
    B: int
    I: int  # noqa: E741  (the input size, as in the formulas)
    H: int
    P: int  # projection size of the projected LSTM
    lengths: tuple  # one per sequence, one of them 0 (the modules, which pack, use at least 1)

    def label(self) -> str:
        return f"T={self.T} B={self.B} I={self.I} H={self.H} P={self.P}"


SIZES = {
    # Odd sizes that are multiples of nothing.
    "small": Size(T=9, B=5, I=7, H=37, P=11, lengths=(9, 3, 0, 7, 1)),
    # Under Triton's interpreter (~0.3 ms per block operation; its blocks are 4
    # wide, rnnkern/triton/tuning.py, so this still runs several tiles with tails).
    "tiny": Size(T=4, B=3, I=5, H=6, P=5, lengths=(4, 1, 0)),
    # float32 only: large enough for the GPU kernels' multi-block and per-step
    # paths (the Triton time loop holds W_hh on chip only up to H = 64..256).
    "large": Size(T=10, B=20, I=64, H=257, P=96,
                  lengths=(10, 1, 0, 7, 10, 5, 2, 9, 3, 10, 6, 8, 4, 10, 1, 7, 9, 2, 10, 5)),
}

#: What each op of the matrix runs and what it is compared with.
OPS = {
    "sequence": "ops.recurrence fwd+bwd vs float64 reference",
    "step": "ops.step fwd+bwd vs float64 reference",
    "module": "modules (packed, bidir.) vs torch.nn",
    "cell": "cells vs torch.nn",
}


@dataclass(frozen=True)
class Case:
    op: str  # a key of OPS
    cell: str  # a reference.CELLS name
    dtype: torch.dtype
    size: str  # a key of SIZES
    proj: bool = False
    variant: str = ""  # sequence: "plain" (no lengths, forward) or "lengths-reverse"

    @property
    def name(self) -> str:
        return self.cell + ("+proj" if self.proj else "") + (f" {self.variant}" if self.variant else "")


@dataclass
class Target:
    """One backend on one device, and how it is checked there."""
    backend: str
    device: torch.device
    interpreted: bool = False  # Triton on the CPU through TRITON_INTERPRET=1
    dtypes: tuple = (torch.float64, torch.float32, torch.bfloat16, torch.float16)

    @property
    def size(self) -> str:
        return "tiny" if self.interpreted else "small"

    def label(self) -> str:
        how = ", Triton interpreter (TRITON_INTERPRET=1): tiny sizes, no speed" if self.interpreted else ""
        return f"{self.backend} on {self.device.type}{how}"


def plan(target: Target, quick: bool) -> list[Case]:
    """The cases one backend runs: every cell in every dtype (--quick: float32 and
    bfloat16, variable lengths in reverse only), the torch.nn comparisons in
    float32, and the large size in float32 with lengths in reverse (not with
    --quick, not under the interpreter, not for the reference, which has no
    size-dependent paths)."""
    dtypes = [d for d in target.dtypes if not quick or d in (torch.float32, torch.bfloat16)]
    variants = ("lengths-reverse",) if quick else ("plain", "lengths-reverse")
    cases = []
    for dtype in dtypes:
        cases += [Case("sequence", cell, dtype, target.size, proj, v)
                  for cell, proj in SEQUENCE_CELLS for v in variants]
        cases += [Case("step", cell, dtype, target.size) for cell in reference.CELLS]
    if not quick and not target.interpreted and target.backend != "reference":
        f32 = torch.float32
        cases += [Case("sequence", cell, f32, "large", proj, "lengths-reverse") for cell, proj in SEQUENCE_CELLS]
        cases += [Case("step", cell, f32, "large") for cell in reference.CELLS]
    cases += [Case("module", cell, torch.float32, target.size) for cell in TORCH_CELLS]
    cases += [Case("module", "lstm", torch.float32, target.size, proj=True)]
    cases += [Case("cell", cell, torch.float32, target.size) for cell in TORCH_CELLS]
    return cases


# ------------------------------------------------------------ the backends ----

def _triton_reason() -> Optional[str]:
    """Why the Triton backend cannot run here (None when it can)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"the triton package is not installed ({e}); pip install triton"
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return ("no CUDA GPU visible; set TRITON_INTERPRET=1 (before Python starts) to check it "
            "on the CPU through Triton's interpreter (slow)")


def select_targets(backends: Optional[list] = None) -> tuple[list[Target], dict[str, str]]:
    """The targets to check: ``backends`` (names), or every backend this machine
    can run; and why the others are not run.  ValueError for a name that is not
    a backend or cannot run here."""
    runnable, missing = targets()
    if backends is None:
        return runnable, missing
    for name in backends:
        if name not in ops.BACKENDS or name == "auto":
            raise ValueError(f"backends: unknown backend {name!r}; expected some of "
                             f"{', '.join(b for b in ops.BACKENDS if b != 'auto')}")
        if name in missing:
            raise ValueError(f"backends: {name!r} cannot run on this machine: {missing[name]}")
    return [t for t in runnable if t.backend in backends], {}


def targets() -> tuple[list[Target], dict[str, str]]:
    """The backends this machine can run, and why the others cannot."""
    gpu = torch.cuda.is_available()
    cuda = torch.device("cuda") if gpu else None
    cpu = torch.device("cpu")
    runnable = [Target("reference", cuda or cpu), Target("cpu", cpu)]
    missing = {}
    if not gpu:
        missing["cuda"] = "no CUDA GPU visible (torch.cuda.is_available() is False)"
    elif not ops.WITH_CUDA:
        missing["cuda"] = ("rnnkern was built without its CUDA kernels (nvcc or a CUDA build of torch "
                           "was missing at build time)")
    else:
        runnable.append(Target("cuda", cuda))
    reason = _triton_reason()
    if reason:
        missing["triton"] = reason
    elif gpu:
        # float64 runs only under the interpreter (README: "What works today").
        runnable.append(Target("triton", cuda, dtypes=(torch.float32, torch.bfloat16, torch.float16)))
    else:
        # The interpreter costs ~0.3 ms per block operation: float32 and bfloat16
        # only (tests/test_triton.py covers float64 and float16 there).
        runnable.append(Target("triton", cpu, interpreted=True, dtypes=(torch.float32, torch.bfloat16)))
    return runnable, missing


# ------------------------------------------------------------ one case ----

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
        record = {"op": case.op, "cell": case.cell, "proj": case.proj, "dtype": _dtype_name(case.dtype),
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


# ------------------------------------------------------------ speed ----

#: One representative size per device type: float32 on the CPU, bfloat16 (what
#: models train in) on a GPU.  One layer, one direction, I = H.
#: Each phase of each cell: ``warmup`` calls, then up to ``repeats`` interleaved
#: rounds, fewer when one round would take more than ``budget_s`` in all.
SPEED = {"cpu": {"B": 32, "T": 128, "H": 256, "dtype": torch.float32, "warmup": 1, "repeats": 3, "budget_s": 0.75},
         "cuda": {"B": 64, "T": 256, "H": 512, "dtype": torch.bfloat16, "warmup": 3, "repeats": 20, "budget_s": 1.0}}


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _timed_phases(m: torch.nn.Module, x: Tensor, x_g: Tensor, grad: Tensor) -> dict:
    """The two phases timed: inference, and a training step's forward + backward."""
    params = list(m.parameters())

    def forward():
        with torch.no_grad():
            m(x)

    def forward_backward():
        torch.autograd.grad(m(x_g)[0], [x_g, *params], grad)

    return {"forward": forward, "forward_backward": forward_backward}


def speed(target: Target) -> dict:
    """Median time of torch.nn and of the backend, forward (inference) and
    forward + backward, per torch.nn cell, timed interleaved on the same inputs."""
    cfg = SPEED[target.device.type]
    B, T, H, dtype, device = cfg["B"], cfg["T"], cfg["H"], cfg["dtype"], target.device
    g = _generator("speed", B, T, H)
    x = _draw(g, T, B, H, dtype=dtype).to(device)
    x_g = x.clone().requires_grad_()
    grad = _draw(g, T, B, H, dtype=dtype).to(device)
    result = {"size": {"B": B, "T": T, "I": H, "H": H}, "dtype": _dtype_name(dtype),
              "max_repeats": cfg["repeats"], "statistic": "median", "cells": {}}
    for cell in TORCH_CELLS:
        theirs, ours = _module_pair(cell, "module", H, H, target.backend, device, dtype, g)
        runs = {"torch.nn": _timed_phases(theirs, x, x_g, grad), "rnnkern": _timed_phases(ours, x, x_g, grad)}
        ms, repeats = {who: {} for who in runs}, {}
        for phase in ("forward", "forward_backward"):
            for _ in range(cfg["warmup"]):
                round_s = sum(_seconds(runs[who][phase], device) for who in runs)
            repeats[phase] = max(1, min(cfg["repeats"], int(cfg["budget_s"] / round_s)))
            samples = {who: [] for who in runs}
            for r in range(repeats[phase]):
                for who in (list(runs) if r % 2 == 0 else list(runs)[::-1]):  # alternate who goes first
                    samples[who].append(_seconds(runs[who][phase], device))
            for who in runs:
                ms[who][phase] = 1e3 * statistics.median(samples[who])
        result["cells"][cell] = {"torch_nn_ms": ms["torch.nn"], "rnnkern_ms": ms["rnnkern"],
                                 "speedup": {p: ms["torch.nn"][p] / ms["rnnkern"][p] for p in ms["rnnkern"]},
                                 "repeats": repeats}
    return result


# ------------------------------------------------------------ environment ----

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _package_version(name: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _cpu_info() -> dict:
    """Model and the ISA extensions rnnkern's CPU kernels dispatch on (Linux's
    /proc/cpuinfo; elsewhere only what platform and torch tell)."""
    model, flags = None, None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and flags is None:
                flags = set(value.split())
    except OSError:
        pass  # not Linux: the model from platform, the ISA unknown
    model = model or platform.processor() or platform.machine()
    isa = None if flags is None else sorted(f for f in flags if f in (
        "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
        "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile"))
    return {"model": model, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "isa": isa, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "rnnkern_cpu_isa": _C.cpu_isa()}


def _gpu_info() -> Optional[dict]:
    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(0)
    driver = None
    try:
        run = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=20)
        driver = run.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        driver = None  # no nvidia-smi (a container without it): the driver stays unknown
    return {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2 ** 30, 1), "count": torch.cuda.device_count(),
            "driver": driver}


def _git_commit() -> Optional[str]:
    """The commit of a source checkout rnnkern runs from (None for an installed copy)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        run = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip() or None


def environment() -> dict:
    return {
        "rnnkern": __version__, "rnnkern_path": str(Path(__file__).resolve().parent), "git": _git_commit(),
        "rnnkern_cuda_kernels": ops.WITH_CUDA,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": _package_version("triton"), "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "python": platform.python_version(), "os": platform.platform(),
        "cpu": _cpu_info(), "gpu": _gpu_info(), "load_average": _load_average(),
    }


def _load_average() -> Optional[list]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:  # not available on this OS
        return None


def _environment_lines(env: dict) -> list[str]:
    cpu, gpu = env["cpu"], env["gpu"]
    isa = "ISA unknown" if cpu["isa"] is None else ("ISA " + " ".join(cpu["isa"]) if cpu["isa"] else "no AVX")
    if cpu["isa"] is not None and "avx512f" not in cpu["isa"]:
        isa += " (no AVX-512)"
    lines = [f"rnnkern {env['rnnkern']} ({env['git'] or env['rnnkern_path']}), CUDA kernels "
             f"{'built' if env['rnnkern_cuda_kernels'] else 'not built'}",
             f"torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}), triton {env['triton']}, "
             f"python {env['python']}, {env['os']}",
             f"CPU: {cpu['model']}, {cpu['cores']} cores, torch uses {cpu['torch_threads']} threads, {isa}, "
             f"torch dispatch {cpu['torch_cpu_capability']}, rnnkern's CPU kernels at {cpu['rnnkern_cpu_isa']}"]
    if gpu:
        lines.append(f"GPU: {gpu['name']} (sm_{gpu['capability'].replace('.', '')}, {gpu['sms']} SMs, "
                     f"{gpu['memory_gib']} GiB), driver {gpu['driver']}, {gpu['count']} visible")
    else:
        lines.append("GPU: none visible")
    load = env["load_average"]
    if load and load[0] > (cpu["cores"] or 1):
        lines.append(f"note: load average {load[0]} on {cpu['cores']} cores: other processes compete "
                     "for the CPU; this run is slower, and the CPU backend is not timed")
    return lines


# ------------------------------------------------------------ report ----

def _row_groups(records: list[dict]) -> list[tuple[tuple, list[dict]]]:
    groups: dict = {}
    for r in records:
        groups.setdefault((r["op"], r["size"], r["dtype"]), []).append(r)
    return list(groups.items())


def _case_name(r: dict) -> str:
    return r["cell"] + ("+proj" if r["proj"] else "") + (f" {r['variant']}" if r["variant"] else "")


def _table_lines(backend: str, records: list[dict]) -> list[str]:
    lines = []
    for (op, size, dtype), rs in _row_groups(records):
        failed = [r for r in rs if not r["ok"]]
        ratios = [(_ratio(r["worst"]), r) for r in rs if r.get("worst")]
        ratio, r = max(ratios, key=lambda t: t[0]) if ratios else (math.inf, rs[0])
        worst = f"{ratio:8.3g}x  {_case_name(r)}: {r['worst']['tensor']}" if ratios else ""
        crashed = [r for r in rs if "exception" in r]
        if crashed:
            worst = f"{_case_name(crashed[0])}: {crashed[0]['exception'][:60]}"
        result = "pass" if not failed else f"FAIL {len(failed)}"
        lines.append(f"{backend:<10} {OPS[op] + ('' if size != 'large' else ', large'):<50} {dtype:<9} "
                     f"{len(rs):>5}  {result:<7} {worst}")
    return lines


def _failure_lines(backend: str, records: list[dict]) -> list[str]:
    lines = []
    for r in records:
        if r["ok"]:
            continue
        head = f"  FAIL {backend}: {OPS[r['op']]}, {_case_name(r)}, {r['dtype']}, {r['size']} ({SIZES[r['size']].label()})"
        if "exception" in r:
            lines.append(f"{head}: {r['exception'][:300]}")
            continue
        for t in r["tensors"]:
            if not t["error"] <= t["allowed"]:
                what = t.get("problem") or f"error {t['error']:.3e} > allowed {t['allowed']:.3e}"
                lines.append(f"{head}: {t['tensor']} {what}")
    return lines


def advice(report: dict) -> dict:
    """For each failing backend, the backend to use instead (a sentence)."""
    passed = {(b["backend"], b["device"]) for b in report["backends"].values() if b.get("ok")}
    out = {}
    for name, b in report["backends"].items():
        if b.get("ok") is not False:
            continue
        device = b["device"]
        others = [x for x in PREFERENCE[device] if x != name and (x, device) in passed]
        if others:
            alt = others[0]
            out[name] = (f"use backend='{alt}' instead (rnnkern.LSTM(..., backend='{alt}'), "
                         f"rnnkern.convert(model, backend='{alt}'))")
        elif device == "cuda" and ("cpu", "cpu") in passed:
            out[name] = "no backend passed on the GPU: run the model on the CPU with backend='cpu', or use torch.nn"
        else:
            out[name] = f"no rnnkern backend passed on the {device}: use torch.nn's modules until this is fixed"
        auto = ops.resolve_backend("auto", torch.device(device))
        if auto == name:
            out[name] += f" (backend='auto', the default, picks '{name}' on this {device})"
    return out


def _speed_skipped(target: Target, env: dict) -> Optional[str]:
    """Why a backend is not timed (None when it is)."""
    if target.backend == "reference":
        return "the reference is not a fast path"
    if target.interpreted:
        return "not timed under the Triton interpreter"
    load, cores = env["load_average"], env["cpu"]["cores"] or 1
    if target.device.type == "cpu" and load and load[0] > cores:
        # Measured here: torch.nn's 2-thread LSTM forward took 4 s instead of
        # 0.15 s at load 6 on 2 cores; ratios of such figures mean nothing.
        return (f"load average {load[0]} on {cores} cores: the figures would time the other processes; "
                "rerun on a quiet machine")
    return None


def _speed_line(backend: str, s: dict) -> str:
    if "skipped" in s:
        return f"speed {backend}: skipped: {s['skipped']}"
    if "exception" in s:
        return f"speed {backend}: could not be measured: {s['exception'][:300]}"
    size = s["size"]
    cells = "  ".join(f"{c} {v['speedup']['forward']:.2f}x / {v['speedup']['forward_backward']:.2f}x"
                      for c, v in s["cells"].items())
    return (f"speed {backend} vs torch.nn ({s['dtype']}, B={size['B']} T={size['T']} H={size['H']}, "
            f"forward / forward+backward, median of <= {s['max_repeats']}; >1x: rnnkern faster): {cells}")


def default_json_path() -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path.cwd() / f"rnnkern-check-{stamp}.json"


def check(backends: Optional[list] = None, quick: bool = False, speed_test: bool = True,
          json_path: Optional[os.PathLike] = None, file: Optional[TextIO] = None,
          command: Optional[str] = None) -> dict:
    """Runs the self-check, prints its report to ``file`` (default stdout), writes
    the JSON report to ``json_path`` (default: ./rnnkern-check-<date>-<time>.json)
    and returns it as a dict; ``report["ok"]`` is False on any mismatch.

    ``backends``: names to check (default: every backend this machine can run);
    one that cannot run here raises ValueError saying why.  ``quick``: float32 and
    bfloat16 only, lengths in reverse only, no large size.  ``speed_test``: time
    against torch.nn.  ``command``: how the check was started, for the report
    (default: this call)."""
    file = file or sys.stdout
    began = time.perf_counter()

    def say(line=""):
        print(line, file=file, flush=True)

    runnable, missing = select_targets(backends)
    json_path = Path(json_path) if json_path is not None else default_json_path()
    env = environment()
    report = {"schema": SCHEMA, "ok": None,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": command or (f"rnnkern.check(backends={backends!r}, quick={quick}, "
                                     f"speed_test={speed_test})"),
              "options": {"backends": [t.backend for t in runnable], "quick": quick, "speed": speed_test},
              "environment": env,
              "sizes": {k: dataclasses.asdict(v) for k, v in SIZES.items()},
              "tolerance": {"float64": TOL[torch.float64], "float32": TOL[torch.float32],
                            "half": "Frobenius error <= 2 x the reference's own error in that dtype + one rounding to it"},
              "backends": {}, "not_run": missing, "cases": [], "speed": {}, "advice": {}}
    say("rnnkern field self-check")
    for line in _environment_lines(env):
        say("  " + line)
    say("backends: " + ", ".join(t.label() for t in runnable))
    for name, why in missing.items():
        say(f"not run: {name}: {why}")
    plans = {t.backend: plan(t, quick) for t in runnable}
    used = {c.size for cases in plans.values() for c in cases}
    say(f"sizes: {', '.join(f'{k} {v.label()}' for k, v in SIZES.items() if k in used)}")
    say()
    say(f"{'backend':<10} {'check':<50} {'dtype':<9} {'cases':>5}  {'result':<7} worst error / allowed")
    checker = Checker()
    for target in runnable:
        t0 = time.perf_counter()
        with strict_numerics():
            records = [{"backend": target.backend} | checker.run(target, case) for case in plans[target.backend]]
        report["cases"] += records
        report["backends"][target.backend] = {
            "backend": target.backend, "device": target.device.type, "interpreted": target.interpreted,
            "ok": all(r["ok"] for r in records), "cases": len(records),
            "failed": sum(not r["ok"] for r in records), "seconds": round(time.perf_counter() - t0, 2)}
        for line in _table_lines(target.backend, records):
            say(line)
    failures = [line for t in runnable for line in
                _failure_lines(t.backend, [r for r in report["cases"] if r["backend"] == t.backend])]
    if failures:
        say()
        say("failures:")
        for line in failures:
            say(line)
    if speed_test:
        say()
        for target in runnable:
            report["speed"][target.backend] = result = _timed(target, env)
            say(_speed_line(target.backend, result))
    report["ok"] = bool(runnable) and all(b["ok"] for b in report["backends"].values())
    report["advice"] = advice(report)
    report["seconds"] = round(time.perf_counter() - began, 2)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(_jsonable(report), indent=1, allow_nan=False) + "\n")
    say()
    for line in _verdict_lines(report):
        say(line)
    say(f"JSON report: {json_path}")
    return report


def _timed(target: Target, env: dict) -> dict:
    """The speed record of one backend: :func:`speed`'s, ``{"skipped": why}`` or
    ``{"exception": text}`` (timing is informative: its failure is reported, not fatal)."""
    why = _speed_skipped(target, env)
    if why:
        return {"skipped": why}
    try:
        return speed(target)
    except Exception as e:  # reported in the output and the JSON, never hidden
        return {"exception": f"{type(e).__name__}: {e}"[:2000]}


def _verdict_lines(report: dict) -> list[str]:
    n = len(report["cases"])
    if report["ok"]:
        verb = "agrees" if len(report["backends"]) == 1 else "agree"
        return [f"OK: {', '.join(report['backends'])} {verb} with the float64 reference and torch.nn "
                f"({n} cases, {report['seconds']:.1f} s)."]
    bad = [b for b, v in report["backends"].items() if not v["ok"]]
    failed = sum(v["failed"] for v in report["backends"].values())
    return ([f"MISMATCH in {', '.join(repr(b) for b in bad)} ({failed} of {n} cases failed, "
             f"{report['seconds']:.1f} s)."]
            + [f"  {name}: {sentence}" for name, sentence in report["advice"].items()]
            + [f"Please {WHERE_TO_REPORT}."])


def _jsonable(value):
    """``value`` with non-finite floats (an error that is NaN or inf) as None:
    strict JSON has no Infinity."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rnnkern.check",
        description="rnnkern's field self-check: every backend this machine runs against the float64 "
                    "reference and torch.nn, a quick speed comparison, and a JSON report to attach "
                    "to a bug report.  Exit status 1 on any mismatch.")
    parser.add_argument("--backends", type=lambda s: [b.strip() for b in s.split(",") if b.strip()],
                        help="comma-separated backends to check (default: every one that can run here: "
                             "reference, cpu, cuda, triton)")
    parser.add_argument("--quick", action="store_true",
                        help="float32 and bfloat16 only, variable lengths in reverse only, no large size")
    parser.add_argument("--json", metavar="PATH", help="where to write the JSON report "
                        "(default: ./rnnkern-check-DATE-TIME.json)")
    parser.add_argument("--no-speed", action="store_true", help="skip the speed comparison with torch.nn")
    args = parser.parse_args(argv)
    try:
        select_targets(args.backends)
    except ValueError as e:
        parser.error(str(e))
    report = check(args.backends, quick=args.quick, speed_test=not args.no_speed, json_path=args.json,
                   command=" ".join(["python -m rnnkern.check", *(sys.argv[1:] if argv is None else argv)]))
    return 0 if report["ok"] else 1


class _CallableModule(types.ModuleType):
    """``rnnkern.check`` is this module (so that ``python -m rnnkern.check`` runs
    it and ``import rnnkern.check`` finds it) and, called, the function
    :func:`check`: ``rnnkern.check()``."""

    def __call__(self, *args, **kwargs):
        return check(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())

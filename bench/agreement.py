"""Numerical agreement, checked before anything is timed.

The truth is torch.nn run in float64 on the same inputs and weights.  A candidate
agrees when, for every output and gradient, its relative error (Frobenius norm of
the difference over the norm of the truth) is at most

    max(FACTOR * (torch.nn's own relative error in the case's dtype), FLOOR[dtype])

-- flash-attention's criterion: torch.nn in the same dtype (cuDNN with its TF32 or
half-precision arithmetic, oneDNN) calibrates what that dtype can deliver, so the
tolerance follows the dtype and the length of the sequence without a hand-tuned
table, and a candidate may be at most a few times less accurate than the baseline.
The floor stops a baseline that happens to be exact in float64 from demanding
exactness.  A candidate that fails is reported with its worst tensor and not timed.
"""
from __future__ import annotations

import math

import torch

FACTOR = 4.0
FLOOR = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def relative_error(actual: torch.Tensor, truth: torch.Tensor) -> float:
    diff = (actual.detach().double() - truth).norm().item()
    scale = truth.norm().item()
    return diff / scale if scale > 0 else diff


def check(names: list[str], got: list, truth: list, baseline: list, dtype: torch.dtype) -> dict:
    """Agreement of ``got`` with ``truth`` (float64), tolerance calibrated by ``baseline``
    (torch.nn in ``dtype``).  Returns a JSON-ready dict; ``ok`` says whether it agrees."""
    floor = FLOOR[dtype]
    worst = None
    ok = True
    max_abs = 0.0
    for name, a, t, b in zip(names, got, truth, baseline):
        err = relative_error(a, t)
        base = relative_error(b, t)
        allowed = max(FACTOR * base, floor)
        good = math.isfinite(err) and err <= allowed
        ok = ok and good
        diff = (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0
        max_abs = max(max_abs, diff) if math.isfinite(diff) else math.inf
        ratio = err / allowed if math.isfinite(err) else math.inf
        if worst is None or ratio > worst[0]:
            worst = (ratio, name, err, base, allowed)
    _, name, err, base, allowed = worst
    finite = (lambda v: v if math.isfinite(v) else None)
    return {"ok": ok, "worst": name, "rel_err": finite(err), "torch_rel_err": finite(base),
            "allowed": allowed, "max_abs_diff_vs_torch": finite(max_abs)}


def tensor_names(cell: str, phase: str) -> list[str]:
    """Names of what a phase returns, in order (see suite.phase_fn)."""
    lstm = cell == "lstm"
    names = ["output", "h_n"] + (["c_n"] if lstm else [])
    if phase == "forward_backward":
        names += ["grad_input", "grad_h0"] + (["grad_c0"] if lstm else [])
        names += ["grad_weight_ih", "grad_weight_hh", "grad_bias_ih", "grad_bias_hh"]
    return names

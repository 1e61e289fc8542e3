"""The self-check's quick speed comparison with torch.nn: one size per device
type, every torch.nn cell, forward and forward + backward, timed interleaved."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch
from torch import Tensor

from .matrix import TORCH_CELLS, Target, dtype_name
from .problems import _draw, _generator, _module_pair

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
    result = {"size": {"B": B, "T": T, "I": H, "H": H}, "dtype": dtype_name(dtype),
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

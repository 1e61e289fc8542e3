"""The self-check's matrix: the sizes, the ops and the cases each backend runs
(:func:`plan`), and the backends this machine can run (:func:`targets`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from .. import ops, reference

#: The cells torch.nn has (gru_reset_before has no twin there).
TORCH_CELLS = ("rnn_tanh", "rnn_relu", "lstm", "gru")

#: (cell, with LSTM projection) of the op cases: every cell and GRU form, and the projected LSTM.
SEQUENCE_CELLS = [(cell, False) for cell in reference.CELLS] + [("lstm", True)]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: how the report names a dtype."""
    return str(dtype).replace("torch.", "")


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
        # float64 runs only under the interpreter (docs/gpu.md, "The Triton backend").
        runnable.append(Target("triton", cuda, dtypes=(torch.float32, torch.bfloat16, torch.float16)))
    else:
        # The interpreter costs ~0.3 ms per block operation: float32 and bfloat16
        # only (tests/test_triton.py covers float64 and float16 there).
        runnable.append(Target("triton", cpu, interpreted=True, dtypes=(torch.float32, torch.bfloat16)))
    return runnable, missing

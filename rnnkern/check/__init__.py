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

The schema of the JSON report is documented in docs/check.md.

The package, one job a module:

  matrix.py    the cases (sizes, ops, dtypes) and the backends this machine runs
  problems.py  one case: its inputs, the float64 truth, the comparison
  timing.py    the quick speed comparison with torch.nn
  probe.py     the environment probe (shared with the benchmarks, bench/)
  report.py    the terminal lines, the advice, the JSON's values
  runner.py    :func:`check`: the run, start to end
  cli.py       ``python -m rnnkern.check``'s arguments (:func:`main`)
"""
from __future__ import annotations

import sys
import types

from .cli import main
from .matrix import OPS, SIZES, Case, Size, Target, plan, select_targets, targets  # noqa: F401
from .problems import Checker, one_thread, strict_numerics  # noqa: F401
from .report import advice  # noqa: F401
from .runner import SCHEMA, check
from .timing import SPEED, speed  # noqa: F401

__all__ = ["check", "main", "SCHEMA"]


class _CallableModule(types.ModuleType):
    """``rnnkern.check`` is this package (so that ``python -m rnnkern.check`` runs
    it and ``import rnnkern.check`` finds it) and, called, the function
    :func:`check`: ``rnnkern.check()``."""

    def __call__(self, *args, **kwargs):
        return check(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

"""How close a backend's results must come to the truth: the one table shared by
the test suite (tests/conftest.py) and the field self-check (:mod:`rnnkern.check`).

- float64 and float32 results are compared element-wise with a reference in the
  same dtype (or a wider one): ``|actual - expected| <= tol * (max(1, max|expected|) + |expected|)``,
  which is ``torch.testing.assert_close`` with ``rtol = tol`` and ``atol = tol * max(1, max|expected|)``.
- float16 and bfloat16 results are judged against the reference's own error in
  that dtype (flash-attention's criterion): the Frobenius error of the result
  against a float32/64 reference may be at most ``LOW_PRECISION_FACTOR`` times
  that of the reference itself run in the low-precision dtype.  Norms, not
  elements: one rounding that flips a ReLU mask moves a single element a lot in
  either computation.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

#: Relative tolerance per dtype, against a reference in the same dtype.  Half
#: types are judged against the reference's own error instead (low_precision_allowance).
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}

#: How many times the reference's own low-precision error a half-precision result may have.
LOW_PRECISION_FACTOR = 2.0


def close_tolerances(expected: Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for ``torch.testing.assert_close`` in ``dtype``: ``TOL[dtype]``
    relative, and ``TOL[dtype] * max(1, max|expected|)`` absolute."""
    tol = TOL[dtype]
    scale = max(1.0, expected.detach().abs().max().item()) if expected.numel() else 1.0
    return tol, tol * scale


def close_error(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> float:
    """``max |actual - expected| / (max(1, max|expected|) + |expected|)``: at most
    ``TOL[dtype]`` exactly when ``torch.testing.assert_close`` passes with
    :func:`close_tolerances` (NaN or inf where ``actual`` is not finite)."""
    if not expected.numel():
        return 0.0
    actual, expected = actual.detach().double(), expected.detach().double()
    rtol, atol = close_tolerances(expected, dtype)
    return ((actual - expected).abs() / (atol / rtol + expected.abs())).max().item()


def low_precision_allowance(reference_lp: Tensor, reference_hp: Tensor,
                            factor: float = LOW_PRECISION_FACTOR,
                            rounding: Optional[torch.dtype] = None) -> float:
    """The Frobenius error ``|actual - reference_hp|`` a half-precision result may
    have: ``factor`` times that of ``reference_lp`` (the reference run in the
    result's dtype), plus a floor.  The floor is, by default, far below one
    bfloat16 ulp of the result (a reference that happens to be exact does not
    demand exactness); with ``rounding=dtype`` it is one rounding of the result
    to that dtype, ``eps * |reference_hp|``: what a computation exact up to its
    final rounding may already cost.  On a few dozen elements the reference's own
    error is small or large by luck, and a correct kernel that rounds once more
    than the reference (Triton rounds h to the dot's dtype) then passes or fails
    by the seed; the field check (rnnkern.check), which cannot choose its seeds
    per machine, uses this floor, as tests/test_cuda.py's comparison with cuDNN does."""
    reference_lp, reference_hp = reference_lp.detach().double(), reference_hp.detach().double()
    own = (reference_lp - reference_hp).norm().item()
    unit = torch.finfo(rounding).eps if rounding is not None else 2 ** -9 * 1e-2
    return factor * own + unit * reference_hp.norm().item()

"""The cells RNNCell, GRUCell and LSTMCell: one fused step
(:func:`rnnkern.ops.run_step`) per call, zoneout blended after it."""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from .. import ops
from .common import (UNSUPPORTED, _any_autocast, _autocast_dtype, _cast, _check_supported,
                     _current, _dtype_mismatch, _fx_leaf_call, _indexed_pair, _promote,
                     _RnnkernOptions, _runs_torch_nn_forward, _well_formed_state)

def _cell_sizes(input_size, hidden_size) -> tuple:
    """The sizes as ints, as torch.nn's cells take them: anything that is an
    integer index -- an int, a bool, a numpy integer, an integer tensor of one
    element (speechbrain's cells pass ``torch.prod(torch.tensor(shape[2:]))``),
    which torch.nn hands to ``torch.empty``.  torch.nn's cells take sizes of 0
    (hidden_size=0 gives empty states) and fail on other bad sizes from inside
    their init (TypeError for a float, RuntimeError for a negative size); the
    same types here, with messages that name the argument."""
    sizes = []
    for arg, value in (("input_size", input_size), ("hidden_size", hidden_size)):
        try:
            size = operator.index(value)
        except TypeError:
            raise TypeError(f"{arg} should be of type int, got: {type(value).__name__}") from None
        if size < 0:
            raise RuntimeError(f"{arg} must be non-negative, got {size}")
        sizes.append(size)
    return tuple(sizes)


#: The cells' parameters, in rnnkern.ops.step's order.
_CELL_WEIGHTS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


class _CellMixin(_RnnkernOptions):
    """forward() shared by the cells: one fused step (:func:`rnnkern.ops.step`).

    ``zoneout=p`` blends after the step, in Python (exact for one step): in
    training a fresh Bernoulli(p) mask per call ([B, Z], Z = 2H for the LSTM
    cells: h's units then c's), ``new = m * previous + (1 - m) * step``; in
    evaluation ``p * previous + (1 - p) * step`` -- what the sequence modules
    compute at each step, so a cell sharing their weights reproduces their
    evaluation outputs one step at a time."""

    @property
    def cell(self) -> str:
        if isinstance(self, nn.LSTMCell):
            return "lstm"
        if isinstance(self, nn.GRUCell):
            return "gru" if self.reset_after else "gru_reset_before"
        if self.nonlinearity not in ("tanh", "relu"):
            # torch.nn.RNNCell finds out only in forward; nn.RNN's message.
            raise ValueError(f"Unknown nonlinearity '{self.nonlinearity}'. Select from 'tanh' or 'relu'.")
        return "rnn_" + self.nonlinearity

    def _hidden_parts(self, hx, input: Tensor) -> tuple:
        """hx as a tuple of 2-D tensors, its types and ranks checked as torch.nn
        does (same exception types; torch.nn's messages with the cell's name in
        front)."""
        name = type(self).__name__
        lstm = self.cell in ("lstm", "lstm_ln")
        if lstm and input.dim() == 1 and isinstance(hx, (Tensor, tuple, list)):
            # torch.nn checks the rank of every state it iterates over, then makes
            # an unbatched call's pair by indexing (hx[0], hx[1]): a stacked [2, H]
            # tensor works there, as does a longer tuple (its first two states).
            for i, h in enumerate(hx):
                if isinstance(h, Tensor) and h.dim() not in (1, 2):
                    raise ValueError(f"{name}: Expected hx[{i}] to be 1D or 2D, got {h.dim()}D instead")
            hx = _indexed_pair(hx, name, "(h, c)")
        if lstm and not isinstance(hx, (tuple, list)):
            raise TypeError(f"{name}: hx must be a tuple (h, c) of two tensors, got {type(hx).__name__}")
        if lstm and len(hx) != 2:  # torch.nn: aten's RuntimeError
            raise RuntimeError(f"{name}: lstm_cell expects two hidden states: hx must be a tuple (h, c) "
                               f"of two tensors, got {len(hx)}")
        parts = tuple(hx) if lstm else (hx,)
        # torch.nn names a state "hidden" (RNNCell, GRUCell) or "hx[i]" (LSTMCell)
        # in its rank checks and "hidden<i>" in aten's size checks.
        ranks = ("hx[0]", "hx[1]") if lstm else ("hidden",)
        for label, h in zip(ranks, parts):
            if not isinstance(h, Tensor):
                raise TypeError(f"{name}: {label} must be a Tensor, got {type(h).__name__}")
            if h.dim() not in (1, 2):
                raise ValueError(f"{name}: Expected {label} to be 1D or 2D, got {h.dim()}D instead")
        for label, h in zip(ranks, parts):
            if h.dim() != input.dim():
                # torch.nn fails here later, inside aten, with a size message
                # (RuntimeError) or an IndexError.
                raise RuntimeError(f"{name}: Expected {label} to be {input.dim()}D like the input, "
                                   f"got {h.dim()}D instead")
        return parts if input.dim() == 2 else tuple(h.unsqueeze(0) for h in parts)

    def forward(self, input: Tensor, hx=None):
        if _runs_torch_nn_forward():
            return self._torch_nn_forward(input, hx)
        traced = _fx_leaf_call(self, _CellMixin.forward, input,
                               (input,) if hx is None else (input, hx), {})
        if traced is not None:
            return traced
        if not isinstance(input, Tensor):
            # (torch.nn: an AttributeError from input.dim(); the sequence modules say this too.)
            raise TypeError(f"{type(self).__name__}: expected input to be a Tensor, got {type(input).__name__}")
        result = self._common_call(input, hx)
        if result is not None:
            return result
        cell = self.cell
        lstm = cell == "lstm" or cell == "lstm_ln"
        name = type(self).__name__
        if input.dim() not in (1, 2):
            raise ValueError(f"{name}: Expected input to be 1D or 2D, got {input.dim()}D instead")
        parts = None if hx is None else self._hidden_parts(hx, input)
        batched = input.dim() == 2
        x = input if batched else input.unsqueeze(0)
        B = x.size(0)
        # aten's cell checks, in aten's order (input before the states).
        if x.size(1) != self.input_size:
            raise RuntimeError(f"{name}: input has inconsistent input_size: got {x.size(1)} "
                               f"expected {self.input_size}")
        # Each parameter read once, from _parameters (see _current): this path
        # is what a per-step loop pays on every call.
        weights = _current(self, _CELL_WEIGHTS)
        ln = self._ln() if cell == "lstm_ln" else None
        if parts is None:
            zeros = torch.zeros(B, self.hidden_size, dtype=x.dtype, device=x.device)
            parts = (zeros, zeros) if lstm else (zeros,)
        # Shapes before dtypes, as aten's cell checks run before its products
        # meet the mismatched dtypes (PyTorch's test_errors feeds float64 input
        # with a wrong hidden size to a float32 cell and expects the size error).
        for i, h in enumerate(parts):
            if h.size(0) != B:
                raise RuntimeError(f"{name}: Input batch size {B} doesn't match hidden{i} batch "
                                   f"size {h.size(0)}")
            if h.size(1) != self.hidden_size:
                raise RuntimeError(f"{name}: hidden{i} has inconsistent hidden_size: got "
                                   f"{h.size(1)}, expected {self.hidden_size}")
        autocast = _autocast_dtype(x.device.type, weights[0]) if _any_autocast() else None
        if autocast is None:
            if x.dtype != weights[0].dtype:
                raise _dtype_mismatch(name, "input", x.dtype, "weight", weights[0].dtype)
            for i, h in enumerate(parts):
                if h.dtype != x.dtype:
                    raise _dtype_mismatch(name, f"hx[{i}]" if lstm else "hx", h.dtype, "input",
                                          x.dtype)
        result_dtypes = None
        if autocast is not None:
            result_dtypes = self._autocast_result_dtypes(x, parts, autocast)
            x, parts = x.to(autocast), tuple(h.to(autocast) for h in parts)
            weights = tuple(_cast(w, autocast) for w in weights)
            ln = _cast(ln, autocast)
        backend = ops.resolve_backend(self.backend, x.device)
        _check_supported(name, backend, cell, x.dtype, step=True)
        if self.hidden_size == 0:
            # Nothing to compute, but the empty results keep their autograd
            # graph as torch.nn's do; the kernels need at least one unit.
            backend = "reference"
        h, c = ops.run_step(backend, cell, x, parts[0], parts[1] if lstm else None, *weights, ln)
        p = self.zoneout
        if p:
            h, c = self._zoneout(p, parts, h, c)
        if result_dtypes is not None:
            h = h.to(result_dtypes[0])
            c = c.to(result_dtypes[1]) if lstm else None
        if not batched:
            h = h.squeeze(0)
            c = c.squeeze(0) if lstm else None
        return (h, c) if lstm else h

    def _common_call(self, input: Tensor, hx):
        """The forward of the commonest call (a per-step loop's: batched CPU
        input of the weights' dtype, hx None or of the right shapes and that
        dtype, no zoneout, autocast or LayerNorm, backend cpu or auto, the CPU
        backend lacking nothing), or None for any other: the full forward then
        runs it, or raises its error.
        A cell call is all overhead at small sizes: the full forward's checks
        and conversions cost an RNNCell H=64 B=1 call ~20 us around a ~9 us
        step (Zen 3), as much as torch.nn's whole call.  The same step op."""
        shape = input.shape
        backend = self.backend
        if len(shape) != 2 or shape[1] != self.input_size or self.zoneout or not input.is_cpu \
                or (backend != "cpu" and backend != "auto") or _any_autocast() or UNSUPPORTED["cpu"]:
            return None
        weights = _current(self, _CELL_WEIGHTS)
        dtype = input.dtype
        H = self.hidden_size
        if weights[0].dtype != dtype or H == 0:
            return None
        cell = self.cell
        if cell == "lstm_ln":
            return None
        state = (shape[0], H)
        lstm = cell == "lstm"
        if hx is None:
            h = input.new_zeros(state)
            c = h if lstm else None
        else:
            parts = _well_formed_state(hx, lstm, state, dtype)
            if parts is None:
                return None
            h, c = parts
        h, c = ops.run_step("cpu", cell, input, h, c, *weights)
        return h if c is None else (h, c)

    def _zoneout(self, p: float, parts, h: Tensor, c: Optional[Tensor]):
        """The zoneout blend of one step's (h, c) with the states it started from."""
        if self.training:
            H = h.size(1)
            m = h.new_empty((h.size(0), 2 * H if c is not None else H)).bernoulli_(p)
            h = m[:, :H] * parts[0] + (1 - m[:, :H]) * h
            if c is not None:
                c = m[:, H:] * parts[1] + (1 - m[:, H:]) * c
            return h, c
        h = p * parts[0] + (1 - p) * h
        if c is not None:
            c = p * parts[1] + (1 - p) * c
        return h, c

    def _autocast_result_dtypes(self, x: Tensor, parts, dtype: torch.dtype):
        """The dtypes torch.nn's cells return under autocast: on CUDA the cell ops
        are autocast whole; on the CPU only their products are, so a float32
        state promotes GRU's h (h0's dtype) and LSTM's h and c (c0's dtype)."""
        if x.device.type != "cpu" or self.cell.startswith("rnn"):
            return (dtype,) * len(parts)
        state = _promote(dtype, parts[-1].dtype)
        return (state,) * len(parts)


class RNNCell(_CellMixin, nn.RNNCell):
    """Drop-in for :class:`torch.nn.RNNCell`, plus ``backend=`` and ``zoneout=``."""

    def __init__(self, input_size, hidden_size, bias: bool = True, nonlinearity: str = "tanh",
                 device=None, dtype=None, *, backend: str = "auto", zoneout: float = 0.0):
        input_size, hidden_size = _cell_sizes(input_size, hidden_size)
        super().__init__(input_size, hidden_size, bias, nonlinearity, device=device, dtype=dtype)
        self._init_rnnkern(backend, zoneout=zoneout)


class GRUCell(_CellMixin, nn.GRUCell):
    """Drop-in for :class:`torch.nn.GRUCell`, plus ``backend=``, ``reset_after=``
    and ``zoneout=``."""

    def __init__(self, input_size, hidden_size, bias: bool = True, device=None, dtype=None, *,
                 backend: str = "auto", reset_after: bool = True, zoneout: float = 0.0):
        input_size, hidden_size = _cell_sizes(input_size, hidden_size)
        super().__init__(input_size, hidden_size, bias, device=device, dtype=dtype)
        self._init_rnnkern(backend, reset_after, zoneout)


class LSTMCell(_CellMixin, nn.LSTMCell):
    """Drop-in for :class:`torch.nn.LSTMCell`, plus ``backend=`` and ``zoneout=``."""

    def __init__(self, input_size, hidden_size, bias: bool = True, device=None, dtype=None, *,
                 backend: str = "auto", zoneout: float = 0.0):
        input_size, hidden_size = _cell_sizes(input_size, hidden_size)
        super().__init__(input_size, hidden_size, bias, device=device, dtype=dtype)
        self._init_rnnkern(backend, zoneout=zoneout)

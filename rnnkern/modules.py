"""Drop-in replacements for torch.nn's recurrent modules.

Each class subclasses its torch.nn twin, so constructor arguments, parameter
names and shapes, initialisation, ``extra_repr``, ``state_dict``, pickling and
``isinstance`` checks are torch's own; only ``forward`` changes.  Layers,
directions, packing, dropout and hidden-state handling live here; each
(layer, direction) is one call of :func:`rnnkern.ops.recurrence` on the input
projection of the whole sequence, so no Python runs per time step.

Extra keyword arguments: ``backend`` (see :data:`rnnkern.ops.BACKENDS`) on every
class, ``reset_after`` on :class:`GRU` and :class:`GRUCell` (``False`` selects the
classic GRU of seed 000, ``n = tanh(W_in x + b_in + W_hn (r * h) + b_hn)``), and
``lengths=`` on the sequence modules' ``forward`` for padded batches.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from . import ops

__all__ = ["RNN", "GRU", "LSTM", "RNNCell", "GRUCell", "LSTMCell", "convert"]


def _check_backend(backend: str) -> str:
    if backend not in ops.BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(ops.BACKENDS)}")
    return backend


class _RecurrentMixin:
    """forward() shared by RNN, GRU and LSTM (the torch.nn base provides the rest)."""

    backend: str

    def _init_rnnkern(self, backend: str = "auto", reset_after: bool = True) -> None:
        self.backend = _check_backend(backend)
        if not isinstance(reset_after, bool):
            raise TypeError(f"reset_after should be of type bool, got: {type(reset_after).__name__}")
        self.reset_after = reset_after

    @property
    def cell(self) -> str:
        """The rnnkern cell this module runs."""
        if self.mode == "LSTM":
            return "lstm"
        if self.mode == "GRU":
            return "gru" if self.reset_after else "gru_reset_before"
        return "rnn_tanh" if self.mode == "RNN_TANH" else "rnn_relu"

    def _layer_weights(self, layer: int, direction: int):
        suffix = "_reverse" if direction == 1 else ""

        def get(name):
            return getattr(self, f"{name}_l{layer}{suffix}", None)

        return get("weight_ih"), get("weight_hh"), get("bias_ih"), get("bias_hh"), get("weight_hr")

    def _autocast(self, x: Tensor, weights, hx):
        """Under torch.autocast, run in the autocast dtype as torch.nn does."""
        device_type = x.device.type
        if not torch.is_autocast_enabled(device_type):
            return x, weights, hx
        dtype = torch.get_autocast_dtype(device_type)

        def cast(t):
            return None if t is None else t.to(dtype)

        return cast(x), [tuple(cast(w) for w in ws) for ws in weights], tuple(cast(h) for h in hx)

    def _run_layers(self, x: Tensor, hx, lengths: Optional[Tensor]):
        """x [T, B, I], hx: (h0[, c0]) of shape [L*D, B, *] -> output [T, B, D*P], (h_n[, c_n])."""
        lstm = self.mode == "LSTM"
        D = 2 if self.bidirectional else 1
        weights = [self._layer_weights(layer, d) for layer in range(self.num_layers) for d in range(D)]
        x, weights, hx = self._autocast(x, weights, hx)
        h0 = hx[0]
        c0 = hx[1] if lstm else None
        h_n, c_n = [], []
        for layer in range(self.num_layers):
            outputs = []
            for d in range(D):
                idx = layer * D + d
                w_ih, w_hh, b_ih, b_hh, w_hr = weights[idx]
                out, h, c = ops.recurrence(
                    self.cell, F.linear(x, w_ih), h0[idx], c0[idx] if lstm else None, w_hh,
                    b_ih, b_hh, w_hr, lengths, reverse=d == 1, backend=self.backend)
                outputs.append(out)
                h_n.append(h)
                if lstm:
                    c_n.append(c)
            x = torch.cat(outputs, dim=2) if D == 2 else outputs[0]
            if self.dropout > 0 and self.training and layer + 1 < self.num_layers:
                x = F.dropout(x, self.dropout, training=True)
        hidden = (torch.stack(h_n), torch.stack(c_n)) if lstm else (torch.stack(h_n),)
        return x, hidden

    def _zeros_hidden(self, batch: int, like: Tensor):
        D = 2 if self.bidirectional else 1
        real_hidden = self.proj_size if self.proj_size > 0 else self.hidden_size
        h = torch.zeros(self.num_layers * D, batch, real_hidden, dtype=like.dtype, device=like.device)
        if self.mode != "LSTM":
            return (h,)
        c = torch.zeros(self.num_layers * D, batch, self.hidden_size, dtype=like.dtype,
                        device=like.device)
        return (h, c)

    def forward(self, input, hx=None, *, lengths: Optional[Tensor] = None):
        """As torch.nn's forward.  ``lengths`` ([B] int64, CPU) marks the valid steps
        of each sequence of a padded batch: later steps leave the state alone and
        output zeros, and the reverse direction starts at each sequence's end."""
        lstm = self.mode == "LSTM"
        name = type(self).__name__
        if isinstance(input, PackedSequence):
            if lengths is not None:
                raise ValueError(f"{name}: lengths= is for padded input; a PackedSequence carries its own")
            data, batch_sizes, sorted_indices, unsorted_indices = input
            # Sequences in the packed (length-sorted) order, as torch.nn runs them.
            padded, seq_lengths = pad_packed_sequence(PackedSequence(data, batch_sizes))
            if hx is None:
                hx = self._zeros_hidden(padded.size(1), data)
            else:
                hx = self.permute_hidden(hx, sorted_indices)
                hx = hx if lstm else (hx,)
                self.check_forward_args(data, hx if lstm else hx[0], batch_sizes)
            self.check_input(data, batch_sizes)
            out, hidden = self._run_layers(padded, hx, seq_lengths)
            out_data = pack_padded_sequence(out, seq_lengths).data
            hidden = hidden if lstm else hidden[0]
            return (PackedSequence(out_data, batch_sizes, sorted_indices, unsorted_indices),
                    self.permute_hidden(hidden, unsorted_indices))

        if input.dim() not in (2, 3):
            raise ValueError(f"{name}: Expected input to be 2D or 3D, got {input.dim()}D tensor instead")
        batched = input.dim() == 3
        batch_dim = 0 if self.batch_first else 1
        if not batched:
            input = input.unsqueeze(batch_dim)
            if lengths is not None:
                raise ValueError(f"{name}: lengths= needs batched (3-D) input")
        if hx is None:
            hx = self._zeros_hidden(input.size(batch_dim), input)
            self.check_forward_args(input, hx if lstm else hx[0], None)
        else:
            parts = hx if lstm else (hx,)
            want = 3 if batched else 2
            if any(not isinstance(h, Tensor) for h in parts):
                raise TypeError(f"{name}: hx must be a Tensor{' or a tuple of two' if lstm else ''}")
            if any(h.dim() != want for h in parts):
                kind = "batched 3-D" if batched else "unbatched 2-D"
                got = ", ".join(f"{h.dim()}-D" for h in parts)
                raise RuntimeError(f"For {kind} input, hx should also be {want}-D but got ({got}) tensor")
            if not batched:
                parts = tuple(h.unsqueeze(1) for h in parts)
            self.check_forward_args(input, parts if lstm else parts[0], None)
            hx = parts
        if self.batch_first:
            input = input.transpose(0, 1)
        if input.size(0) == 0:
            raise RuntimeError("Expected sequence length to be larger than 0 in RNN")
        if lengths is not None:
            lengths = _check_lengths(lengths, input.size(0), input.size(1), name)
        out, hidden = self._run_layers(input, hx, lengths)
        if self.batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(batch_dim)
            hidden = tuple(h.squeeze(1) for h in hidden)
        return out, (hidden if lstm else hidden[0])


def _check_lengths(lengths, T: int, B: int, name: str) -> Tensor:
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.size(0) != B:
        raise ValueError(f"{name}: expected lengths of shape [{B}] (one per sequence), got {list(lengths.shape)}")
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise TypeError(f"{name}: expected integer lengths, got {lengths.dtype}")
    lengths = lengths.to(device="cpu", dtype=torch.int64)
    if B and (int(lengths.min()) < 0 or int(lengths.max()) > T):
        raise ValueError(f"{name}: lengths must lie in [0, {T}] (the sequence length), got "
                         f"{lengths.tolist()}")
    return lengths


class RNN(_RecurrentMixin, nn.RNN):
    """Drop-in for :class:`torch.nn.RNN` (tanh or ReLU), plus ``backend=``."""

    def __init__(self, *args, backend: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self._init_rnnkern(backend)


class GRU(_RecurrentMixin, nn.GRU):
    """Drop-in for :class:`torch.nn.GRU`, plus ``backend=`` and ``reset_after=``."""

    def __init__(self, *args, backend: str = "auto", reset_after: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_rnnkern(backend, reset_after)


class LSTM(_RecurrentMixin, nn.LSTM):
    """Drop-in for :class:`torch.nn.LSTM` (with ``proj_size``), plus ``backend=``."""

    def __init__(self, *args, backend: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self._init_rnnkern(backend)


# ---------------------------------------------------------------- cells ----

class _CellMixin:
    """forward() shared by the cells: one fused step (:func:`rnnkern.ops.step`)."""

    backend: str

    def _init_rnnkern(self, backend: str = "auto", reset_after: bool = True) -> None:
        _RecurrentMixin._init_rnnkern(self, backend, reset_after)

    @property
    def cell(self) -> str:
        if isinstance(self, nn.LSTMCell):
            return "lstm"
        if isinstance(self, nn.GRUCell):
            return "gru" if self.reset_after else "gru_reset_before"
        return "rnn_tanh" if self.nonlinearity == "tanh" else "rnn_relu"

    def forward(self, input: Tensor, hx=None):
        lstm = self.cell == "lstm"
        name = type(self).__name__
        if input.dim() not in (1, 2):
            raise ValueError(f"{name}: Expected input to be 1D or 2D, got {input.dim()}D instead")
        if input.dtype != self.weight_ih.dtype and not torch._C._is_any_autocast_enabled():
            raise ValueError(f"{name}: input dtype ({input.dtype}) does not match weight dtype "
                             f"({self.weight_ih.dtype})")
        if input.size(-1) != self.input_size:
            raise ValueError(f"{name}: input has inconsistent input_size: got {input.size(-1)}, "
                             f"expected {self.input_size}")
        batched = input.dim() == 2
        x = input if batched else input.unsqueeze(0)
        B = x.size(0)
        if hx is None:
            zeros = torch.zeros(B, self.hidden_size, dtype=x.dtype, device=x.device)
            parts = (zeros, zeros) if lstm else (zeros,)
        else:
            parts = tuple(hx) if lstm else (hx,)
            for i, h in enumerate(parts):
                label = f"hx[{i}]" if lstm else "hx"
                if h.dim() != input.dim():
                    raise ValueError(f"{name}: Expected {label} to be {input.dim()}D like the input, "
                                     f"got {h.dim()}D instead")
                if not batched:
                    h = h.unsqueeze(0)
                if tuple(h.shape) != (B, self.hidden_size):
                    raise ValueError(f"{name}: expected {label} of shape {(B, self.hidden_size)}, "
                                     f"got {tuple(h.shape)}")
            if not batched:
                parts = tuple(h.unsqueeze(0) for h in parts)
        weights = (self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh)
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, parts = x.to(dtype), tuple(h.to(dtype) for h in parts)
            weights = tuple(None if w is None else w.to(dtype) for w in weights)
        h, c = ops.step(self.cell, x, parts[0], parts[1] if lstm else None, *weights,
                        backend=self.backend)
        if not batched:
            h = h.squeeze(0)
            c = c.squeeze(0) if lstm else None
        return (h, c) if lstm else h


class RNNCell(_CellMixin, nn.RNNCell):
    """Drop-in for :class:`torch.nn.RNNCell`, plus ``backend=``."""

    def __init__(self, *args, backend: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self._init_rnnkern(backend)


class GRUCell(_CellMixin, nn.GRUCell):
    """Drop-in for :class:`torch.nn.GRUCell`, plus ``backend=`` and ``reset_after=``."""

    def __init__(self, *args, backend: str = "auto", reset_after: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_rnnkern(backend, reset_after)


class LSTMCell(_CellMixin, nn.LSTMCell):
    """Drop-in for :class:`torch.nn.LSTMCell`, plus ``backend=``."""

    def __init__(self, *args, backend: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self._init_rnnkern(backend)


# -------------------------------------------------------------- convert ----

_REPLACEMENTS = {
    nn.RNN: RNN, nn.GRU: GRU, nn.LSTM: LSTM,
    nn.RNNCell: RNNCell, nn.GRUCell: GRUCell, nn.LSTMCell: LSTMCell,
}


def convert(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Turns every torch.nn RNN/GRU/LSTM (and cell) inside ``model`` into its rnnkern
    twin, in place: the same module objects and the same parameters, so the model
    computes the same function.  Returns ``model``."""
    _check_backend(backend)
    for module in model.modules():
        replacement = _REPLACEMENTS.get(type(module))
        if replacement is not None:
            module.__class__ = replacement
            module._init_rnnkern(backend)
    return model

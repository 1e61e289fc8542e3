"""Drop-in replacements for torch.nn's recurrent modules.

Each class subclasses its torch.nn twin, so constructor arguments, parameter
names and shapes, initialisation, ``extra_repr``, ``state_dict``, pickling and
``isinstance`` checks are torch's own; only ``forward`` changes.  Layers,
directions, packing, dropout and hidden-state handling live here; each
(layer, direction) is one call of :func:`rnnkern.ops.recurrence` on the input
projection of the whole sequence, so no Python runs per time step.

Extra keyword arguments: ``backend`` (see :data:`rnnkern.ops.BACKENDS`) on every
class, ``reset_after`` on :class:`GRU` and :class:`GRUCell` (``False`` selects the
classic GRU of seed 000, ``n = tanh(W_in x + b_in + W_hn (r * h) + b_hn)``),
``zoneout`` on every class, and ``lengths=`` and ``resets=`` on the sequence
modules' ``forward``.

Beyond torch.nn (issue #16; the README's "Beyond torch.nn" section has the rules):

- ``resets=`` ([T, B] bool, time-major like the input): where ``resets[t, b]``,
  the step at position t of sequence b starts from hx's row b (zeros without
  hx) in every layer, as if an episode began there.  A reverse direction gets
  the mask shifted by one position (``rev[t] = resets[t + 1]``): the episodes on
  the two sides of a boundary never see each other, in either direction.
- ``zoneout=p``: per unit and step, the state keeps its previous value with
  probability p while training (masks drawn from torch's default generator),
  and becomes ``p * previous + (1 - p) * new`` in evaluation.
- :class:`LayerNormLSTM` and :class:`LayerNormLSTMCell`: haste's layer-normalised
  LSTM (cell ``lstm_ln``), with torch.nn.LSTM's parameters plus the layer norms'
  gains and shift.  They share the layer stack of the drop-ins, but subclass
  ``torch.nn.RNNBase`` / ``RNNCellBase``, not torch.nn.LSTM / LSTMCell, whose
  forward would compute another function.

``torch.compile``: Dynamo refuses every instance of torch.nn.RNN/GRU/LSTM
(subclasses included) unless ``torch._dynamo.config.allow_rnn = True``; with that
flag set, these modules compile with ``fullgraph=True`` (padded input, with or
without ``lengths=``, and PackedSequence input).  torch offers no supported way
to lift the refusal for a subclass only: the one check is
``isinstance(value, (nn.RNN, nn.GRU, nn.LSTM)) and not config.allow_rnn`` in
Dynamo's ``VariableBuilder.wrap_module`` (torch/_dynamo/variables/builder.py,
torch 2.14), run when Dynamo first meets the module object, before any of its
code; see the README's torch.compile paragraph for the smallest user-side step.

``torch.jit.trace`` and ONNX export (``torch.onnx.export``, either exporter) run
torch.nn's own forward on the same parameters (:func:`_runs_torch_nn_forward`):
a TorchScript graph or ONNX model then holds torch's ``aten::lstm``/``gru``/
``rnn_*`` (ONNX ``LSTM``/``GRU``/``RNN``), which any PyTorch or ONNX runtime
can load without rnnkern, train and run at any sequence length.
``torch.export.export`` and ``torch.compile`` capture rnnkern's own ops.
``torch.jit.script`` raises (see ``__prepare_scriptable__``).
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from . import ops

__all__ = ["RNN", "GRU", "LSTM", "RNNCell", "GRUCell", "LSTMCell", "LayerNormLSTM",
           "LayerNormLSTMCell", "convert", "UNSUPPORTED"]


# ------------------------------------------------------ backend coverage ----

#: What each backend cannot do (yet), as the option's user-facing name: the one
#: place that says so.  Every module checks its call against it before running
#: and raises NotImplementedError naming the option and the backends that can.
#: Option names: "reset_after=False", "nonlinearity='relu'", "proj_size",
#: "variable lengths", "cells", "resets", "zoneout", "LayerNormLSTM", and
#: dtypes as "torch.float64" etc.
UNSUPPORTED: dict[str, frozenset] = {
    "reference": frozenset(),
    "cpu": frozenset(),
    "cuda": frozenset(),
    "triton": frozenset(),
    "cuda_emulated": frozenset(),
}


def _check_supported(name: str, backend: str, cell: str, dtype: torch.dtype, *,
                     proj: bool = False, lengths: bool = False, step: bool = False,
                     resets: bool = False, zoneout: bool = False) -> None:
    if not UNSUPPORTED.get(backend):
        return
    used = [str(dtype)]
    if cell == "gru_reset_before":
        used.append("reset_after=False")
    if cell == "rnn_relu":
        used.append("nonlinearity='relu'")
    if cell == "lstm_ln":
        used.append("LayerNormLSTM")
    if proj:
        used.append("proj_size")
    if lengths:
        used.append("variable lengths")
    if step:
        used.append("cells")
    if resets:
        used.append("resets")
    if zoneout:
        used.append("zoneout")
    for option in used:
        if option in UNSUPPORTED.get(backend, ()):
            able = [b for b, gaps in UNSUPPORTED.items() if option not in gaps]
            raise NotImplementedError(
                f"{name}: backend={backend!r} does not support {option}; "
                f"backends that do: {', '.join(able) or 'none'}")


def _check_backend(backend: str) -> str:
    if backend not in ops.BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(ops.BACKENDS)}")
    return backend


# -------------------------------------------------------- trace and export ----

def _runs_torch_nn_forward() -> bool:
    """True while ``torch.jit.trace`` or ONNX export records the model: the
    modules then run their torch.nn base class's forward on the same parameters.

    Why: a trace records Python-side decisions as constants (rnnkern's ops take
    ``train`` = "keep the backward's workspace" from the grad mode at call time,
    so a trace taken under no_grad could not train, and trace's check, rerun
    under no_grad, sees a different graph), and a TorchScript or ONNX graph
    holding ``rnnkern::*`` ops needs rnnkern wherever it is loaded and has no
    ONNX translation.  torch.nn's forward traces to ``aten::lstm`` & co., which
    train in any grad mode, generalise over sequence lengths and export to ONNX's
    LSTM/GRU/RNN operators.  The checks are False under torch.compile (Dynamo
    folds them), so compiled code keeps rnnkern's kernels.  (TorchScript's ONNX
    exporter traces; torch's dynamo-based one runs torch.export, so the costlier
    ONNX check only runs while exporting.)"""
    return torch.jit.is_tracing() or (torch.compiler.is_exporting() and torch.onnx.is_in_onnx_export())


def _no_torch_nn_twin(subject: str, lacks: str) -> NotImplementedError:
    """The error of a call that torch.jit.trace / ONNX export cannot record: they
    run torch.nn's forward (:func:`_runs_torch_nn_forward`), which ``lacks``."""
    return NotImplementedError(
        f"{subject}: torch.jit.trace / ONNX export runs torch.nn's forward, which {lacks}; "
        "use torch.export.export or torch.compile (they capture rnnkern's own ops)")


def _check_zoneout(zoneout) -> float:
    """The zoneout probability as a float; torch.nn's dropout check and message."""
    if not isinstance(zoneout, numbers.Number) or isinstance(zoneout, bool) \
            or not 0 <= zoneout <= 1:
        raise ValueError(f"zoneout should be a number in range [0, 1] (the probability that a "
                         f"unit keeps its previous state), got {zoneout!r}")
    return float(zoneout)


def _dtype_mismatch(name: str, what: str, got: torch.dtype, other: str, want: torch.dtype) -> RuntimeError:
    """A dtype mismatch of an input or state: RuntimeError, as torch.nn's matrix
    products raise (its sequence modules' check of the input itself raises
    ValueError; check_input keeps that one)."""
    return RuntimeError(f"{name}: {what} dtype ({got}) does not match {other} dtype ({want}); "
                        f"convert it with .to({want})")


# -------------------------------------------------------------- autocast ----

#: torch._C._is_any_autocast_enabled where torch has it.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast_dtype(device_type: str, weight: Tensor) -> Optional[torch.dtype]:
    """The dtype autocast runs this module in, or None when autocast is off for
    it (autocast leaves float64 alone, as torch.nn's ops do)."""
    # (the global check first: it is one C call, this runs on every call)
    if not _any_autocast() or weight.dtype == torch.float64 \
            or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _current(module: nn.Module, names) -> list:
    """The current values of the parameters ``names``, read from ``_parameters``
    (where torch.func.functional_call swaps them too): nn.Module.__getattr__
    costs about 0.4 us a lookup, a noticeable share of a one-step call.  A
    name missing there (a parametrization replaced it by a property, or a
    plain attribute took its place) or registered as None is read as an
    attribute."""
    params = module._parameters
    out = []
    for name in names:
        t = params.get(name)
        out.append(t if t is not None else getattr(module, name, None))
    return out


def _cast(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    return None if t is None else t.to(dtype)


def _promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return torch.promote_types(a, b)


# ------------------------------------------------------ sequence modules ----

class _Packing(NamedTuple):
    """Where each row of a packed batch lives in the time-major padded tensor."""
    time: Tensor   # [N] step of each packed row
    batch: Tensor  # [N] column of each packed row


def _packing_from_batch_sizes(batch_sizes: Tensor, rows: int, device) -> _Packing:
    """Rows of a PackedSequence (sorted by length) -> positions in [T, B]; sizes
    come from shapes only, so this traces under torch.compile."""
    steps = torch.arange(batch_sizes.numel())
    time = torch.repeat_interleave(steps, batch_sizes, output_size=rows)
    starts = torch.cumsum(batch_sizes, 0) - batch_sizes
    batch = torch.arange(rows) - starts[time]
    return _Packing(time.to(device), batch.to(device))


def _packing_of_padded(lengths: Tensor, T: int, device) -> _Packing:
    """The rows torch.nn sees for a padded batch with ``lengths``:
    ``pack_padded_sequence(x, lengths, enforce_sorted=False)`` (same sort call,
    so the same order; zero lengths simply contribute no rows)."""
    sorted_lengths, sorted_indices = torch.sort(lengths, descending=True)
    batch_sizes = (sorted_lengths.unsqueeze(0) > torch.arange(T).unsqueeze(1)).sum(1)
    time, column = _packing_from_batch_sizes(batch_sizes, int(sorted_lengths.sum()), "cpu")
    return _Packing(time.to(device), sorted_indices[column].to(device))


def _check_lengths(lengths, T: int, B: int, name: str) -> Tensor:
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.size(0) != B:
        raise ValueError(f"{name}: expected lengths of shape [{B}] (one per sequence), got {list(lengths.shape)}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"{name}: expected integer lengths, got {lengths.dtype}")
    lengths = lengths.to(device="cpu", dtype=torch.int64)
    # Value checks read the data: eager only (the CPU and CUDA ops check again
    # inside; under torch.compile they are the only check).
    if not torch.compiler.is_compiling() and B and (int(lengths.min()) < 0 or int(lengths.max()) > T):
        raise ValueError(f"{name}: lengths must lie in [0, {T}] (the sequence length), got "
                         f"{lengths.tolist()}")
    return lengths


class _RnnkernOptions:
    """The keywords rnnkern adds to the torch.nn modules and cells: ``backend``,
    ``reset_after`` (GRU) and ``zoneout``, checked and shown in the repr.
    Subclasses say which rnnkern cell they run (``cell``)."""

    backend: str
    #: The zoneout probability (a plain attribute, so state_dict stays torch.nn's;
    #: the class default serves modules pickled before it existed).
    zoneout: float = 0.0
    #: False for the classes torch.nn has no module for (LayerNormLSTM and its cell).
    _has_torch_nn_twin = True

    def _init_rnnkern(self, backend: str = "auto", reset_after: bool = True,
                      zoneout: float = 0.0) -> None:
        self.backend = _check_backend(backend)
        if not isinstance(reset_after, bool):
            raise TypeError(f"reset_after should be of type bool, got: {type(reset_after).__name__}")
        self.reset_after = reset_after
        self.zoneout = _check_zoneout(zoneout)
        self.cell  # noqa: B018  (validates the nonlinearity)

    def extra_repr(self) -> str:
        s = super().extra_repr()
        if not self.reset_after:
            s += ", reset_after=False"
        if self.zoneout:
            s += f", zoneout={self.zoneout}"
        if self.backend != "auto":
            s += f", backend={self.backend!r}"
        return s

    def _torch_nn_forward(self, *args):
        """The torch.nn base class's forward (see :func:`_runs_torch_nn_forward`)."""
        name = type(self).__name__
        if not self._has_torch_nn_twin:
            raise _no_torch_nn_twin(name, "has no layer-normalised LSTM")
        if not self.reset_after:
            raise _no_torch_nn_twin(f"{name}(reset_after=False)", "has only the reset-after GRU")
        if self.zoneout:
            raise _no_torch_nn_twin(f"{name}(zoneout={self.zoneout})", "has no zoneout")
        return super(_RnnkernOptions, self).forward(*args)

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every module before compiling it.
        # Scripting would compile rnnkern's forward, which dispatches to its
        # kernels in Python; substituting torch.nn's module here would swap it
        # into the user's eager model too (torch.jit.script writes the result
        # back into the parent's submodules).  So: one clear error.
        if not self._has_torch_nn_twin:
            raise RuntimeError(
                f"torch.jit.script cannot compile rnnkern.{type(self).__name__}: its forward "
                f"dispatches to rnnkern's kernels in Python, and torch.nn has no module to "
                f"trace in its place. Use torch.export.export or torch.compile.")
        base = type(self).__mro__[type(self).__mro__.index(_RnnkernOptions) + 1].__name__
        raise RuntimeError(
            f"torch.jit.script cannot compile rnnkern.{type(self).__name__}: its forward "
            f"dispatches to rnnkern's kernels in Python. Use torch.jit.trace (records "
            f"torch.nn.{base}'s forward on the same parameters), torch.export.export or "
            f"torch.compile; or script a torch.nn.{base} that holds these parameters.")


class _RecurrentMixin(_RnnkernOptions):
    """forward() shared by RNN, GRU, LSTM and LayerNormLSTM (the torch.nn base,
    ``nn.RNNBase`` or one of its subclasses, provides the rest)."""

    #: LayerNormLSTM: the names of each (layer, direction)'s layer-norm
    #: parameters (ln_ih_weight, ln_hh_weight, ln_cell_weight, ln_cell_bias).
    _ln_names: Optional[list] = None

    @property
    def cell(self) -> str:
        """The rnnkern cell this module runs."""
        if self.mode == "LSTM":
            return "lstm"
        if self.mode == "GRU":
            return "gru" if self.reset_after else "gru_reset_before"
        return "rnn_tanh" if self.mode == "RNN_TANH" else "rnn_relu"

    def _layer_weights(self, D: int) -> list:
        """(w_ih, w_hh, b_ih, b_hh, w_hr) of each (layer, direction): each
        weight's current attribute (torch.func.functional_call and
        parametrizations replace them), by the names torch.nn keeps in
        ``_flat_weights_names``, read once per call (a one-step call feels
        every lookup).  Order per layer and direction: w_ih, w_hh[, b_ih,
        b_hh][, w_hr]."""
        flat = _current(self, self._flat_weights_names)
        n = len(flat) // (self.num_layers * D)
        groups = []
        for i in range(0, len(flat), n):
            if self.bias:
                w_ih, w_hh, b_ih, b_hh = flat[i:i + 4]
                w_hr = flat[i + 4] if n == 5 else None
            else:
                w_ih, w_hh = flat[i:i + 2]
                b_ih = b_hh = None
                w_hr = flat[i + 2] if n == 3 else None
            groups.append((w_ih, w_hh, b_ih, b_hh, w_hr))
        return groups

    def _layer_ln(self) -> list:
        """LayerNormLSTM: the ``ln`` argument of each (layer, direction)'s op,
        ``[g_ih (4H), g_hh (4H), g_c (H), beta_c (H)]``, from the parameters'
        current attributes."""
        return [torch.cat(_current(self, names)) for names in self._ln_names]

    def _zoneout_width(self) -> int:
        """Units of a zoneout mask row: h's (P) then c's (H) for LSTMs, H otherwise."""
        if self.mode != "LSTM":
            return self.hidden_size
        return (self.proj_size or self.hidden_size) + self.hidden_size

    # ---- the layer stack

    def _run_layers(self, x: Tensor, hx, lengths: Optional[Tensor], packing: Optional[_Packing],
                    resets: Optional[Tensor] = None):
        """x [T, B, I] time-major, hx: (h0[, c0]) of shape [L*D, B, *], lengths [B]
        or None, resets [T, B] bool (checked) or None -> output [T, B, D*P],
        (h_n[, c_n]).  ``packing`` (variable lengths only) says which rows
        torch.nn would see packed: dropout draws its mask over them, in that
        order, as torch.nn does."""
        lstm = self.mode == "LSTM"
        D = 2 if self.bidirectional else 1
        backend = self.backend
        if not (backend == "cpu" or backend == "auto") or x.device.type != "cpu":
            backend = ops.resolve_backend(backend, x.device)
        else:
            backend = "cpu"
        name = type(self).__name__
        weights = self._layer_weights(D)
        cell = self.cell
        lns = self._layer_ln() if cell == "lstm_ln" else None
        packed = lengths is not None
        result_dtypes = None
        dtype = _autocast_dtype(x.device.type, weights[0][0]) if _any_autocast() else None
        if dtype is not None:
            result_dtypes = self._autocast_result_dtypes(x, hx, dtype, packed)
            x, hx = x.to(dtype), tuple(h.to(dtype) for h in hx)
            weights = [tuple(_cast(w, dtype) for w in ws) for ws in weights]
            if lns is not None:
                lns = [ln.to(dtype) for ln in lns]
        p = self.zoneout
        _check_supported(name, backend, cell, x.dtype, proj=self.proj_size > 0, lengths=packed,
                         resets=resets is not None, zoneout=p > 0)
        h0 = hx[0]
        c0 = hx[1] if lstm else None
        # Per direction, the resets the op sees: a boundary before position t+1
        # makes the reverse direction's step at t start afresh.
        step_resets = (resets, None if resets is None or D == 1 else
                       torch.cat((resets[1:], resets.new_zeros((1, resets.size(1))))))
        zoneout = None
        if p:
            T, B = x.size(0), x.size(1)
            Z = self._zoneout_width()
            if not self.training:  # the expectation: one [Z] vector, broadcast
                zoneout = torch.full((Z,), p, dtype=x.dtype, device=x.device).expand(T, B, Z)
        # One step (a streaming or token-by-token call): the fused step op, x W_ih^T
        # inside, instead of an input projection and a recurrence of one step --
        # one op call instead of two, which is most of such a call's cost.  (A
        # reset at the only position changes nothing: the step starts from h0.)
        one_step = x.size(0) == 1 and lengths is None and not p and self.proj_size == 0
        h_n, c_n = [], []
        for layer in range(self.num_layers):
            outputs = []
            for d in range(D):
                idx = layer * D + d
                w_ih, w_hh, b_ih, b_hh, w_hr = weights[idx]
                if one_step:
                    h, c = ops.run_step(backend, cell, x[0], h0[idx], c0[idx] if lstm else None,
                                        w_ih, w_hh, b_ih, b_hh, None if lns is None else lns[idx])
                    outputs.append(h.unsqueeze(0))
                    # h_n apart from the output, as on every other path (an
                    # in-place edit of one must not show in the other)
                    h_n.append(h.clone() if self.num_layers * D == 1 else h)
                    if lstm:
                        c_n.append(c)
                    continue
                if p and self.training:  # a fresh Bernoulli mask per layer and direction
                    zoneout = x.new_empty((T, B, Z)).bernoulli_(p)
                out, h, c = ops.run_recurrence(
                    backend, cell, ops.input_projection(x, w_ih, backend), h0[idx],
                    c0[idx] if lstm else None, w_hh, b_ih, b_hh, w_hr, lengths, d == 1,
                    step_resets[d], zoneout, None if lns is None else lns[idx])
                outputs.append(out)
                h_n.append(h)
                if lstm:
                    c_n.append(c)
            x = torch.cat(outputs, dim=2) if D == 2 else outputs[0]
            if self.dropout > 0 and self.training and layer + 1 < self.num_layers:
                x = self._dropout(x, packing)
        stack = torch.stack if len(h_n) > 1 else (lambda hs: hs[0].unsqueeze(0))
        hidden = (stack(h_n), stack(c_n)) if lstm else (stack(h_n),)
        if result_dtypes is not None:
            x = x.to(result_dtypes[0])
            hidden = tuple(h.to(dt) for h, dt in zip(hidden, result_dtypes[1:]))
        return x, hidden

    def _dropout(self, x: Tensor, packing: Optional[_Packing]) -> Tensor:
        """Dropout between layers with torch.nn's RNG use: one mask over the
        layer's output, drawn over the packed rows when lengths vary (torch.nn
        drops out PackedSequence.data), so a seeded run draws the same masks."""
        if packing is None:
            return F.dropout(x, self.dropout, training=True)
        rows = F.dropout(x[packing.time, packing.batch], self.dropout, training=True)
        return x.new_zeros(x.shape).index_put((packing.time, packing.batch), rows)

    def _autocast_result_dtypes(self, x: Tensor, hx, dtype: torch.dtype, packed: bool):
        """The dtypes returned under autocast for (output, h_n[, c_n]): rnnkern's
        rule (README, "torch.autocast"), the same on every CPU.

        On CUDA, torch.nn runs cuDNN wholly in the autocast dtype.  On the CPU,
        torch.nn's ATen path autocasts only its matrix products, and a float32
        state mixed into the pointwise math promotes the result: RNN stays in the
        autocast dtype; GRU follows h0; a packed or projected LSTM's c follows c0
        and h follows c (or stays in the autocast dtype with a projection, whose
        product is autocast).  An unpacked LSTM without projection returns the
        autocast dtype, as torch.nn's oneDNN path does where the CPU supports it
        (with AVX-512; elsewhere torch.nn's result depends on the input)."""
        if x.device.type != "cpu" or self.mode in ("RNN_TANH", "RNN_RELU"):
            return (dtype,) * (1 + len(hx))
        if self.mode == "GRU":
            h = _promote(dtype, hx[0].dtype)
            return h, h
        if not packed and self.proj_size == 0:
            return dtype, dtype, dtype
        c = _promote(dtype, hx[1].dtype)
        h = dtype if self.proj_size > 0 else c
        return h, h, c

    # ---- argument handling

    def _state_sizes(self):
        D = 2 if self.bidirectional else 1
        P = self.proj_size if self.proj_size > 0 else self.hidden_size
        return self.num_layers * D, P

    def _zeros_hidden(self, batch: int, like: Tensor):
        LD, P = self._state_sizes()
        h = torch.zeros(LD, batch, P, dtype=like.dtype, device=like.device)
        if self.mode != "LSTM":
            return (h,)
        return (h, torch.zeros(LD, batch, self.hidden_size, dtype=like.dtype, device=like.device))

    def _hx_parts(self, hx) -> tuple:
        """hx as a tuple of tensors, its type checked."""
        name = type(self).__name__
        if self.mode == "LSTM":
            if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                raise TypeError(f"{name}: hx must be a tuple (h_0, c_0) of two tensors, got "
                                f"{type(hx).__name__}")
            parts = tuple(hx)
        else:
            parts = (hx,)
        for i, h in enumerate(parts):
            if not isinstance(h, Tensor):
                label = f"hx[{i}]" if self.mode == "LSTM" else "hx"
                raise TypeError(f"{name}: {label} must be a Tensor, got {type(h).__name__}")
        return parts

    def _check_hidden(self, parts, batch: int, input: Tensor) -> None:
        """torch.nn's hidden-state checks (same messages), plus the dtype."""
        LD, P = self._state_sizes()
        if self.mode == "LSTM":
            self.check_hidden_size(parts[0], (LD, batch, P), "Expected hidden[0] size {}, got {}")
            self.check_hidden_size(parts[1], (LD, batch, self.hidden_size),
                                   "Expected hidden[1] size {}, got {}")
        else:
            self.check_hidden_size(parts[0], (LD, batch, P))
        if not _any_autocast():
            for i, h in enumerate(parts):
                if h.dtype != input.dtype:
                    label = f"hx[{i}]" if self.mode == "LSTM" else "hx"
                    raise _dtype_mismatch(type(self).__name__, label, h.dtype, "input", input.dtype)

    # ---- forward

    def _check_resets(self, resets, T: int, B: int, batched: bool, device) -> Tensor:
        """``resets`` as the ops take it: [T, B] bool, time-major, contiguous, on
        the input's device; errors name the argument and the shape expected
        ([T, B], [B, T] with batch_first, [T] for unbatched input)."""
        name = type(self).__name__
        if not batched:
            layout, shape = "[T]", [T]
        elif self.batch_first:
            layout, shape = "[B, T] (batch_first)", [B, T]
        else:
            layout, shape = "[T, B]", [T, B]
        if not isinstance(resets, Tensor):
            raise TypeError(f"{name}: expected resets to be a bool Tensor of shape {layout} = "
                            f"{shape}, got {type(resets).__name__}")
        if list(resets.shape) != shape:
            raise ValueError(f"{name}: expected resets of shape {layout} = {shape}, got "
                             f"{list(resets.shape)}")
        if resets.dtype != torch.bool:
            raise TypeError(f"{name}: expected resets of dtype torch.bool, got {resets.dtype}")
        if resets.device != device:
            raise ValueError(f"{name}: expected resets on {device} (the input's device), got "
                             f"{resets.device}")
        if not batched:
            return resets.unsqueeze(1)
        return resets.t().contiguous() if self.batch_first else resets.contiguous()

    def forward(self, input, hx=None, *, lengths: Optional[Tensor] = None,
                resets: Optional[Tensor] = None):
        """As torch.nn's forward.  ``lengths`` ([B] integers) marks the valid steps
        of each sequence of a padded batch: later steps leave the state alone and
        output zeros, and the reverse direction starts at each sequence's end --
        what torch.nn computes on ``pack_padded_sequence(input, lengths,
        enforce_sorted=False)``, without packing.

        ``resets`` (bool; [T, B], [B, T] with batch_first, [T] for unbatched
        input; for a PackedSequence the padded [T, B] / [B, T] in the original
        batch order): where ``resets[t, b]``, the step at position t of
        sequence b starts from hx's row b (zeros without hx), h and c, in every
        layer; a reverse direction restarts at the step before each boundary,
        so the episodes on either side of it never see each other."""
        if _runs_torch_nn_forward():
            return self._traced_forward(input, hx, lengths, resets)
        name = type(self).__name__
        if isinstance(input, PackedSequence):
            if lengths is not None:
                raise ValueError(f"{name}: lengths= is for padded input; a PackedSequence carries its own")
            return self._forward_packed(input, hx, resets)

        if not isinstance(input, Tensor):
            raise TypeError(f"{name}: expected input to be a Tensor or a PackedSequence, got "
                            f"{type(input).__name__}")
        if input.dim() not in (2, 3):
            raise ValueError(f"{name}: Expected input to be 2D or 3D, got {input.dim()}D instead")
        batched = input.dim() == 3
        batch_dim = 0 if self.batch_first else 1
        if not batched:
            if lengths is not None:
                raise ValueError(f"{name}: lengths= needs batched (3-D) input")
            input = input.unsqueeze(batch_dim)
        B = input.size(batch_dim)
        if hx is None:
            hx = self._zeros_hidden(B, input)
            self.check_input(input, None)
        else:
            parts = self._hx_parts(hx)
            want = 3 if batched else 2
            if any(h.dim() != want for h in parts):
                kind = "batched 3-D" if batched else "unbatched 2-D"
                if self.mode == "LSTM":
                    got = f"({parts[0].dim()}-D, {parts[1].dim()}-D) tensors"
                    raise RuntimeError(f"For {kind} input, hx and cx should also be {want}-D but got {got}")
                raise RuntimeError(f"For {kind} input, hx should also be {want}-D but got "
                                   f"{parts[0].dim()}-D tensor")
            if not batched:
                parts = tuple(h.unsqueeze(1) for h in parts)
            self.check_input(input, None)
            self._check_hidden(parts, B, input)
            hx = parts
        if self.batch_first:
            input = input.transpose(0, 1)
        T = input.size(0)
        if T == 0:
            raise RuntimeError("Expected sequence length to be larger than 0 in RNN")
        if resets is not None:
            resets = self._check_resets(resets, T, B, batched, input.device)
        packing = None
        if lengths is not None:
            lengths = _check_lengths(lengths, T, B, name)
            if self.dropout > 0 and self.training and self.num_layers > 1 \
                    and not torch.compiler.is_compiling():
                # The packed rows' count is data-dependent: eager only.  Under
                # torch.compile dropout draws over the padded tensor (its random
                # stream differs from eager's anyway).
                packing = _packing_of_padded(lengths, T, input.device)
        out, hidden = self._run_layers(input, hx, lengths, packing, resets)
        if self.batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(batch_dim)
            hidden = tuple(h.squeeze(1) for h in hidden)
        return out, (hidden if self.mode == "LSTM" else hidden[0])

    def _traced_forward(self, input, hx, lengths: Optional[Tensor], resets: Optional[Tensor]):
        """torch.nn's forward, for torch.jit.trace and ONNX export; ``lengths=``
        becomes the PackedSequence torch.nn computes the same numbers on."""
        if resets is not None:
            raise _no_torch_nn_twin(f"{type(self).__name__}.forward(resets=...)", "has no resets")
        if lengths is None:
            return self._torch_nn_forward(input, hx)
        name = type(self).__name__
        if not isinstance(input, Tensor) or input.dim() != 3:
            raise ValueError(f"{name}: lengths= needs batched (3-D) input")
        T = input.size(1 if self.batch_first else 0)
        lengths = _check_lengths(lengths, T, input.size(0 if self.batch_first else 1), name)
        packed = pack_padded_sequence(input, lengths, batch_first=self.batch_first,
                                      enforce_sorted=False)
        out, hidden = self._torch_nn_forward(packed, hx)
        out, _ = pad_packed_sequence(out, batch_first=self.batch_first, total_length=T)
        return out, hidden

    def _forward_packed(self, input: PackedSequence, hx, resets: Optional[Tensor]):
        """A PackedSequence runs as one padded, length-sorted batch with per-sequence
        lengths (one kernel call per layer and direction, padding never computed).
        ``resets`` comes padded in the original batch order and is sorted here."""
        name = type(self).__name__
        data, batch_sizes, sorted_indices, unsorted_indices = input
        self.check_input(data, batch_sizes)
        T, N = batch_sizes.numel(), data.size(0)
        if not torch.compiler.is_compiling() and int(batch_sizes.sum()) != N:
            raise RuntimeError(f"{name}: PackedSequence data has {N} rows but its batch_sizes "
                               f"sum to {int(batch_sizes.sum())}")
        # The batch size, from shapes where possible (a data-dependent size
        # would break a torch.compile graph): the permutation of an unsorted
        # pack, else hx under compile, else the first batch size.
        if sorted_indices is not None:
            B = sorted_indices.numel()
        elif hx is not None and torch.compiler.is_compiling():
            B = self._hx_parts(hx)[0].size(1)
        else:
            B = int(batch_sizes[0])
        if hx is None:
            hx = self._zeros_hidden(B, data)
        else:
            parts = self._hx_parts(hx)
            self._check_hidden(parts, B, data)
            hx = self.permute_hidden(hx, sorted_indices)
            hx = tuple(hx) if self.mode == "LSTM" else (hx,)
        if resets is not None:
            resets = self._check_resets(resets, T, B, True, data.device)
            if sorted_indices is not None:
                resets = resets[:, sorted_indices]
        packing = _packing_from_batch_sizes(batch_sizes, N, data.device)
        # Sequence b of the sorted pack has as many steps as batch sizes above b.
        lengths = (batch_sizes.unsqueeze(1) > torch.arange(B).unsqueeze(0)).sum(0)
        padded = data.new_zeros((T, B, data.size(1))).index_put((packing.time, packing.batch), data)
        out, hidden = self._run_layers(padded, hx, lengths, packing, resets)
        out_data = out[packing.time, packing.batch]
        hidden = hidden if self.mode == "LSTM" else hidden[0]
        return (PackedSequence(out_data, batch_sizes, sorted_indices, unsorted_indices),
                self.permute_hidden(hidden, unsorted_indices))


class RNN(_RecurrentMixin, nn.RNN):
    """Drop-in for :class:`torch.nn.RNN` (tanh or ReLU), plus ``backend=`` and
    ``zoneout=``."""

    def __init__(self, *args, backend: str = "auto", zoneout: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_rnnkern(backend, zoneout=zoneout)


class GRU(_RecurrentMixin, nn.GRU):
    """Drop-in for :class:`torch.nn.GRU`, plus ``backend=``, ``reset_after=`` and
    ``zoneout=``."""

    def __init__(self, *args, backend: str = "auto", reset_after: bool = True,
                 zoneout: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_rnnkern(backend, reset_after, zoneout)


class LSTM(_RecurrentMixin, nn.LSTM):
    """Drop-in for :class:`torch.nn.LSTM` (with ``proj_size``), plus ``backend=``
    and ``zoneout=`` (on h and c)."""

    def __init__(self, *args, backend: str = "auto", zoneout: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_rnnkern(backend, zoneout=zoneout)


#: The layer norms' parameters of lstm_ln, in the order of the op's ``ln``: name
#: stem, width in hidden units, initial value.
_LN_PARAMETERS = (("ln_ih_weight", 4, 1.0), ("ln_hh_weight", 4, 1.0),
                  ("ln_cell_weight", 1, 1.0), ("ln_cell_bias", 1, 0.0))


class LayerNormLSTM(_RecurrentMixin, nn.RNNBase):
    """The layer-normalised LSTM (haste's LayerNormLSTM, torch's gate order i, f, g, o)::

        a   = LN(x W_ih^T) * g_ih + LN(h W_hh^T) * g_hh + b_ih + b_hh
        c_t = sigmoid(f) * c_{t-1} + sigmoid(i) * tanh(g)
        h_t = sigmoid(o) * tanh(LN(c_t) * g_c + beta_c)

    (LN: normalisation over the whole vector, eps 1e-5.)  The constructor and
    forward are torch.nn.LSTM's without ``proj_size``, plus ``zoneout=`` and
    ``backend=``; forward takes the same inputs (padded, ``lengths=``,
    PackedSequence, hx = (h_0, c_0), batch_first, unbatched, ``resets=``).

    Parameters: torch.nn.LSTM's (``weight_ih_l{k}[_reverse]``, ``weight_hh_...``,
    ``bias_ih_...``, ``bias_hh_...``, with its initialisation: a seeded
    construction draws torch.nn.LSTM's values), then per layer and direction
    ``ln_ih_weight_l{k}[_reverse]`` (g_ih, 4H), ``ln_hh_weight_...`` (g_hh, 4H),
    ``ln_cell_weight_...`` (g_c, H), ``ln_cell_bias_...`` (beta_c, H); gains
    start at 1, the shift at 0.

    A subclass of torch.nn.RNNBase (the parameter bookkeeping of torch.nn.LSTM,
    whose cuDNN flattening and ``_flat_weights`` it shares), not of
    torch.nn.LSTM: ``isinstance(m, nn.LSTM)`` would promise torch.nn's function.
    So torch.compile does not need ``torch._dynamo.config.allow_rnn`` for it.
    """

    _has_torch_nn_twin = False
    #: hx is the pair (h, c), permuted as torch.nn.LSTM permutes it.
    permute_hidden = nn.LSTM.permute_hidden

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 zoneout: float = 0.0, backend: str = "auto", device=None, dtype=None):
        super().__init__("LSTM", input_size, hidden_size, num_layers=num_layers, bias=bias,
                         batch_first=batch_first, dropout=dropout, bidirectional=bidirectional,
                         proj_size=0, device=device, dtype=dtype)
        names = []
        for layer in range(num_layers):
            for suffix in ("", "_reverse")[:2 if bidirectional else 1]:
                group = []
                for stem, width, _ in _LN_PARAMETERS:
                    name = f"{stem}_l{layer}{suffix}"
                    setattr(self, name, nn.Parameter(
                        torch.empty(width * hidden_size, device=device, dtype=dtype)))
                    group.append(name)
                names.append(tuple(group))
        self._ln_names = names
        self._reset_ln()
        self._init_rnnkern(backend, zoneout=zoneout)

    @property
    def cell(self) -> str:
        return "lstm_ln"

    def reset_parameters(self) -> None:
        """torch.nn.LSTM's initialisation of its weights and biases (the same
        draws in the same order), gains 1 and shifts 0."""
        stdv = 1.0 / math.sqrt(self.hidden_size)
        for name in self._flat_weights_names:
            nn.init.uniform_(getattr(self, name), -stdv, stdv)
        self._reset_ln()

    def _reset_ln(self) -> None:
        # (torch.nn.RNNBase.__init__ calls reset_parameters before the layer
        # norms' parameters exist.)
        with torch.no_grad():
            for names in self._ln_names or ():
                for name, (_, _, value) in zip(names, _LN_PARAMETERS):
                    getattr(self, name).fill_(value)

    def _autocast_result_dtypes(self, x: Tensor, hx, dtype: torch.dtype, packed: bool):
        """Under autocast every result is in the autocast dtype (torch.nn has no
        layer-norm LSTM whose CPU quirks to follow; its CUDA rule)."""
        return (dtype,) * 3


# ---------------------------------------------------------------- cells ----

def _check_cell_sizes(input_size, hidden_size) -> None:
    # torch.nn's cells take sizes of 0 (hidden_size=0 gives empty states) and
    # fail on other bad sizes from inside their init (TypeError for a float,
    # RuntimeError for a negative size); the same types, with messages that
    # name the argument.
    for arg, value in (("input_size", input_size), ("hidden_size", hidden_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{arg} should be of type int, got: {type(value).__name__}")
        if value < 0:
            raise RuntimeError(f"{arg} must be non-negative, got {value}")


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
        if lstm and (not isinstance(hx, (tuple, list)) or len(hx) != 2):
            raise TypeError(f"{name}: hx must be a tuple (h, c) of two tensors, got {type(hx).__name__}")
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
        autocast = _autocast_dtype(x.device.type, weights[0]) if _any_autocast() else None
        if autocast is None and x.dtype != weights[0].dtype:
            raise _dtype_mismatch(name, "input", x.dtype, "weight", weights[0].dtype)
        if parts is None:
            zeros = torch.zeros(B, self.hidden_size, dtype=x.dtype, device=x.device)
            parts = (zeros, zeros) if lstm else (zeros,)
        for i, h in enumerate(parts):
            if h.size(0) != B:
                raise RuntimeError(f"{name}: Input batch size {B} doesn't match hidden{i} batch "
                                   f"size {h.size(0)}")
            if h.size(1) != self.hidden_size:
                raise RuntimeError(f"{name}: hidden{i} has inconsistent hidden_size: got "
                                   f"{h.size(1)}, expected {self.hidden_size}")
            if autocast is None and h.dtype != x.dtype:
                raise _dtype_mismatch(name, f"hx[{i}]" if lstm else "hx", h.dtype, "input", x.dtype)
        result_dtypes = None
        if autocast is not None:
            result_dtypes = self._autocast_result_dtypes(x, parts, autocast)
            x, parts = x.to(autocast), tuple(h.to(autocast) for h in parts)
            weights = tuple(_cast(w, autocast) for w in weights)
            ln = _cast(ln, autocast)
        backend = self.backend
        if not (backend == "cpu" or backend == "auto") or x.device.type != "cpu":
            backend = ops.resolve_backend(backend, x.device)
        else:
            backend = "cpu"
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

    def __init__(self, input_size, hidden_size, *args, backend: str = "auto",
                 zoneout: float = 0.0, **kwargs):
        _check_cell_sizes(input_size, hidden_size)
        super().__init__(input_size, hidden_size, *args, **kwargs)
        self._init_rnnkern(backend, zoneout=zoneout)


class GRUCell(_CellMixin, nn.GRUCell):
    """Drop-in for :class:`torch.nn.GRUCell`, plus ``backend=``, ``reset_after=``
    and ``zoneout=``."""

    def __init__(self, input_size, hidden_size, *args, backend: str = "auto",
                 reset_after: bool = True, zoneout: float = 0.0, **kwargs):
        _check_cell_sizes(input_size, hidden_size)
        super().__init__(input_size, hidden_size, *args, **kwargs)
        self._init_rnnkern(backend, reset_after, zoneout)


class LSTMCell(_CellMixin, nn.LSTMCell):
    """Drop-in for :class:`torch.nn.LSTMCell`, plus ``backend=`` and ``zoneout=``."""

    def __init__(self, input_size, hidden_size, *args, backend: str = "auto",
                 zoneout: float = 0.0, **kwargs):
        _check_cell_sizes(input_size, hidden_size)
        super().__init__(input_size, hidden_size, *args, **kwargs)
        self._init_rnnkern(backend, zoneout=zoneout)


class LayerNormLSTMCell(_CellMixin, nn.RNNCellBase):
    """One step of :class:`LayerNormLSTM` (cell ``lstm_ln``): ``forward(input,
    hx=None) -> (h, c)``, as torch.nn.LSTMCell's (hx = (h, c) or None for zeros,
    unbatched 1-D input, the same error messages).

    Parameters: torch.nn.LSTMCell's (``weight_ih`` [4H, I], ``weight_hh`` [4H, H],
    ``bias_ih``, ``bias_hh``; its initialisation), then ``ln_ih_weight`` (4H),
    ``ln_hh_weight`` (4H), ``ln_cell_weight`` (H), ``ln_cell_bias`` (H): gains 1,
    shift 0.  A subclass of torch.nn.RNNCellBase, not of torch.nn.LSTMCell."""

    _has_torch_nn_twin = False

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, zoneout: float = 0.0,
                 backend: str = "auto", device=None, dtype=None):
        _check_cell_sizes(input_size, hidden_size)
        super().__init__(input_size, hidden_size, bias, num_chunks=4, device=device, dtype=dtype)
        for stem, width, _ in _LN_PARAMETERS:
            setattr(self, stem, nn.Parameter(torch.empty(width * hidden_size, device=device,
                                                         dtype=dtype)))
        self._reset_ln()
        self._init_rnnkern(backend, zoneout=zoneout)

    @property
    def cell(self) -> str:
        return "lstm_ln"

    def _ln(self) -> Tensor:
        """The op's ``ln``: ``[g_ih (4H), g_hh (4H), g_c (H), beta_c (H)]``."""
        return torch.cat([self.ln_ih_weight, self.ln_hh_weight, self.ln_cell_weight,
                          self.ln_cell_bias])

    def reset_parameters(self) -> None:
        """torch.nn.LSTMCell's initialisation of its weights and biases (the same
        draws in the same order), gains 1 and shift 0."""
        stdv = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            weight = getattr(self, name)
            if weight is not None:
                nn.init.uniform_(weight, -stdv, stdv)
        self._reset_ln()

    def _reset_ln(self) -> None:
        # (torch.nn.RNNCellBase.__init__ calls reset_parameters before the layer
        # norms' parameters exist.)
        with torch.no_grad():
            for stem, _, value in _LN_PARAMETERS:
                if getattr(self, stem, None) is not None:
                    getattr(self, stem).fill_(value)

    def _autocast_result_dtypes(self, x: Tensor, parts, dtype: torch.dtype):
        """Every result in the autocast dtype (as LayerNormLSTM)."""
        return (dtype, dtype)


# -------------------------------------------------------------- convert ----

_REPLACEMENTS = {
    nn.RNN: RNN, nn.GRU: GRU, nn.LSTM: LSTM,
    nn.RNNCell: RNNCell, nn.GRUCell: GRUCell, nn.LSTMCell: LSTMCell,
}


def convert(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Turns every torch.nn RNN/GRU/LSTM (and cell) inside ``model`` into its rnnkern
    twin, in place: the same module objects and the same parameters, so the model
    computes the same function.  Returns ``model``.

    Only modules whose type is exactly a torch.nn recurrent class change (a
    subclass may override ``forward``); modules that already are rnnkern's are
    left as they are, so converting twice changes nothing."""
    _check_backend(backend)
    for module in model.modules():
        original = type(module)
        replacement = _REPLACEMENTS.get(original)
        if replacement is not None:
            module.__class__ = replacement
            try:
                module._init_rnnkern(backend)
            except ValueError:  # an RNNCell with an unknown nonlinearity: leave it as it was
                module.__class__ = original
                raise
    return model

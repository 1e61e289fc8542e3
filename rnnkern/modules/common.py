"""What the sequence modules and the cells share: the backends' coverage
(:data:`UNSUPPORTED` and its check), argument checks, torch.jit.trace / ONNX
export's switch to torch.nn's forward, autocast, and :class:`_RnnkernOptions`
(the keywords rnnkern adds to torch.nn's classes)."""
from __future__ import annotations

import numbers
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from .. import ops

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


class _RnnkernOptions:
    """The keywords rnnkern adds to the torch.nn modules and cells: ``backend``,
    ``reset_after`` (GRU) and ``zoneout``, checked and shown in the repr.
    Subclasses say which rnnkern cell they run (``cell``)."""

    #: The options are plain attributes, so state_dict stays torch.nn's.  The
    #: class defaults serve modules whose pickle lacks them: pickled before an
    #: option existed, or a torch.nn module's pickle loaded under rnnkern.patch().
    backend: str = "auto"
    reset_after: bool = True
    #: The zoneout probability.
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

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
from torch.fx import Proxy as _FxProxy

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


def _fx_leaf_call(module: nn.Module, own_forward, input, args: tuple, kwargs: dict):
    """Under ``torch.fx.symbolic_trace`` (``input`` a Proxy): the module's call
    recorded as one ``call_module`` node, as FX records torch.nn's recurrent
    modules; None otherwise.

    Why: FX's tracer keeps the modules of torch.nn's namespace whole (its
    ``is_leaf_module`` reads the class's ``__module__``) and traces into every
    other module's forward, whose checks and choices of kernel cannot run on
    Proxies.  Here the module makes the leaf's call itself, so a traced model
    holding rnnkern's modules (built so, converted or patched) has torch.nn's
    graph, and the GraphModule calls the same module objects.  Traced as the
    root itself, torch.nn's modules fail (their forward's control flow); so does
    this, with FX's error type, and so does a subclass's forward that reaches
    ``own_forward`` (rnnkern's) through super(), as it does reaching torch.nn's."""
    if not isinstance(input, _FxProxy):
        return None
    if type(module).forward is not own_forward:
        # Reached through a subclass's forward (super().forward): a call_module node
        # would run that forward again around the ops FX recorded from it.
        raise torch.fx.proxy.TraceError(
            f"{type(module).__name__}: its forward, which calls rnnkern's (or torch.nn's) on "
            "Proxies, cannot be traced by torch.fx.symbolic_trace, as torch.nn's cannot: make the "
            "module a leaf of the tracer (a Tracer whose is_leaf_module says so)")
    tracer = input.tracer
    path = tracer.path_of_module(module)
    if not path:
        raise torch.fx.proxy.TraceError(
            f"{type(module).__name__}: torch.fx.symbolic_trace records it as a leaf (one call_module "
            "node), as torch.nn's recurrent modules; as the traced root itself it has no graph of its "
            "own: trace the model that holds it")
    return tracer.create_proxy("call_module", path, args,
                               {k: v for k, v in kwargs.items() if v is not None})


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


def _indexed_pair(hx, name: str, pair: str) -> tuple:
    """(hx[0], hx[1]) of a tensor, tuple or list, as torch.nn's LSTM forward indexes
    hx: an IndexError where there is no second state (torch.nn's type), saying what
    was expected.  ``pair``: how the module names its states, "(h_0, c_0)"."""
    short = (hx.dim() == 0 or hx.size(0) < 2) if isinstance(hx, Tensor) else len(hx) < 2
    if short:
        got = f"shape {list(hx.shape)}" if isinstance(hx, Tensor) else f"{len(hx)} state"
        raise IndexError(f"{name}: hx must be a tuple {pair} of two tensors (torch.nn indexes "
                         f"hx[0] and hx[1]), got a {type(hx).__name__} of {got}")
    return hx[0], hx[1]


def _well_formed_state(hx, lstm: bool, shape: tuple, dtype: torch.dtype):
    """``hx`` (not None) as ``(h, c)`` (c None without a cell state) when it is a
    tensor -- a pair of them for an LSTM -- of exactly ``shape`` and ``dtype``;
    else None.  The modules' one-step and cell fast paths take a call only with
    such a state, leaving every other to the full forward's checks and errors."""
    if lstm:
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            return None
        h, c = hx
        if isinstance(h, Tensor) and isinstance(c, Tensor) and h.shape == shape \
                and c.shape == shape and h.dtype == dtype and c.dtype == dtype:
            return h, c
        return None
    if isinstance(hx, Tensor) and hx.shape == shape and hx.dtype == dtype:
        return hx, None
    return None


def _plain_weights(module: nn.RNNBase) -> Optional[list]:
    """A sequence module's weights (by torch.nn's ``_flat_weights_names``) where
    every one is an entry of ``_parameters`` (a Parameter, or the tensor
    torch.func.functional_call swapped in): read there, with no side effect,
    about 0.4 us a lookup cheaper than nn.Module.__getattr__ (a one-step call
    feels it).  None where one is not (a parametrization made it a property, a
    plain attribute took its place, or it is registered as None)."""
    params = module._parameters
    out = []
    for name in module._flat_weights_names:
        t = params.get(name)
        if t is None:
            return None
        out.append(t)
    return out


def _flat_weights(module: nn.RNNBase) -> list:
    """The weights a call of a sequence module runs on, read once per call:
    :func:`_plain_weights`, else as torch.nn's forward reads them, by its own
    code (``_update_flat_weights``).  Reading a parametrized weight evaluates
    its parametrization, and a stateful one changes with each evaluation:
    spectral_norm runs a step of its power iteration per evaluation in
    training.  torch.nn's forward evaluates a parametrization more than once
    (torch 2.14: twice for each weight, and twice more for the first when a
    parametrization returns a new tensor); the same reads leave the same
    state, so a spectral-normed module computes torch.nn's numbers call after
    call."""
    plain = _plain_weights(module)
    if plain is not None:
        return plain
    module._update_flat_weights()
    return list(module._flat_weights)


def _first_weight(module: nn.RNNBase) -> Tensor:
    """The first weight's tensor for its dtype, device and requires_grad, read
    without evaluating a parametrization (see :func:`_flat_weights`): from
    ``_parameters``, else torch.nn's ``_flat_weights`` as its last read left
    it (or its Parameter before any)."""
    name = module._flat_weights_names[0]
    t = module._parameters.get(name)
    if t is not None:
        return t
    t = module._flat_weights[0]
    return t if isinstance(t, Tensor) else getattr(module, name)


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

    def _without_torch_nn_form(self) -> Optional[tuple]:
        """None when torch.nn's forward computes this module's function on its
        parameters; otherwise (the module as the error names it, what torch.nn
        lacks).  One place for trace, ONNX export and torch.jit.script."""
        name = type(self).__name__
        if not self._has_torch_nn_twin:
            return name, "has no layer-normalised LSTM"
        if not self.reset_after:
            return f"{name}(reset_after=False)", "has only the reset-after GRU"
        if self.zoneout:
            return f"{name}(zoneout={self.zoneout})", "has no zoneout"
        return None

    def _torch_nn_forward(self, *args):
        """The torch.nn base class's forward (see :func:`_runs_torch_nn_forward`)."""
        lacking = self._without_torch_nn_form()
        if lacking is not None:
            raise _no_torch_nn_twin(*lacking)
        return super(_RnnkernOptions, self).forward(*args)

    def _class_before_rnnkern(self) -> type:
        """The class this module had without rnnkern: torch.nn's (the base after
        the rnnkern mixins), or the user's subclass that convert() converted."""
        cls = type(self)
        converted_from = getattr(cls, "_rnnkern_converted_from", None)
        return converted_from or cls.__mro__[cls.__mro__.index(_RnnkernOptions) + 1]

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every module before compiling it, and
        # writes what it returns back into the parent's _modules -- the user's
        # own model (torch 2.14, torch/jit/_script.py,
        # call_prepare_scriptable_func_impl) -- so returning another module
        # would swap it into the eager model.  Instead this module stays in its
        # place and its class becomes, until its next eager call, the class it
        # had without rnnkern (see _scripting_class): TorchScript compiles
        # torch.nn's forward on these same Parameter objects, and the scripted
        # module holds aten::lstm & co., loadable without rnnkern, as trace does.
        lacking = self._without_torch_nn_form()
        if lacking is not None:
            subject, lacks = lacking
            raise RuntimeError(
                f"torch.jit.script cannot compile rnnkern.{subject}: torch.jit.script compiles "
                f"torch.nn's forward on the same parameters, and torch.nn {lacks}. "
                f"Use torch.export.export or torch.compile (they capture rnnkern's own ops).")
        self.__class__ = _scripting_class(self._class_before_rnnkern(), type(self))
        return self


_scripting_classes: dict = {}


def _scripting_class(before: type, ours: type) -> type:
    """The class a module scripts under: a subclass of ``before`` (torch.nn's
    class, or the user's subclass convert() converted) under its very name,
    qualname and module.  TorchScript then treats it as ``before`` itself: it
    finds torch.nn's forward overloads by the class's name and checks them
    against the class's source lines (found through module and qualname), and
    names the compiled type ``__torch__.torch.nn.modules.rnn.LSTM``.

    Its ``__call__`` (TorchScript never calls it) gives the module its rnnkern
    class ``ours`` back and runs it: the eager model's next call runs rnnkern
    again.  ``convert()``, pickling and deepcopy give it back too."""
    key = (before, ours)
    cls = _scripting_classes.get(key)
    if cls is None:
        def __call__(self, *args, **kwargs):
            self.__class__ = ours
            return self(*args, **kwargs)

        def __reduce_ex__(self, protocol):
            self.__class__ = ours
            return self.__reduce_ex__(protocol)

        cls = type(before)(before.__name__, (before,), {
            "__module__": before.__module__, "__qualname__": before.__qualname__,
            "__call__": __call__, "__reduce_ex__": __reduce_ex__, "_rnnkern_class": ours})
        _scripting_classes[key] = cls
    return cls

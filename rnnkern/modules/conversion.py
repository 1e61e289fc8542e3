"""convert(): torch.nn's recurrent modules inside a model become rnnkern's, in
place -- torch.nn's own classes and the subclasses whose forward reaches
torch.nn's -- and conversion_report(), which says what convert() did or would do."""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import threading
import warnings
from typing import NamedTuple, Optional

import torch.nn as nn

from .cells import GRUCell, LSTMCell, RNNCell
from .common import _check_backend, _RnnkernOptions
from .sequence import GRU, LSTM, RNN

#: torch.nn's recurrent classes and their rnnkern twins.
_REPLACEMENTS = {
    nn.RNN: RNN, nn.GRU: GRU, nn.LSTM: LSTM,
    nn.RNNCell: RNNCell, nn.GRUCell: GRUCell, nn.LSTMCell: LSTMCell,
}


class ConversionEntry(NamedTuple):
    """One recurrent module of a model, as :func:`conversion_report` lists it."""
    name: str    # its qualified name in the model ("" for the model itself)
    cls: str     # its class, module.qualname (a converted subclass shows its own class)
    status: str  # "rnnkern", "convertible" or "skipped: <why>"


# ----------------------------------------------------- subclasses' forward ----

def _calls_super_forward(fn) -> Optional[str]:
    """None when the source of ``fn`` calls ``super().forward(...)`` or
    ``super(...).forward(...)`` (or names a torch.nn recurrent class's forward,
    ``nn.LSTM.forward(self, ...)``); otherwise why not.

    Why source inspection: it decides without running the module (a conversion
    must not need an input), and a forward that cannot reach torch.nn's cannot
    reach rnnkern's either, so converting it would only change its type.  A
    forward whose source cannot be read (built by exec, a C function) counts as
    not reaching: converting what we cannot read would be a guess."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError) as e:
        return f"the source of {fn.__qualname__} cannot be read ({type(e).__name__})"
    torch_names = {c.__name__ for c in _REPLACEMENTS}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "forward"):
            continue
        owner = node.func.value
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) \
                and owner.func.id == "super":
            return None
        # nn.LSTM.forward(self, ...) / torch.nn.LSTM.forward(self, ...) / LSTM.forward(self, ...)
        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
        if name in torch_names:
            return None
    return f"{fn.__qualname__} does not call super().forward"


def _torch_nn_base(cls: type) -> Optional[type]:
    """The torch.nn recurrent class that ``cls`` derives from (None: none)."""
    for base in cls.__mro__:
        if base in _REPLACEMENTS:
            return base
    return None


@functools.lru_cache(maxsize=None)
def _why_not(cls: type) -> Optional[str]:
    """None when convert() converts the instances of ``cls`` (a torch.nn recurrent
    class, or a subclass whose forward reaches torch.nn's); otherwise why they
    are left alone.  Only for torch.nn recurrent classes not yet rnnkern's.
    Cached: patch() asks at every construction."""
    base = _torch_nn_base(cls)
    if cls is base:
        return None
    # Every class between the subclass and torch.nn's that defines forward is on
    # the path from the module's call to torch.nn's forward: each must pass it on.
    for klass in cls.__mro__[:cls.__mro__.index(base)]:
        if "forward" in vars(klass):
            why = _calls_super_forward(vars(klass)["forward"])
            if why is not None:
                return why
    return None


# --------------------------------------------------- converted subclasses ----

_converted_classes: dict = {}
_lock = threading.Lock()


def _converted_class(cls: type) -> type:
    """The class a converted instance of the torch.nn subclass ``cls`` gets:
    ``cls`` first, then rnnkern's twin, so the subclass's own methods run and its
    ``super().forward`` reaches rnnkern's forward (the MRO is cls, cls's mixins,
    rnnkern's class and its mixins, then torch.nn's class).  One per ``cls``.

    It carries ``cls``'s name, qualname and module (repr, error messages), and
    pickles as ``cls`` plus the module's state (see :func:`_rebuild`): a
    generated class cannot be imported by name."""
    with _lock:
        generated = _converted_classes.get(cls)
        if generated is None:
            twin = _REPLACEMENTS[_torch_nn_base(cls)]
            # (built by cls's metaclass: pytorch-forecasting's mixins derive from ABC)
            generated = type(cls)(cls.__name__, (cls, twin), {
                "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__, "_rnnkern_converted_from": cls,
                "__reduce_ex__": _reduce_converted,
            })
            _converted_classes[cls] = generated
        return generated


def _reduce_converted(self, protocol):
    # What pickle, copy.deepcopy and torch.save(model) record of a converted
    # subclass: the user's class (importable) and the state, rnnkern's options
    # included (they live in __dict__); loading converts again (_rebuild).
    return _rebuild, (type(self)._rnnkern_converted_from,), self.__getstate__()


def _rebuild(cls: type) -> nn.Module:
    """Unpickling a converted subclass: an empty instance of its converted class
    (pickle then calls ``__setstate__`` with the saved state, as for any module)."""
    generated = _converted_class(cls)
    return generated.__new__(generated)


# ------------------------------------------------------------ convert ----

def _recurrent_modules(model: nn.Module):
    """(name, module, status) of every recurrent module in ``model``."""
    for name, module in model.named_modules():
        # (a module torch.jit.script left under its torch.nn class until its next
        # call, see common._scripting_class, is rnnkern's)
        if isinstance(module, _RnnkernOptions) or hasattr(type(module), "_rnnkern_class"):
            yield name, module, "rnnkern"
        elif _torch_nn_base(type(module)) is not None:
            why = _why_not(type(module))
            yield name, module, "convertible" if why is None else f"skipped: {why}"


def conversion_report(model: nn.Module) -> list:
    """Every recurrent module in ``model`` as ``(name, cls, status)``
    (:class:`ConversionEntry`), in ``named_modules`` order: ``"rnnkern"`` (rnnkern
    runs it: built so, or converted), ``"convertible"`` (``convert`` would
    convert it) or ``"skipped: <why>"`` (``convert`` leaves it as it is).
    Changes nothing; after ``convert(model)`` only the first and the last remain."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"conversion_report: model should be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    return [ConversionEntry(name, f"{type(m).__module__}.{type(m).__qualname__}", status)
            for name, m, status in _recurrent_modules(model)]


def convert(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Turns every torch.nn RNN/GRU/LSTM (and cell) inside ``model`` into its rnnkern
    twin, in place: the same module objects and the same parameters, so the model
    computes the same function.  Returns ``model``.

    A subclass of those classes is converted when its forward reaches torch.nn's:
    it does not override forward, or every override on the way calls
    ``super().forward`` (pytorch-forecasting's LSTM/GRU, which pack by lengths
    and call ``super().forward``).  Its class becomes a generated subclass of
    both its own class and rnnkern's twin (``isinstance`` holds for either), so
    its methods run and ``super().forward`` runs rnnkern's.  Any other subclass
    is left as it is, with a warning naming it (:func:`conversion_report` lists
    both kinds).  Modules that already are rnnkern's are left as they are, so
    converting twice changes nothing."""
    _check_backend(backend)
    for name, module, status in list(_recurrent_modules(model)):
        if status == "rnnkern":
            module.__class__ = getattr(type(module), "_rnnkern_class", type(module))
            continue
        if status != "convertible":
            warnings.warn(f"rnnkern.convert: left {name or '(the model itself)'!r} "
                          f"({type(module).__module__}.{type(module).__qualname__}) as it is: "
                          f"{status[len('skipped: '):]}", stacklevel=2)
            continue
        original = type(module)
        module.__class__ = _REPLACEMENTS[original] if original in _REPLACEMENTS \
            else _converted_class(original)
        try:
            module._init_rnnkern(backend)
        except ValueError:  # an RNNCell with an unknown nonlinearity: leave it as it was
            module.__class__ = original
            raise
    return model

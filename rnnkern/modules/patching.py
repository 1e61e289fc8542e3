"""patch() / unpatch(): while patched, constructing (or unpickling) torch.nn's
recurrent modules gives rnnkern's.

How: torch.nn.RNN/GRU/LSTM/RNNCell/GRUCell/LSTMCell get a ``__new__`` that, for
the exact torch.nn class and while a patch is active, allocates rnnkern's twin
instead (and otherwise allocates as before: see :func:`_install`); Python then runs the
twin's ``__init__`` (``type.__call__`` initialises the object ``__new__``
returned when it is an instance of the class called, which a subclass's is).
The names stay torch.nn's own classes, so:

- every spelling reaches it, ``torch.nn.LSTM``, ``torch.nn.modules.rnn.LSTM`` and
  a ``from torch.nn import LSTM`` done before patching alike;
- ``isinstance(m, torch.nn.LSTM)`` holds for everything, before, during and after;
- unpickling (``torch.load`` of a whole model) allocates through
  ``cls.__new__(cls)`` too (pickle's NEWOBJ), so loaded models come out as
  rnnkern's modules, their options at the class defaults;
- a subclass of them whose forward reaches torch.nn's (pytorch-forecasting's
  LSTM/GRU, built inside its models and their ``load_from_checkpoint``)
  allocates as an instance of the class ``convert`` would give it (its own class
  first, then rnnkern's twin: :func:`conversion._converted_class`), so its
  methods run and its ``super().forward`` reaches rnnkern's; any other subclass
  allocates as before, with a warning naming it, as ``convert`` leaves it;
- rnnkern's own classes (and the generated ones) allocate as before, so the hook
  never recurses.
"""
from __future__ import annotations

import inspect
import threading
import warnings

from .common import _RnnkernOptions
from .conversion import _REPLACEMENTS, _converted_class, _why_not

_lock = threading.Lock()
#: How many patch() calls are active (nested contexts, handles not undone).
_depth = 0
#: Whether the six classes carry the hook (from the first patch() on).
_installed = False
#: Bumped by unpatch(): handles from before it have nothing left to undo.
_generation = 0


def _make_new(torch_cls: type, twin: type):
    def __new__(cls, *args, **kwargs):
        # (object.__new__ takes no arguments: __init__ gets them)
        # A class that is not torch_cls's can still reach this hook: one that
        # copied torch_cls's attributes into itself while patched (torchrl's
        # LSTMBase and GRUBase copy nn.LSTM's and nn.GRU's class dicts, this
        # __new__ included, so that its own LSTM and GRU run torch.nn's
        # methods).  It is not a torch.nn recurrent class: convert() leaves it
        # alone, and so does the patch.
        if not _depth or issubclass(cls, _RnnkernOptions) or not issubclass(cls, torch_cls):
            return object.__new__(cls)
        return object.__new__(twin if cls is torch_cls else _patched_subclass(cls))

    # inspect.signature(torch_cls) reads a class's own __new__ before its
    # __init__: without this it would say (*args, **kwargs) from the first
    # patch() on, and tools that read it (torch.nn.utils.skip_init looks for
    # ``device``) would refuse torch.nn's cells.  What calling the class takes
    # is still its __init__'s parameters.
    init = inspect.signature(torch_cls.__init__)
    params = list(init.parameters.values())
    __new__.__signature__ = init.replace(parameters=[params[0].replace(name="cls")] + params[1:])
    return staticmethod(__new__)


def _patched_subclass(cls: type) -> type:
    """The class a user's subclass of a torch.nn recurrent class is built as
    while patched: what ``convert`` would make of it, or itself (warned)."""
    why = _why_not(cls)
    if why is None:
        return _converted_class(cls)
    warnings.warn(f"rnnkern.patch: built {cls.__module__}.{cls.__qualname__} as it is, not "
                  f"on rnnkern: {why}", stacklevel=3)
    return cls


def _install() -> None:
    """Gives the six torch.nn classes the hook, once; it redirects only while
    ``_depth`` > 0 and passes through otherwise.

    Why it stays after unpatch(): CPython cannot give a class back the C-level
    ``__new__`` it inherited once a Python one was assigned -- deleting the
    attribute leaves the type's slot calling ``object.__new__`` with the
    constructor's arguments, which raises (checked on CPython 3.11).  A
    pass-through keeps construction, pickling and subclasses exactly as before."""
    global _installed
    if _installed:
        return
    for torch_cls, twin in _REPLACEMENTS.items():
        if "__new__" in vars(torch_cls):  # a torch that defines its own: we would hide it
            raise RuntimeError(f"rnnkern.patch: {torch_cls.__qualname__} defines __new__ in "
                               f"this torch version; patch() does not know how to wrap it")
    for torch_cls, twin in _REPLACEMENTS.items():
        torch_cls.__new__ = _make_new(torch_cls, twin)
    _installed = True


class PatchHandle:
    """What :func:`patch` returns: ``undo()`` ends this patch (once; later calls
    do nothing), and as a context manager it ends it on exit, exception or not."""

    def __init__(self):
        self._active = True
        self._generation = _generation

    def undo(self) -> None:
        global _depth
        with _lock:
            if not self._active:
                return
            self._active = False
            if self._generation != _generation:  # unpatch() already ended it
                return
            _depth -= 1

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def patch() -> PatchHandle:
    """Makes constructing torch.nn.RNN/GRU/LSTM/RNNCell/GRUCell/LSTMCell (and
    unpickling them) give rnnkern's modules, process-wide, until the returned
    handle's ``undo()``, the end of ``with rnnkern.patch():``, or :func:`unpatch`.
    Nests: torch.nn is restored when the last active patch ends.  Modules built
    while patched stay rnnkern's after it ends."""
    global _depth
    with _lock:
        _install()
        _depth += 1
        return PatchHandle()


def unpatch() -> None:
    """Ends every active patch (nested ones and handles included): torch.nn's
    classes construct and unpickle as before.  Does nothing when none is active."""
    global _depth, _generation
    with _lock:
        _depth = 0
        _generation += 1


def is_patched() -> bool:
    """True while a :func:`patch` is active."""
    return _depth > 0

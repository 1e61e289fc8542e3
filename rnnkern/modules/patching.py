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
- subclasses (users', rnnkern's own classes) allocate as before: the hook only
  redirects the exact torch.nn class, so it never recurses.

Subclasses of torch.nn's classes stay what they are (``convert`` handles them).
"""
from __future__ import annotations

import threading

from .conversion import _REPLACEMENTS

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
        return object.__new__(twin if _depth and cls is torch_cls else cls)
    return staticmethod(__new__)


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

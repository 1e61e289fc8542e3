"""Run a library's own test suite on rnnkern: a pytest plugin, loaded only
when asked for with ``-p``::

    python -m pytest -p rnnkern.integrations.pytest_plugin tests/
    python -m pytest -p rnnkern.integrations.pytest_plugin --rnnkern=accelerate tests/

``--rnnkern=patch`` (the default): :func:`rnnkern.patch` for the whole session,
so every torch.nn RNN/GRU/LSTM and cell the suite builds (inside the library,
from pickles, through convertible subclasses) is rnnkern's, running the
library's own code on it.  ``--rnnkern=accelerate``: the same, and the
integrations of the RL libraries that are installed on top: every
sb3-contrib ``RecurrentActorCriticPolicy`` is accelerated as it is built
(:func:`rnnkern.integrations.sb3.accelerate`: one fused call per sequence
batch), every torchrl ``LSTMModule``/``GRUModule`` holding torch.nn's module
too (:func:`rnnkern.integrations.torchrl.accelerate`; the ones built
``python_based=True`` hold torchrl's own and are left alone, counted).

The patch starts before the suite's conftest files are imported, so modules
they build at import are covered; everything is undone when the session ends.
The terminal summary says how many rnnkern modules the session built and what
was accelerated, so a green run that never reached rnnkern shows as such (with
pytest-xdist, each worker patches its own process and the controller adds up
their counts).
"""
from __future__ import annotations

import functools
import importlib
import weakref

import pytest

_MODES = ("patch", "accelerate")


class _Session:
    """What the plugin changed (to undo at the end) and counted."""

    def __init__(self, mode: str):
        self.mode = mode
        self.counts = {"rnnkern modules built": 0}
        self._built = weakref.WeakSet()
        self._restore = []  # (owner, attribute name, original value)
        self._handle = None
        self.workers = 0  # pytest-xdist workers whose counts were added

    def _wrap_init(self, cls: type, after) -> None:
        original = cls.__init__  # (its own or inherited)

        @functools.wraps(original)
        def __init__(module, *args, **kwargs):
            original(module, *args, **kwargs)
            after(cls, module)

        self._restore.append((cls, "__init__", cls.__dict__.get("__init__")))
        cls.__init__ = __init__

    def _count_built(self, cls: type, module) -> None:
        if module not in self._built:
            self._built.add(module)
            self.counts["rnnkern modules built"] += 1

    def start(self) -> None:
        import rnnkern
        from rnnkern.modules.conversion import _REPLACEMENTS

        for twin in _REPLACEMENTS.values():
            self._wrap_init(twin, self._count_built)
        self._handle = rnnkern.patch()
        if self.mode == "accelerate":
            self._accelerate_sb3()
            self._accelerate_torchrl()

    def _accelerate_sb3(self) -> None:
        try:
            from sb3_contrib.common.recurrent.policies import RecurrentActorCriticPolicy
        except ImportError:
            return
        sb3 = _integration("sb3")

        self.counts["sb3-contrib policies accelerated"] = 0

        def after(cls, policy):
            sb3.accelerate(policy)
            self.counts["sb3-contrib policies accelerated"] += 1

        self._wrap_init(RecurrentActorCriticPolicy, after)

    def _accelerate_torchrl(self) -> None:
        try:
            from torchrl.modules import GRUModule, LSTMModule
        except ImportError:
            return
        torchrl = _integration("torchrl")

        self.counts["torchrl modules accelerated"] = 0
        self.counts["torchrl modules left alone (python_based)"] = 0
        accepted = {LSTMModule: ("lstm", _torch_and_twin("LSTM")), GRUModule: ("gru", _torch_and_twin("GRU"))}

        def after(cls, module):
            if type(module) is not cls:  # a subclass's own (the accelerated classes included)
                return
            attribute, rnn_classes = accepted[cls]
            if type(getattr(module, attribute)) in rnn_classes:
                torchrl.accelerate(module)
                self.counts["torchrl modules accelerated"] += 1
            else:
                self.counts["torchrl modules left alone (python_based)"] += 1

        for cls in accepted:
            self._wrap_init(cls, after)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.undo()
            self._handle = None
        for owner, name, value in reversed(self._restore):
            if value is None:
                delattr(owner, name)  # it was inherited
            else:
                setattr(owner, name, value)
        self._restore.clear()


def _integration(name: str):
    """rnnkern.integrations.<name> as sys.modules holds it now.  Not ``from
    rnnkern.integrations import <name>``, which takes the package's attribute: a
    harness that drops modules imported during a run from sys.modules (pytest's
    own pytester, running a suite in process) leaves that attribute naming the
    module of an earlier import of the library, whose classes are no longer the
    ones the library builds (accelerate then finds none of its modules)."""
    return importlib.import_module(f"rnnkern.integrations.{name}")


def _torch_and_twin(name: str) -> tuple:
    """torch.nn's class of that name and rnnkern's twin."""
    import torch
    import rnnkern

    return getattr(torch.nn, name), getattr(rnnkern, name)


_session = None


def pytest_addoption(parser):
    parser.addoption("--rnnkern", choices=_MODES, default="patch",
                     help="rnnkern's pytest plugin: 'patch' builds torch.nn's recurrent modules as "
                          "rnnkern's for the session; 'accelerate' also accelerates the sb3-contrib "
                          "and torchrl recurrent modules the suite builds (default: patch)")


def _start(mode: str) -> None:
    global _session
    if _session is None:
        _session = _Session(mode)
        _session.start()


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    _start(early_config.known_args_namespace.rnnkern)


def pytest_configure(config):
    # (loaded later than -p, from a conftest's pytest_plugins: started here)
    _start(config.getoption("rnnkern"))


def pytest_report_header(config):
    if _session is not None:
        return f"rnnkern: --rnnkern={_session.mode} (torch.nn's recurrent modules built as rnnkern's)"


def pytest_sessionfinish(session):
    # A pytest-xdist worker: its counts go to the controller (pytest_testnodedown).
    output = getattr(session.config, "workeroutput", None)
    if output is not None and _session is not None:
        output["rnnkern_counts"] = dict(_session.counts)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    worker = getattr(node, "workeroutput", {}).get("rnnkern_counts")
    if worker is not None and _session is not None:
        _session.workers += 1
        for key, value in worker.items():
            _session.counts[key] = _session.counts.get(key, 0) + value


def pytest_terminal_summary(terminalreporter):
    if _session is not None:
        counts = ", ".join(f"{k}: {v}" for k, v in _session.counts.items())
        workers = f", over {_session.workers} xdist workers" if _session.workers else ""
        terminalreporter.write_line(f"rnnkern ({_session.mode}): {counts}{workers}")


def pytest_unconfigure(config):
    global _session
    if _session is not None:
        _session.stop()
        _session = None

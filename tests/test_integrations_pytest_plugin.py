"""rnnkern.integrations.pytest_plugin: a suite run with ``-p
rnnkern.integrations.pytest_plugin`` builds torch.nn's recurrent modules as
rnnkern's (from its conftest's import on), ``--rnnkern=accelerate`` also
accelerates the sb3-contrib policies and torchrl modules it builds, the summary
counts them, and the session's end restores everything.  Run in this process
(pytester), so that the restoring is checked here."""
from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

import rnnkern

pytest_plugins = ("pytester",)

# The RL libraries and their integrations, imported before any run in process
# (at collection, in each xdist worker): pytester drops from sys.modules what a
# run imported first, and the tests after it (test_integrations_rl.py) would
# import the library again, new classes beside the ones that the package
# rnnkern.integrations still names, and accelerate() would find none of them.
for _library, _modules in (("sb3_contrib", ("sb3_contrib.common.recurrent.policies", "rnnkern.integrations.sb3")),
                           ("torchrl", ("torchrl.modules", "rnnkern.integrations.torchrl"))):
    if importlib.util.find_spec(_library) is not None:
        for _module in _modules:
            importlib.import_module(_module)

PLUGIN = "rnnkern.integrations.pytest_plugin"

CONFTEST = """
import torch
BUILT_AT_IMPORT = torch.nn.GRU(3, 5)
"""

PATCHED = """
import torch
import rnnkern
from conftest import BUILT_AT_IMPORT

def test_modules_are_rnnkerns():
    assert type(BUILT_AT_IMPORT) is rnnkern.GRU
    lstm = torch.nn.LSTM(4, 6, num_layers=2)
    assert type(lstm) is rnnkern.LSTM and isinstance(lstm, torch.nn.LSTM)
    assert type(torch.nn.RNNCell(2, 3)) is rnnkern.RNNCell
    out, (h, c) = lstm(torch.randn(5, 2, 4))
    assert out.shape == (5, 2, 6) and torch.isfinite(out).all()
"""


def _summary(result) -> str:
    lines = [l for l in result.outlines if l.startswith("rnnkern (")]
    assert len(lines) == 1, result.outlines
    return lines[0]


def _assert_restored():
    assert type(torch.nn.LSTM(2, 3)) is torch.nn.LSTM
    assert type(torch.nn.GRUCell(2, 3)) is torch.nn.GRUCell
    for cls in (rnnkern.RNN, rnnkern.GRU, rnnkern.LSTM, rnnkern.RNNCell, rnnkern.GRUCell,
                rnnkern.LSTMCell):
        assert not hasattr(cls.__init__, "__wrapped__"), cls


@pytest.mark.parametrize("mode", ["patch", "accelerate"])
def test_plugin_builds_rnnkerns_modules_and_undoes_it(pytester, mode):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_patched=PATCHED)
    result = pytester.runpytest_inprocess("-p", PLUGIN, f"--rnnkern={mode}", "-p", "no:cacheprovider",
                                          "-p", "no:xdist")
    result.assert_outcomes(passed=1)
    # the GRU built at the conftest's import, the LSTM and the cell
    assert f"rnnkern ({mode}): rnnkern modules built: 3" in _summary(result)
    assert any(f"rnnkern: --rnnkern={mode}" in l for l in result.outlines)
    _assert_restored()


def test_plugin_counts_over_xdist_workers(pytester):
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (requirements-dev.txt)")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_patched=PATCHED, test_more="""
import torch
import rnnkern

def test_cell():
    assert type(torch.nn.LSTMCell(2, 3)) is rnnkern.LSTMCell
""")
    result = pytester.runpytest_subprocess("-p", PLUGIN, "-n", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    # each worker imports the conftest (its GRU; the module import of it in the test file may
    # build another), then runs its share of the tests (3 modules in all)
    summary = _summary(result)
    assert summary.startswith("rnnkern (patch): rnnkern modules built: "), summary
    assert summary.endswith(", over 2 xdist workers"), summary
    assert int(summary.split(": ")[2].split(",")[0]) >= 5, summary


def test_plugin_is_off_unless_asked_for(pytester):
    pytester.makepyfile(test_plain="""
import torch
def test_plain():
    assert type(torch.nn.LSTM(4, 6)) is torch.nn.LSTM
""")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=1)
    assert not any(l.startswith("rnnkern (") for l in result.outlines)


def test_plugin_rejects_an_unknown_mode(pytester):
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", PLUGIN, "--rnnkern=fast", "-p", "no:xdist")
    assert result.ret != 0
    assert any("--rnnkern" in l and "invalid choice" in l for l in result.errlines), result.errlines
    _assert_restored()


SB3 = """
import torch
import rnnkern
from rnnkern.integrations import sb3
from sb3_contrib import RecurrentPPO

def test_policies_accelerated():
    model = RecurrentPPO("MlpLstmPolicy", "CartPole-v1", n_steps=16, batch_size=16, n_epochs=1,
                         policy_kwargs=dict(lstm_hidden_size=8, enable_critic_lstm=True))
    policy = model.policy
    assert type(policy.lstm_actor) is rnnkern.LSTM and type(policy.lstm_critic) is rnnkern.LSTM
    assert policy._process_sequence is sb3.fused_process_sequence
    model.learn(32)
"""

TORCHRL = """
import torch
import rnnkern
from rnnkern.integrations.torchrl import AcceleratedGRUModule, AcceleratedLSTMModule
from torchrl.modules import GRUModule, LSTMModule

def test_modules_accelerated():
    lstm = LSTMModule(input_size=3, hidden_size=4, in_key="x", out_key="h")
    gru = GRUModule(input_size=3, hidden_size=4, in_key="x", out_key="h")
    python_based = LSTMModule(input_size=3, hidden_size=4, in_key="x", out_key="h", python_based=True)
    assert type(lstm) is AcceleratedLSTMModule and type(lstm.lstm) is rnnkern.LSTM
    assert type(gru) is AcceleratedGRUModule and type(gru.gru) is rnnkern.GRU
    assert type(python_based) is LSTMModule
"""


def _accelerated_summary(pytester, **test_files) -> str:
    """Runs the files in this process with --rnnkern=accelerate: their one test passes; the
    summary line."""
    pytester.makepyfile(**test_files)
    result = pytester.runpytest_inprocess("-p", PLUGIN, "--rnnkern=accelerate", "-p", "no:cacheprovider",
                                          "-p", "no:xdist", "-W", "ignore")
    result.assert_outcomes(passed=1)
    _assert_restored()
    return _summary(result)


def test_accelerate_reaches_sb3_contrib(pytester):
    pytest.importorskip("sb3_contrib", reason="sb3-contrib is not installed (requirements-dev.txt)")
    from sb3_contrib.common.recurrent.policies import RecurrentActorCriticPolicy
    original = RecurrentActorCriticPolicy.__init__
    summary = _accelerated_summary(pytester, test_sb3=SB3)
    assert "sb3-contrib policies accelerated: 1" in summary, summary
    assert "rnnkern modules built: 2" in summary, summary  # actor and critic LSTMs
    assert RecurrentActorCriticPolicy.__init__ is original


def test_accelerate_reaches_torchrl(pytester):
    pytest.importorskip("torchrl", reason="torchrl is not installed (requirements-dev.txt)")
    from torchrl.modules import LSTMModule
    original = LSTMModule.__init__
    summary = _accelerated_summary(pytester, test_torchrl=TORCHRL)
    assert "torchrl modules accelerated: 2" in summary, summary
    assert "torchrl modules left alone (python_based): 1" in summary, summary
    assert LSTMModule.__init__ is original


# pytest's pytester drops the modules a run in process imported from sys.modules
# when the run ends; the package rnnkern.integrations, imported before, keeps its
# attribute naming the dropped integration module, bound to the library's earlier
# classes.  The second run imports the library afresh: the plugin must find the
# integration module sys.modules holds (this failed in CI's xdist worker, where
# another test had imported rnnkern.integrations first).
TWO_RUNS = """
import sys
import pytest
import rnnkern.integrations

args = ["-q", "-p", "rnnkern.integrations.pytest_plugin", "--rnnkern=accelerate",
        "-p", "no:cacheprovider", "-p", "no:xdist", "-W", "ignore", *sys.argv[1:]]
# The libraries, the integrations and the test files, as a run in process that
# imported them first drops them (not torch's own lazily imported modules: torch
# registers libraries of operators once per process; in CI's worker they were
# imported before, and stayed).
DROPPED = ("torchrl", "sb3_contrib", "rnnkern.integrations.", "test_")
for run in range(2):
    before = set(sys.modules)
    code = pytest.main(args)
    assert code == 0, f"run {run}: pytest exited {code}"
    for name in set(sys.modules) - before:
        if name.startswith(DROPPED):
            del sys.modules[name]
print("two runs passed")
"""


def test_accelerate_after_a_run_dropped_its_modules(tmp_path):
    import subprocess
    import sys

    pytest.importorskip("sb3_contrib", reason="sb3-contrib is not installed (requirements-dev.txt)")
    pytest.importorskip("torchrl", reason="torchrl is not installed (requirements-dev.txt)")
    (tmp_path / "test_sb3.py").write_text(SB3)
    (tmp_path / "test_torchrl.py").write_text(TORCHRL)
    (tmp_path / "two_runs.py").write_text(TWO_RUNS)
    done = subprocess.run([sys.executable, str(tmp_path / "two_runs.py"), str(tmp_path / "test_sb3.py"),
                           str(tmp_path / "test_torchrl.py")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "two runs passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]

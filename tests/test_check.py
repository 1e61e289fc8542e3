"""The field self-check (rnnkern/check/): in-process and as ``python -m
rnnkern.check``, on the CPU backends (the Triton kernels through the
interpreter, tiny sizes), the JSON report's schema, and a planted mismatch."""
from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rnnkern
from rnnkern import ops, tolerance
from conftest import HAS_GPU, TOL, generator, randn

from rnnkern import check as check_module  # noqa: E402  (the module, also callable)
CPU_BACKENDS = ["reference", "cpu", "triton"]  # triton: interpreted here (conftest sets TRITON_INTERPRET=1)

# The JSON report's layout (README.md, "Field self-check", documents it).
REPORT_KEYS = {"schema", "ok", "date", "command", "options", "environment", "sizes", "tolerance",
               "backends", "not_run", "cases", "speed", "advice", "seconds"}
ENVIRONMENT_KEYS = {"rnnkern", "rnnkern_path", "git", "rnnkern_cuda_kernels", "torch", "cuda", "cudnn",
                    "triton", "triton_interpret", "python", "os", "cpu", "gpu", "load_average"}
CPU_KEYS = {"model", "cores", "torch_threads", "isa", "torch_cpu_capability", "rnnkern_cpu_isa"}
BACKEND_KEYS = {"backend", "device", "interpreted", "ok", "cases", "failed", "seconds"}
CASE_KEYS = {"backend", "op", "cell", "proj", "dtype", "size", "variant", "against", "ok", "worst", "seconds"}
TENSOR_KEYS = {"tensor", "error", "allowed"}


def assert_schema(report: dict) -> None:
    assert set(report) == REPORT_KEYS
    assert report["schema"] == "rnnkern.check/1"
    assert set(report["environment"]) == ENVIRONMENT_KEYS
    assert set(report["environment"]["cpu"]) == CPU_KEYS
    assert report["environment"]["rnnkern"] == rnnkern.__version__
    assert report["environment"]["torch"] == torch.__version__
    assert set(report["options"]) == {"backends", "quick", "speed"}
    assert set(report["sizes"]) == {"small", "tiny", "large"}
    for name, b in report["backends"].items():
        assert set(b) == BACKEND_KEYS and b["backend"] == name and b["device"] in ("cpu", "cuda")
        assert b["cases"] == sum(c["backend"] == name for c in report["cases"]) > 0
        assert b["failed"] == sum(c["backend"] == name and not c["ok"] for c in report["cases"])
    for c in report["cases"]:
        assert CASE_KEYS <= set(c) <= CASE_KEYS | {"tensors", "exception", "traceback"}, set(c)
        assert c["op"] in ("sequence", "step", "module", "cell") and c["cell"] in ops.CELLS
        assert c["dtype"] in ("float64", "float32", "bfloat16", "float16")
        if "exception" in c:
            assert not c["ok"] and c["worst"] is None
        else:
            assert c["tensors"] and all(set(t) <= TENSOR_KEYS | {"problem"} for t in c["tensors"])
            assert c["worst"] in c["tensors"]
            assert c["ok"] == all(t["error"] is not None and t["error"] <= t["allowed"] for t in c["tensors"])
    assert report["ok"] == all(b["ok"] for b in report["backends"].values())
    assert set(report["advice"]) == {n for n, b in report["backends"].items() if not b["ok"]}


def run_check(tmp_path, **kwargs):
    out = io.StringIO()
    path = tmp_path / "report.json"
    report = rnnkern.check(json_path=path, file=out, **kwargs)  # the module, called
    on_disk = json.loads(path.read_text())
    return report, on_disk, out.getvalue()


def test_check_passes_on_the_cpu_backends(tmp_path):
    """Every CPU backend (Triton interpreted), --quick: exit status 0's report,
    written as JSON in the documented layout, every cell, op and dtype present."""
    report, on_disk, text = run_check(tmp_path, backends=CPU_BACKENDS, quick=True, speed_test=False)
    assert report["ok"], text
    assert_schema(on_disk)
    assert list(on_disk["backends"]) == CPU_BACKENDS
    cases = on_disk["cases"]
    for backend in CPU_BACKENDS:
        mine = [c for c in cases if c["backend"] == backend]
        assert {c["cell"] for c in mine if c["op"] == "sequence"} == set(ops.CELLS)
        assert any(c["proj"] for c in mine if c["op"] == "sequence")
        assert {c["dtype"] for c in mine if c["op"] == "sequence"} == {"float32", "bfloat16"}
        assert {c["op"] for c in mine} == {"sequence", "step", "module", "cell"}
    assert all(c["size"] == "tiny" for c in cases if c["backend"] == "triton") != HAS_GPU
    assert "Triton interpreter" in text or HAS_GPU
    assert f"OK: {', '.join(CPU_BACKENDS)} agree" in text
    assert f"JSON report: {tmp_path / 'report.json'}" in text


def test_rnnkern_check_is_the_module_and_the_function():
    """rnnkern.check is importable as a module (python -m rnnkern.check) and
    callable (rnnkern.check()), also after `import rnnkern.check`."""
    import rnnkern.check  # noqa: F401  (binds the submodule as the package attribute)
    assert rnnkern.check is sys.modules["rnnkern.check"]
    assert callable(rnnkern.check) and callable(rnnkern.check.check) and callable(rnnkern.check.main)
    assert "check" in rnnkern.__all__
    from rnnkern import check
    assert check is rnnkern.check


def test_command_line(tmp_path):
    """`python -m rnnkern.check` in a fresh process: exit status 0, the report
    on stdout, the JSON where --json says, no warning from runpy."""
    path = tmp_path / "cli.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(rnnkern.__file__).parent.parent), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "rnnkern.check", "--backends", "cpu", "--quick",
                          "--no-speed", "--json", str(path)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "RuntimeWarning" not in run.stderr, run.stderr
    assert "OK: cpu agrees" in run.stdout
    report = json.loads(path.read_text())
    assert_schema(report)
    assert report["ok"] and report["options"] == {"backends": ["cpu"], "quick": True, "speed": False}


class _Planted:
    """The CPU op family with planted faults: recurrence's output off by 1e-3 in
    one element (float32) or NaN there (half types), and step raising."""

    def __init__(self, family):
        self._family = family

    def __getattr__(self, name):
        return getattr(self._family, name)

    # rnnkern.ops calls the ops' overloads (``family.recurrence.default``).
    @property
    def recurrence(self):
        def planted(*args):
            output, h_n, c_n, workspace = self._family.recurrence.default(*args)
            nudge = torch.zeros_like(output)
            nudge.view(-1)[0] = 1e-3 if output.dtype == torch.float32 else math.nan
            return output + nudge, h_n, c_n, workspace
        return SimpleNamespace(default=planted)

    @property
    def step(self):
        def planted(*args):
            raise RuntimeError("planted fault in step")
        return SimpleNamespace(default=planted)


def test_planted_mismatch_is_detected(tmp_path, monkeypatch, capsys):
    """A backend computing a wrong output, or crashing, fails the check: exit
    status 1, the failing backend named with the tensor, and the backend to use
    instead; the other backend still passes."""
    family = ops._op_family
    monkeypatch.setattr(ops, "_op_family",
                        lambda backend: _Planted(family(backend)) if backend == "cpu" else family(backend))
    # (Through torch.ops, where the planted family sits: not rnnkern._C's unboxed calls.)
    monkeypatch.setattr(ops, "_unboxed_call", lambda *tensors: False)
    path = tmp_path / "mismatch.json"
    status = check_module.main(["--backends", "reference,cpu", "--quick", "--no-speed", "--json", str(path)])
    text = capsys.readouterr().out
    assert status == 1
    report = json.loads(path.read_text())
    assert_schema(report)
    assert not report["ok"] and report["backends"]["reference"]["ok"] and not report["backends"]["cpu"]["ok"]
    failed = [c for c in report["cases"] if not c["ok"]]
    assert {c["backend"] for c in failed} == {"cpu"}
    wrong = [c for c in failed if c["op"] == "sequence"]
    assert len(wrong) == 12 and all(c["worst"]["tensor"] == "output" for c in wrong)  # every cell, 2 dtypes
    assert all(c["worst"]["error"] is None for c in wrong if c["dtype"] == "bfloat16")  # NaN: null in JSON
    crashed = [c for c in failed if c["op"] == "step"]
    assert len(crashed) == 10 and all("planted fault in step" in c["exception"] for c in crashed)
    assert "use backend='reference'" in report["advice"]["cpu"]
    assert "MISMATCH in 'cpu'" in text
    assert "cpu: use backend='reference' instead" in text
    assert "FAIL cpu: ops.recurrence fwd+bwd vs float64 reference, rnn_tanh lengths-reverse, float32" in text
    assert "open an issue on the project's tracker" in text


def one_case_plan(target, quick):
    return [check_module.Case("sequence", "gru", torch.float32, "small", False, "plain")]


def test_speed_line(tmp_path, monkeypatch):
    """The speed comparison, at a tiny size here (and as on a quiet machine): every
    torch.nn cell timed on both sides, the ratio of the medians reported."""
    monkeypatch.setattr(check_module.probe, "load_average", lambda: [0.0, 0.0, 0.0])
    monkeypatch.setitem(check_module.SPEED, "cpu", {"B": 2, "T": 3, "H": 8, "dtype": torch.float32,
                                                    "warmup": 1, "repeats": 3, "budget_s": 1.0})
    monkeypatch.setattr(check_module.runner, "plan", one_case_plan)
    report, on_disk, text = run_check(tmp_path, backends=["reference", "cpu"], speed_test=True)
    assert report["ok"], text
    assert on_disk["speed"]["reference"] == {"skipped": "the reference is not a fast path"}
    s = on_disk["speed"]["cpu"]
    assert s["size"] == {"B": 2, "T": 3, "I": 8, "H": 8} and s["dtype"] == "float32"
    assert list(s["cells"]) == ["rnn_tanh", "rnn_relu", "lstm", "gru"]
    for cell in s["cells"].values():
        for phase in ("forward", "forward_backward"):
            assert cell["torch_nn_ms"][phase] > 0 and cell["rnnkern_ms"][phase] > 0
            assert cell["speedup"][phase] == pytest.approx(cell["torch_nn_ms"][phase] / cell["rnnkern_ms"][phase])
            assert 1 <= cell["repeats"][phase] <= 3
    assert "speed cpu vs torch.nn (float32, B=2 T=3 H=8" in text


def test_speed_skipped_on_a_busy_cpu(tmp_path, monkeypatch):
    """With the load average above the core count the CPU is not timed, and the
    output says why."""
    monkeypatch.setattr(check_module.probe, "load_average", lambda: [99.0, 99.0, 99.0])
    monkeypatch.setattr(check_module.runner, "plan", one_case_plan)
    report, on_disk, text = run_check(tmp_path, backends=["cpu"], speed_test=True)
    assert report["ok"], text
    assert on_disk["speed"]["cpu"]["skipped"].startswith("load average 99.0 on")
    assert "speed cpu: skipped: load average 99.0" in text
    assert "note: load average 99.0" in text


def test_bad_backends_argument(monkeypatch, capsys):
    """An unknown backend, or one that cannot run here, is refused naming the
    argument and the reason."""
    with pytest.raises(SystemExit) as e:
        check_module.main(["--backends", "cpu,nope"])
    assert e.value.code == 2
    assert "backends: unknown backend 'nope'" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="backends: 'cuda' cannot run on this machine: no CUDA GPU visible"):
        rnnkern.check(backends=["cuda"])


def test_close_error_is_assert_close_criterion():
    """tolerance.close_error <= TOL exactly when torch.testing.assert_close passes
    with tolerance.close_tolerances (the test suite's assert_close)."""
    g = generator("close-error")
    expected = randn(g, 200, scale=3.0)
    for dtype in (torch.float64, torch.float32):
        for factor in (0.5, 0.99, 1.01, 3.0):
            actual = expected + factor * TOL[dtype] * (tolerance.close_tolerances(expected, dtype)[1] / TOL[dtype]
                                                       + expected.abs()) * torch.sign(randn(g, 200))
            rtol, atol = tolerance.close_tolerances(expected, dtype)
            passes = torch.allclose(actual, expected, rtol=rtol, atol=atol)
            assert (tolerance.close_error(actual, expected, dtype) <= TOL[dtype]) == passes == (factor < 1)

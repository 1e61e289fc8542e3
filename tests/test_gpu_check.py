"""bench/gpu_check.sh, the script a session with a lent GPU runs first, kept
from rotting on machines without one: its syntax, and its rehearsal
(``--rehearse OUTDIR``) of the cheap stages (env, the sanitizers, the GPU
benchmark: seconds), which must record "no GPU" as a result, not crash.
The full rehearsal (build, the CUDA tests on the emulated device, the Triton
tests under the interpreter) runs in CI from .ci/run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rnnkern import ops

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_header_has_the_stage_plan_and_the_second_call():
    """Each stage with its estimated time on an H100, the budget, and the
    documented second call for what does not fit."""
    header = SCRIPT.read_text().split("\nset -u\n")[0]
    for stage in ("build", "env", "tests_cuda", "memcheck", "bench", "racecheck", "tests_other",
                  "initcheck"):
        assert f"#   {stage} " in header, stage
    assert "GPU_CHECK_BUDGET=540" in header
    assert "STAGES=bench" in header and "--backends cuda triton" in header


@pytest.mark.skipif(torch.cuda.is_available(), reason="a rehearsal is for machines without a GPU")
def test_rehearsal_of_the_cheap_stages(tmp_path):
    out = tmp_path / "out"
    # REHEARSE_SANITIZER_DTYPES="": memcheck records "no GPU" without running the
    # emulated cases (test_sanitizer_cases_on_the_emulated_device below runs some).
    env = dict(os.environ, STAGES="env,sanitizer,bench", PYTHON=sys.executable, REHEARSE_SANITIZER_DTYPES="",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(["bash", str(SCRIPT), "--rehearse", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rehearsal"] is True
    assert summary["rehearsal_broken_stages"] == []
    stages = summary["stages"]
    assert set(stages) == {"env", "memcheck", "bench", "racecheck", "initcheck"}
    assert stages["env"]["result"] == "ok"
    assert summary["env"]["device"] == "none" and summary["env"]["ceilings"] is None
    assert summary["env"]["torch"] == torch.__version__
    for name in ("memcheck", "racecheck", "initcheck", "bench"):
        assert stages[name]["result"] == "no GPU", (name, stages[name])
        assert not stages[name]["timed_out"]
    # The benchmark ran its real command, which said why it could not time anything.
    assert stages["bench"]["exit"] not in ("0", "-")
    assert (out / "gpu_check.log").exists() and (out / "logs.tar.gz").exists()
    assert "bench: exit" in (out / "gpu_check.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a rehearsal is for machines without a GPU")
def test_rehearsal_fails_when_a_stage_breaks(tmp_path):
    """A stage whose command breaks (here the benchmark, given an option it does
    not have) makes the rehearsal exit non-zero and is named in summary.json."""
    out = tmp_path / "out"
    env = dict(os.environ, STAGES="bench", BENCH_ARGS="--no-such-option", PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(["bash", str(SCRIPT), "--rehearse", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stages"]["bench"]["result"] == "failed"
    assert summary["rehearsal_broken_stages"] == ["bench"]


@pytest.mark.skipif(not ops.WITH_CUDA_EMULATION, reason="rnnkern was built without the emulated CUDA device")
def test_sanitizer_cases_on_the_emulated_device():
    """The cases the sanitizer stages run, as the full rehearsal runs them (step
    kernels only here: seconds)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "sanitizer_cases.py"), "--emulated",
                          "--kernels", "step", "--dtypes", "float32,bfloat16"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "sanitizer_cases: 0 wrong result(s)" in run.stdout
    assert run.stdout.count("ok    step ") == 10

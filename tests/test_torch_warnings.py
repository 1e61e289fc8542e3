"""rnnkern/_torch_warnings.py: torch's "No CUDA runtime is found, using CUDA_HOME=..."
warning stays out of a CPU user's way (torch.compile, python -m bench) and nowhere else.

Each case runs in a fresh process (the warning is logged once, when
torch.utils.cpp_extension is first imported) with the conditions that make torch log it
forced: no visible GPU and CUDA_HOME pointing at a directory."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WARNING = "No CUDA runtime is found"


def run_python(code: str, cuda_home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "CUDA_HOME": str(cuda_home),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1",
           # A cold Inductor cache: the compile generates (and so imports cpp_extension) every run.
           "TORCHINDUCTOR_CACHE_DIR": str(cuda_home / "inductor-cache")}
    env.pop("CUDA_PATH", None)
    run = subprocess.run([sys.executable, *(["-c", code] if code else []), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def cuda_home(tmp_path_factory) -> Path:
    """A CUDA_HOME under which torch logs the warning, checked without rnnkern (the
    control).  A CPU-only build of torch never guesses a CUDA_HOME: nothing to keep away."""
    home = tmp_path_factory.mktemp("cuda_home")
    run = run_python("import torch.utils.cpp_extension", home)
    if WARNING not in run.stderr:
        import torch
        assert torch.version.cuda is None, f"no warning from a CUDA build of torch: {run.stderr!r}"
        pytest.skip("this torch is a CPU-only build: cpp_extension never logs the CUDA_HOME warning")
    return home


def test_forward_and_torch_compile_do_not_print_the_cuda_home_warning(cuda_home):
    code = """
import logging, sys
import torch
import rnnkern
x = torch.randn(2, 5, 8)
gru = rnnkern.GRU(8, 16, batch_first=True)
out, h = gru(x)
torch._dynamo.config.allow_rnn = True
compiled = torch.compile(gru, fullgraph=True)
torch.testing.assert_close(compiled(x)[0], out)
assert "torch.utils.cpp_extension" in sys.modules, "Inductor did not import cpp_extension"
logging.getLogger("torch.utils.cpp_extension").warning("another warning of that logger")
"""
    stderr = run_python(code, cuda_home).stderr
    assert WARNING not in stderr, stderr
    assert "another warning of that logger" in stderr, stderr  # the filter drops one record only


def test_bench_does_not_print_the_cuda_home_warning(cuda_home):
    """bench/timing.py imports torch.utils.benchmark, which imports cpp_extension."""
    run = run_python("", cuda_home, "-m", "bench", "--help")
    assert "usage: python -m bench" in run.stdout
    assert WARNING not in run.stderr, run.stderr


def test_an_extension_build_still_gets_the_warning(cuda_home):
    """Imported by the user (to build a CUDA extension), cpp_extension still says which
    CUDA_HOME it took, rnnkern imported or not."""
    stderr = run_python("import rnnkern, torch.utils.cpp_extension as c; assert c.CUDA_HOME",
                        cuda_home).stderr
    assert WARNING in stderr and repr(str(cuda_home)) in stderr, stderr

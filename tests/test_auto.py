"""backend="auto": the choice between torch.nn and rnnkern's kernels (rnnkern/auto.py),
its table (written by bench/auto_table.py), and the modules following it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import rnnkern
from rnnkern import auto
from conftest import generator, randn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_RESULT = "bench/results/gpu-h100-2026-11-27/bench-cuda-grid/bench_cuda_grid.json"
CPU_RESULT = "bench/results/cpu-zen3-2026-11-27-default/bench.json"  # AMD Zen 3, AVX2
CPU = torch.device("cpu")


def entry(device, cell, dtype, phase, B, T, H, ratio, backend="cpu"):
    return {"device": device, "cell": cell, "dtype": dtype, "phase": phase, "B": B, "T": T, "H": H,
            "speedups": {backend: ratio}, "source": "test"}


@pytest.fixture
def table(monkeypatch):
    """Replaces the shipped table by the entries the test appends."""
    doc = {"entries": []}
    monkeypatch.setattr(auto, "table", lambda: doc)
    return doc["entries"]


def choose(**kw):
    args = dict(cell="lstm", device=CPU, dtype=torch.float32, B=16, H=256, T=128, training=False,
                torch_lacks=None, rnnkern_backend="cpu", device_key="cpu:256bit")
    args.update(kw)
    return auto.choose(**args)


def test_an_option_torch_lacks_runs_rnnkern(table):
    table.append(entry("cpu:256bit", "lstm", "float32", "forward", 16, 128, 256, 0.5))
    c = choose(torch_lacks="resets=")
    assert c.implementation == "cpu" and "resets=" in c.reason


def test_the_measured_faster_one_at_the_nearest_size(table):
    table += [entry("cpu:256bit", "lstm", "float32", "forward", 1, 256, 128, 0.8),
              entry("cpu:256bit", "lstm", "float32", "forward", 64, 128, 512, 1.4),
              entry("cpu:256bit", "lstm", "float32", "forward_backward", 1, 256, 128, 1.2)]
    small = choose(B=2, H=128, T=200)
    assert small.uses_torch and "0.80x" in small.reason and "B=1 T=256 H=128" in small.reason
    large = choose(B=32, H=768, T=100)
    assert large.implementation == "cpu" and "1.40x" in large.reason
    training = choose(B=2, H=128, T=200, training=True)  # the forward+backward row
    assert training.implementation == "cpu" and "1.20x" in training.reason
    # Another device's, dtype's or cell's rows do not count.
    assert choose(device_key="cpu:512bit").implementation == "cpu"
    assert "no measurement" in choose(dtype=torch.float64).reason
    assert "no measurement" in choose(cell="gru").reason


def test_without_a_measurement(table):
    cuda = choose(device=torch.device("cuda"), device_key="cuda:sm_90", rnnkern_backend="cuda")
    assert cuda.uses_torch and "cuDNN" in cuda.reason
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert choose(dtype=dtype).implementation == "cpu"
    # bfloat16 on a CPU with the bf16 dot products: torch.nn (oneDNN uses them, rnnkern not yet);
    # the other dtypes there, and bfloat16 once a row measures rnnkern faster, rnnkern.
    for key in ("cpu:512bit+bf16", "cpu:256bit+bf16"):
        bf16 = choose(dtype=torch.bfloat16, device_key=key)
        assert bf16.uses_torch and "bf16 dot-product" in bf16.reason
        assert choose(dtype=torch.float32, device_key=key).implementation == "cpu"
    table.append(entry("cpu:512bit+bf16", "lstm", "bfloat16", "forward", 16, 128, 256, 1.3))
    assert choose(dtype=torch.bfloat16, device_key="cpu:512bit+bf16").implementation == "cpu"


@pytest.mark.parametrize("key", ["cpu:256bit", "cpu:512bit+bf16"])
def test_when_the_modules_skip_the_choice(table, monkeypatch, key):
    """The modules skip the choice (~25 us a call) on CPU tensors where it can only
    say rnnkern: no row of this CPU class measured torch.nn faster, and no bfloat16
    (input or CPU autocast) on a CPU with the bf16 dot products.  Never on CUDA."""
    monkeypatch.setattr(auto, "_this_cpu_class", lambda: key)
    bf16_cpu = key.endswith("+bf16")
    assert auto.no_torch_choice(torch.zeros(1))
    assert auto.no_torch_choice(torch.zeros(1, dtype=torch.bfloat16)) != bf16_cpu
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert auto.no_torch_choice(torch.zeros(1)) != bf16_cpu
    table.append(entry(key, "gru", "float32", "forward", 16, 128, 256, 1.5))  # rnnkern faster
    assert auto.no_torch_choice(torch.zeros(1))
    table.append(entry("cpu:other", "lstm", "float32", "forward", 16, 128, 256, 0.5))  # another CPU
    assert auto.no_torch_choice(torch.zeros(1))
    table.append(entry(key, "lstm", "float32", "forward", 16, 128, 256, 0.5))  # torch.nn faster
    assert not auto.no_torch_choice(torch.zeros(1))
    if torch.cuda.is_available():
        assert not auto.no_torch_choice(torch.zeros(1, device="cuda"))


def test_the_shipped_table_is_the_committed_results(tmp_path):
    """The package's table is what bench.auto_table writes from the committed
    benchmarks (the H100's and a Zen 3's): one run updates its device's rows,
    nothing is typed in by hand."""
    out = tmp_path / "table.json"
    done = subprocess.run([sys.executable, "-m", "bench.auto_table", GPU_RESULT, CPU_RESULT, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    with open(auto.TABLE_PATH) as f:
        shipped = json.load(f)
    with open(out) as f:
        assert json.load(f)["entries"] == shipped["entries"]
    assert {e["device"] for e in shipped["entries"]} == {"cuda:sm_90", "cpu:256bit"}
    # What it says for the measured H100 cases (median of 10 CUDA-event timings).
    by_case = {(e["cell"], e["dtype"], e["phase"], e["B"], e["T"], e["H"]): e["speedups"]["cuda"]
               for e in shipped["entries"] if e["device"] == "cuda:sm_90"}
    assert by_case[("lstm", "float16", "forward", 16, 1024, 768)] < 0.3  # cuDNN's persistent kernel
    assert by_case[("lstm", "bfloat16", "forward", 16, 1024, 768)] > 1.0


@pytest.mark.parametrize("cls,kw", [(nn.LSTM, {}), (nn.GRU, {}), (nn.RNN, {"nonlinearity": "relu"})])
def test_modules_follow_the_choice(table, cls, kw, monkeypatch):
    """Where the table says torch.nn is faster, backend="auto" runs torch.nn's own
    forward (the same bits as torch.nn's module); where torch.nn lacks the call's
    option, rnnkern's kernels; rnnkern.explain names the choice and its reason."""
    torch.manual_seed(0)
    theirs = cls(5, 7, num_layers=2, **kw).double()
    ours = getattr(rnnkern, cls.__name__)(5, 7, num_layers=2, **kw).double()
    ours.load_state_dict(theirs.state_dict())
    g = generator("auto", cls.__name__)
    x = randn(g, 6, 3, 5)
    cell = {"LSTM": "lstm", "GRU": "gru", "RNN": "rnn_relu"}[cls.__name__]
    key = auto.device_class(CPU)
    table.append(entry(key, cell, "float64", "forward", 3, 6, 7, 0.5))
    table.append(entry(key, cell, "float64", "forward_backward", 3, 6, 7, 0.5))
    choice = rnnkern.explain(ours, x)
    assert choice.uses_torch and "0.50x" in choice.reason, choice
    want = theirs(x)
    got = ours(x)
    assert torch.equal(got[0], want[0])
    # An option torch.nn lacks: rnnkern's kernels, with the reason.
    lengths = torch.tensor([6, 2, 4])
    choice = rnnkern.explain(ours, x, lengths=lengths)
    assert choice.implementation == "cpu" and "lengths=" in choice.reason, choice
    # Explicit backends are never redirected.
    ours.backend = "cpu"
    assert rnnkern.explain(ours, x).implementation == "cpu"

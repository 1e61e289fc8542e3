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
from rnnkern.check import probe
from bench import auto_table as bench_auto_table
from conftest import generator, randn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The third H100 run's Triton column, then the seventh's CUDA grid (mode "auto": the
# persistent kernels where they are chosen) and its latency sizes after 345262f, each
# replacing the earlier files' CUDA ratios.
GPU_RESULTS = ("bench/results/gpu-h100-2026-11-27-session3/bench-triton-headline/bench_gpu.json",
               "bench/results/gpu-h100-2026-11-27-session3/bench-triton-latency/bench_gpu.json",
               "bench/results/gpu-h100-2026-12-06/bench-cuda-grid/bench_gpu.json",
               "bench/results/gpu-h100-2026-12-06/bench-cuda-latency-345262f/bench_gpu.json")
CPU_RESULTS = ("bench/results/cpu-zen3-2026-11-27-default/bench.json",  # AMD Zen 3, AVX2, 2 threads
               "bench/results/cpu-zen3-2026-11-27-auto-t1/bench.json",  # the same CPU, 1 thread
               "bench/results/cpu-zen3-2026-11-27-peers-step-t1/bench.json",  # 1 thread
               # a Zen 4 with AVX-512 hidden (the same class), LSTM latency grid, 2 threads
               "bench/results/cpu-zen4avx2-2026-11-28-lstm-latency-t2/bench.json",
               # the same Zen 4, peers and step families at 1 thread after c13bd73's products
               # (its rows replace the Zen 3's of the same cases)
               "bench/results/cpu-zen4avx2-2026-11-28-peers-step-t1/bench.json",
               # a Zen 3 again, the same families at 1 thread after b977408 (its rows replace
               # the Zen 4's), and the speech family's bidirectional stacks at 1 and 2 threads
               "bench/results/cpu-zen3-2026-12-03-peers-step-t1-b977408/bench.json",
               "bench/results/cpu-zen3-2026-12-03-speech-t1-b977408/bench.json",
               "bench/results/cpu-zen3-2026-12-03-speech-t2-b977408/bench.json",
               # and its LSTM latency sizes at 1 and 2 threads (replacing the rows of 11-27/28)
               "bench/results/cpu-zen3-2026-12-03-lstm-latency-t1-5b14c17/bench.json",
               "bench/results/cpu-zen3-2026-12-03-lstm-latency-t2-5b14c17/bench.json")
# A Zen 4 with its AVX512_BF16 (the cpu:512bit+bf16 class): the bf16 family at 1 and 2
# threads, the bf16 latency sizes, and one-step calls (T=1) at 1 thread, bfloat16 rows
# only (bench.auto_table --dtypes).
STEP_RESULTS = "bench/results/cpu-zen4-2026-12-01-step-bf16-t1-1da3971/bench.json"
# The bf16 family again from ec582f6 (after c5126ae: its float32 LSTM forward rows), whose
# rows replace 930c680's.
BF16_RERUN = ("bench/results/cpu-zen4-2026-12-02-bf16-t1-ec582f6/bench.json",
              "bench/results/cpu-zen4-2026-12-02-bf16-t2-ec582f6/bench.json")
BF16_RESULTS = ("bench/results/cpu-zen4-2026-12-02-bf16-t1-930c680/bench.json",
                "bench/results/cpu-zen4-2026-12-02-bf16-t2-930c680/bench.json",
                *BF16_RERUN,
                "bench/results/cpu-zen4-2026-12-02-bf16-latency-t1-930c680/bench.json",
                "bench/results/cpu-zen4-2026-12-02-bf16-latency-t2-930c680/bench.json",
                STEP_RESULTS)
# The same Zen 4 in float32 (the default grid at 1 and 2 threads, the bf16 family's
# float32 rows, one-step calls, and the speech family's bidirectional stacks at 1 and 2
# threads): oneDNN's AVX-512 LSTM forward is level with rnnkern's there.
SPEECH_RESULTS = ("bench/results/cpu-zen4-2026-12-02-speech-t1-2206010/bench.json",
                  "bench/results/cpu-zen4-2026-12-02-speech-t2-72d46ae/bench.json")
# One-step calls at two threads (their one-thread rows are STEP_RESULTS' float32 rows).
STEP_T2_RESULTS = "bench/results/cpu-zen4-2026-12-01-step-t2-c7f7bfd/bench.json"
F32_RESULTS = ("bench/results/cpu-zen4-2026-12-01-grid-t1-7b7cf32/bench.json",
               "bench/results/cpu-zen4-2026-12-01-grid-t2-7b7cf32/bench.json",
               # the LSTM's rows of the same grid after c5126ae (the float32 LSTM's
               # inference makes x_t W_ih^T in its steps up to 4 MB of weights)
               "bench/results/cpu-zen4-2026-12-02-grid-lstm-t1-c5126ae/bench.json",
               "bench/results/cpu-zen4-2026-12-02-grid-lstm-t2-c5126ae/bench.json",
               "bench/results/cpu-zen4-2026-12-01-short-t1-425b41b/bench.json",
               "bench/results/cpu-zen4-2026-12-01-short-t2-425b41b/bench.json",
               "bench/results/cpu-zen4-2026-12-02-short-lstm-t1-8e167f6/bench.json",
               "bench/results/cpu-zen4-2026-12-02-short-lstm-t2-8e167f6/bench.json",
               "bench/results/cpu-zen4-2026-12-02-bf16-t1-930c680/bench.json",
               "bench/results/cpu-zen4-2026-12-02-bf16-t2-930c680/bench.json",
               *BF16_RERUN, STEP_RESULTS, *SPEECH_RESULTS, STEP_T2_RESULTS)
# A Zen 5 (AVX-512 on 512-bit FMA pipes, AVX512_BF16: the cpu:512bit+bf16+fma512 class), its own
# rows since 90fc337: the float32 grid at 1 (ac1877c) and 2 threads, the bf16 family at 1 and 2
# threads (its float32 rows too), the LSTM against the CPU engines, the latency sizes again after
# b364985 (batch 1 off the projection tiles: their rows replace the grid's), the speech stacks,
# bf16 one-step and cell calls (2026-12-04; before, those took the Zen 4's rows), one-step calls.
ZEN5_RESULTS = ("bench/results/cpu-zen5-2026-12-03-grid-t1-ac1877c/bench.json",
                "bench/results/cpu-zen5-2026-12-03-grid-t2-90fc337/bench.json",
                "bench/results/cpu-zen5-2026-12-03-bf16-t1-ac1877c/bench.json",
                "bench/results/cpu-zen5-2026-12-03-bf16-t2-ac1877c/bench.json",
                # the bf16 family again after 908afd6 and 1141504 (2026-12-04): its rows replace
                "bench/results/cpu-zen5-2026-12-04-bf16-t1-1141504/bench.json",
                "bench/results/cpu-zen5-2026-12-04-bf16-t2-1141504/bench.json",
                "bench/results/cpu-zen5-2026-12-03-peers-lstm-t1-90fc337/bench.json",
                "bench/results/cpu-zen5-2026-12-03-latency-t1-90fc337/bench.json",
                "bench/results/cpu-zen5-2026-12-03-latency-t2-90fc337/bench.json",
                "bench/results/cpu-zen5-2026-12-03-speech-t1-90fc337/bench.json",
                "bench/results/cpu-zen5-2026-12-03-speech-t2-90fc337/bench.json",
                # bf16 one-step and cell calls at 1 and 2 threads (2026-12-04, 426f88c;
                # their float32 cases the next two files' again)
                "bench/results/cpu-zen5-2026-12-04-step-bf16-t1-426f88c/bench.json",
                "bench/results/cpu-zen5-2026-12-04-step-bf16-t2-426f88c/bench.json",
                # and one-step calls (T=1) at 1 and 2 threads, from 49c61ef
                "bench/results/cpu-zen5-2026-12-03-step-t1-49c61ef/bench.json",
                "bench/results/cpu-zen5-2026-12-03-step-t2-49c61ef/bench.json")
# An Intel Xeon with AMX's bf16 tiles (the cpu:512bit+bf16+amx class, 2026-12-05): the float32 grid
# at 1 and 2 threads, the bf16 family (its float32 rows too) and the LSTM against the CPU engines at
# 35ac72f (float32 panels prefetched, a step's products past 2 MB panel by panel), the speech stacks
# at a5db55a; one-step calls in bfloat16 and float32 at 1 and 2 threads at 7671b66, rnnkern's bf16
# products on the tiles; the bf16 family again at b64b27a (the bf16 backward's costs), whose rows
# replace 35ac72f's; 2026-12-06: bf16 at the latency, throughput and short sizes at 1 and 2 threads
# (35a0d9b), and the bf16 family with B=16 T=128 H=512 (aa7ca5d), whose rows replace b64b27a's.
XEON_AMX_RESULTS = tuple(f"bench/results/{run}/bench.json" for run in (
    "cpu-xeonamx-2026-12-05-grid-t1-35ac72f", "cpu-xeonamx-2026-12-05-grid-t2-35ac72f",
    "cpu-xeonamx-2026-12-05-bf16-t1-35ac72f", "cpu-xeonamx-2026-12-05-bf16-t2-35ac72f",
    "cpu-xeonamx-2026-12-05-bf16-t1-b64b27a", "cpu-xeonamx-2026-12-05-bf16-t2-b64b27a",
    "cpu-xeonamx-2026-12-05-peers-lstm-t1-35ac72f", "cpu-xeonamx-2026-12-05-speech-t1-a5db55a",
    "cpu-xeonamx-2026-12-05-speech-t2-a5db55a", "cpu-xeonamx-2026-12-05-step-t1-7671b66",
    "cpu-xeonamx-2026-12-05-step-t2-7671b66", "cpu-xeonamx-2026-12-06-bf16-grid-t1-35a0d9b",
    "cpu-xeonamx-2026-12-06-bf16-grid-t2-35a0d9b", "cpu-xeonamx-2026-12-06-bf16-short-t1-35a0d9b",
    "cpu-xeonamx-2026-12-06-bf16-short-t2-35a0d9b", "cpu-xeonamx-2026-12-06-bf16-t1-aa7ca5d",
    "cpu-xeonamx-2026-12-06-bf16-t2-aa7ca5d"))
CPU = torch.device("cpu")


def entry(device, cell, dtype, phase, B, T, H, ratio, backend="cpu", threads=None):
    return {"device": device, "cell": cell, "dtype": dtype, "phase": phase, "B": B, "T": T, "H": H,
            "threads": threads, "speedups": {backend: ratio}, "source": "test"}


@pytest.fixture
def table(monkeypatch):
    """Replaces the shipped table by the entries the test appends.  Each edit
    installs a new table function, as loading another table file would: the
    modules' kept choices hold the function, not the document's contents."""
    doc = {"entries": None}

    class Entries(list):
        def _edited(self):
            monkeypatch.setattr(auto, "table", lambda: doc)

        def append(self, e):
            super().append(e)
            self._edited()

        def __iadd__(self, es):
            out = super().__iadd__(es)
            self._edited()
            return out

        def pop(self, *a):
            out = super().pop(*a)
            self._edited()
            return out

    doc["entries"] = Entries()
    doc["entries"]._edited()
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


def test_level_counts_as_rnnkern(table):
    """A ratio within 3% below 1.0 is level on these VMs: rnnkern runs (its path
    needs no choice); below that, torch.nn."""
    table += [entry("cpu:256bit", "lstm", "float32", "forward", 16, 128, 256, 0.975),
              entry("cpu:256bit", "gru", "float32", "forward", 16, 128, 256, 0.965)]
    assert choose().implementation == "cpu"
    assert choose(cell="gru").uses_torch


def test_cpu_rows_at_the_nearest_thread_count(table, monkeypatch):
    """oneDNN and rnnkern scale differently with threads: a CPU call decides by
    the rows measured at the thread count nearest to its own."""
    table += [entry("cpu:256bit", "lstm", "float32", "forward_backward", 64, 64, 128, 0.88, threads=1),
              entry("cpu:256bit", "lstm", "float32", "forward_backward", 64, 64, 128, 1.25, threads=2)]
    one = choose(training=True, B=64, T=64, H=128, threads=1)
    assert one.uses_torch and "0.88x" in one.reason and "1 thread " in one.reason, one
    for threads in (2, 3, 16):  # 3 and 16: nearer to 2 than to 1
        many = choose(training=True, B=64, T=64, H=128, threads=threads)
        assert many.implementation == "cpu" and "1.25x" in many.reason and "2 threads" in many.reason
    # Rows that name no thread count speak for every count.
    table.append(entry("cpu:256bit", "gru", "float32", "forward", 16, 128, 256, 0.5))
    assert choose(cell="gru", threads=1).uses_torch and choose(cell="gru", threads=2).uses_torch


def test_a_one_step_call_decides_by_one_step_rows(table):
    """A one-step call (T=1) costs its per-call work, a sequence its steps: a T=1
    call decides by the one-step rows where the table has them, even measured
    at another thread count, and a sequence call by the sequence rows."""
    table += [entry("cpu:256bit", "lstm", "float32", "forward", 1, 256, 256, 0.95, threads=2),
              entry("cpu:256bit", "lstm", "float32", "forward", 1, 1, 256, 3.2, threads=1)]
    step = choose(B=1, T=1, H=256, threads=2)
    assert step.implementation == "cpu" and "3.20x" in step.reason and "T=1" in step.reason, step
    sequence = choose(B=1, T=64, H=256, threads=2)
    assert sequence.uses_torch and "0.95x" in sequence.reason, sequence
    # Without rows of its regime, a call decides by the others.
    table.append(entry("cpu:256bit", "gru", "float32", "forward", 1, 256, 256, 0.9, threads=2))
    assert choose(cell="gru", B=1, T=1, H=256, threads=2).uses_torch


def test_a_bidirectional_call_decides_by_bidirectional_rows(table):
    """On a CPU rnnkern runs a bidirectional layer's two directions at once in
    inference (ops.run_concurrently): a bidirectional call decides by the rows
    measured on bidirectional stacks (bench/speech.py) where the table has
    them, else by the one-direction rows; a one-direction call never by the
    bidirectional rows."""
    table += [entry("cpu:256bit", "lstm", "float32", "forward", 1, 256, 128, 0.9, threads=2),
              dict(entry("cpu:256bit", "lstm", "float32", "forward", 1, 400, 512, 1.35, threads=2),
                   directions=2)]
    bi = choose(B=1, T=400, H=512, threads=2, directions=2)
    assert bi.implementation == "cpu" and "1.35x" in bi.reason and "bidirectional" in bi.reason, bi
    one = choose(B=1, T=400, H=512, threads=2)
    assert one.uses_torch and "0.90x" in one.reason and "bidirectional" not in one.reason, one
    # No bidirectional row for the GRU or for training: the one-direction rows decide.
    table.append(entry("cpu:256bit", "gru", "float32", "forward", 1, 256, 128, 0.8, threads=2))
    gru = choose(cell="gru", B=1, T=400, H=512, threads=2, directions=2)
    assert gru.uses_torch and "0.80x" in gru.reason, gru


def test_modules_tell_auto_their_directions(table, monkeypatch):
    asked = []
    real = auto.choose
    monkeypatch.setattr(auto, "choose", lambda **kw: asked.append(kw["directions"]) or real(**kw))
    x = torch.randn(5, 2, 8)
    for bidirectional in (False, True):
        rnnkern.GRU(8, 8, bidirectional=bidirectional, backend="auto")(x)
    assert asked == [1, 2]


def test_without_a_measurement(table):
    cuda = choose(device=torch.device("cuda"), device_key="cuda:sm_90", rnnkern_backend="cuda")
    assert cuda.uses_torch and "cuDNN" in cuda.reason
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert choose(dtype=dtype).implementation == "cpu"
    # bfloat16 on a CPU with the bf16 dot products: torch.nn (oneDNN uses them; rnnkern's use of
    # them is untimed there);
    # the other dtypes there, and bfloat16 once a row measures rnnkern faster, rnnkern.
    for key in ("cpu:512bit+bf16", "cpu:256bit+bf16"):
        bf16 = choose(dtype=torch.bfloat16, device_key=key)
        assert bf16.uses_torch and "bf16 dot-product" in bf16.reason
        assert choose(dtype=torch.float32, device_key=key).implementation == "cpu"
    table.append(entry("cpu:512bit+bf16", "lstm", "bfloat16", "forward", 16, 128, 256, 1.3))
    assert choose(dtype=torch.bfloat16, device_key="cpu:512bit+bf16").implementation == "cpu"


def test_a_cpu_with_512bit_fma_pipes_has_its_own_class():
    assert auto.fma_pipes_512bit("AuthenticAMD", 0x1A, 0x02)  # a server Zen 5 (this project's)
    assert auto.fma_pipes_512bit("AuthenticAMD", 0x1A, 0x44)  # a desktop one
    assert not auto.fma_pipes_512bit("AuthenticAMD", 0x1A, 0x24)  # a mobile one: 256-bit halves
    assert not auto.fma_pipes_512bit("AuthenticAMD", 0x19, 0x11)  # a Zen 4
    assert not auto.fma_pipes_512bit("GenuineIntel", 6, 0x8F)
    # The kernels' rule on this CPU is the table's (when no RNNKERN_CPU_FMA_BITS says otherwise).
    cpu = probe.cpu_identity()  # (Linux's /proc/cpuinfo; elsewhere only the rule above is checked)
    if "RNNKERN_CPU_FMA_BITS" not in os.environ and all(
            isinstance(cpu[k], int) for k in ("family", "model")) and cpu["vendor"]:
        expected = auto.fma_pipes_512bit(cpu["vendor"], cpu["family"], cpu["model"])
        assert (rnnkern._C.cpu_fma_pipe_bits() == 512) == expected
        assert auto._this_cpu_class().endswith(auto.FMA512) == (expected and rnnkern._C.cpu_vector_bits() == 512)
    assert auto.cpu_class(512, True, True) == "cpu:512bit+bf16+fma512"
    assert auto.cpu_class(512, True) == "cpu:512bit+bf16"
    assert auto.cpu_class(256, True, True) == "cpu:256bit+bf16"  # 256-bit kernels: the width moot
    assert auto.parent_class("cpu:512bit+bf16+fma512") == "cpu:512bit+bf16"
    assert auto.parent_class("cpu:512bit+bf16") is None and auto.parent_class("cuda:sm_90") is None


def test_a_512bit_fma_class_without_rows_of_the_call_takes_its_isa_classes(table):
    zen5, zen4 = "cpu:512bit+bf16+fma512", "cpu:512bit+bf16"
    table += [entry(zen4, "lstm", "float32", "forward", 16, 128, 256, 1.3),
              entry(zen4, "lstm", "float32", "forward", 16, 1, 256, 0.8),
              entry(zen4, "lstm", "bfloat16", "forward", 16, 128, 256, 1.2)]
    inherited = choose(device_key=zen5)
    assert inherited.implementation == "cpu" and f"1.30x torch.nn's speed: lstm float32 forward at B=16 " \
        f"T=128 H=256 on {zen4} (test)" in inherited.reason
    assert choose(device_key=zen5, dtype=torch.bfloat16).implementation == "cpu"
    # Its own sequence rows decide its sequence calls; its one-step calls, without one-step
    # rows of its own, go by the Zen 4's one-step rows.
    table.append(entry(zen5, "lstm", "float32", "forward", 32, 128, 256, 0.9))
    own = choose(device_key=zen5)
    assert own.uses_torch and f"0.90x torch.nn's speed" in own.reason and zen5 in own.reason
    step = choose(device_key=zen5, T=1)
    assert step.uses_torch and "0.80x" in step.reason and f"on {zen4} " in step.reason
    table.append(entry(zen5, "lstm", "float32", "forward", 16, 1, 256, 1.1))
    assert choose(device_key=zen5, T=1).implementation == "cpu"
    # A bidirectional call: its own one-direction rows where neither class has bidirectional ones.
    assert choose(device_key=zen5, directions=2).uses_torch
    # bfloat16 where neither class has a row for the cell: torch.nn, as for the Zen 4.
    gru = choose(device_key=zen5, dtype=torch.bfloat16, cell="gru")
    assert gru.uses_torch and "bf16 dot-product" in gru.reason
    # The other classes never borrow.
    assert choose(device_key="cpu:512bit").implementation == "cpu"
    assert "no measurement" in choose(device_key="cpu:512bit").reason


def test_a_cpu_with_amx_has_its_own_class_and_borrows_no_rows(table):
    """oneDNN runs torch.nn's bfloat16 products on AMX's tiles where the CPU has
    them (an Intel Xeon from Sapphire Rapids on: the LSTM's forward at T=128 B=32
    H=256 7x faster than rnnkern's): a Zen 4's bf16 rows, measured against oneDNN
    on the dot products, must not send such a CPU's calls to rnnkern."""
    amx = "cpu:512bit+bf16+amx"
    assert auto.cpu_class(512, True, amx=True) == amx
    assert auto.cpu_class(512, True, True, True) == amx + auto.FMA512
    assert auto.parent_class(amx) is None and auto.parent_class(amx + auto.FMA512) == amx
    # This CPU's class says whether it has the tiles, as Linux's flags do.
    assert (auto.AMX in auto._this_cpu_class()) == ("amx_bf16" in (probe.cpuinfo()[1] or set()))
    table += [entry("cpu:512bit+bf16", "gru", "bfloat16", "forward", 16, 128, 256, 1.9),
              entry("cpu:512bit+bf16", "gru", "float32", "forward", 16, 128, 256, 1.5)]
    assert choose(device_key="cpu:512bit+bf16", dtype=torch.bfloat16, cell="gru").implementation == "cpu"
    for key in (amx, amx + auto.FMA512):
        bf16 = choose(device_key=key, dtype=torch.bfloat16, cell="gru")
        assert bf16.uses_torch and "bf16 dot-product" in bf16.reason and key in bf16.reason
    # float32, which oneDNN runs on no tiles, takes the rows of the class without AMX.
    assert choose(device_key=amx, cell="gru").implementation == "cpu"
    # Its own rows decide.
    table += [entry(amx, "gru", "bfloat16", "forward", 16, 128, 256, 0.45),
              entry(amx, "gru", "float32", "forward", 16, 128, 256, 0.9)]
    bf16 = choose(device_key=amx, dtype=torch.bfloat16, cell="gru")
    assert bf16.uses_torch and "0.45x" in bf16.reason
    assert choose(device_key=amx, cell="gru").uses_torch
    # A result's class comes from the flags the benchmark recorded.
    meta = {"device": {"type": "cpu", "isa": {"cpu_flags": ["avx2", "avx512f", "avx512_bf16", "amx_bf16"],
                                              "rnnkern_vector_bits": 512, "rnnkern_fma_pipe_bits": 256}}}
    assert bench_auto_table.device_key(meta) == amx
    meta["device"]["isa"]["cpu_flags"].remove("amx_bf16")
    assert bench_auto_table.device_key(meta) == "cpu:512bit+bf16"


def test_the_shipped_table_is_the_committed_results(tmp_path):
    """The package's table is what bench.auto_table writes from the committed
    benchmarks (the H100's and a Zen 3's): one run updates its device's rows,
    nothing is typed in by hand."""
    out = tmp_path / "table.json"
    for args in ([*GPU_RESULTS, *CPU_RESULTS], [*BF16_RESULTS, "--dtypes", "bfloat16"],
                 [*F32_RESULTS, "--dtypes", "float32"], list(ZEN5_RESULTS), list(XEON_AMX_RESULTS)):
        done = subprocess.run([sys.executable, "-m", "bench.auto_table", *args, "--out", str(out)],
                              cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
        assert done.returncode == 0, done.stderr
    with open(auto.TABLE_PATH) as f:
        shipped = json.load(f)
    with open(out) as f:
        assert json.load(f)["entries"] == shipped["entries"]
    assert {e["device"] for e in shipped["entries"]} == {"cuda:sm_90", "cpu:256bit", "cpu:512bit+bf16",
                                                         "cpu:512bit+bf16+fma512", "cpu:512bit+bf16+amx"}
    # The AVX512_BF16 class: bfloat16 rows from the bf16 runs, float32 rows from the float32 ones
    # (a run's other dtype taken from neither: --dtypes).
    zen4 = [e for e in shipped["entries"] if e["device"] == "cpu:512bit+bf16"]
    assert {e["dtype"] for e in zen4} == {"bfloat16", "float32"}
    for e in zen4:
        runs = ("-grid-t", "-grid-lstm-t", "-short-t", "-bf16-t", "-step-", "-speech-t") if e["dtype"] == "float32" else ("-bf16-",)
        assert any(r in e["source"] for r in runs), e
    # What it says for the measured H100 cases (median of 10 CUDA-event timings).
    by_case = {(e["cell"], e["dtype"], e["phase"], e["B"], e["T"], e["H"]): e["speedups"]["cuda"]
               for e in shipped["entries"] if e["device"] == "cuda:sm_90"}
    assert by_case[("lstm", "float16", "forward", 16, 1024, 768)] < 0.4  # cuDNN's persistent kernel
    assert by_case[("lstm", "bfloat16", "forward", 16, 1024, 768)] > 1.5  # rnnkern's (1.81x)
    # The gated cells' forward at B=64 H=1024 after 345262f (the host loop), its rows
    # replacing the grid's (which ran the persistent kernel there).
    b64 = {e["cell"]: e for e in shipped["entries"] if e["device"] == "cuda:sm_90" and e["B"] == 64
           and e["dtype"] == "bfloat16" and e["phase"] == "forward"}
    assert all(e["source"].endswith("bench-cuda-latency-345262f/bench_gpu.json") for e in b64.values())
    # The Triton runs merged in: their column, the seventh run's CUDA ratios replacing theirs.
    triton = {(e["cell"], e["dtype"], e["phase"], e["B"], e["T"], e["H"]): e["speedups"]
              for e in shipped["entries"] if "triton" in e["speedups"]}
    assert len(triton) == 36  # 12 + 28 cases, 4 of them in both runs
    loop = triton[("rnn_tanh", "bfloat16", "forward_backward", 1, 1024, 256)]
    # the whole-sequence Triton kernel against cuDNN (9.77x), then the persistent CUDA kernel (4.33x)
    assert loop["triton"] > 5 and 2 < loop["cuda"] < loop["triton"]
    assert max(r["triton"] for r in triton.values() if r is not loop) < 5
    # The 256-bit class's two-thread LSTM latency rows (a Zen 4 at AVX2 on 11-28, a Zen 3's
    # since 2026-12-03): at B=1 H=256 torch.nn (oneDNN splits the step over both cores) wins
    # the forward, and auto runs it there and above, as measured; the training is level now
    # (0.88x then, 0.99x), rnnkern's.
    latency = {(e["phase"], e["B"], e["H"]): e["speedups"]["cpu"] for e in shipped["entries"]
               if e["source"].endswith("cpu-zen3-2026-12-03-lstm-latency-t2-5b14c17/bench.json")}
    assert len(latency) == 18 and latency[("forward", 1, 256)] < auto.LEVEL
    assert latency[("forward_backward", 1, 256)] >= auto.LEVEL
    # One thread, B=64 T=64 H=128 LSTM training: 0.88x on the Zen 3 before c13bd73's
    # products, 1.01x on the Zen 4 after, 1.05x on a Zen 3 after b977408: its row is the
    # latest run's, and auto runs rnnkern.
    # The Zen 4's bidirectional rows (the speech family): the LSTM at B=1 on two threads runs
    # its directions at once, in inference and in training, forward (since 2206010) and
    # backward (since 72d46ae): rnnkern for both (its training there was 0.94x, torch.nn's,
    # when it ran them one after the other, 1.06x with the forward alone at once).
    # The Zen 3's (256-bit class, 2026-12-03) likewise: before them a bidirectional LSTM at B=1
    # on two threads took the one-direction row of B=1 T=256 H=256 (0.94x) and ran torch.nn,
    # where rnnkern measured 1.22x (inference) and 1.28x (training).
    bi = {(e["device"], e["cell"], e["phase"], e["B"], e["threads"]): e["speedups"]["cpu"]
          for e in shipped["entries"] if e.get("directions") == 2}
    assert len(bi) == 64 and {k[0] for k in bi} == {"cpu:512bit+bf16", "cpu:256bit", "cpu:512bit+bf16+fma512",
                                                    "cpu:512bit+bf16+amx"}
    for device in ("cpu:512bit+bf16", "cpu:256bit"):
        assert bi[(device, "lstm", "forward", 1, 2)] > 1.2
        assert bi[(device, "lstm", "forward_backward", 1, 2)] > 1.2
    # The Zen 4's float32 sequence rows: the full grid of the default families (15 sizes a cell)
    # at 1 and 2 threads, the LSTM's from its later runs (c5126ae): its forward at B=16 H=256
    # on one thread, 0.96x before c5126ae made x_t W_ih^T in the steps there, now rnnkern's.
    # (A one-row LSTM at H=256 on two threads measured 0.78x, then 1.04x: oneDNN's split of
    # each step over both cores took 5.5-7.2 ms from run to run on this shared VM.)
    grid = {(e["cell"], e["phase"], e["B"], e["T"], e["H"], e["threads"]): e["speedups"]["cpu"]
            for e in zen4 if "-grid-t" in e["source"]}
    assert len(grid) == 3 * 15 * 2 * 2
    assert all("-grid-lstm-t" in e["source"] for e in zen4 if "-grid-t" in e["source"] and e["cell"] == "lstm")
    assert grid[("lstm", "forward", 16, 256, 256, 1)] >= auto.LEVEL
    # and the short family's (T 8 and 32): 24 sizes a cell, decided by their own rows.
    short = [e for e in zen4 if "-short-t" in e["source"]]
    assert len(short) == 3 * 24 * 2 * 2 and {e["T"] for e in short} == {8, 32}
    # its LSTM rows from the later runs (8e167f6, after c5126ae's forward): B=64 T=32 H=256 at
    # one thread 0.90x before, 1.00x after, rnnkern's now.
    assert all("-short-lstm-t" in e["source"] for e in short if e["cell"] == "lstm")
    assert next(e["speedups"]["cpu"] for e in short if e["cell"] == "lstm" and e["phase"] == "forward"
                and (e["B"], e["T"], e["H"], e["threads"]) == (64, 32, 256, 1)) >= auto.LEVEL
    row = next(e for e in shipped["entries"] if e["device"] == "cpu:256bit" and e["cell"] == "lstm"
               and e["phase"] == "forward_backward" and (e["B"], e["T"], e["H"], e["threads"]) == (64, 64, 128, 1))
    assert row["source"].endswith("cpu-zen3-2026-12-03-peers-step-t1-b977408/bench.json")
    assert row["speedups"]["cpu"] >= auto.LEVEL
    # The Zen 5's own class: every sequence row of the default families at 1 and 2 threads, and
    # the bf16 family's. Its one-row LSTM at H=256 on two threads (oneDNN splits each step over
    # both cores) is torch.nn's there, where the Zen 4's rows said rnnkern; a one-step call goes
    # by the Zen 5's own one-step rows (1.30-5.27x torch.nn at one thread).
    zen5 = [e for e in shipped["entries"] if e["device"] == "cpu:512bit+bf16+fma512"]
    assert {(e["dtype"], e["threads"]) for e in zen5 if e.get("directions", 1) == 1} == \
        {("float32", 1), ("float32", 2), ("bfloat16", 1), ("bfloat16", 2)}
    assert len({(e["cell"], e["phase"], e["B"], e["T"], e["H"], e["threads"])
                for e in zen5 if "-grid-t" in e["source"]}) == 3 * 15 * 2 * 2
    one_row = dict(cell="lstm", device=CPU, dtype=torch.float32, B=1, H=256, T=256, training=False,
                   torch_lacks=None, rnnkern_backend="cpu", threads=2)
    assert auto.choose(**one_row, device_key="cpu:512bit+bf16+fma512").uses_torch
    assert not auto.choose(**one_row, device_key="cpu:512bit+bf16").uses_torch
    step = auto.choose(**{**one_row, "T": 1, "threads": 1}, device_key="cpu:512bit+bf16+fma512")
    assert step.implementation == "cpu" and "on cpu:512bit+bf16+fma512 " in step.reason
    assert "cpu-zen5-2026-12-03-step-t1-" in step.reason
    # and a bf16 one (1.09-5.12x at one and two threads) by its own bf16 one-step rows too,
    # no longer by the Zen 4's.
    for threads in (1, 2):
        bf16_step = auto.choose(**{**one_row, "T": 1, "threads": threads, "dtype": torch.bfloat16},
                                device_key="cpu:512bit+bf16+fma512")
        assert bf16_step.implementation == "cpu" and "on cpu:512bit+bf16+fma512 " in bf16_step.reason
        assert f"cpu-zen5-2026-12-04-step-bf16-t{threads}-" in bf16_step.reason
    # The Intel Xeon's own class (AMX's bf16 tiles, 512-bit FMA pipes that rnnkern's kernels do not
    # tell apart: 2026-12-05): every sequence row of the default families at 1 and 2 threads, both
    # dtypes. With rnnkern's bf16 products on the tiles too (f558dfa; the family again at 35ac72f),
    # its bf16 LSTM sequences at the bf16 family's sizes are rnnkern's (1.01x forward at B=32 T=128
    # H=256 one thread, 1.36x at two; 0.16-0.22x on vdpbf16ps; 1.07x and 1.29x at b64b27a, 0.99x and
    # 1.38x at aa7ca5d), the forward at B=64 T=64 H=512 on two threads at the line (0.98x at
    # 35ac72f, 0.97x at f558dfa, 0.96x at b64b27a, 0.98x at aa7ca5d), its
    # bf16 one-step calls rnnkern's (2.06x at B=1 H=256 one thread), and its
    # float32 LSTM forward at B=64 T=64 H=512 torch.nn's (0.83x at 35ac72f, 0.60x before), where
    # without rows it took the Zen 4's.
    xeon = [e for e in shipped["entries"] if e["device"] == "cpu:512bit+bf16+amx"]
    assert {(e["dtype"], e["threads"]) for e in xeon if e.get("directions", 1) == 1} == \
        {("float32", 1), ("float32", 2), ("bfloat16", 1), ("bfloat16", 2)}
    assert len({(e["cell"], e["phase"], e["B"], e["T"], e["H"], e["threads"])
                for e in xeon if "-grid-t" in e["source"]}) == 3 * 15 * 2 * 2
    amx = dict(one_row, device_key="cpu:512bit+bf16+amx", threads=1)
    for threads in (1, 2):
        seq_bf16 = auto.choose(**{**amx, "B": 32, "T": 128, "dtype": torch.bfloat16, "threads": threads})
        assert seq_bf16.implementation == "cpu" and f"cpu-xeonamx-2026-12-06-bf16-t{threads}-aa7ca5d" in seq_bf16.reason
    # The bf16 family's B=16 T=128 H=512 (aa7ca5d): its forward on two threads below auto.LEVEL
    # (0.94x), torch.nn's, where the nearest rows before it (B=16-32 H=256, 1.28-1.29x) ran
    # rnnkern's; its training rnnkern's (2.17x).  B=64 T=64 H=512 on two threads measured 0.96x at
    # b64b27a and 0.98x at aa7ca5d, whose row replaces it.
    small_wide = dict(amx, B=16, T=128, H=512, dtype=torch.bfloat16, threads=2)
    below = auto.choose(**small_wide)
    assert below.uses_torch and "at B=16 T=128 H=512, 2 threads" in below.reason
    assert auto.choose(**{**small_wide, "training": True}).implementation == "cpu"
    assert auto.choose(**{**small_wide, "B": 64, "T": 64}).implementation == "cpu"
    # bf16 over the latency, throughput and short sizes (35a0d9b): the one-thread LSTM rows below
    # the line send their neighbourhood to torch.nn (B=64 T=256 H=128 forward 0.73x, B=64 T=32
    # H=32 0.72x, B=128 T=64 H=128 training 0.74x), whose calls the two sizes of the bf16 family
    # had given to rnnkern; the GRU's and the RNN's stay rnnkern's (1.60x and up).
    for B, T, H, training in ((64, 256, 128, False), (64, 32, 32, False), (128, 64, 128, True)):
        lstm_bf16 = auto.choose(**{**amx, "B": B, "T": T, "H": H, "training": training, "dtype": torch.bfloat16})
        assert lstm_bf16.uses_torch and f"at B={B} T={T} H={H}, 1 thread" in lstm_bf16.reason
        for cell in ("gru", "rnn_tanh"):
            assert auto.choose(**{**amx, "cell": cell, "B": B, "T": T, "H": H, "training": training,
                                  "dtype": torch.bfloat16}).implementation == "cpu"
    for threads in (1, 2):
        step_bf16 = auto.choose(**{**amx, "T": 1, "threads": threads, "dtype": torch.bfloat16})
        assert step_bf16.implementation == "cpu" and f"cpu-xeonamx-2026-12-05-step-t{threads}-" in step_bf16.reason
    wide = auto.choose(**{**amx, "B": 64, "T": 64, "H": 512})
    assert wide.uses_torch and "on cpu:512bit+bf16+amx " in wide.reason
    assert not auto.choose(**{**amx, "B": 64, "T": 64, "H": 512, "device_key": "cpu:512bit+bf16"}).uses_torch


def gpu_entry(cell, dtype, phase, B, T, H, **ratios):
    return {"device": "cuda:sm_90", "cell": cell, "dtype": dtype, "phase": phase, "B": B, "T": T,
            "H": H, "speedups": ratios, "source": "test"}


def choose_gpu(**kw):
    args = dict(cell="rnn_tanh", device=torch.device("cuda"), dtype=torch.bfloat16, B=1, H=256,
                T=1024, training=False, rnnkern_backend="cuda", device_key="cuda:sm_90")
    args.update(kw)
    return choose(**args)


def test_triton_on_a_gpu_only_where_its_measured_kernel_runs(table):
    """Triton's whole-sequence kernel (W_hh on chip) and its per-step path differ
    five- to fifty-fold: a Triton ratio counts only for calls that run the same
    Triton kernel as its measurement, within a factor of 4 in B and H."""
    table += [gpu_entry("rnn_tanh", "bfloat16", "forward", 1, 1024, 256, cuda=0.69, triton=4.74),
              gpu_entry("rnn_tanh", "bfloat16", "forward", 64, 1024, 1024, cuda=1.05, triton=0.2)]
    assert auto.triton_path("rnn_tanh", 256, 256, torch.bfloat16, False) == "loop"
    assert auto.triton_path("rnn_tanh", 512, 512, torch.bfloat16, False) == "spread"
    assert auto.triton_path("lstm", 256, 256, torch.bfloat16, False) == "spread"
    assert auto.triton_path("lstm", 256, 128, torch.bfloat16, True) == "spread"
    assert auto.triton_path("gru_reset_before", 256, 256, torch.bfloat16, False) == "spread"
    assert auto.triton_path("lstm_ln", 256, 256, torch.bfloat16, False) == "step"
    assert auto.triton_path("lstm", 256, 256, torch.bfloat16, False, B=64 * 133) == "step"
    assert auto.triton_path("lstm", 128, 64, torch.bfloat16, True) == "loop"
    at = choose_gpu()
    assert at.implementation == "triton" and "4.74x" in at.reason, at
    near = choose_gpu(B=4, H=128, T=64)  # the same kernel, within reach
    assert near.implementation == "triton", near
    # Not the measured kernel: the whole-sequence measurement does not speak for H=512
    # (spread path, no Triton row within reach): CUDA's nearest row (cuDNN faster) decides.
    wide = choose_gpu(H=512)
    assert wide.uses_torch and "0.69x" in wide.reason, wide
    # The spread path's own row (0.2x, measured per step before the spread kernels) within
    # reach loses to CUDA's 1.05x.
    big = choose_gpu(B=32, H=1024)
    assert big.implementation == "cuda" and "1.05x" in big.reason, big
    # The same kernel but beyond reach (B 16x the measured): not Triton; CUDA's nearest row decides.
    far = choose_gpu(B=16)
    assert far.implementation == "cuda" and "B=64 T=1024 H=1024" in far.reason, far
    # No Triton rows for this dtype, phase or cell: never Triton.
    assert choose_gpu(dtype=torch.float16).uses_torch
    assert choose_gpu(training=True).uses_torch
    assert choose_gpu(cell="gru").uses_torch
    # CPU tensors never take a Triton row.
    table.append(gpu_entry("rnn_tanh", "bfloat16", "forward", 1, 1024, 256, triton=4.74) | {"device": "cpu:256bit"})
    assert choose(cell="rnn_tanh", dtype=torch.bfloat16, B=1, H=256).implementation == "cpu"
    # A build without the CUDA kernels (rnnkern's GPU backend is Triton): the same rule.
    assert choose_gpu(rnnkern_backend="triton").implementation == "triton"
    assert choose_gpu(rnnkern_backend="triton", H=512).uses_torch
    assert choose_gpu(rnnkern_backend="triton", B=16).uses_torch


def test_modules_run_the_backend_auto_chose(monkeypatch):
    """When auto chooses one of rnnkern's backends (on a GPU: cuda or Triton), the
    module runs that one -- plain and packed input alike (Triton's
    interpreter stands in for the GPU here)."""
    from rnnkern import ops
    torch.manual_seed(0)
    ours = rnnkern.GRU(5, 7, num_layers=2).double()
    twin = rnnkern.GRU(5, 7, num_layers=2, backend="triton").double()
    twin.load_state_dict(ours.state_dict())
    ran = []
    family = ops._op_family
    monkeypatch.setattr(ops, "_op_family", lambda backend: ran.append(backend) or family(backend))
    monkeypatch.setattr(auto, "choose", lambda **kw: auto.Choice("triton", "test"))
    g = generator("auto", "modules_run_the_backend_auto_chose")
    x = randn(g, 6, 3, 5)
    lengths = torch.tensor([6, 2, 4])
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
    for args, kw in (((x,), {}), ((packed,), {})):
        ran.clear()
        got, want = ours(*args, **kw), twin(*args, **kw)
        assert ran and set(ran) == {"triton"}, ran
        got_out = got[0].data if isinstance(got[0], nn.utils.rnn.PackedSequence) else got[0]
        want_out = want[0].data if isinstance(want[0], nn.utils.rnn.PackedSequence) else want[0]
        assert torch.equal(got_out, want_out) and torch.equal(got[1], want[1])


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


def test_a_module_reuses_its_last_choice_only_while_nothing_it_depends_on_changed(table, monkeypatch):
    """A one-step call in a loop pays the choice once (the module keeps its last
    one): a new shape, dtype, grad mode, weights' requires_grad, thread count,
    table entry or CPU class chooses afresh, and every answer is the fresh
    module's."""
    asked = []
    real = auto.choose
    monkeypatch.setattr(auto, "choose", lambda **kw: asked.append(kw) or real(**kw))
    torch.manual_seed(0)
    m = rnnkern.LSTM(4, 8)
    x = torch.randn(1, 2, 4)

    def explain(module, inp):
        n = len(asked)
        choice = rnnkern.explain(module, inp)
        asks = len(asked) - n  # 1: this module asked auto.choose, 0: it reused its choice
        fresh = rnnkern.LSTM(4, 8)
        fresh.load_state_dict(module.state_dict())
        fresh.requires_grad_(module.weight_ih_l0.requires_grad)
        fresh.to(module.weight_ih_l0.dtype)
        assert rnnkern.explain(fresh, inp) == choice
        return asks

    assert explain(m, x) == 1
    assert explain(m, x) == 0 and explain(m, x.clone()) == 0
    assert explain(m, torch.randn(2, 2, 4)) == 1  # T
    assert explain(m, torch.randn(2, 2, 4)) == 0
    assert explain(m, x) == 1
    with torch.no_grad():  # training -> inference
        assert explain(m, x) == 1
    m.requires_grad_(False)
    assert explain(m, x) == 1
    assert explain(m, x.requires_grad_()) == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    assert explain(m, x) == 1
    table.append(entry(auto.device_class(CPU), "lstm", "float32", "forward_backward", 2, 1, 8, 0.5))
    assert explain(m, x) == 1 and rnnkern.explain(m, x).uses_torch
    monkeypatch.setattr(auto, "_this_cpu_class", lambda: "cpu:other")
    assert explain(m, x) == 1 and not rnnkern.explain(m, x).uses_torch
    m.double()
    assert explain(m, x.detach().double()) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):  # never kept under autocast
        assert explain(m, x) == 1 and explain(m, x) == 1
    # A call with an option torch.nn lacks: rnnkern (the forward runs rnnkern's default
    # backend without asking; explain asks once and keeps the answer apart from the
    # plain call's).
    x = x.detach()
    resets = torch.tensor([[True, False]])
    n = len(asked)
    assert rnnkern.explain(m, x, resets=resets).implementation == "cpu"
    assert rnnkern.explain(m, x, resets=resets).implementation == "cpu"
    assert len(asked) == n + 1
    assert explain(m, x) == 1
    # Packed input: kept for the same steps and batch (its batch_sizes), whatever its rows.
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(3, 2, 4).double(), torch.tensor([3, 2]))
    assert explain(m, packed) == 1 and explain(m, packed) == 0
    other = nn.utils.rnn.pack_padded_sequence(torch.randn(3, 2, 4).double(), torch.tensor([3, 1]))
    assert explain(m, other) == 0
    assert explain(m, nn.utils.rnn.pack_padded_sequence(torch.randn(4, 2, 4).double(),
                                                       torch.tensor([4, 1]))) == 1


def test_the_forward_runs_the_kept_choice(table, monkeypatch):
    """The forward and rnnkern.explain share one choice: a table change between
    calls of a one-step loop switches the forward between torch.nn and rnnkern at
    once, and a choice torch.nn makes is torch.nn's bits."""
    torch.manual_seed(0)
    theirs = nn.LSTM(4, 8).double()
    ours = rnnkern.LSTM(4, 8).double()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(1, 2, 4, dtype=torch.float64)
    ran = []
    torch_forward = type(ours)._torch_nn_forward
    monkeypatch.setattr(type(ours), "_torch_nn_forward",
                        lambda self, *a: ran.append("torch.nn") or torch_forward(self, *a))
    ours(x)
    assert ran == []
    table.append(entry(auto.device_class(CPU), "lstm", "float64", "forward_backward", 2, 1, 8, 0.5))
    got = ours(x)
    assert ran == ["torch.nn"] and torch.equal(got[0], theirs(x)[0])
    # resets= and lengths= (torch.nn has neither): rnnkern, without asking for a choice.
    asked = []
    mixin = rnnkern.modules.sequence._RecurrentMixin  # (every sequence module's)
    choice = mixin._auto_choice
    monkeypatch.setattr(mixin, "_auto_choice", lambda self, *a: asked.append(a) or choice(self, *a))
    resets = torch.tensor([[True, False]])
    got = ours(x, resets=resets)
    assert ran == ["torch.nn"] and asked == []
    twin = rnnkern.LSTM(4, 8, backend="cpu").double()
    twin.load_state_dict(ours.state_dict())
    assert torch.equal(got[0], twin(x, resets=resets)[0])
    ours(x, lengths=torch.tensor([1, 1]))
    assert ran == ["torch.nn"] and asked == []
    ours(x)
    assert ran == ["torch.nn"] * 2 and len(asked) == 1
    # An option set on the module drops the kept choice: zoneout, which torch.nn
    # lacks (rnnkern runs, without asking).
    ours.zoneout = 0.25
    ours(x)
    assert ran == ["torch.nn"] * 2 and len(asked) == 1
    for other in (rnnkern.LayerNormLSTM(4, 8), rnnkern.GRU(4, 8, reset_after=False)):
        other.double()(x)
    assert len(asked) == 1
    ours.zoneout = 0.0
    table.pop()
    ours(x)
    assert ran == ["torch.nn"] * 2
    # The kept choice stays with the module object: not in its pickles or copies
    # (nor in a converted module's).
    import copy
    import pickle
    converted = rnnkern.convert(nn.LSTM(4, 8).double())
    converted(x)
    for module in (ours, converted):
        assert "_auto_kept" in module.__dict__
        for clone in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):
            assert "_auto_kept" not in clone.__dict__ and torch.equal(clone(x)[0], module(x)[0])

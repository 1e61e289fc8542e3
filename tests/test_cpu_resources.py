"""Resources of the C++ CPU backend: the memory its buffer cache really holds
(csrc/cpu/buffers.cpp) and the parallel regions its kernels open
(csrc/cpu/parallel.h).  Each check runs in a fresh interpreter, so that the
cache, the thread count and the process's resident memory are its own."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import rnnkern
from conftest import (CELLS, assert_close, generator, outputs_and_grads, randn,
                      recurrence_inputs, rnnkern_module)

# (cell, proj_size): every cell and GRU form, and the LSTM with a projection.
CASES = [(cell, 0) for cell in CELLS] + [("lstm", 3)]
CASE_IDS = [f"{c}-proj{p}" if p else c for c, p in CASES]


def run_script(script: str, *args: str, **env: str) -> str:
    """Runs `script` with `args` in a new interpreter, `env` added to the
    environment; returns its stdout."""
    run = subprocess.run([sys.executable, "-c", script, *args], env=dict(os.environ, **env),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


# ---------------------------------------------------------- buffer cache ----

# Requests of the given sizes, k buffers at a time, each set freed before the
# next.  What the cache holds is measured as the process's resident memory
# (/proc/self/statm) above what it was before the first request, while the
# blocks are cached and after empty_cpu_cache(), not as the cache's own count.
_REQUESTS_SCRIPT = '''
import os, sys, torch, rnnkern
PAGE = os.sysconf("SC_PAGE_SIZE")
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE
MiB, N = 1 << 20, 1024  # a [M, N] fp32 output is M * 4 KiB
k, sizes_mib = int(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")]
x, w = torch.randn(max(sizes_mib) * MiB // (4 * N), 1), torch.randn(N, 1)
base = resident()
for mib in sizes_mib:
    ys = [torch.ops.rnnkern.linear(x[:mib * MiB // (4 * N)], w) for _ in range(k)]
    del ys
held = resident() - base
returned = rnnkern.ops.empty_cpu_cache()
print(held, returned, resident() - base)
'''

# Every size at least 80% of the one before: each request reuses the block of
# the previous one.
_SHRINKING = [40, 32, 26, 22, 18, 16, 14, 12, 10, 8]


@pytest.mark.parametrize("cap_mib,k,sizes_mib", [
    (48, 1, _SHRINKING * 3),
    (24, 3, _SHRINKING),
    (24, 1, [40, 8, 40, 30, 24, 20, 16, 12, 4, 2, 1]),
    (64, 4, [2, 4, 8, 16, 30, 24]),
], ids=["shrinking-cycles", "shrinking-3-at-a-time", "jumping", "growing"])
def test_buffer_cache_holds_at_most_its_cap_in_real_memory(cap_mib, k, sizes_mib):
    """Whatever the request sizes, the cache's blocks never take more resident
    memory than RNNKERN_CPU_CACHE_MB, empty_cpu_cache() gives all of it back to
    the system and reports the bytes it returned.  (A block reused for a
    smaller request was booked at the smaller size: 1490 MiB were held under a
    256 MiB cap.)"""
    out = run_script(_REQUESTS_SCRIPT, str(k), ",".join(map(str, sizes_mib)),
                     RNNKERN_CPU_CACHE_MB=str(cap_mib))
    held, returned, after = (int(v) for v in out.split())
    MiB = 1 << 20
    slack = 2 * MiB  # the interpreter's own allocations on the way
    assert held <= cap_mib * MiB + slack, f"{held / MiB:.1f} MiB held under a {cap_mib} MiB cap"
    assert after <= slack, f"{after / MiB:.1f} MiB still resident after empty_cpu_cache()"
    assert returned <= cap_mib * MiB
    assert abs(held - after - returned) <= slack, (
        f"empty_cpu_cache() said {returned / MiB:.1f} MiB, resident memory fell by "
        f"{(held - after) / MiB:.1f} MiB")


# ------------------------------------------------------ parallel regions ----

@pytest.fixture
def two_threads():
    """Two threads, as on the 2-core machines the thread-collapse was seen on
    (and whatever this machine has)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cell", ["rnn_tanh", "gru", "lstm"])
@pytest.mark.parametrize("T,B,H", [(20000, 1, 32), (4000, 1, 256), (2000, 32, 32), (1000, 32, 256)],
                         ids=lambda v: str(v))
def test_parallel_regions_do_not_grow_with_the_sequence(two_threads, cell, T, B, H):
    """A forward and backward whose steps have little work opens a few
    parallel regions in all, not some per step or per chunk of steps: each
    region is a meeting of the threads, which costs up to a scheduler time
    slice when another process holds a core (a GRU at T=20000 B=1 H=32 ran 42x
    slower on two threads than on one, through 316 regions a call)."""
    g = generator("regions", cell, T, B, H)
    module = rnnkern_module(cell, H, H)
    x = randn(g, T, B, H, dtype=torch.float32, requires_grad=True)
    before = rnnkern._C.cpu_parallel_regions()
    out, _ = module(x)
    (out * randn(g, *out.shape, dtype=out.dtype)).sum().backward()
    regions = rnnkern._C.cpu_parallel_regions() - before
    assert regions <= 16, f"{regions} parallel regions for T={T}"


# Sizes whose paths run only with several threads, each against the float64
# reference: by rows with a W_hh too large to stay in cache (each step too
# small to split by units), by units (a step large enough), and weight-gradient
# GEMMs over a K = T * B long enough to go chunk by chunk (K * H * 8 > 2 MiB).
@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("T,B,H", [(24, 32, 384), (6, 32, 640)], ids=["by-rows", "by-units"])
def test_two_threads_match_the_reference(two_threads, cell, proj, T, B, H):
    args = recurrence_inputs(cell, T, B, H, proj=proj, requires_grad=True, key=("threads", T))
    ours = outputs_and_grads("cpu", cell, args, key=("threads", T))
    expected = outputs_and_grads("reference", cell, args, key=("threads", T))
    for name, value in expected.items():
        assert_close(ours[name], value, what=name)

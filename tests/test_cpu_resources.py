"""Resources of the C++ CPU backend: the memory its buffer cache really holds
(csrc/cpu/buffers.cpp) and the parallel regions its kernels open
(csrc/cpu/parallel.h).  Each check runs in a fresh interpreter, so that the
cache, the thread count and the process's resident memory are its own."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


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



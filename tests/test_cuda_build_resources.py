"""Static resource checks of the real CUDA build (issue #12), no GPU needed.

``cuobjdump --dump-resource-usage`` on rnnkern._C gives, per kernel and
architecture, its registers per thread, static shared memory, stack and local
memory; ``cuobjdump -sass`` its instructions, where a register spill is a
local-memory store (STL) and load (LDL).  Checked against the launch
configuration the sources actually use (block sizes parsed from each kernel's
``RNNKERN_LAUNCH``, constants from the sources):

- registers x threads per block fit the SM's 64K register file (else the
  launch fails with "too many resources requested");
- static shared memory <= 48 KiB (no kernel opts into more);
- no spills (STL/LDL) in the step and pointwise kernels, except the ones listed
  in ``SPILL_ALLOWANCE`` with the measured count and the reason;
- every kernel instantiation exists for every architecture in the build, and
  the step kernel for all four dtypes and every phase.

The cuobjdump is the toolkit's, else the one Triton bundles (CI has no full
toolkit).  A build without the CUDA kernels skips, with the reason.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

import rnnkern
from rnnkern import ops

SOURCES = Path(__file__).resolve().parent.parent / "csrc" / "cuda"
REGISTER_FILE = 64 * 1024   # 32-bit registers per SM (sm_80 .. sm_90)
STATIC_SHARED = 48 * 1024   # without cudaFuncSetAttribute's opt-in
DTYPES = ("double", "float", "__half", "__nv_bfloat16")

# Kernels allowed to spill: (kernel family, dtype, phase) -> (STL+LDL instructions, why).
SPILL_ALLOWANCE = {
    ("step_kernel", "__half", "0"): (2, "ptxas keeps one value in local memory across the K loop "
                                        "of the fp16 RNN step (one STL before, one LDL after): "
                                        "not in the loop; measured in the sm_90 build"),
    ("step_kernel", "__half", "1"): (2, "as the tanh phase: the ReLU one, same code"),
}

if not ops.WITH_CUDA:
    pytest.skip("rnnkern was built without its CUDA kernels (no nvcc at build time)",
                allow_module_level=True)


def cuobjdump() -> str:
    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump"),
                  shutil.which("cuobjdump") or ""]
    try:
        import triton
        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                       "cuobjdump"))
    except ImportError:
        pass
    for c in candidates:
        if c and os.path.exists(c):
            return c
    raise AssertionError(f"no cuobjdump found (looked at {candidates}): the CUDA build cannot be checked")


def demangle(names: list[str]) -> list[str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def kernel_key(demangled: str) -> tuple[str, str, str]:
    """(family, dtype, phase) of e.g. 'void rnnkern::cuda::step_kernel<__half, (rnnkern::cuda::StepPhase)1>(...)'."""
    m = re.match(r"(?:void )?rnnkern::cuda::(?:\(anonymous namespace\)::)?(\w+)(?:<([^,>]+)(?:, \([\w:]+\)(\d+))?>)?\(",
                 demangled)
    assert m, demangled
    return m.group(1), m.group(2) or "", m.group(3) or ""


@pytest.fixture(scope="module")
def table():
    """{(arch, family, dtype, phase): {"REG": .., "SHARED": .., "STACK": .., "LOCAL": .., "SPILLS": ..}}"""
    tool, so = cuobjdump(), rnnkern._C.__file__
    usage = subprocess.run([tool, "--dump-resource-usage", so], capture_output=True, text=True, check=True).stdout
    rows, arch, pending = {}, None, []
    for line in usage.splitlines():
        if m := re.match(r"arch = (sm_\d+)", line.strip()):
            arch = m.group(1)
        elif m := re.match(r"\s*Function (\S+):", line):
            pending.append((arch, m.group(1)))
        elif "REG:" in line:
            a, name = pending.pop()
            rows[(a, name)] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
    sass = subprocess.run([tool, "-sass", so], capture_output=True, text=True, check=True).stdout
    spills, arch, name = defaultdict(int), None, None
    for line in sass.splitlines():
        if m := re.search(r"arch = (sm_\d+)", line):
            arch = m.group(1)
        elif m := re.search(r"Function : (\S+)", line):
            name = m.group(1)
        elif re.search(r"\b(STL|LDL)(\.\w+)*\b", line):
            spills[(arch, name)] += 1
    names = [n for _, n in rows]
    result = {}
    for (a, mangled), pretty in zip(rows, demangle(names)):
        key = (a, *kernel_key(pretty))
        result[key] = dict(rows[(a, mangled)], SPILLS=spills[(a, mangled)], name=pretty)
    return result


def threads_per_block() -> dict[str, int]:
    """Block size of each kernel family from its RNNKERN_LAUNCH in the sources,
    constants (constexpr int kX = N;) resolved."""
    text = "\n".join(p.read_text() for p in sorted(SOURCES.glob("*.cu*")))
    constants = {m.group(1): int(m.group(2)) for m in re.finditer(r"constexpr int (\w+) = (\d+);", text)}
    launches = {}
    for m in re.finditer(r"RNNKERN_LAUNCH\(\s*(?:[^,()]|\([^()]*\))+,\s*([^,]+),\s*[^,]+,\s*[^,]+,\s*(\w+)", text):
        block, kernel = m.group(1).strip(), m.group(2)
        if kernel == "kernel":  # the macro's own comment
            continue
        launches[kernel] = int(block) if block.isdigit() else constants[block]
    return launches


def test_table(table):
    """The table, printed (pytest -s), and sane: every kernel launched by the sources is in it."""
    print(f"\n{'kernel':58} {'arch':6} {'regs':>4} {'thr':>4} {'regs*thr':>8} {'shared':>6} {'stack':>5} {'spills':>6}")
    launch = threads_per_block()
    for (arch, family, dtype, phase), r in sorted(table.items()):
        thr = launch.get(family, 0)
        print(f"{family + '<' + dtype + ',' + phase + '>':58} {arch:6} {r['REG']:4} {thr:4} "
              f"{r['REG'] * thr:8} {r['SHARED']:6} {r['STACK']:5} {r['SPILLS']:6}")
    assert {k[1] for k in table} == set(launch), (set(launch), {k[1] for k in table})


def violations(table, launch, allowance) -> list[str]:
    """Every way the build breaks the rules above, one line each."""
    found = []
    for (arch, family, dtype, phase), r in table.items():
        what = f"{r.get('name', family)} [{arch}]"
        threads = launch[family]
        if r["REG"] * threads > REGISTER_FILE:
            found.append(f"{what}: {r['REG']} registers x {threads} threads = {r['REG'] * threads} "
                         f"> {REGISTER_FILE}")
        if r["SHARED"] > STATIC_SHARED:
            found.append(f"{what}: {r['SHARED']} bytes of static shared memory > {STATIC_SHARED}")
        if r["LOCAL"] > 0:
            found.append(f"{what}: {r['LOCAL']} bytes of local memory per thread")
        allowed = allowance.get((family, dtype, phase), (0, ""))[0]
        if r["SPILLS"] > allowed:
            found.append(f"{what}: {r['SPILLS']} spill instructions (STL/LDL), {allowed} allowed")
    archs = {k[0] for k in table}
    kernels = {k[1:] for k in table}
    for arch in archs:
        missing = kernels - {k[1:] for k in table if k[0] == arch}
        if missing:
            found.append(f"{arch}: kernels missing: {sorted(missing)}")
    phases = set(re.search(r"enum class StepPhase \{([^}]*)\}", (SOURCES / "step.cuh").read_text())
                 .group(1).split(","))
    for dtype in DTYPES:
        have = {k[2] for k in kernels if k[0] == "step_kernel" and k[1] == dtype}
        if len(have) != len(phases):
            found.append(f"step_kernel<{dtype}>: {len(have)} of {len(phases)} phases built")
    return found


def test_build_within_resources(table):
    found = violations(table, threads_per_block(), SPILL_ALLOWANCE)
    assert not found, "\n".join(found)


def test_spill_allowances_are_still_needed(table):
    """An allowance that no longer matches the build (fewer spills) is removed
    rather than left to hide a future spill."""
    for (family, dtype, phase), (count, _why) in SPILL_ALLOWANCE.items():
        measured = [r["SPILLS"] for k, r in table.items() if k[1:] == (family, dtype, phase)]
        assert measured and max(measured) == count, (family, dtype, phase, measured)


def test_checker_catches_each_violation(table):
    """The checker itself, on planted rows: too many registers for the block
    (255 registers, the step kernel launched with 512 threads), too much shared
    memory, a spilling step kernel, a missing bf16 step phase."""
    launch = dict(threads_per_block(), step_kernel=512)
    bad = dict(table)
    some_step = next(k for k in table if k[1] == "step_kernel" and k[2] == "float")
    bad[some_step] = dict(table[some_step], REG=255, SHARED=64 * 1024, SPILLS=3)
    missing = next(k for k in table if k[1] == "step_kernel" and k[2] == "__nv_bfloat16")
    del bad[missing]
    found = violations(bad, launch, SPILL_ALLOWANCE)
    text = "\n".join(found)
    assert "registers x" in text and "static shared memory" in text and "spill" in text, text
    assert "phases built" in text or "kernels missing" in text, text

"""Static resource checks of the real CUDA build (registers, stack, shared and local memory), no GPU needed.

One ``cuobjdump --dump-resource-usage -sass`` of rnnkern._C per session: REG,
STACK, SHARED, LOCAL, CONSTANT[0] per kernel and arch, and the SASS.  The dump
has no spill figures (ptxas -v's are not kept in the binary), so spills are the
SASS's local-memory stores (STL) and loads (LDL), with any non-zero STACK/LOCAL.
Expected kernels (``__global__`` templates x ``RNNKERN_INSTANTIATE_*`` dtypes x
enum-class phases x ``bool`` flags, false and true), block sizes and dynamic shared memory (``RNNKERN_LAUNCH``,
``constexpr int kX = N;`` resolved) and ``__launch_bounds__`` are read from
csrc/cuda.  Checked: registers x threads <= the SM's 64K register file, threads
<= __launch_bounds__, shared memory <= 48 KiB (no cudaFuncSetAttribute opt-in),
no spills beyond ``SPILL_ALLOWANCE`` (measured, matched exactly), every kernel,
dtype and phase built for every arch.  Without CUDA kernels the build test skips
(fails under RNNKERN_REQUIRE_CUDA_BUILD=1); the checker's test runs everywhere.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import rnnkern._C

SOURCES = Path(__file__).resolve().parent.parent / "csrc" / "cuda"
REGISTER_FILE = 64 * 1024       # 32-bit registers per SM, sm_70 .. sm_120
STATIC_SHARED = 48 * 1024       # per block without cudaFuncSetAttribute's opt-in
OPT_IN_SHARED = 227 * 1024      # sm_90's per-block maximum after the opt-in
COOPERATIVE_STATIC_SHARED = 1024  # what sm_90 reports for a kernel without static shared memory

# kernel -> ((STL, LDL, STACK bytes) measured in the sm_90 build, why allowed).
SPILL_ALLOWANCE = {
    f"step_kernel<__half, {phase}>": (
        (1, 1, 8), "ptxas (nvcc 13.0, sm_90; -v: 8 bytes stack frame, 4 bytes spill stores/loads) "
                   "keeps one value of the fp16 RNN step in local memory: one STL before the K "
                   "loop, one LDL after it, none inside")
    for phase in ("RnnTanh", "RnnRelu")} | {
    "forward_pointwise_kernel<float, Lstm, false, true>": (
        (1, 1, 8), "ptxas (nvcc 13.0, sm_90) keeps one loop-invariant address of the float "
                   "LSTM zoneout step in local memory across the call of the 64-bit division "
                   "i / H's slow path (since the kernel also writes every step's c, cell_steps): "
                   "one STL before the grid-stride loop, one LDL (an L1 hit) after the division")}


@functools.cache
def _sources() -> dict[str, str]:
    """csrc/cuda's files, comments removed (they quote the launch syntax)."""
    return {p.name: re.sub(r"//[^\n]*|/\*.*?\*/", "", p.read_text(), flags=re.S)
            for p in sorted(SOURCES.glob("*")) if p.suffix in (".cu", ".cuh", ".cpp", ".h")}


def _enums() -> dict[str, list[str]]:
    """enum class name -> its enumerators in order (none of them sets a value)."""
    return {m.group(1): [e.strip() for e in m.group(2).split(",") if e.strip()]
            for m in re.finditer(r"enum class (\w+)[^{;]*\{([^}]*)\}", "\n".join(_sources().values()))}


def expected_kernels() -> dict[str, list[str]]:
    """family -> its instantiations, e.g. "step_kernel" -> ["step_kernel<double, RnnTanh>", ..],
    "forward_pointwise_kernel" -> ["forward_pointwise_kernel<double, RnnTanh, false, false>", ..]."""
    text, kernels = "\n".join(_sources().values()), {}
    every_dtype = sorted(set(re.findall(r"^RNNKERN_INSTANTIATE_\w+\((\w+)\)", text, re.M)))
    for name, body in _sources().items():
        macros = re.findall(r"#define (RNNKERN_INSTANTIATE_\w+)\(", body)
        # A header without an instantiation macro of its own (persistent.cuh) is
        # instantiated through the entry points that include it: every dtype.
        dtypes = [t for m in macros for t in re.findall(rf"^{m}\((\w+)\)", text, re.M)] or every_dtype
        for m in re.finditer(r"(?:template\s*<([^>]*)>\s*)?__global__\s+void\s+"
                             r"(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(", body):
            names = [m.group(2)]
            for kind, param in (p.split() for p in (m.group(1) or "").split(",") if p.strip()):
                values = (dtypes if kind in ("typename", "class") else ["false", "true"]
                          if kind == "bool" else _enums()[kind])
                assert values, f"{m.group(2)} in {name}: no instantiations of its {param} found"
                names = [f"{n}, {v}" if "<" in n else f"{n}<{v}" for n in names for v in values]
            kernels[m.group(2)] = [n + ">" if "<" in n else n for n in names]
    return kernels


def launch_config() -> dict[str, dict[str, int | None]]:
    """family -> threads per block and dynamic shared bytes (its RNNKERN_LAUNCH), __launch_bounds__."""
    text = "\n".join(_sources().values())
    constants = {m.group(1): int(m.group(2)) for m in re.finditer(r"constexpr int (\w+) = (\d+);", text)}
    value = lambda expr: int(expr) if expr.strip().isdigit() else constants[expr.strip()]  # noqa: E731
    bounds = {m.group(2): value(m.group(1)) for m in re.finditer(
        r"__global__\s+void\s+__launch_bounds__\(([^),]*)[^)]*\)\s*(\w+)\s*\(", text)}
    config = {}
    for m in re.finditer(r"RNNKERN_LAUNCH(_COOPERATIVE)?\(((?:[^()]|\([^()]*\))*)\)", text):
        args = re.split(r",(?![^()<>]*[)>])", m.group(2))
        if len(args) < 5 or "..." in m.group(2):   # the macro's own definition
            continue
        family = re.match(r"\s*(\w+)", args[4]).group(1)
        if m.group(1):
            # A cooperative launch sizes its dynamic shared memory at run time (the plan,
            # checked against the device's opt-in limit and the occupancy API); statically:
            # no static shared memory, a grid barrier and coherent loads (violations()).
            config[family] = {"threads": value(args[1]), "launch_bounds": bounds.get(family),
                              "dynamic_shared": 0, "cooperative": True}
            continue
        prev = config.get(family, {"threads": 0, "dynamic_shared": 0})   # launched twice: the larger
        config[family] = {"threads": max(value(args[1]), prev["threads"]), "launch_bounds": bounds.get(family),
                          "dynamic_shared": max(value(args[2]), prev["dynamic_shared"]), "cooperative": False}
    return config


def _toolkit() -> str:
    """setup.py's find_cuda_home(): CUDA_HOME / CUDA_PATH, else the nvcc on PATH,
    following a wrapper script (`exec /usr/local/cuda-13.0/bin/nvcc "$@"`)."""
    homes = [os.environ[v] for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    nvcc = next((os.path.join(h, "bin", "nvcc") for h in homes if os.path.exists(os.path.join(h, "bin", "nvcc"))),
                shutil.which("nvcc"))
    if not nvcc:
        return "/usr/local/cuda"
    head = Path(nvcc).resolve().read_bytes()[:4096]
    wrapped = re.search(rb"(/[^\s\"']+/bin/nvcc)\b", head) if head.startswith(b"#!") else None
    return os.path.dirname(os.path.dirname(os.path.realpath(wrapped.group(1).decode() if wrapped else nvcc)))


def cuobjdump() -> str:
    """The toolkit's cuobjdump, else the one on PATH, else Triton's bundled copy
    (a toolkit installed for nvcc alone, as here, has none)."""
    triton = importlib.util.find_spec("triton")
    candidates = [os.path.join(_toolkit(), "bin", "cuobjdump"), "/usr/local/cuda/bin/cuobjdump",
                  shutil.which("cuobjdump"),
                  triton and str(Path(triton.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump")]
    found = next((c for c in candidates if c and os.access(c, os.X_OK)), None)
    assert found, f"no cuobjdump (looked at {candidates}): the CUDA build cannot be checked"
    return found


def _short(demangled: str) -> str:
    """'void rnnkern::cuda::step_kernel<__half, (rnnkern::cuda::StepPhase)0>(..)' ->
    'step_kernel<__half, RnnTanh>' (enum values by name, from the sources)."""
    head, depth = demangled.removeprefix("void ").replace("(anonymous namespace)::", ""), 0
    for i, ch in enumerate(head):   # the parameter list: the first "(" outside the <...>
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if ch == "(" and depth == 0:
            head = head[:i]
            break
    family, _, args = head.partition("<")
    family = family.rsplit("::", 1)[-1]
    if not args:
        return family
    args = [re.sub(r"\([\w:]*::(\w+)\)(\d+)", lambda e: _enums()[e.group(1)][int(e.group(2))], a.strip())
            for a in re.split(r",(?![^<]*>)", args.removesuffix(">"))]
    return f"{family}<{', '.join(args)}>"


def resource_table(so: str | None = None) -> list[dict]:
    """One row per (kernel, arch): REG, STACK, SHARED, LOCAL, CONSTANT, STL, LDL; and from
    the SASS the non-coherent loads (LDG_CONSTANT), GPU-scope atomic adds (GRID_ATOM) and
    memory barriers (MEMBAR): a grid barrier is an atomic arrival between two MEMBARs;
    the tensor-core MMAs (HMMA) and the L2 prefetches (PREFETCH_L2: CCTL.E.PF2)."""
    out = subprocess.run([cuobjdump(), "--dump-resource-usage", "-sass", so or rnnkern._C.__file__],
                         capture_output=True, text=True, check=True).stdout
    rows, arch, current = {}, None, None
    # Most of the dump's ~1.3M lines are instructions none of the patterns below
    # can match: one search of this alternation passes on the others (the
    # chain of patterns over every line took half a minute).
    interesting = re.compile(r"arch = |Function|REG:|STL|LDL|LDG\.|ATOM\.|RED\.|MEMBAR|HMMA\.|CCTL\.")
    for line in filter(interesting.search, out.splitlines()):
        if m := re.match(r"\s*arch = (sm_\d+)", line):
            arch = m.group(1)
        elif m := re.match(r"\s*Function (\w+):$", line):          # resource-usage section
            current = rows.setdefault((m.group(1), arch), {"mangled": m.group(1), "arch": arch, "STL": 0, "LDL": 0,
                                                           "LDG_CONSTANT": 0, "GRID_ATOM": 0, "MEMBAR": 0,
                                                           "HMMA": 0, "PREFETCH_L2": 0})
        elif "REG:" in line:
            current.update({k: int(v) for k, v in re.findall(r"(\w+)(?:\[0\])?:(\d+)", line)})
        elif m := re.match(r"\s*Function : (\w+)$", line):        # SASS section
            current = rows[(m.group(1), arch)]
        elif m := re.search(r"\b(STL|LDL)(?:\.\w+)*\s", line):
            current[m.group(1)] += 1
        elif re.search(r"\bLDG\.\S*CONSTANT\b", line):   # non-coherent (read-only path) loads
            current["LDG_CONSTANT"] += 1
        elif re.search(r"\bATOM\.E\.ADD\S*\.GPU\b|\bRED\.E\.ADD\S*\.GPU\b", line):
            current["GRID_ATOM"] += 1
        elif "MEMBAR" in line:
            current["MEMBAR"] += 1
        elif re.search(r"\bHMMA\.", line):                         # tensor-core MMA
            current["HMMA"] += 1
        elif re.search(r"\bCCTL\.\S*PF2\b", line):                  # prefetch.global.L2
            current["PREFETCH_L2"] += 1
    assert shutil.which("c++filt"), "c++filt (binutils) is needed to demangle the kernel names"
    pretty = subprocess.run(["c++filt"], input="\n".join(r["mangled"] for r in rows.values()),
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return [dict(r, kernel=_short(p), family=_short(p).split("<")[0]) for r, p in zip(rows.values(), pretty)]


def violations(table: list[dict], config: dict, expected: dict[str, list[str]],
               allowance: dict = SPILL_ALLOWANCE, opt_in: bool = False) -> list[str]:
    """Every way the table breaks the rules of the module docstring, one line each."""
    found, shared_limit = [], OPT_IN_SHARED if opt_in else STATIC_SHARED
    for r in table:
        what, launch = f"{r['kernel']} [{r['arch']}]", config.get(r["family"])
        if launch is None:
            found.append(f"{what}: no RNNKERN_LAUNCH of {r['family']} in csrc/cuda, block size unknown")
            continue
        threads, bound = launch["threads"], launch["launch_bounds"]
        if r["REG"] * threads > REGISTER_FILE:
            found.append(f"{what}: {r['REG']} registers x {threads} threads = {r['REG'] * threads} "
                         f"> {REGISTER_FILE} (the SM's register file)")
        if bound is not None and threads > bound:
            found.append(f"{what}: launched with {threads} threads > __launch_bounds__({bound})")
        if r["SHARED"] + launch["dynamic_shared"] > shared_limit:
            found.append(f"{what}: {r['SHARED']} B static + {launch['dynamic_shared']} B dynamic shared "
                         f"memory > {shared_limit} B")
        if launch.get("cooperative"):
            if r["SHARED"] > COOPERATIVE_STATIC_SHARED:
                found.append(f"{what}: {r['SHARED']} B static shared memory in a cooperative kernel "
                             f"(its arrays belong in RNNKERN_DYNAMIC_SHARED)")
            if r.get("LDG_CONSTANT", 0):
                found.append(f"{what}: {r['LDG_CONSTANT']} non-coherent loads (LDG.E.CONSTANT) in a "
                             f"kernel that exchanges data between blocks")
            if not (r.get("GRID_ATOM", 0) and r.get("MEMBAR", 0)):
                found.append(f"{what}: no grid barrier (GPU-scope atomic arrival and MEMBAR) in the SASS")
        measured = (r["STL"], r["LDL"], r["STACK"] + r["LOCAL"])
        allowed = allowance.get(r["kernel"], ((0, 0, 0), ""))[0]
        if measured != allowed:
            found.append(f"{what}: {measured[0]} STL, {measured[1]} LDL, {measured[2]} B stack+local "
                         f"(spills), SPILL_ALLOWANCE says {allowed}")
    archs = sorted({r["arch"] for r in table})
    if not archs:
        found.append("no sm_XX code for any kernel in the build")
    for arch in archs:
        have = {r["kernel"] for r in table if r["arch"] == arch}
        for family, names in expected.items():
            missing = [n for n in names if n not in have]
            if missing:
                found.append(f"{arch}: {len(missing)} of {len(names)} {family} kernels missing: {missing}")
        unknown = have - {n for names in expected.values() for n in names}
        if unknown:
            found.append(f"{arch}: kernels not expected from csrc/cuda: {sorted(unknown)}")
    return found


@pytest.fixture(scope="module")
def table() -> list[dict]:
    """The build's resource table, one cuobjdump run per session; skipped (or
    failed, under RNNKERN_REQUIRE_CUDA_BUILD=1) when there are no CUDA kernels."""
    if not rnnkern._C.WITH_CUDA:
        if os.environ.get("RNNKERN_REQUIRE_CUDA_BUILD") == "1":
            pytest.fail("RNNKERN_REQUIRE_CUDA_BUILD=1 but rnnkern was built without its CUDA kernels "
                        "(no nvcc / CUDA torch at build time)")
        pytest.skip("rnnkern was built without its CUDA kernels")
    return resource_table()


def test_sources_parse():
    """The source parsing this module relies on finds every kernel: the
    step kernel for all four dtypes and every StepPhase, both pointwise kernels
    per dtype, the lengths kernel, each with a block size; and the
    LayerNorm cell's row kernels and the step options' flags."""
    expected, config = expected_kernels(), launch_config()
    dtypes = ("double", "float", "__half", "__nv_bfloat16")
    assert {f"step_kernel<{d}, GruRbCandidate>" for d in dtypes} <= set(expected["step_kernel"]), expected
    for family in ("forward_pointwise_kernel", "backward_pointwise_kernel", "lstm_ln_forward_kernel",
                   "lstm_ln_backward_kernel"):
        assert {e.split(",")[0].split("<")[1] for e in expected[family]} == set(dtypes), expected[family]
    # the options (resets, zoneout) as bool template flags: every combination
    assert {"lstm_ln_backward_kernel<float, true, false>", "forward_pointwise_kernel<__half, Gru, false, true>",
            "backward_pointwise_kernel<double, Projection, true, true>"} <= {
        e for family in expected.values() for e in family}, expected
    assert expected["upload_lengths_kernel"] == ["upload_lengths_kernel"], expected
    assert set(config) == set(expected), (config, expected)


def test_build_within_resources(table):
    """The real build: printed (pytest -s), then every rule of the module docstring."""
    config = launch_config()
    print(f"\n{'kernel':56} {'arch':6} {'regs':>4} {'thr':>4} {'regs*thr':>8} {'shared':>6} "
          f"{'local':>5} {'stack':>5} {'STL/LDL':>7}")
    for r in sorted(table, key=lambda r: (r["family"], r["kernel"], r["arch"])):
        thr = config.get(r["family"], {}).get("threads", 0)
        print(f"{r['kernel']:56} {r['arch']:6} {r['REG']:4} {thr:4} {r['REG'] * thr:8} {r['SHARED']:6} "
              f"{r['LOCAL']:5} {r['STACK']:5} {r['STL']:3}/{r['LDL']:<3}")
    opt_in = "cudaFuncSetAttribute" in "\n".join(_sources().values())
    found = violations(table, config, expected_kernels(), opt_in=opt_in)
    assert not found, "\n".join(found)


def test_persistent_kernels_use_the_tensor_cores_for_half_types(table):
    """The persistent kernels' products in float16 / bfloat16 are WMMA on sm_80+: HMMA in
    the SASS of each of them (sm_90), none in the float32 / float64 ones (register tiles)."""
    rows = [r for r in table if r["family"].startswith("persistent_") and r["arch"] == "sm_90"]
    assert len(rows) == 128, len(rows)
    half = [r for r in rows if r["kernel"].split("<")[1].split(",")[0] in ("__half", "__nv_bfloat16")]
    assert len(half) == 64 and all(r["HMMA"] > 0 for r in half), [r["kernel"] for r in half if not r["HMMA"]]
    assert all(r["HMMA"] == 0 for r in rows if r not in half)


def test_persistent_kernels_prefetch_the_next_step(table):
    """The persistent kernels' hint before each grid barrier (persistent.cuh:
    persistent_prefetch_forward / _backward) survives compilation: L2 prefetches
    (CCTL.E.PF2) in the sm_90 SASS of every one of them, and in no other kernel."""
    sm90 = [r for r in table if r["arch"] == "sm_90"]
    persistent = [r for r in sm90 if r["family"].startswith("persistent_")]
    assert len(persistent) == 128, len(persistent)
    assert all(r["PREFETCH_L2"] > 0 for r in persistent), [r["kernel"] for r in persistent
                                                          if not r["PREFETCH_L2"]]
    assert all(r["PREFETCH_L2"] == 0 for r in sm90 if r not in persistent)


def test_checker_catches_each_violation():
    """violations() on rows synthesised from the sources (a clean sm_90 build:
    none reported), then with each fault planted: 255 registers x 1024 threads,
    a 64 KiB shared kernel, a spilling step kernel, a missing bf16 step kernel;
    an allowance the build no longer needs is reported too (not left to hide a spill); a
    cooperative kernel with static shared memory, non-coherent loads and no grid barrier."""
    expected, config = expected_kernels(), launch_config()
    zero = dict(REG=32, STACK=0, SHARED=0, LOCAL=0, CONSTANT=0, STL=0, LDL=0, arch="sm_90")
    clean = [dict(zero, kernel=k, family=f) for f, names in expected.items() for k in names]
    for row in clean:
        if config[row["family"]]["cooperative"]:
            row.update(SHARED=1024, GRID_ATOM=1, MEMBAR=2)   # sm_90's reservation, a grid barrier
    for row in clean:
        (row["STL"], row["LDL"], row["STACK"]), _ = SPILL_ALLOWANCE.get(row["kernel"], ((0, 0, 0), ""))
    assert violations(clean, config, expected) == []
    half = "step_kernel<__half, RnnTanh>"
    stale = violations([dict(zero, kernel=half, family="step_kernel")], config, {"step_kernel": [half]})
    assert stale == ["step_kernel<__half, RnnTanh> [sm_90]: 0 STL, 0 LDL, 0 B stack+local (spills), "
                     "SPILL_ALLOWANCE says (1, 1, 8)"], stale
    bad = [dict(r) for r in clean if r["kernel"] != "step_kernel<__nv_bfloat16, Gru>"]
    big = dict(config, forward_pointwise_kernel=dict(config["forward_pointwise_kernel"], threads=1024))
    next(r for r in bad if r["kernel"] == "forward_pointwise_kernel<float, Lstm, false, false>")["REG"] = 255
    next(r for r in bad if r["kernel"] == "step_kernel<float, Gru>")["SHARED"] = 64 * 1024
    next(r for r in bad if r["kernel"] == "step_kernel<double, Lstm>").update(STL=3, LDL=3, STACK=16)
    coop = "persistent_forward_kernel<__half, Lstm, false, true>"
    next(r for r in bad if r["kernel"] == coop).update(SHARED=4096, LDG_CONSTANT=2, GRID_ATOM=0)
    text = "\n".join(violations(bad, big, expected))
    for want in ("forward_pointwise_kernel<float, Lstm, false, false> [sm_90]: 255 registers x 1024 "
                 "threads = 261120",
                 "launched with 1024 threads > __launch_bounds__(256)",
                 "step_kernel<float, Gru> [sm_90]: 65536 B static + 0 B dynamic shared memory > 49152",
                 "step_kernel<double, Lstm> [sm_90]: 3 STL, 3 LDL, 16 B stack+local",
                 f"sm_90: 1 of {len(expected['step_kernel'])} step_kernel kernels missing: ['step_kernel<__nv_bfloat16, Gru>']",
                 f"{coop} [sm_90]: 4096 B static shared memory in a cooperative kernel",
                 f"{coop} [sm_90]: 2 non-coherent loads (LDG.E.CONSTANT)",
                 f"{coop} [sm_90]: no grid barrier"):
        assert want in text, f"not reported: {want!r}\nreported:\n{text}"


def test_cooperative_test_kernel_builds_for_sm90(tmp_path):
    """The emulated device's cooperative test kernel (csrc/cuda_emu/grid_exchange.cuh, in
    the sources' CUDA dialect) compiles with nvcc for sm_90, so the dialect the emulator
    runs is one the compiler takes: no static shared memory (SHARED is sm_90's 1 KiB
    reservation alone: a cooperative kernel keeps its arrays in dynamic shared memory),
    no spills, the grid barrier in the SASS, and no non-coherent (LDG.E.CONSTANT) loads,
    which could return another block's value from before the barrier."""
    nvcc = os.path.join(_toolkit(), "bin", "nvcc")
    if not os.path.exists(nvcc):
        if os.environ.get("RNNKERN_REQUIRE_CUDA_BUILD") == "1":
            pytest.fail("RNNKERN_REQUIRE_CUDA_BUILD=1 but there is no nvcc")
        pytest.skip("no nvcc: the CUDA sources cannot be compiled here")
    try:
        import nvidia
        includes = [d for base in nvidia.__path__ for d in sorted(Path(base).glob("*/include"))
                    if (d / "cublas_v2.h").exists()]
    except ImportError:
        includes = []
    source = tmp_path / "grid_exchange.cu"
    source.write_text('#include "grid_exchange.cuh"\n')
    cubin = tmp_path / "grid_exchange.cubin"
    done = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-O3", "-std=c++17",
                           "-I", str(SOURCES.parent / "cuda_emu"),
                           *[a for d in includes for a in ("-isystem", str(d))],
                           "-o", str(cubin), str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in resource_table(str(cubin)) if r["family"] == "grid_exchange_kernel"]
    assert len(rows) == 1, rows  # one kernel, built for -arch=sm_90 (a cubin names no arch)
    r = rows[0]
    assert r["SHARED"] <= 1024 and r["STL"] == r["LDL"] == r["STACK"] == r["LOCAL"] == 0, r
    assert r["REG"] * 1024 <= REGISTER_FILE, r  # the tests launch up to 1024 threads a block
    sass = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    assert re.search(r"\bATOM\.E\.ADD\S*\.GPU\b", sass) and "MEMBAR" in sass, \
        "no grid barrier (a GPU-scope atomic arrival and a memory barrier) in the SASS"
    assert not re.search(r"\bLDG\.\S*CONSTANT\b", sass), "non-coherent loads in a kernel that exchanges"

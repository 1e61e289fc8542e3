"""The benchmark run: ``python -m bench`` (see bench/README.md).

For every case of the grid (bench/grid.py) and both phases -- forward (inference,
no autograd) and forward + backward (a training forward, then the gradients of
the input, the initial states and every weight) -- it

1. builds every candidate (bench/candidates.py) on the same weights and inputs;
2. runs each once to warm up (torch.compile and FlashRNN compile here), once more
   for its result and its peak memory, and checks that result against torch.nn in
   float64 (bench/agreement.py); a candidate that disagrees is reported, not timed;
3. times the agreeing candidates interleaved, rotating input buffers
   (bench/timing.py), and derives the figures: median time, speed ratio against
   torch.nn, microseconds per step, TFLOP/s and GB/s (bench/cost.py) against the
   device's measured peaks, peak memory against torch.nn's (GPU).

Output: a terminal table, and on request JSON, a markdown summary and PNG plots
(bench/report.py).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

import rnnkern

from . import agreement, report, timing
from .candidates import BASELINE, CANDIDATES, LOOP_MAX_T, FLASHRNN_FAMILIES, torch_module
from .cost import cost
from .grid import CELLS, DEFAULT_CELLS, DEFAULT_DTYPES, DTYPES, FAMILIES, SIZES, Case, build_grid

SCHEMA = "rnnkern-bench/1"
PHASES = ("forward", "forward_backward")


@dataclass
class Config:
    device: str = "cpu"
    cells: tuple = DEFAULT_CELLS
    backends: Optional[tuple] = None   # None: every available candidate
    dtypes: Optional[tuple] = None     # None: the device's default
    families: tuple = FAMILIES
    quick: bool = False
    rounds: Optional[int] = None
    progress: bool = True
    flashrnn_everywhere: bool = False
    threads: Optional[int] = None      # None: torch's default (quick: 1)
    argv: list = field(default_factory=list)

    def timing(self) -> dict:
        """Rounds, the length of one sample and the time budget per candidate and case."""
        cuda = self.device == "cuda"
        if self.quick:
            t = {"rounds": 3, "round_target_s": 0.01, "budget_s": 0.2, "min_rounds": 3}
        elif cuda:
            t = {"rounds": 10, "round_target_s": 0.02, "budget_s": 0.5, "min_rounds": 3}
        else:
            t = {"rounds": 7, "round_target_s": 0.1, "budget_s": 2.5, "min_rounds": 3}
        if self.rounds is not None:
            t["rounds"] = self.rounds
            t["min_rounds"] = min(t["min_rounds"], self.rounds)
        return t


# ---------------------------------------------------------------- inputs ----

@dataclass
class Inputs:
    """One set of inputs; the ``*_g`` tensors are the same values as leaves that
    require grad (for the forward + backward phase)."""
    x: torch.Tensor
    h0: torch.Tensor
    c0: Optional[torch.Tensor]
    grad_output: torch.Tensor
    grad_h: torch.Tensor
    grad_c: Optional[torch.Tensor]

    def __post_init__(self):
        self.x_g = self.x.detach().requires_grad_()
        self.h0_g = self.h0.detach().requires_grad_()
        self.c0_g = None if self.c0 is None else self.c0.detach().requires_grad_()

    def to(self, dtype) -> "Inputs":
        cast = (lambda t: None if t is None else t.to(dtype))
        return Inputs(cast(self.x), cast(self.h0), cast(self.c0), cast(self.grad_output),
                      cast(self.grad_h), cast(self.grad_c))


def make_inputs(case: Case, device: torch.device, seed: int) -> list[Inputs]:
    """The rotating pool: fresh random inputs (never zeros), non-zero initial
    states, random output gradients.  Enough sets that the pool outgrows the
    caches (2 to 4 sets)."""
    lstm = case.cell == "lstm"
    dtype = case.torch_dtype
    set_bytes = case.T * case.B * (case.I + case.H) * torch.empty((), dtype=dtype).element_size()
    n = max(2, min(4, math.ceil((256 << 20) / max(set_bytes, 1))))
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    pool = []
    for _ in range(n):
        pool.append(Inputs(
            x=rand(case.T, case.B, case.I), h0=rand(case.B, case.H, scale=0.5),
            c0=rand(case.B, case.H, scale=0.5) if lstm else None,
            grad_output=rand(case.T, case.B, case.H), grad_h=rand(case.B, case.H),
            grad_c=rand(case.B, case.H) if lstm else None))
    return pool


def phase_fn(phase: str, built, lstm: bool):
    """``run(inputs) -> list of tensors``: the outputs, and in the training phase the
    gradients of input, initial states and weights (order: agreement.tensor_names)."""
    if phase == "forward":
        def run(s: Inputs):
            with torch.no_grad():
                out, h, c = built.layer(s.x, s.h0, s.c0)
            return [out, h] + ([c] if lstm else [])
        return run

    def run(s: Inputs):
        out, h, c = built.layer(s.x_g, s.h0_g, s.c0_g)
        outs = [out, h] + ([c] if lstm else [])
        wrt = [s.x_g, s.h0_g] + ([s.c0_g] if lstm else []) + list(built.params)
        grads = torch.autograd.grad(outs, wrt, [s.grad_output, s.grad_h] + ([s.grad_c] if lstm else []))
        return outs + list(grads)
    return run


# ------------------------------------------------------------------ run ----

def case_seed(case: Case) -> int:
    return zlib.crc32(f"{case.cell}-{case.B}-{case.T}-{case.H}".encode())


def truth_results(case: Case, src, inputs: Inputs, device: torch.device) -> tuple[dict, str]:
    """torch.nn in float64 on the device, both phases (ground truth for agreement)."""
    s64 = inputs.to(torch.float64)
    case64 = Case(case.cell, case.B, case.T, case.H, "float64", case.families)
    lstm = case.cell == "lstm"
    try:
        built = CANDIDATES[BASELINE].build(case64, src, device)
        results = {p: [t.detach() for t in phase_fn(p, built, lstm)(s64)] for p in PHASES}
        return results, "torch.nn float64"
    except (RuntimeError, NotImplementedError):  # no float64 RNN on this device: the loop then
        built = CANDIDATES["reference"].build(case64, src, device)
        results = {p: [t.detach() for t in phase_fn(p, built, lstm)(s64)] for p in PHASES}
        return results, "vanilla loop float64"


def _finite_positive(v):
    return v if (v is not None and math.isfinite(v) and v > 0) else None


def run_case(case: Case, names: list[str], device: torch.device, cfg: Config, progress) -> list[dict]:
    """Both phases of one case: a record per phase (see bench/README.md for the fields)."""
    lstm = case.cell == "lstm"
    seed = case_seed(case)
    src = torch_module(case.cell, case.I, case.H, seed)
    pool = make_inputs(case, device, seed)
    truth, truth_name = truth_results(case, src, pool[0], device)
    options = {"flashrnn_everywhere": cfg.flashrnn_everywhere}
    tcfg = cfg.timing()

    built, pre = {}, {}
    for name in names:
        reason = CANDIDATES[name].skip(case, device, options)
        if reason:
            pre[name] = {"status": "skipped", "note": reason}
            continue
        try:
            built[name] = CANDIDATES[name].build(case, src, device)
        except Exception as e:  # a candidate that cannot be built is reported, the run goes on
            pre[name] = {"status": "error", "note": f"build: {type(e).__name__}: {e}"}

    records = []
    for phase in PHASES:
        progress.set_postfix_str(f"{case.label} {phase}")
        c = cost(case.cell, case.T, case.B, case.I, case.H, case.torch_dtype, phase)
        tensor_names = agreement.tensor_names(case.cell, phase)
        entries = {n: dict(pre[n], label=CANDIDATES[n].label) for n in pre}
        fns, estimates, results = {}, {}, {}
        for name, b in built.items():
            entry = {"label": CANDIDATES[name].label}
            entries[name] = entry
            fn = phase_fn(phase, b, lstm)
            try:
                fn(pool[0])  # warm-up: compiles, autotunes, allocates caches
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                t = timing.wall_time(lambda: results.__setitem__(name, fn(pool[0])), device)
                if device.type == "cuda":
                    entry["peak_mem_mb"] = (torch.cuda.max_memory_allocated(device) - before) / 2 ** 20
            except Exception as e:  # reported in the table and the JSON, not fatal
                entry.update(status="error", note=f"{type(e).__name__}: {e}".strip()[:500])
                results.pop(name, None)
                continue
            estimates[name] = t
            fns[name] = fn

        if BASELINE not in results:
            for name in list(fns):
                if name != BASELINE:
                    entries[name].update(status="error", note="torch.nn (the baseline) failed")
            fns = {}
        for name in list(fns):
            entries[name]["agreement"] = agreement.check(
                tensor_names, results[name], truth[phase], results[BASELINE], case.torch_dtype)
            if not entries[name]["agreement"]["ok"]:
                entries[name].update(status="disagrees", note="disagrees with torch.nn: not timed")
                del fns[name]
        results.clear()

        if fns:
            plans = {n: timing.plan(estimates[n], tcfg["rounds"], tcfg["round_target_s"], tcfg["budget_s"],
                                    tcfg["min_rounds"]) for n in fns}
            samples = timing.interleaved(fns, pool, plans, device)
            base = timing.summarize(samples[BASELINE])["median_s"]
            for name, s in samples.items():
                st = timing.summarize(s)
                med = st["median_s"]
                e = entries[name]
                e.update(status="timed", median_ms=med * 1e3, iqr_ms=st["iqr_s"] * 1e3,
                         min_ms=st["min_s"] * 1e3, samples=len(s),
                         calls_per_sample=plans[name].calls if device.type == "cpu" else 1,
                         speedup_vs_torch=base / med, us_per_step=med / case.T * 1e6,
                         tflops=c.flops / med / 1e12, gbps=c.bytes / med / 1e9)
            torch_mem = entries[BASELINE].get("peak_mem_mb")
            for name in samples:
                mem = entries[name].get("peak_mem_mb")
                entries[name]["mem_vs_torch"] = (mem / torch_mem) if (mem is not None and torch_mem) else None

        order = [n for n in names if n in entries]
        records.append({
            "cell": case.cell, "families": list(case.families), "B": case.B, "T": case.T, "H": case.H,
            "I": case.I, "dtype": case.dtype, "phase": phase, "flops": c.flops, "bytes": c.bytes,
            "truth": truth_name, "candidates": {n: entries[n] for n in order}})
        progress.update(1)
    return records


def apply_peaks(records: list[dict], peaks: dict) -> None:
    """Achieved TFLOP/s and GB/s as percentages of the measured peaks."""
    for r in records:
        gemm_peak = peaks["gemm_tflops"].get(r["dtype"])
        for e in r["candidates"].values():
            if e["status"] == "timed":
                e["pct_peak_flops"] = 100 * e["tflops"] / gemm_peak if gemm_peak else None
                e["pct_peak_bw"] = 100 * e["gbps"] / peaks["copy_gbps"]


# ------------------------------------------------------------- metadata ----

def _version(module: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(module)
    except Exception:  # not installed, or no metadata: reported as null
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> Optional[str]:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _load() -> Optional[list]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def metadata(device: torch.device, cfg: Config, dtypes, candidates: dict) -> dict:
    dev = {"type": device.type, "cpu": _cpu_name(), "threads": torch.get_num_threads(),
           "cores": os.cpu_count(), "load_average_at_start": _load()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        dev.update(name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                   memory_gb=p.total_memory / 2 ** 30)
    else:
        dev["name"] = dev["cpu"]
    table = SIZES["quick" if cfg.quick else device.type]
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench"] + list(cfg.argv)),
        "git": _git_commit(),
        "device": dev,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "rnnkern": rnnkern.__version__, "triton": _version("triton"),
                     "cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                     "flashrnn": _version("flashrnn")},
        "settings": {"tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                     "tf32_cudnn": torch.backends.cudnn.allow_tf32,
                     "rnnkern_cuda_built": rnnkern.ops.WITH_CUDA},
        "quick": cfg.quick,
        "cells": list(cfg.cells), "dtypes": list(dtypes), "families": list(cfg.families),
        "grid": {f: [list(s) for s in table[f]] for f in cfg.families},
        "grid_note": "sizes are [B, T, H]; input size I = H; one layer, one direction",
        "candidates": candidates,
        "baseline": BASELINE,
        "timing": dict(cfg.timing(), interleaved=True,
                       method=("CUDA events around every call" if device.type == "cuda" else
                               "torch.utils.benchmark.Timer.timeit, num_threads=torch.get_num_threads()"),
                       figure="median over samples"),
        "agreement": {"truth": "torch.nn in float64, same inputs and weights",
                      "criterion": "relative Frobenius error <= max(factor * torch.nn's own, floor)",
                      "factor": agreement.FACTOR,
                      "floor": {str(k).replace("torch.", ""): v for k, v in agreement.FLOOR.items()}},
        "limits": {"loop_max_T": LOOP_MAX_T[device.type], "flashrnn_families": list(FLASHRNN_FAMILIES)},
    }


def run(cfg: Config) -> dict:
    """The whole run; returns the JSON document (see bench/README.md)."""
    from tqdm import tqdm

    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    threads = cfg.threads or (1 if cfg.quick else None)
    if threads:
        torch.set_num_threads(threads)
    dtypes = tuple(cfg.dtypes or DEFAULT_DTYPES[device.type])
    requested = [BASELINE] + [n for n in (cfg.backends or CANDIDATES) if n != BASELINE]
    candidates, names = {}, []
    for n in requested:
        reason = CANDIDATES[n].unavailable(device)
        candidates[n] = {"label": CANDIDATES[n].label, "available": reason is None, "note": reason}
        if reason is None:
            names.append(n)
    cases = build_grid(device.type, cfg.cells, dtypes, cfg.families, cfg.quick)
    doc = {"meta": metadata(device, cfg, dtypes, candidates)}
    progress = tqdm(total=2 * len(cases), disable=not cfg.progress, unit="case", dynamic_ncols=True,
                    desc=f"bench {device.type}")
    progress.set_postfix_str("measuring peaks")
    peaks = timing.measure_peaks(device, [DTYPES[d] for d in dtypes])
    records = []
    for case in cases:
        t0 = time.perf_counter()
        part = run_case(case, names, device, cfg, progress)
        for r in part:
            r["case_seconds"] = time.perf_counter() - t0  # both phases, agreement and timing
        records += part
    progress.set_postfix_str("measuring peaks")
    doc["peaks"] = timing.best_peaks(peaks, timing.measure_peaks(device, [DTYPES[d] for d in dtypes]))
    progress.close()
    apply_peaks(records, doc["peaks"])
    doc["results"] = records
    doc["meta"]["device"]["load_average_at_end"] = _load()
    return doc


# ------------------------------------------------------------------ CLI ----

def parse_args(argv) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="rnnkern against torch.nn (cuDNN / oneDNN), the vanilla loop, torch.compile and "
                    "FlashRNN: forward and forward+backward over a size grid (bench/README.md).")
    p.add_argument("--quick", action="store_true", help="tiny grid, 3 rounds (about a minute on CPU)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cells", nargs="+", choices=CELLS, default=list(DEFAULT_CELLS))
    p.add_argument("--backends", nargs="+", choices=list(CANDIDATES), metavar="NAME",
                   help=f"candidates besides torch.nn (always run): {', '.join(CANDIDATES)}; "
                        "default: all available on the device")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES),
                   help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--threads", type=int,
                   help="CPU threads for every candidate (default: torch's, i.e. one per core; "
                        "--quick: 1, as a smoke test that oversubscribed machines cannot stall)")
    p.add_argument("--rounds", type=int, help="interleaved rounds per measurement (default 7 CPU, 10 GPU)")
    p.add_argument("--json", metavar="PATH", help="write every figure here")
    p.add_argument("--markdown", metavar="PATH", help="write the speed-ratio tables here (markdown)")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--flashrnn-everywhere", action="store_true",
                   help="time FlashRNN on the whole grid, not only the headline size")
    a = p.parse_args(argv)
    if a.rounds is not None and a.rounds < 1:
        p.error("--rounds must be at least 1")
    if a.threads is not None and a.threads < 1:
        p.error("--threads must be at least 1")
    cfg = Config(device=a.device, cells=tuple(a.cells), backends=tuple(a.backends) if a.backends else None,
                 dtypes=tuple(a.dtypes) if a.dtypes else None, families=tuple(a.families), quick=a.quick,
                 rounds=a.rounds, progress=not a.no_progress, flashrnn_everywhere=a.flashrnn_everywhere,
                 threads=a.threads,
                 argv=list(argv))
    return cfg, a


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, a = parse_args(argv)
    doc = run(cfg)
    print(report.table(doc))
    print()
    print(report.summary(doc))
    if report.load_warning(doc):
        print("\n" + report.load_warning(doc))
    if a.json:
        report.write_json(doc, a.json)
        print(f"\nJSON: {a.json}")
    if a.markdown:
        Path(a.markdown).write_text(report.markdown(doc))
        print(f"markdown: {a.markdown}")
    if a.plots:
        for path in report.plots(doc, a.plots):
            print(f"plot: {path}")
    return doc

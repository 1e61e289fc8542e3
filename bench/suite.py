"""The benchmark run: ``python -m bench`` (see bench/README.md).

For every case of the grid (bench/grid.py) and both phases -- forward (inference,
no autograd) and forward + backward (a training forward, then the gradients of
the input, the initial states and every weight) -- it

1. builds every candidate (bench/candidates/) on the same weights and inputs;
2. runs each once to warm up (torch.compile and FlashRNN compile here), once more
   for its result and its peak memory, and checks that result against torch.nn in
   float64 (bench/agreement.py); a candidate that disagrees is reported, not timed;
3. times the agreeing candidates interleaved, rotating input buffers
   (bench/timing.py), and derives the figures: median time, speed ratio against
   torch.nn, microseconds per step, TFLOP/s and GB/s (bench/cost.py) against the
   device's ceilings (the CPU's FMA peak, bench/fma_peak.py; a GPU's measured GEMM
   peak; the measured copy bandwidth), peak memory against torch.nn's (GPU).

Output: a line per case and phase as soon as it is measured, then the terminal
tables; JSON and the markdown summary rewritten after every case, PNG plots at the
end (bench/report.py), in an output directory (default bench/out/<device>-<time>/).
A run stopped by Ctrl-C (SIGINT) or SIGTERM writes what it measured, plots included,
marks the JSON incomplete and exits with 130 / 143.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import signal
import sys
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

import rnnkern

from rnnkern.check.probe import cpu_identity, cpu_isa, cpu_model, git_commit, load_average, package_version

from . import agreement, fma_peak, report, timing
from .candidates import (BASELINE, CANDIDATES, FLASHRNN_FAMILIES, LOOP_MAX_T, ONNX_EXPORT, OPENVINO_HINTS,
                         PEERS, torch_module)
from .cost import cost
from .grid import (CELLS, DEFAULT_CELLS, DEFAULT_DTYPES, DEFAULT_FAMILIES, DTYPES, FAMILIES, FAMILY_CALLS,
                   PACKED_SIZES, STUDY_FAMILIES, Case, build_grid, sizes)

SCHEMA = "rnnkern-bench/1"
PHASES = ("forward", "forward_backward")
#: Where a run writes when no --out is given (git-ignored).
OUT_ROOT = Path(__file__).resolve().parent / "out"
#: Candidates of the default grid when --backends is not given: torch.nn and rnnkern's
#: backends (FlashRNN too on a GPU, at the headline size); the Python loops, whose
#: training phase takes seconds per call at these sizes, run with --full or --quick.
DEFAULT_CANDIDATES = ("torch", "auto", "cpu", "cuda", "triton", "flashrnn")
#: Families that bring the inference engines (PEERS) into the default candidates.
PEER_FAMILIES = ("peers", "step")


@dataclass
class Config:
    device: str = "cpu"
    cells: tuple = DEFAULT_CELLS
    backends: Optional[tuple] = None   # None: every available candidate
    dtypes: Optional[tuple] = None     # None: the device's default
    families: Optional[tuple] = None   # None: DEFAULT_FAMILIES (--quick, --full: every family)
    grid: str = "default"              # "quick", "default" or "full" (bench/grid.py)
    rounds: Optional[int] = None
    progress: bool = True
    flashrnn_everywhere: bool = False
    threads: Optional[int] = None      # None: torch's default (quick: 1)
    clock: str = "wall"                # CPU: "wall" (latency) or "cpu" (process CPU time)
    argv: list = field(default_factory=list)

    @property
    def quick(self) -> bool:
        return self.grid == "quick"

    def run_families(self) -> tuple:
        if self.families is not None:
            return tuple(self.families)
        return DEFAULT_FAMILIES if self.grid == "default" else FAMILIES

    def default_candidates(self) -> tuple:
        """The candidates when --backends is not given: every one with --quick and
        --full; else DEFAULT_CANDIDATES, and the inference engines when the run
        measures the peers or step family."""
        if self.grid != "default":
            return tuple(CANDIDATES)
        peers = PEERS if set(self.run_families()) & set(PEER_FAMILIES) else ()
        return DEFAULT_CANDIDATES + peers

    def timing(self) -> dict:
        """Rounds, the length of one sample and the time budget per candidate and case."""
        cuda = self.device == "cuda"
        if self.quick:
            t = {"rounds": 3, "round_target_s": 0.01, "budget_s": 0.2, "min_rounds": 3}
        elif cuda:
            t = {"rounds": 10, "round_target_s": 0.02, "budget_s": 0.5, "min_rounds": 3}
        elif self.grid == "default":  # minutes for the whole run on 2 cores
            t = {"rounds": 7, "round_target_s": 0.05, "budget_s": 1.0, "min_rounds": 3}
        else:
            t = {"rounds": 7, "round_target_s": 0.1, "budget_s": 2.5, "min_rounds": 3}
        if self.rounds is not None:  # asked for: exactly that many, however slow
            t["rounds"] = self.rounds
            t["min_rounds"] = self.rounds
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
    """Weights and inputs of a case: a T=1 sequence call and the cell call of the
    same size get the same ones."""
    return zlib.crc32(f"{case.cell}-{case.B}-{case.T}-{case.H}".encode())


def truth_results(case: Case, src, inputs: Inputs, device: torch.device) -> tuple[dict, str]:
    """torch.nn in float64 on the device, both phases (ground truth for agreement);
    for a cell call, torch.nn's cell."""
    s64 = inputs.to(torch.float64)
    case64 = replace(case, dtype="float64")
    lstm = case.cell == "lstm"
    try:
        built = CANDIDATES[BASELINE].build(case64, src, device)
        results = {p: [t.detach() for t in phase_fn(p, built, lstm)(s64)] for p in PHASES}
        return results, "torch.nn float64"
    except (RuntimeError, NotImplementedError):  # no float64 RNN on this device: the loop then
        built = CANDIDATES["reference"].build(case64, src, device)
        results = {p: [t.detach() for t in phase_fn(p, built, lstm)(s64)] for p in PHASES}
        return results, "vanilla loop float64"


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
            pre[name] = {"status": "error", "note": f"build: {type(e).__name__}: {e}".strip()[:500]}

    records = []
    for phase in PHASES:
        progress.set_postfix_str(f"{case.label} {phase}")
        c = cost(case.cell, case.T, case.B, case.I, case.H, case.torch_dtype, phase)
        tensor_names = agreement.tensor_names(case.cell, phase)
        entries = {n: dict(pre[n], label=CANDIDATES[n].label) for n in pre}
        fns, estimates, results = {}, {}, {}
        for name, b in built.items():
            entry = {"label": CANDIDATES[name].label}
            if b.info:
                entry["engine"] = b.info
            entries[name] = entry
            if phase not in CANDIDATES[name].phases:
                entry.update(status="skipped", note=CANDIDATES[name].phase_note or f"runs no {phase} phase",
                             phase_not_run=True)
                continue
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
            try:
                estimates[name] = timing.estimate(fn, pool, device, t)
            except Exception as e:  # as above: a call that fails later is reported, not fatal
                entry.update(status="error", note=f"{type(e).__name__}: {e}".strip()[:500])
                results.pop(name, None)
                continue
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
                                    tcfg["min_rounds"], timing.MAX_CALLS[device.type]) for n in fns}
            samples = timing.interleaved(fns, pool, plans, device, cfg.clock)
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
            "cell": case.cell, "call": case.call, "families": list(case.families), "B": case.B, "T": case.T,
            "H": case.H, "I": case.I, "dtype": case.dtype, "phase": phase, "flops": c.flops, "bytes": c.bytes,
            "truth": truth_name, "candidates": {n: entries[n] for n in order}})
        progress.update(1)
    return records


def apply_peaks(records: list[dict], peaks: dict) -> None:
    """Achieved TFLOP/s and GB/s as percentages of the ceilings: on the CPU the
    cores' FMA peak (bench/fma_peak.py, ``peaks["fma"]``), on a GPU the measured
    GEMM peak of the dtype; the measured copy bandwidth."""
    flops = peaks["fma"]["tflops"] if "fma" in peaks else peaks["gemm_tflops"]
    for r in records:
        flops_peak = flops.get(r["dtype"])
        for e in r["candidates"].values():
            if e["status"] == "timed":
                e["pct_peak_flops"] = 100 * e["tflops"] / flops_peak if flops_peak else None
                e["pct_peak_bw"] = 100 * e["gbps"] / peaks["copy_gbps"]


# ------------------------------------------------------------- metadata ----

def metadata(device: torch.device, cfg: Config, dtypes, candidates: dict) -> dict:
    dev = {"type": device.type, "cpu": cpu_model(), "threads": torch.get_num_threads(),
           "cores": os.cpu_count(), "load_average_at_start": load_average()}
    if device.type == "cpu":
        dev["isa"] = cpu_isa()
        dev["cpu_id"] = cpu_identity()
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        dev.update(name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                   memory_gb=p.total_memory / 2 ** 30)
    else:
        dev["name"] = dev["cpu"]
    table = sizes(device.type, cfg.grid)
    families = cfg.run_families()

    def grid_entry(sizes_):
        if isinstance(sizes_, dict):  # per cell (peers)
            return {cell: [list(s) for s in v] for cell, v in sizes_.items() if cell in cfg.cells}
        return [list(s) for s in sizes_]

    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench"] + list(cfg.argv)),
        "git": git_commit(),
        "device": dev,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "rnnkern": rnnkern.__version__, "triton": package_version("triton"),
                     "cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                     "flashrnn": package_version("flashrnn"), "onnxruntime": package_version("onnxruntime"),
                     "openvino": package_version("openvino"), "numpy": package_version("numpy")},
        "settings": {"tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                     "tf32_cudnn": torch.backends.cudnn.allow_tf32,
                     "rnnkern_cuda_built": rnnkern.ops.WITH_CUDA,
                     # which loop the cuda candidate ran (rnnkern.ops.set_cuda_persistent)
                     "rnnkern_cuda_persistent": rnnkern.ops.cuda_persistent()},
        "quick": cfg.quick,
        "grid_name": cfg.grid,
        "complete": False,      # true once every case is measured
        "stopped_by": None,     # "SIGINT" / "SIGTERM" when the run was stopped
        "cells": list(cfg.cells), "dtypes": list(dtypes), "families": list(families),
        "grid": {f: grid_entry(table[f]) if f not in STUDY_FAMILIES else study_sizes(f, cfg)
                 for f in families},
        "grid_calls": {f: list(FAMILY_CALLS.get(f, ("sequence",))) for f in families if f not in STUDY_FAMILIES},
        "grid_note": ("sizes are [B, T, H] (peers: per cell); input size I = H; one layer, one direction; "
                      "grid_calls: how each family's sizes are called (sequence: nn.LSTM & co.; "
                      "cell: nn.LSTMCell & co. on x[0], T = 1)"),
        "candidates": candidates,
        "peers": {"onnx_export": ONNX_EXPORT,
                  "onnxruntime": {"intra_op_num_threads": torch.get_num_threads(), "inter_op_num_threads": 1,
                                  "graph_optimization_level": "default (ORT_ENABLE_ALL)",
                                  "providers": ["CPUExecutionProvider"]},
                  "openvino": {"device": "CPU",
                               "config": dict(OPENVINO_HINTS, INFERENCE_NUM_THREADS=torch.get_num_threads())},
                  "note": ("forward only, float32, CPU; the engine's own report of its settings is in "
                           "each result's candidates.<name>.engine")},
        "baseline": BASELINE,
        "timing": dict(cfg.timing(), interleaved=True,
                       clock="cuda events" if device.type == "cuda" else cfg.clock,
                       method=("CUDA events around every call" if device.type == "cuda" else
                               "process CPU time (time.process_time, all threads) over a loop of calls"
                               if cfg.clock == "cpu" else
                               "torch.utils.benchmark.Timer.timeit, num_threads=torch.get_num_threads()"),
                       figure="median over samples"),
        "agreement": {"truth": "torch.nn in float64, same inputs and weights",
                      "criterion": "relative Frobenius error <= max(factor * torch.nn's own, floor)",
                      "factor": agreement.FACTOR,
                      "floor": {str(k).replace("torch.", ""): v for k, v in agreement.FLOOR.items()}},
        "limits": {"loop_max_T": LOOP_MAX_T[device.type], "flashrnn_families": list(FLASHRNN_FAMILIES)},
    }


def packed_size(cfg: Config) -> dict:
    """The packed study's batch (bench/grid.py PACKED_SIZES)."""
    T, B, I, H, mean = PACKED_SIZES["quick" if cfg.quick else "cpu"]
    return {"T": T, "B": B, "I": I, "H": H, "mean_length": mean}


def speech_sizes(cfg: Config) -> list:
    """The speech study's stacks (bench/speech.py SIZES)."""
    from . import speech

    return [dict(zip(("B", "T", "I", "H", "layers"), size))
            for size in speech.SIZES["quick" if cfg.quick else "cpu"]]


def study_sizes(family: str, cfg: Config):
    return packed_size(cfg) if family == "packed" else speech_sizes(cfg)


def _packed_results(cfg: Config, rounds: int):
    """bench/packed.py's study per cell."""
    from . import packed

    size = packed_size(cfg)
    for cell in cfg.cells:
        yield packed.measure(cell, size["T"], size["B"], size["I"], size["H"], size["mean_length"], rounds,
                             seed=0)


def _speech_results(cfg: Config, rounds: int):
    """bench/speech.py's study per cell it has (LSTM, GRU) and size."""
    from . import speech

    for cell in (c for c in cfg.cells if c in speech.MODULES):
        for size in speech_sizes(cfg):
            yield speech.measure(cell, size["B"], size["T"], size["I"], size["H"], size["layers"], rounds, seed=0)


#: Per study family: its results as they are measured, its line, and what it compares.
STUDIES = {"packed": (_packed_results, report.packed_line, "rnnkern's cpu backend against torch.nn"),
           "speech": (_speech_results, report.speech_line, "rnnkern's cpu backend against torch.nn")}


def run_study(family: str, doc: dict, device: torch.device, cfg: Config, say, outputs) -> None:
    """A study family (bench/packed.py, bench/speech.py) into doc[family]: each result
    printed and saved as it comes; CPU only."""
    results, line, what = STUDIES[family]
    if device.type != "cpu":
        doc[f"{family}_note"] = f"the {family} study runs on the CPU ({what})"
        say(f"{family}: not run ({doc[f'{family}_note']})")
        return
    doc[family] = []
    for r in results(cfg, cfg.rounds or (3 if cfg.quick else 7)):
        doc[family].append(r)
        say(f"[{family}] " + line(r))
        sys.stdout.flush()
        if outputs is not None:
            outputs.save(doc, final=False)


class Stopped(Exception):
    """SIGINT or SIGTERM arrived: the run writes what it has and ends."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


@dataclass
class Outputs:
    """Where a run writes: JSON and markdown after every case, plots at the end."""
    json: Path
    markdown: Path
    plots: Path

    def save(self, doc: dict, final: bool) -> list[str]:
        report.write_json(doc, self.json)
        self.markdown.parent.mkdir(parents=True, exist_ok=True)
        self.markdown.write_text(report.markdown(doc))
        return report.plots(doc, self.plots) if final and doc["results"] else []


def default_out_dir(device: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    return OUT_ROOT / f"{device}-{stamp}"


def run(cfg: Config, outputs: Optional[Outputs] = None) -> dict:
    """The whole run; returns the JSON document (see bench/README.md).  Each case's
    lines are printed as soon as it is measured; with ``outputs``, the JSON and the
    markdown are rewritten after every case.  A :class:`Stopped` or KeyboardInterrupt
    during the run marks the document stopped and returns it (the caller exits)."""
    from tqdm import tqdm

    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    threads = cfg.threads or (1 if cfg.quick else None)
    load = load_average()
    busy = device.type == "cpu" and load is not None and load[0] > (os.cpu_count() or 1)
    if busy and threads is None:
        # Oversubscribed, every multi-threaded kernel waits at each parallel region
        # for a descheduled thread (torch.nn's GRU fwd+bwd at B=32 T=256 H=256 took
        # 5.4 s with 2 threads at load 4 here, 0.26 s quiet): one thread for everyone.
        threads = 1
    if threads:
        torch.set_num_threads(threads)
    dtypes = tuple(cfg.dtypes or DEFAULT_DTYPES[device.type])
    requested = [BASELINE] + [n for n in (cfg.backends or cfg.default_candidates()) if n != BASELINE]
    candidates, names = {}, []
    for n in requested:
        reason = CANDIDATES[n].unavailable(device)
        candidates[n] = {"label": CANDIDATES[n].label, "available": reason is None, "note": reason,
                         "phases": list(CANDIDATES[n].phases)}
        if reason is None:
            names.append(n)
    cases = build_grid(device.type, cfg.cells, dtypes, cfg.run_families(), cfg.grid)
    doc = {"meta": metadata(device, cfg, dtypes, candidates), "results": []}
    say = tqdm.write
    n_threads = torch.get_num_threads()
    studies = [f for f in STUDY_FAMILIES if f in cfg.run_families()] if device.type == "cpu" else []
    study = (f" and the {' and '.join(studies)} stud{'ies' if len(studies) > 1 else 'y'}" if studies else "")
    say(f"bench: {len(cases)} cases x 2 phases{study} on {doc['meta']['device']['name']}, {n_threads} "
        f"thread{'s' if n_threads != 1 else ''}; candidates: {', '.join(CANDIDATES[n].label for n in names)}")
    for n, c in candidates.items():
        if not c["available"]:
            say(f"not run: {c['label']} ({c['note']})")
    warning = report.load_warning(doc)
    if warning:
        say(warning)
    if busy and cfg.threads is None and not cfg.quick:
        say("  so this run uses one thread for every candidate (--threads N to choose)")
    if outputs is not None:
        say(f"results: {outputs.json.parent}" + (" (JSON and markdown after every case, plots at the end)"))
    progress = tqdm(total=2 * len(cases), disable=not cfg.progress, unit="case", dynamic_ncols=True,
                    desc=f"bench {device.type}")
    progress.set_postfix_str("measuring peaks")
    try:
        doc["peaks"] = timing.measure_peaks(device, [DTYPES[d] for d in dtypes])
        if device.type == "cpu":
            # Every dtype the cases run in (the bf16 family's too); the measured GEMM
            # peaks stay those of --dtypes (torch.mm in bf16 runs at 0.3 GFLOP/s on
            # CPUs without bf16 instructions: minutes at the peak's size).
            case_dtypes = tuple(dict.fromkeys([*dtypes, *(c.dtype for c in cases)]))
            doc["peaks"]["fma"] = fma_peak.at_least_measured(
                fma_peak.fma_peak(torch.get_num_threads(), case_dtypes), doc["peaks"]["gemm_tflops"],
                fma_peak.fma_loop_tflops(torch.get_num_threads()))
            overhead = timing.harness_overhead([None] * 4)
            doc["meta"]["timing"]["harness_overhead_us"] = overhead * 1e6
        for i, case in enumerate(cases):
            t0 = time.perf_counter()
            part = run_case(case, names, device, cfg, progress)
            for r in part:
                r["case_seconds"] = time.perf_counter() - t0  # both phases, agreement and timing
            apply_peaks(part, doc["peaks"])
            doc["results"] += part
            for r in part:
                say(f"[{i + 1}/{len(cases)}] " + report.case_line(r))
            sys.stdout.flush()
            if outputs is not None:
                outputs.save(doc, final=False)
        for family in STUDY_FAMILIES:
            if family in cfg.run_families():
                progress.set_postfix_str(f"the {family} study")
                run_study(family, doc, device, cfg, say, outputs)
        progress.set_postfix_str("measuring peaks")
        doc["peaks"] = timing.best_peaks(doc["peaks"], timing.measure_peaks(device, [DTYPES[d] for d in dtypes]))
        if "fma" in doc["peaks"]:
            loop = max(doc["peaks"]["fma"].get("fma_loop_tflops") or 0.0,
                       fma_peak.fma_loop_tflops(doc["peaks"]["fma"]["threads"]))
            doc["peaks"]["fma"] = fma_peak.at_least_measured(doc["peaks"]["fma"], doc["peaks"]["gemm_tflops"], loop)
        doc["meta"]["complete"] = True
    except (Stopped, KeyboardInterrupt) as e:
        doc["meta"]["stopped_by"] = e.signal_name if isinstance(e, Stopped) else "SIGINT"
        doc.setdefault("peaks", {"gemm_tflops": {}, "copy_gbps": None})
    finally:
        progress.close()
    if doc["peaks"].get("copy_gbps"):
        apply_peaks(doc["results"], doc["peaks"])
    doc["meta"]["device"]["load_average_at_end"] = load_average()
    return doc


# ------------------------------------------------------------------ CLI ----

def parse_args(argv) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="rnnkern against torch.nn (cuDNN / oneDNN), the vanilla loop, torch.compile and "
                    "FlashRNN: forward and forward+backward over a size grid (bench/README.md).")
    p.add_argument("--quick", action="store_true", help="tiny grid, 3 rounds (about a minute on CPU)")
    p.add_argument("--full", action="store_true",
                   help="the whole grid with every candidate (CPU: about 40 minutes; bench/grid.py)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cells", nargs="+", choices=CELLS, default=list(DEFAULT_CELLS))
    p.add_argument("--backends", nargs="+", choices=list(CANDIDATES), metavar="NAME",
                   help=f"candidates besides torch.nn (always run): {', '.join(CANDIDATES)}; "
                        "default: all available on the device")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES),
                   help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--families", nargs="+", choices=FAMILIES,
                   help=f"default: {' '.join(DEFAULT_FAMILIES)} (--full, --quick: all); peers and step "
                        "also bring ONNX Runtime and OpenVINO into the default candidates")
    p.add_argument("--threads", type=int,
                   help="CPU threads for every candidate (default: torch's, i.e. one per core; "
                        "--quick: 1, as a smoke test that oversubscribed machines cannot stall)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="CPU timings: wall clock (default), or the process's CPU time, all threads "
                        "together (a busy machine's time slices do not count; use with --threads 1 "
                        "for latencies)")
    p.add_argument("--rounds", type=int,
                   help="interleaved rounds per measurement, exactly (default: up to 7 CPU, 10 GPU, at least 3, "
                        "fewer for slow candidates)")
    p.add_argument("--out", metavar="DIR",
                   help="write bench.json, bench.md and plots/ here (default: bench/out/<device>-<time>/)")
    p.add_argument("--json", metavar="PATH", help="write every figure here (default: OUT/bench.json)")
    p.add_argument("--markdown", metavar="PATH",
                   help="write the speed-ratio tables here, markdown (default: OUT/bench.md)")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots here (default: OUT/plots)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--flashrnn-everywhere", action="store_true",
                   help="time FlashRNN on the whole grid, not only the headline size")
    a = p.parse_args(argv)
    if a.rounds is not None and a.rounds < 1:
        p.error("--rounds must be at least 1")
    if a.threads is not None and a.threads < 1:
        p.error("--threads must be at least 1")
    if a.quick and a.full:
        p.error("--quick and --full are different grids: choose one")
    grid = "quick" if a.quick else "full" if a.full else "default"
    cfg = Config(device=a.device, cells=tuple(a.cells), backends=tuple(a.backends) if a.backends else None,
                 dtypes=tuple(a.dtypes) if a.dtypes else None,
                 families=tuple(a.families) if a.families else None, grid=grid,
                 rounds=a.rounds, progress=not a.no_progress, flashrnn_everywhere=a.flashrnn_everywhere,
                 threads=a.threads, clock=a.clock,
                 argv=list(argv))
    return cfg, a


def _raise_stopped(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, a = parse_args(argv)
    out = Path(a.out) if a.out else default_out_dir(cfg.device)
    outputs = Outputs(json=Path(a.json) if a.json else out / "bench.json",
                      markdown=Path(a.markdown) if a.markdown else out / "bench.md",
                      plots=Path(a.plots) if a.plots else out / "plots")
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        doc = run(cfg, outputs)
    finally:
        signal.signal(signal.SIGTERM, previous)
    # A second Ctrl-C while the files are written would lose them: ignore it until done.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stopped = doc["meta"]["stopped_by"]
        if stopped:
            print(f"\nstopped by {stopped} after {len(doc['results']) // 2} cases: writing what was measured")
        elif doc["results"]:
            print()
            print(report.table(doc))
        print()
        print(report.summary(doc))
        if report.load_warning(doc):
            print("\n" + report.load_warning(doc))
        written = outputs.save(doc, final=True)
        print(f"\nJSON: {outputs.json}\nmarkdown: {outputs.markdown}")
        for path in written:
            print(f"plot: {path}")
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if stopped:
        raise SystemExit(128 + signal.Signals[stopped].value)
    return doc

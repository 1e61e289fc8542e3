"""Timers and the device's measured ceilings.

Candidates are always timed *interleaved*: round r runs every candidate in turn
(the starting candidate rotates from round to round), so load drifting on a
shared machine hits all of them alike, and the figures kept are medians.

- CPU: each sample is ``torch.utils.benchmark.Timer.timeit(k)`` (the mean of k
  calls, k sized from :func:`estimate` so that a sample lasts the run's target:
  thousands of calls for a one-step call of microseconds) with
  ``num_threads=torch.get_num_threads()`` (the Timer's default is 1 thread, which
  would handicap every multi-threaded kernel).
- CUDA: one pair of CUDA events around every call, no synchronisation between
  calls of a round; each sample is one call.

Every call takes the next set of a pool of input buffers (``rotate``), so a
candidate never gets its inputs hot in cache from its own previous call.
"""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.utils.benchmark as tbench


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_time(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds one call takes, synchronised (for planning, not for reporting)."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


@dataclass
class Plan:
    """How often each candidate is called: ``calls`` calls per sample (CPU), at
    most ``rounds`` interleaved rounds."""
    calls: int
    rounds: int


#: Most calls in one sample.  CPU: a sample is one timeit loop, so a one-step call
#: of ~10 us needs thousands of calls to fill a sample of 0.01-0.1 s.  GPU: every
#: call is its own sample (a pair of CUDA events), so a round stays at 100 calls.
MAX_CALLS = {"cpu": 100_000, "cuda": 100}


def plan(estimate_s: float, rounds: int, round_target_s: float, budget_s: float,
         min_rounds: int = 3, max_calls: int = MAX_CALLS["cpu"]) -> Plan:
    """Calls per sample so that a sample lasts about ``round_target_s`` (at most
    ``max_calls``); rounds capped so that one candidate costs about ``budget_s``
    (but never fewer than ``min_rounds``: a slow candidate still gets a median of
    several samples)."""
    estimate_s = max(estimate_s, 1e-7)
    calls = max(1, min(max_calls, int(round_target_s / estimate_s)))
    affordable = int(budget_s / (calls * estimate_s))
    return Plan(calls=calls, rounds=max(min_rounds, min(rounds, affordable)))


def estimate(fn: Callable[[object], object], pool: Sequence, device: torch.device, first_s: float,
             min_s: float = 5e-3) -> float:
    """Seconds per call for planning.  ``first_s`` is one call's wall time; a call
    shorter than ``min_s`` is timed again as a loop over the pool lasting about
    ``min_s``: one call of a few microseconds is mostly the clock's and the
    interpreter's noise, and a bad estimate would size every sample wrongly."""
    if first_s >= min_s:
        return first_s
    n = max(2, min(100_000, int(min_s / max(first_s, 1e-7))))
    nxt = rotate(pool)
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn(nxt())
    synchronize(device)
    return (time.perf_counter() - t0) / n


def harness_overhead(pool: Sequence, calls: int = 20_000, samples: int = 5) -> float:
    """Seconds the CPU timing loop itself adds to each call (the Timer's loop, the
    pool's rotation and the call of an empty function): the floor under every
    per-call figure, recorded in the JSON."""
    nxt = rotate(pool)
    timer = tbench.Timer(stmt="fn(nxt())", globals={"fn": lambda s: None, "nxt": nxt},
                         num_threads=torch.get_num_threads())
    return min(timer.timeit(calls).mean for _ in range(samples))


def rotate(pool: Sequence) -> Callable[[], object]:
    """A function returning the pool's items in turn, forever."""
    cycle = itertools.cycle(pool)
    return lambda: next(cycle)


def cpu_time_loop(fn: Callable[[object], object], nxt: Callable[[], object], calls: int) -> float:
    """Seconds of CPU time (all threads of this process) per call over ``calls`` calls."""
    t0 = time.process_time()
    for _ in range(calls):
        fn(nxt())
    return (time.process_time() - t0) / calls


def interleaved(fns: dict[str, Callable[[object], object]], pool: Sequence,
                plans: dict[str, Plan], device: torch.device,
                clock: str = "wall") -> dict[str, list[float]]:
    """Samples (seconds per call) of every candidate, measured round by round.

    ``fns[name](inputs)`` runs one call on one input set from ``pool``.  On the
    CPU, ``clock="cpu"`` measures the process's CPU time instead of the wall
    clock: the work a call costs, which time slices lost to other processes do
    not inflate (with one thread, a quiet machine's latency)."""
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    most = max(plans[n].rounds for n in names)
    nthreads = torch.get_num_threads()
    nexts = {n: rotate(pool) for n in names}  # each candidate walks the pool across rounds
    for r in range(most):
        order = names[r % len(names):] + names[: r % len(names)]
        active = [n for n in order if r < plans[n].rounds]
        if device.type == "cuda":
            events = []
            for n in active:
                fn, nxt = fns[n], nexts[n]
                for _ in range(plans[n].calls):
                    inp = nxt()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn(inp)
                    end.record()
                    events.append((n, start, end))
            torch.cuda.synchronize(device)
            for n, start, end in events:
                samples[n].append(start.elapsed_time(end) * 1e-3)
        else:
            for n in active:
                fn, nxt = fns[n], nexts[n]
                if clock == "cpu":
                    samples[n].append(cpu_time_loop(fn, nxt, plans[n].calls))
                    continue
                timer = tbench.Timer(stmt="fn(nxt())", globals={"fn": fn, "nxt": nxt},
                                     num_threads=nthreads)
                samples[n].append(timer.timeit(plans[n].calls).mean)
    return samples


def summarize(samples: list[float]) -> dict:
    """Median, interquartile range and minimum (seconds).  The median is the figure
    reported; the minimum is kept in the JSON as the least disturbed sample."""
    if len(samples) >= 2:
        q = statistics.quantiles(samples, n=4, method="inclusive")
        iqr = q[2] - q[0]
    else:
        iqr = 0.0
    return {"median_s": statistics.median(samples), "iqr_s": iqr, "min_s": min(samples)}


# ---------------------------------------------------------------- peaks ----

def measure_peaks(device: torch.device, dtypes: Sequence[torch.dtype]) -> dict:
    """The device's ceilings: the best of a few large square GEMMs per dtype
    (TFLOP/s) and of a few large copies (GB/s, bytes read plus bytes written).
    A run measures them at its start and its end and keeps the better of each
    (see :func:`best_peaks`): a peak is a maximum, and a shared machine's load
    comes and goes."""
    cuda = device.type == "cuda"
    n = 8192 if cuda else 2048
    reps = 10 if cuda else 5
    gemm = {}
    for dtype in dtypes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        torch.mm(a, b)
        best = min(wall_time(lambda: torch.mm(a, b), device) for _ in range(reps))
        gemm[str(dtype).replace("torch.", "")] = 2 * n ** 3 / best / 1e12
        del a, b
    nbytes = (1 << 30) if cuda else (256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(wall_time(lambda: dst.copy_(src), device) for _ in range(reps))
    del src, dst
    return {"gemm_tflops": gemm, "copy_gbps": 2 * nbytes / best / 1e9,
            "gemm_size": n, "copy_bytes": nbytes,
            "how": f"best of {reps}: {n}x{n}x{n} torch.mm per dtype; "
                   f"copy of {nbytes >> 20} MiB (read + write)"}


def best_peaks(a: dict, b: dict) -> dict:
    """The better of two measurements of the peaks."""
    out = dict(a)
    out["gemm_tflops"] = {k: max(v, b["gemm_tflops"].get(k, 0.0)) for k, v in a["gemm_tflops"].items()}
    out["copy_gbps"] = max(a["copy_gbps"], b["copy_gbps"])
    out["how"] = a["how"] + "; measured at the start and at the end of the run, the better kept"
    return out


def study_stats(fns: dict, pool: list, rounds: int, device, budget_s: float = 60) -> dict:
    """The studies' timing (bench/speech.py, bench/resets.py): each function's calls per
    sample planned from an estimate on the pool, then ``rounds`` interleaved rounds;
    {name: summarize(its samples) and their count, "samples"}."""
    plans = {}
    for name, fn in fns.items():
        est = estimate(fn, pool, device, wall_time(lambda: fn(pool[0]), device))
        plans[name] = plan(est, rounds, round_target_s=0.2, budget_s=budget_s, min_rounds=min(3, rounds))
    return {n: {**summarize(s), "samples": len(s)} for n, s in interleaved(fns, pool, plans, device).items()}

"""Writes the table ``backend="auto"`` decides by (rnnkern/auto_table.json) from
benchmark results: ``python -m bench.auto_table RESULT.json [...]``.

For each case of each file (one cell, dtype, size and phase, timed against
torch.nn in the same process), the entry keeps rnnkern's speed ratios
(torch.nn time / rnnkern time, per rnnkern backend).  A device's entries are
replaced by those of the files given for it; other devices' entries stay.  So
one GPU run updates the GPU's rows.  Files measuring the same case merge: the
later file's ratios replace the earlier's backend by backend, so a Triton run
adds its column to a CUDA grid (and its own CUDA ratios replace the grid's: the
third H100 run's Triton files come first, the seventh run's CUDA grid after them,
then its latency sizes measured again after 345262f):

    python -m bench.auto_table bench/results/gpu-h100-2026-11-27-session3/bench-triton-headline/bench_gpu.json \
        bench/results/gpu-h100-2026-11-27-session3/bench-triton-latency/bench_gpu.json \
        bench/results/gpu-h100-2026-12-06/bench-cuda-grid/bench_gpu.json \
        bench/results/gpu-h100-2026-12-06/bench-cuda-latency-345262f/bench_gpu.json \
        bench/results/cpu-zen3-2026-11-27-default/bench.json \
        bench/results/cpu-zen3-2026-11-27-auto-t1/bench.json \
        bench/results/cpu-zen3-2026-11-27-peers-step-t1/bench.json \
        bench/results/cpu-zen4avx2-2026-11-28-lstm-latency-t2/bench.json \
        bench/results/cpu-zen4avx2-2026-11-28-peers-step-t1/bench.json \
        bench/results/cpu-zen3-2026-12-03-peers-step-t1-b977408/bench.json \
        bench/results/cpu-zen3-2026-12-03-speech-t1-b977408/bench.json \
        bench/results/cpu-zen3-2026-12-03-speech-t2-b977408/bench.json \
        bench/results/cpu-zen3-2026-12-03-lstm-latency-t1-5b14c17/bench.json \
        bench/results/cpu-zen3-2026-12-03-lstm-latency-t2-5b14c17/bench.json

A run with the speech family (bench/speech.py) adds rows for bidirectional stacks
("directions": 2), which decide bidirectional calls (auto.py).

CPU rows keep the run's thread count: the fifth and sixth files are one-thread
runs of the same CPU as the fourth, a two-thread run; the seventh and eighth, a
Zen 4 whose AVX-512 the host hides (the same CPU class), at two threads and
one; the last five, a Zen 3 again (2026-12-03): one thread, the speech stacks
at one and two threads, the LSTM's latency sizes at one and two threads.

``--dtypes`` keeps only those dtypes' rows of the files given (the table's
other rows for their devices stay): a bf16 run that measured float32 beside
bfloat16 at two sizes must not decide every float32 call of its CPU class.
Then, for the AVX512_BF16 class (a Zen 4), the bf16 rows at one and two
threads:

    python -m bench.auto_table \
        bench/results/cpu-zen4-2026-12-02-bf16-t1-930c680/bench.json \
        bench/results/cpu-zen4-2026-12-02-bf16-t2-930c680/bench.json \
        bench/results/cpu-zen4-2026-12-02-bf16-t1-ec582f6/bench.json \
        bench/results/cpu-zen4-2026-12-02-bf16-t2-ec582f6/bench.json \
        bench/results/cpu-zen4-2026-12-02-bf16-latency-t1-930c680/bench.json \
        bench/results/cpu-zen4-2026-12-02-bf16-latency-t2-930c680/bench.json \
        bench/results/cpu-zen4-2026-12-01-step-bf16-t1-1da3971/bench.json --dtypes bfloat16

and its float32 rows (the full grid of the default families, its LSTM rows again after c5126ae,
and the short family at 1 and 2 threads, its LSTM rows again after c5126ae too, and the bf16
family's float32 cases), leaving the bfloat16 rows:

    python -m bench.auto_table \
        bench/results/cpu-zen4-2026-12-01-grid-t1-7b7cf32/bench.json \
        bench/results/cpu-zen4-2026-12-01-grid-t2-7b7cf32/bench.json \
        bench/results/cpu-zen4-2026-12-02-grid-lstm-t1-c5126ae/bench.json \
        bench/results/cpu-zen4-2026-12-02-grid-lstm-t2-c5126ae/bench.json \
        bench/results/cpu-zen4-2026-12-01-short-t1-425b41b/bench.json \
        bench/results/cpu-zen4-2026-12-01-short-t2-425b41b/bench.json \
        bench/results/cpu-zen4-2026-12-02-short-lstm-t1-8e167f6/bench.json \
        bench/results/cpu-zen4-2026-12-02-short-lstm-t2-8e167f6/bench.json \
        bench/results/cpu-zen4-2026-12-02-bf16-t1-930c680/bench.json \
        bench/results/cpu-zen4-2026-12-02-bf16-t2-930c680/bench.json \
        bench/results/cpu-zen4-2026-12-02-bf16-t1-ec582f6/bench.json \
        bench/results/cpu-zen4-2026-12-02-bf16-t2-ec582f6/bench.json \
        bench/results/cpu-zen4-2026-12-01-step-bf16-t1-1da3971/bench.json \
        bench/results/cpu-zen4-2026-12-02-speech-t1-2206010/bench.json \
        bench/results/cpu-zen4-2026-12-02-speech-t2-72d46ae/bench.json \
        bench/results/cpu-zen4-2026-12-01-step-t2-c7f7bfd/bench.json --dtypes float32

A Zen 5 (AVX-512 on 512-bit FMA pipes: the class cpu:512bit+bf16+fma512, whose calls without a
row of their own take the Zen 4's), both dtypes in one go: the float32 grid at 1 and 2 threads,
the bf16 family (again after 908afd6 and 1141504: its rows replace), the LSTM against the CPU engines, the latency sizes after b364985 (their rows
replacing the grid's), the speech stacks, bf16 one-step and cell calls (whose float32 cases the
last two files measure again, and decide), one-step calls:

    python -m bench.auto_table \
        bench/results/cpu-zen5-2026-12-03-grid-t1-ac1877c/bench.json \
        bench/results/cpu-zen5-2026-12-03-grid-t2-90fc337/bench.json \
        bench/results/cpu-zen5-2026-12-03-bf16-t1-ac1877c/bench.json \
        bench/results/cpu-zen5-2026-12-03-bf16-t2-ac1877c/bench.json \
        bench/results/cpu-zen5-2026-12-04-bf16-t1-1141504/bench.json \
        bench/results/cpu-zen5-2026-12-04-bf16-t2-1141504/bench.json \
        bench/results/cpu-zen5-2026-12-03-peers-lstm-t1-90fc337/bench.json \
        bench/results/cpu-zen5-2026-12-03-latency-t1-90fc337/bench.json \
        bench/results/cpu-zen5-2026-12-03-latency-t2-90fc337/bench.json \
        bench/results/cpu-zen5-2026-12-03-speech-t1-90fc337/bench.json \
        bench/results/cpu-zen5-2026-12-03-speech-t2-90fc337/bench.json \
        bench/results/cpu-zen5-2026-12-04-step-bf16-t1-426f88c/bench.json \
        bench/results/cpu-zen5-2026-12-04-step-bf16-t2-426f88c/bench.json \
        bench/results/cpu-zen5-2026-12-03-step-t1-49c61ef/bench.json \
        bench/results/cpu-zen5-2026-12-03-step-t2-49c61ef/bench.json

An Intel Xeon with AMX's bf16 tiles (class cpu:512bit+bf16+amx, 2026-12-05): the float32 grid at
1 and 2 threads, the bf16 family and the LSTM against the CPU engines at 35ac72f (the float32
products' panels prefetched, a step's products past 2 MB panel by panel), the bf16 family again
at b64b27a (the bf16 backward's rows widened as read, its weight gradients in larger blocks: its
rows replace 35ac72f's), the speech stacks at a5db55a; one-step calls in bfloat16 and float32 at
1 and 2 threads at 7671b66 (bf16 products on AMX's tiles, one-step calls split in blocks of 32
rows); on 2026-12-06 the bf16 calls of the latency, throughput and short sizes at 1 and 2 threads
(35a0d9b, after the forward's blocked x W_ih^T), and the bf16 family again with its new size,
B=16 T=128 H=512 (aa7ca5d: its rows replace b64b27a's):

    python -m bench.auto_table \
        bench/results/cpu-xeonamx-2026-12-05-grid-t1-35ac72f/bench.json \
        bench/results/cpu-xeonamx-2026-12-05-grid-t2-35ac72f/bench.json \
        bench/results/cpu-xeonamx-2026-12-05-bf16-t1-35ac72f/bench.json \
        bench/results/cpu-xeonamx-2026-12-05-bf16-t2-35ac72f/bench.json \
        bench/results/cpu-xeonamx-2026-12-05-bf16-t1-b64b27a/bench.json \
        bench/results/cpu-xeonamx-2026-12-05-bf16-t2-b64b27a/bench.json \
        bench/results/cpu-xeonamx-2026-12-05-peers-lstm-t1-35ac72f/bench.json \
        bench/results/cpu-xeonamx-2026-12-05-speech-t1-a5db55a/bench.json \
        bench/results/cpu-xeonamx-2026-12-05-speech-t2-a5db55a/bench.json \
        bench/results/cpu-xeonamx-2026-12-05-step-t1-7671b66/bench.json \
        bench/results/cpu-xeonamx-2026-12-05-step-t2-7671b66/bench.json \
        bench/results/cpu-xeonamx-2026-12-06-bf16-grid-t1-35a0d9b/bench.json \
        bench/results/cpu-xeonamx-2026-12-06-bf16-grid-t2-35a0d9b/bench.json \
        bench/results/cpu-xeonamx-2026-12-06-bf16-short-t1-35a0d9b/bench.json \
        bench/results/cpu-xeonamx-2026-12-06-bf16-short-t2-35a0d9b/bench.json \
        bench/results/cpu-xeonamx-2026-12-06-bf16-t1-aa7ca5d/bench.json \
        bench/results/cpu-xeonamx-2026-12-06-bf16-t2-aa7ca5d/bench.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from rnnkern import auto

RNNKERN_CANDIDATES = ("cpu", "cuda", "triton")


def device_key(meta: dict) -> str:
    dev = meta["device"]
    if dev["type"] == "cuda":
        return "cuda:sm_" + dev["capability"].replace(".", "")
    isa = dev.get("isa") or {}
    if "rnnkern_vector_bits" not in isa:
        raise ValueError("a CPU result without meta.device.isa.rnnkern_vector_bits (older than the "
                         "ISA record): its CPU class is unknown")
    if "rnnkern_fma_pipe_bits" in isa:  # (what the kernels took, RNNKERN_CPU_FMA_BITS included)
        fma512 = isa["rnnkern_fma_pipe_bits"] == 512
    else:  # results before 2026-12-03 (and after the CPU id, which older ones lack: no Zen 5's)
        cpu_id = dev.get("cpu_id") or {}
        fma512 = auto.fma_pipes_512bit(cpu_id.get("vendor", ""), int(cpu_id.get("family", 0)),
                                       int(cpu_id.get("model", 0)))
    flags = isa.get("cpu_flags", [])  # (amx_bf16 recorded from 2026-12-05 on: no earlier run had it)
    return auto.cpu_class(isa["rnnkern_vector_bits"], "avx512_bf16" in flags, fma512, "amx_bf16" in flags)


def entries_of(path: str, root: str, dtypes=None) -> tuple[str, list]:
    with open(path) as f:
        doc = json.load(f)
    key = device_key(doc["meta"])
    # A CPU row keeps its thread count (auto compares rows at the call's); a GPU's is moot.
    threads = doc["meta"]["device"].get("threads") if doc["meta"]["device"]["type"] == "cpu" else None
    source = os.path.relpath(path, root)
    out = []
    for r in doc["results"]:
        if r.get("call", "sequence") != "sequence" or (dtypes and r["dtype"] not in dtypes):
            continue
        speedups = {name: e["speedup_vs_torch"] for name, e in r["candidates"].items()
                    if name in RNNKERN_CANDIDATES and e.get("status") == "timed"
                    and e.get("speedup_vs_torch") is not None}
        if speedups:
            out.append({"device": key, "cell": r["cell"], "dtype": r["dtype"], "phase": r["phase"],
                        "B": r["B"], "T": r["T"], "H": r["H"], "threads": threads,
                        "speedups": {k: round(v, 3) for k, v in speedups.items()}, "source": source})
    # The speech study (bench/speech.py): bidirectional stacks, float32, rnnkern's cpu backend.
    for r in doc.get("speech", []):
        if dtypes and "float32" not in dtypes:
            continue
        for phase, p in r["phases"].items():
            out.append({"device": key, "cell": r["cell"], "dtype": "float32", "phase": phase,
                        "B": r["B"], "T": r["T"], "H": r["H"], "threads": threads, "directions": 2,
                        "speedups": {"cpu": round(p["speedup_vs_torch"]["rnnkern-cpu"], 3)},
                        "source": source})
    return key, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.auto_table", description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="bench JSON files (python -m bench --json)")
    p.add_argument("--out", default=auto.TABLE_PATH, help="the table to update (default: the package's)")
    p.add_argument("--dtypes", nargs="+", metavar="DTYPE",
                   help="take only these dtypes' rows; the table's rows of other dtypes stay")
    a = p.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    merged, devices = {}, set()
    for path in a.results:
        key, entries = entries_of(path, root, a.dtypes)
        devices.add(key)
        for e in entries:
            case = tuple(e[k] for k in ("device", "cell", "dtype", "phase", "B", "T", "H", "threads")) \
                + (e.get("directions", 1),)
            if case in merged:  # a later file's ratios replace an earlier one's, backend by backend
                was = merged[case]
                e = {**e, "speedups": {**was["speedups"], **e["speedups"]},
                     "source": was["source"] if was["source"] == e["source"]
                     else f"{was['source']}; {e['source']}"}
            merged[case] = e
        print(f"{path}: {len(entries)} entries for {key}")
    new = list(merged.values())
    old = auto._load(a.out)["entries"] if os.path.exists(a.out) else []
    kept = [e for e in old if e["device"] not in devices or (a.dtypes and e["dtype"] not in a.dtypes)]
    doc = {"about": "rnnkern/auto.py: what backend='auto' runs; written by python -m bench.auto_table",
           "entries": sorted(kept + new, key=lambda e: (e["device"], e["cell"], e["dtype"], e["phase"],
                                                       e.get("directions", 1), e["B"], e["T"], e["H"],
                                                       e.get("threads") or 0))}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"{a.out}: {len(doc['entries'])} entries ({len(kept)} kept from other devices)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

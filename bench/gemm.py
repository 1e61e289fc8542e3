"""The CPU backend's large products against torch's matmul (the MKL bundled with
torch) on the shapes of an RNN layer's input projection and its gradients.

    python -m bench.gemm                    # the LSTM shapes below, float32, JSON with --json
    python -m bench.gemm --threads 1 --json gemm.json
    python -m bench.gemm --quick            # tiny sizes, a smoke test

For rows M = T*B, input width K and gate width N (4H for an LSTM):
  y  = x W^T        (rnnkern::linear; torch: x @ W.t())
  dX = dY W         (rnnkern::linear_backward, need_x;  torch: dY @ W)
  dW = dY^T x       (rnnkern::linear_backward, need_w;  torch: dY.t() @ x)
Before any timing each product must agree with the float64 product (to 1e-4
relative to its largest value, float32 sums of up to 8192 terms).  Timed as the
main suite times (bench/timing.py): interleaved rounds, medians; GFLOP/s =
2*M*K*N / time, against the core's FMA peak (bench/fma_peak.py).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from . import report, timing
from .fma_peak import at_least_measured, fma_loop_tflops, fma_peak

# (M, K, N): the input projection of an LSTM at T*B rows, input width K, hidden N/4.
SHAPES = [(8192, 64, 256),     # sb3-contrib 64 envs x T=128, 64 features, hidden 64
          (8192, 64, 1024),    # the same at hidden 256
          (4096, 128, 512),    # B=64 T=64 H=128
          (8192, 256, 1024),   # B=32 T=256 H=256 (the headline)
          (400, 640, 2048)]    # speech: T=400 B=1, 640 features, H=512
QUICK_SHAPES = [(70, 33, 40), (300, 20, 64)]
TOLERANCE = 1e-4


def products(x, w, gy):
    lin, back = torch.ops.rnnkern.linear, torch.ops.rnnkern.linear_backward
    return {
        "y": (lambda: lin(x, w), lambda: x @ w.t(), lambda: x.double() @ w.double().t()),
        "dX": (lambda: back(gy, x, w, True, False)[0], lambda: gy @ w,
               lambda: gy.double() @ w.double()),
        "dW": (lambda: back(gy, x, w, False, True)[1], lambda: gy.t() @ x,
               lambda: gy.double().t() @ x.double()),
    }


def measure(M: int, K: int, N: int, rounds: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    pool = [(torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(M, N, generator=g))
            for _ in range(2)]
    device = torch.device("cpu")
    rows = []
    for name in ("y", "dX", "dW"):
        ours, theirs, exact = products(*pool[0])[name]
        want = exact()
        scale = want.abs().max().item()
        for who, fn in (("rnnkern", ours), ("torch", theirs)):
            err = (fn().double() - want).abs().max().item() / scale
            if not err <= TOLERANCE:
                raise SystemExit(f"bench.gemm: {name} at M={M} K={K} N={N}: {who} is off by {err:.3g} "
                                 f"of its largest value (> {TOLERANCE}); not timing a wrong answer")
        # Each input set's product pair, built once (not per timed call).
        calls = [products(*inputs)[name][:2] for inputs in pool]
        fns = {"rnnkern": lambda pair: pair[0](), "torch": lambda pair: pair[1]()}
        plans = {}
        for who, fn in fns.items():
            est = timing.estimate(fn, calls, device, timing.wall_time(lambda: fn(calls[0]), device))
            plans[who] = timing.plan(est, rounds, round_target_s=0.1, budget_s=30, min_rounds=min(3, rounds))
        samples = timing.interleaved(fns, calls, plans, device)
        ms = {who: 1e3 * timing.summarize(s)["median_s"] for who, s in samples.items()}
        gflops = {who: 2 * M * K * N / (t * 1e-3) / 1e9 for who, t in ms.items()}
        rows.append({"product": name, "M": M, "K": K, "N": N, "ms": ms, "gflops": gflops,
                     "speedup_vs_torch": ms["torch"] / ms["rnnkern"]})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=None, help="default: torch's (one per core)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 3 rounds")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    shapes, rounds = (QUICK_SHAPES, 3) if args.quick else (SHAPES, args.rounds)
    meta = report.study_meta("bench.gemm", argv)
    peak = at_least_measured(fma_peak(meta["threads"], ["float32"]), {}, fma_loop_tflops(meta["threads"]))
    meta["fma_peak"] = peak
    peak_gflops = 1e3 * peak["tflops"].get("float32", float("nan"))
    print(f"bench.gemm on {meta['cpu']}, {meta['threads']} thread(s), load average "
          f"{meta['load_average_at_start']}, float32, FMA peak {peak_gflops:.0f} GFLOP/s", flush=True)
    print(f"{'product':8s} {'M':>6s} {'K':>5s} {'N':>5s} | {'rnnkern ms':>10s} {'GFLOP/s':>8s} | "
          f"{'torch ms':>9s} {'GFLOP/s':>8s} | speedup", flush=True)
    results = []
    for M, K, N in shapes:
        for r in measure(M, K, N, rounds, seed=0):
            results.append(r)
            print(f"{r['product']:8s} {M:6d} {K:5d} {N:5d} | {r['ms']['rnnkern']:10.3f} "
                  f"{r['gflops']['rnnkern']:8.1f} | {r['ms']['torch']:9.3f} {r['gflops']['torch']:8.1f} | "
                  f"{r['speedup_vs_torch']:.2f}x", flush=True)
    report.write_study(args.json, {"meta": meta, "results": results})


if __name__ == "__main__":
    main()

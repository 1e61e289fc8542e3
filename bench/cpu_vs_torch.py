"""rnnkern's CPU backend against torch.nn (oneDNN / ATen) on the CPU.

For each cell, forward (inference, no autograd) and forward + backward, at one
size (default B=32 T=256 H=256 float32): both run in this process on the same
inputs and weights, their results are compared before anything is timed, and
the timings are interleaved (A, B, A, B, ...) so that drifting machine load
hits both alike.  Prints the median times and the speed ratio torch / rnnkern.

    python -m bench.cpu_vs_torch [--batch 32 --seq 256 --hidden 256 --rounds 7 --json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn as nn

import rnnkern

CELLS = {"lstm": (nn.LSTM, rnnkern.LSTM, {}), "gru": (nn.GRU, rnnkern.GRU, {}),
         "rnn_tanh": (nn.RNN, rnnkern.RNN, {"nonlinearity": "tanh"})}


def timed(fn, repeat: int) -> float:
    """Median wall time of fn() over `repeat` calls (seconds)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compare(cell: str, B: int, T: int, H: int, rounds: int, repeat: int, dtype=torch.float32):
    torch_cls, ours_cls, kw = CELLS[cell]
    torch.manual_seed(0)
    theirs = torch_cls(H, H, **kw).to(dtype)
    ours = ours_cls(H, H, backend="cpu", **kw).to(dtype)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(T, B, H, dtype=dtype)
    xg = x.clone().requires_grad_()

    with torch.no_grad():
        err = (ours(x)[0] - theirs(x)[0]).abs().max().item()
    if not err < 1e-3:
        raise RuntimeError(f"{cell}: rnnkern and torch.nn disagree (max error {err:.2e}); not timing")

    def forward(m):
        def run():
            with torch.no_grad():
                m(x)
        return run

    def train_step(m):
        def run():
            out, _ = m(xg)
            out.sum().backward()
        return run

    result = {"cell": cell, "max_abs_error": err}
    for phase, make in (("forward", forward), ("forward_backward", train_step)):
        fns = {"torch": make(theirs), "rnnkern": make(ours)}
        for fn in fns.values():  # warm-up
            fn()
        samples = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                samples[name].append(timed(fn, repeat))
        t_torch, t_ours = statistics.median(samples["torch"]), statistics.median(samples["rnnkern"])
        result[phase] = {"torch_ms": t_torch * 1e3, "rnnkern_ms": t_ours * 1e3,
                         "speedup": t_torch / t_ours}
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per measurement")
    p.add_argument("--repeat", type=int, default=3, help="calls per round")
    p.add_argument("--cells", nargs="*", default=list(CELLS), choices=list(CELLS))
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    print(f"rnnkern CPU backend vs torch.nn, B={args.batch} T={args.seq} H={args.hidden} float32, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'cell':10} {'phase':18} {'torch.nn ms':>12} {'rnnkern ms':>11} {'speedup':>8}")
    results = []
    for cell in args.cells:
        r = compare(cell, args.batch, args.seq, args.hidden, args.rounds, args.repeat)
        results.append(r)
        for phase in ("forward", "forward_backward"):
            m = r[phase]
            print(f"{cell:10} {phase:18} {m['torch_ms']:12.1f} {m['rnnkern_ms']:11.1f} "
                  f"{m['speedup']:7.2f}x")
    if args.json:
        meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(),
                "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "size": {"B": args.batch, "T": args.seq, "H": args.hidden, "dtype": "float32"}}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()

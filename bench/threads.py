"""One thread against two on the CPU, on a quiet machine and beside a busy one.

    python -m bench.threads                        # GRU, H 32/256 x B 1/32, T=2000
    python -m bench.threads --T 20000 --H 32 --B 1 --no-torch

Each (size, threads, neighbour) runs in its own interpreter, so the thread
pool is fresh; "busy" starts a `while 1: pass` process for the duration (on
a 2-core machine it holds one core).  Times are medians of forward+backward
over --rounds; torch.nn runs in the same process on the same weights and
inputs, so `vs torch.nn` compares like with like under the same load.  The
load average is printed: on a shared machine every figure moves with it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r'''
import json, statistics, sys, time, torch, rnnkern
cell, T, B, H, threads, rounds, with_torch = sys.argv[1:8]
T, B, H, threads, rounds = int(T), int(B), int(H), int(threads), int(rounds)
torch.set_num_threads(threads)
torch.manual_seed(0)
classes = {"rnn": (rnnkern.RNN, torch.nn.RNN), "gru": (rnnkern.GRU, torch.nn.GRU),
           "lstm": (rnnkern.LSTM, torch.nn.LSTM)}[cell]
ours = classes[0](H, H)
theirs = classes[1](H, H)
theirs.load_state_dict(ours.state_dict())
x = torch.randn(T, B, H, requires_grad=True)
def median_ms(m):
    def run():
        out, _ = m(x)
        out.sum().backward()
    run()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)
regions = rnnkern._C.cpu_parallel_regions()
result = {"rnnkern_ms": median_ms(ours)}
result["regions_per_call"] = (rnnkern._C.cpu_parallel_regions() - regions) / (rounds + 1)
if with_torch == "1":
    result["torch_ms"] = median_ms(theirs)
print(json.dumps(result))
'''


def measure(cell, T, B, H, threads, rounds, with_torch, busy):
    neighbour = (subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if busy else None)
    try:
        run = subprocess.run([sys.executable, "-c", _CHILD, cell, str(T), str(B), str(H),
                              str(threads), str(rounds), "1" if with_torch else "0"],
                             capture_output=True, text=True, check=True)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    return json.loads(run.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cell", default="gru", choices=["rnn", "gru", "lstm"])
    p.add_argument("--T", type=int, default=2000)
    p.add_argument("--H", type=int, nargs="+", default=[32, 256])
    p.add_argument("--B", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-torch", action="store_true", help="skip torch.nn (slow at long T)")
    p.add_argument("--neighbour", nargs="+", default=["quiet", "busy"], choices=["quiet", "busy"])
    args = p.parse_args()
    print(f"# {args.cell} forward+backward, T={args.T}, median of {args.rounds}; "
          f"load average {os.getloadavg()[0]:.2f} at start, {os.cpu_count()} CPUs")
    head = f"{'H':>5} {'B':>3} {'neighbour':>9} {'threads':>7} {'rnnkern ms':>11} " \
           f"{'regions':>8} {'torch.nn ms':>12} {'2 thr / 1 thr':>13}"
    print(head)
    for H in args.H:
        for B in args.B:
            for neighbour in args.neighbour:
                one = None
                for threads in (1, 2):
                    r = measure(args.cell, args.T, B, H, threads, args.rounds, not args.no_torch,
                                neighbour == "busy")
                    ratio = "" if one is None else f"{r['rnnkern_ms'] / one:.2f}x"
                    one = one or r["rnnkern_ms"]
                    torch_ms = f"{r['torch_ms']:.1f}" if "torch_ms" in r else "-"
                    print(f"{H:>5} {B:>3} {neighbour:>9} {threads:>7} {r['rnnkern_ms']:>11.1f} "
                          f"{r['regions_per_call']:>8.0f} {torch_ms:>12} {ratio:>13}", flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()

"""Episode boundaries inside a chunk: rnnkern's ``resets=`` against the loop a
torch.nn user writes without it.

    python -m bench.resets                       # LSTM T=64 B=32 H=256, 5% resets
    python -m bench.resets --cells lstm gru rnn_tanh --fraction 0.02
    python -m bench.resets --quick               # tiny sizes, a smoke test

torch.nn has no per-step reset, so a recurrent policy trained on chunks where
episodes end mid-chunk splits the time axis at every step where some row starts
a new episode, zeros those rows' state (``torch.where``, as RL libraries mask
it) and runs each piece: with 5% of 32 rows restarting per step, most pieces
are one or two steps long.  rnnkern runs the chunk with ``resets=`` fused into
its kernels: the chunk carries a state in (h0), so two kernel calls (from h0 up
to each row's first restart, and from zeros; docs/options.md).  Both run forward + backward (the gradients of the input, the initial
state and every weight) on the same weights and inputs; before any timing they
must agree in float64 (outputs and every gradient, to 1e-10).  Timed as the
main suite times (bench/timing.py): interleaved rounds, medians.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import rnnkern

from . import report, timing

MODULES = {"lstm": (torch.nn.LSTM, rnnkern.LSTM), "gru": (torch.nn.GRU, rnnkern.GRU),
           "rnn_tanh": (torch.nn.RNN, rnnkern.RNN)}
TOLERANCE = 1e-10  # float64 agreement, outputs and every gradient


def torch_pieces(m: torch.nn.Module, x, h0, c0, resets):
    """torch.nn over the pieces between the steps where some row restarts; the
    rows restarting at a piece's first step start it from zeros (rnnkern's reset
    rule, position 0 included), the chunk from the carried h0 (and c0)."""
    T = x.size(0)
    bounds = [0] + [t for t in range(1, T) if bool(resets[t].any())] + [T]
    h, c = h0, c0
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        r = resets[a].view(1, -1, 1)
        h = torch.where(r, 0.0, h)
        if c is None:
            out, h = m(x[a:b], h)
        else:
            c = torch.where(r, 0.0, c)
            out, (h, c) = m(x[a:b], (h, c))
        outs.append(out)
    return torch.cat(outs), h, c, len(bounds) - 1


def rnnkern_resets(m: torch.nn.Module, x, h0, c0, resets):
    if c0 is None:
        out, h = m(x, h0, resets=resets)
        return out, h, None
    out, (h, c) = m(x, (h0, c0), resets=resets)
    return out, h, c


def make_inputs(cell: str, T: int, B: int, H: int, fraction: float, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, H, generator=g, dtype=dtype, requires_grad=True)
    h0 = torch.randn(1, B, H, generator=g, dtype=dtype, requires_grad=True)
    c0 = torch.randn(1, B, H, generator=g, dtype=dtype, requires_grad=True) if cell == "lstm" else None
    resets = torch.rand(T, B, generator=g) < fraction
    cot = torch.randn(T, B, H, generator=g, dtype=dtype)
    return x, h0, c0, resets, cot


def forward_backward(run, m, inputs):
    """Outputs and the gradients of x, h0, (c0) and every parameter under
    sum(out * cot) + sum(h_n) (+ sum(c_n))."""
    x, h0, c0, resets, cot = inputs
    out, h, c = run(m, x, h0, c0, resets)[:3]
    loss = (out * cot).sum() + h.sum() + (c.sum() if c is not None else 0)
    wrt = [t for t in (x, h0, c0) if t is not None] + list(m.parameters())
    return [out, h] + ([c] if c is not None else []) + list(torch.autograd.grad(loss, wrt))


def pair(cell: str, H: int, dtype, seed: int):
    torch.manual_seed(seed)
    theirs = MODULES[cell][0](H, H)
    ours = MODULES[cell][1](H, H)
    ours.load_state_dict(theirs.state_dict())
    return theirs.to(dtype), ours.to(dtype)


def agreement(cell: str, T: int, B: int, H: int, fraction: float, seed: int) -> float:
    """Largest difference, float64, over outputs and every gradient."""
    theirs, ours = pair(cell, H, torch.float64, seed)
    inputs = make_inputs(cell, T, B, H, fraction, torch.float64, seed)
    want = forward_backward(torch_pieces, theirs, inputs)
    got = forward_backward(rnnkern_resets, ours, inputs)
    return max((a - b).abs().max().item() for a, b in zip(got, want))


def measure(cell: str, T: int, B: int, H: int, fraction: float, rounds: int, seed: int) -> dict:
    worst = agreement(cell, T, B, H, fraction, seed)
    if not worst <= TOLERANCE:
        raise SystemExit(f"bench.resets: {cell} T={T} B={B} H={H}: rnnkern with resets= and the "
                         f"torch.nn piece loop differ by {worst:.3g} in float64 (> {TOLERANCE}); "
                         f"not timing a wrong answer")
    theirs, ours = pair(cell, H, torch.float32, seed)
    pool = [make_inputs(cell, T, B, H, fraction, torch.float32, seed + i) for i in range(2)]
    pieces = torch_pieces(theirs, *pool[0][:4])[3]
    fns = {"torch.nn pieces": lambda inp: forward_backward(torch_pieces, theirs, inp),
           "rnnkern resets=": lambda inp: forward_backward(rnnkern_resets, ours, inp)}
    device = torch.device("cpu")
    stats = timing.study_stats(fns, pool, rounds, device)
    base, cand = stats["torch.nn pieces"]["median_s"], stats["rnnkern resets="]["median_s"]
    return {"cell": cell, "T": T, "B": B, "H": H, "reset_fraction": fraction,
            "resets": int(pool[0][3].sum()), "torch_pieces": pieces,
            "float64_max_difference": worst, "rounds": {n: s["samples"] for n, s in stats.items()},
            "torch_pieces_ms": 1e3 * base, "rnnkern_ms": 1e3 * cand, "speedup": base / cand,
            "stats_s": stats}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.resets", description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", nargs="+", choices=sorted(MODULES), default=["lstm"])
    p.add_argument("--T", type=int, default=64)
    p.add_argument("--B", type=int, default=32)
    p.add_argument("--H", type=int, default=256)
    p.add_argument("--fraction", type=float, default=0.05, help="share of (step, row) positions that restart")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=None, help="default: torch's (one per core)")
    p.add_argument("--quick", action="store_true", help="T=8 B=4 H=16, 3 rounds")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.T, args.B, args.H, args.rounds = 8, 4, 16, 3
    if not 0 <= args.fraction <= 1:
        p.error(f"--fraction must be in [0, 1], got {args.fraction}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    meta = report.study_meta("bench.resets", argv)
    print(f"bench.resets on {meta['cpu']}, {meta['threads']} thread(s), load average "
          f"{meta['load_average_at_start']}: forward + backward, float32", flush=True)
    results = []
    for cell in args.cells:
        r = measure(cell, args.T, args.B, args.H, args.fraction, args.rounds, seed=0)
        results.append(r)
        print(f"{cell} T={r['T']} B={r['B']} H={r['H']}, {r['resets']} resets "
              f"({100 * args.fraction:g}%): torch.nn over {r['torch_pieces']} pieces "
              f"{r['torch_pieces_ms']:.3g} ms; rnnkern resets= {r['rnnkern_ms']:.3g} ms: "
              f"{r['speedup']:.2f}x (float64 agreement {r['float64_max_difference']:.1e})", flush=True)
    report.write_study(args.json, {"meta": meta, "results": results})

if __name__ == "__main__":
    main()

"""Packed batches of skewed lengths: rnnkern against torch.nn on a PackedSequence of
a few long and many short sequences, and against rnnkern's own dense batch with the
same number of steps; rnnkern's ``lengths=`` on the same batch padded (unsorted) too.

    python -m bench.packed                      # LSTM H=128, 232 sequences, longest 100
    python -m bench.packed --cells lstm gru rnn_tanh --threads 1
    python -m bench.packed --quick              # tiny sizes, a smoke test
    python -m bench --families packed           # the same study as a family of the benchmark

What splitting RL trajectories at episode ends gives (torchrl's split-and-pad,
recurrent PPO's sequence batches): here B sequences, one of the longest length T
and the others drawn from an exponential distribution of mean ``--mean`` steps
(rounded up, at most T), so the [T, B] grid is mostly padding.  torch.nn's packed
path costs the real steps; a kernel that runs rows x longest costs the grid.
Forward + backward (the gradients of the packed data and every weight under a
random functional of the packed output and h_n, c_n), float32; before any timing
the two must agree in float64 (outputs and every gradient, to 1e-10).  The
PackedSequence is built before the clock (packing a padded batch is the
caller's, the same whichever module runs it, and costs the padded grid; until
2026-11-28 it was inside the clock).  The dense batch:
T steps of round(steps / T) rows, the same work if the packed one cost only its
real steps.  ``lengths=`` (since 2026-11-29): the padded [T, B] batch with its
unsorted lengths and the cotangent padded with zeros, inside the clock whatever
rnnkern does with it (it packs it: modules/sequence.py, _sorting_saves_steps).
Timed as the main suite times (bench/timing.py): interleaved rounds, medians.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import rnnkern

from . import report, timing

MODULES = {"lstm": (torch.nn.LSTM, rnnkern.LSTM, {}), "gru": (torch.nn.GRU, rnnkern.GRU, {}),
           "rnn_tanh": (torch.nn.RNN, rnnkern.RNN, {}),
           "rnn_relu": (torch.nn.RNN, rnnkern.RNN, {"nonlinearity": "relu"})}
TOLERANCE = 1e-10  # float64 agreement, outputs and every gradient


def skewed_lengths(B: int, T: int, mean: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(B, generator=g, dtype=torch.float64)
    lengths = (-mean * torch.log1p(-u)).ceil().clamp(1, T).long()
    lengths[0] = T
    return lengths


def pair(cell: str, I: int, H: int, dtype, seed: int):
    torch.manual_seed(seed)
    torch_cls, rnnkern_cls, kwargs = MODULES[cell]
    theirs = torch_cls(I, H, **kwargs)
    ours = rnnkern_cls(I, H, backend="cpu", **kwargs)
    ours.load_state_dict(theirs.state_dict())
    return theirs.to(dtype), ours.to(dtype)


def packed_inputs(T: int, B: int, I: int, H: int, lengths, dtype, seed: int):
    """A PackedSequence of random [T, B, I] sequences with ``lengths`` (batch order
    unsorted), a cotangent of its output's rows, and the same as a padded batch:
    x, lengths, the cotangent padded with zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, I, generator=g, dtype=torch.float64).to(dtype)
    cot = torch.randn(int(lengths.sum()), H, generator=g, dtype=torch.float64).to(dtype)
    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    cot_grid, _ = pad_packed_sequence(PackedSequence(cot, *packed[1:]), total_length=T)
    return packed, cot, x, lengths, cot_grid


def lengths_forward_backward(m, inputs):
    """forward_backward's loss on the padded batch with lengths=: the final states
    and the gradients of every parameter (the input's gradient is padded here)."""
    x, lengths, cot = inputs[2:]
    out, hidden = m(x, lengths=lengths)
    states = list(hidden) if isinstance(hidden, tuple) else [hidden]
    loss = (out * cot).sum() + sum(s.sum() for s in states)
    return [*states, *torch.autograd.grad(loss, list(m.parameters()))]


def forward_backward(m, inputs):
    """The packed output, the final states and the gradients of the packed data
    and every parameter under sum(out.data * cot) + sum(h_n) (+ sum(c_n))."""
    packed, cot = inputs[:2]
    data = packed.data.detach().requires_grad_()
    out, hidden = m(PackedSequence(data, packed.batch_sizes, packed.sorted_indices,
                                   packed.unsorted_indices))
    states = list(hidden) if isinstance(hidden, tuple) else [hidden]
    loss = (out.data * cot).sum() + sum(s.sum() for s in states)
    return [out.data, *states, *torch.autograd.grad(loss, [data, *m.parameters()])]


def dense_forward_backward(m, inputs):
    x, cot = inputs
    x = x.detach().requires_grad_()
    out, hidden = m(x)
    states = list(hidden) if isinstance(hidden, tuple) else [hidden]
    loss = (out * cot).sum() + sum(s.sum() for s in states)
    return torch.autograd.grad(loss, [x, *m.parameters()])


def measure(cell: str, T: int, B: int, I: int, H: int, mean: float, rounds: int, seed: int) -> dict:
    lengths = skewed_lengths(B, T, mean, seed)
    steps = int(lengths.sum())
    theirs, ours = pair(cell, I, H, torch.float64, seed)
    inputs = packed_inputs(T, B, I, H, lengths, torch.float64, seed)
    want = forward_backward(theirs, inputs)
    n_states = 2 if cell == "lstm" else 1
    worst = max((a - b).abs().max().item()
                for a, b in zip(forward_backward(ours, inputs) + lengths_forward_backward(ours, inputs),
                                want + want[1:1 + n_states] + want[2 + n_states:]))
    if not worst <= TOLERANCE:
        raise SystemExit(f"bench.packed: {cell} T={T} B={B} H={H}: rnnkern and torch.nn differ by "
                         f"{worst:.3g} in float64 (> {TOLERANCE}); not timing a wrong answer")
    theirs, ours = pair(cell, I, H, torch.float32, seed)
    pool = [packed_inputs(T, B, I, H, lengths, torch.float32, seed + i) for i in range(2)]
    Bd = max(1, round(steps / T))
    g = torch.Generator().manual_seed(seed)
    dense_pool = [(torch.randn(T, Bd, I, generator=g), torch.randn(T, Bd, H, generator=g)) for _ in range(2)]
    fns = {"torch.nn packed": lambda inp: forward_backward(theirs, inp),
           "rnnkern packed": lambda inp: forward_backward(ours, inp),
           "rnnkern lengths=": lambda inp: lengths_forward_backward(ours, inp),
           "rnnkern dense": lambda inp: dense_forward_backward(ours, inp)}
    pools = {"torch.nn packed": pool, "rnnkern packed": pool, "rnnkern lengths=": pool,
             "rnnkern dense": dense_pool}
    device = torch.device("cpu")
    stats = {}
    # Two interleaved measurements: the packed pair on the same inputs, then the
    # packed rnnkern against its dense batch (different inputs by design).
    for names in (("torch.nn packed", "rnnkern packed", "rnnkern lengths="),
                  ("rnnkern packed", "rnnkern dense")):
        sub = {n: fns[n] for n in names}
        plans = {}
        for n in names:
            est = timing.estimate(sub[n], pools[n], device, timing.wall_time(lambda: sub[n](pools[n][0]), device))
            plans[n] = timing.plan(est, rounds, round_target_s=0.2, budget_s=60, min_rounds=min(3, rounds))
        if names[1] == "rnnkern dense":
            # interleaved() takes one pool: pair each packed input with a dense one.
            zipped = list(zip(pool, dense_pool))
            sub = {"rnnkern packed": lambda pd: fns["rnnkern packed"](pd[0]),
                   "rnnkern dense": lambda pd: fns["rnnkern dense"](pd[1])}
            samples = timing.interleaved(sub, zipped, plans, device)
            stats["rnnkern packed (vs dense)"] = timing.summarize(samples["rnnkern packed"])
            stats["rnnkern dense"] = timing.summarize(samples["rnnkern dense"])
        else:
            samples = timing.interleaved(sub, pool, plans, device)
            for n in names:
                stats[n] = timing.summarize(samples[n])
    ms = {n: 1e3 * s["median_s"] for n, s in stats.items()}
    return {"cell": cell, "T": T, "B": B, "I": I, "H": H, "mean_length": mean, "steps": steps,
            "grid": T * B, "dense_B": Bd, "float64_max_difference": worst, "ms": ms,
            "speedup_vs_torch": ms["torch.nn packed"] / ms["rnnkern packed"],
            "lengths_speedup_vs_torch": ms["torch.nn packed"] / ms["rnnkern lengths="],
            "packed_over_dense": ms["rnnkern packed (vs dense)"] / ms["rnnkern dense"],
            "stats_s": stats}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.packed", description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", nargs="+", choices=sorted(MODULES), default=["lstm"])
    p.add_argument("--T", type=int, default=100, help="the longest sequence")
    p.add_argument("--B", type=int, default=232, help="sequences")
    p.add_argument("--I", type=int, default=64)
    p.add_argument("--H", type=int, default=128)
    p.add_argument("--mean", type=float, default=17.5, help="mean length of the others (exponential)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=None, help="default: torch's (one per core)")
    p.add_argument("--quick", action="store_true", help="T=12 B=9 I=4 H=8, 3 rounds")
    p.add_argument("--lengths-grid", action="store_true",
                   help="lengths= on the padded grid whatever its order (as before 2026-11-29: "
                        "no packing of unsorted lengths), for a before/after comparison")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.T, args.B, args.I, args.H, args.mean, args.rounds = 12, 9, 4, 8, 3.0, 3
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.lengths_grid:
        from rnnkern.modules import sequence
        sequence._sorting_saves_steps = lambda lengths: False
    meta = report.study_meta("bench.packed", argv)
    print(f"bench.packed on {meta['cpu']}, {meta['threads']} thread(s), load average "
          f"{meta['load_average_at_start']}: forward + backward, float32", flush=True)
    results = []
    for cell in args.cells:
        r = measure(cell, args.T, args.B, args.I, args.H, args.mean, args.rounds, seed=0)
        results.append(r)
        print(report.packed_line(r), flush=True)
    report.write_study(args.json, {"meta": meta, "results": results})

if __name__ == "__main__":
    main()

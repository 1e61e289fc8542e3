"""Speech-sized recurrent stacks: rnnkern against torch.nn on the bidirectional
two-layer LSTM and GRU of a speech model's encoder (speechbrain's CRDNN puts one
after its convolutions), in inference and training.

    python -m bench.speech                          # LSTM and GRU, B 1 and 8, float32
    python -m bench.speech --cells lstm --threads 1
    python -m bench.speech --quick                  # tiny sizes, a smoke test
    python -m bench --families speech               # the same study as a family of the benchmark

An utterance of 4 s (T = 400 frames of 10 ms), 640 features from the
convolutions, hidden 512 per direction, 2 layers, bidirectional; one utterance
(B = 1: streaming a file, a voice assistant) and a batch of 8.  At B = 1 each
step is a matrix-vector product that streams W_hh (4 MB for the LSTM) from L3,
so one direction keeps one core busy: rnnkern runs the two directions at once
(ops.run_concurrently; in training their forward), torch.nn one after the other.  Candidates:
torch.nn, rnnkern's cpu backend, and ``backend="auto"`` (what a converted model
runs).  Phases: forward under torch.no_grad (inference), and forward + backward
(the gradients of the input and every weight under a random functional of the
output and the final states).  Before any timing rnnkern must agree with torch.nn
in float64 (outputs and every gradient, to 1e-10).  Timed as the main suite times
(bench/timing.py): interleaved rounds, medians.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import rnnkern

from . import report, timing

MODULES = {"lstm": (torch.nn.LSTM, rnnkern.LSTM), "gru": (torch.nn.GRU, rnnkern.GRU)}
#: (B, T, I, H, layers): the encoder of a speech model, one utterance and a batch.
SIZES = {"cpu": [(1, 400, 640, 512, 2), (8, 400, 640, 512, 2)], "quick": [(2, 12, 16, 24, 2)]}
TOLERANCE = 1e-10  # float64 agreement, outputs and every gradient
CANDIDATES = ("torch.nn", "rnnkern-cpu", "rnnkern-auto")


def modules(cell: str, I: int, H: int, layers: int, dtype, seed: int) -> dict:
    """torch.nn's module and rnnkern's (cpu and auto) on the same weights."""
    torch.manual_seed(seed)
    torch_cls, rnnkern_cls = MODULES[cell]
    theirs = torch_cls(I, H, layers, bidirectional=True).to(dtype)
    out = {"torch.nn": theirs}
    for name, backend in (("rnnkern-cpu", "cpu"), ("rnnkern-auto", "auto")):
        m = rnnkern_cls(I, H, layers, bidirectional=True, backend=backend).to(dtype)
        m.load_state_dict(theirs.state_dict())
        out[name] = m
    return out


def inputs(cell: str, B: int, T: int, I: int, H: int, layers: int, dtype, seed: int) -> tuple:
    """x [T, B, I], (h0[, c0]) [2L, B, H] and cotangents of the output and final states."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    n = 2 if cell == "lstm" else 1
    hx = tuple(rand(2 * layers, B, H, scale=0.5) for _ in range(n))
    cot = (rand(T, B, 2 * H),) + tuple(rand(2 * layers, B, H) for _ in range(n))
    return rand(T, B, I), hx, cot


def forward(m, inp):
    x, hx, _ = inp
    with torch.no_grad():
        out, hidden = m(x, hx if len(hx) == 2 else hx[0])
    return [out, *(hidden if isinstance(hidden, tuple) else (hidden,))]


def forward_backward(m, inp):
    x, hx, cot = inp
    x = x.detach().requires_grad_()
    out, hidden = m(x, hx if len(hx) == 2 else hx[0])
    outs = [out, *(hidden if isinstance(hidden, tuple) else (hidden,))]
    loss = sum((o * c).sum() for o, c in zip(outs, cot))
    return outs + list(torch.autograd.grad(loss, [x, *m.parameters()]))


FNS = {"forward": forward, "forward_backward": forward_backward}


def measure(cell: str, B: int, T: int, I: int, H: int, layers: int, rounds: int, seed: int) -> dict:
    ms64 = modules(cell, I, H, layers, torch.float64, seed)
    inp64 = inputs(cell, B, T, I, H, layers, torch.float64, seed)
    worst = 0.0
    for fn in FNS.values():
        want = fn(ms64["torch.nn"], inp64)
        got = fn(ms64["rnnkern-cpu"], inp64)
        worst = max([worst] + [(a - b).abs().max().item() for a, b in zip(got, want)])
    if not worst <= TOLERANCE:
        raise SystemExit(f"bench.speech: {cell} B={B} T={T} H={H}: rnnkern and torch.nn differ by "
                         f"{worst:.3g} in float64 (> {TOLERANCE}); not timing a wrong answer")
    ms = modules(cell, I, H, layers, torch.float32, seed)
    pool = [inputs(cell, B, T, I, H, layers, torch.float32, seed + i) for i in range(2)]
    device = torch.device("cpu")
    phases = {}
    for phase, fn in FNS.items():
        stats = timing.study_stats({n: (lambda inp, m=ms[n]: fn(m, inp)) for n in CANDIDATES}, pool,
                                   rounds, device)
        med = {n: 1e3 * s["median_s"] for n, s in stats.items()}
        phases[phase] = {"ms": med,
                         "speedup_vs_torch": {n: med["torch.nn"] / med[n] for n in CANDIDATES[1:]},
                         "stats_s": stats}
    # What auto ran, and why (rnnkern.explain): inference, then a call that builds a graph.
    with torch.no_grad():
        phases["forward"]["auto_runs"] = str(rnnkern.explain(ms["rnnkern-auto"], pool[0][0]))
    phases["forward_backward"]["auto_runs"] = str(rnnkern.explain(ms["rnnkern-auto"], pool[0][0]))
    return {"cell": cell, "B": B, "T": T, "I": I, "H": H, "layers": layers, "bidirectional": True,
            "float64_max_difference": worst, "phases": phases}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.speech", description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", nargs="+", choices=sorted(MODULES), default=["lstm", "gru"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="default: torch's (one per core)")
    p.add_argument("--quick", action="store_true", help="B=2 T=12 I=16 H=24, 3 rounds")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = SIZES["quick" if args.quick else "cpu"]
    rounds = 3 if args.quick else args.rounds
    meta = report.study_meta("bench.speech", argv)
    print(f"bench.speech on {meta['cpu']}, {meta['threads']} thread(s), load average "
          f"{meta['load_average_at_start']}: float32", flush=True)
    results = []
    for cell in args.cells:
        for B, T, I, H, layers in sizes:
            r = measure(cell, B, T, I, H, layers, rounds, seed=0)
            results.append(r)
            print(report.speech_line(r), flush=True)
    report.write_study(args.json, {"meta": meta, "results": results})


if __name__ == "__main__":
    main()

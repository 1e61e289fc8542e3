"""RL libraries' recurrent training passes against rnnkern's integrations
(rnnkern.integrations.sb3 and .torchrl; docs/rl.md).

    python -m bench.rl                    # the full grid (a few minutes), JSON under bench/results/
    python -m bench.rl --quick            # tiny sizes, a smoke test (seconds)
    python -m bench.rl --threads 1 --out rl.json

What it measures, forward + backward (the gradients of the features, the
initial state and every weight), T=128 steps per sequence, 5% episode starts,
n_envs x hidden in {8, 64} x {64, 256} (64 input features):

  (a) sb3 loop, torch.nn   sb3-contrib's RecurrentActorCriticPolicy._process_sequence:
                           one torch.nn.LSTM call per step, the state masked by
                           (1 - episode_start)
  (b) sb3 loop, rnnkern    the same loop on the LSTM converted by rnnkern.convert
  (c) rnnkern fused        rnnkern.integrations.sb3's one call with resets=episode_starts
  (d) learn                RecurrentPPO('MlpLstmPolicy', 'CartPole-v1').learn() end to
                           end, unaccelerated against accelerated (alternating rounds,
                           same seed; rollouts step one env step at a time, so only the
                           training passes change)
  (e) torchrl              LSTMModule in recurrent mode on a [B, T] batch with is_init:
                           torchrl's split-and-pad against rnnkern.integrations.torchrl
  (f) rollout step         the action step of collection: _process_sequence at T=1
                           under no_grad, (a)-(c)'s three candidates, 5% of the envs
                           (at least one) starting an episode at that step

Before any timing each pair must agree in float64 (outputs, states and every
gradient, to 1e-10); (d) records how far the two runs' final parameters drift
apart (float32).  Timed as the main suite times (bench/timing.py): interleaved
rounds, medians.  Results: a table on stdout and JSON (--out).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import re
import time
from pathlib import Path

import torch

import rnnkern
from rnnkern.check.probe import cpu_model

from . import report, timing

TOLERANCE = 1e-10  # float64 agreement: outputs, states and every gradient
RESULTS = Path(__file__).resolve().parent / "results"
SEQ = ("sb3 loop, torch.nn", "sb3 loop, rnnkern", "rnnkern fused")
TRL = ("torchrl split-and-pad", "rnnkern resets")


# ------------------------------------------------------ (a)-(c) sb3's loop ----

def sb3_inputs(n_envs: int, T: int, F: int, H: int, fraction: float, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(n_envs * T, F, generator=g, dtype=dtype, requires_grad=True)
    states = tuple(torch.randn(1, n_envs, H, generator=g, dtype=dtype, requires_grad=True)
                   for _ in range(2))
    starts = (torch.rand(n_envs * T, generator=g) < fraction).to(dtype)
    cot = torch.randn(n_envs * T, H, generator=g, dtype=dtype)
    return features, states, starts, cot


def sb3_lstms(F: int, H: int, dtype, seed: int):
    torch.manual_seed(seed)
    plain = torch.nn.LSTM(F, H).to(dtype)
    return plain, rnnkern.convert(copy.deepcopy(plain))


def sb3_candidates(plain, converted, grad: bool = True):
    """(a)-(c): sb3-contrib's loop on each LSTM and the integration's call.  With
    ``grad``, forward + backward on (features, states, starts, cotangent);
    without, the forward alone under no_grad on (features, states, starts), as
    sb3-contrib's predict runs during collection."""
    from sb3_contrib.common.recurrent.policies import RecurrentActorCriticPolicy

    from rnnkern.integrations.sb3 import fused_process_sequence
    loop = RecurrentActorCriticPolicy._process_sequence

    def fb(fn, lstm):
        def run(inputs):
            if not grad:
                with torch.no_grad():
                    out, (h, c) = fn(*inputs, lstm)
                return [out, h, c]
            features, states, starts, cot = inputs
            out, (h, c) = fn(features, states, starts, lstm)
            loss = (out * cot).sum() + h.sum() + c.sum()
            return [out, h, c, *torch.autograd.grad(loss, [features, *states, *lstm.parameters()])]
        return run
    return {SEQ[0]: fb(loop, plain), SEQ[1]: fb(loop, converted),
            SEQ[2]: fb(fused_process_sequence, converted)}


def difference(got, want) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, want))


def timed(fns: dict, pool, rounds: int, budget_s: float) -> dict:
    device = torch.device("cpu")
    plans = {}
    for name, fn in fns.items():
        est = timing.estimate(fn, pool, device, timing.wall_time(lambda: fn(pool[0]), device))
        plans[name] = timing.plan(est, rounds, round_target_s=0.2, budget_s=budget_s,
                                  min_rounds=min(3, rounds))
    samples = timing.interleaved(fns, pool, plans, device)
    return {n: timing.summarize(s) for n, s in samples.items()}


def refuse(what: str, worst: float):
    raise SystemExit(f"bench.rl: {what} differ by {worst:.3g} in float64 (> {TOLERANCE}); "
                     f"not timing a wrong answer")


def agree_then_time(what: str, candidates, inputs, F: int, H: int, rounds: int,
                    budget_s: float, seed: int):
    """``candidates(plain, converted)``' calls on ``inputs(dtype, seed)``: each
    within TOLERANCE of sb3-contrib's loop in float64 (else refused), then timed
    in float32 over a pool of two input sets.  Returns (agreement, pool, stats)."""
    fns = candidates(*sb3_lstms(F, H, torch.float64, seed))
    case = inputs(torch.float64, seed)
    want = fns[SEQ[0]](case)
    agree = {n: difference(fns[n](case), want) for n in SEQ[1:]}
    for n, worst in agree.items():
        if not worst <= TOLERANCE:
            refuse(f"{what}: {n!r} and sb3-contrib's loop", worst)
    fns = candidates(*sb3_lstms(F, H, torch.float32, seed))
    pool = [inputs(torch.float32, seed + i) for i in range(2)]
    return agree, pool, timed(fns, pool, rounds, budget_s)


def measure_sb3(n_envs: int, H: int, T: int, F: int, fraction: float, rounds: int,
                budget_s: float, seed: int = 0) -> dict:
    agree, pool, stats = agree_then_time(
        f"sb3 n_envs={n_envs} H={H}", sb3_candidates,
        lambda dtype, s: sb3_inputs(n_envs, T, F, H, fraction, dtype, s),
        F, H, rounds, budget_s, seed)
    ms = {n: 1e3 * stats[n]["median_s"] for n in SEQ}
    return {"n_envs": n_envs, "hidden": H, "T": T, "features": F, "start_fraction": fraction,
            "episode_starts": int(pool[0][2].sum()), "float64_max_difference": agree,
            "median_ms": ms, "speedup_vs_torch_nn_loop": {n: ms[SEQ[0]] / ms[n] for n in SEQ[1:]},
            "stats_s": stats}


# ------------------------------------------------------ (f) rollout step ----

def rollout_inputs(n_envs: int, F: int, H: int, fraction: float, dtype, seed: int):
    """One collection step: features [n_envs, F], the carried state, and float
    episode starts in max(1, fraction * n_envs) rows (a step without any start
    is the plain one-step call: docs/rl.md)."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(n_envs, F, generator=g, dtype=dtype)
    states = tuple(torch.randn(1, n_envs, H, generator=g, dtype=dtype) for _ in range(2))
    starts = torch.zeros(n_envs, dtype=dtype)
    starts[torch.randperm(n_envs, generator=g)[:max(1, round(fraction * n_envs))]] = 1.0
    return features, states, starts


def measure_rollout(n_envs: int, H: int, F: int, fraction: float, rounds: int,
                    budget_s: float, seed: int = 0) -> dict:
    agree, pool, stats = agree_then_time(
        f"rollout step n_envs={n_envs} H={H}", lambda *lstms: sb3_candidates(*lstms, grad=False),
        lambda dtype, s: rollout_inputs(n_envs, F, H, fraction, dtype, s),
        F, H, rounds, budget_s, seed)
    us = {n: 1e6 * stats[n]["median_s"] for n in SEQ}
    return {"n_envs": n_envs, "hidden": H, "T": 1, "features": F, "grad": False,
            "episode_starts": int(pool[0][2].sum()), "float64_max_difference": agree,
            "median_us": us, "speedup_vs_torch_nn_loop": {n: us[SEQ[0]] / us[n] for n in SEQ[1:]},
            "stats_s": stats}


# ---------------------------------------------------------- (d) learn() ----

def learn_once(accelerated: bool, n_steps: int, total: int, seed: int = 0):
    from sb3_contrib import RecurrentPPO

    from rnnkern.integrations.sb3 import accelerate
    model = RecurrentPPO("MlpLstmPolicy", "CartPole-v1", n_steps=n_steps, batch_size=n_steps,
                         n_epochs=4, seed=seed, device="cpu")
    if accelerated:
        accelerate(model)
    t0 = time.perf_counter()
    model.learn(total)
    return time.perf_counter() - t0, model.policy.state_dict()


def measure_learn(n_steps: int, total: int, rounds: int) -> dict:
    names = ("RecurrentPPO, torch.nn", "RecurrentPPO, accelerated")
    samples = {n: [] for n in names}
    params = {}
    for accelerated in (False, True):  # untimed: imports, the environment's and kernels' first calls
        learn_once(accelerated, n_steps, n_steps)
    for r in range(rounds):  # alternating, the first one first on odd rounds
        for accelerated in ((False, True) if r % 2 == 0 else (True, False)):
            s, state = learn_once(accelerated, n_steps, total)
            samples[names[accelerated]].append(s)
            params[names[accelerated]] = state
    a, b = params[names[0]], params[names[1]]
    drift = max(((a[k] - b[k]).abs() / a[k].abs().clamp_min(1e-3)).max().item() for k in a)
    stats = {n: timing.summarize(s) for n, s in samples.items()}
    sec = {n: stats[n]["median_s"] for n in names}
    return {"env": "CartPole-v1", "policy": "MlpLstmPolicy", "n_steps": n_steps, "total_timesteps": total,
            "n_epochs": 4, "rounds": rounds, "median_s": sec, "speedup": sec[names[0]] / sec[names[1]],
            "final_parameters_max_relative_difference_float32": drift, "stats_s": stats}


# --------------------------------------------------------- (e) torchrl ----

def torchrl_case(B: int, H: int, T: int, F: int, fraction: float, dtype, seed: int):
    from tensordict import TensorDict
    g = torch.Generator().manual_seed(seed)
    is_init = torch.rand(B, T, 1, generator=g) < fraction
    is_init[:, 0] = True
    states = {k: torch.randn(B, T, 1, H, generator=g, dtype=dtype)
              for k in ("recurrent_state_h", "recurrent_state_c")}
    for s in states.values():  # as a collector leaves them: the primer's zeros at resets
        s[:, 1:][is_init[:, 1:, 0]] = 0.0
    td = TensorDict({"obs": torch.randn(B, T, F, generator=g, dtype=dtype), "is_init": is_init,
                     **states}, [B, T])
    cot = torch.randn(B, T, H, generator=g, dtype=dtype)
    return td, cot


def torchrl_candidates(F: int, H: int, dtype, seed: int):
    from torchrl.modules import LSTMModule

    from rnnkern.integrations.torchrl import accelerate
    torch.manual_seed(seed)
    plain = LSTMModule(input_size=F, hidden_size=H, in_key="obs", out_key="feat",
                       default_recurrent_mode=True).to(dtype)
    fast = accelerate(copy.deepcopy(plain))

    def fb(module):
        def run(inputs):
            td, cot = inputs
            td = td.clone()
            x = td["obs"].requires_grad_()
            out = module(td)
            loss = (out["feat"] * cot).sum() + out["next", "recurrent_state_h"].sum() \
                + out["next", "recurrent_state_c"].sum()
            return [out["feat"], out["next", "recurrent_state_h"], out["next", "recurrent_state_c"],
                    *torch.autograd.grad(loss, [x, *module.parameters()])]
        return run
    return {TRL[0]: fb(plain), TRL[1]: fb(fast)}


def measure_torchrl(B: int, H: int, T: int, F: int, fraction: float, rounds: int,
                    budget_s: float, seed: int = 0) -> dict:
    fns = torchrl_candidates(F, H, torch.float64, seed)
    inputs = torchrl_case(B, H, T, F, fraction, torch.float64, seed)
    worst = difference(fns[TRL[1]](inputs), fns[TRL[0]](inputs))
    if not worst <= TOLERANCE:
        refuse(f"torchrl B={B} H={H}: the integration and torchrl's recurrent mode", worst)
    fns = torchrl_candidates(F, H, torch.float32, seed)
    pool = [torchrl_case(B, H, T, F, fraction, torch.float32, seed + i) for i in range(2)]
    stats = timed(fns, pool, rounds, budget_s)
    ms = {n: 1e3 * stats[n]["median_s"] for n in TRL}
    return {"B": B, "hidden": H, "T": T, "features": F, "is_init_fraction": fraction,
            "trajectories": int(pool[0][0]["is_init"].sum()), "float64_max_difference": worst,
            "median_ms": ms, "speedup": ms[TRL[0]] / ms[TRL[1]], "stats_s": stats}


# ------------------------------------------------------------------ main ----

def default_out() -> Path:
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    cpu = re.sub(r"[^a-z0-9]+", "-", cpu_model().lower()).strip("-") or "cpu"
    return RESULTS / f"rl-{stamp}-{cpu}.json"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.rl", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a smoke test: T=8, n_envs x hidden = 2 x 8, 25%% starts, a tiny learn(), 3 rounds")
    p.add_argument("--threads", type=int, default=None, help="default: torch's (one per core)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--out", type=Path, default=None,
                   help="the JSON (default: bench/results/rl-<date>-<cpu>.json)")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.quick:  # (25% starts: a few in so small a batch, so the loops do restart)
        T, F, grid, rounds, budget, fraction = 8, 4, [(2, 8)], 3, 2.0, 0.25
        learn = dict(n_steps=16, total=32, rounds=1)
    else:
        T, F, grid, rounds, budget, fraction = 128, 64, [(n, h) for n in (8, 64) for h in (64, 256)], \
            args.rounds, 10.0, 0.05
        learn = dict(n_steps=128, total=1024, rounds=3)
    out = args.out or default_out()
    import sb3_contrib
    import torchrl
    meta = report.study_meta("bench.rl", argv)
    meta.update(quick=args.quick, tolerance_float64=TOLERANCE)
    meta["versions"].update(sb3_contrib=sb3_contrib.__version__, torchrl=torchrl.__version__)
    print(f"bench.rl on {meta['cpu']}, {meta['threads']} thread(s), load average "
          f"{meta['load_average_at_start']}: forward + backward, float32, T={T}, "
          f"{100 * fraction:g}% episode starts", flush=True)
    doc = {"meta": meta, "sb3_sequence": [], "sb3_rollout_step": [], "sb3_learn": None,
           "torchrl": []}

    print("\n(a)-(c) sb3-contrib _process_sequence, ms (speedup over (a)); float64 agreement")
    print(f"{'n_envs':>6} {'hidden':>6} | {'(a) torch.nn loop':>18} {'(b) rnnkern loop':>18} "
          f"{'(c) fused':>18} | agreement", flush=True)
    for n_envs, H in grid:
        r = measure_sb3(n_envs, H, T, F, fraction, rounds, budget)
        doc["sb3_sequence"].append(r)
        ms, sp = r["median_ms"], r["speedup_vs_torch_nn_loop"]
        print(f"{n_envs:>6} {H:>6} | {ms[SEQ[0]]:>18.3g} {ms[SEQ[1]]:>10.3g} ({sp[SEQ[1]]:4.2f}x) "
              f"{ms[SEQ[2]]:>10.3g} ({sp[SEQ[2]]:4.2f}x) | "
              f"{max(r['float64_max_difference'].values()):.1e}", flush=True)

    print("\n(f) sb3-contrib rollout step (T=1, no_grad), us (speedup over (a)); float64 agreement")
    print(f"{'n_envs':>6} {'hidden':>6} | {'(a) torch.nn loop':>18} {'(b) rnnkern loop':>18} "
          f"{'(c) fused':>18} | agreement", flush=True)
    for n_envs, H in grid:
        r = measure_rollout(n_envs, H, F, fraction, rounds, budget / 4)
        doc["sb3_rollout_step"].append(r)
        us, sp = r["median_us"], r["speedup_vs_torch_nn_loop"]
        print(f"{n_envs:>6} {H:>6} | {us[SEQ[0]]:>18.3g} {us[SEQ[1]]:>10.3g} ({sp[SEQ[1]]:4.2f}x) "
              f"{us[SEQ[2]]:>10.3g} ({sp[SEQ[2]]:4.2f}x) | "
              f"{max(r['float64_max_difference'].values()):.1e}", flush=True)

    print("\n(e) torchrl LSTMModule recurrent mode, ms; float64 agreement")
    print(f"{'B':>6} {'hidden':>6} | {'split-and-pad':>14} {'rnnkern':>10} {'speedup':>8} | agreement")
    for B, H in grid:
        r = measure_torchrl(B, H, T, F, fraction, rounds, budget)
        doc["torchrl"].append(r)
        ms = r["median_ms"]
        print(f"{B:>6} {H:>6} | {ms[TRL[0]]:>14.3g} {ms[TRL[1]]:>10.3g} {r['speedup']:>7.2f}x | "
              f"{r['float64_max_difference']:.1e}", flush=True)

    r = doc["sb3_learn"] = measure_learn(**learn)
    sec = list(r["median_s"].values())
    print(f"\n(d) RecurrentPPO('MlpLstmPolicy', 'CartPole-v1').learn({learn['total']}), "
          f"n_steps={learn['n_steps']}, {learn['rounds']} round(s): torch.nn {sec[0]:.3g} s, "
          f"accelerated {sec[1]:.3g} s: {r['speedup']:.2f}x (final parameters within "
          f"{r['final_parameters_max_relative_difference_float32']:.1e} relative)", flush=True)

    print()
    report.write_study(out, doc)


if __name__ == "__main__":
    main()

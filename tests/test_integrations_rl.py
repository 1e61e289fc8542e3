"""rnnkern.integrations.sb3 and .torchrl against the libraries' own code paths,
and bench.rl's quick mode.  sb3-contrib, gymnasium and torchrl are in
requirements-dev.txt (CI installs them); without them the module is skipped."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sb3_contrib", reason="sb3-contrib is not installed (requirements-dev.txt)")
pytest.importorskip("gymnasium", reason="gymnasium is not installed (requirements-dev.txt)")

import gymnasium as gym  # noqa: E402
from sb3_contrib.common.recurrent.policies import RecurrentActorCriticPolicy  # noqa: E402

import rnnkern  # noqa: E402
from rnnkern.integrations import sb3 as rk_sb3  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"separate": dict(shared_lstm=False, enable_critic_lstm=True),
            "shared": dict(shared_lstm=True, enable_critic_lstm=False),
            "critic_without_lstm": dict(shared_lstm=False, enable_critic_lstm=False)}


def _policies(variant: str, layers: int = 1, dtype=torch.float64):
    torch.manual_seed(0)
    obs = gym.spaces.Box(-1.0, 1.0, (5,))
    theirs = RecurrentActorCriticPolicy(obs, gym.spaces.Discrete(3), lambda _: 3e-4,
                                        lstm_hidden_size=8, n_lstm_layers=layers,
                                        **VARIANTS[variant]).to(dtype)
    ours = rk_sb3.accelerate(copy.deepcopy(theirs))
    return theirs, ours


def _sequence_case(n_seq: int, T: int, F: int, H: int, layers: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(n_seq * T, F, generator=g, dtype=torch.float64)
    starts = (torch.rand(n_seq * T, generator=g) < 0.25).double()
    starts[0] = 1.0       # a start at position 0 of the first sequence...
    starts[T] = 0.0       # ...and a carried state entering the second
    states = tuple(torch.randn(layers, n_seq, H, generator=g, dtype=torch.float64)
                   for _ in range(2))
    cot = torch.randn(n_seq * T, H, generator=g, dtype=torch.float64)
    return features, states, starts, cot


def _run(policy, lstm_name, features, states, starts, cot):
    features = features.clone().requires_grad_()
    states = tuple(s.clone().requires_grad_() for s in states)
    lstm = getattr(policy, lstm_name)
    out, (h, c) = policy._process_sequence(features, states, starts, lstm)
    loss = (out * cot).sum() + (h * h).sum() + c.sum()
    params = list(lstm.parameters())
    grads = torch.autograd.grad(loss, [features, *states, *params])
    return [out, h, c, *grads]


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("T", [1, 7])
def test_sb3_process_sequence_matches_sb3_in_float64(variant, T, layers):
    theirs, ours = _policies(variant, layers)
    assert ours.lstm_actor.__class__ is rnnkern.LSTM
    assert (ours.lstm_critic is None) == (variant != "separate")
    assert "_process_sequence" not in vars(theirs)  # sb3-contrib's class is untouched
    names = ["lstm_actor"] + (["lstm_critic"] if variant == "separate" else [])
    for seed, name in enumerate(names):
        case = _sequence_case(n_seq=4, T=T, F=theirs.features_dim, H=8, layers=layers, seed=seed)
        want = _run(theirs, name, *case)
        got = _run(ours, name, *case)
        for a, b in zip(got, want):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_sb3_evaluate_actions_matches_sb3(variant):
    """The whole policy's training-time pass (actor and critic paths) and the
    gradient of every parameter.  float32: sb3's preprocessing casts the
    observations to float32, so this runs as training does; the tolerance is
    float32 reordering (a few ulps of values of order 1, summed over 18 rows)."""
    theirs, ours = _policies(variant, dtype=torch.float32)
    features, states, starts, _ = _sequence_case(3, 6, 5, 8, 1, seed=3)
    features, states, starts = features.float(), tuple(s.float() for s in states), starts.float()
    from sb3_contrib.common.recurrent.type_aliases import RNNStates
    actions = torch.randint(0, 3, (18,))
    results = []
    for policy in (theirs, ours):
        st = RNNStates(tuple(s.clone() for s in states), tuple(s.clone() + 1 for s in states))
        values, log_prob, entropy = policy.evaluate_actions(features.clone(), actions, st, starts)
        loss = (values.squeeze(-1) * torch.linspace(-1, 1, 18)).sum() \
            + log_prob.sum() + entropy.sum()
        results.append([values, log_prob, entropy,
                        *torch.autograd.grad(loss, list(policy.parameters()), allow_unused=True)])
    for a, b in zip(*results):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_sb3_accelerate_twice_and_rejects_other_models():
    theirs, ours = _policies("separate")
    assert rk_sb3.accelerate(ours) is ours
    with pytest.raises(TypeError, match="RecurrentPPO"):
        rk_sb3.accelerate(torch.nn.Linear(2, 2))


def _learn(accelerated: bool):
    from sb3_contrib import RecurrentPPO
    model = RecurrentPPO("MlpLstmPolicy", "CartPole-v1", n_steps=64, batch_size=64, n_epochs=1,
                         seed=0, device="cpu")
    if accelerated:
        rk_sb3.accelerate(model)
    model.learn(256)
    return model


def test_sb3_recurrent_ppo_learns_the_same():
    """Same seed, same environment steps and updates: the accelerated model's
    parameters after learn(256) equal the unaccelerated one's up to float32
    reordering.  Both compute the same function in float32, only summed in
    another order (rnnkern's fused kernels against torch.nn's per-step calls):
    each step differs by a few ulps (~1e-7 relative) and so do the gradients;
    Adam (lr 3e-4, eps 1e-5) turns a gradient's relative error into about the
    same relative error of a step of at most 3e-4, so four updates leave the
    parameters (of order 0.1-1) within ~1e-7 absolute; measured: 3e-8.  The
    tolerance, 1e-6 absolute + 1e-5 relative, leaves room for another CPU's
    summation order (AVX-512 against AVX2) and stays far below one update's
    step (~3e-4): a wrong reset changes the gradients themselves, and with
    them every parameter by a good part of a step."""
    plain, fast = _learn(False), _learn(True)
    assert isinstance(fast.policy.lstm_actor, rnnkern.LSTM)
    assert not isinstance(plain.policy.lstm_actor, rnnkern.LSTM)
    assert fast.num_timesteps == plain.num_timesteps == 256
    want, got = plain.policy.state_dict(), fast.policy.state_dict()
    assert want.keys() == got.keys()
    moved = max((want[k] - v).abs().max().item() for k, v in
                _learn_initial_state().items())
    assert moved > 1e-4  # learning changed the parameters (else the check below is empty)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def _learn_initial_state():
    from sb3_contrib import RecurrentPPO
    model = RecurrentPPO("MlpLstmPolicy", "CartPole-v1", n_steps=64, batch_size=64, n_epochs=1,
                         seed=0, device="cpu")
    return model.policy.state_dict()


# ----------------------------------------------------------------- torchrl ----

def _torchrl():
    pytest.importorskip("torchrl", reason="torchrl is not installed (requirements-dev.txt)")
    from tensordict import TensorDict
    from torchrl.modules import GRUModule, LSTMModule

    from rnnkern.integrations import torchrl as rk_trl
    return TensorDict, LSTMModule, GRUModule, rk_trl


def _torchrl_case(kind: str, seed: int, states: str = "primer", grad_states: bool = False):
    """A [4, 9] recurrent-mode batch: is_init at random places, at the first
    step of row 0 and mid-row in row 1; stored states as a collector leaves
    them ("primer": random at step 0, zeros at every later is_init, random
    elsewhere -- torchrl reads only the trajectory starts), "absent", or
    "nonzero" at the mid-row is_init too."""
    TensorDict, LSTMModule, GRUModule, rk_trl = _torchrl()
    B, T, F, H = 4, 9, 3, 6
    torch.manual_seed(seed)
    cls = LSTMModule if kind == "lstm" else GRUModule
    theirs = cls(input_size=F, hidden_size=H, in_key="obs", out_key="feat",
                 default_recurrent_mode=True).double()
    ours = rk_trl.accelerate(copy.deepcopy(theirs))
    g = torch.Generator().manual_seed(seed)
    is_init = torch.rand(B, T, 1, generator=g) < 0.2
    is_init[0, 0] = is_init[1, 4] = True
    is_init[2, 0] = False
    x = torch.randn(B, T, F, generator=g, dtype=torch.float64)
    data = {"obs": x, "is_init": is_init}
    n_states = 2 if kind == "lstm" else 1
    if states != "absent":
        for key in theirs.in_keys[1:1 + n_states]:
            s = torch.randn(B, T, 1, H, generator=g, dtype=torch.float64)
            if states == "primer":
                s[:, 1:][is_init[:, 1:, 0]] = 0.0
            data[key] = s
    cots = {key: torch.randn(B, T, *([1] if key != "feat" else []), H, generator=g,
                             dtype=torch.float64) for key in theirs.out_keys}
    return TensorDict(data, [B, T]), theirs, ours, cots, grad_states


def _torchrl_run(module, td, cots, grad_states):
    td = td.clone()
    leaves = {"obs": td["obs"].requires_grad_()}
    if grad_states:
        for key in module.in_keys[1:-1]:
            if key in td.keys():
                leaves[key] = td[key].requires_grad_()
    out = module(td)
    loss = sum((out[k] * c).sum() for k, c in cots.items())
    params = list(module.parameters())
    grads = torch.autograd.grad(loss, [*leaves.values(), *params])
    return out, list(grads)



def _assert_runs_agree(ours, theirs, td, cots, grad_states):
    """Every output key and every gradient of ``ours`` within 1e-12 of torchrl's."""
    want, want_grads = _torchrl_run(theirs, td, cots, grad_states)
    got, got_grads = _torchrl_run(ours, td, cots, grad_states)
    for key in want.keys(True, True):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12, msg=str(key))
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)

@pytest.mark.parametrize("states", ["primer", "absent", "nonzero"])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_torchrl_recurrent_mode_matches_torchrl_in_float64(kind, states):
    td, theirs, ours, cots, grad_states = _torchrl_case(kind, seed=1, states=states)
    want, want_grads = _torchrl_run(theirs, td, cots, grad_states)
    got, got_grads = _torchrl_run(ours, td, cots, grad_states)
    assert sorted(got.keys(True, True), key=str) == sorted(want.keys(True, True), key=str)
    assert ours.in_keys == theirs.in_keys and ours.out_keys == theirs.out_keys
    for key in want.keys(True, True):
        assert got[key].shape == want[key].shape and got[key].dtype == want[key].dtype, key
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12, msg=str(key))
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_torchrl_fast_path_is_one_call_without_split_and_pad(kind, monkeypatch):
    """The cases above that the fast path serves never reach torchrl's forward."""
    td, theirs, ours, cots, _ = _torchrl_case(kind, seed=2)
    want, want_grads = _torchrl_run(theirs, td, cots, False)
    _, LSTMModule, GRUModule, _ = _torchrl()

    def refuse(self, tensordict):
        raise AssertionError("torchrl's own recurrent path ran")
    monkeypatch.setattr(LSTMModule if kind == "lstm" else GRUModule, "forward", refuse)
    got, got_grads = _torchrl_run(ours, td, cots, False)
    torch.testing.assert_close(got["feat"], want["feat"], rtol=0, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_torchrl_stored_states_with_grad(kind):
    """Gradients of the stored states: torchrl differentiates the state stored
    at every trajectory start, so with mid-row resets the module falls back to
    torchrl's path (the same numbers); without them, the fast path's gradient
    of step 0's state is torchrl's."""
    td, theirs, ours, cots, _ = _torchrl_case(kind, seed=3)
    for case in (td, td.clone().set("is_init", torch.zeros_like(td["is_init"]))):
        _assert_runs_agree(ours, theirs, case, cots, True)


@pytest.mark.parametrize("how", ["convert", "patch"])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_torchrl_accelerate_a_module_already_on_rnnkern(kind, how):
    """A module whose RNN is rnnkern's already (the whole model converted, or
    built under rnnkern.patch()) is accelerated like one holding torch.nn's,
    not refused as python_based."""
    td, theirs, _, cots, _ = _torchrl_case(kind, seed=4)
    _, LSTMModule, GRUModule, rk_trl = _torchrl()
    if how == "convert":
        ours = rnnkern.convert(copy.deepcopy(theirs))
    else:
        cls = LSTMModule if kind == "lstm" else GRUModule
        with rnnkern.patch():
            ours = cls(input_size=3, hidden_size=6, in_key="obs", out_key="feat",
                       default_recurrent_mode=True).double()
        ours.load_state_dict(theirs.state_dict())
    assert isinstance(ours.lstm if kind == "lstm" else ours.gru, rnnkern.LSTM if kind == "lstm" else rnnkern.GRU)
    assert rk_trl.accelerate(ours) is ours and type(ours).__name__.startswith("Accelerated")
    _assert_runs_agree(ours, theirs, td, cots, False)


def test_torchrl_sequential_mode_and_accelerate_errors():
    TensorDict, LSTMModule, GRUModule, rk_trl = _torchrl()
    from torchrl.modules import set_recurrent_mode
    torch.manual_seed(0)
    theirs = LSTMModule(input_size=3, hidden_size=4, in_key="obs", out_key="feat").double()
    ours = rk_trl.accelerate(copy.deepcopy(theirs))
    assert isinstance(ours, LSTMModule) and isinstance(ours.lstm, rnnkern.LSTM)
    assert rk_trl.accelerate(ours) is ours
    td = TensorDict({"obs": torch.randn(5, 3, dtype=torch.float64),
                     "is_init": torch.tensor([[True], [False], [True], [False], [False]]),
                     "recurrent_state_h": torch.randn(5, 1, 4, dtype=torch.float64),
                     "recurrent_state_c": torch.randn(5, 1, 4, dtype=torch.float64)}, [5])
    with set_recurrent_mode(False):
        want, got = theirs(td.clone()), ours(td.clone())
    for key in want.keys(True, True):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12)
    with set_recurrent_mode(True):  # the one-call path keeps torch.nn's input errors
        bad = TensorDict({"obs": torch.randn(2, 5, 2, dtype=torch.float64),
                          "is_init": torch.zeros(2, 5, 1, dtype=torch.bool)}, [2, 5])
        for module in (theirs, ours):
            with pytest.raises(RuntimeError, match="input.size.-1. must be equal to input_size"):
                module(bad)
    with pytest.raises(TypeError, match="no torchrl"):
        rk_trl.accelerate(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="python_based"):
        rk_trl.accelerate(LSTMModule(input_size=3, hidden_size=4, in_key="obs", out_key="feat",
                                     python_based=True))


# ------------------------------------------------------------- bench.rl ----

def test_rl_bench_quick_checks_agreement_then_times(tmp_path):
    """`python -m bench.rl --quick`: float64 agreement of every pair first, then
    interleaved times; the JSON's keys and figures."""
    _torchrl()
    out = tmp_path / "rl.json"
    proc = subprocess.run([sys.executable, "-m", "bench.rl", "--quick", "--threads", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(c) fused" in proc.stdout and f"results: {out}" in proc.stdout
    doc = json.loads(out.read_text())
    assert set(doc) == {"meta", "sb3_sequence", "sb3_rollout_step", "sb3_learn", "torchrl"}
    meta = doc["meta"]
    assert meta["quick"] and meta["threads"] == 1 and "isa" in meta and meta["cpu"]
    assert {"load_average_at_start", "load_average_at_end", "git", "versions"} <= set(meta)
    names = ["sb3 loop, torch.nn", "sb3 loop, rnnkern", "rnnkern fused"]
    [seq] = doc["sb3_sequence"]
    assert (seq["n_envs"], seq["hidden"], seq["T"]) == (2, 8, 8) and seq["episode_starts"] >= 1
    assert set(seq["float64_max_difference"]) == set(names[1:])
    assert all(0 <= d <= 1e-10 for d in seq["float64_max_difference"].values())
    assert list(seq["median_ms"]) == names and all(v > 0 for v in seq["median_ms"].values())
    [step] = doc["sb3_rollout_step"]
    assert (step["n_envs"], step["hidden"], step["T"]) == (2, 8, 1) and step["episode_starts"] >= 1
    assert all(0 <= d <= 1e-10 for d in step["float64_max_difference"].values())
    assert list(step["median_us"]) == names and all(v > 0 for v in step["median_us"].values())
    [trl] = doc["torchrl"]
    assert 0 <= trl["float64_max_difference"] <= 1e-10 and trl["trajectories"] > trl["B"]
    assert all(v > 0 for v in trl["median_ms"].values()) and trl["speedup"] > 0
    learn = doc["sb3_learn"]
    assert learn["total_timesteps"] == 32 and learn["speedup"] > 0
    # float32 reordering only (see test_sb3_recurrent_ppo_learns_the_same)
    assert learn["final_parameters_max_relative_difference_float32"] < 1e-3


def test_rl_bench_refuses_to_time_a_wrong_answer(monkeypatch):
    _torchrl()
    from bench import rl

    from rnnkern.integrations import sb3 as rk
    right = rk.fused_process_sequence

    def off_by_a_millionth(*args):
        out, states = right(*args)
        return out * (1 + 1e-6), states
    monkeypatch.setattr(rk, "fused_process_sequence", off_by_a_millionth)
    with pytest.raises(SystemExit, match="differ by"):
        rl.measure_sb3(2, 8, 6, 4, 0.3, rounds=1, budget_s=1.0)

"""The reset rule as reinforcement-learning code writes it: where an episode
starts, the state entering that step is the reset state -- zeros, or a learned
``reset_state=`` -- at every position, 0 included (where it replaces hx).

sb3-contrib's RecurrentPPO (``_process_sequence``), cleanrl's LSTM PPO and
torchrl's primer all step their recurrent module one position at a time and
multiply the state by ``(1 - episode_start)`` before each step.  Here that loop
is the truth (each step computed from the cell formulas, tests/options_truth.py's
loop_module): outputs, final states and the gradients of the input, hx, the
reset state and every parameter agree in float64 on every backend, for a chunk
that starts mid-episode with a carried random hx and has episode starts at
random positions, position 0 in some rows.  The bidirectional, variable-length
and packed forms are held to the episodes run separately
(options_truth.run_episodes_separately, which takes the reset state too).
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import rnnkern
from rnnkern import ops
from conftest import assert_close, generator, randn
from options_truth import (BACKENDS, compare, flat, hx_arg, loop_module, make_module,
                                  raises_unsupported, run_episodes_separately, state_leaves,
                                  used, values_and_grads)

T, B, I, H = 7, 4, 3, 4  # (I, H: make_module's sizes)
CELLS = ["lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_ln"]
#: The Triton interpreter takes seconds per call: two cells there.
CASES = [(b, c) for b in BACKENDS for c in CELLS if b != "triton" or c in ("lstm", "gru")]
IDS = [f"{c}-{b}" for b, c in CASES]


def episode_starts(key, rows_starting_at_0=(0,)) -> torch.Tensor:
    """[T, B] float 0/1, as sb3-contrib keeps its episode starts: ~30% starts,
    position 0 a start in the given rows only (the others carry hx in)."""
    g = generator("starts", *key)
    starts = (torch.rand(T, B, generator=g) < 0.3).double()
    starts[0] = 0.0
    for b in rows_starting_at_0:
        starts[0, b] = 1.0
    starts[3, 1] = 1.0
    return starts


def masking_loop(m, x, hx, starts, reset_state):
    """The RL user's loop: per step, ``state = (1 - start) * state + start *
    reset``, then one step of ``m``'s function (every layer's state is reset)."""
    state = list(hx)
    reset = reset_state if reset_state is not None else tuple(torch.zeros_like(h) for h in hx)
    outs = []
    for t in range(x.shape[0]):
        s = starts[t].view(1, -1, 1)
        state = [(1 - s) * h + s * r for h, r in zip(state, reset)]
        out, *state = loop_module(m, x[t:t + 1], tuple(state))
        outs.append(out)
    return [torch.cat(outs), *state]


def labels_of(m, hx, learned):
    n = len(hx)
    return (["output", "h_n", "c_n"][:n + 1] + ["grad input"] + [f"grad hx[{i}]" for i in range(n)]
            + ([f"grad reset_state[{i}]" for i in range(n)] if learned else [])
            + [f"grad {name}" for name, _ in m.named_parameters()])


@pytest.mark.parametrize("learned", [False, True], ids=["zeros", "learned"])
@pytest.mark.parametrize("backend,cell", CASES, ids=IDS)
def test_equals_the_rl_masking_loop(backend, cell, learned):
    key = ("rl-loop", cell, learned)
    m = make_module(cell, backend, num_layers=2)
    g = generator(*key)
    x = randn(g, T, B, I, requires_grad=True)
    hx = state_leaves(m, B, key)
    reset_state = tuple(randn(g, *h.shape, scale=0.5, requires_grad=True) for h in hx) \
        if learned else None
    starts = episode_starts(key)

    def ours():
        return flat(m(x, hx_arg(hx), resets=starts, reset_state=hx_arg(reset_state)))

    if raises_unsupported(backend, used(cell, "resets"), ours):
        return
    leaves = [x, *hx, *(reset_state or ()), *m.parameters()]
    got = values_and_grads(ours(), leaves, key)
    want = values_and_grads(masking_loop(m, x, hx, starts, reset_state), leaves, key)
    compare(got, want, labels_of(m, hx, learned), f"{backend} {cell}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bidirectional_lengths_packed_with_a_learned_reset_state(backend):
    """Two layers, bidirectional, variable lengths, padded and packed: the
    episodes run separately, each from hx or the learned reset state."""
    cell = "gru" if backend == "triton" else "lstm"
    key = ("bidir-learned", cell)
    m = make_module(cell, backend, num_layers=2, bidirectional=True)
    g = generator(*key)
    x = randn(g, T, B, I, requires_grad=True)
    hx = state_leaves(m, B, key)
    reset_state = tuple(randn(g, *h.shape, scale=0.5, requires_grad=True) for h in hx)
    starts = episode_starts(key, rows_starting_at_0=(0, 2)) > 0
    lengths = [T, 4, T - 1, 2]
    want = None
    leaves = [x, *hx, *reset_state, *m.parameters()]
    for form in ("lengths", "packed"):
        def ours():
            if form == "packed":
                packed = pack_padded_sequence(x, torch.tensor(lengths), enforce_sorted=False)
                out, hidden = m(packed, hx_arg(hx), resets=starts, reset_state=hx_arg(reset_state))
                assert isinstance(out, PackedSequence)
                return flat((pad_packed_sequence(out, total_length=T)[0], hidden))
            return flat(m(x, hx_arg(hx), lengths=torch.tensor(lengths), resets=starts,
                          reset_state=hx_arg(reset_state)))

        if raises_unsupported(backend, used(cell, "resets"), ours):
            return
        got = values_and_grads(ours(), leaves, key)
        if want is None:
            want = values_and_grads(run_episodes_separately(m, x, starts, lengths, hx,
                                                            reset_state=reset_state), leaves, key)
        compare(got, want, labels_of(m, hx, True), f"{backend} {form}")


@pytest.mark.parametrize("zoneout", [0.0, 0.3], ids=["plain", "zoneout"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_of_every_kind_in_one_batch(backend, zoneout):
    """Rows of every kind in one call: a row that never restarts, one
    restarting at its first step and later, early, late, only past its length,
    twice in a row; with lengths, two layers, a learned reset state, and
    evaluation-mode zoneout (its mask broadcast along the rows)."""
    cell = "gru" if backend == "triton" else "lstm"
    key = ("rows-of-every-kind", cell, zoneout)
    Tk, Bk = 9, 6
    m = make_module(cell, backend, num_layers=2, zoneout=zoneout).eval()
    g = generator(*key)
    x = randn(g, Tk, Bk, I, requires_grad=True)
    hx = state_leaves(m, Bk, key)
    reset_state = tuple(randn(g, *h.shape, scale=0.5, requires_grad=True) for h in hx)
    starts = torch.zeros(Tk, Bk, dtype=torch.bool)
    for t, b in [(0, 1), (5, 1), (1, 2), (6, 3), (7, 4), (2, 5), (3, 5)]:
        starts[t, b] = True
    lengths = [Tk, 8, Tk, 7, 5, Tk]  # row 4's start lies past its length

    def ours():
        return flat(m(x, hx_arg(hx), lengths=torch.tensor(lengths), resets=starts,
                      reset_state=hx_arg(reset_state)))

    if raises_unsupported(backend, used(cell, "resets", *(["zoneout"] if zoneout else [])), ours):
        return
    leaves = [x, *hx, *reset_state, *m.parameters()]
    got = values_and_grads(ours(), leaves, key)
    want = values_and_grads(run_episodes_separately(m, x, starts, lengths, hx, p=zoneout,
                                                    reset_state=reset_state), leaves, key)
    compare(got, want, labels_of(m, hx, True), f"{backend} {cell}")


def test_gradients_follow_the_rule():
    """hx gets its gradient only from position 0 without a reset there, the
    reset state from every step that restarted from it: with a start at
    position 0 in every row hx's gradient is exactly zero; without any start
    the reset state's is."""
    m = make_module("lstm", "cpu", num_layers=2)
    g = generator("grad-rule")
    x = randn(g, T, B, I)
    hx = state_leaves(m, B, ("grad-rule",))
    reset_state = tuple(randn(g, *h.shape, scale=0.5, requires_grad=True) for h in hx)
    every = torch.zeros(T, B, dtype=torch.bool)
    every[0] = True
    every[4, 1] = True
    never = torch.zeros(T, B, dtype=torch.bool)
    for starts, zero, nonzero in ((every, hx, reset_state), (never, reset_state, hx)):
        out, (h, c) = m(x, hx, resets=starts, reset_state=reset_state)
        grads = torch.autograd.grad(out.sum() + h.sum() + c.sum(), [*zero, *nonzero],
                                    allow_unused=True)
        for gr in grads[:2]:
            assert gr is None or torch.count_nonzero(gr) == 0
        for gr in grads[2:]:
            assert gr is not None and torch.count_nonzero(gr) > 0


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_one_step_call_starts_from_the_reset_state(backend):
    """A one-step call (the fused step path) restarts the forward direction from
    the reset state where position 0 is a start, and keeps hx elsewhere."""
    m = make_module("gru", backend, num_layers=2)
    g = generator("one-step")
    x = randn(g, 1, B, I)
    hx = state_leaves(m, B, ("one-step",))[0].detach()
    reset = randn(g, *hx.shape, scale=0.5)
    starts = torch.tensor([[True, False, True, False]])
    got = flat(m(x, hx, resets=starts, reset_state=reset))
    want = loop_module(m, x, (torch.where(starts.view(1, B, 1), reset, hx),))
    compare(got, want, ["output", "h_n"])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_one_call_whatever_the_resets(backend, monkeypatch):
    """One recurrence call per layer whatever the resets: without hx (zeros
    both), with no start in any row, with a start at position 0 in every row,
    and with a carried hx and starts inside (the reset state is the op's own
    argument, not a second call)."""
    calls = []
    real = ops.run_recurrence
    monkeypatch.setattr(ops, "run_recurrence", lambda *a: calls.append(a) or real(*a))
    m = make_module("lstm", backend)
    g = generator("calls")
    x = randn(g, T, B, I)
    hx = tuple(h.detach() for h in state_leaves(m, B, ("calls",)))
    inside = torch.zeros(T, B, dtype=torch.bool)
    inside[3] = True
    at_zero = inside.clone()
    at_zero[0] = True
    for kwargs in ({"resets": inside}, {"hx": hx, "resets": torch.zeros(T, B)},
                   {"hx": hx, "resets": at_zero}, {"hx": hx, "resets": inside}):
        calls.clear()
        m(x, **kwargs)
        assert len(calls) == 1, (kwargs.keys(), len(calls))


def test_reset_state_broadcast_by_expand_trains_one_learned_state():
    """A learned initial state of batch 1, expanded to the batch (the reset
    state has hx's form), gets the gradient of every restart, summed."""
    m = make_module("gru", "cpu")
    g = generator("expand")
    x = randn(g, T, B, I)
    learned = randn(g, 1, 1, H, scale=0.5, requires_grad=True)
    starts = episode_starts(("expand",), rows_starting_at_0=(0, 1, 2, 3)) > 0
    out, h = m(x, resets=starts, reset_state=learned.expand(1, B, H))
    (out.sum() + h.sum()).backward()
    want = torch.autograd.grad(sum(t.sum() for t in masking_loop(
        m, x, (learned.expand(1, B, H).detach().clone(),), starts.double(),
        (learned.expand(1, B, H),))), learned)[0]
    assert_close(learned.grad, want, what="grad of the learned state")


@pytest.mark.parametrize("case,bad,exc,words", [
    ("not-a-tensor", lambda m, x, r: m(x, resets=r, reset_state=[[0.0]]), TypeError,
     ["reset_state", "Tensor", "list"]),
    ("shape", lambda m, x, r: m(x, resets=r, reset_state=(torch.zeros(2, 3, H), torch.zeros(2, 4, H))),
     ValueError, ["reset_state[0]", "[2, 4, 4]", "[2, 3, 4]"]),
    ("not-a-pair", lambda m, x, r: m(x, resets=r, reset_state=torch.zeros(2, 4, H)), TypeError,
     ["reset_state", "tuple (h, c)"]),
    ("dtype", lambda m, x, r: m(x, resets=r, reset_state=(torch.zeros(2, 4, H), torch.zeros(2, 4, H))),
     RuntimeError, ["reset_state[0]", "torch.float32", "torch.float64"]),
    ("device", lambda m, x, r: m(x, resets=r, reset_state=tuple(
        torch.zeros(2, 4, H, dtype=torch.float64, device="meta") for _ in range(2))),
     ValueError, ["reset_state[0]", "cpu", "meta"]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_reset_state_is_named_before_any_kernel(case, bad, exc, words, monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "run_recurrence", lambda *a: calls.append(a))
    monkeypatch.setattr(ops, "run_recurrence_with_reset_state", lambda *a: calls.append(a))
    m = make_module("lstm" if case != "not-a-tensor" else "gru", "reference", num_layers=2)
    x = randn(generator("bad-reset-state"), T, B, I)
    with pytest.raises(exc) as e:
        bad(m, x, torch.zeros(T, B, dtype=torch.bool))
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert calls == []


def test_compiled_matches_eager():
    """torch.compile(fullgraph=True) with resets and a learned reset state (the
    reset state an argument of the op, its first-step pick a graph op): the same
    numbers as eager."""
    torch._dynamo.reset()
    m = make_module("lstm", "cpu", num_layers=2)
    g = generator("compile-resets")
    x = randn(g, T, B, I)
    hx = tuple(h.detach() for h in state_leaves(m, B, ("compile-resets",)))
    reset_state = tuple(randn(g, *h.shape, scale=0.5, requires_grad=True) for h in hx)
    starts = episode_starts(("compile-resets",)) > 0
    with torch._dynamo.config.patch(allow_rnn=True):
        compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
        results = []
        for fn in (compiled, m):
            out = flat(fn(x, hx, resets=starts, reset_state=reset_state))
            grads = torch.autograd.grad(sum((o * o).sum() for o in out), [*reset_state, *m.parameters()])
            results.append(out + list(grads))
    torch._dynamo.reset()
    for i, (a, b) in enumerate(zip(*results)):
        assert_close(a, b, what=f"result {i}")


def test_trace_names_reset_state():
    """torch.jit.trace records torch.nn's forward, which has no resets: a clear error."""
    m = rnnkern.GRU(I, H, dtype=torch.float64)
    x = randn(generator("trace-reset"), T, B, I)
    with pytest.raises(NotImplementedError, match="reset_state"):
        torch.jit.trace(lambda x: m(x, resets=torch.zeros(T, B, dtype=torch.bool),
                                    reset_state=torch.zeros(1, B, H, dtype=torch.float64))[0], (x,))

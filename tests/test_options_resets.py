"""The ``resets=`` option of the sequence modules against the episodes run separately
(the truths and shared machinery: tests/options_truth.py)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import rnnkern
from rnnkern import ops
from conftest import assert_close, generator, randn
from options_truth import (B, BACKENDS, CELLS, FORMS, I, T, compare, flat, hx_arg, make_module,
                           raises_unsupported, reset_inputs, run_episodes_separately, state_leaves,
                           used, values_and_grads)


# ------------------------------------------------------------------ resets ----

#: The Triton interpreter takes seconds per module call: it runs a cover of the
#: matrix (every cell, form and layout at least once), the other backends all of it.
TRITON_RESET_CASES = [("lstm", "packed", True), ("gru", "lengths", False), ("rnn_tanh", "padded", True),
                      ("lstm_ln", "packed", False), ("lstm_ln", "lengths", True)]
RESET_CASES = [(b, c, f, bf) for b in BACKENDS for c in CELLS for f in FORMS for bf in (False, True)
               if b != "triton" or (c, f, bf) in TRITON_RESET_CASES]
RESET_IDS = [f"{c}-{f}-{'bf' if bf else 'tf'}-{b}" for b, c, f, bf in RESET_CASES]


@pytest.mark.parametrize("backend,cell,form,batch_first", RESET_CASES, ids=RESET_IDS)
def test_resets_equal_the_episodes_run_separately(backend, cell, form, batch_first):
    """Two layers, bidirectional: outputs, final states and the gradients of the
    input, hx and every parameter equal those of the episodes run separately."""
    key = (cell, form, batch_first)
    m = make_module(cell, backend, num_layers=2, bidirectional=True, batch_first=batch_first)
    x, resets, lengths = reset_inputs(key, batch_first)
    if form == "padded":
        lengths = [T] * B
    hx = state_leaves(m, B, key)

    def ours():
        if form == "packed":
            packed = pack_padded_sequence(x, torch.tensor(lengths), batch_first=batch_first,
                                          enforce_sorted=False)
            out, hidden = m(packed, hx_arg(hx), resets=resets)
            assert isinstance(out, PackedSequence)
            out = pad_packed_sequence(out, batch_first=batch_first, total_length=T)[0]
            return flat((out, hidden))
        kw = {"lengths": torch.tensor(lengths)} if form == "lengths" else {}
        return flat(m(x, hx_arg(hx), resets=resets, **kw))

    if raises_unsupported(backend, used(cell, "resets"), ours):
        return
    leaves = [x, *hx, *m.parameters()]
    got = values_and_grads(ours(), leaves, key)
    x_tm = x.transpose(0, 1) if batch_first else x
    r_tm = resets.t() if batch_first else resets
    want = run_episodes_separately(m, x_tm, r_tm, lengths, hx)
    if batch_first:
        want[0] = want[0].transpose(0, 1)
    want = values_and_grads(want, leaves, key)
    labels = ["output", "h_n", "c_n"][:len(hx) + 1] + ["grad input"] + \
        [f"grad hx[{i}]" for i in range(len(hx))] + [f"grad {n}" for n, _ in m.named_parameters()]
    compare(got, want, labels, f"{backend} {cell} {form}")


def reset_pattern(pattern: str, key) -> torch.Tensor:
    """[T, B] masks: a reset at the first step only, at every step, never, or at
    random (40%)."""
    if pattern == "random":
        return torch.rand(T, B, generator=generator("pattern", *key)) < 0.4
    resets = torch.full((T, B), pattern == "every", dtype=torch.bool)
    if pattern == "first":
        resets[0] = True
    return resets


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", ["first", "every", "never", "random"])
def test_reset_patterns_within_1e_12_of_torch_nn_on_the_episodes(backend, pattern):
    """The resets' criterion: float64 outputs, final states and the gradients of
    the input, hx and every parameter within 1e-12 of torch.nn run on the
    episodes separately, for resets at t=0 only, at every step, never, and at
    random; two layers, bidirectional, variable lengths."""
    cell = "gru" if backend == "triton" else "lstm"  # (the interpreter is slow: one cell)
    key = ("patterns", cell, pattern)
    m = make_module(cell, backend, num_layers=2, bidirectional=True)
    g = generator(*key)
    x = randn(g, T, B, I).requires_grad_()
    lengths = [T, 3, T - 2]
    resets = reset_pattern(pattern, key)
    hx = state_leaves(m, B, key)
    call = lambda: flat(m(x, hx_arg(hx), lengths=torch.tensor(lengths), resets=resets))  # noqa: E731
    if raises_unsupported(backend, used(cell, "resets"), call):
        return
    leaves = [x, *hx, *m.parameters()]
    got = values_and_grads(call(), leaves, key)
    want = values_and_grads(run_episodes_separately(m, x, resets, lengths, hx), leaves, key)
    labels = ["output", "h_n", "c_n"][:len(hx) + 1] + ["grad input"] + \
        [f"grad hx[{i}]" for i in range(len(hx))] + [f"grad {n}" for n, _ in m.named_parameters()]
    assert len(got) == len(want) == len(labels)
    for label, a, b in zip(labels, got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lambda msg: f"{pattern} {label}: {msg}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_hx", [True, False], ids=["hx", "no-hx"])
def test_reset_rule_in_both_directions_by_hand(backend, with_hx):
    """A ReLU RNN that sums its inputs (w_ih = w_hh = 1, no bias, H = 1),
    bidirectional, x = 1..5, a reset at position 2 (and, in row 1 of length 3,
    one at 4, past its end).  Forward: step 0 starts from hx, step 2 from the
    reset state (zeros).  Reverse: each row's last step starts from hx, step 1
    from zeros (the boundary lies between positions 1 and 2)."""
    m = rnnkern.RNN(1, 1, nonlinearity="relu", bias=False, bidirectional=True, backend=backend,
                    dtype=torch.float64)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(1.0)
    x = torch.tensor([1.0, 2, 3, 4, 5], dtype=torch.float64).view(5, 1, 1).repeat(1, 2, 1)
    resets = torch.zeros(5, 2, dtype=torch.bool)
    resets[2, :] = True
    resets[4, 1] = True
    h0 = torch.tensor([[10.0, 20.0], [100.0, 200.0]], dtype=torch.float64).unsqueeze(2)
    hx = h0 if with_hx else None
    call = lambda: m(x, hx, lengths=torch.tensor([5, 3]), resets=resets)  # noqa: E731
    if raises_unsupported(backend, ("resets",), call):
        return
    out, h_n = call()
    if with_hx:
        fwd = [[11, 13, 3, 7, 12], [21, 23, 3, 0, 0]]
        rev = [[3, 2, 112, 109, 105], [3, 2, 203, 0, 0]]
    else:
        fwd = [[1, 3, 3, 7, 12], [1, 3, 3, 0, 0]]
        rev = [[3, 2, 12, 9, 5], [3, 2, 3, 0, 0]]
    want = torch.tensor([fwd, rev], dtype=torch.float64).permute(2, 1, 0)  # [T, B, 2]
    assert_close(out, want, what="output")
    assert_close(h_n, torch.stack([want[[4, 2], [0, 1], 0], want[0, :, 1]]).unsqueeze(2), what="h_n")


def test_reverse_direction_gets_the_shifted_mask(monkeypatch):
    """What each (layer, direction) hands to the op: the mask as given forward,
    shifted by one position in reverse (rev[t] = resets[t + 1], rev[T-1] = False)."""
    seen = []
    real = ops.run_recurrence

    def spy(*args):
        seen.append((args[10], args[11]))  # reverse, resets
        return real(*args)

    monkeypatch.setattr(ops, "run_recurrence", spy)
    m = make_module("gru", "reference", num_layers=2, bidirectional=True)
    x, resets, _ = reset_inputs(("shift",), False)
    m(x, resets=resets)
    shifted = torch.cat([resets[1:], torch.zeros(1, B, dtype=torch.bool)])
    assert [reverse for reverse, _ in seen] == [False, True, False, True]
    for reverse, mask in seen:
        assert torch.equal(mask, shifted if reverse else resets)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", ["lstm", "lstm_ln"])
def test_resets_unbatched_equal_batch_of_one(backend, cell):
    m = make_module(cell, backend, num_layers=2, bidirectional=True)
    g = generator("unbatched-resets", cell)
    x = randn(g, T, I)
    resets = torch.rand(T, generator=g) < 0.4
    resets[3] = True
    hx = tuple(h.detach() for h in state_leaves(m, 1, ("unbatched", cell), unbatched=True))
    call = lambda: m(x, hx, resets=resets)  # noqa: E731
    if raises_unsupported(backend, used(cell, "resets"), call):
        return
    got = flat(call())
    want = flat(m(x.unsqueeze(1), tuple(h.unsqueeze(1) for h in hx), resets=resets.unsqueeze(1)))
    compare(got, [want[0].squeeze(1)] + [h.squeeze(1) for h in want[1:]], ["output", "h_n", "c_n"])


@pytest.mark.parametrize("layout", ["time-major", "batch_first", "unbatched"])
def test_reset_masks_as_rl_libraries_keep_them(layout):
    """bool, uint8 and floating 0/1 masks (sb3-contrib keeps episode starts as
    float), each with a trailing 1 too (torchrl's is_init is [B, T, 1]), give
    the results of the bool mask (reference backend: the conversion happens
    before any backend)."""
    m = make_module("gru", "reference", batch_first=layout == "batch_first")
    g = generator("mask-formats", layout)
    mask = torch.rand(T, B, generator=g) < 0.4
    mask[0, 0] = mask[3, 1] = True
    x = randn(g, T, B, I)
    if layout == "batch_first":
        x, mask = x.transpose(0, 1).contiguous(), mask.t().contiguous()
    elif layout == "unbatched":
        x, mask = x[:, 1], mask[:, 1]
    want = flat(m(x, resets=mask))
    assert not torch.equal(want[0], flat(m(x))[0])  # the mask matters here
    for dtype in (torch.bool, torch.uint8, torch.float32, torch.float64):
        for trailing in (False, True):
            r = mask.to(dtype)
            r = r.unsqueeze(-1) if trailing else r
            compare(flat(m(x, resets=r)), want, ["output", "h_n"], f"{dtype} trailing={trailing}")


def test_no_resets_and_all_false_resets_agree():
    """An all-False mask changes nothing (reference backend; the others are
    held to the reference by tests/test_options.py)."""
    m = make_module("lstm", "reference", num_layers=2, bidirectional=True)
    x, _, _ = reset_inputs(("all-false",), False)
    compare(flat(m(x, resets=torch.zeros(T, B, dtype=torch.bool))), flat(m(x)), ["output", "h_n", "c_n"])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32], ids=["bool", "float"])
@pytest.mark.parametrize("steps", [1, 40], ids=["one-step", "T=40"])
def test_a_mask_that_resets_nothing_is_dropped_on_the_host(backend, dtype, steps, monkeypatch):
    """A small CPU mask is read on the host (an RL rollout's step: the tensor
    ops of the check cost more than the step); one that resets nothing runs
    the call without resets -- the same bits, and no reset machinery (an
    all-zero reset state, a masked start) -- unless a reset state was given,
    which then still gets its (zero) gradient.  Masks beyond the host's size
    (T=40 x B=8: 320 entries) keep the tensor check and the same results."""
    m = make_module("lstm", backend, num_layers=2)
    g = generator("empty-mask", dtype, steps)
    Bm = 8
    x = randn(g, steps, Bm, I, requires_grad=True)
    hx = tuple(h.detach().requires_grad_() for h in state_leaves(m, Bm, ("empty-mask", steps)))
    calls = []
    for name in ("run_recurrence_with_reset_state", "run_recurrence", "run_step"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    leaves = [x, *hx, *m.parameters()]
    want = values_and_grads(flat(m(x, hx)), leaves, ("empty-mask",))
    plain = list(calls)
    calls.clear()
    got = values_and_grads(flat(m(x, hx, resets=torch.zeros(steps, Bm, dtype=dtype))), leaves,
                           ("empty-mask",))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    host = steps * Bm <= 256
    assert (calls == plain) == host, (calls, plain)
    reset_state = tuple(randn(g, *h.shape, requires_grad=True) for h in hx)
    out, (h, c) = m(x, hx, resets=torch.zeros(steps, Bm, dtype=dtype), reset_state=reset_state)
    grads = torch.autograd.grad(out.sum() + h.sum() + c.sum(), reset_state)
    assert all(gr is not None and torch.count_nonzero(gr) == 0 for gr in grads)


@pytest.mark.parametrize("steps", [7, 100], ids=["host", "tensor"])
def test_a_value_other_than_0_or_1_is_named_on_both_checks(steps):
    """The host's check of a small mask and the tensor check of a large one name
    the same value: the first (in the mask's own order) that is neither 0 nor 1."""
    assert (7 * B <= 256) and (100 * B > 256)
    m = make_module("gru", "reference")
    x = randn(generator("bad-value", steps), steps, B, I)
    resets = torch.zeros(steps, B)
    resets[steps - 2, 1], resets[steps - 1, 0] = 0.25, 2.0
    with pytest.raises(ValueError, match=r"resets must hold only 0 and 1 \(a torch.float32 mask\), got 0.25"):
        m(x, resets=resets)
    resets[steps - 2, 1] = float("nan")
    with pytest.raises(ValueError, match="got nan"):
        m(x, resets=resets)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resets_with_dropout_zoneout_training_reproduce_with_a_seed(backend):
    """Every option at once in training: a seeded call reproduces, another seed
    differs, and evaluation is deterministic."""
    m = make_module("gru", backend, num_layers=3, bidirectional=True, dropout=0.3, zoneout=0.2)
    x, resets, lengths = reset_inputs(("all-options",), False)

    def call(seed):
        torch.manual_seed(seed)
        return flat(m(x, resets=resets, lengths=torch.tensor(lengths)))

    if raises_unsupported(backend, ("resets", "zoneout"), lambda: call(0)):
        return
    m.train()
    first, again, other = call(1), call(1), call(2)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])
    m.eval()
    for a, b in zip(call(3), call(4)):
        assert torch.equal(a, b)

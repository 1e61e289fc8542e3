"""``zoneout=`` on every module and cell against the per-step truth
(tests/options_truth.py)."""

from __future__ import annotations

import pytest
import torch

import rnnkern
from rnnkern import ops, reference
from conftest import assert_close, generator, randn
from options_truth import (B, BACKENDS, CELL_CLASSES, H, I, T, cell_states, compare, flat, hx_arg,
                           loop_module, make_cell, make_module, raises_unsupported, reset_inputs,
                           state_leaves, used, values_and_grads)


# ----------------------------------------------------------------- zoneout ----

ZONEOUT_CASES = [("lstm", 0), ("lstm", 2), ("gru", 0), ("rnn_tanh", 0), ("lstm_ln", 0)]
ZONEOUT_IDS = [f"{c}-proj{p}" if p else c for c, p in ZONEOUT_CASES]


def zoneout_module(cell, proj, backend, p, **kwargs):
    extra = {"proj_size": proj} if proj else {}
    return make_module(cell, backend, num_layers=2, bidirectional=True, zoneout=p, **extra, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell,proj", ZONEOUT_CASES, ids=ZONEOUT_IDS)
def test_zoneout_eval_is_the_expectation(backend, cell, proj):
    """Evaluation: every step blends p * previous + (1 - p) * new (h and c), in
    every layer and direction, with lengths; against a per-step loop."""
    p = 0.3
    m = zoneout_module(cell, proj, backend, p).eval()
    x, _, lengths = reset_inputs(("zoneout-eval", cell, proj), False)
    hx = state_leaves(m, B, ("zoneout-eval", cell, proj))
    call = lambda: flat(m(x, hx_arg(hx), lengths=torch.tensor(lengths)))  # noqa: E731
    if raises_unsupported(backend, used(cell, "zoneout"), call):
        return
    leaves = [x, *hx, *m.parameters()]
    key = ("zoneout-eval", cell, proj)
    got = values_and_grads(call(), leaves, key)
    want = values_and_grads(loop_module(m, x, hx, lengths, p=p), leaves, key)
    labels = ["output", "h_n", "c_n"][:len(hx) + 1] + ["grad input"] + \
        [f"grad hx[{i}]" for i in range(len(hx))] + [f"grad {n}" for n, _ in m.named_parameters()]
    compare(got, want, labels, f"{backend} {cell}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell,proj", ZONEOUT_CASES, ids=ZONEOUT_IDS)
def test_zoneout_one_freezes_the_state(backend, cell, proj):
    """p = 1 in training: no unit ever updates, so every output is the last
    layer's h0 and the final states are hx."""
    m = zoneout_module(cell, proj, backend, 1.0).train()
    x, _, _ = reset_inputs(("zoneout-one", cell), False)
    hx = tuple(h.detach() for h in state_leaves(m, B, ("zoneout-one", cell)))
    call = lambda: flat(m(x, hx_arg(hx)))  # noqa: E731
    if raises_unsupported(backend, used(cell, "zoneout"), call):
        return
    out, *states = call()
    last = torch.cat([hx[0][-2], hx[0][-1]], 1)  # the last layer's two directions
    assert_close(out, last.expand(T, *last.shape), what="output")
    for got, want in zip(states, hx):
        assert_close(got, want, what="final state")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_zoneout_zero_is_no_zoneout(backend, cell, monkeypatch):
    """p = 0: no mask reaches the op, and the numbers are those of a module
    built without the keyword (training mode)."""
    m = make_module(cell, backend, num_layers=2, zoneout=0.0).train()
    plain = make_module(cell, backend, num_layers=2).train()
    plain.load_state_dict(m.state_dict())
    seen = []
    real = ops.run_recurrence
    monkeypatch.setattr(ops, "run_recurrence", lambda *a: seen.append(a[12]) or real(*a))
    x, _, _ = reset_inputs(("zoneout-zero", cell), False)
    for a, b in zip(flat(m(x)), flat(plain(x))):
        assert torch.equal(a, b)
    assert seen == [None] * 4


def capture_masks(monkeypatch):
    masks = []
    real = ops.run_recurrence

    def spy(*args):
        masks.append(args[12])
        return real(*args)

    monkeypatch.setattr(ops, "run_recurrence", spy)
    return masks


@pytest.mark.parametrize("cell,proj", ZONEOUT_CASES, ids=ZONEOUT_IDS)
def test_zoneout_training_masks(cell, proj, monkeypatch):
    """Training: one fresh Bernoulli mask per layer and direction, [T, B, Z]
    (Z = P + H for LSTMs, H otherwise), in the input's dtype, each unit 1
    (keep the previous value) with probability p; seeded runs draw the same
    masks.  Evaluation: p broadcast from one [Z] vector (strides (0, 0, 1))."""
    p, Tm, Bm = 0.3, 40, 16
    m = zoneout_module(cell, proj, "reference", p, hidden_size=6, input_size=2)
    masks = capture_masks(monkeypatch)
    x = randn(generator("mask-stats", cell), Tm, Bm, 2)
    torch.manual_seed(7)
    with torch.no_grad():
        m.train()(x)
    Z = (proj or 6) + 6 if cell.startswith("lstm") else 6
    assert len(masks) == 4
    n = Tm * Bm * Z
    for mask in masks:
        assert mask.shape == (Tm, Bm, Z) and mask.dtype == torch.float64
        assert set(mask.unique().tolist()) == {0.0, 1.0}
        assert abs(mask.mean().item() - p) < 5 * (p * (1 - p) / n) ** 0.5
    assert all(not torch.equal(masks[0], other) for other in masks[1:])
    first = list(masks)
    masks.clear()
    torch.manual_seed(7)
    with torch.no_grad():
        m(x)
    assert all(torch.equal(a, b) for a, b in zip(first, masks))
    masks.clear()
    with torch.no_grad():
        m.eval()(x)
    for mask in masks:
        assert mask.shape == (Tm, Bm, Z) and mask.stride() == (0, 0, 1)
        assert torch.equal(mask[0, 0], torch.full((Z,), p, dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zoneout_training_matches_the_masks(backend, monkeypatch):
    """Training with p = 0.5: each unit of each step either keeps its previous
    value or takes the plain update, as its mask says (one layer, checked
    against the reference recurrence fed the captured mask)."""
    m = make_module("lstm", backend, zoneout=0.5).train()
    masks = capture_masks(monkeypatch)
    x, _, _ = reset_inputs(("zoneout-train",), False)
    hx = tuple(h.detach() for h in state_leaves(m, B, ("zoneout-train",)))
    call = lambda: flat(m(x.detach(), hx))  # noqa: E731
    if raises_unsupported(backend, ("zoneout",), call):
        return
    torch.manual_seed(11)
    got = call()
    (mask,) = masks
    want = reference.layer("lstm", x.detach(), hx[0][0], hx[1][0], m.weight_ih_l0, m.weight_hh_l0,
                           m.bias_ih_l0, m.bias_hh_l0, zoneout=mask)
    compare(got, [want[0], want[1].unsqueeze(0), want[2].unsqueeze(0)], ["output", "h_n", "c_n"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", ["lstm", "gru", "lstm_ln"])
def test_module_and_cell_agree_in_eval_with_zoneout(backend, cell):
    """A cell sharing a one-layer module's weights, stepped in Python, gives
    the module's evaluation outputs with zoneout (the blend in the cell is the
    one the sequence kernels apply per step)."""
    p = 0.4
    m = make_module(cell, backend, zoneout=p).eval()
    cls = {"lstm": rnnkern.LSTMCell, "gru": rnnkern.GRUCell, "lstm_ln": rnnkern.LayerNormLSTMCell}[cell]
    c = cls(I, H, zoneout=p, backend=backend, dtype=torch.float64).eval()
    c.load_state_dict({k[:-3]: v for k, v in m.state_dict().items()})
    x, _, _ = reset_inputs(("module-cell", cell), False)
    hx = tuple(h.detach() for h in state_leaves(m, B, ("module-cell", cell)))
    if raises_unsupported(backend, used(cell, "zoneout"), lambda: m(x, hx_arg(hx))):
        return
    out, *states = flat(m(x, hx_arg(hx)))
    state = tuple(h[0] for h in hx)
    for t in range(T):
        state = c(x[t], hx_arg(state))
        state = state if isinstance(state, tuple) else (state,)
        assert_close(out[t], state[0], what=f"step {t}")
    for got, want in zip(states, state):
        assert_close(got[0], want, what="final state")


# ------------------------------------------------------------ zoneout, cells ----

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", CELL_CLASSES)
def test_cell_zoneout(backend, cls):
    """Cells: evaluation blends p * hx + (1 - p) * step (values and gradients);
    training with p = 1 returns hx; with p = 0.5 each unit is hx's or the
    step's, about half each, and a seeded call reproduces."""
    p = 0.35
    plain = make_cell(cls, backend)
    zoned = make_cell(cls, backend, zoneout=p)
    x = randn(generator("cell-zoneout", cls), B, I, requires_grad=True)
    hx = cell_states(cls, ("zoneout",))
    if raises_unsupported(backend, ("LayerNormLSTM",) if cls == "LayerNormLSTMCell" else (),
                          lambda: plain(x)):
        return

    def parts(r):
        return list(r) if isinstance(r, tuple) else [r]

    leaves = [x, *hx, *zoned.parameters()]
    got = values_and_grads(parts(zoned.eval()(x, hx_arg(hx))), leaves, (cls,))
    step = parts(torch.func.functional_call(plain, dict(zoned.named_parameters()), (x, hx_arg(hx))))
    want = values_and_grads([p * h + (1 - p) * s for h, s in zip(hx, step)], leaves, (cls,))
    compare(got, want, ["h", "c"][:len(hx)] + ["grad x"] + [f"grad hx[{i}]" for i in range(len(hx))]
            + [f"grad {n}" for n, _ in zoned.named_parameters()], cls)

    frozen = make_cell(cls, backend, zoneout=1.0).train()
    for a, b in zip(parts(frozen(x, hx_arg(hx))), hx):
        assert torch.equal(a, b)

    half = make_cell(cls, backend, zoneout=0.5).train()
    big_x = randn(generator("cell-zoneout-big", cls), 64, I)
    big_hx = tuple(h.detach() for h in cell_states(cls, ("big",), batch=64))
    torch.manual_seed(5)
    first = parts(half(big_x, hx_arg(big_hx)))
    torch.manual_seed(5)
    again = parts(half(big_x, hx_arg(big_hx)))
    plain_step = parts(plain(big_x, hx_arg(big_hx)))
    kept = 0
    for a, b, prev, new in zip(first, again, big_hx, plain_step):
        assert torch.equal(a, b)
        is_prev, is_new = a == prev, a == new
        assert (is_prev | is_new).all()
        kept += is_prev.sum().item()
    n = sum(t.numel() for t in first)
    assert abs(kept / n - 0.5) < 5 * (0.25 / n) ** 0.5

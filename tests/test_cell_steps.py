"""``cell_steps=True``: the LSTM recurrence's c_n is the cell state after every
step, [T, B, H] at the steps' time positions (zeros past a row's length), and
differentiable: what torchrl's next-state keys need (rnnkern.integrations.
torchrl) without recomputing the gates.

The truth is a loop over each row's own steps written from torch.nn.LSTM's
formulas, independent of rnnkern's reference: outputs, h_n, every step's c and the gradients of every input under
a random functional of all three agree in float64 on every backend, with
lengths, reverse, resets with a reset state, and the projection; its gradient
enters each step (not only the last), so a wrong step shows.
"""
from __future__ import annotations

import pytest
import torch

from rnnkern import ops
from conftest import assert_close, force_triton_path, generator, randn
from options_truth import BACKENDS

#: Triton three times: its in-kernel time loop, its spread kernels and its per-step kernels.
PATHS = [b for b in BACKENDS if b != "triton"] + ["triton:loop", "triton:spread", "triton:step"]

T, B, H = 6, 4, 5


def inputs(proj: int, key):
    g = generator("cell_steps", proj, *key)
    P = proj or H
    s = H ** -0.5
    a = dict(xproj=randn(g, T, B, 4 * H), h0=randn(g, B, P, scale=0.5),
             c0=randn(g, B, H, scale=0.5), w_hh=randn(g, 4 * H, P, scale=s),
             b_ih=randn(g, 4 * H, scale=s), b_hh=randn(g, 4 * H, scale=s),
             w_hr=randn(g, P, H, scale=s) if proj else None,
             reset_h=randn(g, B, P, scale=0.5), reset_c=randn(g, B, H, scale=0.5))
    return {k: v if v is None else v.requires_grad_() for k, v in a.items()}


def truth(a, lengths, reverse, resets):
    """Each row's steps in its own order, from the cell formulas: (output,
    h_n, c after every step), zeros past a row's length."""
    P = a["h0"].shape[1]
    out = [[torch.zeros(P, dtype=torch.float64) for _ in range(B)] for _ in range(T)]
    cs = [[torch.zeros(H, dtype=torch.float64) for _ in range(B)] for _ in range(T)]
    h_n, c_n = [], []
    for b in range(B):
        n = T if lengths is None else int(lengths[b])
        order = list(range(n))[::-1] if reverse else list(range(n))
        h, c = a["h0"][b:b + 1], a["c0"][b:b + 1]
        for k, p in enumerate(order):
            if resets is not None and k > 0 and bool(resets[p, b]):
                h, c = a["reset_h"][b:b + 1], a["reset_c"][b:b + 1]
            gates = a["xproj"][p, b:b + 1] + h @ a["w_hh"].t() + a["b_ih"] + a["b_hh"]
            i, f, gg, o = gates.chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(gg)
            h_full = torch.sigmoid(o) * torch.tanh(c)
            h = h_full @ a["w_hr"].t() if a["w_hr"] is not None else h_full
            out[p][b], cs[p][b] = h[0], c[0]
        h_n.append(h[0])
        c_n.append(c[0])
    return (torch.stack([torch.stack(r) for r in out]), torch.stack(h_n),
            torch.stack([torch.stack(r) for r in cs]))


def rnnkern_call(backend, a, lengths, reverse, resets):
    own = resets is not None
    out, h_n, c_steps = ops.recurrence(
        "lstm", a["xproj"], a["h0"], a["c0"], a["w_hh"], a["b_ih"], a["b_hh"], a["w_hr"], lengths,
        reverse, backend=backend, resets=resets, reset_h=a["reset_h"] if own else None,
        reset_c=a["reset_c"] if own else None, cell_steps=True)
    return out, h_n, c_steps


CASES = [("plain", None, False, False), ("lengths-reverse", (6, 3, 5, 1), True, False),
         ("resets", None, False, True), ("lengths-resets", (4, 6, 2, 5), False, True),
         ("reverse-resets", None, True, True)]


@pytest.mark.parametrize("proj", [0, 3], ids=["", "proj3"])
@pytest.mark.parametrize("name,lengths,reverse,with_resets", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("backend", PATHS)
def test_every_steps_cell_state_and_its_gradient_match_the_cell_loop(backend, name, lengths,
                                                                     reverse, with_resets, proj,
                                                                     monkeypatch):
    if backend.startswith("triton:"):
        backend, path = backend.split(":")
        force_triton_path(monkeypatch, path)
    key = (name, proj)
    a = inputs(proj, key)
    lengths = None if lengths is None else torch.tensor(lengths, dtype=torch.int64)
    g = generator("resets", *key)
    resets = (torch.rand(T, B, generator=g) < 0.35) if with_resets else None
    used = [k for k, v in a.items() if v is not None and (with_resets or not k.startswith("reset"))]
    want = truth(a, lengths, reverse, resets)
    got = rnnkern_call(backend, a, lengths, reverse, resets)
    cot = [randn(generator("cotangent", *key, i), *w.shape) for i, w in enumerate(want)]
    for what, x, y in zip(("output", "h_n", "c after every step"), got, want):
        assert x.shape == y.shape, (what, x.shape, y.shape)
        assert_close(x, y, what=f"{backend} {what}")
    g_want = torch.autograd.grad(sum((w * c).sum() for w, c in zip(want, cot)),
                                 [a[k] for k in used])
    g_got = torch.autograd.grad(sum((x * c).sum() for x, c in zip(got, cot)),
                                [a[k] for k in used])
    for k, x, y in zip(used, g_got, g_want):
        assert_close(x, y, what=f"{backend} grad of {k}")


@pytest.mark.parametrize("backend", PATHS[1:])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_zoneout_with_every_steps_cell_state_matches_the_reference(backend, reverse, monkeypatch):
    """With zoneout (and resets, lengths) the state after a step is the blend;
    every step's c is that blend and its gradient splits as the carry's does:
    the reference (which the zoneout tests hold to the RL user's loop) is the
    truth here."""
    if backend.startswith("triton:"):
        backend, path = backend.split(":")
        force_triton_path(monkeypatch, path)
    a = inputs(0, ("zoneout",))
    args = [a[k] for k in ("xproj", "h0", "c0", "w_hh", "b_ih", "b_hh")]
    g = generator("zoneout-masks", reverse)
    zoneout = (torch.rand(T, B, 2 * H, generator=g) < 0.3).double()
    resets = torch.rand(T, B, generator=g) < 0.3
    lengths = torch.tensor([6, 3, 5, 2], dtype=torch.int64)
    cot = [randn(g, T, B, H), randn(g, B, H), randn(g, T, B, H)]

    def run(name):
        out = ops.recurrence("lstm", *args, None, lengths, reverse, backend=name, resets=resets,
                             zoneout=zoneout, cell_steps=True)
        loss = sum((o * c).sum() for o, c in zip(out, cot))
        return list(out) + list(torch.autograd.grad(loss, args))

    for i, (x, y) in enumerate(zip(run(backend), run("reference"))):
        assert_close(x, y, what=f"{backend} result {i}")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_gradcheck_with_every_steps_cell_state(backend):
    a = inputs(0, ("gradcheck",))
    resets = torch.rand(T, B, generator=generator("gradcheck-resets")) < 0.3
    names = ["xproj", "h0", "c0", "w_hh", "b_ih", "reset_h", "reset_c"]

    def f(*t):
        d = dict(zip(names, t))
        out, h_n, c_steps = ops.recurrence("lstm", d["xproj"], d["h0"], d["c0"], d["w_hh"],
                                           d["b_ih"], None, None, None, False, backend=backend,
                                           resets=resets, reset_h=d["reset_h"],
                                           reset_c=d["reset_c"], cell_steps=True)
        return out, h_n, c_steps

    assert torch.autograd.gradcheck(f, [a[n] for n in names])
    assert torch.autograd.gradgradcheck(f, [a[n] for n in names])


def test_the_last_step_is_the_final_state_and_inference_matches():
    """Without lengths the forward direction's last row of c is c_n of a plain
    call; without grad (no workspace) the values are the same."""
    a = inputs(0, ("final",))
    args = [a[k] for k in ("xproj", "h0", "c0", "w_hh", "b_ih", "b_hh")]
    _, _, c_n = ops.recurrence("lstm", *args, backend="cpu")
    with torch.no_grad():
        _, _, c_steps = ops.recurrence("lstm", *args, backend="cpu", cell_steps=True)
    assert torch.equal(c_steps[-1], c_n.detach())
    _, _, c_steps_grad = ops.recurrence("lstm", *args, backend="cpu", cell_steps=True)
    assert torch.equal(c_steps, c_steps_grad.detach())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", ["gru", "rnn_tanh", "lstm_ln"])
def test_cell_steps_is_refused_for_other_cells(backend, cell):
    G = {"gru": 3, "rnn_tanh": 1, "lstm_ln": 4}[cell]
    xproj, h0 = torch.randn(3, 2, G * 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    c0 = torch.randn(2, 4, dtype=torch.float64) if cell == "lstm_ln" else None
    ln = torch.randn(40, dtype=torch.float64) if cell == "lstm_ln" else None
    with pytest.raises(ValueError, match="cell_steps .* needs cell 'lstm'"):
        ops.recurrence(cell, xproj, h0, c0, torch.randn(G * 4, 4, dtype=torch.float64),
                       backend=backend, ln=ln, cell_steps=True)


@pytest.mark.gpu
@pytest.mark.parametrize("proj", [0, 3], ids=["", "proj3"])
@pytest.mark.parametrize("name,lengths,reverse,with_resets",
                         [c for c in CASES if c[0] in ("lengths-reverse", "reverse-resets")],
                         ids=["lengths-reverse", "reverse-resets"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_every_steps_cell_state_and_its_gradient(backend, name, lengths, reverse, with_resets,
                                                     proj):
    """The same on a GPU (float64: the CUDA host loop and Triton's kernels as
    compiled for the device), against the per-row loop on the CPU."""
    key = (name, proj)
    a = inputs(proj, key)
    lengths = None if lengths is None else torch.tensor(lengths, dtype=torch.int64)
    resets = (torch.rand(T, B, generator=generator("resets", *key)) < 0.35) if with_resets else None
    used = [k for k, v in a.items() if v is not None and (with_resets or not k.startswith("reset"))]
    want = truth(a, lengths, reverse, resets)
    dev = {k: None if v is None else v.detach().cuda().requires_grad_() for k, v in a.items()}
    got = rnnkern_call(backend, dev, lengths, reverse, None if resets is None else resets.cuda())
    cot = [randn(generator("cotangent", *key, i), *w.shape) for i, w in enumerate(want)]
    for what, x, y in zip(("output", "h_n", "c after every step"), got, want):
        assert_close(x.cpu(), y, what=f"{backend} {what}")
    g_want = torch.autograd.grad(sum((w * c).sum() for w, c in zip(want, cot)),
                                 [a[k] for k in used])
    g_got = torch.autograd.grad(sum((x * c.cuda()).sum() for x, c in zip(got, cot)),
                                [dev[k] for k in used])
    for k, x, y in zip(used, g_got, g_want):
        assert_close(x.cpu(), y, what=f"{backend} grad of {k}")

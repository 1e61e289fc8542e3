"""The drop-in modules against torch.nn: a parity grid over every option, dropout,
convert(), serialisation and construction, autocast, backend coverage (bad input:
tests/test_inputs.py).

The grid compares outputs, final states and every gradient (input, initial
states, all parameters) in float64.  Its combinations (cell x layers x
directions x batch_first x bias x input form x hx) are too many to run whole in
CI: a seeded sample covers every (cell, input form) pair several times with the
other options drawn at random; ``RNNKERN_FULL_GRID=1`` runs the whole product.
``gru_reset_before`` has no torch.nn twin: it is compared with
:mod:`rnnkern.reference` run layer by layer.
"""
from __future__ import annotations

import copy
import inspect
import io
import itertools
import os
import pickle
import random
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import rnnkern
from rnnkern import modules, ops, reference
from conftest import HAS_GPU, assert_close, assert_low_precision, generator, randn


# --------------------------------------------------------------- the grid ----

FORMS = ("padded", "lengths", "packed_sorted", "packed_unsorted", "unbatched")
# (cell, proj_size): every cell and GRU form, and the LSTM with a projection.
CELL_VARIANTS = (("rnn_tanh", 0), ("rnn_relu", 0), ("gru", 0), ("gru_reset_before", 0),
                 ("lstm", 0), ("lstm", 3))
T, B, I, H = 6, 4, 3, 5
LENGTHS = {  # per input form; the unsorted ones have ties
    "lengths": [5, 2, 6, 2],
    "packed_sorted": [6, 5, 2, 1],
    "packed_unsorted": [5, 2, 6, 2],
}


@dataclass(frozen=True)
class Case:
    cell: str
    proj: int
    layers: int
    bidirectional: bool
    batch_first: bool
    bias: bool
    form: str
    hx: bool

    @property
    def id(self) -> str:
        return "-".join([self.cell + (f"_proj{self.proj}" if self.proj else ""), f"L{self.layers}",
                         "bi" if self.bidirectional else "uni", "bf" if self.batch_first else "tf",
                         "bias" if self.bias else "nobias", self.form, "hx" if self.hx else "nohx"])


def grid(per_stratum: int, seed: int) -> list[Case]:
    """Every (cell, form) pair `per_stratum` times, the other options drawn from
    a seeded generator; the whole product with RNNKERN_FULL_GRID=1."""
    rest = list(itertools.product((1, 3), (False, True), (False, True), (False, True), (False, True)))
    rng = random.Random(seed)
    full = os.environ.get("RNNKERN_FULL_GRID") == "1"
    cases = []
    for (cell, proj), form in itertools.product(CELL_VARIANTS, FORMS):
        chosen = rest if full else rng.sample(rest, per_stratum)
        cases += [Case(cell, proj, *options[:4], form, options[4]) for options in chosen]
    return cases


def make_pair(case: Case, dtype=torch.float64, device="cpu", backend="cpu"):
    """(ours, twin): the rnnkern module and the module it must agree with --
    torch.nn's with the same parameters, or for gru_reset_before a
    rnnkern.reference stack over the same module."""
    kwargs = dict(num_layers=case.layers, bias=case.bias, batch_first=case.batch_first,
                  bidirectional=case.bidirectional, dtype=dtype, device=device)
    if case.proj:
        kwargs["proj_size"] = case.proj
    torch.manual_seed(zlib.crc32(case.id.encode()))
    if case.cell == "lstm":
        ours = rnnkern.LSTM(I, H, backend=backend, **kwargs)
    elif case.cell in ("gru", "gru_reset_before"):
        ours = rnnkern.GRU(I, H, backend=backend, reset_after=case.cell == "gru", **kwargs)
    else:
        ours = rnnkern.RNN(I, H, nonlinearity=case.cell[4:], backend=backend, **kwargs)
    if case.cell == "gru_reset_before":
        return ours, ReferenceTwin(ours)
    twin = {"lstm": nn.LSTM, "gru": nn.GRU}.get(case.cell, nn.RNN)
    extra = {"nonlinearity": case.cell[4:]} if case.cell.startswith("rnn") else {}
    theirs = twin(I, H, **kwargs, **extra)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


class ReferenceTwin:
    """torch.nn's forward contract (every input form) computed by
    rnnkern.reference.layer, one (layer, direction) at a time, with the
    parameters of an rnnkern module."""

    def __init__(self, module):
        self.m = module

    def named_parameters(self):
        return self.m.named_parameters()

    def __call__(self, input, hx=None, lengths=None):
        m = self.m
        lstm = m.mode == "LSTM"
        packed = isinstance(input, PackedSequence)
        if packed:
            x, lengths = pad_packed_sequence(input)  # original batch order
        else:
            batched = input.dim() == 3
            x = input if batched else input.unsqueeze(1 - int(m.batch_first))
            x = x.transpose(0, 1) if m.batch_first else x
        D = 2 if m.bidirectional else 1
        P = m.proj_size or m.hidden_size
        if hx is None:
            hx = (x.new_zeros(m.num_layers * D, x.size(1), P),
                  x.new_zeros(m.num_layers * D, x.size(1), m.hidden_size))
        else:
            hx = tuple(hx) if lstm else (hx,)
            if not packed and not batched:
                hx = tuple(h.unsqueeze(1) for h in hx)
        h_n, c_n = [], []
        for layer in range(m.num_layers):
            outs = []
            for d in range(D):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                w = lambda n: getattr(m, n + sfx, None)  # noqa: E731
                i = layer * D + d
                out, h, c = reference.layer(m.cell, x, hx[0][i], hx[1][i] if lstm else None,
                                            w("weight_ih"), w("weight_hh"), w("bias_ih"), w("bias_hh"),
                                            w("weight_hr"), lengths, reverse=d == 1)
                outs.append(out)
                h_n.append(h)
                c_n.append(c)
            x = torch.cat(outs, 2)
        hidden = (torch.stack(h_n), torch.stack(c_n)) if lstm else torch.stack(h_n)
        if packed:
            repacked = pack_padded_sequence(x, lengths, enforce_sorted=input.sorted_indices is None)
            return PackedSequence(repacked.data, input.batch_sizes, input.sorted_indices,
                                  input.unsorted_indices), hidden
        x = x.transpose(0, 1) if m.batch_first else x
        if not batched:
            x = x.squeeze(1 - int(m.batch_first))
            hidden = tuple(h.squeeze(1) for h in hidden) if lstm else hidden.squeeze(1)
        return x, hidden


def case_inputs(case: Case, dtype=torch.float64, device="cpu"):
    """Input leaf x (padded layout of the form) and hx leaves (or None)."""
    g = generator("grid", case.id)
    D = 2 if case.bidirectional else 1
    P = case.proj or H
    shape = (T, I) if case.form == "unbatched" else ((B, T, I) if case.batch_first else (T, B, I))
    x = randn(g, *shape, dtype=dtype).to(device).requires_grad_()
    if not case.hx:
        return x, None
    batch = () if case.form == "unbatched" else (B,)
    h = randn(g, case.layers * D, *batch, P, dtype=dtype, scale=0.5).to(device).requires_grad_()
    if case.cell != "lstm":
        return x, (h,)
    c = randn(g, case.layers * D, *batch, H, dtype=dtype, scale=0.5).to(device).requires_grad_()
    return x, (h, c)


def call(module, case: Case, x, hx, is_twin: bool):
    """Runs `module` on the case's input form; returns the tensors to compare:
    (output or packed data, *final states)."""
    lstm = case.cell == "lstm"
    arg = None if hx is None else (hx if lstm else hx[0])
    if case.form in ("packed_sorted", "packed_unsorted"):
        lengths = torch.tensor(LENGTHS[case.form])
        packed = pack_padded_sequence(x, lengths, batch_first=case.batch_first,
                                      enforce_sorted=case.form == "packed_sorted")
        out, hidden = module(packed, arg)
        assert isinstance(out, PackedSequence)
        assert torch.equal(out.batch_sizes, packed.batch_sizes)
        out = out.data
    elif case.form == "lengths":
        lengths = torch.tensor(LENGTHS["lengths"])
        if is_twin and isinstance(module, nn.Module):  # torch.nn: the equivalent PackedSequence
            packed = pack_padded_sequence(x, lengths, batch_first=case.batch_first, enforce_sorted=False)
            out, hidden = module(packed, arg)
            out = pad_packed_sequence(out, batch_first=case.batch_first, total_length=T)[0]
        else:
            out, hidden = module(x, arg, lengths=lengths)
    else:
        out, hidden = module(x, arg)
    return (out, *(hidden if lstm else (hidden,)))


def outputs_and_grads(module, case, x, hx, is_twin):
    """The compared tensors, then the gradients of a random linear functional of
    them w.r.t. the input, hx and every parameter (by name)."""
    results = call(module, case, x, hx, is_twin)
    g = generator("grid-cotangent", case.id)
    loss = sum((r * randn(g, *r.shape, dtype=r.dtype).to(r.device)).sum() for r in results)
    names, params = zip(*module.named_parameters())
    leaves = [x, *(hx or ()), *params]
    grads = torch.autograd.grad(loss, leaves)
    labels = ["output"] + [f"hidden[{i}]" for i in range(len(results) - 1)]
    labels += ["grad input"] + [f"grad hx[{i}]" for i in range(len(hx or ()))]
    labels += [f"grad {n}" for n in names]
    return dict(zip(labels, [*results, *grads]))


def check_case(case: Case, backend: str, device="cpu"):
    ours, twin = make_pair(case, backend=backend, device=device)
    x, hx = case_inputs(case, device=device)
    got = outputs_and_grads(ours, case, x, hx, is_twin=False)
    want = outputs_and_grads(twin, case, x, hx, is_twin=True)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].shape == want[name].shape, name
        assert_close(got[name], want[name], what=f"{case.id} {name}")


@pytest.mark.parametrize("case", grid(per_stratum=4, seed=1), ids=lambda c: c.id)
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_parity_grid(backend, case):
    check_case(case, backend)


@pytest.mark.parametrize("case", grid(per_stratum=1, seed=2), ids=lambda c: c.id)
def test_parity_grid_triton_interpreter(case):
    if HAS_GPU:
        pytest.skip("the interpreter grid runs where there is no GPU; the GPU grid covers triton on CUDA")
    check_case(case, "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("case", grid(per_stratum=1, seed=3), ids=lambda c: c.id)
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_parity_grid_gpu(backend, case):
    check_case(case, backend, device="cuda")


def test_grid_sample_covers_every_option():
    """The CI sample holds every value of every option, and every (cell, form) pair."""
    cases = grid(per_stratum=4, seed=1)
    for field in ("cell", "proj", "layers", "bidirectional", "batch_first", "bias", "form", "hx"):
        values = {getattr(c, field) for c in cases}
        assert len(values) >= 2, field
    assert {(c.cell, c.proj, c.form) for c in cases} == {
        (cell, proj, form) for (cell, proj), form in itertools.product(CELL_VARIANTS, FORMS)}


@pytest.mark.parametrize("cell,proj", CELL_VARIANTS, ids=[f"{c}_proj{p}" if p else c for c, p in CELL_VARIANTS])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_lengths_with_empty_sequences(backend, cell, proj):
    """lengths= accepts zero lengths (no torch.nn twin: a PackedSequence cannot
    hold an empty sequence): their state stays h0 and their output is zero."""
    case = Case(cell, proj, 2, True, False, True, "lengths", True)
    ours, _ = make_pair(case, backend=backend)
    x, hx = case_inputs(case)
    lengths = torch.tensor([4, 0, 6, 1])
    arg = hx if cell == "lstm" else hx[0]
    got = ours(x, arg, lengths=lengths)
    want = ReferenceTwin(ours)(x, arg, lengths=lengths)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert_close(a, b)
    assert (got[0][:, 1] == 0).all()
    h_n = got[1][0] if cell == "lstm" else got[1]
    assert torch.equal(h_n[:, 1], hx[0][:, 1])


def test_lengths_forms_agree():
    """lengths as a list, an int32 tensor or full lengths: same as the int64 tensor
    (and full lengths the same as none)."""
    m = rnnkern.GRU(I, H, num_layers=2, bidirectional=True, backend="cpu", dtype=torch.float64)
    x = randn(generator("lengths-forms"), T, B, I)
    want, _ = m(x, lengths=torch.tensor([6, 2, 5, 1]))
    for lengths in ([6, 2, 5, 1], torch.tensor([6, 2, 5, 1], dtype=torch.int32)):
        got, _ = m(x, lengths=lengths)
        assert torch.equal(got, want)
    assert_close(m(x, lengths=[T] * B)[0], m(x)[0])


def graph_nodes(t: torch.Tensor) -> set:
    """The names of the autograd nodes t's gradient passes through."""
    names, seen, todo = set(), set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("cell,proj", [("lstm", 0), ("lstm", 3), ("gru", 0), ("rnn_tanh", 0)],
                         ids=["lstm", "lstm_proj3", "gru", "rnn_tanh"])
@pytest.mark.parametrize("form", ["packed", "lengths", "lengths-unsorted"])
def test_mostly_padding_packed_batch_second_order(cell, proj, form, monkeypatch):
    """A batch mostly padding.  Packed: the CPU kernels take the PackedSequence's
    rows themselves, no grid anywhere (csrc/checks.h, packed_rows).  lengths=,
    sorted longest first: the input projection runs over the real rows,
    scattered into a grid from rnnkern's buffer cache, gathered back through
    _GridToRows, whose backward scatters into that cache's zeros
    (modules/sequence.py).  lengths=, unsorted: as the packed batch (rows, no
    grid: sorting saves steps, _sorting_saves_steps), its rows gathered and
    scattered back the same way.  Against torch.nn in
    float64: outputs, states, every first gradient, and the second
    derivatives (create_graph through the op's reference and the scatters)."""
    case = Case(cell, proj, 2, True, False, True, "packed_unsorted", True)
    ours, theirs = make_pair(case)
    g = generator("mostly-padding-second-order", cell, proj)
    # 20 real positions of a 9 x 8 grid
    lengths = torch.tensor([9, 3, 2, 2, 1, 1, 1, 1] if form == "lengths" else [2, 9, 1, 3, 1, 2, 1, 1])
    x = randn(g, 9, 8, I, requires_grad=True)
    params_ours, params_theirs = list(ours.parameters()), list(theirs.parameters())

    def run(m, params, form):
        if form.startswith("lengths"):
            out, hidden = m(x, lengths=lengths)
            time, batch = rnnkern.reference.packed_positions(lengths.sort(descending=True).values, 9, "cpu")
            order = lengths.sort(descending=True).indices
            rows = out[time, order[batch]]
        else:
            out, hidden = m(pack_padded_sequence(x, lengths, enforce_sorted=False))
            rows = out.data
        states = list(hidden) if isinstance(hidden, tuple) else [hidden]
        cot = randn(generator("mostly-padding-cot", cell, proj), *rows.shape)
        loss = (rows * cot).sum() + sum((s * s).sum() for s in states)
        first = torch.autograd.grad(loss, [x, *params], create_graph=True)
        second = torch.autograd.grad(sum((f * f).sum() for f in first), [x, *params])
        return rows, [rows, *states, *first, *second]

    packed_calls = []
    forward_packed = type(ours)._forward_packed
    monkeypatch.setattr(type(ours), "_forward_packed",
                        lambda self, *a, **k: packed_calls.append(1) or forward_packed(self, *a, **k))
    rows, got = run(ours, params_ours, form)
    assert ("_GridToRowsBackward" in graph_nodes(rows)) == form.startswith("lengths")
    assert bool(packed_calls) == (form != "lengths")
    _, want = run(theirs, params_theirs, "packed")
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert_close(a, b)


# ------------------------------------------------------------- no Python per step ----

@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("form", ["padded", "lengths", "packed_unsorted"])
def test_one_op_call_per_layer_and_direction(monkeypatch, bidirectional, form):
    """However long the sequence, each (layer, direction) is one recurrence call."""
    calls = []
    real = ops.run_recurrence  # what the modules call (ops.recurrence's resolved form)
    monkeypatch.setattr(ops, "run_recurrence", lambda *a, **k: calls.append(1) or real(*a, **k))
    case = Case("lstm", 0, 3, bidirectional, False, True, form, False)
    ours, _ = make_pair(case)
    x, hx = case_inputs(case)
    call(ours, case, x, hx, is_twin=False)
    assert len(calls) == 3 * (2 if bidirectional else 1)


ONE_STEP_MODULES = [("RNN", {}), ("RNN", {"nonlinearity": "relu"}), ("GRU", {}),
                    ("GRU", {"reset_after": False}), ("LSTM", {})]


def spy_one_step(monkeypatch, name: str):
    """Lists that fill as the module class ``name`` runs the layers_step op
    (one entry per call) and the full forward's layer loop (the module)."""
    calls, loops = [], []
    real = ops.run_layers_step
    monkeypatch.setattr(ops, "run_layers_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    run_layers = getattr(rnnkern, name)._run_layers
    monkeypatch.setattr(getattr(rnnkern, name), "_run_layers",
                        lambda self, *a, **k: loops.append(self) or run_layers(self, *a, **k))
    return calls, loops


def one_step_pair(g, name: str, kwargs: dict, I: int, H: int, options: dict):
    """rnnkern's module ``name`` on the cpu backend with random weights, and its
    twin on the same weights: torch.nn's, or the reference backend's where
    torch.nn lacks the option (reset_after=False)."""
    ours = getattr(rnnkern, name)(I, H, backend="cpu", **options, **kwargs)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(randn(g, *p.shape, scale=H ** -0.5))
    twin = kwargs.get("reset_after", True)
    theirs = getattr(nn, name)(I, H, **options, **kwargs) if twin else \
        getattr(rnnkern, name)(I, H, backend="reference", **options, **kwargs)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def step_results(out, h_n, lstm: bool, wrt: list) -> list:
    """The output, the final states and the gradients of ``wrt`` under a fixed
    random functional of all of them."""
    finals = h_n if lstm else (h_n,)
    loss = (out * randn(generator("cot", 1), *out.shape)).sum() + sum(
        (f * randn(generator("cot", 2 + i), *f.shape)).sum() for i, f in enumerate(finals))
    return [out, *finals, *torch.autograd.grad(loss, wrt)]


@pytest.mark.parametrize("name,kwargs", ONE_STEP_MODULES,
                         ids=["tanh", "relu", "gru", "gru-reset-before", "lstm"])
@pytest.mark.parametrize("layers,bidirectional,batch_first,bias,hx", [
    (1, False, False, True, True), (1, False, True, False, False), (2, True, False, True, False),
    (2, False, True, True, True), (3, True, True, False, True)],
    ids=["L1", "L1-bf-nobias-nohx", "L2-bi-nohx", "L2-bf", "L3-bi-bf-nobias"])
def test_one_step_call_is_one_op(monkeypatch, name, kwargs, layers, bidirectional, batch_first,
                                 bias, hx):
    """A module's one-step call (streaming, an RL rollout's action step) runs its
    whole stack as one layers_step op, none of the full forward's layer loop:
    torch.nn's numbers and gradients (float64), with the output and h_n apart
    (an in-place edit of one leaves the other alone)."""
    calls, loops = spy_one_step(monkeypatch, name)
    g = generator("one-step-op", name, str(kwargs), layers, bidirectional, batch_first, bias, hx)
    I, H, B, D = 3, 5, 4, 2 if bidirectional else 1
    options = dict(num_layers=layers, bidirectional=bidirectional, batch_first=batch_first,
                   bias=bias, dtype=torch.float64)
    ours, theirs = one_step_pair(g, name, kwargs, I, H, options)
    x = randn(g, *((B, 1, I) if batch_first else (1, B, I)), requires_grad=True)
    state = None
    if hx:
        state = tuple(randn(g, layers * D, B, H, scale=0.5, requires_grad=True)
                      for _ in range(2 if name == "LSTM" else 1))
    results = []
    for m in (ours, theirs):
        out, h_n = m(x, None if state is None else state if name == "LSTM" else state[0])
        results.append(step_results(out, h_n, name == "LSTM", [x, *(state or ()), *m.parameters()]))
    assert len(calls) == 1 and not any(m is ours for m in loops)
    for i, (got, want) in enumerate(zip(*results)):
        assert got.shape == want.shape, i
        assert_close(got, want, what=f"result {i}")
    out, h_n = ours(x.detach(), None if state is None else
                    tuple(s.detach() for s in state) if name == "LSTM" else state[0].detach())
    h_n = h_n[0] if name == "LSTM" else h_n
    before = out.clone()
    h_n.add_(1.0)
    assert torch.equal(out, before)


@pytest.mark.parametrize("name,kwargs", ONE_STEP_MODULES,
                         ids=["tanh", "relu", "gru", "gru-reset-before", "lstm"])
@pytest.mark.parametrize("layers,batch_first,mask,hx", [
    (1, False, "float", True), (2, True, "bool", True), (2, False, "uint8-trailing-1", True),
    (1, True, "float-trailing-1", False), (3, False, "none-set", True)],
    ids=["L1-float", "L2-bf-bool", "L2-uint8-1", "L1-bf-float-1-nohx", "L3-none-set"])
def test_one_step_call_with_resets_is_one_op(monkeypatch, name, kwargs, layers, batch_first, mask,
                                             hx):
    """An RL rollout's action step (sb3-contrib's float episode starts as
    ``resets=``, torchrl's bool ``is_init`` [B, T, 1]) runs as the one-step
    call's one op, its rows that start an episode from zeros: the RL masking
    loop's numbers and gradients (torch.nn on ``(1 - start) * state``, float64),
    hx's gradient zero in those rows."""
    calls, loops = spy_one_step(monkeypatch, name)
    g = generator("one-step-resets", name, str(kwargs), layers, batch_first, mask, hx)
    I, H, B = 3, 5, 6
    options = dict(num_layers=layers, batch_first=batch_first, dtype=torch.float64)
    ours, theirs = one_step_pair(g, name, kwargs, I, H, options)
    x = randn(g, *((B, 1, I) if batch_first else (1, B, I)), requires_grad=True)
    lstm = name == "LSTM"
    state = None
    if hx:
        state = tuple(randn(g, layers, B, H, scale=0.5, requires_grad=True)
                      for _ in range(2 if lstm else 1))
    starts = torch.tensor([1, 0, 0, 1, 0, 1] if mask != "none-set" else [0] * B)
    resets = {"float": starts.double(), "bool": starts.bool(), "none-set": starts.float()}.get(
        mask.removesuffix("-trailing-1"), starts.to(torch.uint8))
    resets = resets.view((B, 1) if batch_first else (1, B))
    if mask.endswith("trailing-1"):
        resets = resets.unsqueeze(-1)
    keep = (1 - starts.double()).view(1, B, 1)

    def call(m):
        if m is ours:
            hx_in = state
            out, h_n = m(x, None if hx_in is None else hx_in if lstm else hx_in[0], resets=resets)
        else:
            hx_in = None if state is None else tuple(keep * s for s in state)
            out, h_n = m(x, None if hx_in is None else hx_in if lstm else hx_in[0])
        return step_results(out, h_n, lstm, [x, *(state or ()), *m.parameters()])

    got, want = call(ours), call(theirs)
    assert len(calls) == 1 and not any(m is ours for m in loops)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, i
        assert_close(a, b, what=f"result {i}")
    if state is not None and mask != "none-set":
        first = 2 + len(state)  # (output, the final states, the input's gradient)
        for grad in got[first:first + len(state)]:
            assert torch.count_nonzero(grad[:, starts.bool()]) == 0
            assert torch.count_nonzero(grad[:, ~starts.bool()]) > 0


@pytest.mark.parametrize("call", ["bidirectional", "reset-state", "two-steps", "bad-value",
                                  "bad-shape", "bad-dtype", "large-mask"])
def test_one_step_resets_the_op_cannot_take(monkeypatch, call):
    """One-step calls with ``resets=`` that the one-op path leaves to the full
    forward (a bidirectional module, a reset state, more steps, a mask it would
    refuse, one too large to read on the host): the reference's numbers, and
    the full forward's errors."""
    answers = []
    real = rnnkern.LSTM._one_step_forward
    monkeypatch.setattr(rnnkern.LSTM, "_one_step_forward",
                        lambda *a, **k: answers.append(real(*a, **k)) or answers[-1])
    g = generator("one-step-resets-left", call)
    B = 300 if call == "large-mask" else 3
    ours = rnnkern.LSTM(3, 4, backend="cpu", bidirectional=call == "bidirectional")
    ref = rnnkern.LSTM(3, 4, backend="reference", bidirectional=call == "bidirectional")
    ref.load_state_dict(ours.state_dict())
    D = 2 if call == "bidirectional" else 1
    T = 2 if call == "two-steps" else 1
    x = randn(g, T, B, 3, dtype=torch.float32)
    hx = tuple(randn(g, D, B, 4, dtype=torch.float32) for _ in range(2))
    resets = torch.zeros(T, B)
    resets[0, 0] = 1.0
    kwargs = {"resets": resets}
    if call == "reset-state":
        kwargs["reset_state"] = tuple(randn(g, D, B, 4, dtype=torch.float32) for _ in range(2))
    if call.startswith("bad"):
        bad = {"bad-value": (resets * 0.5, ValueError, "resets must hold only 0 and 1"),
               "bad-shape": (resets.view(1, 1, B), ValueError, "expected resets of shape"),
               "bad-dtype": (resets.long(), TypeError, "expected resets of dtype")}[call]
        with pytest.raises(bad[1], match=bad[2]):
            ours(x, hx, resets=bad[0])
    else:
        got = ours(x, hx, **kwargs)
        want = ref(x, hx, **kwargs)
        for a, b in zip([got[0], *got[1]], [want[0], *want[1]]):
            assert_close(a, b)
    # (A reset state: not even asked.)
    assert all(a is None for a in answers) and bool(answers) == (call != "reset-state")


@pytest.mark.parametrize("name,kwargs", [("RNNCell", {}), ("RNNCell", {"nonlinearity": "relu"}),
                                         ("GRUCell", {}), ("GRUCell", {"reset_after": False}),
                                         ("LSTMCell", {})],
                         ids=["tanh", "relu", "gru", "gru-reset-before", "lstm"])
@pytest.mark.parametrize("hx,bias", [(True, True), (False, False)], ids=["hx", "nohx-nobias"])
def test_cell_call_takes_the_common_path(monkeypatch, name, kwargs, hx, bias):
    """A cell's common call (batched CPU input, hx None or well-formed, no
    zoneout, autocast or LayerNorm) skips the full forward and gives torch.nn's
    numbers and gradients (float64); anything else runs the full forward."""
    answers = []
    cls = getattr(rnnkern, name)
    real = cls._common_call
    monkeypatch.setattr(cls, "_common_call",
                        lambda *a, **k: answers.append(real(*a, **k)) or answers[-1])
    g = generator("cell-common", name, str(kwargs), hx, bias)
    I, H, B = 3, 5, 4
    ours = cls(I, H, bias=bias, dtype=torch.float64, **kwargs)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(randn(g, *p.shape, scale=H ** -0.5))
    twin = kwargs.get("reset_after", True)
    theirs = getattr(nn, name)(I, H, bias=bias, dtype=torch.float64, **kwargs) if twin else \
        cls(I, H, bias=bias, backend="reference", dtype=torch.float64, **kwargs)
    theirs.load_state_dict(ours.state_dict())
    x = randn(g, B, I, requires_grad=True)
    lstm = name == "LSTMCell"
    state = None
    if hx:
        state = tuple(randn(g, B, H, scale=0.5, requires_grad=True) for _ in range(2 if lstm else 1))
    results = []
    for m in (ours, theirs):
        out = m(x, None if state is None else state if lstm else state[0])
        outs = out if lstm else (out,)
        loss = sum((o * randn(generator("cell-cot", i), *o.shape)).sum() for i, o in enumerate(outs))
        results.append([*outs, *torch.autograd.grad(loss, [x, *(state or ()), *m.parameters()])])
    assert answers[0] is not None
    for i, (got, want) in enumerate(zip(*results)):
        assert_close(got, want, what=f"result {i}")
    # Not the common call: unbatched input, zoneout, a state of another dtype (an error).
    answers.clear()
    ours(x[0].detach())
    ours.zoneout = 0.5
    ours.eval()
    ours(x.detach())
    ours.zoneout = 0.0
    bad = randn(g, B, H, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="dtype"):
        ours(x.detach(), (bad, bad) if lstm else bad)
    assert answers == [None] * 3


@pytest.mark.parametrize("name,kwargs,call", [
    ("LSTM", {"num_layers": 2, "dropout": 0.5}, "train"),
    ("LSTM", {"proj_size": 2}, "eval"),
    ("GRU", {"zoneout": 0.3}, "eval"),
    ("LayerNormLSTM", {}, "eval"),
    ("RNN", {}, "unbatched"),
    ("RNN", {}, "two-steps"),
    ("GRU", {}, "autocast"),
])
def test_one_step_calls_the_op_cannot_take(monkeypatch, name, kwargs, call):
    """What the one-step forward leaves out (dropout to draw, a projection,
    zoneout, LayerNorm, unbatched input, more steps, autocast) runs the full
    forward: the same results as the reference backend's."""
    answers = []
    cls = getattr(rnnkern, name)
    real = cls._one_step_forward
    monkeypatch.setattr(cls, "_one_step_forward",
                        lambda *a, **k: answers.append(real(*a, **k)) or answers[-1])
    g = generator("not-one-op", name, call)
    ours = getattr(rnnkern, name)(3, 4, backend="cpu", **kwargs)
    ref = getattr(rnnkern, name)(3, 4, backend="reference", **kwargs)
    ref.load_state_dict(ours.state_dict())
    if call != "train":
        ours.eval(), ref.eval()
    shape = {"unbatched": (1, 3), "two-steps": (2, 2, 3)}.get(call, (1, 2, 3))
    x = randn(g, *shape, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=call == "autocast"):
        torch.manual_seed(0)
        got = ours(x)
        torch.manual_seed(0)
        want = ref(x)
    assert answers[0] is None
    flat = lambda r: [r[0], *(r[1] if isinstance(r[1], tuple) else (r[1],))]  # noqa: E731
    if call == "autocast":  # run in bfloat16: within the reference's own bfloat16 error
        exact = flat(ref(x))
        for a, b, c in zip(flat(got), flat(want), exact):
            assert a.dtype == b.dtype
            assert_low_precision(a, b, c)
        return
    for a, b in zip(flat(got), flat(want)):
        assert_close(a, b)


@pytest.mark.parametrize("name", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("bad", ["hx-shape", "hx-batch", "input-size", "input-dtype", "hx-dtype"])
def test_one_step_call_errors_as_torch_nn(name, bad):
    """A one-step call with a bad argument raises the full forward's error
    (torch.nn's type and message where torch.nn has one), not the op's."""
    g = generator("one-step-errors", name, bad)
    ours = getattr(rnnkern, name)(3, 4, backend="cpu")
    theirs = getattr(nn, name)(3, 4)
    theirs.load_state_dict(ours.state_dict())
    x = randn(g, 1, 2, 3, dtype=torch.float32)
    h = randn(g, 1, 2, 4, dtype=torch.float32)
    hx = {"hx-shape": randn(g, 2, 2, 4, dtype=torch.float32), "hx-batch": h[:, :1],
          "hx-dtype": h.double()}.get(bad, h)
    if bad == "input-size":
        x = randn(g, 1, 2, 5, dtype=torch.float32)
    if bad == "input-dtype":
        x = x.double()
    if name == "LSTM":
        hx = (hx, h)
    errors = []
    for m in (ours, theirs):
        with pytest.raises((RuntimeError, ValueError, TypeError)) as info:
            m(x, hx)
        errors.append(info)
    if bad == "hx-dtype":  # torch.nn: its kernel's error; rnnkern's names the module and hx
        assert errors[0].type is RuntimeError and "hx" in str(errors[0].value) \
            and name in str(errors[0].value)
    else:
        assert errors[0].type is errors[1].type and str(errors[1].value) in str(errors[0].value)


# ---------------------------------------------------------------- dropout ----

class DropoutSpy:
    """Records every F.dropout call (input, p, training, output)."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = torch.nn.functional.dropout

        def spy(input, p=0.5, training=True, inplace=False):
            out = real(input, p, training, inplace)
            self.calls.append((input.detach(), p, training, out.detach()))
            return out

        monkeypatch.setattr(modules.F, "dropout", spy)


@pytest.mark.parametrize("form", ["padded", "lengths", "packed_unsorted"])
def test_dropout_statistics_in_training(monkeypatch, form):
    """Between layers only (L-1 times), over the valid steps only, each element
    zeroed with probability p and the others scaled by 1/(1-p)."""
    p, L = 0.3, 3
    spy = DropoutSpy(monkeypatch)
    m = rnnkern.GRU(8, 32, num_layers=L, dropout=p, backend="cpu", dtype=torch.float64).train()
    g = generator("dropout-stats", form)
    x = randn(g, 40, 16, 8)
    lengths = torch.randint(1, 41, (16,), generator=g)
    if form == "padded":
        m(x)
    elif form == "lengths":
        m(x, lengths=lengths)
    else:
        m(pack_padded_sequence(x, lengths, enforce_sorted=False))
    assert len(spy.calls) == L - 1
    rows = 40 * 16 if form == "padded" else int(lengths.sum())
    for inp, prob, training, out in spy.calls:
        assert prob == p and training
        assert inp.shape == (rows, 32) if form != "padded" else inp.shape == (40, 16, 32)
        assert (inp != 0).all()  # tanh outputs of the valid steps are never exactly 0
        dropped = (out == 0).double().mean().item()
        n = inp.numel()
        assert abs(dropped - p) < 5 * (p * (1 - p) / n) ** 0.5, dropped
        kept = out != 0
        torch.testing.assert_close(out[kept], inp[kept] / (1 - p), rtol=1e-15, atol=0)


@pytest.mark.parametrize("form", ["padded", "lengths", "packed_sorted"])
def test_dropout_off_in_eval_and_deterministic(monkeypatch, form):
    spy = DropoutSpy(monkeypatch)
    case = Case("lstm", 0, 3, True, False, True, form, True)
    ours, _ = make_pair(case)
    plain, _ = make_pair(case)
    ours.dropout = 0.5
    x, hx = case_inputs(case)
    ours.eval()
    first = call(ours, case, x, hx, is_twin=False)
    second = call(ours, case, x, hx, is_twin=False)
    without = call(plain, case, x, hx, is_twin=False)
    assert spy.calls == []
    for a, b, c in zip(first, second, without):
        assert torch.equal(a, b) and torch.equal(a, c)
    ours.train()
    assert not torch.equal(call(ours, case, x, hx, False)[0], call(ours, case, x, hx, False)[0])


@pytest.mark.parametrize("form", ["padded", "lengths", "packed_sorted", "packed_unsorted"])
@pytest.mark.parametrize("cell,proj", [("lstm", 0), ("gru", 0), ("rnn_tanh", 0), ("lstm", 3)],
                         ids=["lstm", "gru", "rnn_tanh", "lstm_proj3"])
@pytest.mark.parametrize("p", [0.4, 1.0])
def test_dropout_masks_match_torch_nn_cpu(form, cell, proj, p):
    """With the same seed, torch.nn's native CPU path and rnnkern draw the same
    masks (torch.nn drops out the packed rows, rnnkern does too), so outputs,
    states and every gradient agree in training mode."""
    case = Case(cell, proj, 3, True, form == "packed_sorted", True, form, True)
    ours, theirs = make_pair(case)
    ours.dropout = theirs.dropout = p
    ours.train(), theirs.train()
    x, hx = case_inputs(case)
    torch.manual_seed(7)
    got = outputs_and_grads(ours, case, x, hx, is_twin=False)
    torch.manual_seed(7)
    want = outputs_and_grads(theirs, case, x, hx, is_twin=True)
    for name in want:
        assert_close(got[name], want[name], what=name)


# ---------------------------------------------------------------- convert ----

class MyLSTM(nn.LSTM):
    """A user subclass whose forward never reaches torch.nn's: convert() leaves it
    alone, with a warning (subclasses that do reach it: tests/test_integrations_convert.py)."""

    def forward(self, x):
        return torch.tanh(x @ self.weight_ih_l0.t()), None


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2)
        self.cell = nn.GRUCell(3, 5)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return out, h, c, self.cell(x[0])


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.blocks = nn.ModuleList([nn.GRU(3, 5, batch_first=True), nn.RNN(3, 5, nonlinearity="relu")])
        self.inner = nn.Sequential(Inner())
        self.cells = nn.ModuleDict({"rnn": nn.RNNCell(3, 5), "lstm": nn.LSTMCell(3, 5)})
        self.custom = MyLSTM(3, 5)

    def forward(self, x):
        x = self.proj(x)
        results = [self.blocks[0](x.transpose(0, 1))[0], self.blocks[1](x)[0]]
        results += list(self.inner(x))
        results.append(self.cells["rnn"](x[0]))
        results += list(self.cells["lstm"](x[0]))
        results.append(self.custom(x)[0])
        return results


TORCH_TO_OURS = {nn.RNN: rnnkern.RNN, nn.GRU: rnnkern.GRU, nn.LSTM: rnnkern.LSTM,
                 nn.RNNCell: rnnkern.RNNCell, nn.GRUCell: rnnkern.GRUCell, nn.LSTMCell: rnnkern.LSTMCell}


def test_convert_replaces_shares_and_computes_the_same():
    torch.manual_seed(0)
    model = Model().double()
    x = randn(generator("convert"), 6, 2, 4)
    before = model(x)
    types = {name: type(m) for name, m in model.named_modules()}
    params = {name: p for name, p in model.named_parameters()}
    keys = list(model.state_dict())

    with pytest.warns(UserWarning, match=r"left 'custom' \(.*MyLSTM\) as it is"):
        assert rnnkern.convert(model, backend="cpu") is model

    for name, m in model.named_modules():
        want = TORCH_TO_OURS.get(types[name], types[name])
        assert type(m) is want, name
        if want in TORCH_TO_OURS.values():
            assert m.backend == "cpu"
    assert type(model.custom) is MyLSTM
    assert all(p is params[name] for name, p in model.named_parameters())  # the same objects
    assert list(model.state_dict()) == keys
    for a, b in zip(model(x), before):
        assert_close(a, b)

    # Idempotent: a second conversion changes nothing.
    with pytest.warns(UserWarning, match="MyLSTM.forward does not call super"):
        assert rnnkern.convert(model) is model
    assert all(type(m) is TORCH_TO_OURS.get(types[n], types[n]) for n, m in model.named_modules())
    assert model.blocks[0].backend == "cpu"
    assert all(p is params[name] for name, p in model.named_parameters())
    for a, b in zip(model(x), before):
        assert_close(a, b)


def test_convert_a_bare_module_and_training_continues():
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 5, num_layers=2).double()
    opt = torch.optim.SGD(lstm.parameters(), lr=0.1)  # made before the conversion
    x = randn(generator("convert-bare"), 4, 2, 3)
    assert rnnkern.convert(lstm) is lstm and type(lstm) is rnnkern.LSTM
    before = lstm.weight_hh_l1.detach().clone()
    lstm(x)[0].sum().backward()
    opt.step()
    assert not torch.equal(lstm.weight_hh_l1, before)


def test_convert_rejects_bad_arguments_and_changes_nothing():
    model = nn.Sequential(nn.GRU(3, 4))
    with pytest.raises(ValueError, match="fortran"):
        rnnkern.convert(model, backend="fortran")
    assert type(model[0]) is nn.GRU
    cell = nn.RNNCell(3, 4, nonlinearity="sigmoid")  # torch.nn finds out only in forward
    with pytest.raises(ValueError, match="nonlinearity 'sigmoid'"):
        rnnkern.convert(cell)
    assert type(cell) is nn.RNNCell


# --------------------------------------------- construction, serialisation ----

CONSTRUCTIONS = [
    (nn.RNN, rnnkern.RNN, (3, 5), dict(num_layers=2, nonlinearity="relu", bidirectional=True)),
    (nn.RNN, rnnkern.RNN, (3, 5, 2, "tanh", False, True, 0.5, True), {}),  # positional, as torch
    (nn.GRU, rnnkern.GRU, (3, 5), dict(num_layers=3, bias=False, dropout=0.2)),
    (nn.LSTM, rnnkern.LSTM, (3, 5), dict(num_layers=2, proj_size=2, bidirectional=True, batch_first=True)),
    (nn.RNNCell, rnnkern.RNNCell, (3, 5), dict(nonlinearity="relu")),
    (nn.GRUCell, rnnkern.GRUCell, (3, 5), dict(bias=False)),
    (nn.LSTMCell, rnnkern.LSTMCell, (3, 5), {}),
]
CONSTRUCTION_IDS = [f"{c[0].__name__}-{i}" for i, c in enumerate(CONSTRUCTIONS)]


@pytest.mark.parametrize("theirs_cls,ours_cls,args,kwargs", CONSTRUCTIONS, ids=CONSTRUCTION_IDS)
def test_same_parameters_init_and_repr(theirs_cls, ours_cls, args, kwargs):
    """Seeded construction gives torch.nn's parameters exactly (names, shapes,
    values: the same initialisation), the same repr, and isinstance holds."""
    torch.manual_seed(3)
    theirs = theirs_cls(*args, **kwargs)
    torch.manual_seed(3)
    ours = ours_cls(*args, **kwargs)
    assert isinstance(ours, theirs_cls)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name
    assert repr(ours) == repr(theirs)
    assert ours.extra_repr() == theirs.extra_repr()


def test_repr_shows_non_default_rnnkern_options():
    assert repr(rnnkern.GRU(3, 5, reset_after=False)) == "GRU(3, 5, reset_after=False)"
    assert repr(rnnkern.LSTM(3, 5, backend="reference")) == "LSTM(3, 5, backend='reference')"
    assert repr(rnnkern.GRUCell(3, 5, reset_after=False, backend="cpu")) == \
        "GRUCell(3, 5, reset_after=False, backend='cpu')"


@pytest.mark.parametrize("theirs_cls,ours_cls,args,kwargs", CONSTRUCTIONS, ids=CONSTRUCTION_IDS)
def test_factory_kwargs(theirs_cls, ours_cls, args, kwargs):
    ours = ours_cls(*args, **kwargs, dtype=torch.float64, device="cpu")
    assert all(p.dtype == torch.float64 and p.device.type == "cpu" for p in ours.parameters())
    meta = ours_cls(*args, **kwargs, device="meta")
    assert all(p.is_meta for p in meta.parameters())


@pytest.mark.parametrize("theirs_cls,ours_cls,args,kwargs", CONSTRUCTIONS, ids=CONSTRUCTION_IDS)
def test_constructor_signature_and_skip_init_as_torch_nn_s(theirs_cls, ours_cls, args, kwargs):
    """The constructor's signature is torch.nn's, rnnkern's options keyword-only
    after it: tools that read it see torch.nn's.  torch.nn.utils.skip_init needs a
    ``device`` parameter there: the cells have one (and skip_init builds them
    without initialising), the sequence modules take ``*args`` as torch.nn's do
    (and skip_init refuses both alike)."""
    theirs = inspect.signature(theirs_cls).parameters
    ours = inspect.signature(ours_cls).parameters
    assert [n for n, p in ours.items() if p.kind is not p.KEYWORD_ONLY] == list(theirs)
    assert all(ours[n].kind is inspect.Parameter.KEYWORD_ONLY for n in ours if n not in theirs)
    assert {n: p.default for n, p in ours.items() if n in theirs} == \
        {n: p.default for n, p in theirs.items()}
    if not issubclass(theirs_cls, nn.RNNCellBase):
        with pytest.raises(RuntimeError, match="must support a 'device' arg"):
            torch.nn.utils.skip_init(theirs_cls, *args, **kwargs)
        with pytest.raises(RuntimeError, match="must support a 'device' arg"):
            torch.nn.utils.skip_init(ours_cls, *args, **kwargs)
        return
    theirs_module = theirs_cls(*args, **kwargs).double()
    ours_module = torch.nn.utils.skip_init(ours_cls, *args, **kwargs, dtype=torch.float64)
    assert type(ours_module) is ours_cls and ours_module.weight_ih.device.type == "cpu"
    ours_module.load_state_dict(theirs_module.state_dict())
    x = torch.randn(4, args[0], dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    for a, b in zip(torch.utils._pytree.tree_leaves(ours_module(x)),
                    torch.utils._pytree.tree_leaves(theirs_module(x))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", ["RNNCell", "GRUCell", "LSTMCell"])
def test_cell_constructor_argument_errors_as_torch_nn_s(cls):
    """Too many positional arguments, or an unknown keyword: torch.nn's TypeError
    and words (the options beyond torch.nn's are keyword-only)."""
    for args, kwargs in [((3, 5, True, None, None, "x", "y"), {}), ((3, 5), dict(colour=1))]:
        with pytest.raises(TypeError) as want:
            getattr(nn, cls)(*args, **kwargs)
        with pytest.raises(TypeError) as got:
            getattr(rnnkern, cls)(*args, **kwargs)
        assert str(got.value) == str(want.value)


def _run_module(m, x):
    out = m(x if not isinstance(m, nn.RNNCellBase) else x[0])
    return torch.utils._pytree.tree_leaves(out)


@pytest.mark.parametrize("theirs_cls,ours_cls,args,kwargs", CONSTRUCTIONS, ids=CONSTRUCTION_IDS)
def test_state_dict_round_trips_with_torch_nn(theirs_cls, ours_cls, args, kwargs):
    torch.manual_seed(4)
    theirs = theirs_cls(*args, **kwargs).double().eval()
    ours = ours_cls(*args, **kwargs, backend="cpu").double().eval()
    x = randn(generator("state-dict", theirs_cls.__name__), 5, 2, 3)
    ours.load_state_dict(theirs.state_dict())  # torch.nn -> rnnkern
    for a, b in zip(_run_module(ours, x), _run_module(theirs, x)):
        assert_close(a, b)
    torch.manual_seed(5)
    source = ours_cls(*args, **kwargs, backend="cpu").double().eval()
    theirs.load_state_dict(source.state_dict())  # rnnkern -> torch.nn
    for a, b in zip(_run_module(source, x), _run_module(theirs, x)):
        assert_close(a, b)


@pytest.mark.parametrize("theirs_cls,ours_cls,args,kwargs", CONSTRUCTIONS, ids=CONSTRUCTION_IDS)
def test_pickle_deepcopy_torch_save(theirs_cls, ours_cls, args, kwargs):
    extra = {"reset_after": False} if ours_cls in (rnnkern.GRU, rnnkern.GRUCell) else {}
    m = ours_cls(*args, **kwargs, **extra, backend="reference").double().eval()
    x = randn(generator("pickle", theirs_cls.__name__), 5, 2, 3)
    want = _run_module(m, x)
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    copies = [pickle.loads(pickle.dumps(m)), copy.deepcopy(m), torch.load(buffer, weights_only=False)]
    for c in copies:
        assert type(c) is ours_cls and c.backend == "reference" and c.reset_after == (not extra)
        assert repr(c) == repr(m)
        for a, b in zip(_run_module(c, x), want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("cls", [rnnkern.RNN, rnnkern.GRU, rnnkern.LSTM])
def test_flatten_parameters_is_accepted(cls):
    m = cls(3, 5, num_layers=2, backend="cpu").double()
    x = randn(generator("flatten", cls.__name__), 4, 2, 3)
    want = _run_module(m, x)
    assert m.flatten_parameters() is None
    for a, b in zip(_run_module(m, x), want):
        assert torch.equal(a, b)


def test_functional_call_uses_the_given_parameters():
    m = rnnkern.LSTM(3, 5, num_layers=2, backend="cpu").double()
    other = rnnkern.LSTM(3, 5, num_layers=2, backend="cpu").double()
    x = randn(generator("functional-call"), 4, 2, 3)
    got = torch.func.functional_call(m, dict(other.named_parameters()), (x,))
    for a, b in zip(torch.utils._pytree.tree_leaves(got), _run_module(other, x)):
        assert torch.equal(a, b)


# ------------------------------------------------ weights that are computed ----
# Parametrizations (weight_norm, spectral_norm, orthogonal: torch.nn.utils.
# parametrize) make a weight a property computed on every read, and a stateful
# one changes with each read: spectral_norm runs a step of its power iteration
# per evaluation in training.  torch.nn's forward reads its weights more than
# once; rnnkern reads them as it does, so the same model trains to the same
# numbers.  (Before, rnnkern read each weight once per call: a spectral-normed
# RNN drifted from torch.nn's by 0.9 within four calls.)

PARAMETRIZED_MODULES = [("RNN", {}), ("GRU", {"num_layers": 2, "bidirectional": True}),
                        ("LSTM", {}), ("LSTM", {"proj_size": 3}), ("RNNCell", {}), ("GRUCell", {}),
                        ("LSTMCell", {})]
PARAMETRIZED_IDS = ["RNN", "GRU_2bi", "LSTM", "LSTM_proj3", "RNNCell", "GRUCell", "LSTMCell"]


class _CountedReads(nn.Module):
    """A parametrization that counts its evaluations, by weight name; it returns
    a new tensor (as weight_norm does) or the original itself (torch.nn's
    forward then reads the first weight less often)."""

    def __init__(self, counts, name, new_tensor):
        super().__init__()
        self.counts, self.name, self.new_tensor = counts, name, new_tensor

    def forward(self, w):
        self.counts[self.name] = self.counts.get(self.name, 0) + 1
        return w * 1.0 if self.new_tensor else w


def _weight_names(m):
    return list(m._flat_weights_names) if isinstance(m, nn.RNNBase) else \
        ["weight_ih", "weight_hh", "bias_ih", "bias_hh"]


# (a cell takes one step, unpacked: its one form is "sequence")
PARAMETRIZED_READS = [
    pytest.param(name, kwargs, form, id=f"{i}-{form}")
    for i, (name, kwargs) in zip(PARAMETRIZED_IDS, PARAMETRIZED_MODULES)
    for form in (["sequence"] if "Cell" in name else ["sequence", "one-step", "packed"])]


@pytest.mark.parametrize("name,kwargs,form", PARAMETRIZED_READS)
@pytest.mark.parametrize("new_tensor", [True, False], ids=["new", "same"])
def test_parametrized_weights_are_read_as_torch_nn_reads_them(name, kwargs, form, new_tensor):
    g = generator("parametrized-reads", name, form)
    x = randn(g, 6 if form != "one-step" else 1, 3, 4)
    if "Cell" in name:
        x = x[0]
    elif form == "packed":
        x = pack_padded_sequence(x, torch.tensor([6, 4, 1]))

    def reads(make):
        counts = {}
        m = make(getattr(nn, name)(4, 5, dtype=torch.float64, **kwargs))
        for w in _weight_names(m):
            torch.nn.utils.parametrize.register_parametrization(
                m, w, _CountedReads(counts, w, new_tensor))
        per_call = []
        for grad in (True, False):
            counts.clear()
            with torch.set_grad_enabled(grad):
                m(x)
            per_call.append(dict(counts))
        return per_call

    want = reads(lambda m: m)
    assert all(want), "the parametrization is read"
    for backend in ("auto", "cpu", "reference"):
        def ours(m, backend=backend):
            m = rnnkern.convert(m)
            m.backend = backend
            return m
        assert reads(ours) == want, backend


@pytest.mark.parametrize("name,kwargs", PARAMETRIZED_MODULES, ids=PARAMETRIZED_IDS)
@pytest.mark.parametrize("backend", ["auto", "cpu", "reference"])
def test_spectral_norm_trains_as_torch_nn(name, kwargs, backend):
    spectral_norm = torch.nn.utils.parametrizations.spectral_norm
    torch.manual_seed(6)
    theirs = getattr(nn, name)(4, 5, dtype=torch.float64, **kwargs)
    ours = getattr(nn, name)(4, 5, dtype=torch.float64, **kwargs)
    for m in (theirs, ours):
        for w in _weight_names(m)[:2]:  # W_ih and W_hh of the first layer
            spectral_norm(m, w)
    ours.load_state_dict(theirs.state_dict())  # the power iteration's u, v too
    ours = rnnkern.convert(ours)
    ours.backend = backend
    g = generator("spectral-norm", name, backend)
    for step in range(4):
        x = randn(g, 1 if step == 2 else 6, 3, 4)  # a one-step call among them
        outs = [_run_module(m, x) for m in (ours, theirs)]
        for a, b in zip(*outs):
            assert_close(a, b, what=f"call {step}")
        for m, out in zip((ours, theirs), outs):
            sum(o.sum() for o in out).backward()
        for (n, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert_close(a.grad, b.grad, what=f"call {step}: grad {n}")
    for m in (ours, theirs):
        m.eval()
    x = randn(g, 6, 3, 4)
    for a, b in zip(_run_module(ours, x), _run_module(theirs, x)):
        assert_close(a, b, what="eval")


def test_a_weight_replaced_by_a_plain_tensor_each_call():
    """fastai's WeightDropout (AWD-LSTM): W_hh deleted as a parameter and set
    anew, a dropped-out copy of a raw parameter, before every call."""
    torch.manual_seed(7)
    raw = nn.Parameter(torch.randn(20, 5, dtype=torch.float64))
    g = generator("weight-dropout")
    x = randn(g, 6, 3, 4)
    results = []
    for make in (lambda m: m, rnnkern.convert):
        torch.manual_seed(8)
        m = make(nn.LSTM(4, 5, dtype=torch.float64))
        del m.weight_hh_l0
        raw.grad = None
        outs = []
        for _ in range(2):
            m.weight_hh_l0 = torch.nn.functional.dropout(raw, p=0.5)
            out = m(x)[0]
            out.sum().backward()
            outs.append(out.detach())
        results.append((outs, raw.grad.clone(), m.weight_ih_l0.grad))
    (ours, ours_raw, ours_ih), (theirs, theirs_raw, theirs_ih) = results[1], results[0]
    for a, b in zip(ours, theirs):
        assert_close(a, b)
    assert_close(ours_raw, theirs_raw, what="the raw weight's gradient")
    assert_close(ours_ih, theirs_ih, what="W_ih's gradient")


# --------------------------------------------------------------- autocast ----

AUTOCAST_MODULES = [("RNN", {}), ("GRU", {}), ("LSTM", {}), ("LSTM", {"proj_size": 3})]
AUTOCAST_IDS = ["RNN", "GRU", "LSTM", "LSTM_proj3"]


def _autocast_pair(name, kwargs, device="cpu"):
    torch.manual_seed(11)
    theirs = getattr(nn, name)(I, H, num_layers=2, bidirectional=True, **kwargs).to(device)
    ours = getattr(rnnkern, name)(I, H, num_layers=2, bidirectional=True, **kwargs).to(device)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def _autocast_run(m, form, x, hx, is_twin):
    lengths = torch.tensor([5, 2, 6, 2])
    if form == "packed":
        out, hidden = m(pack_padded_sequence(x, lengths, enforce_sorted=False), hx)
        out = out.data
    elif form == "lengths" and is_twin:
        out, hidden = m(pack_padded_sequence(x, lengths, enforce_sorted=False), hx)
        out = pad_packed_sequence(out, total_length=T)[0]
    elif form == "lengths":
        out, hidden = m(x, hx, lengths=lengths)
    elif form == "unbatched":
        out, hidden = m(x[:, 0], None if hx is None else torch.utils._pytree.tree_map(lambda h: h[:, 0], hx))
    else:
        out, hidden = m(x, hx)
    return [out, *(hidden if isinstance(hidden, tuple) else (hidden,))]


def _autocast_rule(name, kwargs, form, x_dtype, hx_dtype, dtype=torch.bfloat16):
    """rnnkern's CPU autocast result dtypes (README, "torch.autocast"), written out
    independently of rnnkern.modules: the same on every CPU.  The kernels run in
    the autocast dtype; a float32 state promotes the states torch.nn's ATen path
    keeps in float32 (GRU's h, and LSTM's c and h when packed or projected), and
    an unpacked LSTM without projection returns the autocast dtype throughout."""
    h0 = hx_dtype or x_dtype  # no hx: zeros in the input's dtype
    promoted = torch.promote_types(dtype, h0)
    if name == "RNN":
        return [dtype, dtype]
    if name == "GRU":
        return [promoted, promoted]
    proj = bool(kwargs.get("proj_size"))
    if form in ("padded", "unbatched") and not proj:
        return [dtype, dtype, dtype]
    return [dtype if proj else promoted, dtype if proj else promoted, promoted]


def _torch_nn_autocast_is_isa_dependent(name, kwargs, form):
    """torch.nn's CPU LSTM without projection on unpacked input goes through oneDNN,
    whose bfloat16 support depends on the CPU (with AVX-512 it returns bfloat16
    states; without, it raises for float32 input or returns float32 states): there
    torch.nn is no yardstick.  Every other case runs ATen's CPU code on any CPU."""
    return name == "LSTM" and not kwargs.get("proj_size") and form in ("padded", "unbatched")


def _aten_run(m, form, x, hx):
    """torch.nn with oneDNN turned off: its ATen CPU code, the same numerics on
    every CPU, of the same function."""
    with torch.backends.mkldnn.flags(enabled=False):
        return _autocast_run(m, form, x, hx, True)


@pytest.mark.parametrize("name,kwargs", AUTOCAST_MODULES, ids=AUTOCAST_IDS)
@pytest.mark.parametrize("form", ["padded", "lengths", "packed", "unbatched"])
@pytest.mark.parametrize("hx_dtype", [None, torch.float32, torch.bfloat16], ids=["nohx", "hx32", "hx16"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x32", "x16"])
def test_autocast_cpu_bfloat16_dtypes_and_values(name, kwargs, form, hx_dtype, x_dtype):
    """Under CPU bf16 autocast, every result has the dtype of rnnkern's rule
    (_autocast_rule), which is torch.nn's wherever torch.nn does not depend on
    the CPU's ISA, and its error against float32 is no worse than twice the error
    of torch.nn's own low-precision run of the same function."""
    ours, theirs = _autocast_pair(name, kwargs)
    g = generator("autocast", name, form, str(hx_dtype), str(x_dtype))
    x = randn(g, T, B, I, dtype=torch.float32)
    hx = None
    if hx_dtype is not None:
        P = kwargs.get("proj_size") or H
        h = randn(g, 4, B, P, dtype=torch.float32, scale=0.5)
        hx = (h, randn(g, 4, B, H, dtype=torch.float32, scale=0.5)) if name == "LSTM" else h
    full = _autocast_run(theirs, form, x, hx, True)  # float32, no autocast
    cast = lambda t: t.to(hx_dtype)  # noqa: E731
    hx_lp = None if hx is None else torch.utils._pytree.tree_map(cast, hx)
    isa_dependent = _torch_nn_autocast_is_isa_dependent(name, kwargs, form)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if isa_dependent:
            want = _aten_run(theirs, form, x.to(x_dtype), hx_lp)
        else:
            want = _autocast_run(theirs, form, x.to(x_dtype), hx_lp, True)
        got = _autocast_run(ours, form, x.to(x_dtype), hx_lp, False)
    assert [t.dtype for t in got] == _autocast_rule(name, kwargs, form, x_dtype, hx_dtype)
    if not isa_dependent:
        assert [t.dtype for t in got] == [t.dtype for t in want]
    for i, (a, b, c) in enumerate(zip(got, want, full)):
        assert_low_precision(a, b, c, what=f"result {i}")


@pytest.mark.parametrize("name", ["RNNCell", "GRUCell", "LSTMCell"])
@pytest.mark.parametrize("hx_dtype", [None, torch.float32, torch.bfloat16], ids=["nohx", "hx32", "hx16"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x32", "x16"])
def test_autocast_cpu_bfloat16_cells(name, hx_dtype, x_dtype):
    torch.manual_seed(12)
    theirs = getattr(nn, name)(I, H)
    ours = getattr(rnnkern, name)(I, H)
    ours.load_state_dict(theirs.state_dict())
    g = generator("autocast-cell", name, str(hx_dtype), str(x_dtype))
    x = randn(g, B, I, dtype=x_dtype)
    hx = None
    if hx_dtype is not None:
        hx = randn(g, B, H, dtype=hx_dtype, scale=0.5)
        hx = (hx, randn(g, B, H, dtype=hx_dtype, scale=0.5)) if name == "LSTMCell" else hx
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.utils._pytree.tree_leaves(theirs(x, hx))
        got = torch.utils._pytree.tree_leaves(ours(x, hx))
    assert [t.dtype for t in got] == [t.dtype for t in want]


def test_autocast_backward_gives_parameter_dtype_gradients():
    """Under CPU bf16 autocast the parameter gradients are float32 (the
    parameters' dtype) like torch.nn's, and their error against torch.nn's
    float32 gradients (no autocast) is at most LOW_PRECISION_FACTOR times the
    error of torch.nn's own bf16 autocast run (the low-precision criterion of
    conftest.assert_low_precision): a gradient is a sum over every step of
    bf16-rounded products, so no fixed relative bound holds across sizes."""
    ours, theirs = _autocast_pair("GRU", {})
    x = randn(generator("autocast-bwd"), T, B, I, dtype=torch.float32)
    out, h = theirs(x)
    full = torch.autograd.grad(out.sum() + h.sum(), list(theirs.parameters()))
    for m in (ours, theirs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, h = m(x)
        (out.float().sum() + h.float().sum()).backward()
    for (name, a), b, c in zip(ours.named_parameters(), theirs.parameters(), full):
        assert a.grad.dtype == b.grad.dtype == torch.float32, name
        assert_low_precision(a.grad, b.grad, c, what=name)


@pytest.mark.parametrize("name,kwargs", AUTOCAST_MODULES, ids=AUTOCAST_IDS)
@pytest.mark.parametrize("form", ["padded", "packed"])
def test_autocast_run_dtype_other_than_autocast_dtype(monkeypatch, name, kwargs, form):
    """On CUDA the modules run in float16 under bfloat16 autocast, as cuDNN's RNN
    does: every product then runs in the run dtype, not autocast's (an H100 run
    found the input projection autocast to bfloat16 meeting float16 weights).
    The same split here on the CPU: bfloat16 autocast, a float16 run; results in
    float16 whose values match the float16 run without autocast."""
    ours, _ = _autocast_pair(name, kwargs)
    monkeypatch.setattr(type(ours), "_run_dtype_under_autocast", lambda self, device, weight: torch.float16)
    monkeypatch.setattr(type(ours), "_autocast_result_dtypes",
                        lambda self, x, hx, dtype, packed: (dtype,) * (1 + len(hx)))
    x = randn(generator("autocast-split", name, form), T, B, I, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _autocast_run(ours, form, x, None, False)
    assert [t.dtype for t in got] == [torch.float16] * len(got)
    want = _autocast_run(ours.half(), form, x.half(), None, False)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"result {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name,kwargs", AUTOCAST_MODULES, ids=AUTOCAST_IDS)
@pytest.mark.parametrize("form", ["padded", "packed"])
def test_autocast_cuda_dtypes(dtype, name, kwargs, form):
    ours, theirs = _autocast_pair(name, kwargs, device="cuda")
    x = torch.randn(T, B, I, device="cuda")
    full = _autocast_run(theirs, form, x, None, True)  # float32, no autocast
    with torch.autocast("cuda", dtype=dtype):
        want = _autocast_run(theirs, form, x, None, True)
        got = _autocast_run(ours, form, x, None, False)
    assert [t.dtype for t in got] == [t.dtype for t in want]
    # Values: the error against torch.nn's float32 run at most twice that of
    # torch.nn's own run under the same autocast (conftest.assert_low_precision).
    for i, (a, b, c) in enumerate(zip(got, want, full)):
        assert_low_precision(a, b, c, what=f"result {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["RNNCell", "GRUCell", "LSTMCell"])
def test_autocast_cuda_cells(dtype, name):
    theirs = getattr(nn, name)(I, H).cuda()
    ours = getattr(rnnkern, name)(I, H).cuda()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(B, I, device="cuda")
    full = torch.utils._pytree.tree_leaves(theirs(x))  # float32, no autocast
    with torch.autocast("cuda", dtype=dtype):
        want = torch.utils._pytree.tree_leaves(theirs(x))
        got = torch.utils._pytree.tree_leaves(ours(x))
    assert [t.dtype for t in got] == [t.dtype for t in want]
    for i, (a, b, c) in enumerate(zip(got, want, full)):
        assert_low_precision(a, b, c, what=f"result {i}")


# ------------------------------------------------------- backend coverage ----

@pytest.mark.parametrize("option,build,run", [
    ("proj_size", lambda: rnnkern.LSTM(3, 5, proj_size=2, backend="cpu"), lambda m: m(torch.randn(4, 2, 3))),
    ("variable lengths", lambda: rnnkern.GRU(3, 5, backend="cpu"),
     lambda m: m(torch.randn(4, 2, 3), lengths=[4, 2])),
    ("variable lengths", lambda: rnnkern.GRU(3, 5, backend="cpu"),
     lambda m: m(pack_padded_sequence(torch.randn(4, 2, 3), [4, 2]))),
    ("reset_after=False", lambda: rnnkern.GRU(3, 5, reset_after=False, backend="cpu"),
     lambda m: m(torch.randn(4, 2, 3))),
    ("nonlinearity='relu'", lambda: rnnkern.RNN(3, 5, nonlinearity="relu", backend="cpu"),
     lambda m: m(torch.randn(4, 2, 3))),
    ("torch.float64", lambda: rnnkern.LSTM(3, 5, backend="cpu").double(),
     lambda m: m(torch.randn(4, 2, 3, dtype=torch.float64))),
    ("cells", lambda: rnnkern.LSTMCell(3, 5, backend="cpu"), lambda m: m(torch.randn(2, 3))),
], ids=["proj", "lengths", "packed", "reset_before", "relu", "float64", "cells"])
def test_unsupported_option_names_the_backends_that_can(monkeypatch, option, build, run):
    """A backend lacking an option (declared in modules.UNSUPPORTED, the one
    place) raises NotImplementedError naming the option and the backends that
    support it, before running anything."""
    monkeypatch.setitem(modules.UNSUPPORTED, "cpu", frozenset({option}))
    monkeypatch.setitem(modules.UNSUPPORTED, "cuda", frozenset({option}))
    calls = []
    monkeypatch.setattr(ops, "recurrence", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(ops, "step", lambda *a, **k: calls.append(a))
    m = build()
    with pytest.raises(NotImplementedError) as e:
        run(m)
    assert option in str(e.value)
    assert "backend='cpu'" in str(e.value) and "reference, triton" in str(e.value)
    assert calls == []


def test_coverage_table_names_every_backend():
    assert set(modules.UNSUPPORTED) == set(ops.BACKENDS) - {"auto"}

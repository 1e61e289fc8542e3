"""LayerNormLSTM and LayerNormLSTMCell against the loop written in tests/options_truth.py;
their parameters, initialisation and serialisation, and zoneout's torch.nn compatibility."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import rnnkern
from conftest import generator, randn
from options_truth import (B, BACKENDS, H, I, T, compare, flat, ln_lstm_step, loop_module,
                           make_cell, make_module, raises_unsupported, randomize_ln, reset_inputs,
                           run_episodes_separately, state_leaves, values_and_grads)


# ------------------------------------------------------------ LayerNormLSTM ----

LN_FORMS = ("padded", "lengths", "packed_unsorted", "unbatched")
LN_CASES = [(b, f, bf) for b in BACKENDS for i, f in enumerate(LN_FORMS) for bf in (False, True)
            if b != "triton" or bf == (i % 2 == 1)]  # (the interpreter: each form once)
LN_IDS = [f"{f}-{'bf' if bf else 'tf'}-{b}" for b, f, bf in LN_CASES]


@pytest.mark.parametrize("backend,form,batch_first", LN_CASES, ids=LN_IDS)
def test_layer_norm_lstm_matches_the_loop(backend, form, batch_first):
    """Two layers, bidirectional, hx given: outputs, final states and every
    gradient against the loop of layer norms and LSTM equations written here."""
    m = make_module("lstm_ln", backend, num_layers=2, bidirectional=True, batch_first=batch_first)
    key = ("ln-module", form, batch_first)
    g = generator(*key)
    lengths = [5, 7, 2] if form != "padded" and form != "unbatched" else [T] * B
    unbatched = form == "unbatched"
    x_tm = randn(g, T, 1 if unbatched else B, I)
    x = (x_tm.squeeze(1) if unbatched else x_tm.transpose(0, 1) if batch_first else x_tm) \
        .contiguous().requires_grad_()
    hx = state_leaves(m, B, key, unbatched=unbatched)

    def ours():
        if form == "packed_unsorted":
            packed = pack_padded_sequence(x, torch.tensor(lengths), batch_first=batch_first,
                                          enforce_sorted=False)
            out, hidden = m(packed, hx)
            out = pad_packed_sequence(out, batch_first=batch_first, total_length=T)[0]
            return flat((out, hidden))
        kw = {"lengths": torch.tensor(lengths)} if form == "lengths" else {}
        return flat(m(x, hx, **kw))

    if raises_unsupported(backend, ("LayerNormLSTM",), ours):
        return
    leaves = [x, *hx, *m.parameters()]
    got = values_and_grads(ours(), leaves, key)
    if unbatched:
        want = loop_module(m, x.unsqueeze(1), tuple(h.unsqueeze(1) for h in hx))
        want = [want[0].squeeze(1)] + [s.squeeze(1) for s in want[1:]]
    else:
        want = loop_module(m, x.transpose(0, 1) if batch_first else x, hx,
                           lengths if form != "padded" else None)
        if batch_first:
            want[0] = want[0].transpose(0, 1)
    want = values_and_grads(want, leaves, key)
    labels = ["output", "h_n", "c_n", "grad input", "grad h0", "grad c0"] + \
        [f"grad {n}" for n, _ in m.named_parameters()]
    compare(got, want, labels, f"{backend} {form}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_layer_norm_lstm_without_hx(backend, bias):
    m = make_module("lstm_ln", backend, bias=bias)
    x = randn(generator("ln-no-hx", bias), T, B, I)
    if raises_unsupported(backend, ("LayerNormLSTM",), lambda: m(x)):
        return
    compare(flat(m(x)), loop_module(m, x, None), ["output", "h_n", "c_n"], backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["batched", "unbatched", "no-hx"])
def test_layer_norm_lstm_cell_matches_the_step(backend, form):
    """LayerNormLSTMCell: (h, c) and every gradient against the step written here."""
    cell = make_cell("LayerNormLSTMCell", backend)
    g = generator("ln-cell", form)
    x = randn(g, *((I,) if form == "unbatched" else (B, I)), requires_grad=True)
    hx = None if form == "no-hx" else tuple(
        randn(g, *((H,) if form == "unbatched" else (B, H)), scale=0.5, requires_grad=True)
        for _ in range(2))
    if raises_unsupported(backend, ("LayerNormLSTM",), lambda: cell(x, hx)):
        return
    got = list(cell(x, hx))
    x2 = x if form != "unbatched" else x.unsqueeze(0)
    states = (torch.zeros(B, H, dtype=torch.float64),) * 2 if hx is None else \
        tuple(h if form != "unbatched" else h.unsqueeze(0) for h in hx)
    want = list(ln_lstm_step(cell, "", x2, *states))
    if form == "unbatched":
        want = [w.squeeze(0) for w in want]
    leaves = [x, *(hx or ()), *cell.parameters()]
    compare(values_and_grads(got, leaves, ("ln-cell", form)),
            values_and_grads(want, leaves, ("ln-cell", form)),
            ["h", "c", "grad x"] + [f"grad hx[{i}]" for i in range(len(hx or ()))]
            + [f"grad {n}" for n, _ in cell.named_parameters()], f"{backend} {form}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_norm_lstm_with_resets_and_packed_zoneout_eval(backend):
    """LayerNormLSTM with every option through a PackedSequence (evaluation,
    zoneout p, resets, two layers, bidirectional): the episodes run separately
    through the loop with the blend, values and gradients."""
    p = 0.25
    m = make_module("lstm_ln", backend, num_layers=2, bidirectional=True, zoneout=p).eval()
    x, resets, lengths = reset_inputs(("ln-all",), False)
    hx = state_leaves(m, B, ("ln-all",))
    packed = pack_padded_sequence(x, torch.tensor(lengths), enforce_sorted=False)

    def call():
        out, hidden = m(packed, hx, resets=resets)
        return flat((pad_packed_sequence(out, total_length=T)[0], hidden))

    if raises_unsupported(backend, ("LayerNormLSTM", "resets", "zoneout"), call):
        return
    leaves = [x, *hx, *m.parameters()]
    got = values_and_grads(call(), leaves, ("ln-all",))
    want = values_and_grads(run_episodes_separately(m, x, resets, lengths, hx, p=p), leaves, ("ln-all",))
    compare(got, want, ["output", "h_n", "c_n", "grad input", "grad h0", "grad c0"]
            + [f"grad {n}" for n, _ in m.named_parameters()], backend)


# ------------------------------------------------- parameters and serialisation ----

def test_layer_norm_lstm_parameters_and_initialisation():
    """torch.nn.LSTM's parameters first, drawn as torch.nn.LSTM draws them (same
    seed, same values), then the layer norms': gains 1, shift 0."""
    torch.manual_seed(9)
    theirs = nn.LSTM(3, 5, num_layers=2, bidirectional=True)
    torch.manual_seed(9)
    ours = rnnkern.LayerNormLSTM(3, 5, num_layers=2, bidirectional=True)
    assert not isinstance(ours, nn.LSTM) and isinstance(ours, nn.RNNBase)
    names = [n for n, _ in ours.named_parameters()]
    torch_names = [n for n, _ in theirs.named_parameters()]
    assert names[:len(torch_names)] == torch_names
    ln_names = [f"{stem}_l{k}{sfx}" for k in range(2) for sfx in ("", "_reverse")
                for stem in ("ln_ih_weight", "ln_hh_weight", "ln_cell_weight", "ln_cell_bias")]
    assert names[len(torch_names):] == ln_names
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name
    for name in ln_names:
        value = getattr(ours, name)
        assert value.shape == ((20,) if "ih" in name or "hh" in name else (5,))
        assert torch.equal(value, torch.full_like(value, 0.0 if "bias" in name else 1.0))
    ours.reset_parameters()
    assert torch.equal(ours.ln_cell_bias_l1_reverse, torch.zeros(5))
    assert repr(ours) == "LayerNormLSTM(3, 5, num_layers=2, bidirectional=True)"
    torch.manual_seed(9)
    cell_theirs = nn.LSTMCell(3, 5, bias=False)
    torch.manual_seed(9)
    cell = rnnkern.LayerNormLSTMCell(3, 5, bias=False, zoneout=0.1, backend="reference")
    assert [n for n, _ in cell.named_parameters()] == \
        ["weight_ih", "weight_hh", "ln_ih_weight", "ln_hh_weight", "ln_cell_weight", "ln_cell_bias"]
    assert torch.equal(cell.weight_ih, cell_theirs.weight_ih)
    assert torch.equal(cell.weight_hh, cell_theirs.weight_hh)
    assert repr(cell) == "LayerNormLSTMCell(3, 5, bias=False, zoneout=0.1, backend='reference')"
    assert rnnkern.convert(ours) is ours and type(ours) is rnnkern.LayerNormLSTM


def test_torch_nn_lstm_state_dict_loads_without_the_layer_norms():
    """A torch.nn.LSTM checkpoint loads with strict=False: only the layer norms'
    entries are missing, and the weights are the LSTM's."""
    theirs = nn.LSTM(3, 5, num_layers=2, bidirectional=True, bias=False)
    ours = rnnkern.LayerNormLSTM(3, 5, num_layers=2, bidirectional=True, bias=False)
    result = ours.load_state_dict(theirs.state_dict(), strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == [n for n, _ in ours.named_parameters() if n.startswith("ln_")]
    for name, value in theirs.state_dict().items():
        assert torch.equal(getattr(ours, name), value), name


def test_layer_norm_lstm_factory_kwargs():
    m = rnnkern.LayerNormLSTM(3, 5, device="meta", dtype=torch.float64)
    assert all(p.is_meta and p.dtype == torch.float64 for p in m.parameters())
    c = rnnkern.LayerNormLSTMCell(3, 5, device="meta", dtype=torch.float16)
    assert all(p.is_meta and p.dtype == torch.float16 for p in c.parameters())


@pytest.mark.parametrize("make", [
    lambda: rnnkern.LayerNormLSTM(3, 4, num_layers=2, bidirectional=True, zoneout=0.2,
                                  backend="reference"),
    lambda: rnnkern.LayerNormLSTMCell(3, 4, zoneout=0.2, backend="reference"),
], ids=["LayerNormLSTM", "LayerNormLSTMCell"])
def test_layer_norm_state_dict_pickle_deepcopy_torch_save(make):
    torch.manual_seed(2)
    source = make().double().eval()
    randomize_ln(source)
    torch.manual_seed(3)
    target = make().double().eval()
    target.load_state_dict(source.state_dict())
    x = randn(generator("ln-state-dict"), *((5, 2, 3) if isinstance(source, nn.RNNBase) else (2, 3)))

    def run(m):
        return torch.utils._pytree.tree_leaves(m(x))

    want = run(source)
    buffer = io.BytesIO()
    torch.save(source, buffer)
    buffer.seek(0)
    copies = [target, pickle.loads(pickle.dumps(source)), copy.deepcopy(source),
              torch.load(buffer, weights_only=False)]
    for m in copies:
        assert m.zoneout == 0.2 and m.backend == "reference"
        for a, b in zip(run(m), want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("theirs_cls,ours_cls,args", [
    (nn.RNN, rnnkern.RNN, (3, 5)), (nn.GRU, rnnkern.GRU, (3, 5)), (nn.LSTM, rnnkern.LSTM, (3, 5)),
    (nn.RNNCell, rnnkern.RNNCell, (3, 5)), (nn.GRUCell, rnnkern.GRUCell, (3, 5)),
    (nn.LSTMCell, rnnkern.LSTMCell, (3, 5)),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_zoneout_keeps_torch_nn_compatibility(theirs_cls, ours_cls, args):
    """zoneout is a plain attribute: the state_dict is torch.nn's (both ways), the
    repr is torch.nn's at 0 and names zoneout otherwise, pickling keeps it, and
    a module pickled before it existed reads 0."""
    torch.manual_seed(1)
    theirs = theirs_cls(*args)
    torch.manual_seed(1)
    ours = ours_cls(*args, zoneout=0.25)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert repr(ours_cls(*args)) == repr(theirs)
    assert repr(ours) == repr(theirs)[:-1] + ", zoneout=0.25)"
    assert pickle.loads(pickle.dumps(ours)).zoneout == 0.25
    old = pickle.loads(pickle.dumps(ours))
    del old.__dict__["zoneout"]  # as unpickled from before the attribute existed
    assert old.zoneout == 0.0 and repr(old) == repr(theirs)
    assert rnnkern.convert(theirs).zoneout == 0.0

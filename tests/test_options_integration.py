"""The options (resets, zoneout, LayerNormLSTM) under autocast, torch.compile, tracing and
export, and their bad input (tests/options_truth.py has the truths)."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import rnnkern
from rnnkern import modules, ops
from conftest import assert_close, generator, randn
from options_truth import (B, BACKENDS, I, T, cell_states, compare, flat, make_cell, make_module,
                           raises_unsupported, reset_inputs, used, values_and_grads)


# --------------------------------------------------------------- autocast ----

@pytest.mark.parametrize("cell,form", [("lstm_ln", "packed"), ("lstm_ln", "padded"),
                                       ("gru", "padded"), ("lstm", "lengths")])
def test_autocast_runs_the_options_in_the_autocast_dtype(cell, form):
    """CPU bfloat16 autocast with resets and zoneout (evaluation): the numbers of
    the same module cast to bfloat16 (reference backend, bitwise), and the
    result dtypes of the README's rule (LayerNormLSTM: all bfloat16)."""
    m = make_module(cell, "reference", num_layers=2, bidirectional=True, zoneout=0.3,
                    dtype=torch.float32).eval()
    low = copy.deepcopy(m).to(torch.bfloat16)
    x, resets, lengths = reset_inputs(("autocast", cell, form), False)
    x = x.detach().float()

    def call(module, inp):
        if form == "packed":
            out, hidden = module(pack_padded_sequence(inp, torch.tensor(lengths), enforce_sorted=False),
                                 resets=resets)
            return flat((pad_packed_sequence(out, total_length=T)[0], hidden))
        kw = {"lengths": torch.tensor(lengths)} if form == "lengths" else {}
        return flat(module(inp, resets=resets, **kw))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = call(m, x)
    want = call(low, x.to(torch.bfloat16))
    for a, b in zip(got, want):
        assert torch.equal(a.to(torch.bfloat16), b)
    # LayerNormLSTM: all in the autocast dtype; GRU and the LSTM with lengths
    # promote with the (absent, so the input's) float32 state.
    want_dtype = torch.bfloat16 if cell == "lstm_ln" else torch.float32
    assert all(t.dtype == want_dtype for t in got), [t.dtype for t in got]


def test_autocast_cell_zoneout():
    c = make_cell("LayerNormLSTMCell", "reference", zoneout=0.3).float().eval()
    low = copy.deepcopy(c).to(torch.bfloat16)
    x = randn(generator("autocast-cell"), B, I, dtype=torch.float32)
    hx = tuple(h.detach().float() for h in cell_states("LSTMCell", ("autocast",)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = c(x, hx)
    want = low(x.to(torch.bfloat16), tuple(h.to(torch.bfloat16) for h in hx))
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


# ---------------------------------------------------------- torch.compile ----

@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled_and_eager(m, make_call, key):
    """fullgraph compile (aot_eager: Dynamo and AOTAutograd without inductor's
    code generation, to keep CI fast) against eager: values and the gradients
    of the call's leaves and every parameter."""
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, m):
        result, leaves = make_call(fn)
        results.append(values_and_grads(result, leaves + list(m.parameters()), key))
    for k, (a, b) in enumerate(zip(*results)):
        assert_close(a, b, what=f"{key} result {k}")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("form", ["padded", "lengths"])
def test_compile_lstm_with_resets_and_zoneout(backend, form, dynamo):
    """torch.compile(fullgraph=True) of LSTM with resets= and zoneout
    (evaluation) agrees with eager, values and gradients (the flag torch.nn's
    classes need, see the README)."""
    m = make_module("lstm", backend, num_layers=2, bidirectional=True, zoneout=0.3,
                    batch_first=True, input_size=2, hidden_size=3).eval()
    g = generator("compile-resets", form)
    Tc, Bc = 4, 3
    resets = torch.zeros(Bc, Tc, dtype=torch.bool)
    resets[0, 2] = resets[2, 1] = True
    kw = {"lengths": torch.tensor([4, 2, 3])} if form == "lengths" else {}
    x0 = randn(g, Bc, Tc, 2)

    def make_call(fn):
        x = x0.clone().requires_grad_()
        return flat(fn(x, resets=resets, **kw)), [x]

    if raises_unsupported(backend, ("resets", "zoneout"), lambda: make_call(m)):
        return
    with torch._dynamo.config.patch(allow_rnn=True):
        compiled_and_eager(m, make_call, ("compile", backend, form))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_compile_layer_norm_lstm_packed_without_the_flag(backend, dynamo):
    """LayerNormLSTM is no torch.nn.LSTM: Dynamo compiles it without
    allow_rnn, with a PackedSequence and resets."""
    m = make_module("lstm_ln", backend, bidirectional=True, input_size=2, hidden_size=3)
    g = generator("compile-ln")
    x0 = randn(g, 4, 3, 2)
    resets = torch.tensor([[0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=torch.bool)

    def make_call(fn):
        x = x0.clone().requires_grad_()
        out, hidden = fn(pack_padded_sequence(x, torch.tensor([4, 2, 3]), enforce_sorted=False),
                         resets=resets)
        return flat((out, hidden)), [x]

    if raises_unsupported(backend, ("LayerNormLSTM", "resets"), lambda: make_call(m)):
        return
    with torch._dynamo.config.patch(allow_rnn=False):
        compiled_and_eager(m, make_call, ("compile-ln", backend))


def test_compile_zoneout_training_and_cells(dynamo):
    """Training masks are drawn inside the compiled graph: p = 1 keeps the state
    (a deterministic check of the compiled mask path); a LayerNormLSTMCell
    with zoneout compiles and agrees with eager in evaluation."""
    m = make_module("gru", "reference", zoneout=1.0, input_size=2, hidden_size=3).train()
    x = randn(generator("compile-zoneout"), 4, 2, 2)
    h0 = randn(generator("compile-zoneout-h"), 1, 2, 3)
    with torch._dynamo.config.patch(allow_rnn=True):
        out, h = torch.compile(m, fullgraph=True, backend="aot_eager")(x, h0)
    assert torch.equal(out, h0.expand(4, 2, 3)) and torch.equal(h, h0)
    c = make_cell("LayerNormLSTMCell", "reference", zoneout=0.3).eval()
    xc = randn(generator("compile-cell"), B, I, requires_grad=True)
    hc = cell_states("LSTMCell", ("compile",))

    def make_call(fn):
        return list(fn(xc, hc)), [xc, *hc]

    compiled_and_eager(c, make_call, ("compile-cell",))


# ----------------------------------------------------------- trace and export ----

def quiet_trace(m, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.trace(m, args)


class WithResets(nn.Module):
    """A model taking the reset mask as an input, as an RL policy does."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, resets):
        return self.rnn(x, resets=resets)[0]


class Passing(nn.Module):
    """A model around a module, passing its arguments on."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args)


@pytest.mark.parametrize("make,args,words", [
    (lambda: WithResets(rnnkern.LSTM(3, 4, backend="reference")),
     (torch.randn(5, 2, 3), torch.zeros(5, 2, dtype=torch.bool)), r"forward\(resets=\.\.\.\): .*has no resets"),
    (lambda: rnnkern.GRU(3, 4, zoneout=0.2), (torch.randn(5, 2, 3),), r"GRU\(zoneout=0\.2\): .*has no zoneout"),
    (lambda: rnnkern.LSTMCell(3, 4, zoneout=0.2), (torch.randn(2, 3),), r"LSTMCell\(zoneout=0\.2\)"),
    (lambda: rnnkern.LayerNormLSTM(3, 4), (torch.randn(5, 2, 3),), "LayerNormLSTM: .*layer-normalised"),
    (lambda: rnnkern.LayerNormLSTMCell(3, 4), (torch.randn(2, 3),), "LayerNormLSTMCell: .*layer-normalised"),
], ids=["resets", "zoneout", "cell-zoneout", "LayerNormLSTM", "LayerNormLSTMCell"])
def test_trace_and_onnx_export_say_what_works_instead(make, args, words):
    """torch.jit.trace and ONNX export record torch.nn's forward, which has none
    of these: a clear error naming the option and torch.export / torch.compile."""
    m = make().eval()
    pattern = words + r".*torch\.export\.export or torch\.compile"
    with pytest.raises(NotImplementedError, match=pattern):
        quiet_trace(m, *args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NotImplementedError, match=pattern):
            # (inside a model: the TorchScript exporter passes every keyword-only
            # default of a bare module's forward positionally)
            torch.onnx.export(Passing(m), args, io.BytesIO(), dynamo=False)


@pytest.mark.parametrize("make", [lambda: rnnkern.LayerNormLSTM(3, 4),
                                  lambda: rnnkern.LayerNormLSTMCell(3, 4)], ids=["module", "cell"])
def test_jit_script_of_layer_norm_says_what_works_instead(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(RuntimeError, match=r"cannot compile rnnkern\.LayerNormLSTM.*"
                                               r"torch\.export\.export or torch\.compile"):
            torch.jit.script(make())


@pytest.mark.parametrize("backend", BACKENDS[:2])
@pytest.mark.parametrize("cell", ["lstm", "lstm_ln"])
def test_torch_export_captures_the_options(backend, cell):
    """torch.export.export of a model with resets as an input and zoneout in
    evaluation: rnnkern's ops in the graph (except on the reference backend,
    plain torch ops), the eager numbers and gradients."""
    rnn = make_module(cell, backend, bidirectional=True, zoneout=0.3).eval()
    m = WithResets(rnn)
    x, resets, _ = reset_inputs(("export", cell), False)
    x = x.detach()
    if raises_unsupported(backend, used(cell, "resets", "zoneout"), lambda: m(x, resets)):
        return
    ep = torch.export.export(m, (x, resets))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    if backend != "reference":
        assert any(t.startswith("rnnkern.") for t in targets), targets
    exported = ep.module()
    results = []
    for fn in (exported, m):
        xi = x.clone().requires_grad_()
        names, params = zip(*sorted(fn.named_parameters()))
        out = fn(xi, resets)
        results.append((names, values_and_grads([out], [xi, *params], ("export", cell))))
    (names, got), (want_names, want) = results
    assert names == want_names
    compare(got, want, ["output", "grad input"] + [f"grad {n}" for n in names], f"export {backend}")


# ------------------------------------------------------------------- errors ----

@pytest.mark.parametrize("case,bad,exc,words", [
    ("padded-list", lambda m, x: m(x, resets=[[True] * B] * T), TypeError, ["resets", "[T, B] = [7, 3]"]),
    ("padded-int64", lambda m, x: m(x, resets=torch.zeros(T, B, dtype=torch.int64)), TypeError,
     ["resets", "torch.bool", "torch.uint8", "floating", "torch.int64"]),
    ("padded-float-not-0-1", lambda m, x: m(x, resets=torch.full((T, B), 0.5)), ValueError,
     ["resets", "only 0 and 1", "0.5"]),
    ("padded-uint8-2", lambda m, x: m(x, resets=torch.full((T, B), 2, dtype=torch.uint8)), ValueError,
     ["resets", "only 0 and 1", "2"]),
    ("padded-trailing-2", lambda m, x: m(x, resets=torch.zeros(T, B, 2, dtype=torch.bool)), ValueError,
     ["resets", "[T, B] = [7, 3]", "[7, 3, 1]", "[7, 3, 2]"]),
    ("padded-shape", lambda m, x: m(x, resets=torch.zeros(B, T, dtype=torch.bool)), ValueError,
     ["resets", "[T, B] = [7, 3]", "[3, 7]"]),
    ("padded-1d", lambda m, x: m(x, resets=torch.zeros(T, dtype=torch.bool)), ValueError,
     ["resets", "[T, B] = [7, 3]"]),
    ("device", lambda m, x: m(x, resets=torch.zeros(T, B, dtype=torch.bool, device="meta")), ValueError,
     ["resets", "cpu", "meta"]),
    ("unbatched", lambda m, x: m(x[:, 0], resets=torch.zeros(T, 2, dtype=torch.bool)), ValueError,
     ["resets", "[T] = [7]"]),
    ("packed", lambda m, x: m(pack_padded_sequence(x, [7, 5, 2]), resets=torch.zeros(5, B, dtype=torch.bool)),
     ValueError, ["resets", "[T, B] = [7, 3]", "[5, 3]"]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_resets_are_named_before_any_kernel(case, bad, exc, words, monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "run_recurrence", lambda *a: calls.append(a))
    m = make_module("lstm", "reference")
    x = randn(generator("bad-resets"), T, B, I)
    with pytest.raises(exc) as e:
        bad(m, x)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert calls == []


def test_bad_resets_batch_first_names_its_layout():
    m = make_module("gru", "reference", batch_first=True)
    with pytest.raises(ValueError, match=r"resets of shape \[B, T\] \(batch_first\) = \[3, 7\] \(or \[3, 7, 1\]\), got \[7, 3\]"):
        m(randn(generator("bf"), B, T, I), resets=torch.zeros(T, B, dtype=torch.bool))


@pytest.mark.parametrize("cls", ["RNN", "GRU", "LSTM", "LayerNormLSTM", "RNNCell", "GRUCell",
                                 "LSTMCell", "LayerNormLSTMCell"])
@pytest.mark.parametrize("value", [-0.1, 1.5, True, "0.1", None], ids=str)
def test_bad_zoneout(cls, value):
    with pytest.raises(ValueError, match=r"zoneout should be a number in range \[0, 1\]"):
        getattr(rnnkern, cls)(3, 5, zoneout=value)


@pytest.mark.parametrize("kwargs,words", [
    (dict(hidden_size=0), ["hidden_size", "greater than zero"]),
    (dict(num_layers=0), ["num_layers", "greater than zero"]),
    (dict(dropout=1.5), ["dropout", "[0, 1]"]),
    (dict(bias="yes"), ["bias", "bool"]),
    (dict(backend="fortran"), ["fortran", "reference"]),
])
def test_layer_norm_lstm_bad_constructor_arguments(kwargs, words):
    args = dict(input_size=3, hidden_size=5) | kwargs
    with pytest.raises((ValueError, TypeError)) as e:
        rnnkern.LayerNormLSTM(**args)
    if "backend" not in kwargs:
        with pytest.raises(type(e.value)):
            nn.LSTM(**args)
    for w in words:
        assert w in str(e.value)
    with pytest.raises(TypeError, match="proj_size"):
        rnnkern.LayerNormLSTM(3, 5, proj_size=2)


def _ln_cell_pair():
    torch.manual_seed(0)
    return nn.LSTMCell(4, 5), rnnkern.LayerNormLSTMCell(4, 5, backend="reference")


@pytest.mark.parametrize("bad,words", [
    (lambda m: m(torch.randn(3, 6)), ["input_size", "6", "4"]),
    (lambda m: m(torch.randn(2, 3, 4)), ["1D or 2D", "3D"]),
    (lambda m: m(torch.randn(3, 4), torch.randn(3, 5)), ["hx", "tuple"]),
    (lambda m: m(torch.randn(3, 4), (torch.randn(2, 5), torch.randn(2, 5))), ["batch size", "3", "2"]),
    (lambda m: m(torch.randn(3, 4), (torch.randn(3, 6), torch.randn(3, 6))), ["hidden_size", "6", "5"]),
], ids=["input-size", "input-3d", "hx-not-pair", "hx-batch", "hx-size"])
def test_layer_norm_lstm_cell_bad_input_like_torch(bad, words):
    """The same exception types as torch.nn.LSTMCell's, messages naming the argument."""
    theirs, ours = _ln_cell_pair()
    with pytest.raises(Exception) as want:
        bad(theirs)
    with pytest.raises(type(want.value)) as got:
        bad(ours)
    for w in words:
        assert w in str(got.value), (w, str(got.value))


@pytest.mark.parametrize("option,build,run", [
    # (A reset in each mask: one that resets nothing needs no support -- the call
    # runs without resets, tests/test_options_resets.py.)
    ("resets", lambda: rnnkern.GRU(3, 5, backend="cpu"),
     lambda m: m(torch.randn(4, 2, 3), resets=torch.eye(4, 2, dtype=torch.bool))),
    ("resets", lambda: rnnkern.LSTM(3, 5, backend="cpu"),
     lambda m: m(pack_padded_sequence(torch.randn(4, 2, 3), [4, 2]),
                 resets=torch.eye(4, 2, dtype=torch.bool))),
    ("zoneout", lambda: rnnkern.RNN(3, 5, zoneout=0.1, backend="cpu"), lambda m: m(torch.randn(4, 2, 3))),
    ("zoneout", lambda: rnnkern.LSTM(3, 5, zoneout=0.1, backend="cpu").eval(),
     lambda m: m(torch.randn(4, 2, 3))),
    ("LayerNormLSTM", lambda: rnnkern.LayerNormLSTM(3, 5, backend="cpu"), lambda m: m(torch.randn(4, 2, 3))),
    ("LayerNormLSTM", lambda: rnnkern.LayerNormLSTMCell(3, 5, backend="cpu"), lambda m: m(torch.randn(2, 3))),
], ids=["resets", "resets-packed", "zoneout", "zoneout-eval", "LayerNormLSTM", "LayerNormLSTMCell"])
def test_unsupported_option_names_the_backends_that_can(monkeypatch, option, build, run):
    """A backend lacking an option raises NotImplementedError naming it and the
    backends that have it, before any op runs (the table patched here, so the
    test holds whatever the kernels' state)."""
    monkeypatch.setitem(modules.UNSUPPORTED, "cpu", frozenset({option}))
    monkeypatch.setitem(modules.UNSUPPORTED, "triton", frozenset({option}))
    monkeypatch.setitem(modules.UNSUPPORTED, "reference", frozenset())
    calls = []
    monkeypatch.setattr(ops, "run_recurrence", lambda *a: calls.append(a))
    monkeypatch.setattr(ops, "run_step", lambda *a: calls.append(a))
    m = build()
    with pytest.raises(NotImplementedError) as e:
        run(m)
    message = str(e.value)
    assert f"backend='cpu' does not support {option}" in message
    assert "reference" in message.split("backends that do:")[1]
    assert "triton" not in message.split("backends that do:")[1]
    assert calls == []


def test_cells_zoneout_needs_no_kernel_support(monkeypatch):
    """The cells blend in Python: zoneout is not a kernel option for them."""
    monkeypatch.setitem(modules.UNSUPPORTED, "cpu", frozenset({"zoneout"}))
    c = rnnkern.GRUCell(3, 5, zoneout=0.3, backend="cpu").eval()
    h = c(torch.randn(2, 3))
    assert h.shape == (2, 5)

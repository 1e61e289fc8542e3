"""Tracing and export of models holding rnnkern modules.

- ``torch.jit.trace`` records torch.nn's forward on the same parameters
  (aten::lstm & co.): the trace passes its own check, generalises over sequence
  lengths, and trains even when it was taken under no_grad, as torch.nn's does.
- ``torch.jit.script`` compiles torch.nn's forward on the same Parameter
  objects (the eager model keeps rnnkern's); options torch.nn lacks raise,
  naming the option.
- ``torch.export.export`` captures rnnkern's own ops; the exported program
  computes the eager numbers and trains.
- ONNX export (both of torch's exporters) gives the operators torch.nn's own
  export gives (ONNX LSTM / GRU / RNN), and onnxruntime computes our numbers.
- ``torch.fx.symbolic_trace`` records each module as one ``call_module`` node,
  as it records torch.nn's; the GraphModule runs the same module objects.
"""
from __future__ import annotations

import copy
import io
import warnings
import zlib

import pytest
import torch
import torch.nn as nn

import rnnkern
from conftest import assert_close, generator, randn


# (name, constructor of the rnnkern module, input shape, aten op that torch.nn traces to)
MODULES = [
    ("lstm-proj-bi-2layers-batch_first",
     lambda: rnnkern.LSTM(3, 6, num_layers=2, bidirectional=True, proj_size=4, batch_first=True,
                          backend="cpu"), (2, 5, 3), "aten::lstm"),
    ("gru-bi", lambda: rnnkern.GRU(3, 5, bidirectional=True, backend="cpu"), (5, 2, 3), "aten::gru"),
    ("rnn-relu-2layers", lambda: rnnkern.RNN(3, 5, num_layers=2, nonlinearity="relu", backend="reference"),
     (5, 2, 3), "aten::rnn_relu"),
    ("rnn-tanh-unbatched", lambda: rnnkern.RNN(3, 5, backend="cpu"), (5, 3), "aten::rnn_tanh"),
    ("lstmcell", lambda: rnnkern.LSTMCell(3, 5, backend="cpu"), (2, 3), "aten::lstm_cell"),
    ("grucell", lambda: rnnkern.GRUCell(3, 5, backend="reference"), (2, 3), "aten::gru_cell"),
    ("rnncell", lambda: rnnkern.RNNCell(3, 5, backend="cpu"), (2, 3), "aten::rnn_tanh_cell"),
]
IDS = [m[0] for m in MODULES]


class Model(nn.Module):
    """A recurrent module between two linear layers, as in a real model."""

    def __init__(self, rnn: nn.Module, input_size: int, output_size: int):
        super().__init__()
        self.inp = nn.Linear(input_size, input_size)
        self.rnn = rnn
        self.out = nn.Linear(output_size, 2)

    def forward(self, x):
        y = self.rnn(self.inp(x))
        y = y[0] if isinstance(y, tuple) else y
        return self.out(y)


def model(make, key):
    torch.manual_seed(zlib_key(key))
    rnn = make()
    out_size = rnn.hidden_size if not getattr(rnn, "proj_size", 0) else rnn.proj_size
    out_size *= 2 if getattr(rnn, "bidirectional", False) else 1
    return Model(rnn, rnn.input_size, out_size).double()


def zlib_key(key) -> int:
    return zlib.crc32(repr(key).encode())


def longer(shape, rnn):
    """The input shape with another sequence length (or batch, for a cell)."""
    shape = list(shape)
    time_dim = 1 if getattr(rnn, "batch_first", False) else 0
    shape[time_dim] += 3
    return tuple(shape)


def grads(m, x, key):
    out = m(x)
    loss = (out * randn(generator("export-cotangent", *key), *out.shape)).sum()
    return [out, *torch.autograd.grad(loss, [x, *m.parameters()])]


def torch_nn_twin(m: "Model") -> "Model":
    """A copy of ``m`` whose recurrent module is torch.nn's class itself."""
    twin = copy.deepcopy(m)
    twin.rnn.__class__ = next(c for c in type(m.rnn).__mro__ if c.__module__.startswith("torch.nn"))
    return twin


def quiet_trace(m, x, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.trace's deprecation notice
        return torch.jit.trace(m, (x,), **kwargs)


@pytest.mark.parametrize("name,make,shape,aten_op", MODULES, ids=IDS)
def test_jit_trace_records_torch_nn_and_generalises(name, make, shape, aten_op):
    m = model(make, name)
    g = generator("trace", name)
    traced = quiet_trace(m, randn(g, *shape))  # check_trace=True: reruns and compares graphs
    nodes = {n.kind() for n in traced.inlined_graph.nodes()}
    # torch.nn's own trace of the same model: the sequence modules record
    # aten::lstm & co.; the cells' aten ops are composite, recorded decomposed.
    theirs = quiet_trace(torch_nn_twin(m), randn(g, *shape))
    assert nodes == {n.kind() for n in theirs.inlined_graph.nodes()}, nodes
    assert (aten_op in nodes) == (not aten_op.endswith("_cell")), nodes
    assert not any(k.startswith("rnnkern") for k in nodes), nodes
    for s in (shape, longer(shape, m.rnn)):
        x = randn(g, *s, requires_grad=True)
        for k, (got, want) in enumerate(zip(grads(traced, x, (name, s)), grads(m, x, (name, s)))):
            assert_close(got, want, what=f"{name} shape {s} result {k}")


@pytest.mark.parametrize("name,make,shape,aten_op", MODULES[:3], ids=IDS[:3])
def test_trace_taken_under_no_grad_trains(name, make, shape, aten_op):
    m = model(make, name)
    g = generator("trace-no-grad", name)
    with torch.no_grad():
        traced = quiet_trace(m, randn(g, *shape))
    x = randn(g, *shape, requires_grad=True)
    for k, (got, want) in enumerate(zip(grads(traced, x, (name,)), grads(m, x, (name,)))):
        assert_close(got, want, what=f"{name} result {k}")


class WithLengths(nn.Module):
    """The module called with fixed ``lengths=`` (a module, so that its
    parameters are the trace's parameters, not constants)."""

    def __init__(self, rnn: nn.Module, lengths: torch.Tensor):
        super().__init__()
        self.rnn = rnn
        self.register_buffer("lengths", lengths)

    def forward(self, x):
        return self.rnn(x, lengths=self.lengths)


def test_trace_with_lengths_packs_as_torch_nn_does():
    lstm = rnnkern.LSTM(3, 4, bidirectional=True, batch_first=True, backend="cpu").double()
    lengths = torch.tensor([5, 2, 4])
    g = generator("trace-lengths")
    x = randn(g, 3, 5, 3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trace's notes on lengths used as constants
        traced = torch.jit.trace(WithLengths(lstm, lengths), (x,), check_trace=False)
    nodes = {n.kind() for n in traced.inlined_graph.nodes()}
    assert "aten::_pack_padded_sequence" in nodes and "aten::lstm" in nodes, nodes
    got, want = traced(x), lstm(x, lengths=lengths)
    for k, (a, b) in enumerate(zip(torch.utils._pytree.tree_leaves(got),
                                   torch.utils._pytree.tree_leaves(want))):
        assert_close(a, b, what=f"result {k}")


@pytest.mark.parametrize("cls", [rnnkern.GRU, rnnkern.GRUCell])
def test_trace_of_classic_gru_says_what_to_use(cls):
    m = cls(3, 4, reset_after=False)
    x = torch.randn(5, 2, 3) if cls is rnnkern.GRU else torch.randn(2, 3)
    with pytest.raises(NotImplementedError, match=r"reset_after=False.*torch\.export\.export or torch\.compile"):
        quiet_trace(m, x)


def quiet_script(m):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script's deprecation notice
        return torch.jit.script(m)


def count_op_calls(monkeypatch):
    """Counts rnnkern's recurrence and step ops as the modules call them."""
    calls = []
    for op in ("run_recurrence", "run_step"):
        def counted(*args, _op=getattr(rnnkern.ops, op), **kwargs):
            calls.append(_op)
            return _op(*args, **kwargs)
        monkeypatch.setattr(rnnkern.ops, op, counted)
    return calls


@pytest.mark.parametrize("name,make,shape,aten_op", MODULES, ids=IDS)
def test_jit_script_compiles_torch_nn_on_the_same_parameters(monkeypatch, name, make, shape, aten_op):
    m = model(make, name)
    ours = type(m.rnn)
    params = dict(m.named_parameters())
    rnn = m.rnn
    scripted = quiet_script(m)
    assert m.rnn is rnn  # the eager model keeps its module object
    nodes = {n.kind() for n in scripted.inlined_graph.nodes()}
    assert aten_op in nodes and not any("rnnkern" in k for k in nodes), nodes
    # The scripted module trains the eager model's Parameter objects themselves.
    assert all(p is params[n] for n, p in scripted.named_parameters()) and len(params) == len(
        dict(scripted.named_parameters()))
    calls = count_op_calls(monkeypatch)
    g = generator("script", name)
    for s in (shape, longer(shape, m.rnn)):
        x = randn(g, *s, requires_grad=True)
        calls.clear()
        got = grads(scripted, x, (name, s))
        assert calls == []  # the scripted module runs no rnnkern op
        want = grads(m, x, (name, s))
        assert calls and type(m.rnn) is ours  # the eager model runs rnnkern again
        for k, (a, b) in enumerate(zip(got, want)):
            assert_close(a, b, what=f"{name} shape {s} result {k}")
        theirs = grads(torch_nn_twin(m), x, (name, s))
        assert_close(got[0], theirs[0], what=f"{name} against torch.nn")


def test_jit_script_keeps_the_eager_model_and_saves_without_rnnkern(tmp_path):
    import subprocess
    import sys
    m = model(MODULES[0][1], "script-save")
    rnn = m.rnn
    scripted = quiet_script(m)
    assert m.rnn is rnn and isinstance(rnn, nn.LSTM)  # the same object, in its place
    assert rnnkern.conversion_report(m)[0].status == "rnnkern"
    assert rnnkern.convert(m) is m and type(m.rnn) is rnnkern.LSTM  # gives the class back at once
    assert quiet_script(m).rnn.weight_hh_l0 is rnn.weight_hh_l0  # scripting again
    x = randn(generator("script-save"), 2, 5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.save's deprecation notice
        torch.jit.save(scripted, str(tmp_path / "m.pt"))
    torch.save(x, tmp_path / "x.pt")
    torch.save(m(x).detach(), tmp_path / "want.pt")
    # A process that never imports rnnkern loads and runs it.
    code = (f"import sys, torch; m = torch.jit.load({str(tmp_path / 'm.pt')!r}); "
            f"x = torch.load({str(tmp_path / 'x.pt')!r}); want = torch.load({str(tmp_path / 'want.pt')!r}); "
            "assert torch.allclose(m(x), want, rtol=1e-12, atol=1e-12), (m(x) - want).abs().max(); "
            "assert not any(k.startswith('rnnkern') for k in sys.modules); print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize("make,option", [
    (lambda: rnnkern.LSTM(3, 4, zoneout=0.25), r"LSTM\(zoneout=0\.25\).*has no zoneout"),
    (lambda: rnnkern.GRUCell(3, 4, reset_after=False), r"GRUCell\(reset_after=False\).*reset-after GRU"),
    (lambda: Model(rnnkern.GRU(3, 4, zoneout=0.5), 3, 4), r"GRU\(zoneout=0\.5\)"),
], ids=["LSTM-zoneout", "GRUCell-classic", "inside-a-model"])
def test_jit_script_of_options_without_a_torch_nn_form_names_them(make, option):
    m = make()
    before = [type(s) for s in m.modules()]
    with pytest.raises(RuntimeError, match=r"torch\.jit\.script cannot compile rnnkern\." + option
                                           + r".*torch\.export\.export or torch\.compile"):
        quiet_script(m)
    assert [type(s) for s in m.modules()] == before  # the eager model is left as it was


@pytest.mark.parametrize("name,make,shape,aten_op", MODULES, ids=IDS)
def test_torch_export_captures_rnnkern_ops_and_trains(name, make, shape, aten_op):
    m = model(make, name)
    g = generator("export", name)
    ep = torch.export.export(m, (randn(g, *shape),))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    if m.rnn.backend != "reference":
        assert any(t.startswith("rnnkern.") for t in targets), targets
    exported = ep.module()
    x = randn(g, *shape, requires_grad=True)
    got, want = grads(exported, x, (name,)), grads(m, x, (name,))
    for k, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, what=f"{name} result {k}")


# ------------------------------------------------------------------ ONNX ----

def onnx_model(m, x, dynamo: bool):
    import onnx
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            return torch.onnx.export(m, (x,), dynamo=True, verbose=False).model_proto
        f = io.BytesIO()
        torch.onnx.export(m, (x,), f, dynamo=False)
        return onnx.load_from_string(f.getvalue())


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript-exporter", "dynamo-exporter"])
@pytest.mark.parametrize("name,make,shape,aten_op", MODULES[:3], ids=IDS[:3])
def test_onnx_export_gives_torch_nn_operators(name, make, shape, aten_op, dynamo):
    # float32: onnxruntime's CPU LSTM/GRU/RNN kernels take float only.
    m = model(make, name).float().eval()
    theirs = model(make, name).float().eval()
    theirs.rnn = {rnnkern.LSTM: nn.LSTM, rnnkern.GRU: nn.GRU, rnnkern.RNN: nn.RNN}[type(m.rnn)](
        **{k: getattr(m.rnn, k) for k in ("input_size", "hidden_size", "num_layers", "bias",
                                           "batch_first", "bidirectional")},
        **({"nonlinearity": m.rnn.nonlinearity} if isinstance(m.rnn, nn.RNN) else {}),
        **({"proj_size": m.rnn.proj_size} if isinstance(m.rnn, nn.LSTM) else {}))
    theirs.load_state_dict(m.state_dict())
    g = generator("onnx", name)
    x = randn(g, *shape, dtype=torch.float32)
    try:
        theirs_proto = onnx_model(theirs, x, dynamo)
    except Exception as e:  # torch.nn's own export fails: ours fails the same way
        with pytest.raises(type(e)):
            onnx_model(m, x, dynamo)
        assert "projection" in str(e) or "proj" in str(e), e  # the one such case: LSTM proj_size
        return
    ours_ops = [n.op_type for n in onnx_model(m, x, dynamo).graph.node]
    theirs_ops = [n.op_type for n in theirs_proto.graph.node]
    assert ours_ops == theirs_ops
    standard = {"aten::lstm": "LSTM", "aten::gru": "GRU", "aten::rnn_relu": "RNN"}[aten_op]
    if not (dynamo and standard == "RNN"):  # torch's dynamo exporter unrolls torch.nn.RNN itself
        assert standard in ours_ops, ours_ops
    ours_proto = onnx_model(m, x, dynamo)
    try:
        run_onnx(theirs_proto, x)
    except Exception as e:  # torch's exporter wrote a model onnxruntime rejects: ours too
        with pytest.raises(type(e)):
            run_onnx(ours_proto, x)
        return
    assert_close(run_onnx(ours_proto, x), m(x).detach(), what=f"{name} onnxruntime")


# The sequence modules that torch.nn's ONNX export takes (not an LSTM with a projection).
BARE = [("lstm-2layers", lambda: rnnkern.LSTM(3, 5, num_layers=2, backend="cpu"), (5, 2, 3),
         "aten::lstm")] + MODULES[1:4]


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript-exporter", "dynamo-exporter"])
@pytest.mark.parametrize("name,make,shape,aten_op", BARE, ids=[m[0] for m in BARE])
def test_onnx_export_of_a_bare_module_as_torch_nn_s(name, make, shape, aten_op, dynamo):
    # The module itself exported, not a model holding it: torch's TorchScript
    # exporter then calls its forward with every defaulted parameter of the
    # signature as a positional argument, rnnkern's keyword-only ones too
    # (forward(x, None, None, None, None)), which once raised a TypeError.
    torch.manual_seed(zlib_key(name))
    m = make().float().eval()
    theirs = torch_nn_twin(Model(m, 1, 1)).rnn
    g = generator("onnx-bare", name)
    x = randn(g, *shape, dtype=torch.float32)
    ours_proto, theirs_proto = onnx_model(m, x, dynamo), onnx_model(theirs, x, dynamo)
    assert [n.op_type for n in ours_proto.graph.node] == [n.op_type for n in theirs_proto.graph.node]
    import onnxruntime
    session = onnxruntime.InferenceSession(ours_proto.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    out, state = m(x)
    want = [out, *(state if isinstance(state, tuple) else (state,))]
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        assert_close(torch.from_numpy(a), b.detach(), what=f"{name} onnxruntime result {k}")


def test_forward_refuses_positional_arguments_past_hx_as_torch_nn_does():
    x = torch.randn(4, 2, 3)
    for cls in (rnnkern.LSTM, rnnkern.GRU, rnnkern.RNN, rnnkern.LayerNormLSTM):
        m = cls(3, 5, backend="cpu")
        with pytest.raises(TypeError, match=rf"^{cls.__name__}\.forward\(\) takes from 2 to 3 "
                                            r"positional arguments but 4 were given$"):
            m(x, None, torch.tensor([4, 4]))
        # (trailing Nones, as the TorchScript exporter passes them, change nothing)
        assert_close(m(x, None, None, None, None)[0], m(x)[0], what=f"{cls.__name__} trailing Nones")


class _FxModel(nn.Module):
    """A model FX traces: a projection, a recurrent stack given hx (and, for
    rnnkern's, lengths=), a cell fed the last output and the top layer's h."""

    def __init__(self, lib, recurrent: str, with_lengths: bool):
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.rnn = getattr(lib, recurrent)(4, 5, num_layers=2, batch_first=True)
        self.cell = getattr(lib, "LSTMCell" if recurrent == "LSTM" else "GRUCell")(5, 5)
        self.with_lengths = with_lengths
        self.lstm = recurrent == "LSTM"  # (decided here: FX runs forward's Python once, on Proxies)

    def forward(self, x, hx, lengths):
        kwargs = {"lengths": lengths} if self.with_lengths else {}
        out, state = self.rnn(self.proj(x), hx, **kwargs)
        last = out[:, -1]
        if self.lstm:
            return self.cell(last, (state[0][-1], state[1][-1]))[0]
        return self.cell(last, state[-1])


def _fx_nodes(gm):
    return [(n.op, str(n.target), len(n.args), sorted(n.kwargs)) for n in gm.graph.nodes]


@pytest.mark.parametrize("recurrent", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("built", ["rnnkern", "converted"])
def test_fx_symbolic_trace_records_the_modules_as_torch_nn_s(recurrent, built):
    """torch.fx.symbolic_trace keeps torch.nn's recurrent modules whole (one
    call_module node each: its tracer's leaves are torch.nn's namespace) and traces
    into every other module's forward, where rnnkern's checks cannot run on
    Proxies: rnnkern's modules record themselves as the same leaf.  The graph is
    torch.nn's node for node (with lengths=, one keyword more), the GraphModule runs
    the same module objects and trains as the model does."""
    torch.manual_seed(0)
    theirs = _FxModel(nn, recurrent, False).double()
    if built == "converted":
        ours = rnnkern.convert(copy.deepcopy(theirs), backend="cpu")
    else:
        ours = _FxModel(rnnkern, recurrent, False).double()
        ours.load_state_dict(theirs.state_dict())
    gm_theirs, gm_ours = torch.fx.symbolic_trace(theirs), torch.fx.symbolic_trace(ours)
    assert _fx_nodes(gm_ours) == _fx_nodes(gm_theirs)
    assert gm_ours.rnn is ours.rnn and gm_ours.cell is ours.cell
    g = generator("fx", recurrent, built)
    x = randn(g, 2, 6, 3, requires_grad=True)
    h = randn(g, 2, 2, 5)
    hx = (h, randn(g, 2, 2, 5)) if recurrent == "LSTM" else h
    results = []
    for m in (theirs, gm_ours):
        y = m(x, hx, None)
        y = y[0] if isinstance(y, tuple) else y
        results.append([y, *torch.autograd.grad(y.pow(2).sum(), [x, *m.parameters()])])
    for k, (a, b) in enumerate(zip(*results)):
        assert_close(a, b, what=f"{recurrent} {built} GraphModule result {k}")
    with_lengths = _FxModel(rnnkern, recurrent, True).double()
    gm = torch.fx.symbolic_trace(with_lengths)
    (call,) = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "rnn"]
    assert sorted(call.kwargs) == ["lengths"]
    lengths = torch.tensor([6, 3])
    assert_close(gm(x, hx, lengths), with_lengths(x, hx, lengths), what=f"{recurrent} GraphModule lengths=")


class _WrappedGRU(nn.GRU):
    """A subclass whose forward wraps torch.nn's (as pytorch-forecasting's do)."""

    def forward(self, x, hx=None):
        out, h = super().forward(x * 2, hx)
        return out + 1, h


class _HoldsWrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = _WrappedGRU(3, 5)

    def forward(self, x):
        return self.rnn(x)[0]


@pytest.mark.parametrize("cls", ["LSTM", "GRUCell"])
def test_fx_symbolic_trace_of_a_bare_module_fails_as_torch_nn_s(cls):
    """Traced as the root, torch.nn's recurrent modules fail (their forward's
    control flow on Proxies); rnnkern's with FX's error type too.  So does a
    subclass whose forward wraps the module's (FX traces into it: its class is not
    torch.nn's), before and after convert(): a call_module node would run the
    subclass's forward again around the ops FX recorded from it."""
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(getattr(nn, cls)(3, 5))
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(getattr(rnnkern, cls)(3, 5))
    model = _HoldsWrapped()
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(model)
    rnnkern.convert(model, backend="cpu")
    assert isinstance(model.rnn, rnnkern.GRU) and isinstance(model.rnn, _WrappedGRU)
    with pytest.raises(torch.fx.proxy.TraceError, match="_WrappedGRU.*cannot be traced"):
        torch.fx.symbolic_trace(model)


def run_onnx(proto, x: torch.Tensor) -> torch.Tensor:
    import onnxruntime

    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    return torch.from_numpy(got)

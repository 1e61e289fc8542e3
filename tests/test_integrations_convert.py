"""convert() of torch.nn subclasses as other libraries define them, and
conversion_report().

The subclasses here have pytorch-forecasting's shape: a mixin
``RNN(ABC, nn.RNNBase)`` whose forward packs by ``lengths`` and calls
``super().forward``, combined as ``class LSTM(RNN, nn.LSTM)``.  Converted, they
must compute torch.nn's float64 numbers and gradients with rnnkern's ops, stay
instances of their own class, convert once, and survive pickling.
"""
from __future__ import annotations

import copy
import io
import pickle
import warnings
from abc import ABC

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import rnnkern
from rnnkern import ops
from conftest import assert_close, generator, randn


class ForecastingRNN(ABC, nn.RNNBase):
    """pytorch-forecasting's mixin (pytorch_forecasting/models/nn/rnn.py), reduced."""

    def forward(self, x, hx=None, lengths=None, enforce_sorted=True):
        if lengths is None:
            return super().forward(x, hx)
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=self.batch_first,
                                      enforce_sorted=enforce_sorted)
        out, state = super().forward(packed, hx)
        out, _ = pad_packed_sequence(out, batch_first=self.batch_first, total_length=x.size(1))
        return out, state


class ForecastingLSTM(ForecastingRNN, nn.LSTM):
    pass


class ForecastingGRU(ForecastingRNN, nn.GRU):
    pass


class ScaledGRUCell(nn.GRUCell):
    """A cell subclass whose forward reaches torch.nn's through super(...)."""

    def forward(self, x, hx=None):
        return super(ScaledGRUCell, self).forward(0.5 * x, hx)


class PlainLSTMCell(nn.LSTMCell):
    """A subclass that only adds a method."""

    def state_size(self):
        return self.hidden_size


class OwnLoop(nn.RNN):
    """A subclass whose forward never reaches torch.nn's: left alone."""

    def forward(self, x, hx=None):
        return torch.tanh(x @ self.weight_ih_l0.t()), hx


class Encoder(nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.rnn = cls(3, 5, num_layers=2, batch_first=True)

    def forward(self, x, lengths):
        return self.rnn(x, lengths=lengths, enforce_sorted=False)


class DeepARLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder(ForecastingLSTM)
        self.gru = ForecastingGRU(5, 4, batch_first=True, bidirectional=True)
        self.cell = ScaledGRUCell(4 * 2, 3)
        self.plain = PlainLSTMCell(3, 2)
        self.head = nn.Linear(2, 1)

    def forward(self, x, lengths):
        out, _ = self.encoder(x, lengths)
        out, _ = self.gru(out, lengths=lengths, enforce_sorted=False)
        h = self.cell(out[:, -1])
        h, _ = self.plain(h)
        return self.head(h), out


def data(key):
    g = generator("integrations-convert", key)
    return randn(g, 3, 6, 3), torch.tensor([6, 2, 4])


def outputs_and_grads(model, x, lengths):
    x = x.detach().requires_grad_()
    y, out = model(x, lengths)
    (y.sum() + (out * out).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return y.detach(), out.detach(), x.grad, grads


def count_op_calls(monkeypatch):
    """Counts rnnkern's recurrence and step ops as the modules call them."""
    calls = {"recurrence": 0, "step": 0}
    recurrence, step = ops.run_recurrence, ops.run_step

    def counted_recurrence(*args, **kwargs):
        calls["recurrence"] += 1
        return recurrence(*args, **kwargs)

    def counted_step(*args, **kwargs):
        calls["step"] += 1
        return step(*args, **kwargs)

    monkeypatch.setattr(ops, "run_recurrence", counted_recurrence)
    monkeypatch.setattr(ops, "run_step", counted_step)
    return calls


def subclass_modules(model):
    """(module, its subclass, rnnkern's twin, torch.nn's class) of a DeepARLike."""
    return ((model.encoder.rnn, ForecastingLSTM, rnnkern.LSTM, nn.LSTM),
            (model.gru, ForecastingGRU, rnnkern.GRU, nn.GRU),
            (model.cell, ScaledGRUCell, rnnkern.GRUCell, nn.GRUCell),
            (model.plain, PlainLSTMCell, rnnkern.LSTMCell, nn.LSTMCell))


def assert_same_results(got, want):
    """outputs_and_grads of two models: outputs, x's gradient, every parameter's."""
    for name, a, b in zip(("y", "out", "x.grad"), got[:3], want[:3]):
        assert_close(a, b, what=name)
    for name in want[3]:
        assert_close(got[3][name], want[3][name], what=name)


def test_forecasting_subclasses_convert_compute_torch_nn_numbers_with_rnnkern(monkeypatch):
    torch.manual_seed(0)
    model = DeepARLike().double()
    x, lengths = data("deepar")
    want = outputs_and_grads(model, x, lengths)
    params = dict(model.named_parameters())

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing here is skipped
        assert rnnkern.convert(model, backend="cpu") is model

    for m, own, ours, base in subclass_modules(model):
        assert isinstance(m, own) and isinstance(m, ours), own
        assert type(m).__name__ == own.__name__ and type(m).__qualname__ == own.__qualname__
        assert type(m).__module__ == own.__module__
        assert m.backend == "cpu"
        # The subclass's methods come first, then rnnkern's class, then torch.nn's.
        mro = type(m).__mro__
        assert mro.index(own) < mro.index(ours) < mro.index(base)
    assert repr(model.encoder.rnn).startswith("ForecastingLSTM(3, 5, num_layers=2")
    assert all(p is params[n] for n, p in model.named_parameters())  # the same objects

    calls = count_op_calls(monkeypatch)
    got = outputs_and_grads(model, x, lengths)
    # rnnkern's ops ran: a recurrence per layer and direction (2 + 2), a step per cell call
    assert calls == {"recurrence": 4, "step": 2}
    assert_same_results(got, want)


def test_converting_twice_is_idempotent_and_the_class_is_cached():
    models = [DeepARLike().double(), DeepARLike().double()]
    for m in models:
        rnnkern.convert(m, backend="reference")
    first = {n: type(m) for n, m in models[0].named_modules()}
    assert first == {n: type(m) for n, m in models[1].named_modules()}  # one class per subclass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rnnkern.convert(models[0])
    assert first == {n: type(m) for n, m in models[0].named_modules()}
    assert models[0].gru.backend == "reference"  # a second conversion keeps the options
    assert len(type(models[0].gru).__mro__) == len(set(type(models[0].gru).__mro__))


def test_a_subclass_that_never_reaches_torch_nn_is_skipped_with_a_warning():
    torch.manual_seed(1)
    model = nn.Sequential()
    model.add_module("encoder", nn.Module())
    model.encoder.rnn = OwnLoop(3, 4)
    model.encoder.gru = nn.GRU(3, 4)
    model.double()
    x = randn(generator("skip"), 5, 2, 3)
    before = model.encoder.rnn(x)[0]
    with pytest.warns(UserWarning, match=r"left 'encoder\.rnn' \(test_integrations_convert\.OwnLoop\) "
                                         r"as it is: OwnLoop\.forward does not call super\(\)\.forward"):
        rnnkern.convert(model)
    assert type(model.encoder.rnn) is OwnLoop and type(model.encoder.gru) is rnnkern.GRU
    assert torch.equal(model.encoder.rnn(x)[0], before)
    assert rnnkern.conversion_report(model) == [
        ("encoder.rnn", "test_integrations_convert.OwnLoop",
         "skipped: OwnLoop.forward does not call super().forward"),
        ("encoder.gru", "rnnkern.modules.GRU", "rnnkern"),
    ]


def test_a_forward_without_readable_source_is_skipped():
    namespace = {}
    exec("def forward(self, x, hx=None):\n    return super(type(self), self).forward(x, hx)\n", namespace)
    Hidden = type("Hidden", (nn.LSTM,), {"forward": namespace["forward"]})
    m = Hidden(3, 4)
    with pytest.warns(UserWarning, match=r"the source of forward cannot be read"):
        rnnkern.convert(m)
    assert type(m) is Hidden


def test_conversion_report_before_and_after():
    model = DeepARLike()
    names = ["encoder.rnn", "gru", "cell", "plain"]
    before = rnnkern.conversion_report(model)
    assert [(e.name, e.status) for e in before] == [(n, "convertible") for n in names]
    assert before[0].cls == "test_integrations_convert.ForecastingLSTM"
    assert [type(m) for m in model.modules()][1:3] == [Encoder, ForecastingLSTM]  # nothing changed
    rnnkern.convert(model)
    after = rnnkern.conversion_report(model)
    assert [(e.name, e.cls, e.status) for e in after] == [(n, e.cls, "rnnkern") for n, e in zip(names, before)]
    with pytest.raises(TypeError, match="model should be a torch.nn.Module"):
        rnnkern.conversion_report([model])


def test_whole_model_pickling_of_converted_subclasses():
    """torch.save(model) / torch.load, pickle and deepcopy: the copy is converted
    again (the pickle names the user's classes), with its options and numbers."""
    torch.manual_seed(2)
    model = rnnkern.convert(DeepARLike().double(), backend="cpu")
    model.gru.zoneout = 0.25  # an rnnkern option travels in the pickle
    model.eval()
    x, lengths = data("pickle")
    want = model(x, lengths)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert b"rnnkern.modules.conversion" in pickle.dumps(model)  # loads through _rebuild
    copies = [torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(model)),
              copy.deepcopy(model)]
    for c in copies:
        for name, m in c.named_modules():
            assert type(m) is type(model.get_submodule(name)), name
        assert c.gru.backend == "cpu" and c.gru.zoneout == 0.25
        assert isinstance(c.encoder.rnn, ForecastingLSTM) and isinstance(c.encoder.rnn, rnnkern.LSTM)
        for a, b in zip(c(x, lengths), want):
            assert_close(a, b)


def test_state_dict_round_trips_between_converted_and_plain_subclasses():
    torch.manual_seed(3)
    ours = rnnkern.convert(DeepARLike().double(), backend="cpu")
    theirs = DeepARLike().double()
    assert list(ours.state_dict()) == list(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())
    x, lengths = data("state_dict")
    for a, b in zip(ours(x, lengths), theirs(x, lengths)):
        assert_close(a, b)


def test_torch_jit_script_of_a_converted_subclass_compiles_its_torch_nn_form():
    """Scripting compiles the class the module had before convert() (here the
    user's cell subclass, whose forward is torch.nn's), on the same parameters."""
    cell = rnnkern.convert(PlainLSTMCell(3, 4).double(), backend="cpu")
    converted = type(cell)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script's deprecation notice
        scripted = torch.jit.script(cell)
    assert all(p is getattr(cell, n) for n, p in scripted.named_parameters())
    g = generator("script-subclass")
    x, hx = randn(g, 2, 3), (randn(g, 2, 4), randn(g, 2, 4))
    got = scripted(x, hx)
    want = cell(x, hx)
    assert type(cell) is converted  # the eager call ran the converted class again
    for a, b in zip(got, want):
        assert_close(a, b)


def test_convert_after_dynamic_quantization_keeps_torch_int8_modules():
    """docs/modules.md, dynamic quantization: quantized modules are passed by,
    the float recurrent ones converted, the numbers unchanged."""
    quantize_dynamic = torch.ao.quantization.quantize_dynamic
    torch.manual_seed(9)
    model = nn.Sequential(nn.LSTM(4, 8), nn.GRU(8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.14: torch.ao.quantization
        quantized = quantize_dynamic(model, {nn.LSTM}, dtype=torch.qint8)
    int8_lstm = type(quantized[0])
    assert int8_lstm is not nn.LSTM and not isinstance(quantized[0], nn.LSTM)
    x = randn(generator("quantized"), 5, 3, 4, dtype=torch.float32)
    want = quantized[1](quantized[0](x)[0])[0]
    assert [e.name for e in rnnkern.conversion_report(quantized)] == ["1"]
    converted = rnnkern.convert(quantized)
    assert type(converted[0]) is int8_lstm and type(converted[1]) is rnnkern.GRU
    got = converted[1](converted[0](x)[0])[0]
    assert_close(got, want)

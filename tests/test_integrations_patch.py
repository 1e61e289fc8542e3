"""rnnkern.patch(): while active, torch.nn's recurrent classes construct (and
unpickle) as rnnkern's modules; after it, torch.nn is as before."""
from __future__ import annotations

import contextlib
import inspect
import io
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn import LSTM as LSTM_IMPORTED_BEFORE  # a name bound before any patch

import rnnkern
from conftest import assert_close, generator, randn
from test_integrations_convert import (DeepARLike, ForecastingLSTM, OwnLoop, ScaledGRUCell,
                                       assert_same_results, count_op_calls, outputs_and_grads,
                                       subclass_modules)
from test_integrations_convert import data as convert_data

BUILDS = [  # (torch.nn class, its rnnkern twin, constructor arguments, input shape)
    (nn.RNN, rnnkern.RNN, (3, 5), dict(num_layers=2, nonlinearity="relu"), (6, 2, 3)),
    (nn.GRU, rnnkern.GRU, (3, 5), dict(bidirectional=True, batch_first=True), (2, 6, 3)),
    (nn.LSTM, rnnkern.LSTM, (3, 5), dict(num_layers=2, proj_size=2), (6, 2, 3)),
    (nn.RNNCell, rnnkern.RNNCell, (3, 5), {}, (2, 3)),
    (nn.GRUCell, rnnkern.GRUCell, (3, 5), {}, (2, 3)),
    (nn.LSTMCell, rnnkern.LSTMCell, (3, 5), {}, (2, 3)),
]
IDS = [b[0].__name__ for b in BUILDS]


@pytest.fixture(autouse=True)
def no_patch_left_behind():
    assert not rnnkern.is_patched()
    yield
    leaked = rnnkern.is_patched()
    rnnkern.unpatch()
    assert not leaked, "a test left rnnkern.patch() active"


def flat(result):
    return torch.utils._pytree.tree_leaves(result)


@pytest.mark.parametrize("theirs_cls,ours_cls,args,kwargs,shape", BUILDS, ids=IDS)
def test_construction_inside_patch_gives_rnnkern_with_torch_nn_numbers(theirs_cls, ours_cls, args,
                                                                         kwargs, shape):
    before = theirs_cls(*args, **kwargs).double()  # built before patching
    with rnnkern.patch():
        m = theirs_cls(*args, **kwargs).double()
        assert type(m) is ours_cls and m.backend == "auto"
        assert isinstance(m, theirs_cls) and isinstance(before, theirs_cls)
        assert type(before) is theirs_cls  # modules built before stay as they are
        assert type(ours_cls(*args, **kwargs)) is ours_cls  # rnnkern's own classes build normally
    after = theirs_cls(*args, **kwargs)
    assert type(after) is theirs_cls
    m.load_state_dict(before.state_dict())
    x = randn(generator("patch", theirs_cls.__name__), *shape)
    for a, b in zip(flat(m(x)), flat(before(x))):
        assert_close(a, b)


def test_every_spelling_is_caught_and_the_exit_restores():
    with rnnkern.patch():
        assert type(nn.LSTM(2, 3)) is rnnkern.LSTM
        assert type(torch.nn.modules.rnn.LSTM(2, 3)) is rnnkern.LSTM
        assert type(LSTM_IMPORTED_BEFORE(2, 3)) is rnnkern.LSTM  # the name is the class itself
    for spelling in (nn.LSTM, torch.nn.modules.rnn.LSTM, LSTM_IMPORTED_BEFORE):
        assert type(spelling(2, 3)) is nn.LSTM


@pytest.mark.parametrize("theirs_cls,ours_cls,args,kwargs,shape", BUILDS, ids=IDS)
def test_signatures_and_skip_init_stay_torch_nn_s_while_patched_and_after(theirs_cls, ours_cls, args,
                                                                           kwargs, shape):
    """inspect.signature of torch.nn's class (and of a subclass that inherits its
    constructor) is its __init__'s while patched and after, not the hook's
    ``(*args, **kwargs)``: torch.nn.utils.skip_init reads it for ``device`` and
    refused torch.nn's cells in any process that had ever patched."""
    init = inspect.signature(theirs_cls.__init__)
    expected = init.replace(parameters=list(init.parameters.values())[1:])

    class Inherits(theirs_cls):
        pass

    for patched in (True, False):  # the hook stays installed after the first patch
        with rnnkern.patch() if patched else contextlib.nullcontext():
            assert inspect.signature(theirs_cls) == expected
            assert inspect.signature(Inherits) == expected
            if "device" in expected.parameters:  # the cells (torch.nn's sequence modules take *args)
                built = torch.nn.utils.skip_init(theirs_cls, *args, **kwargs)
                assert type(built) is (ours_cls if patched else theirs_cls)
                assert built.weight_hh.shape == theirs_cls(*args, **kwargs).weight_hh.shape


def test_a_subclass_reaching_torch_nn_is_built_as_convert_makes_it():
    class Sub(nn.GRU):
        pass
    with rnnkern.patch():
        m = Sub(2, 3)
        again = Sub(2, 3)
    assert isinstance(m, Sub) and isinstance(m, rnnkern.GRU) and type(m).__qualname__.endswith("Sub")
    assert type(again) is type(m)  # one generated class per subclass
    assert type(m).__mro__.index(Sub) < type(m).__mro__.index(rnnkern.GRU)
    assert type(Sub(2, 3)) is Sub  # after the patch, as before


def test_forecasting_subclasses_built_inside_patch_compute_torch_nn_numbers_with_rnnkern(monkeypatch):
    """pytorch-forecasting's shape (a mixin whose forward packs by lengths and
    calls super().forward): its models build their LSTM/GRU inside the library,
    in from_dataset and load_from_checkpoint alike, where only patch() reaches."""
    torch.manual_seed(0)
    before = DeepARLike().double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing here is left alone
        with rnnkern.patch():
            model = DeepARLike().double()
    model.load_state_dict(before.state_dict())
    for m, own, ours, _ in subclass_modules(model):
        assert isinstance(m, own) and isinstance(m, ours) and type(m).__qualname__ == own.__qualname__
        assert m.backend == "auto"
    assert [e.status for e in rnnkern.conversion_report(model)] == ["rnnkern"] * 4
    assert [e.status for e in rnnkern.conversion_report(before)] == ["convertible"] * 4
    x, lengths = convert_data("patch")
    want = outputs_and_grads(before, x, lengths)
    calls = count_op_calls(monkeypatch)
    got = outputs_and_grads(model, x, lengths)
    assert calls == {"recurrence": 4, "step": 2}  # rnnkern ran every recurrent module
    assert_same_results(got, want)


def test_a_subclass_that_never_reaches_torch_nn_is_built_as_it_is_with_a_warning():
    with rnnkern.patch():
        with pytest.warns(UserWarning, match=r"rnnkern\.patch: built test_integrations_convert\.OwnLoop "
                                             r"as it is, not on rnnkern: OwnLoop\.forward does not "
                                             r"call super\(\)\.forward"):
            m = OwnLoop(3, 4)
    assert type(m) is OwnLoop


def test_a_subclass_whose_init_skips_rnnkern_runs_with_the_default_options():
    class Explicit(nn.LSTM):
        def __init__(self, hidden):
            nn.LSTM.__init__(self, 3, hidden)  # past rnnkern's __init__ in the method order
    torch.manual_seed(4)
    plain = Explicit(5).double()
    with rnnkern.patch():
        m = Explicit(5).double()
    assert isinstance(m, rnnkern.LSTM) and m.backend == "auto" and m.zoneout == 0.0
    m.load_state_dict(plain.state_dict())
    x = randn(generator("patch-explicit-init"), 6, 2, 3)
    for a, b in zip(flat(m(x)), flat(plain(x))):
        assert_close(a, b)


def test_a_model_of_subclasses_unpickled_inside_patch_is_on_rnnkern():
    torch.manual_seed(5)
    model = DeepARLike().double()
    x, lengths = convert_data("patch-load")
    want = model(x, lengths)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    with rnnkern.patch():
        loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded.encoder.rnn, ForecastingLSTM) and isinstance(loaded.encoder.rnn, rnnkern.LSTM)
    assert isinstance(loaded.cell, ScaledGRUCell) and isinstance(loaded.cell, rnnkern.GRUCell)
    for a, b in zip(loaded(x, lengths), want):
        assert_close(a, b)


def build_like_a_library(input_size):
    """A library's builder (darts' RNN models build nn.GRU inside fit())."""
    return nn.Sequential(nn.Linear(input_size, 4), nn.GRU(4, 6, batch_first=True))


def test_a_library_builder_inside_the_block_gets_rnnkern():
    with rnnkern.patch():
        model = build_like_a_library(3)
    assert type(model[1]) is rnnkern.GRU and type(model[0]) is nn.Linear
    assert type(build_like_a_library(3)[1]) is nn.GRU


def test_whole_model_loaded_inside_patch_is_rnnkern():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LSTM(4, 5, num_layers=2)).double()
    x = randn(generator("patch-load"), 6, 2, 3)
    want = model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    with rnnkern.patch():
        loaded = torch.load(buffer, weights_only=False)
        copied = pickle.loads(pickle.dumps(model))
    for m in (loaded, copied):
        assert type(m[1]) is rnnkern.LSTM and m[1].backend == "auto" and m[1].zoneout == 0.0
        assert m[1].reset_after  # the class defaults stand in for options the pickle lacks
        for a, b in zip(flat(m(x)), flat(want)):
            assert_close(a, b)
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=False)[1]) is nn.LSTM


def test_an_exception_inside_the_block_restores():
    with pytest.raises(ZeroDivisionError):
        with rnnkern.patch():
            assert type(nn.RNN(2, 3)) is rnnkern.RNN
            1 / 0
    assert not rnnkern.is_patched() and type(nn.RNN(2, 3)) is nn.RNN


def test_nesting_handles_and_unpatch():
    with rnnkern.patch():
        with rnnkern.patch():
            assert type(nn.GRUCell(2, 3)) is rnnkern.GRUCell
        assert type(nn.GRUCell(2, 3)) is rnnkern.GRUCell  # the outer patch still holds
    assert type(nn.GRUCell(2, 3)) is nn.GRUCell

    first, second = rnnkern.patch(), rnnkern.patch()
    first.undo()
    first.undo()  # undoing twice ends it once
    assert type(nn.LSTMCell(2, 3)) is rnnkern.LSTMCell
    second.undo()
    assert type(nn.LSTMCell(2, 3)) is nn.LSTMCell

    stale = rnnkern.patch()
    rnnkern.patch()
    rnnkern.unpatch()  # ends both
    assert not rnnkern.is_patched() and type(nn.LSTM(2, 3)) is nn.LSTM
    fresh = rnnkern.patch()
    stale.undo()  # from before unpatch(): must not end the fresh patch
    assert type(nn.LSTM(2, 3)) is rnnkern.LSTM
    fresh.undo()
    assert type(nn.LSTM(2, 3)) is nn.LSTM


def copy_like_torchrl(torch_cls):
    """A class made as torchrl 0.14 makes its LSTMBase and GRUBase: an nn.RNNBase
    into which torch_cls's class attributes are copied -- the patch's __new__
    among them when the copy is made while patched (a library imported after
    rnnkern.patch())."""
    class Copied(nn.RNNBase):
        def __init__(self, *args, **kwargs):
            super().__init__(torch_cls.__name__, *args, **kwargs)

    for attr in torch_cls.__dict__:
        if attr != "__init__":
            setattr(Copied, attr, getattr(torch_cls, attr))
    return Copied


@pytest.mark.parametrize("torch_cls", [nn.LSTM, nn.GRU], ids=["LSTM", "GRU"])
def test_a_class_that_copied_torch_nn_while_patched_is_built_as_it_is(torch_cls):
    # It is no torch.nn recurrent class (convert leaves it alone), so the patch
    # does too, silently; it raised ValueError from the hook's subclass check.
    with rnnkern.patch():
        copied = copy_like_torchrl(torch_cls)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.manual_seed(6)
            m = copied(3, 5, num_layers=2, batch_first=True).double()
    assert type(m) is copied and not isinstance(m, rnnkern.LSTM)
    plain = torch_cls(3, 5, num_layers=2, batch_first=True).double()
    plain.load_state_dict(m.state_dict())
    x = randn(generator("patch-copied-" + torch_cls.__name__), 2, 6, 3)
    for a, b in zip(flat(m(x)), flat(plain(x))):
        assert_close(a, b)


def test_torchrl_imported_while_patched_builds_its_modules():
    """torchrl imported after rnnkern.patch() (its LSTMBase and GRUBase then copy
    the hook): its own python LSTM and GRU build as they are, its LSTMModule and
    GRUModule's torch.nn modules as rnnkern's, with torch.nn's numbers.  In a
    process of its own: the copy happens at torchrl's import."""
    pytest.importorskip("torchrl", reason="torchrl is not installed (requirements-dev.txt)")
    code = textwrap.dedent("""
        import torch, rnnkern
        rnnkern.patch()
        from torchrl.modules import GRU, LSTM, GRUModule, LSTMModule
        x = torch.randn(2, 6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
        for cls, module_cls, twin, torch_cls in ((LSTM, LSTMModule, rnnkern.LSTM, torch.nn.LSTM),
                                                 (GRU, GRUModule, rnnkern.GRU, torch.nn.GRU)):
            theirs = cls(3, 5, num_layers=2, batch_first=True).double()
            assert type(theirs) is cls, type(theirs)
            ours = torch_cls(3, 5, num_layers=2, batch_first=True).double()
            assert type(ours) is twin, type(ours)
            ours.load_state_dict(theirs.state_dict())
            for a, b in zip(torch.utils._pytree.tree_leaves(theirs(x)),
                            torch.utils._pytree.tree_leaves(ours(x))):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
            for python_based, want in ((False, twin), (True, cls)):
                m = module_cls(input_size=3, hidden_size=5, in_key="obs", out_key="feat",
                               python_based=python_based)
                inner = m.lstm if cls is LSTM else m.gru
                assert type(inner) is want, (python_based, type(inner))
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr

"""Bad input, in one place: every argument check (modules, cells, the ops of each
backend) raises the right exception type with a message naming the argument;
edge cases behave as torch.nn."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import rnnkern
from rnnkern import ops
from rnnkern.triton import ops as triton_ops  # noqa: F401  (defines torch.ops.rnnkern_triton)
from conftest import (CELLS, HAS_GPU, assert_close, generator, randn, recurrence_inputs,
                      rnnkern_module, step_inputs, to_device, torch_module)

TORCH_CELLS = [c for c in CELLS if c != "gru_reset_before"]


def pair(cell, I=4, H=5, **kwargs):
    torch.manual_seed(0)
    theirs = torch_module(cell, I, H, **kwargs)
    ours = rnnkern_module(cell, I, H, backend="cpu", **kwargs)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def both_raise(theirs, ours, *args):
    """torch.nn and rnnkern raise the same exception type; ours names the problem."""
    with pytest.raises(Exception) as want:
        theirs(*args)
    with pytest.raises(type(want.value)) as got:
        ours(*args)
    return str(got.value)


# ----------------------------------------------------------- module input ----

@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_wrong_rank(cell):
    theirs, ours = pair(cell)
    msg = both_raise(theirs, ours, torch.randn(3, 2, 4, 1))
    assert "input" in msg and "4D" in msg


@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_wrong_feature_size(cell):
    theirs, ours = pair(cell)
    msg = both_raise(theirs, ours, torch.randn(3, 2, 7))
    assert "input_size" in msg and "4" in msg and "7" in msg


@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_hx_wrong_shape(cell):
    theirs, ours = pair(cell)
    bad = torch.randn(1, 3, 5)
    hx = (bad, torch.randn(1, 2, 5)) if cell == "lstm" else bad
    msg = both_raise(theirs, ours, torch.randn(3, 2, 4), hx)
    assert "hidden" in msg and "(1, 2, 5)" in msg


@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_hx_wrong_rank(cell):
    theirs, ours = pair(cell)
    bad = torch.randn(2, 5)
    hx = (bad, bad) if cell == "lstm" else bad
    msg = both_raise(theirs, ours, torch.randn(3, 2, 4), hx)
    assert "hx" in msg and "3-D" in msg


@pytest.mark.parametrize("cell", TORCH_CELLS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64], ids=["float64", "int64"])
def test_input_dtype_mismatch(cell, dtype):
    theirs, ours = pair(cell)
    x = torch.randn(3, 2, 4).to(dtype)
    msg = both_raise(theirs, ours, x)
    assert "dtype" in msg and str(dtype) in msg


@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_zero_length_sequence(cell):
    theirs, ours = pair(cell)
    msg = both_raise(theirs, ours, torch.randn(0, 2, 4))
    assert "sequence length" in msg


@pytest.mark.parametrize("cell", TORCH_CELLS)
@pytest.mark.parametrize("batch_first", [False, True])
def test_empty_batch(cell, batch_first):
    theirs, ours = pair(cell, batch_first=batch_first)
    x = torch.randn(0, 3, 4) if batch_first else torch.randn(3, 0, 4)
    out_t, hid_t = theirs(x)
    out_o, hid_o = ours(x)
    assert out_o.shape == out_t.shape
    for a, b in zip(hid_o if cell == "lstm" else [hid_o], hid_t if cell == "lstm" else [hid_t]):
        assert a.shape == b.shape


def _strided_views(g):
    base = randn(g, 6, 8, 10, dtype=torch.float32)
    return {
        "transposed": base.transpose(0, 1)[:, :, :4],  # [8, 6, 4], non-contiguous
        "sliced": base[::2, ::3, 1:5],                  # [3, 3, 4], every stride odd
        "expanded": randn(g, 5, 1, 4, dtype=torch.float32).expand(5, 3, 4),  # batch stride 0
    }


@pytest.mark.parametrize("cell", TORCH_CELLS)
@pytest.mark.parametrize("view", ["transposed", "sliced", "expanded"])
def test_strided_inputs(cell, view):
    theirs, ours = pair(cell)
    x = _strided_views(generator("strided", cell))[view]
    assert not x.is_contiguous()
    want, _ = theirs(x)
    got, _ = ours(x)
    assert_close(got, want, dtype=torch.float32)


@pytest.mark.parametrize("cell", TORCH_CELLS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_propagate_like_torch(cell, value):
    theirs, ours = pair(cell)
    x = randn(generator("nonfinite", cell), 5, 3, 4, dtype=torch.float32)
    x[2, 1, 0] = value
    want, hid_t = theirs(x)
    got, hid_o = ours(x)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert_close(got[finite], want[finite], dtype=torch.float32)


@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_unbatched_input(cell):
    theirs, ours = pair(cell)
    x = randn(generator("unbatched", cell), 6, 4, dtype=torch.float32)
    want, hid_t = theirs(x)
    got, hid_o = ours(x)
    assert_close(got, want, dtype=torch.float32)
    for a, b in zip(hid_o if cell == "lstm" else [hid_o], hid_t if cell == "lstm" else [hid_t]):
        assert_close(a, b, dtype=torch.float32)


# -------------------------------------------------------- backend choice ----

def test_unknown_backend_lists_valid_ones():
    with pytest.raises(ValueError) as e:
        rnnkern.LSTM(3, 4, backend="fortran")
    assert "fortran" in str(e.value) and all(b in str(e.value) for b in ops.BACKENDS)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_backend_on_cpu_tensors_is_an_error(backend, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    m = rnnkern.GRU(3, 4, backend=backend)
    with pytest.raises((ValueError, RuntimeError)) as e:
        m(torch.randn(2, 1, 3))
    assert f"backend='{backend}'" in str(e.value)


@pytest.mark.parametrize("backend", ["auto", "reference", "cpu", "cuda", "triton", "cuda_emulated"])
def test_modules_on_meta_tensors_give_torch_nn_s_shapes(backend):
    """Meta tensors (shape inference, deferred initialisation) carry no data: a
    module built with any backend runs on them as torch.nn's does, its
    reference's ATen ops giving the shapes, its gradients' too."""
    cases = [("LSTM", dict(num_layers=2, bidirectional=True, proj_size=3), (4, 3, 5)),
             ("GRU", dict(batch_first=True), (3, 4, 5)), ("RNN", {}, (4, 5)),
             ("LSTMCell", {}, (3, 5)), ("GRUCell", {}, (3, 5)), ("RNNCell", {}, (5,))]
    for name, kwargs, shape in cases:
        with torch.device("meta"):
            theirs = getattr(torch.nn, name)(5, 7, **kwargs)
            ours = getattr(rnnkern, name)(5, 7, backend=backend, **kwargs)
            results = []
            for m in (theirs, ours):
                x = torch.empty(*shape, requires_grad=True)
                out = m(x)
                flat = [out] if isinstance(out, torch.Tensor) else [out[0], *(
                    out[1] if isinstance(out[1], tuple) else (out[1],))]
                flat[0].sum().backward()
                results.append([(t.shape, t.device.type) for t in flat] + [(x.grad.shape, x.grad.device.type)])
        assert results[1] == results[0], (name, results)
    with torch.device("meta"):  # rnnkern's own: its CPU shapes
        m = rnnkern.LayerNormLSTM(5, 7, backend=backend)
        out, (h, c) = m(torch.empty(4, 3, 5))
    assert (out.shape, h.shape, c.shape, out.device.type) == ((4, 3, 7), (1, 3, 7), (1, 3, 7), "meta")


def test_auto_picks_cpu_for_cpu_tensors():
    assert ops.resolve_backend("auto", torch.device("cpu")) == "cpu"


# ------------------------------------------------------------- op checks ----

def _op_args(**override):
    args = recurrence_inputs("lstm", 4, 3, 5, key=("op-args",))
    args.update(override)
    return ["lstm", *args.values(), None, False, False]


@pytest.mark.parametrize("name,bad,exc,words", [
    ("xproj", torch.randn(4, 3, 19), ValueError, ["xproj", "20"]),
    ("xproj", torch.randn(4, 20), ValueError, ["xproj", "3-D"]),
    ("h0", torch.randn(2, 5), ValueError, ["h0", "[3, 5]"]),
    ("c0", torch.randn(3, 4), ValueError, ["c0", "[3, 5]"]),
    ("w_hh", torch.randn(19, 5), ValueError, ["w_hh", "multiple of 4"]),
    ("b_hh", torch.randn(21), ValueError, ["b_hh", "[20]"]),
    ("h0", torch.randn(3, 5, dtype=torch.float32), TypeError, ["h0", "dtype"]),
    ("xproj", torch.randint(0, 3, (4, 3, 20)), TypeError, ["xproj", "floating"]),
])
def test_op_rejects_bad_arguments(name, bad, exc, words):
    args = recurrence_inputs("lstm", 4, 3, 5, key=("op-args",))
    args[name] = bad
    with pytest.raises(exc) as e:
        torch.ops.rnnkern.recurrence("lstm", *args.values(), None, False, False)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("lengths,words", [
    (torch.tensor([4, 5, 1]), ["lengths[1] = 5", "[0, 4]"]),
    (torch.tensor([4, -1, 1]), ["lengths[1] = -1"]),
    (torch.tensor([4, 1]), ["lengths", "[3]"]),
    (torch.tensor([4.0, 1.0, 2.0]), ["lengths", "int64"]),
])
def test_op_rejects_bad_lengths(lengths, words):
    args = recurrence_inputs("gru", 4, 3, 5, key=("op-lengths",))
    with pytest.raises((ValueError, TypeError)) as e:
        torch.ops.rnnkern.recurrence("gru", *args.values(), lengths, False, False)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_op_rejects_unknown_cell():
    args = recurrence_inputs("gru", 2, 1, 3, key=("cell",))
    with pytest.raises(ValueError) as e:
        torch.ops.rnnkern.recurrence("gruu", *args.values(), None, False, False)
    assert "gruu" in str(e.value) and "gru_reset_before" in str(e.value)


def test_module_rejects_bad_lengths():
    m = rnnkern.LSTM(3, 4)
    x = torch.randn(5, 2, 3)
    with pytest.raises(ValueError, match="lengths must lie in"):
        m(x, lengths=torch.tensor([5, 6]))
    with pytest.raises(ValueError, match=r"lengths of shape \[2\]"):
        m(x, lengths=torch.tensor([5]))


def test_linear_op_rejects_bad_shapes():
    with pytest.raises(ValueError, match="weight of shape"):
        torch.ops.rnnkern.linear(torch.randn(3, 4), torch.randn(5, 3))
    with pytest.raises(TypeError, match="weight"):
        torch.ops.rnnkern.linear(torch.randn(3, 4), torch.randn(5, 4, dtype=torch.float64))


# ------------------------------------- the Triton ops' argument checks ----
# (under Triton's interpreter without a GPU, on CUDA tensors with one)

TRITON_DEVICE = "cuda" if HAS_GPU else "cpu"


def triton_recurrence_args(cell="lstm", T=3, B=2, H=4, **overrides):
    args = to_device(recurrence_inputs(cell, T, B, H, key=("bad",)), TRITON_DEVICE)
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,exc,words", [
    (dict(h0=torch.randn(3, 4, dtype=torch.float64)), ValueError, ["h0", "[2, 4]", "[3, 4]"]),
    (dict(c0=torch.randn(2, 5, dtype=torch.float64)), ValueError, ["c0", "[2, 4]"]),
    (dict(c0=None), ValueError, ["lstm needs c0"]),
    (dict(w_hh=torch.randn(15, 4, dtype=torch.float64)), ValueError, ["w_hh", "15 rows", "multiple of 4"]),
    (dict(xproj=torch.randn(3, 2, 12, dtype=torch.float64)), ValueError, ["xproj.size(2) == 16"]),
    (dict(xproj=torch.randn(2, 16, dtype=torch.float64)), ValueError, ["xproj", "3-D"]),
    (dict(b_ih=torch.randn(4, dtype=torch.float64)), ValueError, ["b_ih", "[16]"]),
    (dict(b_hh=torch.randn(16)), TypeError, ["b_hh", "dtype", "float32"]),
    (dict(w_hr=torch.randn(3, 4, dtype=torch.float64)), ValueError, ["w_hr", "[4, 4]", "[3, 4]"]),
    (dict(xproj=torch.ones(3, 2, 16, dtype=torch.int32)), TypeError, ["xproj", "floating"]),
], ids=["h0-shape", "c0-shape", "c0-missing", "w_hh-rows", "xproj-width", "xproj-rank",
        "b_ih-shape", "b_hh-dtype", "w_hr-shape", "xproj-int"])
def test_triton_recurrence_rejects_bad_arguments(overrides, exc, words):
    args = triton_recurrence_args(**{k: None if v is None else v.to(TRITON_DEVICE) for k, v in overrides.items()})
    with pytest.raises(exc) as e:
        torch.ops.rnnkern_triton.recurrence("lstm", *args.values(), None, False, True)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("lengths,exc,words", [
    (torch.tensor([3, 4]), ValueError, ["lengths[1] = 4", "[0, 3]"]),
    (torch.tensor([3, -1]), ValueError, ["lengths[1] = -1"]),
    (torch.tensor([3]), ValueError, ["lengths", "[2]"]),
    (torch.tensor([3, 1], dtype=torch.int32), TypeError, ["lengths", "int64"]),
], ids=["too-long", "negative", "shape", "dtype"])
def test_triton_recurrence_rejects_bad_lengths(lengths, exc, words):
    args = triton_recurrence_args()
    with pytest.raises(exc) as e:
        torch.ops.rnnkern_triton.recurrence("lstm", *args.values(), lengths, False, True)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_triton_recurrence_rejects_unknown_cell():
    args = triton_recurrence_args()
    with pytest.raises(ValueError, match="unknown cell 'lstn'"):
        torch.ops.rnnkern_triton.recurrence("lstn", *args.values(), None, False, True)


def test_triton_backward_rejects_bad_workspace():
    args = triton_recurrence_args()
    out, h_n, c_n, ws = torch.ops.rnnkern_triton.recurrence("lstm", *args.values(), None, False, False)
    bwd = ("lstm", out, h_n, c_n, args["h0"], args["c0"], args["w_hh"], None, out)
    with pytest.raises(ValueError, match="train=False"):
        torch.ops.rnnkern_triton.recurrence_backward(*bwd, ws, None, False)
    with pytest.raises(ValueError, match=r"workspace of shape \[3, 2, 20\]"):
        torch.ops.rnnkern_triton.recurrence_backward(*bwd, torch.zeros(3, 2, 19).to(out), None, False)
    with pytest.raises(TypeError, match="workspace of dtype torch.float64"):
        torch.ops.rnnkern_triton.recurrence_backward(
            *bwd, torch.zeros(3, 2, 20, dtype=torch.float32, device=TRITON_DEVICE), None, False)


@pytest.mark.parametrize("overrides,exc,words", [
    (dict(w_ih=torch.randn(18, 4, dtype=torch.float64)), ValueError, ["w_ih", "[18, 5]"]),
    (dict(h=torch.randn(3, 5, dtype=torch.float64)), ValueError, ["h", "[3, 6]"]),
    (dict(c=torch.randn(3, 6, dtype=torch.float64)), ValueError, ["c is only defined for lstm"]),
    (dict(x=torch.randn(3, 5)), TypeError, ["w_ih", "dtype"]),
], ids=["w_ih-shape", "h-shape", "c-for-gru", "dtype"])
def test_triton_step_rejects_bad_arguments(overrides, exc, words):
    args = to_device(step_inputs("gru", 3, 5, 6, key=("bad",)), TRITON_DEVICE)
    args.update({k: v.to(TRITON_DEVICE) for k, v in overrides.items()})
    with pytest.raises(exc) as e:
        torch.ops.rnnkern_triton.step("gru", *args.values())
    assert all(w in str(e.value) for w in words), str(e.value)


# --------------------------------------------- module arguments and input ----
# (the modules' constructor and forward checks, against torch.nn's)

T, B, I, H = 6, 4, 3, 5

def _raises_like_torch(theirs_call, ours_call, *words):
    """torch.nn raises; rnnkern raises the same exception type with a message
    holding `words` (the argument's name and what was expected)."""
    with pytest.raises(Exception) as want:
        theirs_call()
    with pytest.raises(type(want.value)) as got:
        ours_call()
    for w in words:
        assert w in str(got.value), (w, str(got.value))


@pytest.mark.parametrize("cls", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("kwargs,words", [
    (dict(hidden_size=0), ["hidden_size", "greater than zero"]),
    (dict(input_size=0), ["input_size", "greater than zero"]),
    (dict(num_layers=0), ["num_layers", "greater than zero"]),
    (dict(dropout=-0.1), ["dropout", "[0, 1]"]),
    (dict(dropout=1.5), ["dropout", "[0, 1]"]),
    (dict(dropout=True), ["dropout", "[0, 1]"]),
    (dict(bias="yes"), ["bias", "bool"]),
], ids=["hidden0", "input0", "layers0", "dropout-neg", "dropout-big", "dropout-bool", "bias-str"])
def test_bad_constructor_arguments(cls, kwargs, words):
    args = dict(input_size=3, hidden_size=5) | kwargs
    _raises_like_torch(lambda: getattr(nn, cls)(**args), lambda: getattr(rnnkern, cls)(**args), *words)


@pytest.mark.parametrize("proj", [5, 7, -1])
def test_bad_proj_size(proj):
    _raises_like_torch(lambda: nn.LSTM(3, 5, proj_size=proj), lambda: rnnkern.LSTM(3, 5, proj_size=proj),
                       "proj_size")


def test_proj_size_only_for_lstm():
    _raises_like_torch(lambda: nn.GRU(3, 5, proj_size=2), lambda: rnnkern.GRU(3, 5, proj_size=2), "proj_size")


def test_unknown_nonlinearity():
    _raises_like_torch(lambda: nn.RNN(3, 5, nonlinearity="gelu"),
                       lambda: rnnkern.RNN(3, 5, nonlinearity="gelu"), "gelu", "tanh", "relu")
    # torch.nn.RNNCell only fails in forward (RuntimeError); rnnkern at construction.
    with pytest.raises(ValueError, match="nonlinearity 'gelu'. Select from 'tanh' or 'relu'"):
        rnnkern.RNNCell(3, 5, nonlinearity="gelu")


@pytest.mark.parametrize("cls", ["RNNCell", "GRUCell", "LSTMCell"])
@pytest.mark.parametrize("args,words", [
    ((3, -1), ["hidden_size", "non-negative", "-1"]),
    ((-2, 5), ["input_size", "non-negative", "-2"]),
    ((3, 5.0), ["hidden_size", "int"]),
], ids=["hidden-negative", "input-negative", "hidden-float"])
def test_bad_cell_sizes(cls, args, words):
    """torch.nn's cells fail here from inside their init (same exception types);
    rnnkern's say which argument is wrong.  Sizes of 0 are valid, as in torch.nn
    (tests/test_torch_contract.py runs hidden_size=0)."""
    _raises_like_torch(lambda: getattr(nn, cls)(*args), lambda: getattr(rnnkern, cls)(*args), *words)


@pytest.mark.parametrize("cls", ["RNNCell", "GRUCell", "LSTMCell", "LayerNormLSTMCell"])
@pytest.mark.parametrize("size", [np.int64(3), torch.tensor(3), torch.tensor([3], dtype=torch.int32), True],
                         ids=["numpy-int64", "tensor-0d", "tensor-1-element", "bool"])
def test_cell_sizes_given_as_integer_indices(cls, size):
    """torch.nn's cells take any integer index as a size (they hand it to
    torch.empty): speechbrain's RNNCell/GRUCell/LSTMCell pass
    ``torch.prod(torch.tensor(input_shape[2:]))``.  rnnkern's take them too, as
    ints, and compute torch.nn's numbers."""
    n = int(size)
    m = getattr(rnnkern, cls)(size, 5).double()
    assert m.input_size == n and type(m.input_size) is int and m.weight_ih.shape == (m.weight_ih.shape[0], n)
    assert getattr(rnnkern, cls)(4, size).hidden_size == n
    if cls == "LayerNormLSTMCell":
        return  # no torch.nn twin; its numbers are tests/test_options_layer_norm.py's
    theirs = getattr(nn, cls)(size, 5).double()
    theirs.load_state_dict(m.state_dict())
    x = torch.randn(2, n, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    for a, b in zip(torch.utils._pytree.tree_leaves(m(x)), torch.utils._pytree.tree_leaves(theirs(x))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", ["RNNCell", "GRUCell", "LSTMCell"])
@pytest.mark.parametrize("size", [3.0, torch.tensor(3.0), torch.tensor([3, 4])],
                         ids=["float", "float-tensor", "tensor-2-elements"])
def test_cell_sizes_that_are_no_integer_index(cls, size):
    _raises_like_torch(lambda: getattr(nn, cls)(size, 5), lambda: getattr(rnnkern, cls)(size, 5),
                       "input_size", "int")


@pytest.mark.parametrize("cls", ["RNN", "GRU", "LSTM", "RNNCell", "GRUCell", "LSTMCell"])
def test_bad_rnnkern_arguments(cls):
    with pytest.raises(ValueError) as e:
        getattr(rnnkern, cls)(3, 5, backend="fortran")
    assert "fortran" in str(e.value) and all(b in str(e.value) for b in ops.BACKENDS)
    if cls.startswith("GRU"):
        for bad in ("yes", 1, None):
            with pytest.raises(TypeError, match="reset_after should be of type bool"):
                getattr(rnnkern, cls)(3, 5, reset_after=bad)
    else:
        with pytest.raises(TypeError, match="reset_after"):
            getattr(rnnkern, cls)(3, 5, reset_after=False)  # GRU only


def _pair(cls, backend="cpu", **kwargs):
    torch.manual_seed(0)
    theirs = getattr(nn, cls)(4, 5, **kwargs)
    ours = getattr(rnnkern, cls)(4, 5, backend=backend, **kwargs)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _hx(cls, *shape, c_shape=None, dtype=torch.float32):
    h = torch.randn(*shape, dtype=dtype)
    return (h, torch.randn(*(c_shape or shape), dtype=dtype)) if cls.startswith("LSTM") else h


_PACK = pack_padded_sequence(torch.randn(5, 3, 4), torch.tensor([5, 2, 4]), enforce_sorted=False)


def _packed_data(data):
    return PackedSequence(data, _PACK.batch_sizes, _PACK.sorted_indices, _PACK.unsorted_indices)


# (name, call(module, cls), words): torch.nn raises an explicit error; so do we.
LIKE_TORCH = [
    ("input-4d", lambda m, c: m(torch.randn(3, 2, 4, 1)), ["input", "2D or 3D", "4D"]),
    ("input-0d", lambda m, c: m(torch.tensor(1.0)), ["input", "2D or 3D", "0D"]),
    ("input-1d", lambda m, c: m(torch.randn(4)), ["input", "2D or 3D", "1D"]),
    ("input-size", lambda m, c: m(torch.randn(3, 2, 7)), ["input_size", "4", "7"]),
    ("input-size-unbatched", lambda m, c: m(torch.randn(3, 7)), ["input_size", "4", "7"]),
    ("input-dtype", lambda m, c: m(torch.randn(3, 2, 4, dtype=torch.float64)), ["dtype", "float64"]),
    ("seq-len-0", lambda m, c: m(torch.randn(0, 2, 4)), ["sequence length"]),
    ("hx-batch", lambda m, c: m(torch.randn(3, 2, 4), _hx(c, 1, 3, 5)), ["hidden", "(1, 2, 5)", "[1, 3, 5]"]),
    ("hx-layers", lambda m, c: m(torch.randn(3, 2, 4), _hx(c, 2, 2, 5)), ["hidden", "(1, 2, 5)", "[2, 2, 5]"]),
    ("hx-rank", lambda m, c: m(torch.randn(3, 2, 4), _hx(c, 2, 5)), ["hx", "3-D", "2-D"]),
    ("hx-rank-unbatched", lambda m, c: m(torch.randn(3, 4), _hx(c, 1, 1, 5)), ["hx", "2-D", "3-D"]),
    ("packed-data-3d", lambda m, c: m(_packed_data(torch.randn(11, 2, 4))), ["input", "2 dimensions", "3"]),
    ("packed-hx-layers", lambda m, c: m(_PACK, _hx(c, 2, 3, 5)), ["hidden", "(1, 3, 5)", "[2, 3, 5]"]),
]


@pytest.mark.parametrize("backend", ["cpu", "auto"])
@pytest.mark.parametrize("cls", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("name,bad,words", LIKE_TORCH, ids=[c[0] for c in LIKE_TORCH])
def test_bad_input_like_torch(cls, name, bad, words, backend):
    """(auto too: its choice reads the input's sizes, after these checks.)"""
    theirs, ours = _pair(cls, backend)
    if cls == "LSTM" and name == "packed-hx-layers":
        # torch.nn.LSTM fails here with "Expected more hidden states in stacked_rnn".
        with pytest.raises(RuntimeError, match=r"Expected hidden\[0\] size \(1, 3, 5\), got \[2, 3, 5\]"):
            ours(_PACK, _hx(cls, 2, 3, 5))
        return
    _raises_like_torch(lambda: bad(theirs, cls), lambda: bad(ours, cls), *words)


@pytest.mark.parametrize("backend", ["auto", "cpu", "reference"])
@pytest.mark.parametrize("cls", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("shape", [(), (4,), (3, 2, 4, 1)], ids=["0d", "1d", "4d"])
def test_input_rank_error_is_torch_nns(cls, shape, backend):
    """Word for word: torch.nn's RNN says "got 0D tensor instead", its GRU and
    LSTM "got 0D instead"."""
    theirs, ours = _pair(cls, backend)
    x = torch.randn(shape)
    with pytest.raises(ValueError) as want:
        theirs(x)
    with pytest.raises(ValueError) as got:
        ours(x)
    assert str(got.value) == str(want.value)


def test_lstm_cell_state_shape_like_torch():
    theirs, ours = _pair("LSTM")
    hx = (torch.randn(1, 2, 5), torch.randn(1, 2, 6))
    _raises_like_torch(lambda: theirs(torch.randn(3, 2, 4), hx), lambda: ours(torch.randn(3, 2, 4), hx),
                       "hidden[1]", "(1, 2, 5)", "[1, 2, 6]")


# (name, call(module, cls), exception, words): torch.nn fails obscurely or not at all.
CLEARER_THAN_TORCH = [
    ("packed-data-size", lambda m, c: m(_packed_data(torch.randn(11, 7))), RuntimeError,
     ["input_size", "4", "7"]),
    ("packed-data-rows", lambda m, c: m(_packed_data(torch.randn(10, 4))), RuntimeError,
     ["PackedSequence data has 10 rows", "11"]),
    ("packed-hx-batch", lambda m, c: m(_PACK, _hx(c, 1, 2, 5)), RuntimeError, ["hidden", "(1, 3, 5)", "[1, 2, 5]"]),
    ("hx-dtype", lambda m, c: m(torch.randn(3, 2, 4), _hx(c, 1, 2, 5, dtype=torch.float64)), RuntimeError,
     ["hx", "float64", "float32"]),
    ("hx-not-tensor", lambda m, c: m(torch.randn(3, 2, 4), [1, 2]), TypeError, ["hx", "Tensor"]),
    ("input-not-tensor", lambda m, c: m([[1.0] * 4]), TypeError, ["input", "Tensor", "list"]),
    ("lengths-with-packed", lambda m, c: m(_PACK, lengths=torch.tensor([1, 2, 3])), ValueError,
     ["lengths", "PackedSequence"]),
    ("lengths-unbatched", lambda m, c: m(torch.randn(3, 4), lengths=torch.tensor([3])), ValueError,
     ["lengths", "batched"]),
    ("lengths-shape", lambda m, c: m(torch.randn(3, 2, 4), lengths=torch.tensor([3])), ValueError,
     ["lengths", "[2]"]),
    ("lengths-range", lambda m, c: m(torch.randn(3, 2, 4), lengths=torch.tensor([3, 4])), ValueError,
     ["lengths", "[0, 3]"]),
    ("lengths-negative", lambda m, c: m(torch.randn(3, 2, 4), lengths=torch.tensor([3, -1])), ValueError,
     ["lengths", "[0, 3]"]),
    ("lengths-float", lambda m, c: m(torch.randn(3, 2, 4), lengths=torch.tensor([3.0, 1.0])), TypeError,
     ["lengths", "integer"]),
]


@pytest.mark.parametrize("backend", ["cpu", "auto"])
@pytest.mark.parametrize("cls", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("name,bad,exc,words", CLEARER_THAN_TORCH, ids=[c[0] for c in CLEARER_THAN_TORCH])
def test_bad_input_clear_errors(cls, name, bad, exc, words, backend):
    _, ours = _pair(cls, backend)
    with pytest.raises(exc) as e:
        bad(ours, cls)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_lstm_hx_must_be_a_pair():
    """A batched call's hx that is not a pair: torch.nn's exception types (it indexes
    hx[0] and hx[1] first), messages saying what was expected.  A tensor without a
    second state or a 1-tuple: IndexError; a tensor whose states are not 3-D:
    torch.nn's RuntimeError; a stacked [2, L, B, H] tensor: TypeError (aten's); a
    tuple of three: RuntimeError, "expects two hidden states"."""
    theirs, ours = _pair("LSTM")
    x, h = torch.randn(3, 2, 4), torch.randn(1, 2, 5)
    cases = [(h, IndexError, r"hx must be a tuple \(h_0, c_0\).*shape \[1, 2, 5\]"),
             ((h,), IndexError, r"hx must be a tuple \(h_0, c_0\).*tuple of 1"),
             (torch.randn(2, 2, 5), RuntimeError, r"hx and cx should also be 3-D but got \(2-D, 2-D\)"),
             (torch.randn(2, 1, 2, 5), TypeError, r"hx must be a tuple \(h_0, c_0\)"),
             ((h, h, h), RuntimeError, r"LSTM: lstm expects two hidden states.*got 3"),
             ([h, h, h], RuntimeError, r"LSTM: lstm expects two hidden states.*got 3")]
    for hx, exc, words in cases:
        with pytest.raises(exc):
            theirs(x, hx)
        with pytest.raises(exc, match=words):
            ours(x, hx)
    for cls in (nn.LSTMCell, rnnkern.LSTMCell):
        cell = cls(4, 5)
        x1, h1 = torch.randn(2, 4), torch.randn(2, 5)
        for hx in ((h1,), (h1, h1, h1)):
            with pytest.raises(RuntimeError, match="lstm_cell expects two hidden states"):
                cell(x1, hx)
        with pytest.raises(TypeError):
            cell(x1, h1)
        with pytest.raises(IndexError):  # unbatched: indexed, no second state
            cell(x1[0], (h1[0],))


def _stacked_hx_calls():
    """(name, module class, kwargs, make inputs) of the calls where torch.nn makes
    an LSTM's pair of states by indexing hx, so that a stacked tensor (or a longer
    tuple) works there."""
    def unbatched(g):
        return torch.randn(3, 4, generator=g, dtype=torch.float64), \
            torch.randn(2, 2, 5, generator=g, dtype=torch.float64)

    def unbatched_three(g):
        x, hx = unbatched(g)
        return x, [hx[0], hx[1], torch.randn(2, 5, generator=g, dtype=torch.float64)]

    def packed_unsorted(g):
        x = torch.randn(3, 3, 4, generator=g, dtype=torch.float64)
        return pack_padded_sequence(x, [2, 3, 1], enforce_sorted=False), \
            torch.randn(2, 4, 3, 5, generator=g, dtype=torch.float64)

    def cell_unbatched(g):
        return torch.randn(4, generator=g, dtype=torch.float64), \
            torch.randn(2, 5, generator=g, dtype=torch.float64)

    def cell_unbatched_three(g):
        return torch.randn(4, generator=g, dtype=torch.float64), \
            torch.randn(3, 5, generator=g, dtype=torch.float64)

    return [("lstm-unbatched-stacked", "LSTM", dict(num_layers=2), unbatched),
            ("lstm-unbatched-three", "LSTM", dict(num_layers=2), unbatched_three),
            ("lstm-packed-unsorted-stacked", "LSTM", dict(num_layers=2, bidirectional=True),
             packed_unsorted),
            ("cell-unbatched-stacked", "LSTMCell", {}, cell_unbatched),
            ("cell-unbatched-three", "LSTMCell", {}, cell_unbatched_three)]


@pytest.mark.parametrize("backend", ["cpu", "reference", "auto"])
@pytest.mark.parametrize("name,cls,kwargs,make", _stacked_hx_calls(), ids=[c[0] for c in _stacked_hx_calls()])
def test_lstm_hx_indexed_where_torch_nn_indexes_it(name, cls, kwargs, make, backend):
    """Where torch.nn's forward makes the LSTM's pair itself, (hx[0], hx[1]) (an
    unbatched call, a PackedSequence with a permutation), a stacked tensor or a
    longer tuple works there: the same outputs and gradients here, in float64,
    the gradient reaching the stacked tensor."""
    torch.manual_seed(0)
    theirs = getattr(nn, cls)(4, 5, **kwargs).double()
    ours = getattr(rnnkern, cls)(4, 5, backend=backend, **kwargs).double()
    ours.load_state_dict(theirs.state_dict())
    results = []
    for m in (theirs, ours):
        x, hx = make(generator(1))
        leaves = [hx.requires_grad_()] if isinstance(hx, torch.Tensor) else [h.requires_grad_() for h in hx]
        result = m(x, hx)  # LSTMCell: (h, c); LSTM: (output, (h_n, c_n))
        outs = list(result) if cls == "LSTMCell" else [result[0], *result[1]]
        outs = [o.data if isinstance(o, PackedSequence) else o for o in outs]
        w = [torch.randn(o.shape, generator=generator(2), dtype=o.dtype) for o in outs]
        grads = torch.autograd.grad(sum((o * wi).sum() for o, wi in zip(outs, w)),
                                    leaves + list(m.parameters()), allow_unused=True)
        results.append((outs, grads))
    (want_out, want_grad), (got_out, got_grad) = results
    for a, b in zip(want_out, got_out):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    for a, b in zip(want_grad, got_grad):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


# Cells: (name, call(cell, cls), words); torch.nn raises the same type.
CELL_LIKE_TORCH = [
    ("input-3d", lambda m, c: m(torch.randn(2, 3, 4)), ["input", "1D or 2D", "3D"]),
    ("input-size", lambda m, c: m(torch.randn(3, 7)), ["input_size", "7", "4"]),
    ("hx-3d", lambda m, c: m(torch.randn(3, 4), _hx(c, 1, 3, 5)), ["1D or 2D", "3D"]),
    ("hx-batch", lambda m, c: m(torch.randn(3, 4), _hx(c, 2, 5)), ["batch size", "3", "2"]),
    ("hx-size", lambda m, c: m(torch.randn(3, 4), _hx(c, 3, 6)), ["hidden_size", "6", "5"]),
]


@pytest.mark.parametrize("backend", ["cpu", "auto"])
@pytest.mark.parametrize("cls", ["RNNCell", "GRUCell", "LSTMCell"])
@pytest.mark.parametrize("name,bad,words", CELL_LIKE_TORCH, ids=[c[0] for c in CELL_LIKE_TORCH])
def test_cell_bad_input_like_torch(cls, name, bad, words, backend):
    theirs, ours = _pair(cls, backend)
    _raises_like_torch(lambda: bad(theirs, cls), lambda: bad(ours, cls), *words)


# torch.nn raises RuntimeError here too (or, for hx-rank-batched, an IndexError
# from inside aten), with messages about matrix products or sizes.
CELL_CLEARER = [
    ("hx-rank-unbatched", lambda m, c: m(torch.randn(4), _hx(c, 1, 5)), RuntimeError, ["1D like the input"]),
    ("hx-rank-batched", lambda m, c: m(torch.randn(3, 4), _hx(c, 5)), RuntimeError, ["2D like the input"]),
    ("input-dtype", lambda m, c: m(torch.randn(3, 4, dtype=torch.float64)), RuntimeError, ["input", "float64"]),
    ("hx-dtype", lambda m, c: m(torch.randn(3, 4), _hx(c, 3, 5, dtype=torch.float64)), RuntimeError,
     ["hx", "float64"]),
    # (torch.nn: an AttributeError, "'list' object has no attribute 'dim'".)
    ("input-not-tensor", lambda m, c: m([[1.0] * 4]), TypeError, ["input", "Tensor", "list"]),
]


@pytest.mark.parametrize("backend", ["cpu", "auto"])
@pytest.mark.parametrize("cls", ["RNNCell", "GRUCell", "LSTMCell"])
@pytest.mark.parametrize("name,bad,exc,words", CELL_CLEARER, ids=[c[0] for c in CELL_CLEARER])
def test_cell_bad_input_clear_errors(cls, name, bad, exc, words, backend):
    _, ours = _pair(cls, backend)
    with pytest.raises(exc) as e:
        bad(ours, cls)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_lstm_cell_hx_must_be_a_pair():
    theirs, ours = _pair("LSTMCell")
    _raises_like_torch(lambda: theirs(torch.randn(3, 4), torch.randn(3, 5)),
                       lambda: ours(torch.randn(3, 4), torch.randn(3, 5)), "hx", "tuple")

"""Bad input gets a clear error naming the argument; edge cases behave as torch.nn."""
from __future__ import annotations

import pytest
import torch

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

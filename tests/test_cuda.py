"""The CUDA kernels (backend="cuda", csrc/cuda) against the reference, the CPU
backend and torch.nn (cuDNN); the step options and the LayerNorm cell against the reference (last
section).

The first tests run everywhere: a build made with nvcc present must contain the
CUDA kernels.  Every other test needs a GPU (``gpu`` marker, skipped with the
reason where there is none).  The conftest fixture makes torch.empty return NaN
on CUDA too (ATen's empty_cuda honours fill_uninitialized_memory), so every
buffer a kernel forgets to write fails these comparisons.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import rnnkern
from rnnkern import ops, reference, tolerance
from conftest import (CELLS, assert_close, assert_low_precision, differentiable, generator,
                      outputs_and_grads, randn, recurrence_inputs, rnnkern_module,
                      run_recurrence, step_inputs, to_device, torch_module)

OPS = ("recurrence", "recurrence_backward", "step", "step_backward")
CASES = [(cell, 0) for cell in CELLS] + [("lstm", 3)]
CASE_IDS = [f"{c}-proj{p}" if p else c for c, p in CASES]
TORCH_CELLS = [c for c in CELLS if c != "gru_reset_before"]
LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}
gpu = pytest.mark.gpu
DEV = "cuda"


def nvcc_present() -> bool:
    """What setup.py looks for (RNNKERN_SKIP_CUDA, CUDA_HOME / CUDA_PATH, nvcc on PATH)."""
    if os.environ.get("RNNKERN_SKIP_CUDA", "0") == "1":
        return False
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return True
    return shutil.which("nvcc") is not None


# (gradcheck of recurrence and step, opcheck, no workspace without grad, empty
# sizes: the backend contract, tests/test_backend_contract.py)


# ------------------------------------------------------------ no GPU needed ----

def test_cuda_kernels_built_with_nvcc():
    """A build made where nvcc and a CUDA build of torch are present has the
    CUDA kernels of all four ops registered; WITH_CUDA says so, all or nothing."""
    registered = {op: torch._C._dispatch_has_kernel_for_dispatch_key(f"rnnkern::{op}", "CUDA")
                  for op in OPS}
    assert all(registered.values()) == ops.WITH_CUDA, registered
    assert any(registered.values()) == ops.WITH_CUDA, registered
    if torch.version.cuda is not None and nvcc_present():
        assert ops.WITH_CUDA, (f"nvcc and torch CUDA {torch.version.cuda} are present but rnnkern "
                               f"was built without its CUDA kernels: {registered}")


def test_auto_picks_cuda_for_cuda_tensors():
    want = "cuda" if ops.WITH_CUDA else "triton"
    assert ops.resolve_backend("auto", torch.device("cuda", 0)) == want
    assert ops.resolve_backend("auto", torch.device("cpu")) == "cpu"


def test_cuda_backend_refuses_cpu_tensors():
    args = recurrence_inputs("gru", 3, 2, 4)
    with pytest.raises(ValueError, match="backend='cuda'.*cpu"):
        ops.recurrence("gru", *args.values(), backend="cuda")


# --------------------------------------------------------------- helpers ----

def assert_as_accurate_as(ours, theirs, truth, what=""):
    """Result `ours` (float32 or a half type) against the float64 `truth`: its error may be
    at most twice that of `theirs` (torch.nn's), plus one rounding of the result
    to its dtype (eps * |truth|, Frobenius norms).  That floor is what a
    perfect fp32 computation rounded once to bf16/fp16 may already cost: on a
    handful of elements, torch.nn rounding luckily to the exact value would
    otherwise fail a correct kernel."""
    eps = torch.finfo(ours.dtype).eps
    ours, theirs, truth = (t.detach().double() for t in (ours, theirs, truth))
    own = (theirs - truth).norm().item()
    err = (ours - truth).norm().item()
    floor = eps * truth.norm().item()
    assert err <= 2 * own + floor, f"{what}: error {err:.3e} > 2 x torch.nn's {own:.3e} + {floor:.3e}"


def compared_in_low_precision(cell, name):
    """The derivative of ReLU jumps at 0: in fp16/bf16 a pre-activation within
    rounding of 0 legitimately lands on either side, in ours or in torch.nn's,
    and moves a gradient element by O(1).  A norm comparison of rnn_relu
    gradients in half precision is therefore a coin toss; they are checked in
    float64 (gradcheck), float32 (against cuDNN) and against the reference's
    own bfloat16 error (test_half_types_within_reference_error), and share
    every line of half-precision handling with rnn_tanh's."""
    return not (cell == "rnn_relu" and name.startswith("grad"))


@pytest.fixture
def exact_fp32():
    """float32 without TF32, in cuDNN and in matmuls, for tight comparisons."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    cudnn = torch.backends.cudnn
    # The context manager: tests/test_torch_contract.py imports torch's test
    # utilities, which forbid assigning cuDNN's flags.
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark,
                     deterministic=cudnn.deterministic, allow_tf32=False):
        yield
    torch.backends.cuda.matmul.allow_tf32 = saved


# --------------------------------------- same results as the CPU backend ----

def raw_ops_results(device, cell, args, lengths, reverse):
    """Every output of recurrence and recurrence_backward, in the op's own layout."""
    a = {k: None if v is None else v.detach().to(device) for k, v in args.items()}
    fwd = torch.ops.rnnkern.recurrence(cell, *a.values(), lengths, reverse, True)
    out, h_n, c_n, ws = fwd
    g = generator("raw-ops", cell)
    grad_out, grad_h = randn(g, *out.shape).to(device), randn(g, *h_n.shape).to(device)
    grad_c = randn(g, *c_n.shape).to(device) if cell == "lstm" else None
    bwd = torch.ops.rnnkern.recurrence_backward(cell, grad_out, grad_h, grad_c, a["h0"], a["c0"],
                                                a["w_hh"], a["w_hr"], out, ws, lengths, reverse)
    return list(fwd) + list(bwd)


@gpu
@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("variant", ["plain", "reverse", "lengths", "lengths-reverse"])
def test_ops_match_cpu_backend_float64(cell, proj, variant):
    """The same op outputs as the CPU kernels -- output, states, workspace,
    placeholders, every gradient -- in shape, dtype and value; sizes that are
    not multiples of anything."""
    T, B, H = 9, 5, 37
    args = recurrence_inputs(cell, T, B, H, proj=proj and 11, key=("raw", variant))
    lengths = torch.tensor([9, 3, 0, 7, 1]) if "lengths" in variant else None
    reverse = "reverse" in variant
    want = raw_ops_results("cpu", cell, args, lengths, reverse)
    got = raw_ops_results(DEV, cell, args, lengths, reverse)
    names = ["output", "h_n", "c_n", "workspace", "grad_xproj", "grad_h0", "grad_c0", "grad_w_hh",
             "grad_b_ih", "grad_b_hh", "grad_w_hr"]
    for name, a, b in zip(names, got, want):
        assert a.device.type == "cuda", name
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        assert_close(a.cpu(), b, what=name)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_workspace_layout_of_half_types(dtype):
    """The workspace is kept in the accumulate dtype, as on the CPU."""
    args = to_device(recurrence_inputs("lstm", 4, 3, 8, dtype=dtype), DEV)
    *_, ws = torch.ops.rnnkern.recurrence("lstm", *args.values(), None, False, True)
    assert ws.shape == (4, 3, 5 * 8) and ws.dtype == ops.acc_dtype(dtype)
    *_, ws = torch.ops.rnnkern.recurrence("lstm", *args.values(), None, False, False)
    assert ws.numel() == 0 and ws.device.type == "cuda"


@gpu
@pytest.mark.parametrize("cell", CELLS)
def test_step_ops_match_cpu_backend_float64(cell):
    s = step_inputs(cell, 5, 7, 33, key=("raw-step",))
    results = []
    for device in ("cpu", DEV):
        a = {k: None if v is None else v.to(device) for k, v in s.items()}
        h, c, ws = torch.ops.rnnkern.step(cell, *a.values())
        g = generator("raw-step-grad", cell)
        gh = randn(g, *h.shape).to(device)
        gc = randn(g, *c.shape).to(device) if cell == "lstm" else None
        bwd = torch.ops.rnnkern.step_backward(cell, gh, gc, a["x"], a["h"], a["c"], a["w_ih"],
                                              a["w_hh"], h, ws)
        results.append([h, c, ws, *bwd])
    for i, (a, b) in enumerate(zip(results[1], results[0])):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        assert_close(a.cpu(), b, what=f"result {i}")


@gpu
@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", list(LOW.values()), ids=list(LOW))
def test_half_types_within_reference_error(cell, proj, dtype):
    """Every cell (gru_reset_before has no torch.nn twin) in half precision,
    with lengths in reverse: no worse than twice the reference's own error."""
    T, B, H = 16, 5, 40
    args = to_device(
        recurrence_inputs(cell, T, B, H, dtype=dtype, proj=proj and 9, key=("half",)), DEV)
    lengths = torch.tensor([16, 5, 0, 9, 1])
    a16 = {k: None if v is None else v.requires_grad_() for k, v in args.items()}
    a32 = {k: None if v is None else v.detach().float().requires_grad_() for k, v in args.items()}
    key = ("half-cot", cell)
    want = outputs_and_grads("reference", cell, a32, lengths, True, key=key)
    ref16 = outputs_and_grads("reference", cell, a16, lengths, True, key=key)
    got = outputs_and_grads("cuda", cell, a16, lengths, True, key=key)
    for name in want:
        assert got[name].dtype == dtype, name
        assert_low_precision(got[name], ref16[name], want[name], what=name)


# ---------------------------------------------------- torch.nn parity ----

# (T, B, H): every H of {1, 3, 33, 257, 768}, T of {1, 1000}, B of {1, 300}; few big ones.
PARITY_SIZES = [(1, 1, 1), (1000, 1, 3), (1, 300, 33), (1000, 300, 33), (50, 7, 257),
                (1000, 1, 768), (1, 300, 768)]
PARITY_IDS = [f"T{T}-B{B}-H{H}" for T, B, H in PARITY_SIZES]


def module_results(module, x, hx, cotangents):
    """Outputs, final states and the gradients of the input, the initial states
    and every parameter, under sum(output * cotangent)."""
    lstm = isinstance(module, torch.nn.LSTM)
    x = x.detach().requires_grad_()
    hx = tuple(h.detach().requires_grad_() for h in hx)
    out, hidden = module(x, hx if lstm else hx[0])
    hidden = hidden if isinstance(hidden, tuple) else (hidden,)
    results = [out, *hidden]
    loss = sum((r * c).sum() for r, c in zip(results, cotangents))
    grads = torch.autograd.grad(loss, [x, *hx, *module.parameters()])
    names = ["output"] + [f"hidden{i}" for i in range(len(hidden))] + ["grad_input"] + \
            [f"grad_hx{i}" for i in range(len(hx))] + [f"grad_{n}" for n, _ in module.named_parameters()]
    return dict(zip(names, [*results, *grads]))


def nn_parity(cell, T, B, H, dtype, proj=0, I=13, key=()):
    """(ours, torch.nn's, truth): rnnkern's CUDA kernels and torch.nn in `dtype`
    on the same (dtype-valued) weights and inputs, and torch.nn in float64
    without cuDNN as the truth."""
    kw = {"proj_size": proj} if proj else {}
    torch.manual_seed(T * 7919 + B * 31 + H)
    theirs = torch_module(cell, I, H, **kw).to(DEV, dtype)
    ours = rnnkern_module(cell, I, H, backend="cuda", **kw).to(DEV, dtype)
    ours.load_state_dict(theirs.state_dict())
    truth = torch_module(cell, I, H, **kw).to(DEV, torch.float64)
    truth.load_state_dict({k: v.double() for k, v in theirs.state_dict().items()})
    g = generator("nn-parity", cell, T, B, H, str(dtype), proj, *key)
    P = proj or H
    x = randn(g, T, B, I, dtype=dtype).to(DEV)
    hx = [randn(g, 1, B, P, dtype=dtype, scale=0.5).to(DEV)]
    if cell == "lstm":
        hx.append(randn(g, 1, B, H, dtype=dtype, scale=0.5).to(DEV))
    cot = [randn(g, T, B, P, dtype=dtype).to(DEV)] + [randn(g, *h.shape, dtype=dtype).to(DEV) for h in hx]
    r_ours = module_results(ours, x, hx, cot)
    r_theirs = module_results(theirs, x, hx, cot)
    with torch.backends.cudnn.flags(enabled=False):
        r_truth = module_results(truth, x.double(), [h.double() for h in hx], [c.double() for c in cot])
    return r_ours, r_theirs, r_truth


@gpu
@pytest.mark.parametrize("cell", TORCH_CELLS)
@pytest.mark.parametrize("T,B,H", PARITY_SIZES, ids=PARITY_IDS)
def test_matches_cudnn_float32(cell, T, B, H, exact_fp32):
    """Each result equals cuDNN's within the float32 tolerance, or, where the two
    differ by more, is at least as accurate as cuDNN's against the float64 truth
    (at most twice cuDNN's own error, plus one rounding).  Over T=1000 steps two
    correct float32 computations summing in different orders can drift apart by
    more than one float32 tolerance (seen on an H100: grad_input of T1000-B1-H3,
    2.8e-5 apart where 1.9e-5 is allowed); which of the two is wrong then only
    the truth can say."""
    ours, theirs, truth = nn_parity(cell, T, B, H, torch.float32)
    for name in truth:
        assert ours[name].dtype == torch.float32, name
        if tolerance.close_error(ours[name], theirs[name], torch.float32) > tolerance.TOL[torch.float32]:
            assert_as_accurate_as(ours[name], theirs[name], truth[name], what=name)


@gpu
@pytest.mark.parametrize("cell", TORCH_CELLS)
@pytest.mark.parametrize("T,B,H", PARITY_SIZES, ids=PARITY_IDS)
@pytest.mark.parametrize("dtype", list(LOW.values()), ids=list(LOW))
def test_matches_cudnn_half_types(cell, T, B, H, dtype):
    """Against the float64 truth, no worse than twice cuDNN's own error (plus
    one rounding), per output, final state and gradient."""
    ours, theirs, truth = nn_parity(cell, T, B, H, dtype)
    for name in truth:
        assert ours[name].dtype == dtype, name
        if compared_in_low_precision(cell, name):
            assert_as_accurate_as(ours[name], theirs[name], truth[name], what=name)


@gpu
@pytest.mark.parametrize("T,B,H", [(1, 3, 33), (200, 16, 257)], ids=["T1-B3-H33", "T200-B16-H257"])
@pytest.mark.parametrize("dtype", [torch.float32, *LOW.values()], ids=["fp32", *LOW])
def test_lstm_projection_matches_cudnn(T, B, H, dtype, exact_fp32):
    ours, theirs, truth = nn_parity("lstm", T, B, H, dtype, proj=H // 3)
    for name in truth:
        if dtype == torch.float32:
            assert_close(ours[name], theirs[name], what=name)
        else:
            assert_as_accurate_as(ours[name], theirs[name], truth[name], what=name)


@gpu
@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_packed_bidirectional_stack_matches_cudnn(cell, exact_fp32):
    """Two bidirectional layers on a packed batch (lengths and reverse inside
    the kernels), float32, through the modules."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
    torch.manual_seed(5)
    I, H = 6, 33
    theirs = torch_module(cell, I, H, num_layers=2, bidirectional=True).to(DEV)
    ours = rnnkern_module(cell, I, H, num_layers=2, bidirectional=True, backend="cuda").to(DEV)
    ours.load_state_dict(theirs.state_dict())
    g = generator("packed", cell)
    x = randn(g, 11, 4, I, dtype=torch.float32).to(DEV).requires_grad_()
    lengths = torch.tensor([11, 7, 3, 1])
    results = []
    for m in (theirs, ours):
        out, hidden = m(pack_padded_sequence(x, lengths, enforce_sorted=False))
        out = pad_packed_sequence(out)[0]
        hidden = hidden if isinstance(hidden, tuple) else (hidden,)
        loss = (out * out.detach().sin()).sum() + sum((h * h.detach().cos()).sum() for h in hidden)
        results.append([out, *hidden, *torch.autograd.grad(loss, [x, *m.parameters()])])
    for i, (a, b) in enumerate(zip(results[1], results[0])):
        assert_close(a, b, what=f"result {i}")


@gpu
@pytest.mark.parametrize("cell", TORCH_CELLS)
@pytest.mark.parametrize("BIH", [(1, 1, 1), (3, 33, 257), (300, 70, 768)], ids=lambda s: "B{}-I{}-H{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, *LOW.values()], ids=["fp32", *LOW])
def test_step_matches_torch_cells(cell, BIH, dtype, exact_fp32):
    """The fused step kernel (tensor cores for half types) through the cell
    modules, against torch.nn's cells: outputs and every gradient."""
    B, I, H = BIH
    torch.manual_seed(B + I + H)
    cls = {"lstm": torch.nn.LSTMCell, "gru": torch.nn.GRUCell}.get(cell, torch.nn.RNNCell)
    kw = {"nonlinearity": cell[4:]} if cls is torch.nn.RNNCell else {}
    ours_cls = {"lstm": rnnkern.LSTMCell, "gru": rnnkern.GRUCell}.get(cell, rnnkern.RNNCell)
    theirs = cls(I, H, **kw).to(DEV, dtype)
    ours = ours_cls(I, H, backend="cuda", **kw).to(DEV, dtype)
    ours.load_state_dict(theirs.state_dict())
    truth = cls(I, H, **kw).to(DEV, torch.float64)
    truth.load_state_dict({k: v.double() for k, v in theirs.state_dict().items()})
    g = generator("cells", cell, B, I, H, str(dtype))
    x = randn(g, B, I, dtype=dtype).to(DEV)
    hx = [randn(g, B, H, dtype=dtype, scale=0.5).to(DEV) for _ in range(2 if cell == "lstm" else 1)]
    cot = [randn(g, B, H, dtype=dtype).to(DEV) for _ in hx]

    def results(m, cast):
        xs = cast(x).requires_grad_()
        hs = [cast(h).requires_grad_() for h in hx]
        out = m(xs, tuple(hs) if cell == "lstm" else hs[0])
        out = out if isinstance(out, tuple) else (out,)
        loss = sum((o * cast(c)).sum() for o, c in zip(out, cot))
        return [*out, *torch.autograd.grad(loss, [xs, *hs, *m.parameters()])]

    r_ours, r_theirs = results(ours, lambda t: t), results(theirs, lambda t: t)
    r_truth = results(truth, lambda t: t.double())
    names = ["h", "c"][:len(hx)] + ["grad_x"] + [f"grad_hx{i}" for i in range(len(hx))] + \
        [f"grad_{n}" for n, _ in theirs.named_parameters()]
    for name, a, b, t in zip(names, r_ours, r_theirs, r_truth):
        assert a.dtype == dtype
        if dtype == torch.float32:
            assert_close(a, b, what=name)
        elif compared_in_low_precision(cell, name):
            assert_as_accurate_as(a, b, t, what=name)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, *LOW.values()], ids=["fp32", *LOW])
def test_step_reset_before_within_reference_error(dtype):
    args = to_device(step_inputs("gru_reset_before", 19, 40, 70, dtype=dtype, key=("rb",)), DEV)
    h, _ = ops.step("gru_reset_before", *args.values(), backend="cuda")
    a64 = {k: None if v is None else v.double() for k, v in args.items()}
    want, _ = reference.step("gru_reset_before", *a64.values())
    if dtype == torch.float32:
        assert_close(h, want.float())
    else:
        own, _ = reference.step("gru_reset_before", *args.values())
        assert_low_precision(h, own, want, what="h")


@gpu
def test_tf32_is_honoured_and_close():
    """Both settings of allow_tf32 run (CUBLAS_COMPUTE_32F_FAST_TF32 or not):
    within TF32 accuracy of float64 with it, within float32's without it, and
    with it the error is TF32's (unit roundoff 2^-11), not float32's (2^-24):
    a kernel that ignores the flag fails the lower bound.

    FAST_TF32 allows tensor cores, it does not require them: at small products
    cuBLAS may pick float32 kernels (an H100 run at B=8, H=257: the same bits
    either way).  So the sizes are ones where the tensor cores pay (the step's
    product 256 x 4096 x 1024), and torch's own matmul of that product under
    the same flag shows the TF32 error, the premise, checked first."""
    T, B, H = 3, 256, 1024
    args = to_device(recurrence_inputs("lstm", T, B, H, dtype=torch.float32, key=("tf32",)), DEV)
    a64 = {k: None if v is None else v.double() for k, v in args.items()}
    want = run_recurrence("reference", "lstm", a64)[0]
    saved = torch.backends.cuda.matmul.allow_tf32
    h, w = args["h0"], args["w_hh"]
    exact = h.double() @ w.double().t()
    results, errs = {}, {}
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        premise = ((h @ w.t()).double() - exact).norm() / exact.norm()
        assert premise > 1e-5, f"torch's own matmul shows no TF32 error ({premise:.1e}) at this size"
        for allow in (True, False):
            torch.backends.cuda.matmul.allow_tf32 = allow
            results[allow] = run_recurrence("cuda", "lstm", args)[0]
            errs[allow] = ((results[allow].double() - want).norm() / want.norm()).item()
            assert errs[allow] < (1e-2 if allow else 1e-5), (allow, errs[allow])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert errs[True] > 1e-5 and errs[True] > 10 * errs[False], errs
    diff = ((results[True] - results[False]).double().norm() / want.norm()).item()
    assert diff > 1e-5, f"TF32 on and off differ by {diff:.2e} only: float32 products both times?"


# ------------------------------------------------------ edge cases, misc ----

@gpu
def test_poisoning_covers_cuda():
    """The conftest fixture makes CUDA allocations NaN, so the tests above see
    every element a kernel leaves unwritten."""
    assert torch.empty(16, device=DEV).isnan().all()
    assert torch.empty(16, device=DEV, dtype=torch.bfloat16).isnan().all()


@gpu
@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
def test_padding_is_zero_and_states_kept(cell, proj):
    """Finished sequences output exact zeros and keep their state; an empty
    sequence returns its initial state."""
    args = to_device(recurrence_inputs(cell, 6, 3, 5, proj=proj and 2, key=("pad",)), DEV)
    out, h_n, c_n = run_recurrence("cuda", cell, args, torch.tensor([6, 2, 0]))
    assert out.isfinite().all()
    assert (out[2:, 1] == 0).all() and (out[:, 2] == 0).all()
    assert torch.equal(h_n[2], args["h0"][2]) and torch.equal(h_n[1], out[1, 1])
    if cell == "lstm":
        assert torch.equal(c_n[2], args["c0"][2])


@gpu
@pytest.mark.parametrize("cell", ["lstm", "gru_reset_before"])
def test_strided_xproj_and_grad_output(cell):
    """Batch-first views (rows strided, not contiguous) of xproj and of
    grad_output give the contiguous results."""
    args = to_device(recurrence_inputs(cell, 7, 4, 9, key=("strided",)), DEV)
    lstm = cell == "lstm"
    fwd = torch.ops.rnnkern.recurrence(cell, *args.values(), None, False, True)
    xp = args["xproj"].transpose(0, 1).contiguous().transpose(0, 1)
    assert not xp.is_contiguous()
    fwd_strided = torch.ops.rnnkern.recurrence(cell, xp, *list(args.values())[1:], None, False, True)
    for i, (a, b) in enumerate(zip(fwd_strided, fwd)):
        assert_close(a, b, what=f"forward result {i}")
    out, h_n, c_n, ws = fwd
    g = generator("strided-grad", cell)
    gout = randn(g, *out.shape).to(DEV)
    gout_strided = gout.transpose(0, 1).contiguous().transpose(0, 1)
    gh, gc = randn(g, *h_n.shape).to(DEV), randn(g, *c_n.shape).to(DEV) if lstm else None
    rest = (gh, gc, args["h0"], args["c0"], args["w_hh"], args["w_hr"], out, ws, None, False)
    want = torch.ops.rnnkern.recurrence_backward(cell, gout, *rest)
    got = torch.ops.rnnkern.recurrence_backward(cell, gout_strided, *rest)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, what=f"backward result {i}")


@gpu
def test_mixed_devices_are_a_clear_error():
    args = to_device(recurrence_inputs("gru", 3, 2, 4), DEV)
    args["h0"] = args["h0"].cpu()
    with pytest.raises(ValueError, match="h0"):
        run_recurrence("cuda", "gru", args)
    with pytest.raises(ValueError, match="backend='cpu'"):
        run_recurrence("cpu", "gru", to_device(recurrence_inputs("gru", 3, 2, 4), DEV))


@gpu
def test_other_device_runs_under_its_guard():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (device guard test); this machine has one")
    args = recurrence_inputs("lstm", 5, 3, 8, key=("dev1",))
    want = run_recurrence("cuda", "lstm", to_device(args, DEV))
    on1 = {k: None if v is None else v.to("cuda:1") for k, v in args.items()}
    got = run_recurrence("cuda", "lstm", on1)
    for a, b in zip(got, want):
        assert a.device == torch.device("cuda:1")
        assert_close(a.to(DEV), b)


# ------------------------------------------------------------ CUDA graphs ----

@gpu
@pytest.mark.parametrize("cell,lengths", [("lstm", True), ("gru", False), ("gru_reset_before", True)])
def test_cuda_graph_forward_backward(cell, lengths):
    """Forward and backward captured in one CUDA graph (no host sync, no
    allocation the graph cannot own), replayed on new data, match eager runs."""
    lens = torch.tensor([6, 2, 5]) if lengths else None
    static = to_device(recurrence_inputs(cell, 6, 3, 10, requires_grad=True, key=("graph",)), DEV)
    names = differentiable(static)
    cot = randn(generator("graph-cot"), 6, 3, 10).to(DEV)

    def fwd_bwd(a):
        out, h_n, _ = run_recurrence("cuda", cell, a, lens, reverse=True)
        loss = (out * cot).sum() + h_n.sum()
        return [out, *torch.autograd.grad(loss, [a[n] for n in names])]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fwd_bwd(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fwd_bwd(static)

    for round_ in range(2):
        fresh = to_device(
            recurrence_inputs(cell, 6, 3, 10, requires_grad=True, key=("graph", round_)), DEV)
        with torch.no_grad():
            for n in names:
                static[n].copy_(fresh[n])
        graph.replay()
        want = fwd_bwd(fresh)
        for i, (a, b) in enumerate(zip(captured, want)):
            assert_close(a, b, what=f"round {round_} result {i}")


# ------------------------- the step options and the LayerNorm cell ----
# GPU twins of tests/test_cuda_emulated.py's option tests (per-step resets,
# zoneout, the lstm_ln cell; tests/test_options.py, the acceptance matrix, runs
# the CUDA code on the emulated device), plus what only sizes a GPU runs
# quickly can reach: rows of thousands of values in the LSTM-LN row kernels,
# hundreds of steps, CUDA graphs.

import option_cases  # noqa: E402


@gpu
@pytest.mark.parametrize("cell,proj,variant", option_cases.ALL, ids=option_cases.ALL_IDS)
def test_options_match_reference_float64(cell, proj, variant):
    """Outputs, final states and every gradient (ln's included) against the
    float64 reference on the same device."""
    t, c = option_cases.option_inputs(cell, proj, variant, requires_grad=True, device=DEV)
    want = option_cases.outputs_and_grads("reference", cell, t, c, key=(cell, variant))
    got = option_cases.outputs_and_grads("cuda", cell, t, c, key=(cell, variant))
    assert set(got) == set(want)
    for name in want:
        assert got[name].device.type == "cuda", name
        assert_close(got[name], want[name], what=name)


@gpu
@pytest.mark.parametrize("cell,proj,variant", option_cases.ALL, ids=option_cases.ALL_IDS)
def test_options_gradcheck(cell, proj, variant):
    """float64 gradcheck (full Jacobians) w.r.t. every tensor input."""
    t, c = option_cases.option_inputs(cell, proj, variant, T=4, H=3, requires_grad=True,
                                      device=DEV, key=("gradcheck",))
    names = [n for n in t if t[n] is not None]

    def f(*tensors):
        out, h_n, c_n = option_cases.run("cuda", cell, {**t, **dict(zip(names, tensors))}, c)
        return (out, h_n) if c_n is None else (out, h_n, c_n)

    assert torch.autograd.gradcheck(f, [t[n] for n in names])


@gpu
@pytest.mark.parametrize("cell,proj", option_cases.CASES, ids=option_cases.CASE_IDS)
@pytest.mark.parametrize("T,B,H", [(40, 7, 257), (8, 3, 1024)], ids=["T40-B7-H257", "T8-B3-H1024"])
def test_options_float32_large(cell, proj, T, B, H, exact_fp32):
    """float32 with every option at sizes of many pointwise blocks and of
    LSTM-LN rows far longer than a block (4H = 4096 values per row): no worse
    than twice the float32 reference's own error against float64."""
    t, c = option_cases.option_inputs(cell, proj and 96, "all-lengths-reverse", T=T, B=B, H=H,
                                      device=DEV, key=("f32-large",))
    t32 = {n: None if v is None else v.float().requires_grad_() for n, v in t.items()}
    c32 = dict(c, zoneout=c["zoneout"].float())
    t64 = {n: None if v is None else v.requires_grad_() for n, v in t.items()}
    want = option_cases.outputs_and_grads("reference", cell, t64, c, key=("f32-large",))
    ref32 = option_cases.outputs_and_grads("reference", cell, t32, c32, key=("f32-large",))
    got = option_cases.outputs_and_grads("cuda", cell, t32, c32, key=("f32-large",))
    for name in want:
        assert got[name].dtype == torch.float32, name
        assert_low_precision(got[name], ref32[name], want[name], what=name)


@gpu
@pytest.mark.parametrize("cell,proj", option_cases.CASES, ids=option_cases.CASE_IDS)
@pytest.mark.parametrize("dtype", list(LOW.values()), ids=list(LOW))
def test_options_half_types_within_reference_error(cell, proj, dtype):
    """Every cell with every option in half precision: no worse than twice the
    reference's own error in that dtype."""
    t, c = option_cases.option_inputs(cell, proj and 9, "all-lengths-reverse", T=16, B=5, H=40,
                                      device=DEV, key=("half",))
    a32 = {n: None if v is None else v.float().requires_grad_() for n, v in t.items()}
    a16 = {n: None if v is None else v.to(dtype).requires_grad_() for n, v in t.items()}
    c32, c16 = dict(c, zoneout=c["zoneout"].float()), dict(c, zoneout=c["zoneout"].to(dtype))
    want = option_cases.outputs_and_grads("reference", cell, a32, c32, key=("half", cell))
    ref16 = option_cases.outputs_and_grads("reference", cell, a16, c16, key=("half", cell))
    got = option_cases.outputs_and_grads("cuda", cell, a16, c16, key=("half", cell))
    for name in want:
        assert got[name].dtype == dtype, name
        if compared_in_low_precision(cell, name):
            assert_low_precision(got[name], ref16[name], want[name], what=name)


@gpu
@pytest.mark.parametrize("cell,proj", [("gru", 0), ("lstm", 3), ("lstm_ln", 0)],
                         ids=["gru", "lstm-proj3", "lstm_ln"])
def test_zoneout_mask_strides(cell, proj):
    """A mask viewed from batch-first storage (read in place) and one with its
    units strided (copied) give the contiguous mask's results."""
    t, c = option_cases.option_inputs(cell, proj, "zoneout-lengths", requires_grad=True,
                                      device=DEV, key=("strides",))
    z = c["zoneout"]
    want = option_cases.outputs_and_grads("cuda", cell, t, c, key=("strides",))
    for view in (z.transpose(0, 1).contiguous().transpose(0, 1),
                 z.permute(2, 0, 1).contiguous().permute(1, 2, 0)):
        got = option_cases.outputs_and_grads("cuda", cell, t, dict(c, zoneout=view),
                                             key=("strides",))
        for name in want:
            assert torch.equal(got[name], want[name]), name


@gpu
@pytest.mark.parametrize("cell", ["lstm_ln", "lstm", "rnn_tanh"])
def test_workspace_layout_of_the_options(cell):
    """The workspace in cells.h's layout: lstm_ln's 14 blocks of H and 3 row
    statistics, the LSTM's zoned c, the RNN's candidate with zoneout."""
    t, c = option_cases.option_inputs(cell, 0, "all-lengths-reverse", T=4, B=3, H=3, device=DEV,
                                      key=("ws",))
    *_, ws = torch.ops.rnnkern.recurrence(cell, *(t[n] for n in option_cases.INPUTS), c["lengths"],
                                          c["reverse"], True, c["resets"], c["zoneout"], t["ln"])
    want_ws, _ = option_cases.expected_workspace(cell, t, c)
    assert ws.device.type == "cuda" and ws.shape == want_ws.shape
    assert_close(ws.cpu(), want_ws, what="workspace")


@gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *LOW.values()],
                         ids=["f64", "f32", *LOW])
def test_lstm_ln_step_matches_reference(dtype, exact_fp32):
    """The lstm_ln step (x W_ih^T, then the recurrence's kernels with T = 1):
    float64 and float32 against float64, half types within the reference's
    own error; float64 gradcheck."""
    a = option_cases.ln_step_inputs(300, 70, 768, device=DEV)
    want = option_cases.ln_step_results("reference", {n: v.requires_grad_() for n, v in a.items()})
    low = {n: v.detach().to(dtype).requires_grad_() for n, v in a.items()}
    got = option_cases.ln_step_results("cuda", low)
    ref_lp = option_cases.ln_step_results("reference", low) if dtype != torch.float64 else None
    for i, (r, w) in enumerate(zip(got, want)):
        assert r.dtype == dtype and r.device.type == "cuda", i
        if ref_lp is None:
            assert_close(r, w, what=f"result {i}")
        else:
            assert_low_precision(r, ref_lp[i], w, what=f"result {i}")
    if dtype == torch.float64:
        small = option_cases.ln_step_inputs(3, 5, 4, device=DEV)
        args = [v.requires_grad_() for v in small.values()]
        assert torch.autograd.gradcheck(
            lambda *v: ops.step("lstm_ln", *v[:7], backend="cuda", ln=v[7]), args)


@gpu
def test_opcheck_options():
    """opcheck of every op with the options: recurrence and recurrence_backward
    with resets, zoneout, lengths (and ln), step and step_backward of lstm_ln."""
    family = torch.ops.rnnkern
    g = generator("opcheck-options")
    a = option_cases.ln_step_inputs(3, 5, 4, device=DEV)
    names = ("x", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh", "ln")
    torch.library.opcheck(family.step.default,
                          ("lstm_ln", *(a[n].clone().requires_grad_() for n in names)))
    h, c, ws = family.step("lstm_ln", *(a[n] for n in names))
    torch.library.opcheck(family.step_backward.default,
                          ("lstm_ln", randn(g, *h.shape).to(DEV), randn(g, *c.shape).to(DEV),
                           a["x"], a["h"], a["c"], a["w_ih"], a["w_hh"], h, ws, a["ln"]))
    for cell, proj in [("lstm_ln", 0), ("lstm", 2), ("gru", 0), ("rnn_tanh", 0)]:
        t, k = option_cases.option_inputs(cell, proj, "all-lengths-reverse", T=4, H=4, device=DEV,
                                          key=("opcheck",))
        z = k["zoneout"].contiguous()
        fwd = (cell, *(t[n] for n in option_cases.INPUTS), k["lengths"], True, True, k["resets"], z,
               t["ln"])
        torch.library.opcheck(family.recurrence.default, fwd)
        out, h_n, c_n, ws = family.recurrence(*fwd)
        grad_c = randn(g, *c_n.shape).to(DEV) if c_n.numel() else None
        torch.library.opcheck(family.recurrence_backward.default,
                              (cell, randn(g, *out.shape).to(DEV), randn(g, *h_n.shape).to(DEV),
                               grad_c, t["h0"], t["c0"], t["w_hh"], t["w_hr"], out, ws,
                               k["lengths"], True, k["resets"], z, t["ln"]))


@gpu
@pytest.mark.parametrize("cell", ["lstm_ln", "gru", "lstm"])
def test_cuda_graph_with_options(cell):
    """Forward and backward with resets, a training mask and lengths captured
    in one CUDA graph, replayed on new data and new masks, match eager runs."""
    proj = 3 if cell == "lstm" else 0
    static, consts = option_cases.option_inputs(cell, proj, "all-lengths-reverse", T=6, B=3, H=10,
                                                requires_grad=True, device=DEV, key=("graph",))
    names = [n for n in static if static[n] is not None]

    def fwd_bwd(t, c):
        out, h_n, _ = option_cases.run("cuda", cell, t, c)
        loss = (out * out.detach().sin()).sum() + h_n.sum()
        return [out, *torch.autograd.grad(loss, [t[n] for n in names])]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fwd_bwd(static, consts)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fwd_bwd(static, consts)

    for round_ in range(2):
        fresh, fresh_c = option_cases.option_inputs(cell, proj, "all-lengths-reverse", T=6, B=3,
                                                    H=10, requires_grad=True, device=DEV,
                                                    key=("graph", round_))
        with torch.no_grad():
            for n in names:
                static[n].copy_(fresh[n])
            consts["resets"].copy_(fresh_c["resets"])
            consts["zoneout"].copy_(fresh_c["zoneout"])
        graph.replay()
        want = fwd_bwd(fresh, fresh_c)
        for i, (a, b) in enumerate(zip(captured, want)):
            assert_close(a, b, what=f"round {round_} result {i}")


@gpu
@pytest.mark.parametrize("cell,proj", [("lstm_ln", 0), ("lstm", 2), ("gru_reset_before", 0)],
                         ids=["lstm_ln", "lstm-proj2", "gru_reset_before"])
@pytest.mark.parametrize("T,B,H", [(0, 3, 4), (3, 0, 4), (2, 3, 1), (1, 1, 1)])
def test_options_empty_and_tiny(cell, proj, T, B, H):
    """No steps, no sequences, one unit, with every option: the reference's
    results and gradients (zeros where it leaves an input out of its graph)."""
    t, c = option_cases.option_inputs(cell, proj and min(proj, H), "all-lengths-reverse",
                                      T=max(T, 1), B=max(B, 3), H=H, key=("tiny",))
    t = {n: None if v is None else (v[:T, :B] if n == "xproj" else v[:B] if n in ("h0", "c0")
                                    else v).to(DEV).requires_grad_() for n, v in t.items()}
    c = dict(c, lengths=None, reverse=False, resets=c["resets"][:T, :B].contiguous().to(DEV),
             zoneout=c["zoneout"][:T, :B].contiguous().to(DEV))
    names = [n for n in t if t[n] is not None]
    results = []
    for backend in ("reference", "cuda"):
        out = [o for o in option_cases.run(backend, cell, t, c) if o is not None]
        g = generator("tiny-cot", cell, T, B, H)
        loss = sum((o * randn(g, *o.shape).to(DEV)).sum() for o in out)
        grads = torch.autograd.grad(loss, [t[n] for n in names], allow_unused=True)
        results.append(out + [torch.zeros_like(t[n]) if gr is None else gr
                              for n, gr in zip(names, grads)])
    for i, (a, b) in enumerate(zip(results[1], results[0])):
        assert a.shape == b.shape, i
        assert_close(a, b, what=f"result {i}")


# --------------------------------------------- the persistent kernels ----
# csrc/cuda/persistent.cuh: "auto" by default (small batches, csrc/cuda/params.h's
# persistent_chosen), "always" here; proven on the emulated cooperative grid
# (tests/test_cuda_emulated_persistent.py), checked here on the GPU: the real grid
# barrier, co-residency, shared memory beyond 48 KiB.

PERSISTENT_CELLS = ["rnn_tanh", "rnn_relu", "lstm", "gru"]


def test_persistent_modes():
    """"auto" by default; set_cuda_persistent takes the three modes and bools, and
    names what it expected otherwise (a build without the CUDA kernels raises,
    naming itself, and reports "never")."""
    with pytest.raises(ValueError, match="set_cuda_persistent: mode must be one of 'never', 'auto', "
                                         "'always' or a bool, got 'on'"):
        ops.set_cuda_persistent("on")
    if not ops.WITH_CUDA:
        assert ops.cuda_persistent() == "never"
        with pytest.raises(RuntimeError, match="set_cuda_persistent.*without its CUDA kernels"):
            ops.set_cuda_persistent(True)
        return
    assert ops.cuda_persistent() == "auto"
    try:
        for mode, name in [(True, "always"), (False, "never"), ("always", "always"),
                           ("never", "never"), ("auto", "auto")]:
            ops.set_cuda_persistent(mode)
            assert ops.cuda_persistent() == name
    finally:
        ops.set_cuda_persistent("auto")
    assert ops.cuda_persistent() == "auto"


def test_persistent_mode_from_the_environment():
    """RNNKERN_CUDA_PERSISTENT sets the mode at import ("0": never); a value it does
    not know stops the import, naming the variable and what it takes."""
    import subprocess
    import sys
    code = "import rnnkern.ops as o; print(o.cuda_persistent())"
    env = dict(os.environ, RNNKERN_CUDA_PERSISTENT="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "never"  # also without the CUDA kernels
    env["RNNKERN_CUDA_PERSISTENT"] = "on"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert ("ValueError: RNNKERN_CUDA_PERSISTENT must be one of never, auto, always, 1 or 0, "
            "got 'on'") in done.stderr


@pytest.fixture
def persistent():
    ops.set_cuda_persistent("always")
    yield
    ops.set_cuda_persistent("auto")


@gpu
@pytest.mark.parametrize("mode", ["auto", "never", "always"])
@pytest.mark.parametrize("cell", PERSISTENT_CELLS)
def test_each_persistent_mode_matches_cudnn(cell, mode, exact_fp32):
    """The default ("auto": the persistent kernel at this small size), the host
    loop ("never") and "always" each match cuDNN on the same weights, float32, as
    test_matches_cudnn_float32 asks (the other GPU tests run the default)."""
    ops.set_cuda_persistent(mode)
    try:
        ours, theirs, truth = nn_parity(cell, 50, 3, 20, torch.float32)
    finally:
        ops.set_cuda_persistent("auto")
    for name in truth:
        if tolerance.close_error(ours[name], theirs[name], torch.float32) > tolerance.TOL[torch.float32]:
            assert_as_accurate_as(ours[name], theirs[name], truth[name], what=f"{mode} {name}")


@gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("H", [5, 200, 600], ids=["H5", "H200-2units", "H600-5units"])
@pytest.mark.parametrize("cell", PERSISTENT_CELLS)
def test_persistent_matches_reference(persistent, cell, H, dtype):
    """Outputs and every gradient against the float64 reference, lengths in reverse,
    hidden sizes that give 5 CTAs of 1 unit, or every SM with 2 / 5 units."""
    T, B = 6, 5
    args = recurrence_inputs(cell, T, B, H, dtype=dtype, key=("persistent-gpu",))
    lengths = torch.tensor([6, 2, 0, 5, 1])
    dev = {k: None if v is None else v.to(DEV).requires_grad_() for k, v in args.items()}
    a64 = {k: None if v is None else v.detach().double().requires_grad_() for k, v in args.items()}
    key = ("persistent-gpu-cot", cell)
    want = outputs_and_grads("reference", cell, a64, lengths, True, key=key)
    got = outputs_and_grads("cuda", cell, dev, lengths, True, key=key)
    for name in want:
        assert_close(got[name].cpu(), want[name].to(dtype), what=name)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("cell", PERSISTENT_CELLS)
def test_persistent_half_types_at_flashrnn_size(persistent, cell, dtype):
    """B=16 H=768 (FlashRNN's size; LSTM: 4.7 MB of W_hh over the SMs, shared memory
    beyond 48 KiB per CTA), T=32: no worse than the reference's own error in that dtype."""
    T, B, H = 32, 16, 768
    args = recurrence_inputs(cell, T, B, H, dtype=dtype, key=("persistent-gpu-half",))
    lengths = torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(2))
    dev = {k: None if v is None else v.to(DEV).requires_grad_() for k, v in args.items()}
    a16 = {k: None if v is None else v.detach().requires_grad_() for k, v in args.items()}
    a32 = {k: None if v is None else v.detach().float().requires_grad_() for k, v in args.items()}
    key = ("persistent-gpu-half-cot", cell)
    want = outputs_and_grads("reference", cell, a32, lengths, False, key=key)
    ref16 = outputs_and_grads("reference", cell, a16, lengths, False, key=key)
    got = outputs_and_grads("cuda", cell, dev, lengths, False, key=key)
    for name in want:
        assert got[name].dtype == dtype, name
        assert_low_precision(got[name].cpu(), ref16[name], want[name], what=name)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_persistent_lstm_backward_in_pieces_at_h1024(persistent, dtype):
    """The LSTM's backward at H=1024 in a half type stages its rows of da (K = 4096)
    in two pieces of k (W's slice and a 16-row tile of whole rows exceed 227 KiB:
    test_plan_stages_rows_in_pieces_where_they_do_not_fit); compiled for the GPU, no
    worse than the reference's own error in that dtype, lengths in reverse."""
    T, B, H = 8, 4, 1024
    args = recurrence_inputs("lstm", T, B, H, dtype=dtype, key=("persistent-gpu-pieces",))
    lengths = torch.tensor([8, 3, 8, 1])
    dev = {k: None if v is None else v.to(DEV).requires_grad_() for k, v in args.items()}
    a16 = {k: None if v is None else v.detach().requires_grad_() for k, v in args.items()}
    a32 = {k: None if v is None else v.detach().float().requires_grad_() for k, v in args.items()}
    key = ("persistent-gpu-pieces-cot",)
    want = outputs_and_grads("reference", "lstm", a32, lengths, True, key=key)
    ref16 = outputs_and_grads("reference", "lstm", a16, lengths, True, key=key)
    got = outputs_and_grads("cuda", "lstm", dev, lengths, True, key=key)
    for name in want:
        assert got[name].dtype == dtype, name
        assert_low_precision(got[name].cpu(), ref16[name], want[name], what=name)


@gpu
@pytest.mark.parametrize("cell", PERSISTENT_CELLS)
def test_persistent_prefetch_changes_no_bit(persistent, cell, monkeypatch):
    """The L2 prefetch of the next step's rows before each grid barrier is a hint:
    with it off (RNNKERN_CUDA_PREFETCH=0) every output and gradient has the same
    bits, bfloat16 at B=16 H=768 with lengths (what the emulated device counts,
    test_next_step_prefetched_during_the_barrier, compiled for the real GPU)."""
    T, B, H = 32, 16, 768
    args = recurrence_inputs(cell, T, B, H, dtype=torch.bfloat16, key=("persistent-gpu-prefetch",))
    lengths = torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(3))
    key = ("persistent-gpu-prefetch-cot", cell)

    def run():
        dev = {k: None if v is None else v.to(DEV).requires_grad_() for k, v in args.items()}
        return outputs_and_grads("cuda", cell, dev, lengths, False, key=key)

    on = run()
    monkeypatch.setenv("RNNKERN_CUDA_PREFETCH", "0")
    off = run()
    for name in on:
        assert torch.equal(on[name], off[name]), name

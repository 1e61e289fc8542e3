"""The Triton kernels (backend="triton") against the reference, the C++ ops and torch.nn.

Without a GPU they run on the CPU through Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1), float64 included, so every kernel is exercised in CI:
the three ways of running the recurrence (the in-kernel time loop, the spread
kernels and the per-step kernels, forced through rnnkern.triton.ops.PATH), every
cell and GRU form, the LSTM projection, lengths and reverse.  The spread
kernels' programs wait for each other at a grid barrier every step; the
interpreter runs them as threads (rnnkern/triton/spread.py), and the tests
check that the barrier is needed (without it, or one arrival short, the
results are wrong) and that programs that never meet are reported.  The
interpreter's blocks are 4 wide (rnnkern/triton/tuning.py), so H = 6, P = 5
and B = 5 run several tiles with masked tails.  The interpreter costs ~0.3 ms per block operation: sizes are
small and gradcheck runs in fast mode on all inputs at once.
The backend contract (gradcheck of recurrence and step, opcheck, empty sizes,
no workspace without grad) runs on both paths in tests/test_backend_contract.py.

The step options (resets, zoneout) and the LayerNorm cell (lstm_ln) run through
tests/test_options.py's matrix on the automatic path; here they run through it
on both paths, with gradcheck on the per-step path, against the workspace
layout of csrc/cells.h, with a transposed zoneout mask, in half precision on
the per-step path, and through opcheck.

Triton's GPU compiler is exercised without a GPU too: every kernel is compiled
for sm_90 (test_kernels_compile_for_sm90, rnnkern/triton/aot.py).  GPU tests
(marker ``gpu``) compare with torch.nn (cuDNN) in float32, float16 and bfloat16
and skip without a GPU.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import rnnkern
from rnnkern import ops, reference
from rnnkern.triton import ops as triton_ops
from rnnkern.triton import sequence
from rnnkern.triton import spread as spread_module
from conftest import (CELLS, HAS_GPU, assert_close, assert_low_precision, differentiable,
                      force_triton_path, generator, outputs_and_grads, randn, recurrence_inputs,
                      rnnkern_module, run_recurrence, step_inputs, to_device, torch_module)
from test_options import ALL as OPTION_CASES, ALL_IDS as OPTION_IDS
from test_options import CASES as OPTION_CELLS, CASE_IDS as OPTION_CELL_IDS
from test_options import case_inputs, step_case
from test_options import outputs_and_grads as options_outputs_and_grads

# (cell, proj_size): every cell and GRU form, and the LSTM with a projection.
CASES = [(cell, 0) for cell in CELLS] + [("lstm", 5)]
CASE_IDS = [f"{c}-proj{p}" if p else c for c, p in CASES]
TORCH_CELLS = [c for c in CELLS if c != "gru_reset_before"]
DEVICE = "cuda" if HAS_GPU else "cpu"


@pytest.fixture(params=["loop", "spread", "step"])
def path(request, monkeypatch):
    """Runs the test with the in-kernel time loop, the spread kernels (the cells
    they run; the others per step: conftest.force_triton_path) and the per-step
    kernels."""
    force_triton_path(monkeypatch, request.param)
    return request.param


@pytest.fixture(params=["loop", "step"])
def loop_or_step(request, monkeypatch):
    """The in-kernel time loop, then the per-step kernels: for the tests whose
    spread run would repeat another's (the options matrix: the spread kernels
    equal the per-step path bit for bit under every option,
    test_spread_equals_per_step_bitwise; LSTM-LN runs per step there anyway;
    re-running kernels: the spread kernels are not autotuned)."""
    force_triton_path(monkeypatch, request.param)
    return request.param


def gradcheck_flat(f, tensors):
    """float64 gradcheck of f(*tensors) in fast mode, with respect to all the
    tensors at once (one flat vector) and of all the outputs at once (one flat
    vector): each evaluation runs the kernels under the interpreter, and this
    needs three forward and two backward runs instead of two per tensor and
    one per output.  (Missing output gradients go through the autograd formula
    shared with the C++ ops, tested there; test_gradcheck_undefined_grads
    checks it once here.)"""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]).requires_grad_()
    sizes = [t.numel() for t in tensors]

    def g(v):
        outs = f(*[p.view_as(t) for p, t in zip(v.split(sizes), tensors)])
        return torch.cat([o.reshape(-1) for o in outs])

    return torch.autograd.gradcheck(g, [flat], fast_mode=True, check_undefined_grad=False)


# ------------------------------------------------------------- gradcheck ----

# (gradcheck of recurrence and step, opcheck, no workspace without grad, empty
# sizes on both paths: the backend contract, tests/test_backend_contract.py)

def test_gradcheck_undefined_grads(path):
    """gradcheck in full form (per input, per output, undefined output grads) once:
    an LSTM with projection and lengths, T = 2."""
    args = to_device(recurrence_inputs("lstm", 2, 2, 4, proj=3, requires_grad=True,
                                       key=("gradcheck-undefined",)), DEVICE)
    names = differentiable(args)

    def f(*tensors):
        return run_recurrence("triton", "lstm", {**args, **dict(zip(names, tensors))},
                              torch.tensor([2, 1]), True)

    assert torch.autograd.gradcheck(f, [args[n] for n in names], fast_mode=True)


# ------------------------------------------------------ against reference ----

# The per-step path shares positions() and the host code with the loop path:
# two variants cover its own masking (lengths and reverse at once) and its
# constexpr variant without lengths.
PATH_VARIANTS = ([("loop", v) for v in ("plain", "reverse", "lengths", "lengths-reverse",
                                         "lengths-sorted-reverse")]
                 + [(p, v) for p in ("spread", "step") for v in ("plain", "lengths-reverse")]
                 + [("step", "lengths-sorted-reverse")])


@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("path,variant", PATH_VARIANTS, indirect=["path"],
                         ids=[f"{p}-{v}" for p, v in PATH_VARIANTS])
def test_recurrence_matches_reference_float64(cell, proj, path, variant):
    """Outputs, final states and every gradient, float64, both directions, with
    and without lengths.  H = 6 spans two column tiles of the interpreter's
    blocks; with lengths B = 5 spans two row blocks, and the lengths cover
    full, empty and one-step sequences.  Sorted longest first (a packed
    batch), B = 9 makes three row blocks whose loops stop at 3, 2 and 0
    steps, the rest of each block's positions written as padding."""
    lengths = {"lengths": [3, 2, 0, 3, 1], "lengths-reverse": [3, 2, 0, 3, 1],
               "lengths-sorted-reverse": [3, 3, 3, 2, 2, 2, 1, 1, 0]}.get(variant)
    T, B, H = 3, (3 if lengths is None else len(lengths)), 6
    args = to_device(recurrence_inputs(cell, T, B, H, proj=proj, requires_grad=True,
                                       key=("reference", variant)), DEVICE)
    lengths = None if lengths is None else torch.tensor(lengths)
    reverse = "reverse" in variant
    key = (cell, variant)
    want = outputs_and_grads("reference", cell, args, lengths, reverse, key=key)
    got = outputs_and_grads("triton", cell, args, lengths, reverse, key=key)
    for name in want:
        assert_close(got[name], want[name], what=name)


@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
def test_per_step_grids_cover_the_live_rows(cell, proj, monkeypatch):
    """The per-step path launches each step's kernels over the rows up to the
    last one still running (forward: of the step before, which a finishing
    row needs once more; backward: of the step), so a batch sorted longest
    first costs its real steps.  The grids' row counts, recorded."""
    force_triton_path(monkeypatch, "step")
    from rnnkern.triton import ops as triton_ops
    rows = []
    grid = triton_ops._grid
    monkeypatch.setattr(triton_ops, "_grid", lambda B, N: rows.append(B) or grid(B, N))
    lengths = [5, 4, 4, 2, 1, 1]
    T, B, H = 5, len(lengths), 6
    args = to_device(recurrence_inputs(cell, T, B, H, proj=proj, requires_grad=True,
                                       key=("live-grids", cell)), DEVICE)
    want = outputs_and_grads("reference", cell, args, torch.tensor(lengths), False,
                             key=("live-grids", cell))
    rows.clear()
    got = outputs_and_grads("triton", cell, args, torch.tensor(lengths), False,
                            key=("live-grids", cell))
    for name in want:
        assert_close(got[name], want[name], what=name)
    live = [sum(n > s for n in lengths) for s in range(T)]  # sorted: the running rows
    visited_forward = [B] + live[:-1]
    launches = 1 + (cell == "gru_reset_before") + bool(proj)  # the step's kernels with _grid
    if cell == "lstm_ln":
        launches = 1  # (its row kernel takes _loop_grid)
    want_rows = ([r for r in visited_forward for _ in range(launches)]
                 + [r for r in reversed(live) for _ in range(launches)])
    assert rows == want_rows, (rows, want_rows)


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_step_matches_reference(cell, bias):
    """B = 5, I = 7, H = 6: two row blocks, two column tiles, K blocks of x and
    of h both with a masked tail."""
    args = to_device(step_inputs(cell, 5, 7, 6, bias=bias, requires_grad=True), DEVICE)
    names = differentiable(args)
    results = []
    for backend in ("reference", "triton"):
        h, c = ops.step(cell, *args.values(), backend=backend)
        outs = [h] if c is None else [h, c]
        g = generator("step-cotangent", cell)
        loss = sum((o * randn(g, *o.shape).to(DEVICE)).sum() for o in outs)
        results.append(outs + list(torch.autograd.grad(loss, [args[n] for n in names])))
    for name, got, want in zip(["h_new", "c_new"][:len(results[0]) - len(names)] + names,
                               results[1], results[0]):
        assert_close(got, want, what=name)


# ---------------------------------------------------- against the C++ ops ----

@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
def test_same_workspace_as_cpp(cell, proj, path):
    """The Triton and C++ ops return the same outputs and the same workspace
    (layout, dtype, zeros at padding positions), and the Triton backward run on
    the C++ forward's workspace returns the C++ backward's gradients."""
    T, B, H = 3, 3, 6
    args = recurrence_inputs(cell, T, B, H, proj=proj, key=("workspace",))
    lengths = torch.tensor([3, 1, 0])
    call = (cell, *args.values(), lengths, True, True)
    cpp = torch.ops.rnnkern.recurrence(*call)
    tri = torch.ops.rnnkern_triton.recurrence(*[a.to(DEVICE) if isinstance(a, torch.Tensor)
                                                 and a is not lengths else a for a in call])
    for name, got, want in zip(["output", "h_n", "c_n", "workspace"], tri, cpp):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert_close(got.cpu(), want, what=name)
    g = generator("workspace-grad", cell)
    grad_output, grad_h_n = randn(g, *cpp[0].shape), randn(g, *cpp[1].shape)
    grad_c_n = randn(g, *cpp[2].shape) if cell == "lstm" else None
    bwd = [grad_output, grad_h_n, grad_c_n, args["h0"], args["c0"], args["w_hh"], args["w_hr"]]
    want = torch.ops.rnnkern.recurrence_backward(cell, *bwd, cpp[0], cpp[3], lengths, True)
    got = torch.ops.rnnkern_triton.recurrence_backward(
        cell, *[None if t is None else t.to(DEVICE) for t in bwd], cpp[0].to(DEVICE),
        cpp[3].to(DEVICE), lengths, True)
    names = ["grad_xproj", "grad_h0", "grad_c0", "grad_w_hh", "grad_b_ih", "grad_b_hh", "grad_w_hr"]
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, name
        assert_close(a.cpu(), b, what=name)


def test_step_same_workspace_as_cpp():
    for cell in CELLS:
        args = step_inputs(cell, 3, 5, 6, key=("step-workspace",))
        want = torch.ops.rnnkern.step(cell, *args.values())
        got = torch.ops.rnnkern_triton.step(cell, *to_device(args, DEVICE).values())
        for name, a, b in zip(["h_new", "c_new", "workspace"], got, want):
            assert a.shape == b.shape and a.dtype == b.dtype, f"{cell} {name}"
            assert_close(a.cpu(), b, what=f"{cell} {name}")


# ------------------------------------------------------ torch.nn parity ----

def paired_modules(cell, I, H, dtype, device, **kwargs):
    theirs = torch_module(cell, I, H, **kwargs).to(device=device, dtype=dtype)
    ours = rnnkern_module(cell, I, H, backend="triton", **kwargs).to(device=device, dtype=dtype)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def module_outputs_and_grads(module, x, hx, cotangents):
    out, hid = module(x, hx)
    hid = hid if isinstance(hid, tuple) else (hid,)
    outs = (out, *hid)
    loss = sum((o * c).sum() for o, c in zip(outs, cotangents))
    grads = torch.autograd.grad(loss, [x, *(hx if isinstance(hx, tuple) else (hx,)),
                                       *module.parameters()])
    return outs, grads


@pytest.mark.parametrize("cell,kwargs", [
    ("rnn_tanh", {}), ("rnn_relu", {}), ("gru", {}), ("lstm", {}),
    ("lstm", {"proj_size": 4}), ("gru", {"bias": False}),
    ("lstm", {"num_layers": 2, "bidirectional": True}),
], ids=["rnn_tanh", "rnn_relu", "gru", "lstm", "lstm-proj", "gru-nobias", "lstm-2layers-bidir"])
def test_matches_torch_nn_float32(cell, kwargs, path):
    """Outputs, final states and every gradient (input, h0, c0, all weights)
    against torch.nn with the same weights, float32."""
    T, B, I, H = 5, 3, 4, 6
    torch.manual_seed(7)
    theirs, ours = paired_modules(cell, I, H, torch.float32, DEVICE, **kwargs)
    g = generator("nn-parity", cell, str(kwargs))
    L = theirs.num_layers * (2 if theirs.bidirectional else 1)
    P = kwargs.get("proj_size", 0) or H
    x = randn(g, T, B, I, dtype=torch.float32).to(DEVICE).requires_grad_()
    h0 = (randn(g, L, B, P, dtype=torch.float32, scale=0.5)).to(DEVICE).requires_grad_()
    hx = h0
    if cell == "lstm":
        hx = (h0, randn(g, L, B, H, dtype=torch.float32, scale=0.5).to(DEVICE).requires_grad_())
    out_t, _ = theirs(x, hx)
    D = 2 if theirs.bidirectional else 1
    cot = [randn(g, T, B, D * P, dtype=torch.float32).to(DEVICE), randn(g, L, B, P).float().to(DEVICE)]
    if cell == "lstm":
        cot.append(randn(g, L, B, H, dtype=torch.float32).to(DEVICE))
    outs_t, grads_t = module_outputs_and_grads(theirs, x, hx, cot)
    outs_o, grads_o = module_outputs_and_grads(ours, x, hx, cot)
    for name, a, b in zip(["output", "h_n", "c_n"], outs_o, outs_t):
        assert_close(a, b, dtype=torch.float32, what=name)
    names = ["input", "h0", "c0"][:1 + len(hx) if isinstance(hx, tuple) else 2]
    names += [n for n, _ in theirs.named_parameters()]
    for name, a, b in zip(names, grads_o, grads_t):
        assert_close(a, b, dtype=torch.float32, what=f"grad {name}")


@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_cells_match_torch_nn_float32(cell):
    """RNNCell / GRUCell / LSTMCell: the single-step op against torch.nn's cells."""
    B, I, H = 5, 7, 6
    torch.manual_seed(3)
    if cell == "lstm":
        theirs, ours = torch.nn.LSTMCell(I, H), rnnkern.LSTMCell(I, H, backend="triton")
    elif cell == "gru":
        theirs, ours = torch.nn.GRUCell(I, H), rnnkern.GRUCell(I, H, backend="triton")
    else:
        theirs = torch.nn.RNNCell(I, H, nonlinearity=cell[4:])
        ours = rnnkern.RNNCell(I, H, nonlinearity=cell[4:], backend="triton")
    theirs, ours = theirs.to(DEVICE), ours.to(DEVICE)
    ours.load_state_dict(theirs.state_dict())
    g = generator("cell-parity", cell)
    x = randn(g, B, I, dtype=torch.float32).to(DEVICE).requires_grad_()
    h = randn(g, B, H, dtype=torch.float32, scale=0.5).to(DEVICE).requires_grad_()
    hx = (h, randn(g, B, H, dtype=torch.float32, scale=0.5).to(DEVICE).requires_grad_()) if cell == "lstm" else h
    results = []
    for module in (theirs, ours):
        out = module(x, hx)
        outs = out if isinstance(out, tuple) else (out,)
        g2 = generator("cell-cotangent", cell)
        loss = sum((o * randn(g2, *o.shape, dtype=torch.float32).to(DEVICE)).sum() for o in outs)
        inputs = [x, *(hx if isinstance(hx, tuple) else (hx,)), *module.parameters()]
        results.append(list(outs) + list(torch.autograd.grad(loss, inputs)))
    for i, (a, b) in enumerate(zip(results[1], results[0])):
        assert_close(a, b, dtype=torch.float32, what=f"result {i}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
def test_half_within_reference_error(cell, proj, dtype):
    """Half inputs (computed in float32, workspace in float32) against the float32
    reference on the same half-valued inputs: no worse than twice the
    reference's own half-precision error (outputs, states, gradients)."""
    T, B, H = 4, 3, 6
    args = recurrence_inputs(cell, T, B, H, dtype=dtype, proj=proj, key=("half",))
    args_lp = {k: None if v is None else v.to(DEVICE).requires_grad_() for k, v in args.items()}
    args_hp = {k: None if v is None else v.detach().float().requires_grad_() for k, v in args.items()}
    key = ("half-cot", cell)
    want = outputs_and_grads("reference", cell, args_hp, key=key)
    ref_lp = outputs_and_grads("reference", cell,
                               {k: None if v is None else v.detach().cpu().requires_grad_()
                                for k, v in args_lp.items()}, key=key)
    got = outputs_and_grads("triton", cell, args_lp, key=key)
    for name in want:
        assert got[name].dtype == dtype, name
        assert_low_precision(got[name].cpu(), ref_lp[name], want[name], what=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("cell,options", [("lstm", ""), ("rnn_tanh", "lengths-reverse")])
def test_half_weight_gradient_in_the_input_dtype(cell, options, dtype, monkeypatch):
    """A half call's W_hh gradient is one product in the input dtype summed in
    float32, as torch.nn's: bitwise the half-precision product of the input
    gradient the op returns and the states the steps started from (h0 at each
    sequence's first position), and within one rounding of the exact (float64)
    product of those operands over all T * B = 256 rows: a sum kept in half
    precision would be off by several roundings.  (It was a float32 product of
    float32 gradients: ten times the tensor cores' time on a GPU.)  On a GPU,
    torch lets cuBLAS reduce split-K partial sums in half precision by default
    (``allow_fp16/bf16_reduced_precision_reduction``), as for any half matmul:
    switched off here, so that the sum is float32's throughout."""
    if HAS_GPU:
        for flag in ("allow_fp16_reduced_precision_reduction",
                     "allow_bf16_reduced_precision_reduction"):
            monkeypatch.setattr(torch.backends.cuda.matmul, flag, False)
    T, B, H = 32, 8, 6
    args = to_device(recurrence_inputs(cell, T, B, H, dtype=dtype, key=("half-dw", options)),
                     DEVICE)
    lengths = torch.randint(1, T + 1, (B,), generator=generator("half-dw-lengths")) \
        if options else None
    reverse = bool(options)
    output, h_n, c_n, ws = torch.ops.rnnkern_triton.recurrence(
        cell, *args.values(), lengths, reverse, True)
    g = generator("half-dw-cotangent", cell)
    grad_output = randn(g, *output.shape, dtype=dtype).to(DEVICE)
    if lengths is not None:  # the op's padding positions get no gradient
        t = torch.arange(T).unsqueeze(1)
        grad_output = grad_output * (t < lengths).unsqueeze(2).to(grad_output)
    grad_h_n = randn(g, *h_n.shape, dtype=dtype).to(DEVICE)
    grad_c_n = randn(g, *c_n.shape, dtype=dtype).to(DEVICE) if cell == "lstm" else None
    got = torch.ops.rnnkern_triton.recurrence_backward(
        cell, grad_output, grad_h_n, grad_c_n, args["h0"], args["c0"], args["w_hh"], None,
        output, ws, lengths, reverse)
    dx, grad_w_hh = got[0], got[3]
    assert dx.dtype == grad_w_hh.dtype == dtype
    h0 = args["h0"]
    if reverse:
        prev = torch.cat([output[1:], h0.unsqueeze(0)])
        prev[(lengths - 1).to(DEVICE), torch.arange(B, device=DEVICE)] = h0
    else:
        prev = torch.cat([h0.unsqueeze(0), output[:-1]])
    dx_rows, prev_rows = dx.reshape(T * B, -1), prev.reshape(T * B, H)
    assert torch.equal(grad_w_hh, dx_rows.t() @ prev_rows)
    exact = dx_rows.double().t() @ prev_rows.double()
    one_rounding = torch.finfo(dtype).eps * exact.abs() + torch.finfo(dtype).tiny
    assert ((grad_w_hh.double() - exact).abs() <= one_rounding).all()


# ------------------------------------------------- torch.library / compile ----

def test_torch_compile_fullgraph():
    """A layer and a cell step in one torch.compile(fullgraph=True) graph,
    forward and backward, equal to eager (the ops are opaque custom ops with
    fake implementations, so Dynamo never traces into the kernels)."""
    rec = to_device(
        recurrence_inputs("lstm", 3, 3, 6, proj=5, requires_grad=True, key=("compile",)), DEVICE)
    stp = to_device(
        step_inputs("gru_reset_before", 3, 5, 6, requires_grad=True, key=("compile",)), DEVICE)
    lengths = torch.tensor([3, 1, 2])

    def f(rec, stp):
        out, h_n, c_n = ops.recurrence("lstm", *rec.values(), lengths=lengths, reverse=True,
                                       backend="triton")
        h, _ = ops.step("gru_reset_before", *stp.values(), backend="triton")
        return out.sum() + (h_n * h_n).sum() + c_n.sum() + (h * h).sum()

    inputs = [t for d in (rec, stp) for t in d.values() if t is not None]
    compiled = torch.compile(f, fullgraph=True)
    got = compiled(rec, stp)
    got_grads = torch.autograd.grad(got, inputs)
    want = f(rec, stp)
    want_grads = torch.autograd.grad(want, inputs)
    assert_close(got, want, what="loss")
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        assert_close(a, b, what=f"grad {i}")


def test_kernels_compile_for_sm90():
    """The interpreter does not run Triton's GPU compiler: compile every kernel
    for sm_90 (to a cubin, with Triton's ptxas) so one that would not build on a
    GPU fails in CI too.  In a subprocess, without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "rnnkern.triton.aot", "--arch", "90"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 failures" in done.stdout and done.stdout.count("ok ") >= 31, done.stdout
    for kernel in ("ln_projections_kernel", "lstm_ln_forward_kernel", "lstm_ln_backward_kernel"):
        assert kernel in done.stdout, done.stdout
    assert "lstm+options" in done.stdout and "lstm_ln+options" in done.stdout, done.stdout
    # the spread kernels' grid barrier, read from their PTX (rnnkern.triton.aot.barrier_problems)
    spread_lines = [line for line in done.stdout.splitlines() if "spread_kernel" in line]
    assert len(spread_lines) >= 10, done.stdout
    assert all(line.startswith("ok") and "barrier ok" in line for line in spread_lines), done.stdout


def test_barrier_check_catches_what_it_names():
    """The PTX check of the spread kernels' barrier fails a relaxed arrival, a
    wait without acquire, and a non-coherent load (what a release turned
    relaxed, or exchanged rows read through the read-only path, would show)."""
    from rnnkern.triton.aot import barrier_problems
    good = ("@%p2 atom.global.gpu.release.add.u32 %r10, [ %rd6 + 0 ], %r11;\n"
            "@%p2 ld.global.gpu.acquire.b32 %r12, [ %rd6 + 0 ];\n"
            "ld.global.b32 { %r8 }, [ %rd4 + 0 ];\n")
    assert barrier_problems(good) == []
    relaxed = good.replace("atom.global.gpu.release.add", "atom.global.gpu.relaxed.add")
    assert any("release" in p for p in barrier_problems(relaxed))
    no_acquire = good.replace("ld.global.gpu.acquire", "ld.global.gpu.relaxed")
    assert any("acquire" in p for p in barrier_problems(no_acquire))
    nc = good + "ld.global.nc.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd9 + 0 ];\n"
    assert any("non-coherent" in p for p in barrier_problems(nc))


def test_autotune_keys_hold_the_batch_class():
    """Every autotuned kernel keys its configuration on the batch's class too
    (B rounded up to a power of two, at most 256: issue 26), so a BLOCK_B tuned at
    one batch size does not stick to another, and B_CLASS is not specialised (an
    unused argument must not multiply the compiled variants)."""
    import inspect
    import re

    import triton

    from rnnkern.triton import tuning
    from rnnkern.triton.step import backward as step_backward, forward as step_forward
    assert [tuning.batch_class(b) for b in (0, 1, 2, 3, 5, 16, 17, 200, 256, 5000)] == \
        [1, 1, 2, 4, 8, 16, 32, 256, 256, 256]
    tuned = [k for m in (sequence, step_forward, step_backward) for k in vars(m).values()
             if isinstance(k, triton.runtime.Autotuner)]
    assert len(tuned) == 12
    # The jit decorators' arguments, read from the source (the interpreter's
    # functions do not keep them).
    not_specialised = {name: args for m in (sequence, step_forward, step_backward)
                       for args, name in re.findall(r"@triton\.jit\(do_not_specialize=\[([^\]]*)\]\)\n"
                                                    r"def (\w+)\(", inspect.getsource(m))}
    for kernel in tuned:
        name = kernel.fn.__name__
        assert "B_CLASS" in kernel.keys, name
        assert '"B_CLASS"' in not_specialised.get(name, ""), name


# ------------- the step options and the LayerNorm cell, both paths ----

def options_on_device(tensors, consts):
    """test_options' inputs on DEVICE; an evaluation zoneout mask stays an
    expanded [Z] vector (strides (0, 0, 1)) there too."""
    z = consts["zoneout"]
    if z is not None:
        z = z[0, 0].to(DEVICE).expand(z.shape) if z.stride(0) == 0 else z.to(DEVICE)
    resets = None if consts["resets"] is None else consts["resets"].to(DEVICE)
    return to_device(tensors, DEVICE), dict(consts, zoneout=z, resets=resets)


def run_options(cell, tensors, consts, backend="triton"):
    t, c = tensors, consts
    return ops.recurrence(cell, t["xproj"], t["h0"], t["c0"], t["w_hh"], t["b_ih"], t["b_hh"],
                          t["w_hr"], c["lengths"], c["reverse"], backend=backend,
                          resets=c["resets"], zoneout=c["zoneout"], ln=t["ln"],
                          reset_h=t.get("reset_h"), reset_c=t.get("reset_c"))


@pytest.mark.parametrize("cell,proj,variant", OPTION_CASES, ids=OPTION_IDS)
def test_options_match_reference_float64(cell, proj, variant, loop_or_step):
    """tests/test_options.py's matrix (resets, zoneout in training and in
    evaluation, everything with lengths and reverse, lstm_ln) on the in-kernel
    loop and on the per-step kernels: outputs, final states and every gradient
    against the reference.  B = 5 spans two row blocks of the loop kernels and
    three of lstm_ln's row kernels; H = 5 two column tiles and two unit chunks,
    with masked tails."""
    tensors, consts = options_on_device(*case_inputs(cell, proj, variant, T=5, B=5, H=5,
                                                     requires_grad=True, key=("paths",)))
    key = ("paths", cell, variant)
    want = options_outputs_and_grads("reference", cell, tensors, consts, key=key)
    got = options_outputs_and_grads("triton", cell, tensors, consts, key=key)
    assert set(got) == set(want)
    for name in want:
        assert_close(got[name], want[name], what=f"{loop_or_step} {name}")


@pytest.mark.parametrize("cell,proj,variant",
                         [(c, p, "all-lengths-reverse") for c, p in OPTION_CELLS]
                         + [(c, p, "reset-state-all") for c, p in
                            [("lstm", 3), ("gru", 0), ("gru_reset_before", 0), ("lstm_ln", 0)]],
                         ids=[f"{i}-all-lengths-reverse" for i in OPTION_CELL_IDS]
                         + ["lstm-proj3-reset-state-all", "gru-reset-state-all",
                            "gru_reset_before-reset-state-all", "lstm_ln-reset-state-all"])
def test_options_gradcheck_per_step(cell, proj, variant, monkeypatch):
    """float64 gradcheck of the per-step path with resets, zoneout, lengths and
    reverse at once (tests/test_options.py checks the loop path): the routing
    of a reset step's gradient to grad_h0 / grad_c0 between launches, or with
    a reset state of its own to grad_reset_h / grad_reset_c (each kernel of
    the cells with kernels of their own: projection, reset-before, lstm_ln)."""
    monkeypatch.setattr(triton_ops, "PATH", "step")
    tensors, consts = options_on_device(*case_inputs(cell, proj, variant, T=4,
                                                     B=3, H=3, requires_grad=True,
                                                     key=("gradcheck-step",)))
    names = [n for n, t in tensors.items() if t is not None]

    def f(*ts):
        out, h_n, c_n = run_options(cell, {**tensors, **dict(zip(names, ts))}, consts)
        return (out, h_n) if c_n is None else (out, h_n, c_n)

    assert gradcheck_flat(f, [tensors[n] for n in names])


SPREAD_OPTION_CASES = [(c, p, v) for c, p in [(c, 0) for c in spread_module.CELLS] + [("lstm", 3)]
                       for v in ("all-lengths-reverse", "reset-state-all")]
SPREAD_OPTION_IDS = [f"{c}-proj{p}-{v}" if p else f"{c}-{v}" for c, p, v in SPREAD_OPTION_CASES]


@pytest.mark.parametrize("cell,proj,variant", SPREAD_OPTION_CASES, ids=SPREAD_OPTION_IDS)
def test_options_gradcheck_spread(cell, proj, variant, monkeypatch):
    """float64 gradcheck of the spread kernels with resets, zoneout, lengths
    and reverse at once (and a reset state of its own): B = 5 and H = 5 make
    four programs (two row tiles, two unit tiles) that exchange h and dA at
    the barrier every step (the projection's and the reset-before GRU's
    intermediate rows at a second one)."""
    monkeypatch.setattr(triton_ops, "PATH", "spread")
    tensors, consts = options_on_device(*case_inputs(cell, proj, variant, T=4, B=5, H=5,
                                                     requires_grad=True,
                                                     key=("gradcheck-spread",)))
    assert math.prod(spread_module.grid(5, 5, spread_module.tiles(
        cell, 5, 5, False, torch.device(DEVICE)))) == 4
    names = [n for n, t in tensors.items() if t is not None]

    def f(*ts):
        out, h_n, c_n = run_options(cell, {**tensors, **dict(zip(names, ts))}, consts)
        return (out, h_n) if c_n is None else (out, h_n, c_n)

    assert gradcheck_flat(f, [tensors[n] for n in names])


@pytest.mark.skipif(HAS_GPU, reason="the interpreter's tiles: a GPU's spread and per-step "
                                    "tiles differ, and so does the order of their sums")
@pytest.mark.parametrize("cell,proj,variant", SPREAD_OPTION_CASES, ids=SPREAD_OPTION_IDS)
def test_spread_equals_per_step_bitwise(cell, proj, variant, monkeypatch):
    """The spread kernels run the per-step kernels' tile body once per step:
    with the same tiles (the interpreter's 4 x 4, K in blocks of 4), every
    output and every gradient is the per-step path's, bit for bit."""
    tensors, consts = options_on_device(*case_inputs(cell, proj, variant, T=5, B=5, H=5,
                                                     requires_grad=True, key=("bitwise",)))
    blocks = spread_module.tiles(cell, 5, 5, False, torch.device(DEVICE))
    assert (blocks["BLOCK_B"], blocks["BLOCK_H"], blocks["BLOCK_K"]) == (4, 4, 4)
    results = {}
    for path in ("spread", "step"):
        monkeypatch.setattr(triton_ops, "PATH", path)
        results[path] = options_outputs_and_grads("triton", cell, tensors, consts,
                                                  key=("bitwise", cell, proj, variant))
    assert set(results["spread"]) == set(results["step"])
    for name, want in results["step"].items():
        got = results["spread"][name]
        assert not torch.isnan(want).any(), name
        assert torch.equal(got, want), f"{name}: max difference {(got - want).abs().max()}"


@pytest.mark.skipif(HAS_GPU, reason="counts the tile bodies the interpreter runs")
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("cell,proj", [("lstm", 0), ("gru", 0), ("rnn_tanh", 0), ("lstm", 3),
                                       ("gru_reset_before", 0)],
                         ids=["lstm", "gru", "rnn_tanh", "lstm-proj3", "gru_reset_before"])
def test_spread_tiles_stop_at_their_longest_rows(cell, proj, reverse, monkeypatch):
    """With lengths each row tile of the spread kernels runs its own steps: the
    forward up to its longest row and one more (where that row finishes), the
    backward from its longest row down; the batch's longest sets only the first
    tile's.  Sorted longest first (a packed batch), the interpreter's 4-row tiles
    over 2 unit tiles: the tile bodies run, counted, and every output and
    gradient equal to the per-step path's, bit for bit.  The tiles' first
    backward steps fall on either buffer of the ping-pong pairs."""
    lengths = [6, 6, 6, 5, 3, 3, 2, 2, 2, 1, 1, 0]  # tiles of 4 rows: longest 6, 3 and 2
    T, B, H = 6, len(lengths), 5
    args = to_device(recurrence_inputs(cell, T, B, H, proj=proj, requires_grad=True,
                                       key=("spread-tiles", cell)), DEVICE)
    blocks = spread_module.tiles(cell, B, H, bool(proj), torch.device(DEVICE))
    n_b, n_h = spread_module.grid(B, H, blocks)
    assert (blocks["BLOCK_B"], n_b, n_h) == (4, 3, 2)
    bodies = {"forward": 0, "backward": 0}
    for name, kind in (("gates_forward_tile", "forward"), ("gates_backward_tile", "backward")):
        body = getattr(spread_module, name)

        def counted(*a, _body=body, _kind=kind, **k):
            bodies[_kind] += 1  # (the programs run as threads, one at a time: spread.launch)
            return _body(*a, **k)

        monkeypatch.setattr(spread_module, name, counted)
    results = {}
    for path in ("spread", "step"):
        monkeypatch.setattr(triton_ops, "PATH", path)
        results[path] = outputs_and_grads("triton", cell, args, torch.tensor(lengths), reverse,
                                          key=("spread-tiles", cell))
    longest = [max(lengths[i:i + 4]) for i in range(0, B, 4)]
    assert bodies["forward"] == n_h * sum(min(n + 1, T) for n in longest), bodies
    assert bodies["backward"] == n_h * sum(longest), bodies
    assert sum(longest) < n_b * T
    for name, want in results["step"].items():
        got = results["spread"][name]
        assert not torch.isnan(want).any(), name
        assert torch.equal(got, want), f"{name}: max difference {(got - want).abs().max()}"


@triton.jit
def _barrier_removed(p_count, target):
    """Mutant: arrives, never waits."""
    tl.atomic_add(p_count, 1, sem="release", scope="gpu")


@triton.jit
def _barrier_one_short(p_count, target):
    """Mutant: waits for one arrival fewer than the programs of the group."""
    tl.atomic_add(p_count, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(p_count, 0, sem="acquire", scope="gpu")
    while seen < target - 1:
        seen = tl.atomic_add(p_count, 0, sem="acquire", scope="gpu")


@triton.jit
def _barrier_one_extra(p_count, target):
    """Mutant: waits for one arrival more than there will ever be."""
    tl.atomic_add(p_count, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(p_count, 0, sem="acquire", scope="gpu")
    while seen < target + 1:
        seen = tl.atomic_add(p_count, 0, sem="acquire", scope="gpu")


@pytest.mark.skipif(HAS_GPU, reason="mutates the kernels the interpreter runs")
@pytest.mark.parametrize("mutant", [_barrier_removed, _barrier_one_short],
                         ids=["barrier-removed", "barrier-one-short"])
@pytest.mark.parametrize("cell,proj", [("lstm", 0), ("gru", 0), ("lstm", 3),
                                       ("gru_reset_before", 0)],
                         ids=["lstm", "gru", "lstm-proj3", "gru_reset_before"])
def test_spread_without_its_barrier_is_wrong(cell, proj, mutant, monkeypatch):
    """The barrier is what makes the spread kernels right: without it, or
    waiting for one program fewer, a program reads the next step's h before
    the other programs have written it.  The interpreter's schedule runs a
    program until it spins, so the early read happens in every run, not by
    chance: the results differ from the reference (the buffers a program
    reads too early hold NaN, conftest's poison)."""
    tensors, consts = options_on_device(*case_inputs(cell, proj, "all-lengths-reverse", T=4, B=5,
                                                     H=5, requires_grad=True, key=("mutant",)))
    want = options_outputs_and_grads("reference", cell, tensors, consts, key=("mutant",))
    monkeypatch.setattr(triton_ops, "PATH", "spread")
    monkeypatch.setattr(spread_module, "grid_barrier", mutant)
    got = options_outputs_and_grads("triton", cell, tensors, consts, key=("mutant",))
    wrong = [name for name in want
             if not torch.allclose(got[name], want[name], rtol=1e-7, atol=1e-9, equal_nan=False)]
    assert "output" in wrong and "h_n" in wrong, wrong


@pytest.mark.skipif(HAS_GPU, reason="mutates the kernels the interpreter runs")
def test_spread_programs_that_never_meet_are_reported(monkeypatch):
    """A barrier waiting for more programs than the grid has would hang a GPU:
    under the interpreter the launch reports it once every program spins with
    nothing changing (every program's thread stops), and the next launch runs
    normally."""
    args = to_device(recurrence_inputs("gru", 3, 2, 6, key=("never-meet",)), DEVICE)
    monkeypatch.setattr(triton_ops, "PATH", "spread")
    with monkeypatch.context() as m:
        m.setattr(spread_module, "grid_barrier", _barrier_one_extra)
        with pytest.raises(Exception, match="programs never meet"):
            torch.ops.rnnkern_triton.recurrence("gru", *args.values(), None, False, False)
    got = torch.ops.rnnkern_triton.recurrence("gru", *args.values(), None, False, False)
    want = ops.recurrence("gru", *args.values(), None, False, backend="reference")
    assert_close(got[0], want[0], what="output after the failed launch")


def test_forced_spread_where_it_cannot_run_raises(monkeypatch):
    """Never a wrong answer or a hang: a forced spread kernel for LSTM-LN, or
    with more tiles than SMs, raises before any launch."""
    monkeypatch.setattr(triton_ops, "PATH", "spread")
    with pytest.raises(ValueError, match="PATH='spread'.*lstm_ln"):
        triton_ops.choose_path("lstm_ln", 6, 6, torch.float64, False, B=2,
                               device=torch.device(DEVICE))
    B = 64 * (spread_module._programs(torch.device(DEVICE)) + 1)
    args = to_device(recurrence_inputs("rnn_tanh", 1, B, 6, key=("forced",)), DEVICE)
    with pytest.raises(ValueError, match=f"PATH='spread'.*B={B}"):
        torch.ops.rnnkern_triton.recurrence("rnn_tanh", *args.values(), None, False, False)


def test_every_step_a_reset(path):
    """resets everywhere: each step starts from h0 / c0, so each output is one
    step from the initial state, and the gradient of every step reaches
    h0 / c0 (reverse, with lengths, zoneout in evaluation)."""
    for cell in ("lstm_ln", "gru"):
        tensors, consts = case_inputs(cell, 0, "zoneout-eval", T=4, B=3, H=5, requires_grad=True,
                                      key=("all-resets",))
        consts = dict(consts, resets=torch.ones(4, 3, dtype=torch.bool),
                      lengths=torch.tensor([4, 2, 0]), reverse=True)
        tensors, consts = options_on_device(tensors, consts)
        key = ("all-resets", cell)
        want = options_outputs_and_grads("reference", cell, tensors, consts, key=key)
        got = options_outputs_and_grads("triton", cell, tensors, consts, key=key)
        for name in want:
            assert_close(got[name], want[name], what=f"{cell} {name}")


def test_zoneout_read_through_strides(path):
    """A zoneout mask that is a transposed view ([B, T, Z] storage, strides
    (Z, T*Z, 1)): the kernels read it in place, h part and c part."""
    for cell, proj in (("lstm", 3), ("gru", 0)):
        tensors, consts = case_inputs(cell, proj, "all-lengths-reverse", T=5, B=3, H=5,
                                      requires_grad=True, key=("strided",))
        z = consts["zoneout"].transpose(0, 1).contiguous().transpose(0, 1)
        assert not z.is_contiguous()
        tensors, consts = options_on_device(tensors, dict(consts, zoneout=z))
        key = ("strided", cell)
        want = options_outputs_and_grads("reference", cell, tensors, consts, key=key)
        got = options_outputs_and_grads("triton", cell, tensors, consts, key=key)
        for name in want:
            assert_close(got[name], want[name], what=f"{cell} {name}")


@pytest.mark.parametrize("T,B", [(0, 3), (3, 0)], ids=["T0", "B0"])
def test_empty_sizes_with_options(T, B, path):
    """No steps or no rows with resets, zoneout and lstm_ln: the states pass
    through, the weight and ln gradients are zeros (also the lstm_ln step op
    without rows)."""
    for cell in ("lstm_ln", "rnn_tanh"):
        tensors, consts = case_inputs(cell, 0, "plain", T=T, B=B, H=5, requires_grad=True,
                                      key=("empty-options",))
        g = generator("empty-options", cell, T, B)
        Z = reference.zoneout_width(cell, 5, 5)
        consts = dict(consts, resets=torch.zeros(T, B, dtype=torch.bool),
                      zoneout=(torch.rand(T, B, Z, generator=g) < 0.5).double())
        tensors, consts = options_on_device(tensors, consts)
        results = []
        for backend in ("reference", "triton"):
            out = [o for o in run_options(cell, tensors, consts, backend) if o is not None]
            g = generator("empty-options-cotangent")
            loss = sum((o * randn(g, *o.shape).to(DEVICE)).sum() for o in out)
            grads = torch.autograd.grad(loss, [t for t in tensors.values() if t is not None],
                                        allow_unused=True, materialize_grads=True)
            results.append(out + list(grads))
        for i, (got, want) in enumerate(zip(*results[::-1])):
            assert got.shape == want.shape, i
            assert_close(got, want, what=f"{cell} result {i}")
    if B == 0:
        a = to_device(step_case(B=0, requires_grad=True, key=("empty-step",)), DEVICE)
        h, c = ops.step("lstm_ln", *[a[n] for n in ("x", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh")],
                        backend="triton", ln=a["ln"])
        grads = torch.autograd.grad(h.sum() + c.sum(), list(a.values()))
        assert h.shape == c.shape == (0, 5)
        for name, gr in zip(a, grads):
            assert gr.shape == a[name].shape and torch.equal(gr, torch.zeros_like(gr)), name


class _LaunchTwice:
    """A kernel whose every launch runs twice, as the autotuner's benchmark runs
    re-launch a kernel on a GPU before the real launch."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def twice(*args, **kwargs):
            launch(*args, **kwargs)
            launch(*args, **kwargs)

        return twice


@pytest.mark.parametrize("cell,proj", [("lstm_ln", 0), ("lstm", 3), ("gru_reset_before", 0)],
                         ids=["lstm_ln", "lstm-proj3", "gru_reset_before"])
def test_kernels_can_rerun(cell, proj, loop_or_step, monkeypatch):
    """Every kernel reads its inputs and writes separate outputs, so the
    autotuner may re-run it (under the interpreter there is one configuration,
    so nothing re-runs): with every launch run twice, both paths with every
    option still match the reference.  (An accumulator updated in place, such
    as the sum of the reset steps' start-state gradients, would count twice.)"""
    for name in ("forward_loop_kernel", "backward_loop_kernel"):
        monkeypatch.setattr(triton_ops.sequence, name,
                            _LaunchTwice(getattr(triton_ops.sequence, name)))
    for name in ("gates_forward_kernel", "gru_rb_candidate_kernel", "projection_forward_kernel",
                 "ln_projections_kernel", "lstm_ln_forward_kernel", "gates_backward_kernel",
                 "gru_rb_reset_kernel", "projection_backward_kernel", "lstm_ln_backward_kernel",
                 "input_grad_kernel"):
        monkeypatch.setattr(triton_ops.step_kernels, name,
                            _LaunchTwice(getattr(triton_ops.step_kernels, name)))
    tensors, consts = options_on_device(*case_inputs(cell, proj, "all-lengths-reverse", T=5, B=3,
                                                     H=5, requires_grad=True, key=("rerun",)))
    want = options_outputs_and_grads("reference", cell, tensors, consts, key=("rerun",))
    got = options_outputs_and_grads("triton", cell, tensors, consts, key=("rerun",))
    for name in want:
        assert_close(got[name], want[name], what=name)


def expected_workspace(cell, t, resets, zoneout):
    """The workspace csrc/cells.h describes, from the reference formulas, for a
    forward run without lengths: LSTM i, f, g, o, c (c after zoneout); RNN with
    zoneout its candidate h~; LSTM-LN i, f, g, o, c, x^ (4H), h^ (4H), c^, then
    the rstd of x W_ih^T, of h W_hh^T and of c~."""
    T, H = t["xproj"].shape[0], t["w_hh"].shape[1]
    h, c = t["h0"], t["c0"]
    ln = t["ln"]
    rows = []
    for s in range(T):
        keep = resets[s].unsqueeze(1)
        h = torch.where(keep, t["h0"], h)
        if c is not None:
            c = torch.where(keep, t["c0"], c)
        m = zoneout[s]
        if cell == "rnn_tanh":
            cand = torch.tanh(t["xproj"][s] + t["b_ih"] + h @ t["w_hh"].t() + t["b_hh"])
            rows.append(cand)
            h = m * h + (1 - m) * cand
            continue

        def norm(v):
            mean = v.mean(1, keepdim=True)
            rstd = 1 / torch.sqrt(((v - mean) ** 2).mean(1, keepdim=True) + reference.LN_EPS)
            return (v - mean) * rstd, rstd

        if cell == "lstm":
            pre = t["xproj"][s] + t["b_ih"] + h @ t["w_hh"].t() + t["b_hh"]
        else:
            xh, rx = norm(t["xproj"][s])
            hh, rh = norm(h @ t["w_hh"].t())
            pre = xh * ln[:4 * H] + hh * ln[4 * H:8 * H] + t["b_ih"] + t["b_hh"]
        i, f, g, o = pre.chunk(4, 1)
        i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
        c_cand = f * c + i * g
        if cell == "lstm":
            h_cand = o * torch.tanh(c_cand)
        else:
            ch, rc = norm(c_cand)
            h_cand = o * torch.tanh(ch * ln[8 * H:9 * H] + ln[9 * H:])
        h_new = m[:, :H] * h + (1 - m[:, :H]) * h_cand
        c = m[:, H:] * c + (1 - m[:, H:]) * c_cand
        h = h_new
        row = [i, f, g, o, c]
        if cell == "lstm_ln":
            row += [xh, hh, ch, rx, rh, rc]
        rows.append(torch.cat(row, 1))
    return torch.stack(rows)


@pytest.mark.parametrize("cell", ["rnn_tanh", "lstm", "lstm_ln"])
def test_workspace_layout_with_options(cell, path):
    """The workspace is the layout every backend shares (csrc/cells.h,
    reference.workspace_size), with resets and zoneout: its values against
    the reference formulas, on both paths."""
    T, B, H = 4, 3, 5
    tensors, consts = case_inputs(cell, 0, "zoneout", T=T, B=B, H=H, key=("workspace-layout",))
    g = generator("workspace-resets", cell)
    resets = torch.rand(T, B, generator=g) < 0.4
    resets[1, 0] = True
    want = expected_workspace(cell, tensors, resets, consts["zoneout"])
    t, c = options_on_device(tensors, dict(consts, resets=resets))
    *_, ws = torch.ops.rnnkern_triton.recurrence(
        cell, t["xproj"], t["h0"], t["c0"], t["w_hh"], t["b_ih"], t["b_hh"], None, None, False,
        True, c["resets"], c["zoneout"], t["ln"])
    assert ws.shape == (T, B, reference.workspace_size(cell, H, True)) == want.shape
    assert_close(ws, want.to(ws.device), what="workspace")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cell", ["lstm", "lstm_ln", "gru_reset_before"])
def test_options_half_per_step(cell, dtype, monkeypatch):
    """Half inputs with every option on the per-step path (tests/test_options.py
    covers the loop path): within the reference's own error in that dtype."""
    monkeypatch.setattr(triton_ops, "PATH", "step")
    tensors, consts = case_inputs(cell, 0, "all-lengths-reverse", H=8, requires_grad=True,
                                  key=("half-step",))
    key = ("half-step", cell)
    want = options_outputs_and_grads("reference", cell, tensors, consts, key=key)

    def cast(where):
        ts = {n: None if v is None else v.detach().to(where, dtype).requires_grad_()
              for n, v in tensors.items()}
        cs = dict(consts, zoneout=consts["zoneout"].to(dtype),
                  resets=consts["resets"].to(where))
        return ts, cs

    ref_lp = options_outputs_and_grads("reference", cell, *cast("cpu"), key=key)
    got = options_outputs_and_grads("triton", cell, *cast(DEVICE), key=key)
    for name in want:
        assert got[name].dtype == dtype, name
        assert_low_precision(got[name].cpu(), ref_lp[name], want[name], what=name)


OPTIONS_OPCHECK = [("loop", "lstm_ln", 0), ("step", "lstm_ln", 0), ("step", "lstm", 3),
                   ("loop", "gru", 0), ("step", "gru_reset_before", 0), ("step", "rnn_relu", 0)]


@pytest.mark.parametrize("path,cell,proj", OPTIONS_OPCHECK, indirect=["path"],
                         ids=[f"{p}-{c}-proj{q}" if q else f"{p}-{c}"
                              for p, c, q in OPTIONS_OPCHECK])
def test_opcheck_recurrence_options(path, cell, proj):
    """opcheck of the recurrence with resets, zoneout, lengths, reverse (and ln)."""
    t, c = options_on_device(*case_inputs(cell, proj, "all-lengths-reverse", T=4, B=3, H=4,
                                          requires_grad=True, key=("opcheck-options",)))
    torch.library.opcheck(torch.ops.rnnkern_triton.recurrence.default,
                          (cell, t["xproj"], t["h0"], t["c0"], t["w_hh"], t["b_ih"], t["b_hh"],
                           t["w_hr"], c["lengths"], c["reverse"], True, c["resets"],
                           c["zoneout"].contiguous(), t["ln"]))


def test_opcheck_lstm_ln_ops(loop_or_step):
    """opcheck of lstm_ln's step op, step_backward and recurrence_backward."""
    s = to_device(step_case(key=("opcheck",)), DEVICE)
    args = [s[n] for n in ("x", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh")]
    torch.library.opcheck(torch.ops.rnnkern_triton.step.default, ("lstm_ln", *args, s["ln"]))
    h, c, ws = torch.ops.rnnkern_triton.step("lstm_ln", *args, s["ln"])
    g = generator("opcheck-ln-bwd")
    torch.library.opcheck(torch.ops.rnnkern_triton.step_backward.default,
                          ("lstm_ln", randn(g, *h.shape).to(DEVICE), randn(g, *c.shape).to(DEVICE),
                           *args[:5], h, ws, s["ln"]))
    t, k = options_on_device(*case_inputs("lstm_ln", 0, "all-lengths-reverse", T=4, B=3, H=4,
                                          key=("opcheck-ln-bwd",)))
    out, h_n, c_n, ws = torch.ops.rnnkern_triton.recurrence(
        "lstm_ln", t["xproj"], t["h0"], t["c0"], t["w_hh"], t["b_ih"], t["b_hh"], None,
        k["lengths"], True, True, k["resets"], k["zoneout"], t["ln"])
    torch.library.opcheck(torch.ops.rnnkern_triton.recurrence_backward.default,
                          ("lstm_ln", randn(g, *out.shape).to(DEVICE),
                           randn(g, *h_n.shape).to(DEVICE), randn(g, *c_n.shape).to(DEVICE),
                           t["h0"], t["c0"], t["w_hh"], None, out, ws, k["lengths"], True,
                           k["resets"], k["zoneout"].contiguous(), t["ln"]))


def test_lstm_ln_step_several_chunks():
    """The lstm_ln step op with H = 9 (three unit chunks of the row kernels,
    three column tiles) and B = 5 (three row blocks), float64, against the
    reference: values and every gradient (tests/test_options.py: H = 5)."""
    a = to_device(step_case(B=5, I=7, H=9, requires_grad=True, key=("chunks",)), DEVICE)
    names = list(a)
    results = []
    for backend in ("reference", "triton"):
        h, c = ops.step("lstm_ln", *[a[n] for n in names[:7]], backend=backend, ln=a["ln"])
        g = generator("chunks-cotangent")
        loss = (h * randn(g, *h.shape).to(DEVICE)).sum() + (c * randn(g, *c.shape).to(DEVICE)).sum()
        results.append([h, c, *torch.autograd.grad(loss, [a[n] for n in names])])
    for name, got, want in zip(["h_new", "c_new"] + [f"grad_{n}" for n in names], *results[::-1]):
        assert_close(got, want, what=name)


# ------------------------------------------------------------ path choice ----

def test_fits_on_chip_limits():
    """The documented limits of the in-kernel time loop (128 KiB of weights)."""
    fits = sequence.fits_on_chip
    assert fits("lstm", 128, 128, torch.float16) and not fits("lstm", 129, 129, torch.float16)
    assert fits("gru", 128, 128, torch.bfloat16) and not fits("gru", 256, 256, torch.bfloat16)
    assert fits("rnn_tanh", 256, 256, torch.float16) and not fits("rnn_tanh", 257, 257, torch.float16)
    assert fits("lstm", 64, 64, torch.float32) and not fits("lstm", 65, 65, torch.float32)
    assert fits("rnn_relu", 128, 128, torch.float32)
    assert fits("gru", 64, 64, torch.float32) and not fits("gru", 65, 65, torch.float32)
    assert fits("lstm", 64, 64, torch.float64) and not fits("lstm", 65, 65, torch.float64)
    # the projection adds one [H, P] block
    assert fits("lstm", 64, 32, torch.float32, proj=True)
    assert not fits("lstm", 128, 128, torch.float16, proj=True)


def test_auto_path_follows_the_limit(monkeypatch):
    """On chip where the weights fit; beyond, the spread kernels where the cell
    has one kernel per step and the tiles fit the SMs (here the interpreter's
    8, :data:`rnnkern.triton.spread.INTERPRET_PROGRAMS`; a GPU's SM count on a
    GPU), else per step."""
    monkeypatch.setattr(triton_ops, "PATH", "auto")
    device = torch.device(DEVICE)
    programs = spread_module._programs(device)

    def choose(cell, H, P, dtype, proj=False, B=1):
        return triton_ops.choose_path(cell, H, P, dtype, proj, B=B, device=device)

    assert choose("lstm", 64, 64, torch.float32) == "loop"
    assert choose("lstm", 65, 65, torch.float32) == "spread"
    assert choose("gru", 1024, 1024, torch.bfloat16) == "spread"
    assert choose("rnn_relu", 300, 300, torch.float32, B=2) == "spread"
    # two stages per step, two barriers
    assert choose("gru_reset_before", 1024, 1024, torch.bfloat16) == "spread"
    assert choose("lstm", 256, 128, torch.float16, proj=True) == "spread"
    # whole-row layer norms: per step
    assert choose("lstm_ln", 256, 256, torch.float16) == "step"
    # more row tiles than SMs, even at the widest unit tile: per step
    assert choose("lstm", 65, 65, torch.float32, B=64 * (programs + 1)) == "step"
    # every program of a spread grid resident at once: at most one per SM
    blocks = spread_module.tiles("rnn_relu", 2, 300, False, device)
    assert math.prod(spread_module.grid(2, 300, blocks)) <= programs


@pytest.mark.parametrize("cell", ["lstm", "gru_reset_before"])
def test_auto_path_beyond_the_limit(cell, monkeypatch):
    """With the limit lowered to one 16 x 16 float64 block, H = 6 no longer
    fits: "auto" runs the spread kernels, which agree with the reference."""
    monkeypatch.setattr(triton_ops, "PATH", "auto")
    monkeypatch.setattr(sequence, "ON_CHIP_BYTES", 16 * 16 * 8)
    H = 6
    assert triton_ops.choose_path(cell, H, H, torch.float64, False, B=2,
                                  device=torch.device(DEVICE)) == "spread"
    args = to_device(recurrence_inputs(cell, 3, 2, H, requires_grad=True, key=("beyond",)), DEVICE)
    want = outputs_and_grads("reference", cell, args, key=("beyond",))
    got = outputs_and_grads("triton", cell, args, key=("beyond",))
    for name in want:
        assert_close(got[name], want[name], what=name)


def test_forced_loop_beyond_the_limit_raises(monkeypatch):
    """Never a wrong answer: a forced in-kernel loop that cannot hold the weights
    raises before any launch."""
    monkeypatch.setattr(triton_ops, "PATH", "loop")
    args = to_device(recurrence_inputs("rnn_tanh", 2, 2, 129, key=("forced",)), DEVICE)
    with pytest.raises(ValueError, match="PATH='loop'.*H=129"):
        torch.ops.rnnkern_triton.recurrence("rnn_tanh", *args.values(), None, False, False)


def test_unknown_path_is_an_error(monkeypatch):
    monkeypatch.setattr(triton_ops, "PATH", "fastest")
    args = to_device(recurrence_inputs("gru", 2, 2, 4, key=("path",)), DEVICE)
    with pytest.raises(ValueError, match="'fastest'.*auto, loop, spread, step"):
        torch.ops.rnnkern_triton.recurrence("gru", *args.values(), None, False, False)


# -------------------------------------------------------------- bad input ----

# (the Triton ops' argument checks: tests/test_inputs.py, with the other bad input)

@pytest.mark.skipif(HAS_GPU, reason="CPU tensors are the interpreter's; a GPU run uses CUDA tensors")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    """Kernels compiled for a GPU cannot take CPU tensors: a clear error, no launch."""
    monkeypatch.setattr(triton_ops, "INTERPRET", False)
    args = to_device(recurrence_inputs("lstm", 3, 2, 4, key=("bad",)), DEVICE)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        torch.ops.rnnkern_triton.recurrence("lstm", *args.values(), None, False, True)


# -------------------------------------------------------------------- GPU ----

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cell,H", [("lstm", 64), ("lstm", 256), ("gru", 96), ("gru", 320),
                                    ("rnn_tanh", 128), ("rnn_relu", 512)])
def test_gpu_matches_torch_nn(cell, H, dtype, monkeypatch):
    """On a GPU, against torch.nn (cuDNN): float32 to the float32 tolerance (TF32
    off on both sides), half types within twice cuDNN's own error against a
    float64 run of the same (rounded) parameters and inputs.  The sizes cover
    both paths (auto choice)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    T, B, I = 33, 17, 40
    torch.manual_seed(H)
    ref64, _ = paired_modules(cell, I, H, torch.float64, "cuda")
    theirs, ours = paired_modules(cell, I, H, dtype, "cuda")
    theirs.load_state_dict(ref64.state_dict())
    ours.load_state_dict(ref64.state_dict())
    g = generator("gpu-parity", cell, H)
    x = randn(g, T, B, I).cuda()
    L = 1
    h0 = randn(g, L, B, H, scale=0.5).cuda()
    hx64 = (h0, randn(g, L, B, H, scale=0.5).cuda()) if cell == "lstm" else h0
    cot = [randn(g, T, B, H).cuda(), randn(g, L, B, H).cuda()] + ([randn(g, L, B, H).cuda()] if cell == "lstm" else [])
    if dtype != torch.float32:
        # The truth is the function both half-precision modules hold: their
        # rounded parameters and inputs, in float64 (as test_cuda.py's half-type
        # tests define it).  Against the unrounded float64 weights, the weights'
        # rounding alone, in exact arithmetic, moves the H=512 ReLU's grad h0 by
        # 0.97 (Frobenius): more than either implementation's arithmetic, so the
        # comparison measured which one the rounding happened to favour.
        ref64.load_state_dict({k: v.to(dtype).double() for k, v in ref64.state_dict().items()})
        rounded = lambda t: t.to(dtype).double()  # noqa: E731
        x, cot = rounded(x), [rounded(c) for c in cot]
        hx64 = tuple(map(rounded, hx64)) if cell == "lstm" else rounded(hx64)

    def run(module, dt):
        xx = x.detach().to(dt).requires_grad_()
        hx = (tuple(h.detach().to(dt).requires_grad_() for h in hx64) if cell == "lstm"
              else hx64.detach().to(dt).requires_grad_())
        outs, grads = module_outputs_and_grads(module, xx, hx, [c.to(dt) for c in cot])
        return list(outs) + list(grads)

    want = run(ref64, torch.float64)
    lp = run(theirs, dtype)
    got = run(ours, dtype)
    for i, (a, b, w) in enumerate(zip(got, lp, want)):
        if dtype == torch.float32:
            assert_close(a, b, dtype=torch.float32, what=f"result {i}")
        else:
            assert_low_precision(a, b, w, what=f"result {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
def test_gpu_gradcheck_float64(cell, proj, path):
    args = recurrence_inputs(cell, 4, 3, 6, proj=proj, requires_grad=True, key=("gpu-gc",))
    args = {k: None if v is None else v.detach().cuda().requires_grad_() for k, v in args.items()}
    names = differentiable(args)

    def f(*tensors):
        out, h_n, c_n = run_recurrence("triton", cell, {**args, **dict(zip(names, tensors))},
                                       torch.tensor([4, 1, 0]), True)
        return (out, h_n) if c_n is None else (out, h_n, c_n)

    assert torch.autograd.gradcheck(f, [args[n] for n in names])


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["loop", "spread", "step"])
def test_gpu_lengths_reach_the_device_without_a_sync(path, monkeypatch):
    """lengths, an int64 CPU tensor, go to the GPU from pinned memory without
    waiting: after a first call (Triton's compiling and autotuning synchronise),
    forward and backward with lengths make no synchronising call
    (torch.cuda.set_sync_debug_mode("error") raises at one: a copy from pageable
    memory synchronises the stream first)."""
    force_triton_path(monkeypatch, path)
    args = {k: None if v is None else v.float().cuda().requires_grad_()
            for k, v in recurrence_inputs("lstm", 6, 4, 32, key=("lengths-sync",)).items()}
    lengths = torch.tensor([6, 2, 0, 5])

    def fwd_bwd():
        out = [t for t in run_recurrence("triton", "lstm", args, lengths) if t is not None]
        return torch.autograd.grad(sum(t.sum() for t in out), [args["xproj"], args["w_hh"]])

    want = fwd_bwd()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = fwd_bwd()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b in zip(got, want):
        assert_close(a, b, dtype=torch.float32, what="gradient")


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["spread", "step"])
def test_gpu_captures_in_a_cuda_graph(path, monkeypatch):
    """The per-step and spread forwards never synchronise with the host: they
    replay from a CUDA graph with the same result (the spread kernel's barrier
    counters are zeroed inside the graph)."""
    monkeypatch.setattr(triton_ops, "PATH", path)
    args = {k: None if v is None else v.float().cuda()
            for k, v in recurrence_inputs("gru", 16, 8, 256, key=("graph",)).items()}
    want = run_recurrence("triton", "gru", args)  # also autotunes, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run_recurrence("triton", "gru", args)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(got[0], want[0], dtype=torch.float32, what="output")

"""The CUDA backend's code executed on the CPU: backend="cuda_emulated".

rnnkern built with RNNKERN_CUDA_EMULATION=1 compiles csrc/cuda with g++ for an
emulated device (csrc/cuda_emu: one fiber per CUDA thread, barriers checked,
WMMA and cuBLAS as checked references, fresh "device" memory full of 0xFF =
NaN) and registers the real backend's op bodies (csrc/cuda/bindings_impl.h) for
CPU tensors.  These tests run the matrix the CPU backend passes on that code:
float64 gradcheck of every cell and GRU form (recurrence and step, projection,
lengths, reverse), the raw ops against the CPU backend's, half types within the
reference's own error on both step paths (WMMA sm_90, FMA below sm_80), every
thread-resume order, parity with torch.nn, edge sizes, strided views, opcheck;
and the step options and the LayerNorm cell (resets, zoneout, lstm_ln: last section).
Emulated sizes stay small (B, H, I of 1-40, T of 1-12; LSTM-LN rows up to H = 150).
The backend contract (float64 gradcheck of recurrence and step, opcheck, edge
sizes, no workspace without grad) runs on this backend in
tests/test_backend_contract.py.

CI builds the emulation and sets RNNKERN_REQUIRE_CUDA_EMULATION=1, so a build
without it fails here; elsewhere the module is skipped with the reason.
"""
from __future__ import annotations


import pytest
import torch

from rnnkern import ops, reference
from conftest import (CELLS, assert_close, assert_low_precision, differentiable, generator,
                      outputs_and_grads, randn, recurrence_inputs, rnnkern_module, run_recurrence,
                      require_cuda_emulation, step_inputs, torch_module)

require_cuda_emulation()

from rnnkern import cuda_emulated  # noqa: E402

EMU = "cuda_emulated"
CASES = [(cell, 0) for cell in CELLS] + [("lstm", 3)]
CASE_IDS = [f"{c}-proj{p}" if p else c for c, p in CASES]
TORCH_CELLS = [c for c in CELLS if c != "gru_reset_before"]
ORDERS = ["forward", "reverse", "shuffle"]
LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def default_schedule():
    """Each test starts from the forward order on sm_90 and leaves it so."""
    cuda_emulated.set_schedule("forward", 0)
    cuda_emulated.set_arch(900)
    yield
    cuda_emulated.set_schedule("forward", 0)
    cuda_emulated.set_arch(900)


def test_backend_is_listed_and_runs_on_the_emulator():
    assert EMU in ops.BACKENDS
    assert ops.resolve_backend(EMU, torch.device("cpu")) == EMU
    args = recurrence_inputs("lstm", 3, 2, 5)
    before = cuda_emulated.launches()
    run_recurrence(EMU, "lstm", args)
    assert cuda_emulated.launches() > before  # the kernels ran on the emulated device


# (gradcheck of recurrence and step, opcheck, no workspace without grad, empty
# sizes: the backend contract, tests/test_backend_contract.py)


# --------------------------------------- the raw ops against the CPU kernels ----

def raw_ops_results(namespace, cell, args, lengths, reverse):
    """Every output of recurrence and recurrence_backward, in the op's own layout."""
    family = getattr(torch.ops, namespace)
    a = {k: None if v is None else v.detach() for k, v in args.items()}
    fwd = family.recurrence(cell, *a.values(), lengths, reverse, True)
    out, h_n, c_n, ws = fwd
    g = generator("emu-raw-ops", cell)
    grad_out, grad_h = randn(g, *out.shape, dtype=out.dtype), randn(g, *h_n.shape, dtype=out.dtype)
    grad_c = randn(g, *c_n.shape, dtype=out.dtype) if cell == "lstm" else None
    bwd = family.recurrence_backward(cell, grad_out, grad_h, grad_c, a["h0"], a["c0"], a["w_hh"],
                                     a["w_hr"], out, ws, lengths, reverse)
    return list(fwd) + list(bwd)


RAW_NAMES = ["output", "h_n", "c_n", "workspace", "grad_xproj", "grad_h0", "grad_c0", "grad_w_hh",
             "grad_b_ih", "grad_b_hh", "grad_w_hr"]


# Lengths and direction of test_ops_match_cpu_backend's variants: unsorted with a
# zero inside; sorted longest first (a packed batch: the rows past each step's
# live ones drop out of the loop); unsorted ending in zero-length rows (none of
# them in step 0's products).
RAW_VARIANTS = {"plain": (None, False), "lengths-reverse": ([7, 3, 0, 6, 1], True),
                "sorted": ([7, 6, 4, 4, 1], False), "sorted-reverse": ([7, 6, 4, 4, 1], True),
                "trailing-zero": ([3, 7, 0, 5, 0], False)}


@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("variant", list(RAW_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_ops_match_cpu_backend(cell, proj, variant, dtype):
    """Output, states, workspace, placeholders and every gradient as the CPU
    kernels give them, in shape, dtype and value."""
    T, B, H = 7, 5, 37
    args = recurrence_inputs(cell, T, B, H, dtype=dtype, proj=proj and 11, key=("emu-raw", variant))
    lengths, reverse = RAW_VARIANTS[variant]
    lengths = None if lengths is None else torch.tensor(lengths)
    want = raw_ops_results("rnnkern", cell, args, lengths, reverse)
    got = raw_ops_results("rnnkern_cuda_emu", cell, args, lengths, reverse)
    for name, a, b in zip(RAW_NAMES, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        assert_close(a, b, what=name)


@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("lengths", [[8, 6, 6, 3, 1, 1], [2, 8, 1, 3, 1, 0]],
                         ids=["sorted", "unsorted"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_lengths_cost_their_live_rows(cell, proj, lengths, reverse):
    """The host loops' GEMMs take at each step only the rows up to the last
    one still running, forward and backward: a batch sorted longest first (a
    packed batch) costs its real steps in multiply-adds, not rows x longest.
    Counted by the emulated cuBLAS against the same call without lengths."""
    T, B, H = 8, 6, 5
    args = recurrence_inputs(cell, T, B, H, proj=proj and 3, key=("emu-live", cell))
    a = {k: None if v is None else v.detach() for k, v in args.items()}
    family = torch.ops.rnnkern_cuda_emu

    def multiply_adds(n):
        before = cuda_emulated.gemm_multiply_adds()
        out, h_n, c_n, ws = family.recurrence(cell, *a.values(), n, reverse, True)
        middle = cuda_emulated.gemm_multiply_adds()
        assert not out.isnan().any() and not h_n.isnan().any()
        grads = family.recurrence_backward(
            cell, torch.ones_like(out), torch.ones_like(h_n),
            torch.ones_like(c_n) if cell == "lstm" else None, a["h0"], a["c0"], a["w_hh"],
            a["w_hr"], out, ws, n, reverse)
        assert not any(g.isnan().any() for g in grads)
        return middle - before, cuda_emulated.gemm_multiply_adds() - middle

    mode = cuda_emulated.persistent()
    cuda_emulated.set_persistent("never")  # the host loop (the persistent kernel takes all rows)
    try:
        full = multiply_adds(None)
        live = multiply_adds(torch.tensor(lengths))
    finally:
        cuda_emulated.set_persistent(mode)
    rows = sum(reference.live_rows(lengths, T))
    if lengths == sorted(lengths, reverse=True):
        assert rows == sum(lengths)  # the real steps
    assert full[0] > 0 and full[1] > 0
    assert live[0] * T * B == full[0] * rows, (live, full, rows)
    assert live[1] * T * B == full[1] * rows, (live, full, rows)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("arch", [900, 700])
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("BIH", [(3, 7, 5), (20, 40, 33)], ids=["B3-I7-H5", "B20-I40-H33"])
def test_step_ops_match_cpu_backend(cell, BIH, arch, order):
    """The fused step kernel (several tiles and K chunks at the larger size)
    under every resume order of its barriers, on both paths, float64."""
    cuda_emulated.set_arch(arch)
    cuda_emulated.set_schedule(order, 7)
    B, I, H = BIH
    s = step_inputs(cell, B, I, H, key=("emu-step", BIH))
    results = []
    for family in (torch.ops.rnnkern, torch.ops.rnnkern_cuda_emu):
        h, c, ws = family.step(cell, *s.values())
        g = generator("emu-step-grad", cell)
        gh = randn(g, *h.shape)
        gc = randn(g, *c.shape) if cell == "lstm" else None
        bwd = family.step_backward(cell, gh, gc, s["x"], s["h"], s["c"], s["w_ih"], s["w_hh"], h, ws)
        results.append([h, c, ws, *bwd])
    for i, (a, b) in enumerate(zip(results[1], results[0])):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        assert_close(a, b, what=f"result {i}")


# ------------------------------------------------------------ half types ----

@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", list(LOW.values()), ids=list(LOW))
def test_half_types_within_reference_error(cell, proj, dtype):
    """Every cell in half precision, lengths in reverse: no worse than the
    reference's own error in that dtype (conftest's criterion)."""
    T, B, H = 8, 5, 24
    args = recurrence_inputs(cell, T, B, H, dtype=dtype, proj=proj and 9, key=("emu-half",))
    lengths = torch.tensor([8, 5, 0, 3, 1])
    a16 = {k: None if v is None else v.requires_grad_() for k, v in args.items()}
    a32 = {k: None if v is None else v.detach().float().requires_grad_() for k, v in args.items()}
    key = ("emu-half-cot", cell)
    want = outputs_and_grads("reference", cell, a32, lengths, True, key=key)
    ref16 = outputs_and_grads("reference", cell, a16, lengths, True, key=key)
    got = outputs_and_grads(EMU, cell, a16, lengths, True, key=key)
    for name in want:
        assert got[name].dtype == dtype, name
        assert_low_precision(got[name], ref16[name], want[name], what=name)


@pytest.mark.parametrize("arch", [900, 700], ids=["sm90-wmma", "sm70-fma"])
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("dtype", list(LOW.values()), ids=list(LOW))
def test_step_half_types_within_reference_error(cell, dtype, arch):
    cuda_emulated.set_arch(arch)
    s = step_inputs(cell, 19, 21, 18, dtype=dtype, requires_grad=True, key=("emu-step-half",))
    s32 = {k: None if v is None else v.detach().float().requires_grad_() for k, v in s.items()}

    def run(backend, a):
        h, c = ops.step(cell, *a.values(), backend=backend)
        out = [h] if c is None else [h, c]
        g = generator("emu-step-half-cot", cell)
        loss = sum((o * randn(g, *o.shape, dtype=o.dtype)).sum() for o in out)
        names = differentiable(a)
        return out + list(torch.autograd.grad(loss, [a[n] for n in names]))

    want, ref16, got = run("reference", s32), run("reference", s), run(EMU, s)
    for i, (a, r, w) in enumerate(zip(got, ref16, want)):
        assert a.dtype == dtype, i
        assert_low_precision(a, r, w, what=f"result {i}")


# ---------------------------------------------------- torch.nn parity ----

@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_packed_bidirectional_stack_matches_torch_nn(cell):
    """Two layers, both directions, variable lengths: torch.nn on the same
    weights, outputs and every gradient, float64."""
    torch.manual_seed(3)
    theirs = torch_module(cell, 7, 6, num_layers=2, bidirectional=True, dtype=torch.float64)
    ours = rnnkern_module(cell, 7, 6, num_layers=2, bidirectional=True, dtype=torch.float64,
                          backend=EMU)
    ours.load_state_dict(theirs.state_dict())
    g = generator("emu-packed", cell)
    x = randn(g, 6, 4, 7, requires_grad=True)
    lengths = torch.tensor([6, 2, 5, 1])
    results = []
    for m in (theirs, ours):
        out, hidden = m(torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False))
        leaves = [out.data] + list(hidden if isinstance(hidden, tuple) else (hidden,))
        cot = generator("emu-packed-cot", cell)
        loss = sum((t * randn(cot, *t.shape)).sum() for t in leaves)
        results.append(leaves + list(torch.autograd.grad(loss, [x, *m.parameters()])))
    for i, (a, b) in enumerate(zip(results[1], results[0])):
        assert_close(a, b, what=f"{cell} result {i}")


# ------------------------------------------------------------ edge cases ----

@pytest.mark.parametrize("cell", ["lstm", "gru", "gru_reset_before"])
def test_strided_xproj_and_grad_output(cell):
    """Batch-first views as xproj and grad_output (strided rows, no copy)."""
    T, B, H = 5, 3, 6
    G = 4 if cell == "lstm" else 3
    g = generator("emu-strided", cell)
    base = randn(g, B, T, G * H, requires_grad=True)
    args = recurrence_inputs(cell, T, B, H, requires_grad=True, key=("emu-strided",))
    results = []
    for backend in ("cpu", EMU):
        a = dict(args, xproj=base.transpose(0, 1))
        assert not a["xproj"].is_contiguous()
        out = [t for t in run_recurrence(backend, cell, a) if t is not None]
        cot = randn(generator("emu-strided-cot"), B, T, H).transpose(0, 1)
        loss = (out[0] * cot).sum() + sum(t.sum() for t in out[1:])
        results.append(out + list(torch.autograd.grad(loss, [base, *[args[n] for n in differentiable(args) if n != "xproj"]])))
    for i, (a, b) in enumerate(zip(results[1], results[0])):
        assert_close(a, b, what=f"result {i}")


def test_bad_device_is_a_clear_error():
    with pytest.raises(ValueError, match="cuda_emulated.*CPU tensors"):
        ops.resolve_backend(EMU, torch.device("cuda"))


# ------------------------------------------------------- launch bounds ----

def test_every_launch_respects_its_kernels_launch_bounds():
    """A kernel compiled with __launch_bounds__(N) must never be launched with
    more than N threads (the launch fails on hardware).  The emulator cannot
    see the attribute, so the sources are read: every RNNKERN_LAUNCH of a
    kernel with bounds passes the same block-size expression as its bounds,
    and every kernel is launched through RNNKERN_LAUNCH or RNNKERN_LAUNCH_COOPERATIVE
    (no triple chevrons outside common.cuh's definition)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "csrc" / "cuda"
    text = {p.name: p.read_text() for p in sorted(root.glob("*.cu*"))}
    bounds = {m.group(2): m.group(1).split(",")[0].strip()   # (max threads[, min blocks per SM])
              for src in text.values()
              for m in re.finditer(r"__launch_bounds__\(([^)]*)\)\s*(\w+)\s*\(", src)}
    launches = [(m.group(5), m.group(2).strip(), name)
                for name, src in text.items()
                for m in re.finditer(r"RNNKERN_LAUNCH(?:_COOPERATIVE)?\(\s*((?:[^,()]|\([^()]*\))+),"
                                     r"\s*([^,]+),\s*([^,]+),\s*([^,]+),\s*(\w+)", src)]
    assert bounds and launches
    launched = {kernel for kernel, _, _ in launches}
    assert set(bounds) <= launched, f"kernels with bounds never launched: {set(bounds) - launched}"
    for kernel, block, where in launches:
        if kernel in bounds:
            assert block == bounds[kernel], (f"{where}: {kernel} is launched with {block} threads, "
                                             f"its __launch_bounds__ is {bounds[kernel]}")
    for name, src in text.items():
        chevrons = [line for line in src.splitlines() if "<<<" in line and "#define" not in line]
        assert not chevrons, f"{name}: a launch outside RNNKERN_LAUNCH: {chevrons}"


# -------------------------------------------- device semantics of test_cuda ----

def test_tf32_is_honoured_and_close():
    """allow_tf32 reaches cuBLAS (CUBLAS_COMPUTE_32F_FAST_TF32, which the emulated
    GemmEx rounds to TF32's 10-bit mantissa): within TF32 accuracy of float64 with
    it, within float32's without it, and with it the error is TF32's, not
    float32's: a kernel that ignores the flag (float32 products both times)
    fails the lower bound, one that always rounds fails the float32 bound."""
    args = recurrence_inputs("lstm", 6, 4, 37, dtype=torch.float32, key=("emu-tf32",))
    a64 = {k: None if v is None else v.double() for k, v in args.items()}
    want = run_recurrence("reference", "lstm", a64)[0]
    saved = torch.backends.cuda.matmul.allow_tf32
    results, errs = {}, {}
    try:
        for allow in (True, False):
            torch.backends.cuda.matmul.allow_tf32 = allow
            results[allow] = run_recurrence(EMU, "lstm", args)[0]
            errs[allow] = ((results[allow].double() - want).norm() / want.norm()).item()
            assert errs[allow] < (1e-2 if allow else 1e-5), (allow, errs[allow])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert not torch.equal(results[True], results[False])
    # TF32's unit roundoff is 2^-11 (~5e-4), float32's 2^-24 (~6e-8): rounded
    # products leave a relative error far above float32's, and above 1e-5.
    assert errs[True] > 1e-5 and errs[True] > 10 * errs[False], errs
    diff = ((results[True] - results[False]).double().norm() / want.norm()).item()
    assert diff > 1e-5, f"TF32 on and off differ by {diff:.2e} only: float32 products both times?"


@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
def test_padding_is_zero_and_states_kept(cell, proj):
    """Finished sequences output exact zeros and keep their state; an empty
    sequence returns its initial state."""
    args = recurrence_inputs(cell, 6, 3, 5, proj=proj and 2, key=("emu-pad",))
    out, h_n, c_n = run_recurrence(EMU, cell, args, torch.tensor([6, 2, 0]))
    assert out.isfinite().all()
    assert (out[2:, 1] == 0).all() and (out[:, 2] == 0).all()
    assert torch.equal(h_n[2], args["h0"][2]) and torch.equal(h_n[1], out[1, 1])
    if cell == "lstm":
        assert torch.equal(c_n[2], args["c0"][2])



# ------------------------- the step options and the LayerNorm cell ----
# Per-step resets, zoneout and the lstm_ln cell (tests/test_options.py is the
# acceptance matrix of every backend).  Here, on the emulated device, and so
# under the sanitizers of .ci/cuda_emulation.sh: float64 values, gradients and
# gradcheck against the reference over more variants than the matrix's
# (option_cases.py: resets in reverse without lengths, zoneout with lengths
# forward, an evaluation mask in reverse, every position reset), then the paths
# the matrix does not reach: the LSTM-LN row kernels in every thread-resume
# order with rows longer than a block (H > kRowThreads), zoneout masks read
# through unusual strides, empty and tiny sizes, the lstm_ln step in every
# dtype at a size of several passes, the workspace layout of cells.h, opcheck
# of the backward ops.  Their GPU twins are in tests/test_cuda.py.

import option_cases  # noqa: E402


@pytest.mark.parametrize("cell,proj,variant", option_cases.ALL, ids=option_cases.ALL_IDS)
def test_options_match_reference_float64(cell, proj, variant):
    """Outputs, final states and every gradient (ln's included) against the
    float64 reference."""
    t, c = option_cases.option_inputs(cell, proj, variant, requires_grad=True)
    want = option_cases.outputs_and_grads("reference", cell, t, c, key=(cell, variant))
    got = option_cases.outputs_and_grads(EMU, cell, t, c, key=(cell, variant))
    assert set(got) == set(want)
    for name in want:
        assert_close(got[name], want[name], what=name)


@pytest.mark.parametrize("cell,proj,variant", option_cases.ALL, ids=option_cases.ALL_IDS)
def test_options_gradcheck(cell, proj, variant):
    """float64 gradcheck w.r.t. every tensor input, gradients from the outputs
    and the final states."""
    t, c = option_cases.option_inputs(cell, proj, variant, T=4, H=3, requires_grad=True,
                                      key=("gradcheck",))
    names = [n for n in t if t[n] is not None]

    def f(*tensors):
        out, h_n, c_n = option_cases.run(EMU, cell, {**t, **dict(zip(names, tensors))}, c)
        return (out, h_n) if c_n is None else (out, h_n, c_n)

    assert torch.autograd.gradcheck(f, [t[n] for n in names], fast_mode=True)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("H", [3, 130], ids=["H3", "H130-multipass"])
def test_lstm_ln_row_kernels_every_order(order, H):
    """The LSTM-LN row kernels (one block of kRowThreads per row, reductions
    over the block) in every thread-resume order of their barriers, with rows
    shorter than a block and rows longer than one (4H and H above kRowThreads:
    several passes per thread), every option at once, float64."""
    cuda_emulated.set_schedule(order, 11)
    t, c = option_cases.option_inputs("lstm_ln", 0, "all-lengths-reverse", T=3, B=3, H=H,
                                      requires_grad=True, key=("orders",))
    before = cuda_emulated.launches()
    got = option_cases.outputs_and_grads(EMU, "lstm_ln", t, c, key=("orders", H))
    assert cuda_emulated.launches() > before
    want = option_cases.outputs_and_grads("reference", "lstm_ln", t, c, key=("orders", H))
    for name in want:
        assert_close(got[name], want[name], what=f"{order} {name}")


@pytest.mark.parametrize("cell,proj", [("gru", 0), ("lstm", 3), ("rnn_relu", 0), ("lstm_ln", 0)],
                         ids=["gru", "lstm-proj3", "rnn_relu", "lstm_ln"])
@pytest.mark.parametrize("layout", ["batch-first", "units-strided"])
def test_zoneout_mask_strides(cell, proj, layout):
    """A mask viewed from batch-first storage (strided rows: read in place) and
    one whose units are not adjacent (copied to dense rows) give the results
    of the contiguous mask, and the reference's."""
    t, c = option_cases.option_inputs(cell, proj, "zoneout-lengths", requires_grad=True,
                                      key=("strides",))
    z = c["zoneout"]
    if layout == "batch-first":
        view = z.transpose(0, 1).contiguous().transpose(0, 1)
        assert view.stride(2) == 1 and not view.is_contiguous()
    else:
        view = z.permute(2, 0, 1).contiguous().permute(1, 2, 0)
        assert view.stride(2) != 1
    want = option_cases.outputs_and_grads(EMU, cell, t, c, key=("strides",))
    got = option_cases.outputs_and_grads(EMU, cell, t, dict(c, zoneout=view), key=("strides",))
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ref = option_cases.outputs_and_grads("reference", cell, t, c, key=("strides",))
    for name in ref:
        assert_close(got[name], ref[name], what=name)


def tiny_option_results(backend, cell, proj, T, B, H, device="cpu"):
    """Outputs and gradients of a call with resets, a training mask (and ln)
    at sizes with nothing in them; zeros for the inputs the reference leaves
    out of its graph."""
    t, c = option_cases.option_inputs(cell, proj and min(proj, H), "all-lengths-reverse",
                                      T=max(T, 1), B=max(B, 3), H=H, key=("tiny",))

    def cut(name, v):  # to T steps and B rows
        if v is None:
            return None
        v = v[:T, :B] if name == "xproj" else v[:B] if name in ("h0", "c0") else v
        return v.to(device).requires_grad_()

    t = {n: cut(n, v) for n, v in t.items()}
    c = dict(c, lengths=None, reverse=False, resets=c["resets"][:T, :B].contiguous().to(device),
             zoneout=c["zoneout"][:T, :B].contiguous().to(device))
    names = [n for n in t if t[n] is not None]
    out = [o for o in option_cases.run(backend, cell, t, c) if o is not None]
    g = generator("tiny-cot", cell, T, B, H)
    loss = sum((o * randn(g, *o.shape).to(o.device)).sum() for o in out)
    grads = torch.autograd.grad(loss, [t[n] for n in names], allow_unused=True)
    return out + [torch.zeros_like(t[n]) if gr is None else gr for n, gr in zip(names, grads)]


TINY_CASES = [("lstm_ln", 0), ("lstm", 2), ("gru_reset_before", 0)]
TINY_SIZES = [(0, 3, 4), (3, 0, 4), (2, 3, 1), (1, 1, 1)]


@pytest.mark.parametrize("cell,proj", TINY_CASES, ids=["lstm_ln", "lstm-proj2", "gru_reset_before"])
@pytest.mark.parametrize("T,B,H", TINY_SIZES)
def test_options_empty_and_tiny(cell, proj, T, B, H):
    """No steps, no sequences, one unit, with every option: the reference's
    results and gradients."""
    want = tiny_option_results("reference", cell, proj, T, B, H)
    got = tiny_option_results(EMU, cell, proj, T, B, H)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, i
        assert_close(a, b, what=f"result {i}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *LOW.values()],
                         ids=["f64", "f32", *LOW])
def test_lstm_ln_step_matches_reference(dtype):
    """The lstm_ln step (x W_ih^T, then the recurrence's kernels with T = 1) at
    a size of several row passes: float64 and float32 against the float64
    reference, the half types within the reference's own error."""
    a = option_cases.ln_step_inputs(19, 21, 140)
    want = option_cases.ln_step_results("reference", {n: v.requires_grad_() for n, v in a.items()})
    low = {n: v.detach().to(dtype).requires_grad_() for n, v in a.items()}
    got = option_cases.ln_step_results(EMU, low)
    ref_lp = option_cases.ln_step_results("reference", low) if dtype in LOW.values() else None
    for i, (r, w) in enumerate(zip(got, want)):
        assert r.dtype == dtype, i
        if ref_lp is None:
            assert_close(r, w.to(dtype), dtype=dtype, what=f"result {i}")
        else:
            assert_low_precision(r, ref_lp[i], w, what=f"result {i}")


@pytest.mark.parametrize("cell", ["lstm_ln", "lstm", "rnn_tanh"])
def test_workspace_layout_of_the_options(cell):
    """The workspace in cells.h's layout (shared by every backend): lstm_ln's
    14 blocks of H and 3 row statistics, the LSTM's zoned c, the RNN's
    candidate with zoneout; resets, a training mask, lengths in reverse."""
    t, c = option_cases.option_inputs(cell, 0, "all-lengths-reverse", T=4, B=3, H=3, key=("ws",))
    out, _, _, ws = torch.ops.rnnkern_cuda_emu.recurrence(
        cell, *(t[n] for n in option_cases.INPUTS), c["lengths"], c["reverse"], True, c["resets"],
        c["zoneout"], t["ln"])
    want_ws, want_out = option_cases.expected_workspace(cell, t, c)
    assert_close(want_out, option_cases.run("reference", cell, t, c)[0], what="this test's loop")
    assert_close(out, want_out, what="output")
    assert ws.shape == want_ws.shape and ws.dtype == torch.float64
    assert_close(ws, want_ws, what="workspace")


def test_opcheck_options():
    """opcheck of the lstm_ln step and step_backward, and of recurrence_backward
    with every option (test_options.py opchecks the forward)."""
    family = torch.ops.rnnkern_cuda_emu
    a = option_cases.ln_step_inputs(3, 5, 4)
    names = ("x", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh", "ln")
    torch.library.opcheck(family.step.default,
                          ("lstm_ln", *(a[n].clone().requires_grad_() for n in names)))
    h, c, ws = family.step("lstm_ln", *(a[n] for n in names))
    g = generator("opcheck-options")
    torch.library.opcheck(family.step_backward.default,
                          ("lstm_ln", randn(g, *h.shape), randn(g, *c.shape), a["x"], a["h"],
                           a["c"], a["w_ih"], a["w_hh"], h, ws, a["ln"]))
    for cell, proj in [("lstm_ln", 0), ("lstm", 2), ("gru", 0)]:
        t, k = option_cases.option_inputs(cell, proj, "all-lengths-reverse", T=4, H=4,
                                          key=("opcheck",))
        z = k["zoneout"].contiguous()
        out, h_n, c_n, ws = family.recurrence(cell, *(t[n] for n in option_cases.INPUTS),
                                              k["lengths"], True, True, k["resets"], z, t["ln"])
        grad_c = randn(g, *c_n.shape) if c_n.numel() else None
        torch.library.opcheck(family.recurrence_backward.default,
                              (cell, randn(g, *out.shape), randn(g, *h_n.shape), grad_c, t["h0"],
                               t["c0"], t["w_hh"], t["w_hr"], out, ws, k["lengths"], True,
                               k["resets"], z, t["ln"]))


@pytest.mark.parametrize("cell,proj", [("lstm_ln", 0), ("rnn_tanh", 0), ("lstm", 3), ("gru", 0)],
                         ids=["lstm_ln", "rnn_tanh", "lstm-proj3", "gru"])
def test_options_inference_without_workspace(cell, proj):
    """train=False (no workspace: the LSTM-LN row kernel keeps c~ and o in the
    GEMM's row instead) computes exactly what training computes."""
    t, c = option_cases.option_inputs(cell, proj, "all-lengths-reverse", key=("inference",))
    args = (cell, *(t[n] for n in option_cases.INPUTS), c["lengths"], c["reverse"])
    options = (c["resets"], c["zoneout"], t["ln"])
    trained = torch.ops.rnnkern_cuda_emu.recurrence(*args, True, *options)
    inferred = torch.ops.rnnkern_cuda_emu.recurrence(*args, False, *options)
    assert inferred[3].numel() == 0 and trained[3].numel() > 0
    for a, b in zip(inferred[:3], trained[:3]):
        assert torch.equal(a, b)

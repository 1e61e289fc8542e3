"""The C++ CPU kernels (backend="cpu") against the reference and torch.nn."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import rnnkern
from rnnkern import ops, reference
from rnnkern.modules.sequence import _RecurrentMixin
from conftest import (CELLS, assert_close, assert_half_step_within_reference_error,
                      assert_low_precision, differentiable, generator, inference_through_from_input,
                      outputs_and_grads, randn, recurrence_inputs, rnnkern_module, step_inputs,
                      torch_module)

# (cell, proj_size): every cell and GRU form, and the LSTM with a projection.
CASES = [(cell, 0) for cell in CELLS] + [("lstm", 3)]
CASE_IDS = [f"{c}-proj{p}" if p else c for c, p in CASES]


# (gradcheck of recurrence and step, opcheck, no workspace without grad, empty
# sizes: the backend contract, tests/test_backend_contract.py)


# ------------------------------------------------- CPU against reference ----

@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("H", [16, 70, 257])
@pytest.mark.parametrize("variant", ["plain", "reverse", "lengths", "lengths-reverse"])
def test_cpu_matches_reference_float64(cell, proj, H, variant):
    """Sizes that split across threads (with B = 5 the kernel gives each thread a
    slice of units), odd sizes, and every direction / length combination."""
    T, B = 9, 5
    args = recurrence_inputs(cell, T, B, H, proj=proj and H // 2 + 1, requires_grad=True,
                             key=(variant,))
    lengths = torch.tensor([9, 3, 0, 7, 1]) if "lengths" in variant else None
    reverse = "reverse" in variant
    want = outputs_and_grads("reference", cell, args, lengths, reverse, key=(cell, H, variant))
    got = outputs_and_grads("cpu", cell, args, lengths, reverse, key=(cell, H, variant))
    for name in want:
        assert_close(got[name], want[name], what=name)


@pytest.fixture
def threads():
    """Sets torch's CPU thread count for one test."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("n_threads,B", [(2, 17), (3, 26), (1, 17)])
@pytest.mark.parametrize("H", [16, 70])
@pytest.mark.parametrize("variant", ["plain", "reverse", "lengths", "lengths-reverse"])
def test_cpu_split_by_rows_matches_reference(threads, cell, proj, n_threads, B, H, variant):
    """With at least 8 batch rows per thread and a small W_hh, each thread runs
    the whole recurrence of its rows (forward and backward); uneven row counts,
    sequences ending inside one thread's rows, and the one-thread case."""
    threads(n_threads)
    T = 9
    args = recurrence_inputs(cell, T, B, H, proj=proj and H // 2 + 1, requires_grad=True,
                             key=("rows", variant, B))
    g = generator("rows-lengths", B)
    lengths = torch.randint(0, T + 1, (B,), generator=g) if "lengths" in variant else None
    reverse = "reverse" in variant
    want = outputs_and_grads("reference", cell, args, lengths, reverse, key=(cell, H, variant, B))
    got = outputs_and_grads("cpu", cell, args, lengths, reverse, key=(cell, H, variant, B))
    for name in want:
        assert_close(got[name], want[name], what=name)


@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("n_threads,T,B", [(2, 1, None), (1, 5, 2), (2, 6, 5), (2, 4, 1)],
                         ids=["one-step-unit-slices", "two-rows", "two-rows-per-thread", "one-row"])
def test_cpu_weights_read_in_place_match_reference(threads, cell, proj, n_threads, T, B):
    """Calls of one step, or of at most two rows per thread, read the per-step
    weights where they lie instead of packing them (csrc/cpu/schedule.h,
    kMaxInPlaceRows): the whole weight, each thread's rows, and, for a single
    step large enough to split by units (B chosen so), each thread's gate rows
    of its unit slice (H = 520: slices off the 16-column panels, partial tails)."""
    threads(n_threads)
    H = 520 if B is None else 37
    G = reference.gate_count(cell)
    P = H // 2 + 1 if proj else H
    if B is None:  # the smallest batch whose step splits by units on 2 threads
        B = (1 << 25) // (G * H * P) + 1
    args = recurrence_inputs(cell, T, B, H, proj=proj and P, requires_grad=True,
                             key=("in-place", T, B))
    for variant in ("plain", "lengths-reverse"):
        lengths, reverse = None, False
        if variant != "plain":
            g = generator("in-place-lengths", B)
            lengths, reverse = torch.randint(0, T + 1, (B,), generator=g), True
        want = outputs_and_grads("reference", cell, args, lengths, reverse, key=(cell, T, B, variant))
        got = outputs_and_grads("cpu", cell, args, lengths, reverse, key=(cell, T, B, variant))
        for name in want:
            assert_close(got[name], want[name], what=f"{variant} {name}")


@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("n_threads,B", [(1, 1), (1, 2), (2, 2)])
def test_streamed_matrix_vector_products_match_reference(threads, cell, proj, n_threads, B):
    """Batches of one and two rows whose per-step weight is 2 MiB or more
    (float64): gemm.h's matrix-vector products prefetch its panels there
    (kStreamedPanelBytes), streaming from L3 each step, on CPUs with 512-bit FMA
    pipes (RNNKERN_CPU_FMA_BITS=512 takes the path elsewhere); forward and
    backward, plain and reversed with lengths, against the reference."""
    threads(n_threads)
    # (the reset-before GRU's largest per-step product: its r and z rows)
    G = 2 if cell == "gru_reset_before" else reference.gate_count(cell)
    H = next(h for h in range(16, 2048) if G * h * ((h // 2 + 1) if proj else h) * 8 >= 2 << 20)
    T = 3
    args = recurrence_inputs(cell, T, B, H, proj=proj and H // 2 + 1, requires_grad=True,
                             key=("streamed", B))
    for lengths, reverse in ((None, False), (torch.tensor([2, 3][:B]), True)):
        key = (cell, B, n_threads, reverse)
        want = outputs_and_grads("reference", cell, args, lengths, reverse, key=key)
        got = outputs_and_grads("cpu", cell, args, lengths, reverse, key=key)
        for name in want:
            assert_close(got[name], want[name], what=f"reverse={reverse} {name}")


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_step_matches_reference(cell, bias):
    args = step_inputs(cell, 5, 7, 33, bias=bias, requires_grad=True)
    names = differentiable(args)
    results = []
    for backend in ("reference", "cpu"):
        h, c = ops.step(cell, *args.values(), backend=backend)
        outs = [h] if c is None else [h, c]
        g = generator("step-cotangent", cell)
        loss = sum((o * randn(g, *o.shape)).sum() for o in outs)
        results.append(outs + list(torch.autograd.grad(loss, [args[n] for n in names])))
    for got, want in zip(results[1], results[0]):
        assert_close(got, want)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("B", [1, 2, 3, 5, 6, 8, 13, 17, 33, 70])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lean_and_driver_steps_match_reference(threads, cell, B, dtype):
    """The single step's two CPU paths: the lean one (every cell without
    options, its rows split between threads) and the recurrence driver (the
    reset-before GRU), values and every gradient against the
    float64 reference.  Both products with W read in place: dot products up to 5 rows,
    W's rows broadcast from 6 (one to four vectors of rows, and past four in
    chunks: 33 and 70 rows), over 4 x 37 gate rows (whole register blocks, then
    blocks of 4 and single rows)."""
    args = step_inputs(cell, B, 11, 37, dtype=dtype, requires_grad=True, key=("lean", threads))
    ref = {k: None if v is None else v.detach().double().requires_grad_() for k, v in args.items()}
    names = differentiable(args)
    results = []
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for backend, a in (("reference", ref), ("cpu", args)):
            h, c = ops.step(cell, *a.values(), backend=backend)
            outs = [h] if c is None else [h, c]
            g = generator("lean-cotangent", cell, B)
            loss = sum((o * randn(g, *o.shape, dtype=o.dtype)).sum() for o in outs)
            results.append(outs + list(torch.autograd.grad(loss, [a[n] for n in names])))
    finally:
        torch.set_num_threads(saved)
    for got, want in zip(results[1], results[0]):
        assert_close(got, want.to(dtype), dtype=dtype)


# ------------------------------------------------------ torch.nn parity ----

TORCH_CELLS = [c for c in CELLS if c != "gru_reset_before"]


def paired_modules(cell, I, H, dtype, **kwargs):
    theirs = torch_module(cell, I, H, **kwargs).to(dtype)
    ours = rnnkern_module(cell, I, H, backend="cpu", **kwargs).to(dtype)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def random_hx(cell, B, H, dtype, g, P=None):
    h = randn(g, 1, B, P or H, dtype=dtype, scale=0.5, requires_grad=True)
    if cell != "lstm":
        return (h,)
    return (h, randn(g, 1, B, H, dtype=dtype, scale=0.5, requires_grad=True))


@pytest.mark.parametrize("cell", TORCH_CELLS)
@pytest.mark.parametrize("H", [24, 256])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_torch_nn_float32(cell, H, bias):
    """Outputs, final states and every gradient (input, h0, c0, all weights) of
    the CPU kernels against torch.nn with the same weights, float32."""
    T, B, I = 20, 6, 10
    torch.manual_seed(H)
    theirs, ours = paired_modules(cell, I, H, torch.float32, bias=bias)
    g = generator("nn-parity", cell, H, bias)
    x = randn(g, T, B, I, dtype=torch.float32, requires_grad=True)
    hx = random_hx(cell, B, H, torch.float32, g)
    arg = hx if cell == "lstm" else hx[0]
    out_t, hid_t = theirs(x, arg)
    out_o, hid_o = ours(x, arg)
    hid_t = hid_t if isinstance(hid_t, tuple) else (hid_t,)
    hid_o = hid_o if isinstance(hid_o, tuple) else (hid_o,)
    g2 = generator("nn-parity-cotangent", cell, H)
    cot = [randn(g2, *t.shape, dtype=torch.float32) for t in (out_t, *hid_t)]
    inputs_t = [x, *hx, *theirs.parameters()]
    inputs_o = [x, *hx, *ours.parameters()]
    grads_t = torch.autograd.grad(sum((t * c).sum() for t, c in zip((out_t, *hid_t), cot)), inputs_t)
    grads_o = torch.autograd.grad(sum((t * c).sum() for t, c in zip((out_o, *hid_o), cot)), inputs_o)
    names = ["output"] + [f"hidden{i}" for i in range(len(hid_t))]
    for name, a, b in zip(names, (out_o, *hid_o), (out_t, *hid_t)):
        assert_close(a, b, what=name)
    param_names = ["input", *[f"hx{i}" for i in range(len(hx))], *[n for n, _ in theirs.named_parameters()]]
    for name, a, b in zip(param_names, grads_o, grads_t):
        assert_close(a, b, what=f"grad {name}")


def test_float32_gate_functions_within_their_bounds():
    """The CPU's float32 tanh and logistic functions (csrc/host_math.h) over a
    sweep of pre-activations, read off one step with W_hh = 0: the tanh RNN's
    h is tanh(x), and a GRU's with x_n = 0 and h0 = 1 is its update gate z =
    sigmoid(x_z).  Within the bounds host_math.h states (tanh 3.5e-7, logistic
    2.2e-7, absolute), saturating at +-inf, 0 and 1/2 exact at 0, NaN kept."""
    x = torch.cat([torch.linspace(-40, 40, 200_001),
                   torch.tensor([float("inf"), float("-inf"), 0.0, float("nan")])])
    H = 5
    B = x.numel() // H
    pre = x.view(B, H)
    finite = torch.isfinite(x)
    zeros = torch.zeros(B, H)
    h = ops.recurrence("rnn_tanh", pre.unsqueeze(0).clone(), zeros.clone(), None, torch.zeros(H, H),
                       backend="cpu")[0][0].reshape(-1)
    assert (h[finite].double() - torch.tanh(x[finite].double())).abs().max() <= 3.5e-7
    assert h[-4:-1].tolist() == [1.0, -1.0, 0.0] and torch.isnan(h[-1])
    xproj = torch.cat([torch.randn(B, H, generator=generator("gate-bounds")), pre, zeros], 1).unsqueeze(0)
    z = ops.recurrence("gru", xproj, torch.ones(B, H), None, torch.zeros(3 * H, H),
                       backend="cpu")[0][0].reshape(-1)
    assert (z[finite].double() - torch.sigmoid(x[finite].double())).abs().max() <= 2.2e-7
    assert z[-4:-1].tolist() == [1.0, 0.0, 0.5] and torch.isnan(z[-1])
    # The bound is absolute: the smallest values come out 0 (host_math.h), but only there.
    assert (z[finite] >= 0).all() and (z[finite] <= 1).all() and (z[x > -15.7] > 0).all()


@pytest.mark.parametrize("cell", CELLS)
def test_bfloat16_within_reference_error(cell):
    """bfloat16 results against the float32 reference on the same (bf16-valued)
    inputs: no worse than twice the reference's own bfloat16 error (outputs,
    states, gradients)."""
    T, B, H = 16, 4, 64
    args = recurrence_inputs(cell, T, B, H, dtype=torch.bfloat16, key=("bf16",))
    args16 = {k: None if v is None else v.requires_grad_() for k, v in args.items()}
    args32 = {k: None if v is None else v.detach().float().requires_grad_() for k, v in args.items()}
    key = ("bf16-cot", cell)
    want = outputs_and_grads("reference", cell, args32, key=key)
    ref16 = outputs_and_grads("reference", cell, args16, key=key)
    got = outputs_and_grads("cpu", cell, args16, key=key)
    for name in want:
        assert got[name].dtype == torch.bfloat16, name
        assert_low_precision(got[name], ref16[name], want[name], what=name)


@pytest.mark.parametrize("cell,B,I,H", [("rnn_tanh", 1, 8, 8), ("lstm", 1, 48, 40), ("gru", 5, 33, 60),
                                        ("rnn_relu", 32, 64, 48), ("lstm", 1, 48, 80), ("gru", 16, 33, 110)])
def test_float16_step_within_reference_error(cell, B, I, H):
    """One float16 step (the cells' op): up to 2^15 weight values (the first four)
    the lean step on values widened to float32, results rounded to float16 as
    c10 rounds; above, the driver on pooled float32 conversions.  h_new, c_new
    and every gradient within twice the reference's own float16 error."""
    assert_half_step_within_reference_error(cell, B, I, H, torch.float16, key=("f16-step",))


def half_weight(g, *shape):
    """float16 weights with every tenth value a subnormal (below 2^-14)."""
    w = randn(g, *shape, scale=0.2)
    tiny = torch.randint(-1023, 1024, shape, generator=g).float() * 2.0 ** -24
    return torch.where(torch.rand(shape, generator=g) < 0.1, tiny, w).half()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("B", [1, 2, 4])
def test_float16_step_is_the_float32_step_on_its_values(threads, cell, B):
    """A float16 step too large for the lean one, at a batch the dot products
    take: W_ih and W_hh read as float16 and converted as the products load
    them (gemm::multiply_nt_half, on CPUs with F16C), exactly: the bits
    of the float32 step on the same float16 values, rounded to float16 (h_new,
    c_new), subnormal weights included, at 1 and 2 threads.  And
    rnnkern.linear with a float16 weight whose rows lie apart."""
    I, H = 48, 160  # G*H*(I + H) > 2^15: the driver, not the lean step
    G = {"lstm": 4, "gru": 3, "gru_reset_before": 3}.get(cell, 1)
    g = generator("f16-in-place", cell, B)
    x, h, c = (randn(g, B, n, scale=0.5).half() for n in (I, H, H))
    c = c if cell == "lstm" else None
    w_ih, w_hh = half_weight(g, G * H, I), half_weight(g, G * H, H)
    b_ih, b_hh = (randn(g, G * H, scale=0.1).half() for _ in range(2))
    args16 = (x, h, c, w_ih, w_hh, b_ih, b_hh)
    args32 = tuple(None if t is None else t.float() for t in args16)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            got = ops.step(cell, *args16, backend="cpu")
            want = ops.step(cell, *args32, backend="cpu")
            wide = torch.zeros(G * H, I + 9, dtype=torch.float16)
            w_apart = wide[:, 3:3 + I].copy_(w_ih)  # rows I + 9 values apart
            assert w_apart.stride() == (I + 9, 1)
            y16 = torch.ops.rnnkern.linear(x, w_apart)
            y32 = torch.ops.rnnkern.linear(x.float(), w_ih.float())
    finally:
        torch.set_num_threads(saved)
    for name, a, b in (("h_new", got[0], want[0]), ("c_new", got[1], want[1]), ("x W_ih^T", y16, y32)):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == torch.float16, name
        assert torch.equal(a, b.half()), f"{name}: {(a.float() - b.half().float()).abs().max().item()}"


# ------------------------------------------ input projection (linear op) ----

@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (7, 5, 3), (70, 33, 129), (600, 300, 40), (3001, 203, 7),
                                   (9001, 61, 37), (200, 640, 1100)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_linear_matches_matmul(M, K, N, dtype):
    """The CPU backend's own GEMM: tails in every dimension, K split into chunks;
    B packed whole, and (grad_w of the last two sizes: K = 3001 rows of a
    203-wide x, 9001 of a 61-wide one, over 2 MiB) chunk by chunk; A read where
    it lies (row-major: y, grad_x) and, for grad_w's transposed A, packed (203
    columns: 13 panels of B of 256-bit vectors) or read where it lies (61: 4
    panels; with 512-bit vectors 2 panels, packed in micro-panels of 8 rows,
    and 37 rows of grad_w leave a tail of 5)."""
    g = generator("linear", M, K, N, str(dtype))
    x, w, gy = randn(g, M, K, dtype=dtype), randn(g, N, K, dtype=dtype), randn(g, M, N, dtype=dtype)
    assert_close(torch.ops.rnnkern.linear(x, w), x.double().mm(w.double().t()).to(dtype), what="y")
    gx, gw = torch.ops.rnnkern.linear_backward(gy, x, w, True, True)
    assert_close(gx, gy.double().mm(w.double()).to(dtype), what="grad_x")
    assert_close(gw, gy.double().t().mm(x.double()).to(dtype), what="grad_w")


@pytest.mark.parametrize("M,K,N", [(600, 300, 40), (9001, 61, 37), (4096, 128, 512), (5, 512, 1024),
                                   (8, 256, 1024), (40, 300, 517), (96, 128, 530), (200, 640, 1100)])
def test_linear_same_bits_at_1_2_and_3_threads(M, K, N):
    """rnnkern::linear and its gradients split rows of C between threads (up
    to 96 rows, B's panels: the last four sizes, K in two chunks and tail
    panels among them) and pick packed or in-place operands by shape alone:
    every thread count gives the same bits, and they are the product's."""
    g = generator("linear-bits", M, K, N)
    x, w, gy = randn(g, M, K), randn(g, N, K), randn(g, M, N)

    def run():
        return [torch.ops.rnnkern.linear(x, w), *torch.ops.rnnkern.linear_backward(gy, x, w, True, True)]

    want = _results_at(1, lambda: None, lambda _: run())
    truth = [x.double().mm(w.double().t()), gy.double().mm(w.double()), gy.double().t().mm(x.double())]
    for name, a, b in zip(("y", "grad_x", "grad_w"), want, truth):
        assert_close(a, b, what=name)
    for threads in (2, 3):
        got = _results_at(threads, lambda: None, lambda _: run())
        for name, a, b in zip(("y", "grad_x", "grad_w"), got, want):
            assert torch.equal(a, b), f"{name} differs at {threads} threads"


@pytest.mark.parametrize("n_threads", [1, 2])
def test_linear_whole_or_chunked_b_same_bits(threads, n_threads):
    """A row-major A's product packs B whole up to 16 MiB (y = x W^T, dX = dY
    W; linear.cpp, kWholeBBytesRowMajorA) and chunk by chunk past it: W of
    2100 x 2048 (17 MB) takes the chunks, its first 512 rows (4 MB) the whole
    B, and each column of y is the same bits either way."""
    threads(n_threads)
    g = generator("linear-whole-b")
    x, w = randn(g, 40, 2048, dtype=torch.float32), randn(g, 2100, 2048, dtype=torch.float32)
    full = torch.ops.rnnkern.linear(x, w)
    part = torch.ops.rnnkern.linear(x, w[:512])
    assert_close(full, x.double().mm(w.double().t()).float(), what="y")
    assert torch.equal(full[:, :512], part)


@pytest.mark.parametrize("K", [61, 130])
def test_linear_weight_gradient_of_a_large_dy_is_its_slices_bit_for_bit(K):
    """grad_w = dY^T X takes another order through memory for a dY over 2 MiB
    on 256-bit vectors (chunk of K by chunk, dY^T packed at any panel count)
    than for a small one (block of rows by block over all of K, read where it
    lies at 4 panels of 256-bit vectors, packed at 512 bits: K = 61): row n of
    grad_w is the same bits from the whole dY (9.8 MB) as from its first 24
    columns alone (0.8 MB)."""
    g = generator("linear-large-dy", K)
    x, w, gy = randn(g, 8192, K), randn(g, 300, K), randn(g, 8192, 300)
    whole = torch.ops.rnnkern.linear_backward(gy, x, w, False, True)[1]
    assert_close(whole, gy.double().t().mm(x.double()), what="grad_w")
    part = torch.ops.rnnkern.linear_backward(gy[:, :24].contiguous(), x, w[:24], False, True)[1]
    assert torch.equal(whole[:24], part)


def test_linear_strided_input_and_skipped_gradients():
    g = generator("linear-strided")
    base = randn(g, 40, 30)
    x = base[::2, 1::3]  # [20, 10], both strides odd
    w = randn(g, 7, 10)
    assert_close(torch.ops.rnnkern.linear(x, w), x.mm(w.t()))
    gx, gw = torch.ops.rnnkern.linear_backward(randn(g, 20, 7), x, w, False, True)
    assert gx.numel() == 0 and gw.shape == (7, 10)


def test_linear_gradcheck_and_opcheck():
    g = generator("linear-gradcheck")
    x, w = randn(g, 9, 4, requires_grad=True), randn(g, 6, 4, requires_grad=True)
    assert torch.autograd.gradcheck(torch.ops.rnnkern.linear, (x, w))
    torch.library.opcheck(torch.ops.rnnkern.linear.default, (x, w))


def test_pooled_buffers_are_reused_and_released():
    """Large outputs come from the pool: a freed block is handed out again
    (same address), poisoning still applies, and empty_cpu_cache frees it."""
    ops.empty_cpu_cache()  # blocks of this size cached by earlier tests would serve first
    g = generator("pool")
    x, w = randn(g, 1024, 64), randn(g, 512, 64)  # a 4 MiB output
    y = torch.ops.rnnkern.linear(x, w)
    address = y.data_ptr()
    del y
    y = torch.ops.rnnkern.linear(x, w)
    assert y.data_ptr() == address
    assert_close(y, x.mm(w.t()))
    del y
    assert ops.empty_cpu_cache() >= 1024 * 512 * 8
    assert ops.empty_cpu_cache() == 0


def test_grid_zeros_clears_a_reused_block():
    """grid_zeros (a packed batch's grid): zeros of the asked size and dtype
    even from a cached block that held other values (same address: the
    block was reused, not fresh from the system)."""
    ops.empty_cpu_cache()
    g = generator("grid-zeros")
    x, w = randn(g, 1024, 64), randn(g, 512, 64)  # a 4 MiB output of nonzero values
    y = torch.ops.rnnkern.linear(x, w)
    address = y.data_ptr()
    assert (y != 0).any()
    del y
    z = torch.ops.rnnkern.grid_zeros(x, (8, 64, 1024))  # the same 4 MiB
    assert z.data_ptr() == address
    assert z.shape == (8, 64, 1024) and z.dtype == x.dtype and not z.requires_grad
    assert torch.count_nonzero(z) == 0
    small = torch.ops.rnnkern.grid_zeros(x.float(), (3, 2, 5))
    assert torch.equal(small, torch.zeros(3, 2, 5))
    torch.library.opcheck(torch.ops.rnnkern.grid_zeros.default, (x, (3, 2, 5)))
    with pytest.raises(RuntimeError, match="size must be non-negative"):
        torch.ops.rnnkern.grid_zeros(x, (3, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_relayout_copies_into_the_asked_layout_and_hands_the_gradient_back_in_the_inputs(dtype):
    """rnnkern::relayout (the dense copies of a caller's transposed tensors):
    the same values, laid out in `order`, from the buffer cache when large;
    the gradient comes back in the input's layout (a batch-first caller's
    own tensor gets a dense gradient), differentiable twice."""
    g = generator("relayout", dtype)
    base = randn(g, 6, 5, 4, dtype=dtype)  # batch-first [B, T, F]
    x = base.transpose(0, 1)                # time-major view [T, B, F]
    for order in ([0, 1, 2], [1, 0, 2], [2, 0, 1]):
        y = torch.ops.rnnkern.relayout(x, order)
        assert torch.equal(y, x) and y.dtype == dtype
        assert y.permute(order).is_contiguous(), order
    y = ops.dense(x)
    assert y.is_contiguous() and torch.equal(y, x)
    leaf = base.clone().requires_grad_()
    cot = randn(g, 5, 6, 4, dtype=dtype)
    (grad,) = torch.autograd.grad(ops.dense(leaf.transpose(0, 1)), leaf, cot)
    assert grad.is_contiguous() and torch.equal(grad, cot.transpose(0, 1))
    big = randn(g, 256, 64, 64, dtype=dtype).transpose(0, 1)  # 2-8 MiB: pooled
    ops.empty_cpu_cache()
    y = ops.dense(big)
    assert torch.equal(y, big.contiguous())
    del y
    assert ops.empty_cpu_cache() >= big.numel() * big.element_size()  # its block was cached
    if dtype == torch.float64:
        xg = x.detach().requires_grad_()
        assert torch.autograd.gradcheck(ops.dense, (xg,))
        assert torch.autograd.gradgradcheck(ops.dense, (xg,))
        torch.library.opcheck(torch.ops.rnnkern.relayout.default, (xg, [1, 0, 2]))
    for order in ([0, 1], [0, 1, 1], [0, 1, 3]):
        with pytest.raises(RuntimeError, match="order must list each of x's 3 dimensions once"):
            torch.ops.rnnkern.relayout(x, order)


def test_batch_first_input_gradient_comes_back_dense():
    """A batch-first CPU call transposes its input to time-major; the input
    projection copies it through relayout, so the input's gradient comes back
    in the input's own (dense) layout, with torch.nn's values and every
    parameter's gradient."""
    g = generator("batch-first-layout")
    theirs = torch.nn.LSTM(4, 6, batch_first=True).double()
    ours = rnnkern.LSTM(4, 6, batch_first=True, backend="cpu").double()
    ours.load_state_dict(theirs.state_dict())
    x = randn(g, 5, 7, 4).requires_grad_()
    cot = randn(g, 5, 7, 6)
    grads = [torch.autograd.grad((m(x)[0] * cot).sum(), [x, *m.parameters()]) for m in (ours, theirs)]
    assert grads[0][0].is_contiguous()
    for a, b in zip(*grads):
        assert_close(a, b)


_STALE_BLOCKS_SCRIPT = '''
import torch, rnnkern
x = torch.randn(1024, 64)
# 8 of the cache's 10 MiB in blocks of a size the program no longer uses.
held = [torch.ops.rnnkern.linear(x, torch.randn(1024, 64)) for _ in range(2)]  # 4 MiB each
del held
w = torch.randn(1536, 64)  # a 6 MiB output: cached once the older 4 MiB block goes
y = torch.ops.rnnkern.linear(x, w)
address = y.data_ptr()
del y
y = torch.ops.rnnkern.linear(x, w)
assert y.data_ptr() == address, "the new size was not cached"
torch.testing.assert_close(y, x.mm(w.t()))
del y
released = rnnkern.ops.empty_cpu_cache()
assert released == 10 << 20, released  # the 6 MiB block and the newer 4 MiB one
print("ok")
'''


def test_pooled_buffers_evict_stale_blocks():
    """A full cache frees its least recently returned blocks for new ones and
    never holds more than RNNKERN_CPU_CACHE_MB."""
    env = dict(os.environ, RNNKERN_CPU_CACHE_MB="10")
    run = subprocess.run([sys.executable, "-c", _STALE_BLOCKS_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_cpu_isa_level_is_the_expected_one():
    """The ISA level the kernels' vectorised loops run at; .ci/isa_levels.sh sets
    RNNKERN_EXPECT_CPU_ISA when it runs this file on a build pinned to a lower
    level, so that a run that silently picked up another build fails."""
    level = rnnkern._C.cpu_isa()
    assert level in ("x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4", "native")
    expected = os.environ.get("RNNKERN_EXPECT_CPU_ISA")
    if expected is not None:
        assert level == expected


def test_cpu_vector_width_follows_the_isa():
    """The products run 512-bit on CPUs with AVX-512 (x86-64-v4) unless
    RNNKERN_CPU_VECTOR_BITS=256 asks for the 256-bit kernels; 256-bit
    elsewhere and in builds pinned below v4 (.ci/isa_levels.sh)."""
    wide = rnnkern._C.cpu_isa() == "x86-64-v4" and os.environ.get("RNNKERN_CPU_VECTOR_BITS") != "256"
    assert rnnkern._C.cpu_vector_bits() == (512 if wide else 256)


_WIDTH_SCRIPT = '''
import sys, torch, rnnkern
from rnnkern import reference
torch.manual_seed(0)
worst = 0.0
for cell in ("lstm", "gru", "rnn_tanh", "gru_reset_before"):
    G = reference.gate_count(cell)
    # T = 1: W_hh read in place (dot products, or its rows broadcast from 6 rows)
    for B, T, H in ((1, 5, 70), (2, 4, 33), (3, 3, 40), (32, 3, 64), (7, 1, 37), (40, 1, 29)):
        xp = torch.randn(T, B, G * H, dtype=torch.float64, requires_grad=True)
        h0 = torch.randn(B, H, dtype=torch.float64, requires_grad=True)
        c0 = torch.randn(B, H, dtype=torch.float64, requires_grad=True) if cell == "lstm" else None
        w = (torch.randn(G * H, H, dtype=torch.float64) * H ** -0.5).requires_grad_()
        b = torch.randn(G * H, dtype=torch.float64, requires_grad=True)
        ins = [t for t in (xp, h0, c0, w, b) if t is not None]
        got, want = [], []
        for backend, sink in (("cpu", got), ("reference", want)):
            out = rnnkern.ops.recurrence(cell, xp, h0, c0, w, b, b, None, None, False, backend=backend)
            outs = [o for o in out if o is not None]
            sink += [o.detach() for o in outs]
            sink += torch.autograd.grad(sum(o.sum() for o in outs), ins)
        worst = max(worst, max(((g - r).abs().max() / (1 + r.abs().max())).item() for g, r in zip(got, want)))
    if cell == "gru_reset_before":
        continue
    for B in (5, 6, 9, 33, 70):  # the step: every form of the in-place products
        x, h = (torch.randn(B, 23, dtype=torch.float64, requires_grad=True) for _ in range(2))
        c = torch.randn(B, 23, dtype=torch.float64, requires_grad=True) if cell == "lstm" else None
        w_ih, w_hh = ((torch.randn(G * 23, 23, dtype=torch.float64) / 5).requires_grad_() for _ in range(2))
        b = torch.randn(G * 23, dtype=torch.float64, requires_grad=True)
        ins = [t for t in (x, h, c, w_ih, w_hh, b) if t is not None]
        got, want = [], []
        for backend, sink in (("cpu", got), ("reference", want)):
            outs = [o for o in rnnkern.ops.step(cell, x, h, c, w_ih, w_hh, b, b, backend=backend) if o is not None]
            sink += [o.detach() for o in outs]
            sink += torch.autograd.grad(sum((o * o).sum() for o in outs), ins)
        worst = max(worst, max(((g - r).abs().max() / (1 + r.abs().max())).item() for g, r in zip(got, want)))
print(rnnkern._C.cpu_vector_bits(), worst)
'''


@pytest.mark.parametrize("bits", ["256", "default"])
def test_both_vector_widths_match_reference(bits):
    """Both widths of the products in this build (on an AVX-512 CPU the default
    is 512-bit; RNNKERN_CPU_VECTOR_BITS=256 runs the 256-bit kernels), batch 1
    and 2 (the two-panel matrix-vector form) to 32, one-step calls of 5 to 70
    rows (W read in place), float64 values and gradients against the
    reference."""
    env = dict(os.environ)
    env.pop("RNNKERN_CPU_VECTOR_BITS", None)
    if bits == "256":
        env["RNNKERN_CPU_VECTOR_BITS"] = "256"
    run = subprocess.run([sys.executable, "-c", _WIDTH_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    width, worst = run.stdout.split()
    assert width == ("256" if bits == "256" or rnnkern._C.cpu_isa() != "x86-64-v4" else "512")
    assert float(worst) < 1e-10


_PREFETCH_SCRIPT = r'''
import hashlib, torch, rnnkern
torch.manual_seed(0)
digest = hashlib.sha256()
for name, B in (("LSTM", 32), ("GRU", 19), ("RNN", 64)):
    m = getattr(rnnkern, name)(40, 96, backend="cpu")
    x = torch.randn(9, B, 40, requires_grad=True)
    out, _ = m(x)
    grads = torch.autograd.grad((out * torch.randn_like(out)).sum(), [x, *m.parameters()])
    for t in (out, *grads):
        digest.update(t.detach().contiguous().numpy().tobytes())
print(digest.hexdigest())
'''


def test_panel_prefetch_changes_no_bits():
    """The 512-bit products prefetch their panels' rows on Intel CPUs
    (gemm::prefetches_panels; RNNKERN_CPU_PREFETCH_PANELS=0/1 overrides): a
    prefetch moves no value, so outputs and every gradient of float32 training
    calls (blocks of 3-8 rows, the weight gradients' packed products) are the
    same bits with and without it, at 1 and 2 threads."""
    digests = set()
    for prefetch in ("0", "1"):
        for threads in ("1", "2"):
            env = dict(os.environ, RNNKERN_CPU_PREFETCH_PANELS=prefetch, OMP_NUM_THREADS=threads)
            run = subprocess.run([sys.executable, "-c", _PREFETCH_SCRIPT], env=env, capture_output=True,
                                 text=True, timeout=300)
            assert run.returncode == 0, run.stderr[-3000:]
            digests.add(run.stdout.strip())
    assert len(digests) == 1, digests


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_step_products_panel_by_panel_match_reference(threads, cell, n_threads):
    """A step's product whose panels of W take 2 MB or more (gemm.h's
    kPanelOuterBytes: float64 W_hh^T of the LSTM at H = 256, 2 MB; the GRU's
    at H = 320, 2.5 MB; the tanh RNN's at H = 512, 2 MB) runs panel by panel
    through every block of rows (20 rows: 7, 7 and 6 at 512 bits), forward and
    backward (the backward's dH = dA W_hh too): outputs and
    every gradient against the reference, with lengths, the same bits at 1, 2
    and 3 threads."""
    threads(n_threads)
    H = {"lstm": 256, "gru": 320, "rnn_tanh": 512}[cell]
    T, B = 3, 20
    args = recurrence_inputs(cell, T, B, H, requires_grad=True, key=("panel-outer",))
    lengths = torch.tensor([T - b % T for b in range(B)])
    want = outputs_and_grads("reference", cell, args, lengths, key=("panel-outer", cell))
    got = outputs_and_grads("cpu", cell, args, lengths, key=("panel-outer", cell))
    for name in want:
        assert_close(got[name], want[name], what=name)
    one = _results_at(1, lambda: None,
                      lambda _: outputs_and_grads("cpu", cell, args, lengths, key=("panel-outer", cell)))
    for name in got:
        assert torch.equal(got[name], one[name]), f"{name} differs at {n_threads} threads"


# ----------------------- the step options and the LayerNorm cell ----
# tests/test_options.py holds the matrix every backend passes (small sizes,
# default threads); these reach the CPU kernels' own paths: both work splits
# on 1-3 threads, widths off the vector width, calls that keep no workspace,
# masks read through their strides, resets on every step or at a sequence's
# first step, and the lstm_ln step.

OPTION_CASES = CASES + [("lstm_ln", 0)]
OPTION_IDS = CASE_IDS + ["lstm_ln"]
OPTION_NAMES = ("xproj", "h0", "c0", "w_hh", "b_ih", "b_hh", "w_hr", "ln")
# The option matrix's runners (one copy, in test_options.py): the call, and
# outputs with every gradient under a random functional of them.
from test_options import outputs_and_grads as option_results, run as run_options  # noqa: E402


def option_inputs(cell, proj, T, B, H, variant, dtype=torch.float64, key=()):
    """Random op arguments (a dict, leaves requiring grad) and the options of
    the variant: "resets", "every-reset" (every step restarts), "state" (a
    reset state of its own: reset_h, reset_c), "zoneout" (a training mask),
    "eval" (an expanded evaluation-mode mask), "lengths", "reverse", joined by
    dashes."""
    g = generator("cpu-options", cell, proj, T, B, H, variant, str(dtype), *key)
    G = reference.gate_count(cell)
    P = proj or H
    s = H ** -0.5
    has_c = cell in ("lstm", "lstm_ln")
    args = dict(
        xproj=randn(g, T, B, G * H, dtype=dtype, requires_grad=True),
        h0=randn(g, B, P, dtype=dtype, scale=0.5, requires_grad=True),
        c0=randn(g, B, H, dtype=dtype, scale=0.5, requires_grad=True) if has_c else None,
        w_hh=randn(g, G * H, P, dtype=dtype, scale=s, requires_grad=True),
        b_ih=randn(g, G * H, dtype=dtype, scale=s, requires_grad=True),
        b_hh=randn(g, G * H, dtype=dtype, scale=s, requires_grad=True),
        w_hr=randn(g, P, H, dtype=dtype, scale=s, requires_grad=True) if proj else None,
        ln=((1 + 0.3 * randn(g, 10 * H)) * torch.cat([torch.ones(9 * H), 0.3 * torch.ones(H)]))
        .to(dtype).requires_grad_() if cell == "lstm_ln" else None,
    )
    parts = variant.split("-")
    state = "state" in parts
    args["reset_h"] = randn(g, B, P, dtype=dtype, scale=0.5, requires_grad=True) if state else None
    args["reset_c"] = (randn(g, B, H, dtype=dtype, scale=0.5, requires_grad=True)
                       if state and has_c else None)
    Z = reference.zoneout_width(cell, H, P)
    resets = zoneout = lengths = None
    if "resets" in parts:
        resets = torch.rand(T, B, generator=g) < 0.3
    if "every" in parts:
        resets = torch.ones(T, B, dtype=torch.bool)
    if "zoneout" in parts:
        zoneout = (torch.rand(T, B, Z, generator=g) < 0.4).to(dtype)
    if "eval" in parts:
        zoneout = torch.full((Z,), 0.3, dtype=dtype).expand(T, B, Z)
    if "lengths" in parts:
        lengths = torch.randint(0, T + 1, (B,), generator=g)
    return args, dict(resets=resets, zoneout=zoneout, lengths=lengths, reverse="reverse" in parts)


def assert_options_match_reference(cell, args, opts, key):
    want = option_results("reference", cell, args, opts, key=key)
    got = option_results("cpu", cell, args, opts, key=key)
    assert set(got) == set(want)
    for name in want:
        assert_close(got[name], want[name], what=name)


def forward_regions(cell, args, opts):
    """Parallel regions one inference forward opens (by rows: one for the whole
    time loop; by units: at least one per step)."""
    before = rnnkern._C.cpu_parallel_regions()
    with torch.no_grad():
        run_options("cpu", cell, args, opts)
    return rnnkern._C.cpu_parallel_regions() - before


OPTION_VARIANTS = ["resets-zoneout", "resets-eval-lengths-reverse", "every-reset-zoneout-reverse",
                   "resets-zoneout-lengths", "resets-state-zoneout-reverse"]


@pytest.mark.parametrize("cell,proj", OPTION_CASES, ids=OPTION_IDS)
@pytest.mark.parametrize("n_threads,B", [(2, 17), (3, 26), (1, 17)])
@pytest.mark.parametrize("H", [16, 70])
@pytest.mark.parametrize("variant", OPTION_VARIANTS)
def test_cpu_options_split_by_rows_match_reference(threads, cell, proj, n_threads, B, H, variant):
    """Each thread runs the whole recurrence of its rows, the options read per
    row: restarting rows and mask rows spread over uneven thread shares."""
    threads(n_threads)
    args, opts = option_inputs(cell, proj and H // 2 + 1, 9, B, H, variant, key=("rows",))
    if n_threads > 1:
        assert forward_regions(cell, args, opts) == 1  # split by rows: one meeting
    assert_options_match_reference(cell, args, opts, key=(cell, B, H, variant))


def unit_split_batch(cell, H, P):
    """The smallest batch whose step splits by units on two threads
    (csrc/cpu/schedule.h, kMinStepMacsPerWorker)."""
    G = reference.gate_count(cell)
    return (1 << 25) // (G * H * P + (H * P if P != H else 0)) + 1


@pytest.mark.parametrize("cell,proj", OPTION_CASES, ids=OPTION_IDS)
@pytest.mark.parametrize("T,variant", [(3, "resets-zoneout-lengths-reverse"),
                                       (3, "every-reset-eval"), (1, "resets-zoneout"),
                                       (3, "resets-state-zoneout-lengths")],
                         ids=["all", "every-reset-eval", "one-step", "reset-state"])
def test_cpu_options_split_by_units_match_reference(threads, cell, proj, T, variant):
    """A step large enough to split by units on two threads (H = 520: slices
    off the 16-column panels): restarting rows take their slice of h0 W_hh^T
    (with a reset state of its own: of reset_h W_hh^T, formed at step 0), the
    carries of their slices move to d_h0 (d_reset_h); lstm_ln runs its product
    by units and its layer norms over whole rows on one thread.  One step
    reads the weights in place."""
    threads(2)
    H = 520
    P = H // 2 + 1 if proj else H
    B = unit_split_batch(cell, H, P)
    args, opts = option_inputs(cell, proj and P, T, B, H, variant, key=("units",))
    assert forward_regions(cell, args, opts) >= T  # split by units: a meeting per step
    assert_options_match_reference(cell, args, opts, key=(cell, T, variant))


#: A few long sequences and many short ones, longest first (a packed batch's
#: order): 34 real positions of a 12 x 11 grid.
SKEWED_LENGTHS = [12, 7, 4, 3, 2, 2, 1, 1, 1, 1, 0]


@pytest.mark.parametrize("cell,proj", OPTION_CASES, ids=OPTION_IDS)
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("variant", ["lengths", "lengths-reverse", "resets-zoneout-lengths",
                                     "resets-eval-lengths-reverse", "resets-state-lengths"])
def test_mostly_padding_batches_match_reference_at_every_thread_count(threads, cell, proj, order, variant):
    """A grid mostly padding: each step's products skip the finished rows past
    the last running one (all of them when the rows are sorted longest first),
    and the weight gradients run over the real positions alone, gathered
    (csrc/cpu: Positions::live_rows, gathers_real_positions).  Against the
    reference in float64 with every gradient, and the same bits at 1, 2 and 3
    threads (each thread's block of rows skips its own finished rows)."""
    T, B, H = 12, len(SKEWED_LENGTHS), 16
    args, opts = option_inputs(cell, proj and 9, T, B, H, variant, key=("skewed", order))
    lengths = torch.tensor(SKEWED_LENGTHS)
    if order == "shuffled":
        lengths = lengths[torch.randperm(B, generator=generator("skewed-order", cell, variant))]
    opts["lengths"] = lengths
    assert int(lengths.sum()) * 5 < T * B * 4  # the gathered weight gradients
    key = (cell, order, variant)
    results = {}
    for n_threads in (1, 2, 3):
        threads(n_threads)
        results[n_threads] = option_results("cpu", cell, args, opts, key=key)
    want = option_results("reference", cell, args, opts, key=key)
    assert set(results[1]) == set(want)
    for name in want:
        assert_close(results[1][name], want[name], what=name)
        for n_threads in (2, 3):
            assert torch.equal(results[n_threads][name], results[1][name]), (name, n_threads)


PACKED_ROWS_ARGS = ("h0", "c0", "w_hh", "b_ih", "b_hh", "w_hr", "ln")


def packed_rows_results(backend, cell, args, lengths, reverse, layout, key):
    """Outputs and every gradient of one call whose xproj is the packed rows of
    args["xproj"]'s real positions (layout "rows": csrc/checks.h, packed_rows)
    or those rows in a zero [T, B] grid ("grid"), under one random functional
    of the output rows and final states: the same numbers either way."""
    T, B = args["xproj"].shape[:2]
    time, batch = reference.packed_positions(lengths, T, "cpu")
    rows = args["xproj"].detach()[time, batch].requires_grad_()
    xproj = rows if layout == "rows" else rows.new_zeros(args["xproj"].shape).index_put((time, batch), rows)
    rest = [args[n] for n in PACKED_ROWS_ARGS]
    out, h, c = ops.recurrence(cell, xproj, *rest[:6], lengths, reverse, backend=backend, ln=rest[6])
    out_rows = out if layout == "rows" else out[time, batch]
    g = generator("packed-rows-cotangent", *key)
    outs = [o for o in (out_rows, h, c) if o is not None]
    loss = sum((o * randn(g, *o.shape)).sum() for o in outs)
    leaves = [rows] + [t for t in rest if t is not None]
    return outs + list(torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("cell,proj", OPTION_CASES, ids=OPTION_IDS)
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_packed_rows_equal_the_grid_bit_for_bit_at_every_thread_count(threads, cell, proj, reverse):
    """xproj as the rows of a packed batch, [N, G*H] time-major with lengths
    sorted longest first (what rnnkern's modules pass for a PackedSequence on
    the CPU): the output as rows likewise, and the same bits as the [T, B]
    grid holding those rows (mostly padding: the grid's weight gradients
    gather the same rows in the same order), outputs and every gradient, at
    1, 2 and 3 threads; the reference's numbers in float64."""
    T, B, H = 12, len(SKEWED_LENGTHS), 16
    args, _ = option_inputs(cell, proj and 9, T, B, H, "plain", key=("packed-rows", reverse))
    lengths = torch.tensor(SKEWED_LENGTHS)
    key = (cell, proj, reverse)
    threads(1)
    grid = packed_rows_results("cpu", cell, args, lengths, reverse, "grid", key)
    for n_threads in (1, 2, 3):
        threads(n_threads)
        rows = packed_rows_results("cpu", cell, args, lengths, reverse, "rows", key)
        assert rows[0].shape == (sum(SKEWED_LENGTHS), 9 if proj else H)
        for i, (a, b) in enumerate(zip(rows, grid)):
            assert torch.equal(a, b), (i, n_threads)
    want = packed_rows_results("reference", cell, args, lengths, reverse, "rows", key)
    for i, (a, b) in enumerate(zip(rows, want)):
        assert_close(a, b, what=str(i))


@pytest.mark.parametrize("cell,proj", [("lstm", 0), ("lstm", 3), ("gru", 0),
                                       ("gru_reset_before", 0), ("rnn_relu", 0), ("lstm_ln", 0)],
                         ids=["lstm", "lstm_proj3", "gru", "gru_reset_before", "rnn_relu", "lstm_ln"])
def test_packed_rows_gradcheck_and_gradgradcheck(cell, proj):
    """Packed rows in float64: first derivatives from the kernels' backward,
    second ones through the reference's packed rows (rnnkern.reference)."""
    T, B, H = 4, 3, 3
    args, _ = option_inputs(cell, proj and 2, T, B, H, "plain", key=("packed-rows-gradcheck",))
    lengths = torch.tensor([4, 2, 1])
    time, batch = reference.packed_positions(lengths, T, "cpu")
    rows = args["xproj"].detach()[time, batch].requires_grad_()
    names = [n for n in PACKED_ROWS_ARGS if args[n] is not None]

    def f(rows, *tensors):
        t = dict(zip(names, tensors))
        out, h, c = ops.recurrence(cell, rows, t["h0"], t.get("c0"), t["w_hh"], t["b_ih"], t["b_hh"],
                                   t.get("w_hr"), lengths, True, backend="cpu", ln=t.get("ln"))
        return (out, h) if c is None else (out, h, c)

    inputs = (rows, *(args[n] for n in names))
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("change,words", [
    (dict(lengths=torch.tensor([2, 3, 1])), ["sorted longest first", "lengths[0] = 2 < lengths[1] = 3"]),
    (dict(lengths=torch.tensor([3, 2, 1])), ["xproj", "6 rows", "got 7"]),
    (dict(lengths=None), ["xproj", "3-D", "without lengths"]),
    (dict(resets=torch.zeros(3, 3, dtype=torch.bool)), ["resets", "3-D", "packed rows"]),
])
def test_packed_rows_reject_what_they_cannot_be(change, words):
    """Packed rows need lengths sorted longest first that sum to their count,
    and no option read per grid position."""
    args = recurrence_inputs("gru", 3, 3, 5, key=("packed-rows-errors",))
    lengths = torch.tensor([3, 3, 1])
    time, batch = reference.packed_positions(lengths, 3, "cpu")
    args["xproj"] = args["xproj"].detach()[time, batch]
    call = dict(lengths=lengths, resets=None) | change
    with pytest.raises(ValueError) as e:
        torch.ops.rnnkern.recurrence("gru", *args.values(), call["lengths"], False, False,
                                     resets=call["resets"])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("cell,proj", OPTION_CASES, ids=OPTION_IDS)
@pytest.mark.parametrize("n_threads,T,B", [(1, 5, 2), (2, 6, 5), (2, 4, 1)],
                         ids=["two-rows", "two-rows-per-thread", "one-row"])
def test_cpu_options_weights_read_in_place_match_reference(threads, cell, proj, n_threads, T, B):
    """At most two rows per thread a step: the per-step products read the
    weights where they lie (kMaxInPlaceRows), with every option."""
    threads(n_threads)
    H = 37
    args, opts = option_inputs(cell, proj and H // 2 + 1, T, B, H, "resets-zoneout-lengths-reverse",
                               key=("in-place", n_threads))
    assert_options_match_reference(cell, args, opts, key=(cell, T, B))


@pytest.mark.parametrize("cell,proj", OPTION_CASES, ids=OPTION_IDS)
@pytest.mark.parametrize("H", [37, 130])
@pytest.mark.parametrize("variant", ["resets-zoneout-lengths-reverse", "resets-eval"])
def test_cpu_options_odd_widths_match_reference(cell, proj, H, variant):
    """Widths that are not multiples of the vector width (vectorised loops
    with tails; lstm_ln's row statistics over 4H and H values)."""
    args, opts = option_inputs(cell, proj and H // 2 + 1, 7, 5, H, variant, key=("odd",))
    assert_options_match_reference(cell, args, opts, key=(cell, H, variant))


@pytest.mark.parametrize("cell,proj", OPTION_CASES, ids=OPTION_IDS)
@pytest.mark.parametrize("n_threads,B,H", [(2, 17, 16), (2, None, 520)], ids=["by-rows", "by-units"])
def test_cpu_options_inference_equals_training(threads, cell, proj, n_threads, B, H):
    """A call without gradients keeps no workspace (lstm_ln: a scratch row per
    worker instead) and computes the same numbers, bit for bit."""
    threads(n_threads)
    P = H // 2 + 1 if proj else H
    B = B or unit_split_batch(cell, H, P)
    args, opts = option_inputs(cell, proj and P, 4, B, H, "resets-zoneout-lengths", key=("infer",))
    trained = run_options("cpu", cell, args, opts)
    with torch.no_grad():
        inferred = run_options("cpu", cell, args, opts)
    for a, b in zip(trained, inferred):
        if a is not None:
            assert torch.equal(a.detach(), b)


@pytest.mark.parametrize("cell,proj", OPTION_CASES, ids=OPTION_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cpu_eval_zoneout_mask_read_through_its_strides(cell, proj, dtype):
    """An evaluation-mode mask (a [Z] vector expanded to [T, B, Z]) and its
    contiguous copy give the same results bit for bit (the kernel converts
    the one row and reads it through strides 0), as does a mask expanded
    along T only."""
    H = 12
    args, opts = option_inputs(cell, proj and 7, 5, 4, H, "resets-eval-lengths-reverse",
                               dtype=dtype, key=("strides",))
    assert opts["zoneout"].stride()[:2] == (0, 0)
    expanded = option_results("cpu", cell, args, opts, key=("strides",))
    copied = option_results("cpu", cell, args, dict(opts, zoneout=opts["zoneout"].contiguous()),
                            key=("strides",))
    for name in expanded:
        assert torch.equal(expanded[name], copied[name]), name
    g = generator("strides-rows", cell)
    Z = opts["zoneout"].shape[2]
    per_row = (torch.rand(1, 4, Z, generator=g) < 0.5).to(dtype)
    along_t = option_results("cpu", cell, args, dict(opts, zoneout=per_row.expand(5, 4, Z)),
                             key=("strides",))
    copied = option_results("cpu", cell, args,
                            dict(opts, zoneout=per_row.expand(5, 4, Z).contiguous()),
                            key=("strides",))
    for name in along_t:
        assert torch.equal(along_t[name], copied[name]), name


@pytest.mark.parametrize("cell,proj", OPTION_CASES, ids=OPTION_IDS)
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_cpu_resets_at_first_step_and_zoneout_extremes(cell, proj, reverse):
    """A reset at each sequence's first step changes nothing (values and
    gradients); a mask of ones keeps every state at h0 (c0) exactly, a mask of
    zeros is the plain recurrence exactly."""
    T, B, H = 6, 4, 9
    args, opts = option_inputs(cell, proj and 5, T, B, H, "lengths", key=("extremes", reverse))
    opts["reverse"] = reverse
    lengths = opts["lengths"]
    plain = run_options("cpu", cell, args, opts)
    resets = torch.zeros(T, B, dtype=torch.bool)
    for b in range(B):
        if lengths[b] > 0:
            resets[lengths[b] - 1 if reverse else 0, b] = True
    want = option_results("cpu", cell, args, opts, key=("extremes",))
    got = option_results("cpu", cell, args, dict(opts, resets=resets), key=("extremes",))
    for name in want:
        assert torch.equal(got[name], want[name]), name
    Z = reference.zoneout_width(cell, H, args["h0"].shape[1])
    for got, want in zip(run_options("cpu", cell, args, dict(opts, zoneout=torch.zeros(T, B, Z, dtype=torch.float64))), plain):
        if want is not None:
            assert torch.equal(got, want)
    out, h_n, c_n = run_options("cpu", cell, args, dict(opts, zoneout=torch.ones(T, B, Z, dtype=torch.float64)))
    assert torch.equal(h_n, args["h0"])
    if c_n is not None:
        assert torch.equal(c_n, args["c0"])
    valid = (torch.arange(T).unsqueeze(1) < lengths).unsqueeze(2)  # [T, B, 1], by position
    torch.testing.assert_close(out, torch.where(valid, args["h0"].detach(), 0.0), rtol=0, atol=0)


@pytest.mark.parametrize("n_threads,B,I,H", [(2, 5, 7, 33), (2, None, 16, 520)],
                         ids=["by-rows", "by-units"])
def test_lstm_ln_step_matches_reference(threads, n_threads, B, I, H):
    """The lstm_ln step op (the recurrence's kernels with T = 1) at sizes that
    split by rows and by units, float64, every gradient."""
    threads(n_threads)
    B = B or unit_split_batch("lstm_ln", H, H)
    g = generator("cpu-ln-step", B, I, H)
    s = H ** -0.5
    args = dict(x=randn(g, B, I), h=randn(g, B, H, scale=0.5), c=randn(g, B, H, scale=0.5),
                w_ih=randn(g, 4 * H, I, scale=s), w_hh=randn(g, 4 * H, H, scale=s),
                b_ih=randn(g, 4 * H, scale=s), b_hh=randn(g, 4 * H, scale=s),
                ln=1 + 0.3 * randn(g, 10 * H))
    args = {k: v.requires_grad_() for k, v in args.items()}
    results = []
    for backend in ("reference", "cpu"):
        h, c = ops.step("lstm_ln", *list(args.values())[:7], backend=backend, ln=args["ln"])
        gc = generator("cpu-ln-step-cotangent", B, H)
        loss = (h * randn(gc, *h.shape)).sum() + (c * randn(gc, *c.shape)).sum()
        results.append([h, c, *torch.autograd.grad(loss, list(args.values()))])
    for name, got, want in zip(["h", "c", *args], results[1], results[0]):
        assert_close(got, want, what=name)


# ------------------------------------------------ bits across thread counts ----

def _results_at(threads, make, run):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run(make())
    finally:
        torch.set_num_threads(saved)


# (name, kwargs, T): the cells, and sequences of 3 steps and of one (a one-step
# call the modules' one-step path does not take -- layers, both directions, a
# projection, GRU(reset_after=False) -- runs the sequence driver with its
# weights read in place).
BITS_CASES = [("RNNCell", {}, 1), ("RNNCell", {"nonlinearity": "relu"}, 1), ("GRUCell", {}, 1),
              ("GRUCell", {"reset_after": False}, 1), ("LSTMCell", {}, 1),
              ("LSTM", {}, 3), ("GRU", {"num_layers": 2}, 3), ("RNN", {"bidirectional": True}, 3),
              ("LSTM", {"proj_size": 64}, 3), ("LSTM", {"proj_size": 64, "num_layers": 2}, 1),
              ("GRU", {"reset_after": False, "num_layers": 2}, 1), ("RNN", {"bidirectional": True}, 1)]


@pytest.mark.parametrize("name,kwargs,T", BITS_CASES,
                         ids=["rnn_tanh", "rnn_relu", "gru", "gru_reset_before", "lstm",
                              "LSTM-seq", "GRU-seq-2layers", "RNN-seq-bidir", "LSTM-proj-seq",
                              "LSTM-proj-2layers-T1", "GRU-reset-before-2layers-T1", "RNN-bidir-T1"])
@pytest.mark.parametrize("B,H", [(1, 128), (8, 512), (32, 256), (64, 128), (5, 512), (17, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_same_bits_at_1_2_and_3_threads(name, kwargs, T, B, H, dtype):
    """Outputs and every gradient are bitwise the same at 1, 2 and 3 threads
    (torch.nn's cells are): the CPU kernels split work between threads without
    changing any sum's order, and which path a call takes does not depend on
    the thread count.  The one-step sizes cover both products of W read in
    place (dot products under 6 rows, W's rows broadcast from 6) and splits of
    the rows that cross that line (B = 8 in blocks of 4, B = 17 in 5, 6, 6)."""
    cell = name.endswith("Cell")

    def make():
        torch.manual_seed(H + B)
        m = getattr(rnnkern, name)(H, H, backend="cpu", dtype=dtype, **kwargs)
        g = generator("bits", name, B, H)
        x = randn(g, *((B, H) if cell else (T, B, H)), dtype=dtype, requires_grad=True)
        return m, x

    def run(made):
        m, x = made
        out = m(x)
        outs = [o for o in torch.utils._pytree.tree_leaves(out)]
        g = generator("bits-cotangent", name, B, H)
        loss = sum((o * randn(g, *o.shape, dtype=o.dtype)).sum() for o in outs)
        return outs + list(torch.autograd.grad(loss, [x, *m.parameters()]))

    want = _results_at(1, make, run)
    for threads in (2, 3):
        got = _results_at(threads, make, run)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"{name} B={B} H={H}: result {i} differs at {threads} threads"


# (module, kwargs, H): steps large enough that two and three threads split each
# by units (W_hh past 2 MiB, at least 16M multiply-adds a worker at B = 48).
UNITS_BITS_CASES = [("LSTM", {}, 512), ("GRU", {}, 640), ("GRU", {"reset_after": False}, 640),
                    ("RNN", {}, 1024), ("LSTM", {"proj_size": 64}, 512)]


@pytest.mark.parametrize("name,kwargs,H", UNITS_BITS_CASES,
                         ids=["lstm", "gru", "gru-reset-before", "rnn", "lstm-proj"])
@pytest.mark.parametrize("lengths", [False, True], ids=["dense", "lengths"])
def test_split_by_units_same_bits_at_1_2_and_3_threads(name, kwargs, H, lengths):
    """Split by units each worker owns a slice of the units of every row and
    the threads meet at every phase of every step; outputs and every gradient
    (the bias gradients' per-row sums among them, summed in the steps by
    whichever worker owns the units) are bitwise those of one thread.  The
    parallel regions counted show the split: some per step."""
    T, B, I = 4, 48, 32

    def make():
        torch.manual_seed(H)
        m = getattr(rnnkern, name)(I, H, backend="cpu", **kwargs)
        g = generator("units-bits", name, H)
        x = randn(g, T, B, I, dtype=torch.float32, requires_grad=True)
        n = torch.tensor([T - (b % T) for b in range(B)]) if lengths else None
        return m, x, n

    def run(made):
        m, x, n = made
        out, hidden = m(x, lengths=n) if n is not None else m(x)
        outs = [out, *torch.utils._pytree.tree_leaves(hidden)]
        g = generator("units-bits-cotangent", name, H)
        loss = sum((o * randn(g, *o.shape, dtype=o.dtype)).sum() for o in outs)
        return outs + list(torch.autograd.grad(loss, [x, *m.parameters()]))

    want = _results_at(1, make, run)
    for threads in (2, 3):
        before = rnnkern._C.cpu_parallel_regions()
        got = _results_at(threads, make, run)
        regions = rnnkern._C.cpu_parallel_regions() - before
        assert regions >= 2 * T, f"{regions} parallel regions at {threads} threads: not split by units"
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"{name} H={H}: result {i} differs at {threads} threads"


# ------------------------------------- a bidirectional layer's directions at once ----

# (module, kwargs, forward kwargs): bidirectional two-layer modules whose
# directions run at once in inference (ops.run_concurrently), with the options
# that reach the recurrence through other paths: variable lengths (packed rows),
# resets with a reset state, zoneout's expectation, a projection, LayerNorm.
AT_ONCE_CASES = [("LSTM", {}, {}), ("GRU", {}, {}), ("GRU", {"reset_after": False}, {}),
                 ("RNN", {"nonlinearity": "relu"}, {}), ("LSTM", {"proj_size": 48}, {}),
                 ("LayerNormLSTM", {}, {}), ("LSTM", {"zoneout": 0.3}, {}),
                 ("GRU", {}, {"lengths": True}), ("LSTM", {}, {"resets": True})]


def _at_once_run(name, kwargs, fwd, B, H, dtype, grad=False):
    T = 300  # work enough per direction (ops.CONCURRENT_MIN_MACS)
    torch.manual_seed(B + H)
    m = getattr(rnnkern, name)(H, H, num_layers=2, bidirectional=True, backend="cpu", dtype=dtype,
                               **kwargs).eval()
    g = generator("at-once", name, repr(kwargs), B, H)
    x = randn(g, T, B, H, dtype=dtype, requires_grad=grad)
    call = {}
    if fwd.get("lengths"):
        call["lengths"] = torch.tensor([T] + [max(1, T - 7 * b) for b in range(1, B)])
    if fwd.get("resets"):
        call["resets"] = torch.rand(T, B, generator=g) < 0.1
        P = kwargs.get("proj_size") or H
        call["reset_state"] = (randn(g, 4, B, P, dtype=dtype), randn(g, 4, B, H, dtype=dtype))
    out = m(x, **call)
    return [o.detach() for o in torch.utils._pytree.tree_leaves(out)]


@pytest.mark.parametrize("name,kwargs,fwd", AT_ONCE_CASES,
                         ids=["lstm", "gru", "gru_reset_before", "rnn_relu", "lstm-proj", "lstm_ln",
                              "lstm-zoneout", "gru-lengths", "lstm-resets"])
@pytest.mark.parametrize("B,H", [(1, 128), (3, 96)])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_directions_at_once_give_the_bits_of_one_after_the_other(monkeypatch, name, kwargs, fwd, B, H,
                                                                 mode):
    """In inference on two threads or more, a bidirectional layer runs its two
    directions at once (each on one thread); the outputs and states are the
    bits of running them one after the other, and of one thread."""
    calls = []
    run_concurrently = ops.run_concurrently

    def spy(a, b):
        calls.append(1)
        return run_concurrently(a, b)

    monkeypatch.setattr(ops, "run_concurrently", spy)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with context():
        want = _results_at(1, lambda: None, lambda _: _at_once_run(name, kwargs, fwd, B, H, torch.float32))
        assert not calls, "one thread: the directions run one after the other"
        for threads in (2, 3):
            got = _results_at(threads, lambda: None,
                              lambda _: _at_once_run(name, kwargs, fwd, B, H, torch.float32))
            assert len(calls) == 2, f"{threads} threads: both layers' directions at once, got {len(calls)}"
            calls.clear()
            for i, (a, b) in enumerate(zip(got, want)):
                assert torch.equal(a, b), f"{name} {kwargs} {fwd}: result {i} differs at {threads} threads"
        monkeypatch.setattr(_RecurrentMixin, "_directions_at_once", lambda *args: False)
        got = _results_at(2, lambda: None, lambda _: _at_once_run(name, kwargs, fwd, B, H, torch.float32))
        assert not calls
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_directions_at_once_float64_match_torch_nn():
    """The bidirectional layer run at once against torch.nn on the same weights, float64."""
    torch.manual_seed(0)
    ref = torch.nn.LSTM(64, 96, num_layers=2, bidirectional=True, dtype=torch.float64)
    m = rnnkern.LSTM(64, 96, num_layers=2, bidirectional=True, backend="cpu", dtype=torch.float64)
    m.load_state_dict(ref.state_dict())
    x = randn(generator("at-once-truth"), 50, 2, 64)
    h0 = randn(generator("at-once-h0"), 4, 2, 96)
    c0 = randn(generator("at-once-c0"), 4, 2, 96)
    with torch.no_grad():
        want = ref(x, (h0, c0))
        got = _results_at(2, lambda: None, lambda _: m(x, (h0, c0)))
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert_close(a, b, what="LSTM bidirectional at once")


def _at_once_train(name, kwargs, fwd, B, H, threads, hx=True, residual=False, calls=1):
    """A training step of a bidirectional two-layer module at ``threads``:
    outputs, then the gradients of the inputs, hx and every parameter.
    ``residual``: x also feeds the loss directly (three gradients meet in x);
    ``calls``: the module called on that many inputs (and the first again)."""
    T, F32 = 300, torch.float32
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(B + H)
        m = getattr(rnnkern, name)(H, H, num_layers=2, bidirectional=True, backend="cpu",
                                   **kwargs)
        g = generator("at-once-train", name, repr(kwargs), B, H)
        xs = [randn(g, T, B, H, dtype=F32, requires_grad=True) for _ in range(calls)]
        P = kwargs.get("proj_size") or H
        lstm = name in ("LSTM", "LayerNormLSTM")
        state = [randn(g, 4, B, P, dtype=F32, requires_grad=True)] + ([randn(g, 4, B, H, dtype=F32, requires_grad=True)]
                                                           if lstm else [])
        call = {}
        if fwd.get("lengths"):
            call["lengths"] = torch.tensor([T] + [max(1, T - 7 * b) for b in range(1, B)])
        if fwd.get("resets"):
            call["resets"] = torch.rand(T, B, generator=g) < 0.1
            call["reset_state"] = (randn(g, 4, B, P, dtype=F32, requires_grad=True),
                                   randn(g, 4, B, H, dtype=F32, requires_grad=True))
        loss, outs = 0, []
        for x in xs + xs[:1] if calls > 1 else xs:
            out = m(x, (tuple(state) if lstm else state[0]) if hx else None, **call)
            leaves = torch.utils._pytree.tree_leaves(out)
            outs += [o.detach() for o in leaves]
            for o in leaves:
                loss = loss + (o * randn(g, *o.shape, dtype=F32)).sum()
            if residual:
                loss = loss + (x * randn(g, *x.shape, dtype=F32)).sum()
        wrt = xs + (state if hx else []) + list(call.get("reset_state", ())) + list(m.parameters())
        return outs + list(torch.autograd.grad(loss, wrt))
    finally:
        torch.set_num_threads(saved)


@pytest.fixture
def at_once_spy(monkeypatch):
    """Counts ops.run_concurrently's calls, and the recurrences computed ahead
    that no recording call took (each would have run its kernel twice); and
    the recurrence backwards run at once (``backwards``: those kept for their
    nodes' calls) -- ``backward_untaken()``: those no node's call took since
    the last (it would have run the kernel again)."""
    seen = {"calls": 0, "untaken": 0, "backwards": 0,
            "backward_untaken": ops._C.clear_recurrence_backwards_ahead}
    run_concurrently, clear = ops.run_concurrently, ops._C.clear_recurrences_ahead
    backwards = ops.backward_recurrences_at_once

    def spy(a, b):
        seen["calls"] += 1
        return run_concurrently(a, b)

    def counted_backwards(*args):
        kept = backwards(*args)
        seen["backwards"] += kept
        return kept

    monkeypatch.setattr(ops, "backward_recurrences_at_once", counted_backwards)

    def counted_clear():
        left = clear()
        seen["untaken"] += left
        return left

    monkeypatch.setattr(ops, "run_concurrently", spy)
    monkeypatch.setattr(ops._C, "clear_recurrences_ahead", counted_clear)
    return seen


@pytest.mark.parametrize("name,kwargs,fwd", AT_ONCE_CASES,
                         ids=["lstm", "gru", "gru_reset_before", "rnn_relu", "lstm-proj", "lstm_ln",
                              "lstm-zoneout", "gru-lengths", "lstm-resets"])
@pytest.mark.parametrize("B,H", [(1, 128), (3, 96)])
def test_directions_at_once_in_training_give_the_bits_of_one_after_the_other(
        monkeypatch, at_once_spy, name, kwargs, fwd, B, H):
    """In training too a bidirectional layer runs its two directions at once
    (their kernels on two threads, their graph nodes made afterwards on the
    caller's, one direction after the other): the outputs and every gradient
    (x, hx, the reset state, each parameter) are the bits of one thread and of
    the directions run one after the other, and no direction's kernel runs
    twice.  (Zoneout's training masks are drawn on the caller's thread, layer
    by layer before the directions, from the seed each run sets.)"""
    want = _at_once_train(name, kwargs, fwd, B, H, 1)
    assert at_once_spy["calls"] == 0, "one thread: the directions run one after the other"
    assert at_once_spy["backwards"] == 0
    for threads in (2, 3):
        got = _at_once_train(name, kwargs, fwd, B, H, threads)
        assert at_once_spy["calls"] == 2, f"{threads} threads: both layers at once"
        at_once_spy["calls"] = 0
        assert at_once_spy["untaken"] == 0, "a recurrence computed ahead was computed again"
        assert at_once_spy["backwards"] == 4, f"{threads} threads: both layers' backward at once"
        at_once_spy["backwards"] = 0
        assert at_once_spy["backward_untaken"]() == 0, "a backward computed ahead ran again"
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"{name} {kwargs} {fwd}: result {i} differs at {threads} threads"
    monkeypatch.setattr(_RecurrentMixin, "_directions_at_once", lambda *args: False)
    got = _at_once_train(name, kwargs, fwd, B, H, 2)
    assert at_once_spy["calls"] == 0 and at_once_spy["backwards"] == 0
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["LSTM", "GRU"])
def test_directions_at_once_keep_the_order_of_gradients_meeting_in_a_tensor(at_once_spy, name):
    """x feeding both directions and the loss itself (three gradients summed
    in x), and the module called on three inputs and the first again (four
    into each parameter, in the order the backward reaches them): the same
    bits at 1, 2 and 3 threads.  Graph nodes made on the second thread took
    that thread's sequence numbers, which reordered the backward and changed
    x's sums."""
    want = _at_once_train(name, {}, {}, 1, 96, 1, residual=True, calls=3)
    for threads in (2, 3, 2):
        got = _at_once_train(name, {}, {}, 1, 96, threads, residual=True, calls=3)
        assert at_once_spy["calls"] == 8
        at_once_spy["calls"] = 0
        assert at_once_spy["backwards"] == 16
        at_once_spy["backwards"] = 0
        assert at_once_spy["backward_untaken"]() == 0
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"{name}: result {i} differs at {threads} threads"


def test_directions_at_once_under_checkpoint_and_saved_tensor_hooks(at_once_spy):
    """Saved-tensor hooks see what the layer saves on the caller's thread, in
    the order of one direction after the other: torch.utils.checkpoint (which
    pairs what it saved with what it recomputes by that order) gives the
    gradients of the plain call, bit for bit, with the directions at once in
    the forward and in its recomputation."""
    torch.manual_seed(0)
    m = rnnkern.LSTM(64, 64, num_layers=2, bidirectional=True, backend="cpu")
    g, F32 = generator("at-once-checkpoint"), torch.float32
    x = randn(g, 300, 2, 64, dtype=F32, requires_grad=True)
    cot = randn(g, 300, 2, 128, dtype=F32)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = torch.autograd.grad((m(x)[0] * cot).sum(), [x, *m.parameters()])
        assert at_once_spy["calls"] == 2 and at_once_spy["backwards"] == 4
        at_once_spy["backwards"] = 0
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            got = torch.autograd.grad((m(x)[0] * cot).sum(), [x, *m.parameters()])
        assert packed, "the hooks saw the layer's saved tensors"
        assert at_once_spy["backwards"] == 0, "unpack hooks run on the engine's thread: no backward at once"
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        at_once_spy["calls"] = 0
        out = torch.utils.checkpoint.checkpoint(lambda t: m(t)[0], x, use_reentrant=False)
        got = torch.autograd.grad((out * cot).sum(), [x, *m.parameters()])
        assert at_once_spy["calls"] == 4, "forward and recomputation, both layers"
        assert at_once_spy["untaken"] == 0
        assert at_once_spy["backwards"] == 0
        assert at_once_spy["backward_untaken"]() == 0
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    finally:
        torch.set_num_threads(saved)


def _recurrence_nodes(tensor):
    """The recurrence nodes of ``tensor``'s graph, in the order their
    gradients are reached from it (the last layer's first)."""
    found, seen, stack = [], set(), [tensor.grad_fn]
    while stack:
        node = stack.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        if "RecurrenceFunction" in node.name():
            found.append(node)
        stack += [f for f, _ in node.next_functions]
    return found


def _on_bidirectional(threads, name, key, run, T=300):
    """``run(m, x, g)`` at ``threads`` on a fresh bidirectional two-layer
    module (64 features) and x [T, 2, 64] drawn from ``generator(*key)``, g."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        m = getattr(rnnkern, name)(64, 64, num_layers=2, bidirectional=True, backend="cpu")
        g = generator(*key)
        x = randn(g, T, 2, 64, dtype=torch.float32, requires_grad=True)
        return run(m, x, g)
    finally:
        torch.set_num_threads(saved)


def _bidirectional_grads(threads, wrt, hook=None, create_graph=False, T=300):
    """A bidirectional two-layer LSTM's output and the gradients of a loss
    with respect to ``wrt(module, x)`` at ``threads``; ``hook(nodes)`` may
    register hooks on the recurrence nodes first."""
    def run(m, x, g):
        out, (h, c) = m(x)
        if hook is not None:
            hook(_recurrence_nodes(out))
        loss = (out * randn(g, *out.shape, dtype=torch.float32)).sum() + (h * h).sum() + c.sum()
        return [out.detach(), *torch.autograd.grad(loss, wrt(m, x), create_graph=create_graph)]

    return _on_bidirectional(threads, "LSTM", ("backwards-at-once", T), run, T)


def test_backwards_at_once_leave_changed_gradients_to_the_node(at_once_spy):
    """A hook on a recurrence node that changes the gradients it receives
    after the layer's backwards ran at once: that node's call finds its
    result computed for other gradients and runs the kernel on its own; the
    results are those of one thread."""
    def double_first_layer(nodes):
        nodes[-1].register_prehook(lambda grads: tuple(None if v is None else 2 * v for v in grads))

    def params(m, x):
        return [x, *m.parameters()]

    want = _bidirectional_grads(1, params, double_first_layer)
    got = _bidirectional_grads(2, params, double_first_layer)
    assert at_once_spy["backwards"] == 4
    assert at_once_spy["backward_untaken"]() == 1, "the hooked node ran its kernel again"
    plain = _bidirectional_grads(1, params)
    assert not torch.equal(plain[1], want[1]), "the hook changed x's gradient"
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"result {i}"


def test_backwards_at_once_only_where_the_engine_runs_both_nodes(at_once_spy):
    """torch.autograd.grad with inputs that one direction's node does not
    reach (the second layer's reverse weights alone): no backward runs ahead,
    the gradients are one thread's."""
    def reverse_weights(m, x):
        return [m.weight_hh_l1_reverse, m.weight_ih_l1_reverse]

    want = _bidirectional_grads(1, reverse_weights)
    got = _bidirectional_grads(2, reverse_weights)
    assert at_once_spy["calls"] == 2, "the forward at once"
    assert at_once_spy["backwards"] == 0
    assert at_once_spy["backward_untaken"]() == 0
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_backwards_at_once_not_with_create_graph(at_once_spy):
    """create_graph=True (the nodes record the graph of their gradients): the
    nodes run one after the other; first and second derivatives are one
    thread's."""
    def x_and_weights(m, x):
        return [x, m.weight_hh_l0, m.weight_hh_l1_reverse]

    results = []
    for threads in (1, 2):
        first = _bidirectional_grads(threads, x_and_weights, create_graph=True, T=128)
        second = torch.autograd.grad(sum((v * v).sum() for v in first[1:]), [first[1]])
        results.append([v.detach() for v in first] + list(second))
    assert at_once_spy["calls"] == 2 and at_once_spy["backwards"] == 0
    for a, b in zip(*results):
        assert_close(a, b, what="create_graph at one and two threads")


def _grads_after_backward(threads, name, seed, backward):
    """x.grad and every parameter's .grad after ``backward(m, x, g)`` on a
    bidirectional two-layer module at ``threads`` (g: the case's generator)."""
    def run(m, x, g):
        backward(m, x, g)
        return [x.grad, *(p.grad for p in m.parameters())]

    return _on_bidirectional(threads, name, (seed,), run)


def test_backwards_at_once_with_retain_graph(at_once_spy):
    """backward twice through a retained graph, the gradients accumulating:
    each backward runs the layers' backwards at once again, and the sums are
    one thread's."""
    def twice(m, x, g):
        out, h = m(x)
        loss = (out * randn(g, *out.shape, dtype=torch.float32)).sum() + (h * h).sum()
        loss.backward(retain_graph=True)
        loss.backward()

    want, got = (_grads_after_backward(t, "GRU", "backwards-at-once-retain", twice) for t in (1, 2))
    assert at_once_spy["backwards"] == 8, "both layers, both backwards, at two threads"
    assert at_once_spy["backward_untaken"]() == 0
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_backwards_at_once_under_reentrant_checkpoint(at_once_spy):
    """torch.utils.checkpoint with use_reentrant=True: its forward runs
    without a graph; its backward recomputes the layers with one and runs a
    nested backward on the engine's thread, where the layers' backwards run at
    once; the gradients are one thread's."""
    def checkpointed(m, x, g):
        out = torch.utils.checkpoint.checkpoint(lambda t: m(t)[0], x, use_reentrant=True)
        (out * randn(g, *out.shape, dtype=torch.float32)).sum().backward()

    want, got = (_grads_after_backward(t, "LSTM", "backwards-at-once-reentrant", checkpointed)
                 for t in (1, 2))
    assert at_once_spy["backwards"] == 4, "the recomputed layers, at two threads"
    assert at_once_spy["backward_untaken"]() == 0
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("edit", ["twice", "in_place"])
def test_backwards_at_once_raise_torch_errors(at_once_spy, edit):
    """A second backward through a freed graph, or a saved weight edited in
    place after the forward: torch's error, raised by the node's own call as
    with one thread (the backwards at once ran into it and kept nothing)."""
    torch.manual_seed(0)
    m = rnnkern.LSTM(64, 64, num_layers=2, bidirectional=True, backend="cpu")
    x = randn(generator("backwards-at-once-errors"), 300, 2, 64, dtype=torch.float32,
              requires_grad=True)
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            loss = m(x)[0].sum()
            if edit == "twice":
                loss.backward()
                with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                    loss.backward()
            else:
                with torch.no_grad():
                    m.weight_hh_l1.mul_(1.5)
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    loss.backward()
        # twice: both layers' the first time, none the second; in place: the
        # edited weight's direction keeps nothing, the other direction's result
        # is taken by its node (the engine calls it first) before the error.
        assert at_once_spy["backwards"] == (4 if edit == "twice" else 1)
        assert at_once_spy["backward_untaken"]() == 0
    finally:
        torch.set_num_threads(saved)


def test_directions_run_one_after_the_other_under_a_dispatch_mode(monkeypatch):
    """Under a dispatch mode (which would see the two directions' ops
    interleaved), or on one thread, the directions run one after the other;
    with or without a graph otherwise at once."""
    calls = []
    monkeypatch.setattr(ops, "run_concurrently", lambda a, b: calls.append(1) or (a(), b()))
    torch.manual_seed(0)
    m = rnnkern.GRU(128, 128, num_layers=2, bidirectional=True, backend="cpu")
    x = torch.randn(100, 1, 128)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, h = m(x.requires_grad_())
        out.sum().backward()
        assert len(calls) == 2, "a graph: the kernels at once, the nodes made after"
        calls.clear()
        with torch.no_grad():
            m(x)
        assert len(calls) == 2
        calls.clear()
        from torch.utils._python_dispatch import TorchDispatchMode

        class Passthrough(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        with torch.no_grad(), Passthrough():
            m(x)
        assert not calls
        torch.set_num_threads(1)
        m(x)
        assert not calls
    finally:
        torch.set_num_threads(saved)


def test_run_concurrently_results_errors_and_thread_state():
    """(a(), b()) in order; b sees the caller's grad and inference mode; an error
    of either is raised once both have finished, a's first."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert ops.run_concurrently(lambda: 1, lambda: 2) == (1, 2)
        with torch.no_grad():
            assert ops.run_concurrently(torch.is_grad_enabled, torch.is_grad_enabled) == (False, False)
        assert ops.run_concurrently(torch.is_grad_enabled, torch.is_grad_enabled) == (True, True)
        with torch.inference_mode():
            modes = ops.run_concurrently(torch.is_inference_mode_enabled, torch.is_inference_mode_enabled)
        assert modes == (True, True)
        finished = []

        def fail(what):
            def f():
                finished.append(what)
                raise ValueError(what)
            return f

        with pytest.raises(ValueError, match="^b$"):
            ops.run_concurrently(lambda: finished.append("a"), fail("b"))
        assert sorted(finished) == ["a", "b"]
        with pytest.raises(ValueError, match="^a$"):
            ops.run_concurrently(fail("a"), fail("b"))
        with pytest.raises(TypeError, match="callables"):
            rnnkern._C.run_concurrently(1, lambda: 2)
    finally:
        torch.set_num_threads(saved)


# ------------------------------ the input projection inside the recurrence ----
# rnnkern::recurrence_from_input: at batch 1 the projection x W_ih^T goes along
# with the steps' products (csrc/cpu/forward.cpp, forward_from_input), which
# the modules run for a plain inference call of one sequence.  Its results are
# linear-then-recurrence's, bit for bit: chunks of the projection's sum
# (I > 256), a last, partial chunk of steps (T not a multiple of the tile's
# rows), panels cut short (4H not a multiple of the panel width), both
# directions.

FROM_INPUT_SIZES = [(8, 16, 16), (13, 40, 24), (64, 128, 128), (37, 300, 70), (20, 600, 33),
                    (9, 7, 3)]


def _from_input_args(cell, T, B, I, H, dtype=torch.float32, key=()):
    g = generator("from-input", cell, T, B, I, H, str(dtype), *key)
    G = reference.gate_count(cell)
    return dict(x=randn(g, T, B, I, dtype=dtype), w_ih=randn(g, G * H, I, dtype=dtype, scale=I ** -0.5),
                h0=randn(g, B, H, dtype=dtype, scale=0.5),
                c0=randn(g, B, H, dtype=dtype, scale=0.5) if cell == "lstm" else None,
                w_hh=randn(g, G * H, H, dtype=dtype, scale=H ** -0.5),
                b_ih=randn(g, G * H, dtype=dtype), b_hh=randn(g, G * H, dtype=dtype))


def _linear_then_recurrence(cell, a, reverse):
    T, B, I = a["x"].shape
    xproj = torch.ops.rnnkern.linear(a["x"].reshape(T * B, I), a["w_ih"]).view(T, B, -1)
    out, h_n, c_n, _ = torch.ops.rnnkern.recurrence(cell, xproj, a["h0"], a["c0"], a["w_hh"], a["b_ih"],
                                                    a["b_hh"], None, None, reverse, False)
    return out, h_n, c_n


def _poison_heap(*shapes):
    """Frees NaN-filled blocks of these sizes, which the next allocations may reuse:
    an output the op leaves unwritten then reads NaN rather than stale numbers."""
    for shape in shapes:
        torch.full(shape, float("nan"))


@pytest.mark.parametrize("cell", ops.FROM_INPUT_CELLS)
@pytest.mark.parametrize("T,I,H", FROM_INPUT_SIZES, ids=[f"T{t}-I{i}-H{h}" for t, i, h in FROM_INPUT_SIZES])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_recurrence_from_input_is_linear_then_recurrence_bit_for_bit(cell, T, I, H, reverse):
    a = _from_input_args(cell, T, 1, I, H)
    want = _linear_then_recurrence(cell, a, reverse)
    _poison_heap((T, 1, H), (1, H))
    got = torch.ops.rnnkern.recurrence_from_input(cell, a["x"], a["w_ih"], a["h0"], a["c0"], a["w_hh"],
                                                  a["b_ih"], a["b_hh"], reverse)
    for name, g, w in zip(("output", "h_n", "c_n"), got, want):
        assert not g.isnan().any(), name
        assert torch.equal(g, w), f"{name}: max difference {(g - w).abs().max().item():.3g}"


_FROM_INPUT_WIDTH_SCRIPT = r'''
import torch
import rnnkern
from rnnkern import ops
torch.manual_seed(0)
for cell in ops.FROM_INPUT_CELLS:
    for T, I, H in [(13, 40, 24), (37, 300, 70), (64, 128, 128)]:
        for reverse in (False, True):
            G = 4 if cell == "lstm" else 3 if cell == "gru" else 1
            x, w_ih, w_hh = torch.randn(T, 1, I), torch.randn(G * H, I) / I ** 0.5, torch.randn(G * H, H) / H ** 0.5
            b_ih, b_hh, h0 = torch.randn(G * H), torch.randn(G * H), torch.randn(1, H)
            c0 = torch.randn(1, H) if cell == "lstm" else None
            xp = torch.ops.rnnkern.linear(x.view(T, I), w_ih).view(T, 1, G * H)
            want = torch.ops.rnnkern.recurrence(cell, xp, h0, c0, w_hh, b_ih, b_hh, None, None, reverse, False)[:3]
            got = torch.ops.rnnkern.recurrence_from_input(cell, x, w_ih, h0, c0, w_hh, b_ih, b_hh, reverse)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (cell, T, I, H, reverse)
print(rnnkern._C.cpu_vector_bits(), rnnkern._C.cpu_fma_pipe_bits())
'''


@pytest.mark.parametrize("setting", ["RNNKERN_CPU_VECTOR_BITS=256", "RNNKERN_CPU_FMA_BITS=256",
                                     "RNNKERN_CPU_FMA_BITS=512"])
def test_recurrence_from_input_at_each_width_is_linear_then_recurrence_bit_for_bit(setting):
    """With 256-bit vectors (an AVX2 CPU's; RNNKERN_CPU_VECTOR_BITS=256 on an
    AVX-512 one), which carry no tiles, the op is the composition: its bits.
    On 512-bit vectors the FMA pipes' width decides which W_hh take the tiles
    (csrc/cpu/bindings.cpp, max_tiled_weight_bytes): either way, the same bits."""
    name, value = setting.split("=")
    run = subprocess.run([sys.executable, "-c", _FROM_INPUT_WIDTH_SCRIPT], env=dict(os.environ, **{name: value}),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    vector_bits, fma_bits = run.stdout.split()[-2:]
    if name == "RNNKERN_CPU_VECTOR_BITS":
        assert vector_bits == "256"
    else:
        assert fma_bits == value


@pytest.mark.parametrize("case", ["float64", "batch3", "T4", "H296"])
def test_recurrence_from_input_elsewhere_is_the_composition(case):
    """Calls the tiles do not take (float64, a batch of 3, fewer steps than a
    tile's rows, a W_hh past L2: 1 MB and more) run linear then recurrence
    themselves: the same bits, and float64 against the reference."""
    dtype = torch.float64 if case == "float64" else torch.float32
    T, B = (4, 1) if case == "T4" else (11, 3 if case == "batch3" else 1)
    H = 296 if case == "H296" else 12
    for cell in ops.FROM_INPUT_CELLS:
        a = _from_input_args(cell, T, B, 20, H, dtype=dtype, key=(case,))
        got = torch.ops.rnnkern.recurrence_from_input(cell, a["x"], a["w_ih"], a["h0"], a["c0"], a["w_hh"],
                                                      a["b_ih"], a["b_hh"], True)
        want = _linear_then_recurrence(cell, a, True)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        if dtype == torch.float64:
            ref = reference.recurrence(cell, a["x"] @ a["w_ih"].T, a["h0"], a["c0"], a["w_hh"], a["b_ih"],
                                       a["b_hh"], None, None, True)
            assert_close(got[0], ref[0], what=f"{cell} output")


def test_recurrence_from_input_refuses_gradients_and_bad_arguments():
    a = _from_input_args("lstm", 9, 1, 8, 6)
    args = lambda **kw: [kw.get(k, a[k]) for k in ("x", "w_ih", "h0", "c0", "w_hh", "b_ih", "b_hh")]
    w = a["w_hh"].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="recurrence_from_input is for inference"):
        torch.ops.rnnkern.recurrence_from_input("lstm", *args(w_hh=w), False)
    with torch.no_grad():  # no gradient wanted: it runs
        assert torch.ops.rnnkern.recurrence_from_input("lstm", *args(w_hh=w), False)[0].shape == (9, 1, 6)
    with pytest.raises(ValueError, match="expected w_ih of shape"):
        torch.ops.rnnkern.recurrence_from_input("lstm", *args(w_ih=a["w_ih"][:, :5]), False)
    with pytest.raises(ValueError, match="expected x to be 3-D"):
        torch.ops.rnnkern.recurrence_from_input("lstm", *args(x=a["x"][0]), False)
    with pytest.raises(TypeError, match="expected w_ih of dtype"):
        torch.ops.rnnkern.recurrence_from_input("lstm", *args(w_ih=a["w_ih"].double()), False)
    with pytest.raises(ValueError, match="needs c0"):
        torch.ops.rnnkern.recurrence_from_input("lstm", *args(c0=None), False)


@pytest.mark.parametrize("name,kwargs", [("LSTM", {}), ("GRU", {"num_layers": 2}),
                                         ("RNN", {"nonlinearity": "relu", "bidirectional": True}),
                                         ("LSTM", {"num_layers": 2, "bidirectional": True, "batch_first": True})],
                         ids=["lstm", "gru-2layers", "rnn_relu-bidir", "lstm-2layers-bidir-batch_first"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "frozen"])
def test_modules_infer_one_sequence_through_recurrence_from_input(monkeypatch, name, kwargs, mode):
    """An inference call of one float32 sequence runs each layer and direction
    as recurrence_from_input: the bits of the call that keeps gradients (linear,
    then recurrence), torch.nn's numbers on the same weights."""
    torch.manual_seed(7)
    ref = getattr(torch.nn, name)(24, 40, **kwargs)
    m = getattr(rnnkern, name)(24, 40, backend="cpu", **kwargs)
    m.load_state_dict(ref.state_dict())
    g = generator("from-input-module", name, repr(kwargs))
    shape = (1, 29, 24) if kwargs.get("batch_first") else (29, 1, 24)
    x = randn(g, *shape, dtype=torch.float32)
    with_grad = [o.detach() for o in torch.utils._pytree.tree_leaves(m(x))]
    calls = []
    real = ops.run_recurrence_from_input
    monkeypatch.setattr(ops, "run_recurrence_from_input", lambda *a: calls.append(a[0]) or real(*a))
    if mode == "frozen":
        for p in m.parameters():
            p.requires_grad_(False)
        got = m(x)
    else:
        with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
            got = m(x)
    got = torch.utils._pytree.tree_leaves(got)
    layers = kwargs.get("num_layers", 1) * (2 if kwargs.get("bidirectional") else 1)
    assert len(calls) == layers
    for a, b in zip(got, with_grad):
        assert torch.equal(a, b)
    with torch.no_grad():
        for a, b in zip(got, torch.utils._pytree.tree_leaves(ref(x))):
            assert_close(a, b, what=name)


@pytest.mark.parametrize("name,kwargs,B,dtype", [("GRU", {}, 1, torch.float64),
                                                 ("LSTM", {"proj_size": 8}, 1, torch.float32),
                                                 ("GRU", {"reset_after": False}, 1, torch.float32),
                                                 ("LSTM", {"zoneout": 0.2}, 1, torch.float32)],
                         ids=["float64", "proj", "gru_reset_before", "zoneout"])
def test_modules_keep_linear_then_recurrence_elsewhere(monkeypatch, name, kwargs, B, dtype):
    """Other dtypes, a projection, the classic GRU and the options keep the two
    ops (where the op has nothing to gain or does not apply)."""
    m = getattr(rnnkern, name)(12, 16, backend="cpu", dtype=dtype, **kwargs).eval()
    monkeypatch.setattr(ops, "run_recurrence_from_input", lambda *a: pytest.fail("took from_input"))
    with torch.no_grad():
        out = m(torch.randn(10, B, 12, dtype=dtype))[0]
    assert out.shape == (10, B, kwargs.get("proj_size") or 16)


@pytest.mark.parametrize("name,kwargs,B,with_hx", [
    ("LSTM", {}, 1, False), ("LSTM", {"num_layers": 2, "batch_first": True}, 3, True),
    ("GRU", {"bias": False}, 1, True), ("GRU", {"num_layers": 2}, 2, False),
    ("RNN", {"nonlinearity": "relu", "batch_first": True}, 1, False), ("RNN", {}, 4, True),
    ("LSTM", {"num_layers": 2, "dropout": 0.5}, 1, True)],
    ids=["lstm", "lstm-2layers-batch_first-hx", "gru-nobias-hx", "gru-2layers-B2", "rnn_relu-batch_first",
         "rnn-B4-hx", "lstm-dropout-eval"])
def test_modules_short_path_of_inference_is_the_full_forward(monkeypatch, name, kwargs, B, with_hx):
    """A one-direction inference call in float32 skips the full forward's Python
    (_from_input_forward: the same ops, layer after layer): the same bits, shapes
    and strides as the full forward, which it leaves every other call to."""
    torch.manual_seed(11)
    m = getattr(rnnkern, name)(12, 20, backend="cpu", **kwargs).eval()
    g = generator("from-input-short", name, repr(kwargs))
    L = kwargs.get("num_layers", 1)
    x = randn(g, *((B, 9, 12) if kwargs.get("batch_first") else (9, B, 12)), dtype=torch.float32)
    hx = None
    if with_hx:
        hx = tuple(randn(g, L, B, 20, dtype=torch.float32) for _ in range(2 if name == "LSTM" else 1))
        hx = hx if name == "LSTM" else hx[0]
    cls = type(m)
    fast = cls._from_input_forward
    taken = []
    monkeypatch.setattr(cls, "_from_input_forward",
                        lambda self, *a: taken.append(1) or fast(self, *a))
    with torch.no_grad():
        got = torch.utils._pytree.tree_leaves(m(x, hx))
        assert taken and fast(m, x, hx, "cpu") is not None
        monkeypatch.setattr(cls, "_from_input_forward", lambda self, *a: None)
        want = torch.utils._pytree.tree_leaves(m(x, hx))
    assert len(got) == len(want) == (3 if name == "LSTM" else 2)
    for a, b in zip(got, want):
        assert torch.equal(a, b) and a.shape == b.shape and a.stride() == b.stride()
        assert not a.requires_grad


def test_modules_short_path_of_inference_leaves_other_calls():
    """What _from_input_forward leaves to the full forward: two directions,
    dropout to draw, a gradient wanted, float64, one step, hx of another shape
    (the full forward's error), autocast."""
    torch.manual_seed(3)
    x = torch.randn(7, 2, 5)

    def short(m, x, hx=None):
        return m._from_input_forward(x, hx, "cpu")

    with torch.no_grad():
        assert short(rnnkern.LSTM(5, 6, backend="cpu"), x) is not None
        assert short(rnnkern.LSTM(5, 6, bidirectional=True, backend="cpu"), x) is None
        assert short(rnnkern.LSTM(5, 6, num_layers=2, dropout=0.5, backend="cpu").train(), x) is None
        assert short(rnnkern.LSTM(5, 6, backend="cpu"), x.double()) is None
        assert short(rnnkern.GRU(5, 6, backend="cpu"), x[:1]) is None
        assert short(rnnkern.GRU(5, 6, backend="cpu"), x, torch.zeros(1, 3, 6)) is None
        assert short(rnnkern.GRU(5, 6, backend="cpu"), x, torch.zeros(1, 2, 6, dtype=torch.float64)) is None
        assert short(rnnkern.GRU(5, 6, backend="cpu", reset_after=False), x) is None
        with pytest.raises(RuntimeError, match="Expected hidden size"):
            rnnkern.GRU(5, 6, backend="cpu")(x, torch.zeros(1, 3, 6))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert short(rnnkern.RNN(5, 6, backend="cpu"), x) is None
    assert short(rnnkern.RNN(5, 6, backend="cpu"), x) is None  # (gradients wanted)


def test_recurrence_from_input_same_bits_at_1_2_and_3_threads():
    """A two-layer LSTM's inference at batch 1 (H = 128: the step's product on
    one thread, the projection's split between threads when apart) gives the
    same bits at any thread count, as every call does."""
    torch.manual_seed(3)
    m = rnnkern.LSTM(128, 128, num_layers=2, backend="cpu").eval()
    x = randn(generator("from-input-bits"), 70, 1, 128, dtype=torch.float32)

    def run(_):
        with torch.no_grad():
            return torch.utils._pytree.tree_leaves(m(x))
    want = _results_at(1, lambda: None, run)
    for n in (2, 3):
        for a, b in zip(_results_at(n, lambda: None, run), want):
            assert torch.equal(a, b)


# A batch of 16 rows or more (I <= 256; W_ih and W_hh within 4 MB): each step
# makes x_t W_ih^T too (ForwardArgs::x_rows), the same bits; H=448 B=64 (W_hh
# past 2 MB) split by units, the LSTM's accumulating path and the others' own
# products.
INSIDE_SIZES = [(5, 16, 16, 16), (13, 17, 40, 24), (64, 64, 128, 128), (9, 33, 256, 70),
                (6, 20, 300, 20), (7, 15, 32, 32), (2, 64, 16, 448)]


@pytest.mark.parametrize("T,B,I,H", INSIDE_SIZES, ids=[f"T{t}-B{b}-I{i}-H{h}" for t, b, i, h in INSIDE_SIZES])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_recurrence_from_input_batches_are_linear_then_recurrence_bit_for_bit(threads, T, B, I, H, reverse,
                                                                             n_threads):
    """Split by rows or by units at 2 and 3 threads, I past 256 and B under 16
    (the composition), every cell: the composition's bits."""
    threads(n_threads)
    for cell in ops.FROM_INPUT_CELLS:
        a = _from_input_args(cell, T, B, I, H, key=("batch",))
        want = _linear_then_recurrence(cell, a, reverse)
        _poison_heap((T, B, H), (B, H))
        got = torch.ops.rnnkern.recurrence_from_input(cell, a["x"], a["w_ih"], a["h0"], a["c0"], a["w_hh"],
                                                      a["b_ih"], a["b_hh"], reverse)
        for name, g, w in zip(("output", "h_n", "c_n"), got, want):
            assert not g.isnan().any(), name
            assert torch.equal(g, w), f"{cell} {name}: max difference {(g - w).abs().max().item():.3g}"


def test_lstm_batch_inference_runs_recurrence_from_input(monkeypatch):
    """A two-layer bidirectional LSTM's inference at B=32: the op per layer and
    direction, the bits of the gradient-keeping call, torch.nn's numbers."""
    torch.manual_seed(5)
    ref = torch.nn.LSTM(24, 40, num_layers=2, bidirectional=True)
    m = rnnkern.LSTM(24, 40, num_layers=2, bidirectional=True, backend="cpu")
    m.load_state_dict(ref.state_dict())
    x = randn(generator("inside-module"), 21, 32, 24, dtype=torch.float32)
    with_grad = [o.detach() for o in torch.utils._pytree.tree_leaves(m(x))]
    got, calls = inference_through_from_input(monkeypatch, m, x)
    with torch.no_grad():
        want = torch.utils._pytree.tree_leaves(ref(x))
    assert calls == 4
    for a, b, r in zip(got, with_grad, want):
        assert torch.equal(a, b)
        assert_close(a, r, what="LSTM B=32")

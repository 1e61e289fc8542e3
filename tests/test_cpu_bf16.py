"""bfloat16 products on bf16 pairs (csrc/cpu/pairs.h; the recurrence's
per-step products forward and backward, its weight gradients, rnnkern::linear
and its backward): the layout, packing,
rounding and drivers of the path that CPUs with AVX512_BF16 run on the
vdpbf16ps instruction, and CPUs with AMX-BF16 on AMX's tiles.  Every test
runs the portable emulation of the instruction ("emulated": exact for normal
numbers) and the tile driver on emulated tiles ("amx_emulated"), so CPUs
without them test every line but the instructions themselves; where the CPU
has them, the same tests run them too ("native", "amx"): the instruction must
agree with its emulation bit for bit, the tiles (whose order of sums within a
block is the hardware's own) within the float32 sums' error."""
from __future__ import annotations

import contextlib
import os
import subprocess

import pytest
import torch

import rnnkern
from rnnkern import _C, ops, reference
from conftest import (CELLS, assert_close, assert_half_step_within_reference_error,
                      assert_low_precision, generator, inference_through_from_input, outputs_and_grads,
                      randn, recurrence_inputs)


@contextlib.contextmanager
def bf16_products(mode):
    before = _C.cpu_bf16_products()
    _C.set_cpu_bf16_products(mode)
    try:
        yield
    finally:
        _C.set_cpu_bf16_products(before)


def native_or_skip():
    if not _cpu_has_instruction():
        pytest.skip("needs a CPU with AVX512_BF16 (vdpbf16ps) and a build with the 512-bit kernels")


def amx_or_skip():
    if not _cpu_has_tiles():
        pytest.skip("needs a CPU with AMX-BF16 whose OS grants the tile state, and a build with the "
                    "512-bit kernels")


def _cpu_has(mode):
    try:
        with bf16_products(mode):
            return True
    except RuntimeError:
        return False


def _cpu_has_instruction():
    return _cpu_has("native")


def _cpu_has_tiles():
    return _cpu_has("amx")


PAIR_MODES = ["emulated", "native", "amx_emulated", "amx"]


@pytest.fixture(params=PAIR_MODES)
def pair_mode(request):
    if request.param == "native":
        native_or_skip()
    if request.param == "amx":
        amx_or_skip()
    with bf16_products(request.param):
        assert _C.cpu_bf16_products() == request.param
        yield request.param


def bf16_values(g, *shape, scale=1.0):
    return randn(g, *shape, scale=scale).bfloat16()


def test_modes_are_set_and_refused_by_name():
    default = _C.cpu_bf16_products()
    # The default is AMX's tiles where the CPU has them, else the instruction
    # where it has it, float32 elsewhere, unless RNNKERN_CPU_BF16_PRODUCTS chose
    # float32, emulated, amx_emulated or (where the CPU has it) native at load
    # time.
    chosen = os.environ.get("RNNKERN_CPU_BF16_PRODUCTS")
    assert default == (chosen if chosen in ("float32", "emulated", "amx_emulated")
                       else "native" if chosen == "native" and _cpu_has_instruction()
                       else "amx" if _cpu_has_tiles()
                       else "native" if _cpu_has_instruction() else "float32")
    with bf16_products("emulated"):
        assert _C.cpu_bf16_products() == "emulated"
    assert _C.cpu_bf16_products() == default
    with pytest.raises(ValueError, match="'float32', 'native', 'emulated', 'amx' or 'amx_emulated'"):
        _C.set_cpu_bf16_products("bf16")
    if not _cpu_has_instruction():
        with pytest.raises(RuntimeError, match="AVX512_BF16"):
            _C.set_cpu_bf16_products("native")
    if not _cpu_has_tiles():
        with pytest.raises(RuntimeError, match="AMX-BF16"):
            _C.set_cpu_bf16_products("amx")
    assert _C.cpu_bf16_products() == default


@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (1, 64, 64), (2, 41, 100), (7, 5, 3), (9, 33, 32),
                                   (70, 64, 129), (300, 77, 40), (1000, 256, 96), (130, 600, 40),
                                   (3, 0, 4), (0, 5, 4)])
def test_linear_on_pairs_sums_the_exact_products(pair_mode, M, K, N):
    """x W^T of bf16 x and W: each product is exact in float32 and the sum is
    float32, so the result is the float64 product rounded to bf16, within
    the float32 sum's own error.  Odd K (a pair half zero), N past a panel,
    row counts that are not a multiple of the kernel's 8, one and two rows
    (two panels per call), K past a chunk of 512 (the rows' sums carried in
    float32 between chunks, rounded once), an empty sum and no rows."""
    g = generator("pairs-linear", M, K, N)
    x, w = bf16_values(g, M, K), bf16_values(g, N, K)
    exact = x.double() @ w.double().t()
    y = torch.ops.rnnkern.linear(x, w)
    assert y.dtype == torch.bfloat16
    bound = 2.0 ** -8 * exact.abs() + K * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
    assert ((y.double() - exact).abs() <= bound).all(), (y.double() - exact).abs().max()
    # strided operands take the same path
    xs = torch.cat([x, x], 1)[:, ::2]
    assert torch.equal(torch.ops.rnnkern.linear(xs, w),
                       torch.ops.rnnkern.linear(xs.contiguous(), w))


@pytest.mark.parametrize("M,K,N", [(1, 3, 1), (2, 41, 100), (70, 64, 129), (1300, 33, 40),
                                   (517, 130, 7)])
def test_linear_backward_on_pairs_sums_the_exact_products(pair_mode, M, K, N):
    """grad_x = gy W and grad_w = gy^T x of bf16 operands: the exact products,
    float32 sums (grad_w's over M = 1300 rows: three chunks of 512, an odd
    last one), rounded to bf16."""
    g = generator("pairs-linear-backward", M, K, N)
    x, w, gy = bf16_values(g, M, K), bf16_values(g, N, K), bf16_values(g, M, N)
    gx, gw = torch.ops.rnnkern.linear_backward(gy, x, w, True, True)
    for name, got, a, b in (("grad_x", gx, gy, w), ("grad_w", gw, gy.t(), x)):
        exact = a.double() @ b.double()
        bound = 2.0 ** -8 * exact.abs() + a.shape[1] * 2.0 ** -24 * (a.double().abs() @ b.double().abs())
        assert got.dtype == torch.bfloat16, name
        assert ((got.double() - exact).abs() <= bound).all(), (name, (got.double() - exact).abs().max())
    only_w = torch.ops.rnnkern.linear_backward(gy, x, w, False, True)[1]
    assert torch.equal(only_w, gw)
    only_x = torch.ops.rnnkern.linear_backward(gy, x, w, True, False)[0]
    assert torch.equal(only_x, gx)
    # strided operands are read where they lie: the same bits as their dense copies
    gys, xs = torch.stack([gy, -gy], 2).flatten(1)[:, ::2], torch.stack([x, -x], 2).flatten(1)[:, ::2]
    assert gys.stride(1) == 2 and xs.stride(1) == 2 and torch.equal(gys, gy) and torch.equal(xs, x)
    for got, want in zip(torch.ops.rnnkern.linear_backward(gys, xs, w, True, True), (gx, gw)):
        assert torch.equal(got, want)


def test_weight_gradient_blocks_past_2mb_sum_as_smaller_ones(pair_mode):
    """grad_w = gy^T x reads gy^T as columns of gy, block of rows (of grad_w)
    by block: 96 rows a block, 256 where gy takes more than 2 MB (pairs.cpp,
    kSweepBytes).  Each row of grad_w sums its pairs chunk by chunk whatever
    the block it falls in: grad_w of a gy of 2.3 MB (rows in blocks of 256)
    holds, bit for bit, that of its first 300 columns (1.3 MB: blocks of 96),
    and is within the float32 sums' error of the exact product (three
    chunks of K, an odd last one)."""
    M, K, N = 2100, 520, 36
    g = generator("pairs-sweep", M, K, N)
    x, w, gy = bf16_values(g, M, N), bf16_values(g, K, N), bf16_values(g, M, K)
    assert gy.numel() * 2 > 2 << 20 > gy[:, :300].numel() * 2
    gw = torch.ops.rnnkern.linear_backward(gy, x, w, False, True)[1]
    exact = gy.double().t() @ x.double()
    bound = 2.0 ** -8 * exact.abs() + M * 2.0 ** -24 * (gy.double().abs().t() @ x.double().abs())
    assert gw.dtype == torch.bfloat16 and gw.shape == (K, N)
    assert ((gw.double() - exact).abs() <= bound).all(), (gw.double() - exact).abs().max()
    part = torch.ops.rnnkern.linear_backward(gy[:, :300].contiguous(), x, w[:300], False, True)[1]
    assert torch.equal(gw[:300], part)


def test_linear_blocks_of_columns_past_1mb_sum_as_the_blocks_alone(pair_mode):
    """x W^T where a chunk of W as pairs passes 1 MB (N=1100 at K=600: 35
    panels of 32 KB) runs in blocks of 1024 columns for all of a worker's
    rows (pairs.cpp, column_block).  Each column sums its pairs chunk by
    chunk whatever its block: the bits of the product with W's rows of each
    block alone, and of a product of 96 rows or fewer (one block of rows,
    never split by columns); within the float32 sums' error of the exact
    product (two chunks of K, an odd N past the last panel)."""
    M, K, N = 200, 600, 1100
    g = generator("pairs-column-blocks", M, K, N)
    x, w = bf16_values(g, M, K), bf16_values(g, N, K)
    y = torch.ops.rnnkern.linear(x, w)
    exact = x.double() @ w.double().t()
    bound = 2.0 ** -8 * exact.abs() + K * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert ((y.double() - exact).abs() <= bound).all(), (y.double() - exact).abs().max()
    assert torch.equal(y[:, :1024], torch.ops.rnnkern.linear(x, w[:1024]))
    assert torch.equal(y[:, 1024:], torch.ops.rnnkern.linear(x, w[1024:]))
    assert torch.equal(y[:96], torch.ops.rnnkern.linear(x[:96], w))
    # The float32 sums themselves (a cell's x W_ih^T, kept float32 for its
    # gate math): an LSTM cell of 200 rows with 4H = 1200 gate rows of K=600,
    # whose rows are those of its first 96 alone.
    H = 300
    w_ih, w_hh = bf16_values(g, 4 * H, K, scale=K ** -0.5), bf16_values(g, 4 * H, H, scale=H ** -0.5)
    h, c, b = bf16_values(g, M, H), bf16_values(g, M, H), bf16_values(g, 4 * H)
    whole = torch.ops.rnnkern.step("lstm", x, h, c, w_ih, w_hh, b, b, None)
    rows = torch.ops.rnnkern.step("lstm", x[:96], h[:96], c[:96], w_ih, w_hh, b, b, None)
    for a, r in zip(whole, rows):
        assert not a.isnan().any() and torch.equal(a[:96], r)


@pytest.mark.parametrize("B,H", [(1, 37), (2, 70), (9, 70), (20, 16)])
def test_recurrence_product_reads_the_state_as_bf16(B, H):
    """The tanh RNN's step, teacher-forced: h_t = tanh(xproj_t + b +
    bf16(h_{t-1}) W^T), with bf16(h_{t-1}) = the bf16 output at t-1 (both
    round the float32 state to nearest even).  Each output must be that
    float64 value rounded to bf16, within the float32 sums' error.  The
    float32 products (unrounded states) miss it: the check sees the rounding."""
    T = 6
    args = recurrence_inputs("rnn_tanh", T, B, H, dtype=torch.bfloat16, key=("pairs-state",))
    w, b = args["w_hh"].double(), args["b_ih"].double() + args["b_hh"].double()

    def worst_excess(mode):
        with bf16_products(mode):
            out, h_n = ops.recurrence("rnn_tanh", **args, backend="cpu")[:2]
        assert torch.equal(out[-1], h_n)
        prev = torch.cat([args["h0"][None], out[:-1]]).double()
        want = torch.tanh(args["xproj"].double() + b + prev @ w.t())
        # bf16 rounding of the output (half an ulp: up to 2^-8 relative) and the
        # float32 sums before it
        bound = 2.0 ** -8 * want.abs() + 1e-6 * (1 + (prev.abs() @ w.abs().t()))
        return ((out.double() - want).abs() - bound).max().item()

    for mode in ("emulated", "amx_emulated"):
        assert worst_excess(mode) <= 0, mode
    if _cpu_has_instruction():
        assert worst_excess("native") <= 0
    if _cpu_has_tiles():
        assert worst_excess("amx") <= 0
    assert worst_excess("float32") > 0


@pytest.mark.parametrize("B,H", [(1, 37), (2, 70), (9, 70)])
def test_backward_product_reads_the_gate_gradient_as_bf16(B, H):
    """The ReLU RNN's backward, teacher-forced: dA_{t-1} = relu'(a_{t-1}) *
    (g_{t-1} + bf16(dA_t) W), where bf16(dA_t) is grad_xproj at t (both round
    the float32 gate gradient to nearest even) and relu'(a) = (output > 0).
    Each grad_xproj must be that float64 value rounded to bf16, within the
    float32 sums' error; the float32 products (unrounded dA) miss it."""
    T = 6
    args = recurrence_inputs("rnn_relu", T, B, H, dtype=torch.bfloat16, key=("pairs-grad",))
    g = generator("pairs-grad-cot", B, H)
    g_out, g_hn = bf16_values(g, T, B, H), bf16_values(g, B, H)
    w = args["w_hh"].double()

    def worst_excess(mode):
        xproj = args["xproj"].clone().requires_grad_()
        with bf16_products(mode):
            out, h_n = ops.recurrence("rnn_relu", **(args | {"xproj": xproj}), backend="cpu")[:2]
            (gx,) = torch.autograd.grad((out * g_out).sum() + (h_n * g_hn).sum(), [xproj])
        carried = torch.cat([gx[1:].double() @ w, g_hn.double()[None]])
        want = (out > 0).double() * (g_out.double() + carried)
        bound = 2.0 ** -8 * want.abs() + 1e-6 * (1 + gx.double().abs() @ w.abs())
        return ((gx.double() - want).abs() - bound).max().item()

    for mode in ("emulated", "amx_emulated"):
        assert worst_excess(mode) <= 0, mode
    if _cpu_has_instruction():
        assert worst_excess("native") <= 0
    if _cpu_has_tiles():
        assert worst_excess("amx") <= 0
    assert worst_excess("float32") > 0


@pytest.mark.parametrize("cell", ["rnn_tanh", "lstm", "gru"])
@pytest.mark.parametrize("lengths,reverse", [(None, False), (None, True), ([7, 3, 7, 1, 5], False),
                                             ([7, 3, 7, 1, 5], True)])
def test_weight_gradient_reads_the_gate_gradients_it_hands_back(pair_mode, cell, lengths, reverse):
    """The backward rounds each step's gate gradients to bf16 once, as the
    step leaves them (csrc/cpu/recurrence.h, rounds_rows_in_steps): the
    rounded rows are grad_xproj, the next step's product and dW_hh's operand.
    So dW_hh (for the GRU its r, z rows) must be the sum over the real
    positions of grad_xproj^T h_{t-1}, h_{t-1} the bf16 output one step
    earlier in the direction of the pass (h0 at a sequence's first step),
    within the float32 sums' error and dW's rounding to bf16; a padded
    position's grad_xproj is zero.  Without lengths the product reads the
    bf16 output's bits in place of its float32 copy (backward.cpp,
    weight_grad_by_prev_state), in both directions."""
    T, B, H = 7, 5, 40
    args = recurrence_inputs(cell, T, B, H, dtype=torch.bfloat16, key=("pairs-dw",))
    g = generator("pairs-dw-cot", cell)
    cot = bf16_values(g, T, B, H)
    lens = None if lengths is None else torch.tensor(lengths)
    xproj = args["xproj"].clone().requires_grad_()
    w_hh = args["w_hh"].clone().requires_grad_()
    out = ops.recurrence(cell, **(args | {"xproj": xproj, "w_hh": w_hh}), lengths=lens,
                         reverse=reverse, backend="cpu")[0]
    gx, gw = torch.autograd.grad((out * cot).sum(), [xproj, w_hh])
    rows = H * (2 if cell == "gru" else reference.gate_count(cell))
    want = torch.zeros(rows, H, dtype=torch.float64)
    size = torch.zeros(rows, H, dtype=torch.float64)
    for b in range(B):
        n = T if lens is None else int(lens[b])
        assert (gx[n:, b] == 0).all()
        for p in range(n):
            earlier = p + 1 if reverse else p - 1
            h_prev = args["h0"][b] if not 0 <= earlier < n else out[earlier, b]
            d = gx[p, b, :rows].double()
            want += torch.outer(d, h_prev.double())
            size += torch.outer(d.abs(), h_prev.double().abs())
    terms = T * B
    bound = 2.0 ** -8 * want.abs() + terms * 2.0 ** -24 * size
    assert gw.dtype == torch.bfloat16
    excess = (gw[:rows].double() - want).abs() - bound
    assert excess.max() <= 0, excess.max()


@pytest.mark.parametrize("cell", ["rnn_tanh", "rnn_relu", "lstm", "gru"])
@pytest.mark.parametrize("reverse", [False, True])
def test_backward_widens_bf16_rows_as_their_float32_copies(pair_mode, cell, reverse):
    """A bfloat16 call's backward reads grad_output and the output (the RNN's
    h_t, the GRU's h_{t-1}) row by row from their bf16 bits, widened as the
    row kernels take them (csrc/cpu/recurrence.h, widened_output), where a
    call with resets or lengths widens the whole output to float32 first: the
    widening is exact, so no resets (all False) and lengths of T must give
    the gradients of the plain call bit for bit, at 1 and 2 threads (each
    worker widens into its own buffer).  (grad_output is widened row by row
    in all three; its rows are pinned by the tests within the reference's
    error, test_bfloat16_on_pairs_within_reference_error.)"""
    T, B, H = 6, 5, 40
    args = recurrence_inputs(cell, T, B, H, dtype=torch.bfloat16, key=("pairs-widen",))
    cot = bf16_values(generator("pairs-widen-cot", cell), T, B, H)
    names = [n for n, t in args.items() if t is not None]
    options = {"plain": {}, "resets": dict(resets=torch.zeros(T, B, dtype=torch.bool)),
               "lengths": dict(lengths=torch.full((B,), T, dtype=torch.int64))}

    def grads(opts):
        leaves = {n: t.clone().requires_grad_() if t is not None else None for n, t in args.items()}
        out, h_n, c_n = ops.recurrence(cell, **leaves, reverse=reverse, backend="cpu", **opts)
        loss = (out * cot).sum() + h_n.float().sum() + (0 if c_n is None else c_n.float().sum())
        return [out, *torch.autograd.grad(loss, [leaves[n] for n in names])]

    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            want = grads(options["plain"])
            assert all(torch.isfinite(w.float()).all() for w in want)
            assert want[names.index("w_hh") + 1].abs().sum() > 0
            for name in ("resets", "lengths"):
                for n, a, b in zip(["output", *names], grads(options[name]), want):
                    assert torch.equal(a, b), f"{name}: {n} differs at {threads} threads"
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("cell,proj,T,B", [(cell, 0, 16, 4) for cell in CELLS] +
                         [("lstm", 5, 16, 4), ("gru", 0, 40, 16)])
def test_bfloat16_on_pairs_within_reference_error(pair_mode, cell, proj, T, B):
    """Every cell (and the LSTM's projection) on pairs: outputs, states and
    gradients no worse than twice the reference's own bfloat16 error, as the
    float32 products (test_cpu.py).  At T=40 B=16 the weight gradients sum
    640 rows: two chunks of the pair GEMM."""
    H = 64
    args = recurrence_inputs(cell, T, B, H, dtype=torch.bfloat16, proj=proj, key=("bf16-pairs",))
    args16 = {k: None if v is None else v.requires_grad_() for k, v in args.items()}
    args32 = {k: None if v is None else v.detach().float().requires_grad_() for k, v in args.items()}
    key = ("bf16-pairs-cot", cell, T, B)
    want = outputs_and_grads("reference", cell, args32, key=key)
    ref16 = outputs_and_grads("reference", cell, args16, key=key)
    got = outputs_and_grads("cpu", cell, args16, key=key)
    for name in want:
        assert got[name].dtype == torch.bfloat16, name
        assert torch.isfinite(got[name]).all(), name
        assert_low_precision(got[name], ref16[name], want[name], what=name)


@pytest.mark.parametrize("cell,B,I,H", [("lstm", 1, 48, 80), ("gru", 5, 33, 110),
                                        ("rnn_tanh", 32, 129, 130), ("lstm", 9, 130, 64),
                                        ("rnn_relu", 3, 17, 8), ("lstm", 1, 48, 40),
                                        ("gru", 5, 33, 60), ("rnn_tanh", 32, 64, 48)])
def test_step_on_pairs_within_reference_error(pair_mode, cell, B, I, H):
    """One step of a bfloat16 call (the cells' op).  Past 2^15 weight values
    (the first four) both products run on pairs: x W_ih^T into a float32
    xproj, and h W_hh^T with W_hh packed from its bf16 bits (whole panels of
    32 columns by tiles of 8 pairs, pair by pair past them: odd I, H and 4H
    not multiples of 32); the backward's dX, dW_ih on pairs of dXproj rounded
    to bf16 (as a sequence's backward hands it over).  Below, the lean step:
    values widened to float32, the float32 step, results rounded.  One row
    and batches; h_new, c_new and every gradient within twice the
    reference's own bfloat16 error."""
    assert_half_step_within_reference_error(cell, B, I, H, torch.bfloat16, key=("bf16-pairs-step",))


@pytest.mark.parametrize("name", ["LSTM", "GRU", "RNN"])
def test_modules_on_pairs_match_torch_nn_bf16(pair_mode, name):
    """Two layers, both directions, a packed batch of uneven lengths: within
    twice torch.nn's own bf16 error against torch.nn in float32."""
    g = generator("pairs-modules", name)
    theirs = getattr(torch.nn, name)(24, 40, num_layers=2, bidirectional=True)
    ours = getattr(rnnkern, name)(24, 40, num_layers=2, bidirectional=True, backend="cpu")
    ours.load_state_dict(theirs.state_dict())
    x = randn(g, 11, 6, 24, dtype=torch.float32)
    lengths = torch.tensor([11, 9, 9, 4, 2, 1])
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths)
    want = theirs(packed)[0].data
    theirs.bfloat16()
    ours.bfloat16()
    packed16 = torch.nn.utils.rnn.pack_padded_sequence(x.bfloat16(), lengths)
    ref16 = theirs(packed16)[0].data
    got = ours(packed16)[0].data
    assert got.dtype == torch.bfloat16
    assert_low_precision(got, ref16, want, what="output")


def test_pairs_same_bits_at_1_2_and_3_threads(pair_mode):
    """Each element sums its pairs in one order whatever rows or units a
    thread takes: the recurrence forward and backward (split by rows at
    B = 32; by units at H = 544 B = 30, where W_hh outgrows the caches and
    each worker rounds its units' gate gradients to bf16; every gradient), a
    cell's step on pairs and a small one's lean step, with their gradients,
    and the input projection with its gradients give the same bits at every
    thread count, emulated and (where the CPU has it) on the instruction."""
    g = generator("pairs-threads")
    m = rnnkern.LSTM(48, 128, backend="cpu").bfloat16()
    x = bf16_values(g, 9, 32, 48)
    xl, wl = bf16_values(g, 999, 130), bf16_values(g, 96, 130)
    saved = torch.get_num_threads()

    gl = bf16_values(g, 999, 96)
    cot = bf16_values(g, 9, 32, 128)

    cell = rnnkern.GRUCell(48, 128, backend="cpu").bfloat16()
    hc = bf16_values(g, 32, 128)
    small = rnnkern.LSTMCell(48, 40, backend="cpu").bfloat16()  # the lean step's size (widened)
    hs, cs = bf16_values(g, 32, 40), bf16_values(g, 32, 40)
    wide = rnnkern.LSTM(16, 544, backend="cpu").bfloat16()
    xw, cot_w = bf16_values(g, 3, 30, 16), bf16_values(g, 3, 30, 544)
    lengths = torch.tensor([3, 1, 2] * 10)

    def run(threads):
        torch.set_num_threads(threads)
        out, (h, c) = m(x.requires_grad_())
        grads = torch.autograd.grad((out * cot).sum(), [x, *m.parameters()])
        h1 = cell(x[0], hc)
        cell_grads = torch.autograd.grad((h1 * cot[0]).sum(), [x, *cell.parameters()])
        h2, c2 = small(x[0], (hs, cs))
        small_grads = torch.autograd.grad((h2 * cot[0, :, :40]).sum() + c2.sum(), [x, *small.parameters()])
        out_w = wide(xw.requires_grad_(), lengths=lengths)[0]
        wide_grads = torch.autograd.grad((out_w * cot_w).sum(), [xw, *wide.parameters()])
        out_g = wide(xw)[0]  # the grid: the output rounded in the steps, by units
        grid_grads = torch.autograd.grad((out_g * cot_w).sum(), [xw, *wide.parameters()])
        return [out, h, c, *grads, h1, *cell_grads, h2, c2, *small_grads, out_w, *wide_grads,
                out_g, *grid_grads,
                torch.ops.rnnkern.linear(xl, wl),
                *torch.ops.rnnkern.linear_backward(gl, xl, wl, True, True)]

    try:
        want = run(1)
        for threads in (2, 3):
            for a, b in zip(run(threads), want):
                assert torch.equal(a, b), f"differs at {threads} threads"
    finally:
        torch.set_num_threads(saved)


# rnnkern::recurrence_from_input on pairs: at a batch of 16 rows or more (W_ih
# and W_hh within 4 MB as pairs, I <= 512) each step makes its x_t W_ih^T, a
# product of its own rounded to bf16 (ForwardArgs::x_rows), the bits of
# linear then recurrence; other batches are that composition.  Odd I (the
# rows' pairs not in place), I past 512 and B under 16 (the composition), at
# 1, 2 and 3 threads: split by rows, and at H=600 (W_hh past 2 MB as pairs for
# the LSTM and GRU) by units.  At I=512 H=400 the LSTM's and GRU's two
# weights pass 2 MB as pairs: on tiles a worker makes x W_ih^T for four steps
# at a time (x_steps_per_product), six steps in blocks of four and two, its
# rows gathered where it has part of the batch (two and three threads).
FROM_INPUT_SIZES = [(5, 16, 16, 16), (13, 17, 41, 24), (9, 33, 256, 70), (6, 20, 520, 20),
                    (7, 15, 32, 32), (4, 40, 64, 160), (2, 32, 64, 600), (6, 20, 512, 400)]


@pytest.mark.parametrize("T,B,I,H", FROM_INPUT_SIZES, ids=[f"T{t}-B{b}-I{i}-H{h}" for t, b, i, h in FROM_INPUT_SIZES])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_recurrence_from_input_on_pairs_is_linear_then_recurrence_bit_for_bit(pair_mode, T, B, I, H, reverse):
    saved = torch.get_num_threads()
    try:
        for cell in ops.FROM_INPUT_CELLS:
            g = generator("pairs-from-input", cell, T, B, I, H)
            G = reference.gate_count(cell)
            x, w_ih = bf16_values(g, T, B, I), bf16_values(g, G * H, I, scale=I ** -0.5)
            h0 = bf16_values(g, B, H, scale=0.5)
            c0 = bf16_values(g, B, H, scale=0.5) if cell == "lstm" else None
            w_hh = bf16_values(g, G * H, H, scale=H ** -0.5)
            b_ih, b_hh = bf16_values(g, G * H), bf16_values(g, G * H)
            xproj = torch.ops.rnnkern.linear(x.reshape(T * B, I), w_ih).view(T, B, G * H)
            want = torch.ops.rnnkern.recurrence(cell, xproj, h0, c0, w_hh, b_ih, b_hh, None, None, reverse,
                                                False)[:3]
            for n_threads in (1, 2, 3):
                torch.set_num_threads(n_threads)
                for shape in ((T, B, H), (B, H)):
                    torch.full(shape, float("nan"), dtype=torch.bfloat16)  # freed: the next buffers may be these
                got = torch.ops.rnnkern.recurrence_from_input(cell, x, w_ih, h0, c0, w_hh, b_ih, b_hh, reverse)
                for name, a, b in zip(("output", "h_n", "c_n"), got, want):
                    assert a.dtype == torch.bfloat16, name
                    assert not a.isnan().any(), (cell, name, n_threads)
                    assert torch.equal(a, b), (cell, name, n_threads, (a.float() - b.float()).abs().max().item())
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("name", ["LSTM", "GRU", "RNN"])
def test_batch_inference_on_pairs_runs_recurrence_from_input(pair_mode, name, monkeypatch):
    """A two-layer bidirectional bf16 module's inference at B=32, batch first:
    the op per layer and direction, the bits of the gradient-keeping call,
    torch.nn's numbers within bf16's error."""
    torch.manual_seed(6)
    ref = getattr(torch.nn, name)(24, 40, num_layers=2, bidirectional=True, batch_first=True)
    m = getattr(rnnkern, name)(24, 40, num_layers=2, bidirectional=True, batch_first=True, backend="cpu")
    m.load_state_dict(ref.state_dict())
    x = randn(generator("pairs-inside-module", name), 32, 21, 24, dtype=torch.float32)
    want = torch.utils._pytree.tree_leaves(ref(x))
    m.bfloat16()
    ref.bfloat16()
    x16 = x.bfloat16()
    with_grad = [o.detach() for o in torch.utils._pytree.tree_leaves(m(x16))]
    got, calls = inference_through_from_input(monkeypatch, m, x16)
    with torch.no_grad():
        theirs = torch.utils._pytree.tree_leaves(ref(x16))
    assert calls == 4
    for a, b, r16, r in zip(got, with_grad, theirs, want):
        assert a.dtype == torch.bfloat16
        assert torch.equal(a, b)
        assert_low_precision(a, r16, r, what=f"{name} B=32")


def test_native_agrees_with_the_emulation():
    """Where the CPU has the instruction: the same bits as the emulation (it
    differs only where the instruction flushes a denormal, which products of
    these values never are)."""
    native_or_skip()
    g = generator("pairs-native")
    x, w = bf16_values(g, 257, 131), bf16_values(g, 67, 131)
    m = rnnkern.GRU(131, 67, backend="cpu").bfloat16()
    results = {}
    for mode in ("native", "emulated"):
        with bf16_products(mode):
            results[mode] = [torch.ops.rnnkern.linear(x, w), m(x[:, None])[0]]
    for a, b in zip(results["native"], results["emulated"]):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()


def test_tiles_agree_with_their_emulation():
    """Where the CPU has AMX: within the float32 sums' error of the emulated
    tiles (the hardware adds a block's 32 products in its own order), and the
    same bits at every row count, whatever tile a row falls in (rows 0 and
    40 of 41 alone, in a block of 32 and in one of 9).  Odd K and N past a
    panel, K past a chunk (C accumulated in tiles, a panel cut by N through
    the edge buffer), and a GRU's sequence."""
    amx_or_skip()
    g = generator("pairs-amx")
    for M, K, N in ((257, 131, 67), (41, 600, 40)):
        x, w = bf16_values(g, M, K), bf16_values(g, N, K)
        with bf16_products("amx"):
            got = torch.ops.rnnkern.linear(x, w).float()
            rows = torch.cat([torch.ops.rnnkern.linear(x[i:i + n], w).float()
                              for i, n in ((0, 1), (1, 32), (33, 9))] +
                             [torch.ops.rnnkern.linear(x[42:], w).float()] * (M > 42))
        assert torch.equal(got[:42], rows[:42]) and torch.equal(got[42:], rows[42:])
        with bf16_products("amx_emulated"):
            want = torch.ops.rnnkern.linear(x, w).float()
        bound = 2.0 ** -7 * want.abs() + 2 * K * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t()).float()
        assert ((got - want).abs() <= bound).all(), (got - want).abs().max()
    m = rnnkern.GRU(131, 67, backend="cpu")
    xs = bf16_values(g, 9, 5, 131)
    want = m(xs.float())[0]
    m.bfloat16()
    results = {}
    for mode in ("amx", "amx_emulated"):
        with bf16_products(mode):
            results[mode] = m(xs)[0]
    assert_low_precision(results["amx"], results["amx_emulated"], want, what="GRU output")


def test_build_holds_the_instruction():
    """The native driver is compiled for the instruction (read off the
    binary: CPUs without it cannot run it); builds pinned below x86-64-v4
    (.ci/isa_levels.sh sets RNNKERN_EXPECT_CPU_ISA) have no 512-bit kernels
    and no instruction."""
    dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", _C.__file__],
                          capture_output=True, text=True, check=True).stdout
    pinned = os.environ.get("RNNKERN_EXPECT_CPU_ISA")
    assert ("vdpbf16ps" in dump) == (pinned in (None, "x86-64-v4"))
    assert ("tdpbf16ps" in dump) == (pinned in (None, "x86-64-v4"))

"""The persistent recurrence kernels (csrc/cuda/persistent.cuh) on the emulated
cooperative grid: one cooperative launch per layer and direction for the whole
sequence, W_hh's slices resident in each CTA's shared memory, a grid barrier
per step, forward and backward.

The emulated device runs every CTA of the grid at once (csrc/cuda_emu), so a
CTA that read another's slice of h_{t-1} (or of da) before the barrier would
read the NaN the "device memory" starts with, or a stale step.  The device
model has 4 multiprocessors here, so hidden sizes of 3-40 spread over 3-4
CTAs, with a last CTA of fewer units.  Everything is compared with the
float64 reference (values and every gradient), gradchecked, and checked to
have run on the persistent kernels (cooperative launches counted); the cells
and options the kernels do not take fall back to the host loop (no
cooperative launch).  Under ThreadSanitizer (.ci/cuda_emulation.sh) the
barrier's ordering between CTAs is checked too.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import (assert_close, assert_low_precision, generator, outputs_and_grads, randn,
                      recurrence_inputs, require_cuda_emulation, rnnkern_module, run_recurrence,
                      torch_module)

require_cuda_emulation()

from rnnkern import cuda_emulated, reference  # noqa: E402
import option_cases  # noqa: E402

EMU = "cuda_emulated"
PERSISTENT_CELLS = ["rnn_tanh", "rnn_relu", "lstm", "gru"]
SMS = 4
VARIANTS = {"plain": (None, False), "reverse": (None, True),
            "lengths": (torch.tensor([5, 2, 0, 4]), False),
            "lengths-reverse": (torch.tensor([1, 5, 3, 5]), True)}


@pytest.fixture(autouse=True)
def persistent_on_small_device():
    """Persistent kernels on, a 4-SM device model, and the reverse order: each
    released block runs on alone to its next grid barrier (the blocks out of
    step, as on hardware; in the forward order block barriers keep them in
    step and would hide a missing grid barrier).  Restored afterwards."""
    cuda_emulated.set_schedule("reverse", 0)
    cuda_emulated.set_device_model(SMS)
    cuda_emulated.set_persistent(True)
    yield
    cuda_emulated.set_persistent(False)
    cuda_emulated.set_device_model(132)
    cuda_emulated.set_schedule("forward", 0)


def counted(fn):
    """fn()'s result and the cooperative launches it made."""
    before = cuda_emulated.cooperative_launches()
    result = fn()
    return result, cuda_emulated.cooperative_launches() - before


def test_modes_and_switch():
    """The emulated device defaults to "never" (its suite proves the host loop);
    "always" (or True) takes the layer; a mode it does not know is refused."""
    cuda_emulated.set_persistent(False)
    assert cuda_emulated.persistent() == "never"
    args = recurrence_inputs("lstm", 3, 2, 5)
    _, n = counted(lambda: run_recurrence(EMU, "lstm", args))
    assert n == 0
    cuda_emulated.set_persistent(True)
    assert cuda_emulated.persistent() == "always"
    got, n = counted(lambda: run_recurrence(EMU, "lstm", args))  # inference: no workspace
    assert n == 1
    for a, b in zip(got, run_recurrence("reference", "lstm", args)):
        assert_close(a, b)
    with pytest.raises(ValueError, match="set_persistent: mode must be one of 'never', 'auto', "
                                         "'always' or a bool, got 2"):
        cuda_emulated.set_persistent(2)


# Auto's bounds (csrc/cuda/params.h: persistent_auto_staged): B x K values of h
# (forward, K = H) or da (backward, K = G x H: 4H for the LSTM) staged per step, at
# most 4096 in float64 and 12288 in float32; in the half types 65536 values x gates,
# the forward's values counted once per gate (G dot products each), so that both
# phases meet the bound at the same B (the LSTM's a quarter of the tanh RNN's); at
# least 32 steps.  (dtype, cell, H, the largest B of the backward, of the forward.)
AUTO_BOUNDS = {"fp64-lstm": (torch.float64, "lstm", 8, 128, 512),
               "fp32-lstm": (torch.float32, "lstm", 8, 384, 1536),
               "bf16-lstm": (torch.bfloat16, "lstm", 16, 1024, 1024),
               "bf16-rnn_tanh": (torch.bfloat16, "rnn_tanh", 16, 4096, 4096)}
# B: at the backward's bound, one past it, at the forward's, one past it.
AUTO_CASES = {"backward-bound": lambda bw, fw: bw, "past-backward": lambda bw, fw: bw + 1,
              "forward-bound": lambda bw, fw: fw, "past-forward": lambda bw, fw: fw + 1}


def auto_params():
    """(bounds, case) pairs, each B once: the half types' phases share one bound."""
    for bounds, (_, _, _, backward, forward) in AUTO_BOUNDS.items():
        seen = set()
        for case, batch in AUTO_CASES.items():
            if batch(backward, forward) not in seen:
                seen.add(batch(backward, forward))
                yield bounds, case
        yield bounds, "too-few-steps"


@pytest.mark.parametrize("bounds,case", list(auto_params()))
def test_auto_takes_small_batches_of_long_sequences(case, bounds):
    """"auto" runs the persistent kernel for a phase exactly when B x K (x G for the
    half types' forward) is within the bound of the element size and T >= 32: the
    LSTM's forward stages K = H values a row, its backward K = 4H; the phase it
    declines runs the host loop, and either way the values are the reference's
    (half types: no worse than the reference's own error in that dtype)."""
    dtype, cell, H, backward, forward = AUTO_BOUNDS[bounds]
    if case == "too-few-steps":
        T, B, launches = 31, 4, 0
    else:
        T, B = 32, AUTO_CASES[case](backward, forward)
        launches = int(B <= forward) + int(B <= backward)
    cuda_emulated.set_persistent("auto")
    assert cuda_emulated.persistent() == "auto"
    args = recurrence_inputs(cell, T, B, H, dtype=dtype, requires_grad=True, key=("persistent-auto", B))
    key = ("auto", B)
    got, n = counted(lambda: outputs_and_grads(EMU, cell, args, key=key))
    assert n == launches
    if dtype == torch.float64:
        want = outputs_and_grads("reference", cell, args, key=key)
        for name in want:
            assert_close(got[name], want[name], what=name)
        return
    a64 = {k: None if v is None else v.detach().double().requires_grad_() for k, v in args.items()}
    want = outputs_and_grads("reference", cell, a64, key=key)
    if dtype == torch.float32:
        for name in want:
            assert got[name].dtype == dtype, name
            assert_close(got[name], want[name].float(), what=name)
        return
    ref_low = outputs_and_grads("reference", cell, args, key=key)
    for name in want:
        assert got[name].dtype == dtype, name
        assert_low_precision(got[name], ref_low[name], want[name].float(), what=name)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("H", [3, 10, 33], ids=["H3-3ctas", "H10-uneven", "H33-9units"])
@pytest.mark.parametrize("cell", PERSISTENT_CELLS)
def test_matches_reference_float64(cell, H, variant):
    """Outputs, final states and the gradient of every input against the float64
    reference; one cooperative launch forward, one backward."""
    lengths, reverse = VARIANTS[variant]
    args = recurrence_inputs(cell, 5, 4, H, requires_grad=True, key=("persistent",))
    want = outputs_and_grads("reference", cell, args, lengths, reverse, key=(cell, H))
    got, n = counted(lambda: outputs_and_grads(EMU, cell, args, lengths, reverse, key=(cell, H)))
    assert n == 2
    assert set(got) == set(want)
    for name in want:
        assert_close(got[name], want[name], what=name)


@pytest.mark.parametrize("cell", PERSISTENT_CELLS)
def test_same_values_as_the_host_loop(cell):
    """The persistent kernels and the host loop (cuBLAS + pointwise kernels) of the
    same backend agree to float64 rounding: same unit functions, other sum order."""
    lengths = torch.tensor([6, 3, 6, 1, 4])
    args = recurrence_inputs(cell, 6, 5, 17, requires_grad=True, key=("persistent-host",))
    got, n = counted(lambda: outputs_and_grads(EMU, cell, args, lengths, True, key=(cell,)))
    assert n == 2
    cuda_emulated.set_persistent(False)
    host, n = counted(lambda: outputs_and_grads(EMU, cell, args, lengths, True, key=(cell,)))
    assert n == 0
    for name in host:
        torch.testing.assert_close(got[name], host[name], rtol=1e-13, atol=1e-13,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("variant", ["plain", "lengths-reverse"])
@pytest.mark.parametrize("cell", PERSISTENT_CELLS)
def test_gradcheck(cell, variant):
    lengths, reverse = VARIANTS[variant]
    args = recurrence_inputs(cell, 5, 4, 6, requires_grad=True, key=("persistent-gc",))
    names = [n for n, t in args.items() if t is not None]

    def f(*tensors):
        a = {**args, **dict(zip(names, tensors))}
        return tuple(t for t in run_recurrence(EMU, cell, a, lengths, reverse) if t is not None)

    _, n = counted(lambda: f(*(args[k] for k in names)))
    assert n == 1
    assert torch.autograd.gradcheck(f, [args[k] for k in names], fast_mode=True)


@pytest.mark.parametrize("variant", option_cases.VARIANTS)
@pytest.mark.parametrize("cell", PERSISTENT_CELLS)
def test_options_match_reference_float64(cell, variant):
    """Resets and zoneout (option_cases.py's variants) through the persistent kernels."""
    t, c = option_cases.option_inputs(cell, 0, variant, H=6, requires_grad=True,
                                      key=("persistent",))
    want = option_cases.outputs_and_grads("reference", cell, t, c, key=(cell, variant))
    got, n = counted(lambda: option_cases.outputs_and_grads(EMU, cell, t, c, key=(cell, variant)))
    assert n == 2
    for name in want:
        assert_close(got[name], want[name], what=name)


@pytest.mark.parametrize("variant", ["reset-state", "reset-state-all"])
@pytest.mark.parametrize("cell", PERSISTENT_CELLS)
def test_reset_state_matches_reference_float64(cell, variant):
    """A reset state of its own (reset_h, reset_c): the resets restart from it,
    each row's first step from h0, and its gradient is apart from h0's
    (tests/test_options.py's variants, with lengths, reverse and zoneout)."""
    t, c = option_cases.case_inputs(cell, 0, variant, H=6, requires_grad=True,
                                    key=("persistent-reset-state",))
    want = option_cases.outputs_and_grads("reference", cell, t, c, key=(cell, variant))
    got, n = counted(lambda: option_cases.outputs_and_grads(EMU, cell, t, c, key=(cell, variant)))
    assert n == 2
    assert set(got) == set(want) and "grad_reset_h" in got
    for name in want:
        assert_close(got[name], want[name], what=name)


@pytest.mark.parametrize("cell", PERSISTENT_CELLS)
def test_options_gradcheck(cell):
    """Resets, a training zoneout mask, lengths and reverse at once."""
    t, c = option_cases.option_inputs(cell, 0, "all-lengths-reverse", T=4, H=5,
                                      requires_grad=True, key=("persistent-gc",))
    names = [n for n in t if t[n] is not None]

    def f(*tensors):
        out, h_n, c_n = option_cases.run(EMU, cell, {**t, **dict(zip(names, tensors))}, c)
        return (out, h_n) if c_n is None else (out, h_n, c_n)

    _, n = counted(lambda: f(*(t[k] for k in names)))
    assert n == 1
    assert torch.autograd.gradcheck(f, [t[n] for n in names], fast_mode=True)


@pytest.mark.parametrize("order", ["forward", "shuffle"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_every_thread_order(cell, order):
    """The block barriers between staging, products and the units hold in any
    order of the threads' resumption (the blocks in step, or a random one ahead)."""
    cuda_emulated.set_schedule(order, 5)
    args = recurrence_inputs(cell, 4, 3, 11, requires_grad=True, key=("persistent-order",))
    lengths = torch.tensor([4, 1, 3])
    want = outputs_and_grads("reference", cell, args, lengths, False, key=(order,))
    got, n = counted(lambda: outputs_and_grads(EMU, cell, args, lengths, False, key=(order,)))
    assert n == 2
    for name in want:
        assert_close(got[name], want[name], what=f"{order} {name}")


@pytest.mark.parametrize("H", [24, 13], ids=["H24-chunks", "H13-elements"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cell", PERSISTENT_CELLS)
def test_lower_precisions(cell, dtype, H):
    """float32 within its tolerance of the float64 reference; half types no worse
    than the reference's own error in that dtype (products accumulated in float32).
    H=24 stages h in 16-byte chunks (float32's into rows of an odd word stride,
    element by element), H=13 element by element (rows not a multiple of 16 bytes)."""
    T, B = 7, 5
    lengths = torch.tensor([7, 5, 0, 3, 1])
    args = recurrence_inputs(cell, T, B, H, dtype=dtype, key=("persistent-low",))
    a = {k: None if v is None else v.requires_grad_() for k, v in args.items()}
    a64 = {k: None if v is None else v.detach().double().requires_grad_() for k, v in args.items()}
    key = ("persistent-low-cot", cell)
    want = outputs_and_grads("reference", cell, a64, lengths, True, key=key)
    got, n = counted(lambda: outputs_and_grads(EMU, cell, a, lengths, True, key=key))
    assert n == 2
    if dtype == torch.float32:
        for name in want:
            assert got[name].dtype == dtype
            assert_close(got[name], want[name].float(), what=name)
        return
    ref_low = outputs_and_grads("reference", cell, a, lengths, True, key=key)
    for name in want:
        assert got[name].dtype == dtype, name
        assert_low_precision(got[name], ref_low[name], want[name].float(), what=name)


@pytest.mark.parametrize("order", ["random", "sorted"])
def test_batch_in_several_tiles(order):
    """A batch whose rows of h do not all fit a CTA's shared memory with W's slice
    is staged in tiles: B = 700 float64 rows of H = 40 (about 580 fit).  Sorted
    longest first, the second tile drops out of the steps where all its rows
    are finished, and then the first tile's finished rows."""
    T, B, H = 3, 700, 40
    cell = "rnn_tanh"
    args = recurrence_inputs(cell, T, B, H, requires_grad=True, key=("persistent-tiles",))
    lengths = torch.randint(0, T + 1, (B,), generator=torch.Generator().manual_seed(4))
    if order == "sorted":
        lengths = lengths.sort(descending=True).values
    want = outputs_and_grads("reference", cell, args, lengths, False, key=("tiles",))
    got, n = counted(lambda: outputs_and_grads(EMU, cell, args, lengths, False, key=("tiles",)))
    assert n == 2
    for name in want:
        assert_close(got[name], want[name], what=name)


@pytest.mark.parametrize("cell", PERSISTENT_CELLS)
@pytest.mark.parametrize("lengths", [[8, 6, 6, 3, 1, 1], [2, 8, 1, 3, 1, 0]],
                         ids=["sorted", "unsorted"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_lengths_cost_their_live_rows(cell, lengths, reverse):
    """Each step of the persistent kernels stages (and multiplies) only the rows
    up to the last one still running, forward and backward, as the host loops'
    GEMMs take them: a batch sorted longest first (a packed batch) costs its real
    steps, not rows x longest.  Rows staged by each CTA, counted by the emulated
    device against the same call without lengths; the results are the host
    loop's (to float64 rounding), whose rows are the same."""
    T, B, H = 8, 6, 10
    args = recurrence_inputs(cell, T, B, H, key=("persistent-live", cell))
    a = {k: None if v is None else v.detach() for k, v in args.items()}
    family = torch.ops.rnnkern_cuda_emu

    def run(n):
        before = cuda_emulated.staged_rows()
        launches = cuda_emulated.cooperative_launches()
        out, h_n, c_n, ws = family.recurrence(cell, *a.values(), n, reverse, True)
        middle = cuda_emulated.staged_rows()
        grads = family.recurrence_backward(
            cell, torch.ones_like(out), torch.ones_like(h_n),
            torch.ones_like(c_n) if cell == "lstm" else None, a["h0"], a["c0"], a["w_hh"],
            a["w_hr"], out, ws, n, reverse)
        counts = middle - before, cuda_emulated.staged_rows() - middle
        return (out, h_n, c_n, *grads), counts, cuda_emulated.cooperative_launches() - launches

    _, full, launches = run(None)
    assert launches == 2 and full[0] > 0 and full[1] > 0
    got, live, launches = run(torch.tensor(lengths))
    assert launches == 2
    rows = sum(reference.live_rows(lengths, T))
    if lengths == sorted(lengths, reverse=True):
        assert rows == sum(lengths)  # the real steps
    assert rows < T * B
    assert live[0] * T * B == full[0] * rows, (live, full, rows)
    assert live[1] * T * B == full[1] * rows, (live, full, rows)
    cuda_emulated.set_persistent(False)
    want, _, launches = run(torch.tensor(lengths))
    assert launches == 0
    for i, (x, y) in enumerate(zip(got, want)):
        if x is None or x.numel() == 0:
            continue
        torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-13, msg=lambda m: f"result {i}: {m}")


@pytest.mark.parametrize("cell,proj", [("gru_reset_before", 0), ("lstm", 3), ("lstm_ln", 0)])
def test_cells_it_does_not_take_run_the_host_loop(cell, proj):
    """The reset-before GRU, the LSTM projection and LSTM-LN need more than one
    exchange per step: the host loop runs them, no cooperative launch."""
    if cell == "lstm_ln":
        t, c = option_cases.option_inputs(cell, 0, "plain", requires_grad=True, key=("fallback",))
        want = option_cases.outputs_and_grads("reference", cell, t, c, key=("fallback",))
        got, n = counted(lambda: option_cases.outputs_and_grads(EMU, cell, t, c, key=("fallback",)))
    else:
        args = recurrence_inputs(cell, 4, 3, 8, proj=proj, requires_grad=True, key=("fallback",))
        want = outputs_and_grads("reference", cell, args, key=("fallback",))
        got, n = counted(lambda: outputs_and_grads(EMU, cell, args, key=("fallback",)))
    assert n == 0
    for name in want:
        assert_close(got[name], want[name], what=name)


@pytest.mark.parametrize("cell", PERSISTENT_CELLS)
def test_modules_match_torch_nn(cell):
    """Two layers, both directions, packed variable lengths: torch.nn on the same
    weights, outputs and every gradient, float64, every layer and direction on
    the persistent kernels."""
    torch.manual_seed(3)
    theirs = torch_module(cell, 7, 9, num_layers=2, bidirectional=True, dtype=torch.float64)
    ours = rnnkern_module(cell, 7, 9, num_layers=2, bidirectional=True, dtype=torch.float64,
                          backend=EMU)
    ours.load_state_dict(theirs.state_dict())
    g = generator("persistent-packed", cell)
    x = randn(g, 6, 4, 7, requires_grad=True)
    lengths = torch.tensor([6, 2, 5, 1])
    results, launches = [], []
    for m in (theirs, ours):
        def run():
            out, hidden = m(torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False))
            leaves = [out.data] + list(hidden if isinstance(hidden, tuple) else (hidden,))
            cot = generator("persistent-packed-cot", cell)
            loss = sum((t * randn(cot, *t.shape)).sum() for t in leaves)
            return leaves + list(torch.autograd.grad(loss, [x, *m.parameters()]))
        r, n = counted(run)
        results.append(r)
        launches.append(n)
    assert launches == [0, 8]  # 2 layers x 2 directions, forward and backward
    for i, (a, b) in enumerate(zip(results[1], results[0])):
        assert_close(a, b, what=f"{cell} result {i}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_half_types_on_several_tensor_core_tiles(cell, dtype):
    """The half types' products on the tensor cores (WMMA 16x16x16) over several
    tiles each way: B = 20 rows (2 row tiles), H = 40 on 4 CTAs of 10 units (LSTM:
    40 outputs, 3 tiles), k = 40 forward and G*H = 120-160 backward (k not a
    multiple of 16: the zero padding), lengths in reverse; no worse than the
    reference's own error in that dtype."""
    T, B, H = 5, 20, 40
    lengths = torch.randint(0, T + 1, (B,), generator=torch.Generator().manual_seed(9))
    args = recurrence_inputs(cell, T, B, H, dtype=dtype, key=("persistent-mma",))
    a = {k: None if v is None else v.requires_grad_() for k, v in args.items()}
    a32 = {k: None if v is None else v.detach().float().requires_grad_() for k, v in args.items()}
    key = ("persistent-mma-cot", cell)
    want = outputs_and_grads("reference", cell, a32, lengths, True, key=key)
    ref_low = outputs_and_grads("reference", cell, a, lengths, True, key=key)
    got, n = counted(lambda: outputs_and_grads(EMU, cell, a, lengths, True, key=key))
    assert n == 2
    for name in want:
        assert got[name].dtype == dtype, name
        assert_low_precision(got[name], ref_low[name], want[name], what=name)


# ---- rows staged in pieces of k (persistent.cuh: persistent_plan, persistent_stage_and_multiply)

GATES = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3}
DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16",
               torch.bfloat16: "bfloat16"}


def plans(dtype, cell, H, B):
    """persistent_plan's choice for the forward (K = H, G outputs a unit) and the
    backward (K = G H, one output) of a layer, on the current device model."""
    name, g = DTYPE_NAMES[dtype], GATES[cell]
    return (cuda_emulated.persistent_plan(name, H, B, H, g),
            cuda_emulated.persistent_plan(name, H, B, g * H, 1))


def test_plan_stages_rows_in_pieces_where_they_do_not_fit():
    """On sm_90's 227 KiB of shared memory and 132 SMs: the half types' LSTM backward
    at H=1024 (K = 4096; W's slice of 8 columns padded to 16 rows, 131 KiB, and a
    16-row staging tile of 131 KiB more) stages its rows in two pieces of 2048 --
    before, the kernel declined it and the host loop ran -- with every warp busy
    (split 8); whole rows wherever they fit, as before: the forward at H=1024, the
    GRU's backward at H=1024, the LSTM's at H=768, float32; and nothing where W's
    slice alone does not fit."""
    cuda_emulated.set_device_model(132)
    assert cuda_emulated.shared_per_block() == 227 * 1024
    for dtype in (torch.bfloat16, torch.float16):
        forward, backward = plans(dtype, "lstm", 1024, 16)
        assert forward["k_piece"] == forward["K"] == 1024
        assert backward["K"] == 4096 and backward["k_piece"] == 2048
        assert backward["split"] == 8 and backward["batch_tile"] == 16
        assert backward["smem"] <= 227 * 1024
        assert plans(dtype, "lstm", 1024, 2)[1]["k_piece"] == 2048  # fewer rows than a tile
        assert plans(dtype, "gru", 1024, 16)[1]["k_piece"] == 3072
        assert plans(dtype, "lstm", 768, 16)[1]["k_piece"] == 3072
        # H=1600: 13 columns of 6400, 12 pieces of 544 (multiples of 16, as equal as they come)
        wide = plans(dtype, "lstm", 1600, 16)[1]
        assert wide["k_piece"] == 544 and wide["smem"] <= 227 * 1024
        assert plans(dtype, "lstm", 2048, 16)[0] is None  # W's slice alone: 263 KiB
    fp32 = plans(torch.float32, "lstm", 1024, 16)[1]
    assert fp32["k_piece"] == 4096 and fp32["batch_tile"] == 6


def test_time_model_plans_as_the_kernels():
    """bench.persistent_model's copy of persistent_plan (units, tile, split, pieces
    of k, shared memory) gives the kernels' plan, fit or not, on sm_90's 132 SMs.
    (Loaded from its file: the sanitizer runs of .ci/cuda_emulation.sh start elsewhere.)"""
    path = Path(__file__).resolve().parents[1] / "bench" / "persistent_model.py"
    spec = importlib.util.spec_from_file_location("persistent_model", path)
    pm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pm)
    cuda_emulated.set_device_model(132)
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for H in (5, 33, 768, 907, 1024, 1600, 2048):
            for B in (1, 16, 256):
                for K, outputs in ((H, 4), (H, 3), (H, 1), (4 * H, 1), (3 * H, 1)):
                    kernel = cuda_emulated.persistent_plan(dtype, H, B, K, outputs)
                    model = pm.plan(H, B, K, outputs, dtype)
                    where = (dtype, H, B, K, outputs)
                    assert (kernel is None) == (not model), where
                    if kernel is not None:
                        assert {k: model[k] for k in kernel} == kernel, where


def least_budget(dtype, cell, H, B, direction, whole=False):
    """The least shared memory per block at which a direction's kernel fits (with
    whole rows, if asked) on SMS multiprocessors."""
    def fit(budget):
        cuda_emulated.set_device_model(SMS, 64, budget)
        p = plans(dtype, cell, H, B)[direction]
        return p is not None and (not whole or p["k_piece"] == p["K"])
    lo, hi = 1, 227 * 1024
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fit(mid) else (mid + 1, hi)
    return lo


def smallest_budget(dtype, cell, H, B, whole=False):
    """The least shared memory per block at which both directions' kernels fit (with
    whole rows, if asked): where a tile of whole rows does not fit beside W's slice,
    the rows go in pieces."""
    return max(least_budget(dtype, cell, H, B, d, whole) for d in (0, 1))


# (dtype, cell): the half types take pieces in both directions at the least budget
# (their tiles pad to 16 rows); float64 in the backward of the LSTM and the GRU (K = G H).
PIECE_CASES = [(torch.bfloat16, c) for c in PERSISTENT_CELLS] + [(torch.float16, "lstm")] + \
              [(torch.float64, c) for c in ("lstm", "gru")]


@pytest.mark.parametrize("variant", ["plain", "lengths-reverse"])
@pytest.mark.parametrize("dtype,cell", PIECE_CASES,
                         ids=[f"{DTYPE_NAMES[d]}-{c}" for d, c in PIECE_CASES])
def test_rows_in_pieces_match_reference(dtype, cell, variant):
    """A device model with just enough shared memory for W's slice and a tile of rows
    in pieces of k (H=40: the pieces 32 + 8 long, the short last one padded with
    zeros for the tensor cores): one cooperative launch each way, every output and
    gradient against the reference (float64: to its tolerance, and to 1e-13 of the
    same kernels staging whole rows; half types no worse than the reference's own
    error in that dtype)."""
    lengths, reverse = {"plain": (None, False),
                        "lengths-reverse": (torch.tensor([1, 5, 3, 5]), True)}[variant]
    T, B, H = 5, 4, 40
    cuda_emulated.set_device_model(SMS, 64, smallest_budget(dtype, cell, H, B))
    forward, backward = plans(dtype, cell, H, B)
    assert backward["k_piece"] < backward["K"]
    if dtype != torch.float64:
        assert forward["k_piece"] < forward["K"]
    args = recurrence_inputs(cell, T, B, H, dtype=dtype, requires_grad=True,
                             key=("persistent-pieces",))
    key = ("pieces", cell, variant)
    got, n = counted(lambda: outputs_and_grads(EMU, cell, args, lengths, reverse, key=key))
    assert n == 2
    if dtype == torch.float64:
        want = outputs_and_grads("reference", cell, args, lengths, reverse, key=key)
        cuda_emulated.set_device_model(SMS)
        assert all(p["k_piece"] == p["K"] for p in plans(dtype, cell, H, B))
        whole, n = counted(lambda: outputs_and_grads(EMU, cell, args, lengths, reverse, key=key))
        assert n == 2
        for name in want:
            assert_close(got[name], want[name], what=name)
            torch.testing.assert_close(got[name], whole[name], rtol=1e-13, atol=1e-13,
                                       msg=lambda m: f"{name}: {m}")
        return
    a32 = {k: None if v is None else v.detach().float().requires_grad_() for k, v in args.items()}
    want = outputs_and_grads("reference", cell, a32, lengths, reverse, key=key)
    ref_low = outputs_and_grads("reference", cell, args, lengths, reverse, key=key)
    for name in want:
        assert got[name].dtype == dtype, name
        assert_low_precision(got[name], ref_low[name], want[name], what=name)


def piece_budget(dtype, cell, H, B, where):
    """A budget at which both directions fit and one at least stages in pieces (`where`
    in [0, 1) places it in that window), or None where the size has no such window."""
    fits = smallest_budget(dtype, cell, H, B)
    whole = smallest_budget(dtype, cell, H, B, whole=True)
    return None if fits >= whole else fits + int(where * (whole - fits))


def _piece_shapes(n=12):
    """(cell, dtype, H, B, T, budget, lengths or None) drawn, seeded, among the sizes
    whose rows go in pieces at some budget; computed once (the device model restored)."""
    g = torch.Generator().manual_seed(81)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    shapes = []
    try:
        while len(shapes) < n:
            i = len(shapes)
            cell = PERSISTENT_CELLS[i % 4]
            dtype = (torch.float64, torch.bfloat16, torch.float16)[i % 3]
            H, B, T = draw(2, 60), draw(1, 20), draw(2, 6)
            lengths = torch.randint(0, T + 1, (B,), generator=g) if i % 2 else None
            budget = piece_budget(dtype, cell, H, B, draw(0, 99) / 100)
            if budget is not None:
                shapes.append((cell, dtype, H, B, T, budget, lengths))
    finally:
        cuda_emulated.set_device_model(132)
    return shapes


PIECE_SHAPES = _piece_shapes()


@pytest.mark.parametrize("cell,dtype,H,B,T,budget,lengths", PIECE_SHAPES,
                         ids=[f"{c}-{DTYPE_NAMES[d]}-H{h}-B{b}" for c, d, h, b, *_ in PIECE_SHAPES])
def test_rows_in_pieces_at_drawn_sizes(cell, dtype, H, B, T, budget, lengths):
    """Sizes drawn at random (H 2-60 over 4 CTAs, B 1-20, lengths or not) on a device
    model whose shared memory lets both directions fit with one of them in pieces of k
    (pieces of the lengths the plan makes, tiles of fewer than 16 rows, K not a
    multiple of 16): one cooperative launch each way; float64 against the reference,
    the half types against the same kernels staging whole rows, within torch's
    default tolerance for the dtype (their products differ only in the order of
    float32 sums; against the reference a drawn ReLU pre-activation near 0 can flip
    its mask in either rounding, which test_rows_in_pieces_match_reference's fixed
    data does not meet)."""
    cuda_emulated.set_device_model(SMS, 64, budget)
    forward, backward = plans(dtype, cell, H, B)
    assert forward["k_piece"] < forward["K"] or backward["k_piece"] < backward["K"]
    args = recurrence_inputs(cell, T, B, H, dtype=dtype, requires_grad=True,
                             key=("persistent-pieces-drawn", H, B))
    key = ("pieces-drawn", cell, H, B)
    got, n = counted(lambda: outputs_and_grads(EMU, cell, args, lengths, True, key=key))
    assert n == 2
    if dtype == torch.float64:
        want = outputs_and_grads("reference", cell, args, lengths, True, key=key)
    else:
        cuda_emulated.set_device_model(SMS)
        assert all(p["k_piece"] == p["K"] for p in plans(dtype, cell, H, B))
        want, n = counted(lambda: outputs_and_grads(EMU, cell, args, lengths, True, key=key))
        assert n == 2
    for name in want:
        assert got[name].dtype == dtype, name
        if dtype == torch.float64:
            assert_close(got[name], want[name], what=name)
        else:
            torch.testing.assert_close(got[name], want[name], msg=lambda m: f"{name}: {m}")


# What each row's units read at a step from the arrays laid out by time, in values
# per hidden unit (persistent.cuh: persistent_prefetch_forward / _backward): the
# forward's G gates of xproj; the backward's output gradient, workspace row and
# (the RNN) its output, and from the row's previous position the LSTM's c (the
# workspace's fifth value) or the GRU's h.
PREFETCHED_FORWARD = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3}
PREFETCHED_BACKWARD = {"rnn_tanh": (2, 0), "rnn_relu": (2, 0), "lstm": (6, 1), "gru": (5, 1)}


@pytest.mark.parametrize("cell", PERSISTENT_CELLS)
@pytest.mark.parametrize("lengths", [None, [7, 5, 5, 2, 1, 0], [2, 7, 1, 3, 1, 0]],
                         ids=["dense", "sorted", "unsorted"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_next_step_prefetched_during_the_barrier(cell, lengths, reverse, monkeypatch):
    """Before each grid barrier every CTA asks for the next step's cold values of
    its units (the input projection forward; the output gradient, workspace and
    outputs backward) to be fetched into L2, of the rows that run that step and
    no others: the bytes asked for, counted by the emulated device (which reads
    every address, so the sanitizer runs check them), are exactly those values,
    every unit of every CTA once.  RNNKERN_CUDA_PREFETCH=0 asks for nothing and
    gives the same bits; another value is refused."""
    T, B, H = 7, 6, 10  # 3 units a CTA on the 4-SM model, the last CTA 1
    args = recurrence_inputs(cell, T, B, H, key=("persistent-prefetch", cell))
    a = {k: None if v is None else v.detach() for k, v in args.items()}
    n = None if lengths is None else torch.tensor(lengths)
    family = torch.ops.rnnkern_cuda_emu

    def run():
        start = cuda_emulated.prefetched_bytes()
        out, h_n, c_n, ws = family.recurrence(cell, *a.values(), n, reverse, True)
        middle = cuda_emulated.prefetched_bytes()
        grads = family.recurrence_backward(
            cell, randn(generator("prefetch-gout", cell), *out.shape),
            torch.ones_like(h_n), torch.ones_like(c_n) if cell == "lstm" else None, a["h0"],
            a["c0"], a["w_hh"], a["w_hr"], out, ws, n, reverse)
        return (out, h_n, c_n, *grads), (middle - start, cuda_emulated.prefetched_bytes() - middle)

    def running(s):  # rows that run step s (steps count from each row's own start)
        return B if lengths is None else sum(s < length for length in lengths)

    element = torch.finfo(torch.float64).bits // 8
    forward = sum(running(s) for s in range(1, T)) * PREFETCHED_FORWARD[cell] * H * element
    per_row, from_previous = PREFETCHED_BACKWARD[cell]
    backward = sum(running(s) * (per_row + (from_previous if s > 0 else 0))
                   for s in range(T - 1)) * H * element
    (got, counts), launches = counted(run)
    assert launches == 2
    assert counts == (forward, backward)
    monkeypatch.setenv("RNNKERN_CUDA_PREFETCH", "0")
    (want, counts), launches = counted(run)
    assert launches == 2 and counts == (0, 0)
    for i, (x, y) in enumerate(zip(got, want)):
        if x is not None:
            assert torch.equal(x, y), f"result {i}"
    monkeypatch.setenv("RNNKERN_CUDA_PREFETCH", "yes")
    with pytest.raises(ValueError, match="RNNKERN_CUDA_PREFETCH must be 0 or 1, got 'yes'"):
        run()

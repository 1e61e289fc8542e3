"""The options of the ops beyond torch.nn (the step options and the LayerNorm cell), on every backend, against
the reference: per-step state resets (``resets``), zoneout (``zoneout``) and the
layer-normalised LSTM (cell ``lstm_ln`` with its ``ln`` parameters).

Every backend runs every option (``rnnkern.modules.UNSUPPORTED`` lists none of
them, tested below).  The reference itself is checked against the
rules it encodes: a reset splits a sequence, a zoneout mask of ones freezes the
state, lstm_ln equals a layer-norm LSTM written with torch.nn.LayerNorm.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rnnkern import modules, ops, reference
from conftest import CELLS, assert_close, assert_low_precision, generator, randn

BACKENDS = ["reference", "cpu", "triton"] + (["cuda_emulated"] if ops.WITH_CUDA_EMULATION else [])
#: (cell, proj): every torch.nn cell, the classic GRU, the projected LSTM and lstm_ln.
CASES = [(cell, 0) for cell in CELLS] + [("lstm", 3), ("lstm_ln", 0)]
CASE_IDS = [f"{c}-proj{p}" if p else c for c, p in CASES]
#: Which options a call uses, by variant.
VARIANTS = {
    "resets": dict(resets=True),
    "zoneout": dict(zoneout="train"),
    "zoneout-eval": dict(zoneout="eval"),
    "all-lengths-reverse": dict(resets=True, zoneout="train", lengths=True, reverse=True),
    "plain": dict(),  # lstm_ln alone
    # a reset state of its own (reset_h, reset_c): resets restart from it
    "reset-state": dict(resets=True, reset_state=True),
    "reset-state-all": dict(resets=True, reset_state=True, zoneout="train", lengths=True,
                            reverse=True),
}
DIFFERENTIABLE = ("xproj", "h0", "c0", "w_hh", "b_ih", "b_hh", "w_hr", "ln", "reset_h", "reset_c")


def has_c(cell: str) -> bool:
    return cell in ("lstm", "lstm_ln")


def test_every_backend_runs_every_option():
    """No backend lists resets, zoneout or LayerNormLSTM as unsupported: the
    tests below run all of them on every backend."""
    for backend in BACKENDS + ["cuda"]:
        assert not {"resets", "zoneout", "LayerNormLSTM"} & modules.UNSUPPORTED[backend], backend


def case_inputs(cell, proj, variant, T=6, B=3, H=5, dtype=torch.float64, requires_grad=False,
                key=()):
    """Random op arguments (weights at torch.nn's scale, non-zero states) and
    the masks of the variant.  Returns (tensors, constants)."""
    g = generator("options", cell, proj, variant, T, B, H, str(dtype), *key)
    G = reference.gate_count(cell)
    P = proj or H
    s = H ** -0.5
    rg = requires_grad
    tensors = dict(
        xproj=randn(g, T, B, G * H, dtype=dtype, requires_grad=rg),
        h0=randn(g, B, P, dtype=dtype, scale=0.5, requires_grad=rg),
        c0=randn(g, B, H, dtype=dtype, scale=0.5, requires_grad=rg) if has_c(cell) else None,
        w_hh=randn(g, G * H, P, dtype=dtype, scale=s, requires_grad=rg),
        b_ih=randn(g, G * H, dtype=dtype, scale=s, requires_grad=rg),
        b_hh=randn(g, G * H, dtype=dtype, scale=s, requires_grad=rg),
        w_hr=randn(g, P, H, dtype=dtype, scale=s, requires_grad=rg) if proj else None,
        # gains around 1, shift around 0: a layer norm as trained, not the identity
        ln=((1 + 0.3 * randn(g, 10 * H)) * torch.cat([torch.ones(9 * H), 0.3 * torch.ones(H)]))
        .to(dtype).requires_grad_(rg) if cell == "lstm_ln" else None,
    )
    v = VARIANTS[variant]
    reset_state = v.get("reset_state")
    tensors["reset_h"] = randn(g, B, P, dtype=dtype, scale=0.5, requires_grad=rg) \
        if reset_state else None
    tensors["reset_c"] = randn(g, B, H, dtype=dtype, scale=0.5, requires_grad=rg) \
        if reset_state and has_c(cell) else None
    Z = reference.zoneout_width(cell, H, P)
    resets = zoneout = lengths = None
    if v.get("resets"):
        resets = torch.rand(T, B, generator=g) < 0.35
        resets[min(2, T - 1), 0] = True  # at least one inside the first sequence
        if reset_state:  # at each row's first step (the op ignores it: h0 enters there)
            resets[T - 1 if v.get("reverse") else 0, :] = True
    if v.get("zoneout") == "train":
        zoneout = (torch.rand(T, B, Z, generator=g) < 0.4).to(dtype)
    elif v.get("zoneout") == "eval":
        zoneout = torch.full((Z,), 0.3, dtype=dtype).expand(T, B, Z)  # strides (0, 0, 1)
    if v.get("lengths"):
        lengths = torch.tensor([T, 0, max(1, T // 2)] + [T] * (B - 3))[:B]
    return tensors, dict(resets=resets, zoneout=zoneout, lengths=lengths,
                         reverse=bool(v.get("reverse")))


def run(backend, cell, tensors, consts):
    t, c = tensors, consts
    return ops.recurrence(cell, t["xproj"], t["h0"], t["c0"], t["w_hh"], t["b_ih"], t["b_hh"],
                          t["w_hr"], c["lengths"], c["reverse"], backend=backend,
                          resets=c["resets"], zoneout=c["zoneout"], ln=t["ln"],
                          reset_h=t.get("reset_h"), reset_c=t.get("reset_c"))


def outputs_and_grads(backend, cell, tensors, consts, key=()):
    """Outputs, final states and the gradient of every tensor input under a
    random linear functional of all outputs (cotangents drawn on the CPU; also
    used by test_cpu.py and option_cases.py)."""
    out = [o for o in run(backend, cell, tensors, consts) if o is not None]
    g = generator("cotangent", *key)
    loss = sum((o * randn(g, *o.shape, dtype=o.dtype).to(o.device)).sum() for o in out)
    names = [n for n in DIFFERENTIABLE if tensors.get(n) is not None]
    grads = torch.autograd.grad(loss, [tensors[n] for n in names])
    return dict(zip(["output", "h_n", "c_n"], out)) | {f"grad_{n}": gr for n, gr in zip(names, grads)}


def variants_of(cell):
    return (["plain", "resets", "zoneout-eval", "all-lengths-reverse"] if cell == "lstm_ln" else
            ["resets", "zoneout", "zoneout-eval", "all-lengths-reverse"]) + \
        ["reset-state", "reset-state-all"]


ALL = [(c, p, v) for c, p in CASES for v in variants_of(c)]
ALL_IDS = [f"{c}-proj{p}-{v}" if p else f"{c}-{v}" for c, p, v in ALL]


# ------------------------------------------------ the reference's own rules ----

@pytest.mark.parametrize("cell", CELLS + ("lstm_ln",))
def test_reference_reset_splits_the_sequence(cell):
    """A reset at position t of row b: from t on, row b computes what a fresh
    sequence started from h0 at t computes."""
    tensors, _ = case_inputs(cell, 0, "plain", T=7, B=3, key=("split",))
    resets = torch.zeros(7, 3, dtype=torch.bool)
    resets[3, 1] = True
    out, _, _ = reference.recurrence(cell, *(tensors[n] for n in DIFFERENTIABLE[:7]),
                                     resets=resets, ln=tensors["ln"])
    tail = {**tensors, "xproj": tensors["xproj"][3:]}
    want, _, _ = reference.recurrence(cell, *(tail[n] for n in DIFFERENTIABLE[:7]), ln=tensors["ln"])
    torch.testing.assert_close(out[3:, 1], want[:, 1], rtol=0, atol=0)
    plain, _, _ = reference.recurrence(cell, *(tensors[n] for n in DIFFERENTIABLE[:7]),
                                       ln=tensors["ln"])
    torch.testing.assert_close(out[:, [0, 2]], plain[:, [0, 2]], rtol=0, atol=0)
    assert not torch.equal(out[3:, 1], plain[3:, 1])


@pytest.mark.parametrize("cell", CELLS + ("lstm_ln",))
def test_reference_reset_state_restarts_later_steps(cell):
    """With a reset state of its own: a reset at position t > 0 of row b makes
    row b compute, from t on, what a fresh sequence started from reset_h
    (reset_c) at t computes; a reset at a row's first step changes nothing
    (h0 enters there: the op's rule, which leaves that case to its caller)."""
    tensors, _ = case_inputs(cell, 0, "reset-state", T=7, B=3, key=("split-state",))
    resets = torch.zeros(7, 3, dtype=torch.bool)
    resets[3, 1] = True
    resets[0, 2] = True
    args = [tensors[n] for n in DIFFERENTIABLE[:7]]
    out, h_n, _ = reference.recurrence(cell, *args, resets=resets, ln=tensors["ln"],
                                       reset_h=tensors["reset_h"], reset_c=tensors["reset_c"])
    tail = {**tensors, "xproj": tensors["xproj"][3:], "h0": tensors["reset_h"],
            "c0": tensors["reset_c"]}
    want, _, _ = reference.recurrence(cell, *(tail[n] for n in DIFFERENTIABLE[:7]), ln=tensors["ln"])
    torch.testing.assert_close(out[3:, 1], want[:, 1], rtol=0, atol=0)
    plain, _, _ = reference.recurrence(cell, *args, ln=tensors["ln"])
    torch.testing.assert_close(out[:, [0, 2]], plain[:, [0, 2]], rtol=0, atol=0)
    assert not torch.equal(out[3:, 1], plain[3:, 1])


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh", "lstm_ln"])
def test_reference_zoneout_masks(cell):
    """Mask of ones: every state stays h0 (c0); mask of zeros: no zoneout; p in
    evaluation: the blend of the two updates."""
    tensors, _ = case_inputs(cell, 0, "plain", key=("zoneout-rules",))
    T, B, H = 6, 3, 5
    Z = reference.zoneout_width(cell, H, H)
    args = [tensors[n] for n in DIFFERENTIABLE[:7]]
    ones = torch.ones(T, B, Z, dtype=torch.float64)
    out, h, c = reference.recurrence(cell, *args, zoneout=ones, ln=tensors["ln"])
    torch.testing.assert_close(out, tensors["h0"].expand(T, B, H), rtol=0, atol=0)
    if c is not None:
        torch.testing.assert_close(c, tensors["c0"], rtol=0, atol=0)
    out0, _, _ = reference.recurrence(cell, *args, zoneout=0 * ones, ln=tensors["ln"])
    plain, _, _ = reference.recurrence(cell, *args, ln=tensors["ln"])
    torch.testing.assert_close(out0, plain, rtol=0, atol=0)
    # one step in evaluation mode: p * h0 + (1 - p) * (the plain step's h)
    out_p, _, _ = reference.recurrence(cell, *args, zoneout=0.3 * ones, ln=tensors["ln"])
    torch.testing.assert_close(out_p[0], 0.3 * tensors["h0"] + 0.7 * plain[0])


def test_reference_lstm_ln_is_a_layer_norm_lstm():
    """lstm_ln against a layer-norm LSTM written from torch.nn.LayerNorm modules
    (haste's formulation, torch's gate order)."""
    T, B, I, H = 5, 3, 4, 6
    g = generator("lstm-ln-modules")
    x = randn(g, T, B, I)
    w_ih, w_hh = randn(g, 4 * H, I, scale=0.4), randn(g, 4 * H, H, scale=0.4)
    b = randn(g, 4 * H, scale=0.3)
    h, c = randn(g, B, H, scale=0.5), randn(g, B, H, scale=0.5)
    ln_x = torch.nn.LayerNorm(4 * H, elementwise_affine=True, bias=False, dtype=torch.float64)
    ln_h = torch.nn.LayerNorm(4 * H, elementwise_affine=True, bias=False, dtype=torch.float64)
    ln_c = torch.nn.LayerNorm(H, dtype=torch.float64)
    with torch.no_grad():
        for m in (ln_x, ln_h, ln_c):
            m.weight.copy_(1 + 0.3 * randn(g, *m.weight.shape))
        ln_c.bias.copy_(0.3 * randn(g, H))
    outs = []
    h_, c_ = h, c
    for t in range(T):
        i, f, gg, o = (ln_x(x[t] @ w_ih.t()) + ln_h(h_ @ w_hh.t()) + b).chunk(4, 1)
        c_ = torch.sigmoid(f) * c_ + torch.sigmoid(i) * torch.tanh(gg)
        h_ = torch.sigmoid(o) * torch.tanh(ln_c(c_))
        outs.append(h_)
    ln = torch.cat([ln_x.weight, ln_h.weight, ln_c.weight, ln_c.bias]).detach()
    out, h_n, c_n = reference.layer("lstm_ln", x, h, c, w_ih, w_hh, b, None, ln=ln)
    torch.testing.assert_close(out, torch.stack(outs).detach())
    torch.testing.assert_close(c_n, c_.detach())
    h1, c1 = reference.step("lstm_ln", x[0], h, c, w_ih, w_hh, b, None, ln)
    torch.testing.assert_close(h1, outs[0].detach())


# ------------------------------------------------------------- the backends ----

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell,proj,variant", ALL, ids=ALL_IDS)
def test_matches_reference_float64(backend, cell, proj, variant):
    """Outputs, final states and every gradient against the reference, float64."""
    tensors, consts = case_inputs(cell, proj, variant, requires_grad=True)
    want = outputs_and_grads("reference", cell, tensors, consts, key=(cell, variant))
    got = outputs_and_grads(backend, cell, tensors, consts, key=(cell, variant))
    assert set(got) == set(want)
    for name in want:
        assert_close(got[name], want[name], what=f"{backend} {name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell,proj,variant", ALL, ids=ALL_IDS)
def test_gradcheck(backend, cell, proj, variant):
    """float64 gradcheck w.r.t. every tensor input (fast mode: random
    projections of the Jacobian, so the interpreted Triton kernels stay quick)."""
    tensors, consts = case_inputs(cell, proj, variant, T=4, B=3, H=3, requires_grad=True,
                                  key=("gradcheck",))
    names = [n for n in DIFFERENTIABLE if tensors.get(n) is not None]

    def f(*ts):
        out, h_n, c_n = run(backend, cell, {**tensors, **dict(zip(names, ts))}, consts)
        return (out, h_n) if c_n is None else (out, h_n, c_n)

    assert torch.autograd.gradcheck(f, [tensors[n] for n in names], fast_mode=True)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("cell,proj", CASES, ids=CASE_IDS)
def test_float32_matches_reference(backend, cell, proj):
    """float32 with every option at once, against the float64 reference."""
    tensors, consts = case_inputs(cell, proj, "all-lengths-reverse", H=9, requires_grad=True,
                                  key=("f32",))
    want = outputs_and_grads("reference", cell, tensors, consts, key=("f32",))
    t32 = {n: None if t is None else t.detach().float().requires_grad_() for n, t in tensors.items()}
    c32 = dict(consts, zoneout=None if consts["zoneout"] is None else consts["zoneout"].float())
    got = outputs_and_grads(backend, cell, t32, c32, key=("f32",))
    for name in want:
        assert_close(got[name], want[name].float(), dtype=torch.float32, what=f"{backend} {name}")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("cell", ["lstm", "gru", "lstm_ln"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_within_reference_error(backend, cell, dtype):
    """Half types with every option: within the reference's own error in that dtype."""
    tensors, consts = case_inputs(cell, 0, "all-lengths-reverse", H=8, requires_grad=True,
                                  key=("half",))
    want = outputs_and_grads("reference", cell, tensors, consts, key=("half",))

    def cast(ts, dt):
        return {n: None if t is None else t.detach().to(dt).requires_grad_() for n, t in ts.items()}

    def cast_consts(dt):
        return dict(consts, zoneout=None if consts["zoneout"] is None else consts["zoneout"].to(dt))

    ref_lp = outputs_and_grads("reference", cell, cast(tensors, dtype), cast_consts(dtype),
                               key=("half",))
    got = outputs_and_grads(backend, cell, cast(tensors, dtype), cast_consts(dtype), key=("half",))
    for name in want:
        assert_low_precision(got[name], ref_lp[name], want[name], what=f"{backend} {name}")


# ----------------------------------------------------------- lstm_ln step ----

def step_case(B=3, I=4, H=5, dtype=torch.float64, requires_grad=False, key=()):
    g = generator("ln-step", B, I, H, str(dtype), *key)
    s = H ** -0.5
    rg = requires_grad
    return dict(
        x=randn(g, B, I, dtype=dtype, requires_grad=rg),
        h=randn(g, B, H, dtype=dtype, scale=0.5, requires_grad=rg),
        c=randn(g, B, H, dtype=dtype, scale=0.5, requires_grad=rg),
        w_ih=randn(g, 4 * H, I, dtype=dtype, scale=s, requires_grad=rg),
        w_hh=randn(g, 4 * H, H, dtype=dtype, scale=s, requires_grad=rg),
        b_ih=randn(g, 4 * H, dtype=dtype, scale=s, requires_grad=rg),
        b_hh=randn(g, 4 * H, dtype=dtype, scale=s, requires_grad=rg),
        ln=(1 + 0.3 * randn(g, 10 * H, dtype=dtype)).requires_grad_(rg),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_lstm_ln_step_matches_reference(backend):
    a = step_case(requires_grad=True)
    args = list(a.values())

    def results(b):
        h, c = ops.step("lstm_ln", *args[:7], backend=b, ln=a["ln"])
        g = generator("ln-step-cotangent")
        loss = (h * randn(g, *h.shape)).sum() + (c * randn(g, *c.shape)).sum()
        return [h, c, *torch.autograd.grad(loss, args)]

    for got, want in zip(results(backend), results("reference")):
        assert_close(got, want, what=backend)
    assert torch.autograd.gradcheck(
        lambda *t: ops.step("lstm_ln", *t[:7], backend=backend, ln=t[7]), args, fast_mode=True)


# ------------------------------------------------------ opcheck and errors ----

@pytest.mark.parametrize("backend", ["cpu"] + (["cuda_emulated"] if ops.WITH_CUDA_EMULATION else []))
@pytest.mark.parametrize("cell,proj,variant", [("lstm", 3, "all-lengths-reverse"),
                                               ("gru", 0, "all-lengths-reverse"),
                                               ("lstm_ln", 0, "all-lengths-reverse"),
                                               ("lstm", 3, "reset-state-all"),
                                               ("gru", 0, "reset-state-all")])
def test_opcheck(backend, cell, proj, variant):
    family = torch.ops.rnnkern if backend == "cpu" else torch.ops.rnnkern_cuda_emu
    t, c = case_inputs(cell, proj, variant, T=4, B=3, H=4, requires_grad=True, key=("opcheck",))
    torch.library.opcheck(family.recurrence.default,
                          (cell, t["xproj"], t["h0"], t["c0"], t["w_hh"], t["b_ih"], t["b_hh"],
                           t["w_hr"], c["lengths"], c["reverse"], True, c["resets"],
                           c["zoneout"].contiguous(), t["ln"], t["reset_h"], t["reset_c"]))


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_bad_options_are_named(backend):
    """Wrong shapes and dtypes of the new arguments: an error naming the argument."""
    t, c = case_inputs("lstm", 0, "all-lengths-reverse", key=("errors",))
    args = [t[n] for n in DIFFERENTIABLE[:7]]
    T, B = 6, 3

    def call(cell="lstm", args=args, **kw):
        return ops.recurrence(cell, *args, None, False, backend=backend, **kw)

    with pytest.raises(ValueError, match=r"resets of shape \[6, 3\]"):
        call(resets=torch.zeros(T, B + 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="resets of dtype torch.bool"):
        call(resets=torch.zeros(T, B))
    with pytest.raises(ValueError, match=r"zoneout of shape \[6, 3, 10\]"):
        call(zoneout=torch.zeros(T, B, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="zoneout of dtype"):
        call(zoneout=torch.zeros(T, B, 10, dtype=torch.float32))
    with pytest.raises(ValueError, match="ln is only defined for lstm_ln"):
        call(ln=torch.ones(50, dtype=torch.float64))
    with pytest.raises(ValueError, match="lstm_ln needs ln"):
        call(cell="lstm_ln")
    with pytest.raises(ValueError, match=r"expected ln of shape \[50\]"):
        call(cell="lstm_ln", ln=torch.ones(40, dtype=torch.float64))
    with pytest.raises(ValueError, match="w_hr"):
        ln_args = args[:6] + [torch.ones(5, 5, dtype=torch.float64)]
        call(cell="lstm_ln", args=ln_args, ln=torch.ones(50, dtype=torch.float64))
    resets = torch.zeros(T, B, dtype=torch.bool)
    state = torch.zeros(B, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="reset_h given without resets"):
        call(reset_h=state, reset_c=state)
    with pytest.raises(ValueError, match=r"reset_h of shape \[3, 5\]"):
        call(resets=resets, reset_h=torch.zeros(B, 4, dtype=torch.float64), reset_c=state)
    with pytest.raises(TypeError, match="reset_c of dtype"):
        call(resets=resets, reset_h=state, reset_c=state.float())
    with pytest.raises(ValueError, match="lstm needs reset_c with reset_h"):
        call(resets=resets, reset_h=state)
    with pytest.raises(ValueError, match="reset_c given without reset_h"):
        call(resets=resets, reset_c=state)
    with pytest.raises(ValueError, match="reset_c is only defined for the cells with a cell"):
        gru_args = [args[0][:, :, :15], args[1], None, args[3][:15], args[4][:15], args[5][:15],
                    None]
        call(cell="gru", args=gru_args, resets=resets, reset_h=state, reset_c=state)


def test_zoneout_gradient_respects_the_mask():
    """With every unit of row 0 zoned out at the last step, the gradient of its
    last output reaches h0 only through the frozen path (reference and cpu agree)."""
    tensors, consts = case_inputs("gru", 0, "zoneout", requires_grad=True, key=("mask-grad",))
    z = consts["zoneout"].clone()
    z[:, 0] = 1.0  # row 0 never updates: its output is h0 at every step
    consts = dict(consts, zoneout=z)
    for backend in ["reference", "cpu"]:
        out, _, _ = run(backend, "gru", tensors, consts)
        torch.testing.assert_close(out[:, 0], tensors["h0"][0].expand(6, 5), rtol=0, atol=0)
        (g,) = torch.autograd.grad(out[:, 0].sum(), tensors["h0"])
        torch.testing.assert_close(g[0], torch.full((5,), 6.0, dtype=torch.float64))
        assert torch.equal(g[1:], torch.zeros_like(g[1:]))

"""Property-based parity with torch.nn (hypothesis): modules of every shape of
option torch.nn has -- cell, layers, bidirectional, bias, batch_first,
proj_size, dropout -- on padded, unbatched, packed (sorted or not) or
lengths= input, with or without hx, with gradients asked of any subset of the
input, hx and the weights, first and second order, and forward-mode tangents,
on every CPU backend; the cells likewise.  float64 against the torch.nn twin
on the same weights: the targeted tests each fix a few of these choices; these
draw them together, where a bug in how two options meet would hide.  And the
CPU kernels' bits at 1, 2 and 3 threads over odd batches and few steps; and
rnnkern's own options (resets=, a reset state, zoneout, LayerNormLSTM,
reset_after=False) drawn together with those, every backend that runs on the
CPU against the reference backend.

Deterministic in CI (derandomize: the same examples each run, no database);
RNNKERN_HYPOTHESIS_EXAMPLES=N draws N per test (default 60) to explore further."""
from __future__ import annotations

import os

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import rnnkern
from conftest import assert_close, generator, randn, rnnkern_module, torch_module

EXAMPLES = int(os.environ.get("RNNKERN_HYPOTHESIS_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BACKENDS = ["auto", "cpu", "reference"]
CLASSES = {"rnn_tanh": "RNN", "rnn_relu": "RNN", "gru": "GRU", "lstm": "LSTM"}


@st.composite
def sequence_cases(draw):
    cell = draw(st.sampled_from(sorted(CLASSES)))
    H = draw(st.integers(1, 6))
    layers = draw(st.integers(1, 3))
    case = dict(
        cell=cell, I=draw(st.integers(1, 5)), H=H, T=draw(st.integers(1, 6)), B=draw(st.integers(1, 4)),
        layers=layers, bidirectional=draw(st.booleans()), bias=draw(st.booleans()),
        batch_first=draw(st.booleans()),
        proj=draw(st.integers(0, H - 1)) if cell == "lstm" and H > 1 else 0,
        # (Dropout between layers, in training: torch.nn's draws, in its order.)
        dropout=draw(st.sampled_from([0.0, 0.4])) if layers > 1 else 0.0,
        # ("lengths": rnnkern's lengths= on the padded batch against torch.nn on the
        # packed one, padded back.)
        form=draw(st.sampled_from(["padded", "unbatched", "packed-sorted", "packed-unsorted", "lengths"])),
        with_hx=draw(st.booleans()),
        grad_x=draw(st.booleans()), grad_hx=draw(st.booleans()), grad_weights=draw(st.booleans()),
        second_order=draw(st.booleans()),
        backend=draw(st.sampled_from(BACKENDS)),
    )
    if case["form"].startswith("packed") or case["form"] == "lengths":
        lengths = draw(st.lists(st.integers(1, case["T"]), min_size=case["B"], max_size=case["B"]))
        if case["form"] == "packed-sorted":
            lengths = sorted(lengths, reverse=True)
        case["lengths"] = lengths
    return case


def _key(case) -> str:
    """A case's seed material for its generators."""
    return repr(sorted(case.items()))


def _twins(case):
    kwargs = dict(num_layers=case["layers"], bias=case["bias"], batch_first=case["batch_first"],
                  dropout=case["dropout"], bidirectional=case["bidirectional"], dtype=torch.float64)
    if case["proj"]:
        kwargs["proj_size"] = case["proj"]
    theirs = torch_module(case["cell"], case["I"], case["H"], **kwargs)
    ours = rnnkern_module(case["cell"], case["I"], case["H"], backend=case["backend"], **kwargs)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _input_shape(case):
    T, B, I = case["T"], case["B"], case["I"]
    return (T, I) if case["form"] == "unbatched" else ((B, T, I) if case["batch_first"] else (T, B, I))


def _state_lead(case):
    """The leading sizes of hx's tensors: layers x directions[, batch]."""
    L, D = case["layers"], 1 + case["bidirectional"]
    return (L * D,) if case["form"] == "unbatched" else (L * D, case["B"])


def _fresh(hx, requires_grad):
    """hx (a tensor, a tuple of them, or None) cloned as new leaves."""
    if hx is None:
        return None
    if isinstance(hx, tuple):
        return tuple(t.clone().requires_grad_(requires_grad) for t in hx)
    return hx.clone().requires_grad_(requires_grad)


def _with_grads(outs, module, case, x, hx):
    """(outs, the gradients asked of the case's differentiable leaves of a
    random functional of outs, then their second derivatives if asked)."""
    leaves = ([x] if case["grad_x"] else []) \
        + (list(hx if isinstance(hx, tuple) else (hx,)) if case["grad_hx"] and hx is not None else []) \
        + (list(module.parameters()) if case["grad_weights"] else [])
    if not leaves:
        return outs, []
    g = generator("weights of the loss", _key(case))
    loss = sum((o * randn(g, *o.shape)).sum() for o in outs)
    grads = list(torch.autograd.grad(loss, leaves, create_graph=case["second_order"], allow_unused=True))
    present = [gr for gr in grads if gr is not None and gr.requires_grad]
    if case["second_order"] and present:
        grads += torch.autograd.grad(sum((gr * gr).sum() for gr in present), leaves, allow_unused=True)
    return outs, grads


def _assert_match(got, want, case):
    """(outs, grads) of rnnkern against torch.nn's."""
    for what, a_list, b_list in (("output", got[0], want[0]), ("gradient", got[1], want[1])):
        assert len(a_list) == len(b_list)
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            if b is None:
                # torch.nn's unused leaf (a zero second derivative): ours is None or zeros.
                assert a is None or not a.any(), f"{what} {i}: torch.nn has None, rnnkern {a}"
                continue
            assert a is not None, f"{what} {i}: rnnkern has None, torch.nn {b}"
            assert a.shape == b.shape, (what, i, a.shape, b.shape)
            assert_close(a, b, what=f"{what} {i} of {case}")


def _run(module, case, x, hx):
    """module's outputs (the tensors, the packed data for packed input) and the
    gradients asked of the case's differentiable leaves."""
    seed = sum(map(ord, _key(case))) % 2 ** 31
    form, ours = case["form"], type(module).__module__.startswith("rnnkern")
    kwargs = {}
    if form.startswith("packed") or (form == "lengths" and not ours):
        inp = pack_padded_sequence(x, torch.tensor(case["lengths"]), batch_first=case["batch_first"],
                                   enforce_sorted=form == "packed-sorted")
    else:
        inp = x
        if form == "lengths":
            kwargs["lengths"] = torch.tensor(case["lengths"])
    torch.manual_seed(seed)
    out, h = module(inp, hx, **kwargs)
    if form.startswith("packed"):
        out = out.data
    elif form == "lengths" and not ours:
        out = pad_packed_sequence(out, batch_first=case["batch_first"], total_length=case["T"])[0]
    return _with_grads([out, *(h if isinstance(h, tuple) else (h,))], module, case, x, hx)


@SETTINGS
@given(case=sequence_cases())
def test_sequence_modules_match_torch_nn(case):
    theirs, ours = _twins(case)
    theirs.train(), ours.train()
    g = generator("sequence property", _key(case))
    shape, lead = _input_shape(case), _state_lead(case)
    hx = None
    if case["with_hx"]:
        hx = randn(g, *lead, case["proj"] or case["H"], scale=0.5)
        if case["cell"] == "lstm":
            hx = (hx, randn(g, *lead, case["H"], scale=0.5))
    got, want = [], []
    for module, results in ((ours, got), (theirs, want)):
        x = randn(generator("x", _key(case)), *shape).requires_grad_(case["grad_x"])
        results.extend(_run(module, case, x, _fresh(hx, case["grad_hx"])))
    _assert_match(got, want, case)


@st.composite
def cell_cases(draw):
    cell = draw(st.sampled_from(sorted(CLASSES)))
    unbatched = draw(st.booleans())
    return dict(cell=cell, I=draw(st.integers(1, 5)), H=draw(st.integers(1, 6)),
                B=1 if unbatched else draw(st.integers(0, 4)),
                bias=draw(st.booleans()), unbatched=unbatched, with_hx=draw(st.booleans()),
                grad_x=draw(st.booleans()), grad_hx=draw(st.booleans()), grad_weights=draw(st.booleans()),
                second_order=draw(st.booleans()), backend=draw(st.sampled_from(BACKENDS)))


def _cell_twins(case):
    cls = CLASSES[case["cell"]] + "Cell"
    kwargs = dict(bias=case["bias"], dtype=torch.float64)
    if cls == "RNNCell":
        kwargs["nonlinearity"] = case["cell"][4:]
    theirs = getattr(nn, cls)(case["I"], case["H"], **kwargs)
    ours = getattr(rnnkern, cls)(case["I"], case["H"], backend=case["backend"], **kwargs)
    ours.load_state_dict(theirs.state_dict())
    return cls, theirs, ours


@SETTINGS
@given(case=cell_cases())
def test_cells_match_torch_nn(case):
    cls, theirs, ours = _cell_twins(case)
    key = _key(case)
    lead = () if case["unbatched"] else (case["B"],)
    g = generator("cell state", key)
    hx = None
    if case["with_hx"]:
        hx = randn(g, *lead, case["H"], scale=0.5)
        if cls == "LSTMCell":
            hx = (hx, randn(g, *lead, case["H"], scale=0.5))
    results = []
    for module in (ours, theirs):
        x = randn(generator("x", key), *lead, case["I"]).requires_grad_(case["grad_x"])
        h = _fresh(hx, case["grad_hx"])
        out = module(x, h)
        results.append(_with_grads(list(out) if isinstance(out, tuple) else [out], module, case, x, h))
    _assert_match(*results, case)


@st.composite
def thread_cases(draw):
    name = draw(st.sampled_from(["RNN", "GRU", "LSTM", "RNNCell", "GRUCell", "LSTMCell"]))
    H = draw(st.sampled_from([7, 64, 128, 200, 256]))
    case = dict(name=name, B=draw(st.integers(1, 40)), H=H, I=draw(st.sampled_from([5, 64])),
                dtype=draw(st.sampled_from(["float32", "float64"])), train=draw(st.booleans()), kwargs={})
    if name.endswith("Cell"):
        case["form"] = "cell"
        if name == "GRUCell" and draw(st.booleans()):
            case["kwargs"]["reset_after"] = False
        return case
    case.update(T=draw(st.sampled_from([1, 2, 4])), form=draw(st.sampled_from(["padded", "packed", "lengths"])))
    case["kwargs"] = dict(num_layers=draw(st.integers(1, 2)), bidirectional=draw(st.booleans()))
    if name == "LSTM" and draw(st.booleans()):
        case["kwargs"]["proj_size"] = H // 2
    if name == "GRU" and draw(st.booleans()):
        case["kwargs"]["reset_after"] = False
    return case


@settings(SETTINGS, max_examples=max(1, EXAMPLES // 2))
@given(case=thread_cases())
def test_same_bits_at_every_thread_count(case):
    """Outputs and gradients bitwise equal at 1, 2 and 3 threads, for any batch
    (the splits between threads cross the products' method lines at odd
    sizes), any number of steps, padded, packed or with lengths=."""
    dtype = getattr(torch, case["dtype"])
    key = _key(case)
    torch.manual_seed(0)
    module = getattr(rnnkern, case["name"])(case["I"], case["H"], backend="cpu", dtype=dtype,
                                            **case["kwargs"])
    cell = case["form"] == "cell"
    x0 = randn(generator("x", key), *((case["B"], case["I"]) if cell else (case["T"], case["B"], case["I"])),
               dtype=dtype)
    lengths = None if cell else torch.randint(1, case["T"] + 1, (case["B"],), generator=generator("len", key))

    def run():
        x = x0.clone().requires_grad_(case["train"])
        if case["form"] == "packed":
            out, h = module(pack_padded_sequence(x, lengths, enforce_sorted=False))
            out = out.data
        else:
            out, h = (module(x, lengths=lengths) if case["form"] == "lengths" else module(x)) \
                if not cell else (module(x), None)
        outs = [t for t in torch.utils._pytree.tree_leaves((out, h)) if t is not None]
        if not case["train"]:
            return [t.detach() for t in outs]
        g = generator("cotangent", key)
        loss = sum((t * randn(g, *t.shape, dtype=t.dtype)).sum() for t in outs)
        return [t.detach() for t in outs] + list(torch.autograd.grad(loss, [x, *module.parameters()]))

    saved = torch.get_num_threads()
    try:
        results = {}
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results[threads] = run()
    finally:
        torch.set_num_threads(saved)
    for threads in (2, 3):
        for i, (a, b) in enumerate(zip(results[threads], results[1], strict=True)):
            assert torch.equal(a, b), f"result {i} differs at {threads} threads from 1: {case}"


def _dual_weights_and_state(weights, weight_tangents, hx, hx_tangents, lstm):
    """Inside a dual level: the weights as duals (for functional_call) and the
    state argument (None, h, or (h, c)) as duals."""
    p = {k: fwAD.make_dual(v, weight_tangents[k]) for k, v in weights.items()}
    hd = tuple(fwAD.make_dual(t, dt) for t, dt in zip(hx, hx_tangents))
    return p, None if not hd else (hd if lstm else hd[0])


def _unpacked_duals(out):
    """[(primal, tangent)] of a module's tensors (output, h_n[, c_n]) or a cell's."""
    parts = torch.utils._pytree.tree_leaves(out)
    return [(d.primal, d.tangent) for d in map(fwAD.unpack_dual, parts)]


@SETTINGS
@given(case=sequence_cases())
def test_sequence_modules_forward_mode_matches_torch_nn(case):
    """Forward-mode AD: the tangent of the outputs and states along random
    directions of the input, hx and every weight at once (dual tensors through
    functional_call; evaluation mode: dropout off).  The case's gradient flags
    are unused."""
    theirs, ours = _twins(case)
    theirs.eval(), ours.eval()
    g = generator("forward mode", _key(case))
    x = randn(g, *_input_shape(case))
    hx = ()
    if case["with_hx"]:
        lead = _state_lead(case)
        hx = (randn(g, *lead, case["proj"] or case["H"], scale=0.5),)
        if case["cell"] == "lstm":
            hx += (randn(g, *lead, case["H"], scale=0.5),)
    params = dict(theirs.named_parameters())
    weights = {k: v.detach() for k, v in params.items()}
    weight_tangents = {k: randn(g, *v.shape) for k, v in params.items()}
    x_tangent = randn(g, *x.shape)
    hx_tangents = tuple(randn(g, *t.shape) for t in hx)
    form = case["form"]
    packing = None
    if form != "padded" and form != "unbatched":
        # (Packed outside jvp: torch has no forward AD for _pack_padded_sequence;
        # packing is linear, so the tangent packs as the input does.)
        lengths = torch.tensor(case["lengths"])
        packing = [pack_padded_sequence(t, lengths, batch_first=case["batch_first"],
                                        enforce_sorted=form == "packed-sorted") for t in (x, x_tangent)]

    def call(module):
        """[(primal, tangent)] of (output, h_n[, c_n]), by dual tensors
        (torch.func.jvp would fail in torch.nn's packed path)."""
        rows = packing is not None and not (form == "lengths" and module is ours)
        with fwAD.dual_level():
            p, state = _dual_weights_and_state(weights, weight_tangents, hx, hx_tangents, case["cell"] == "lstm")
            xd = fwAD.make_dual(packing[0].data, packing[1].data) if rows else fwAD.make_dual(x, x_tangent)
            if rows:  # a packed batch's rows
                first = packing[0]
                inp = PackedSequence(xd, first.batch_sizes, first.sorted_indices, first.unsorted_indices)
                out, h = torch.func.functional_call(module, p, (inp, state))
                out = out.data if form.startswith("packed") else \
                    pad_packed_sequence(out, batch_first=case["batch_first"], total_length=case["T"])[0]
            elif form == "lengths":
                out, h = torch.func.functional_call(module, p, (xd, state),
                                                    {"lengths": torch.tensor(case["lengths"])})
            else:
                out, h = torch.func.functional_call(module, p, (xd, state))
            return _unpacked_duals((out, h))

    for i, ((a, da), (b, db)) in enumerate(zip(call(ours), call(theirs), strict=True)):
        assert_close(a, b, what=f"primal {i} of {case}")
        assert_close(da, db, what=f"tangent {i} of {case}")


@SETTINGS
@given(case=cell_cases())
def test_cells_forward_mode_matches_torch_nn(case):
    """Forward-mode AD of the cells along random directions of the input, hx
    and every weight at once.  The case's gradient flags are unused."""
    cls, theirs, ours = _cell_twins(case)
    g = generator("cell forward mode", _key(case))
    lead = () if case["unbatched"] else (case["B"],)
    x, x_tangent = randn(g, *lead, case["I"]), randn(g, *lead, case["I"])
    hx = ()
    if case["with_hx"]:
        hx = tuple(randn(g, *lead, case["H"], scale=0.5) for _ in range(2 if cls == "LSTMCell" else 1))
    hx_tangents = tuple(randn(g, *t.shape) for t in hx)
    weights = {k: v.detach() for k, v in theirs.named_parameters()}
    weight_tangents = {k: randn(g, *v.shape) for k, v in weights.items()}
    results = []
    for module in (ours, theirs):
        with fwAD.dual_level():
            p, state = _dual_weights_and_state(weights, weight_tangents, hx, hx_tangents, cls == "LSTMCell")
            out = torch.func.functional_call(module, p, (fwAD.make_dual(x, x_tangent), state))
            results.append(_unpacked_duals(out))
    for i, ((a, da), (b, db)) in enumerate(zip(*results, strict=True)):
        assert_close(a, b, what=f"primal {i} of {case}")
        assert_close(da, db, what=f"tangent {i} of {case}")


# ------------------------------------------ rnnkern's options, backend by backend ----

@st.composite
def option_cases(draw):
    name = draw(st.sampled_from(["rnn_tanh", "rnn_relu", "gru", "gru_reset_before", "lstm", "lstm_proj",
                                 "lstm_ln"]))
    H = draw(st.integers(2, 5))
    case = dict(name=name, I=draw(st.integers(1, 4)), H=H, T=draw(st.integers(1, 5)), B=draw(st.integers(1, 3)),
                layers=draw(st.integers(1, 2)), bidirectional=draw(st.booleans()),
                batch_first=draw(st.booleans()), bias=draw(st.booleans()) if name != "lstm_ln" else True,
                proj=draw(st.integers(1, H - 1)) if name == "lstm_proj" else 0,
                zoneout=draw(st.sampled_from([0.0, 0.0, 0.2, 0.5])), train=draw(st.booleans()),
                form=draw(st.sampled_from(["padded", "lengths", "packed"])),
                resets=draw(st.booleans()), with_hx=draw(st.booleans()))
    case["reset_state"] = case["resets"] and draw(st.booleans())
    return case


@settings(SETTINGS, max_examples=max(1, EXAMPLES // 4))
@given(case=option_cases())
def test_options_together_match_the_reference_on_every_backend(case):
    """resets= (with a reset state or zeros), zoneout (training masks drawn from
    the same seed), LayerNormLSTM, GRU(reset_after=False), lengths= and packed
    input, layers and directions drawn together: every backend that runs on the
    CPU (cpu, Triton's interpreter, the emulated CUDA device) against the
    reference backend, outputs and the gradients of input, hx, reset state and
    every weight, float64."""
    from options_truth import BACKENDS as OPTION_BACKENDS
    name = case["name"]
    kwargs = dict(num_layers=case["layers"], bidirectional=case["bidirectional"], batch_first=case["batch_first"],
                  dtype=torch.float64)
    if name != "lstm_ln":
        kwargs["bias"] = case["bias"]
    if case["proj"]:
        kwargs["proj_size"] = case["proj"]
    if case["zoneout"]:
        kwargs["zoneout"] = case["zoneout"]
    key = _key(case)
    g = generator("options together", key)
    T, B, L, D = case["T"], case["B"], case["layers"], 1 + case["bidirectional"]
    P, lstm = case["proj"] or case["H"], name.startswith("lstm")

    def make(backend):
        if name == "lstm_ln":
            return rnnkern.LayerNormLSTM(case["I"], case["H"], backend=backend, **kwargs)
        return rnnkern_module("lstm" if name == "lstm_proj" else name, case["I"], case["H"], backend=backend,
                              **kwargs)

    x0 = randn(g, *((B, T, case["I"]) if case["batch_first"] else (T, B, case["I"])))
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T  # (a packed batch's resets are [its longest length, B])
    mask = torch.rand((B, T) if case["batch_first"] else (T, B), generator=g) < 0.35

    def states():
        return [randn(g, L * D, B, P, scale=0.5)] + ([randn(g, L * D, B, case["H"], scale=0.5)] if lstm else [])

    hx0 = states() if case["with_hx"] else None
    rs0 = states() if case["reset_state"] else None
    torch.manual_seed(0)
    reference_module = make("reference")

    def run(backend):
        m = make(backend)
        m.load_state_dict(reference_module.state_dict())
        m.train(case["train"])
        x = x0.clone().requires_grad_()
        hx = None if hx0 is None else [t.clone().requires_grad_() for t in hx0]
        rs = None if rs0 is None else [t.clone().requires_grad_() for t in rs0]
        options = {}
        if case["resets"]:
            options["resets"] = mask
        if rs is not None:
            options["reset_state"] = tuple(rs) if lstm else rs[0]
        state = None if hx is None else (tuple(hx) if lstm else hx[0])
        torch.manual_seed(1)  # zoneout's and dropout's masks
        if case["form"] == "packed":
            out, h = m(pack_padded_sequence(x, lengths, batch_first=case["batch_first"], enforce_sorted=False),
                       state, **options)
            out = out.data
        elif case["form"] == "lengths":
            out, h = m(x, state, lengths=lengths, **options)
        else:
            out, h = m(x, state, **options)
        outs = [out, *(h if isinstance(h, tuple) else (h,))]
        gl = generator("cotangent", key)
        loss = sum((o * randn(gl, *o.shape)).sum() for o in outs)
        leaves = [x, *(hx or []), *(rs or []), *m.parameters()]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return [o.detach() for o in outs] + [torch.zeros_like(v) if d is None else d for d, v in zip(grads, leaves)]

    want = run("reference")
    for backend in OPTION_BACKENDS:
        if backend == "reference":
            continue
        for i, (a, b) in enumerate(zip(run(backend), want, strict=True)):
            assert_close(a, b, what=f"{backend}: result {i} of {case}")

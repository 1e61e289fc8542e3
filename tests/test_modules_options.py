"""The modules' options beyond torch.nn: ``resets=`` on forward,
``zoneout=`` on every module and cell, and LayerNormLSTM / LayerNormLSTMCell.

Every test runs on each backend that runs on the CPU (reference, cpu, triton
under the interpreter, cuda_emulated when built).  Where
``rnnkern.modules.UNSUPPORTED`` says a backend lacks an option, the test asserts
the module's NotImplementedError (naming the option and the backends that have
it) instead; when the kernels land and the entry goes, the same test checks the
numbers, unedited.

The truths are computed independently of the modules' code path:
- resets: the episodes run separately -- each sequence split at its reset
  points, every piece run from hx's row or the reset state's (the reset rule)
  by torch.nn's own module (through
  ``torch.func.functional_call`` on the same parameters, so gradients meet) or,
  for LayerNormLSTM, by the layer-norm LSTM loop written here;
- zoneout in evaluation: a per-step loop over ``reference.cell_from_projections``
  (or the loop written here) with the blend ``p * h_prev + (1 - p) * h_new``;
- LayerNormLSTM: ``torch.nn.functional.layer_norm`` and the LSTM equations, step
  by step, in this file (not rnnkern.reference).
float64, fresh random data from seeded generators, tiny sizes (the Triton
interpreter is slow).
"""
from __future__ import annotations

import copy
import io
import pickle
import warnings
import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import rnnkern
from rnnkern import modules, ops, reference
from conftest import assert_close, generator, randn

BACKENDS = ["reference", "cpu", "triton"] + (["cuda_emulated"] if ops.WITH_CUDA_EMULATION else [])
#: Sequence cells: torch.nn's (with a twin to run the episodes) and lstm_ln.
CELLS = ("lstm", "gru", "rnn_tanh", "lstm_ln")
EPS = 1e-5  # the layer norms' epsilon (the LayerNorm cell's contract)
T, B, I, H = 7, 3, 3, 4


# ------------------------------------------------------------------ helpers ----

def lacking(backend: str, *options: str) -> list:
    return [o for o in options if o in modules.UNSUPPORTED.get(backend, ())]


def raises_unsupported(backend: str, options, fn) -> bool:
    """Where ``backend`` lacks one of ``options``: asserts that ``fn`` raises the
    module's NotImplementedError naming it, and returns True."""
    missing = lacking(backend, *options)
    if not missing:
        return False
    with pytest.raises(NotImplementedError) as e:
        fn()
    message = str(e.value)
    assert f"backend={backend!r}" in message and "backends that do" in message, message
    named = [o for o in missing if f"does not support {o}" in message]
    assert named, message
    able = [b for b, gaps in modules.UNSUPPORTED.items() if named[0] not in gaps]
    assert message.endswith(", ".join(able) or "none"), message
    return True


def used(cell: str, *options: str) -> tuple:
    """The UNSUPPORTED names a call uses."""
    return (("LayerNormLSTM",) if cell == "lstm_ln" else ()) + options


def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode())


def make_module(cell: str, backend: str, input_size=I, hidden_size=H, **kwargs):
    """The rnnkern sequence module of ``cell`` (float64); LayerNormLSTM's gains
    and shifts drawn around 1 and 0, so that its layer norms are not the identity."""
    torch.manual_seed(seed_of("module", cell, backend, input_size, hidden_size, sorted(kwargs.items())))
    kwargs.setdefault("dtype", torch.float64)
    if cell == "lstm_ln":
        m = rnnkern.LayerNormLSTM(input_size, hidden_size, backend=backend, **kwargs)
        randomize_ln(m)
    elif cell == "lstm":
        m = rnnkern.LSTM(input_size, hidden_size, backend=backend, **kwargs)
    elif cell == "gru":
        m = rnnkern.GRU(input_size, hidden_size, backend=backend, **kwargs)
    else:
        m = rnnkern.RNN(input_size, hidden_size, nonlinearity=cell[4:], backend=backend, **kwargs)
    return m


def randomize_ln(m: nn.Module) -> None:
    g = generator("ln-parameters", type(m).__name__)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.startswith("ln_"):
                base = 0.0 if "bias" in name else 1.0
                p.copy_(base + 0.3 * randn(g, *p.shape, dtype=p.dtype))


def state_leaves(m, batch: int, key, unbatched=False):
    """Non-zero hx leaves for module ``m``: (h,) or (h, c)."""
    g = generator("hx", *key)
    D = 2 if m.bidirectional else 1
    P = getattr(m, "proj_size", 0) or m.hidden_size
    lead = (m.num_layers * D,) + (() if unbatched else (batch,))
    h = randn(g, *lead, P, scale=0.5, requires_grad=True)
    if m.mode != "LSTM":
        return (h,)
    return h, randn(g, *lead, m.hidden_size, scale=0.5, requires_grad=True)


def hx_arg(parts):
    return None if parts is None else (parts if len(parts) == 2 else parts[0])


def flat(result):
    """(output, (h, c)) / (output, h) -> [output, h(, c)], PackedSequence as its data."""
    out, hidden = result
    out = out.data if isinstance(out, PackedSequence) else out
    return [out, *(hidden if isinstance(hidden, tuple) else (hidden,))]


def cotangent_loss(tensors, key):
    g = generator("cotangent", *key)
    return sum((t * randn(g, *t.shape, dtype=t.dtype)).sum() for t in tensors)


def values_and_grads(tensors, leaves, key):
    """The tensors, then the gradients of a random linear functional of them
    with respect to ``leaves``."""
    grads = torch.autograd.grad(cotangent_loss(tensors, key), leaves, allow_unused=True)
    return list(tensors) + [g if g is not None else torch.zeros_like(l) for g, l in zip(grads, leaves)]


def compare(got, want, labels, what=""):
    assert len(got) == len(want) == len(labels)
    for label, a, b in zip(labels, got, want):
        assert a.shape == b.shape, (what, label, a.shape, b.shape)
        assert_close(a, b, what=f"{what} {label}")


# ---------------------------------------------- independent computations ----

def ln_lstm_step(m, sfx, x_t, h, c):
    """One layer-normalised LSTM step with the parameters of ``m`` (suffix
    ``sfx``: "_l0", "_l1_reverse", or "" for the cell), written from the
    formula: a = LN(x W_ih^T) g_ih + LN(h W_hh^T) g_hh + b_ih + b_hh, torch's
    gates, h = o * tanh(LN(c) g_c + beta_c)."""
    p = lambda name: getattr(m, name + sfx, None)  # noqa: E731
    H4 = p("weight_hh").shape[0]
    a = F.layer_norm(x_t @ p("weight_ih").t(), (H4,), weight=p("ln_ih_weight"), eps=EPS) \
        + F.layer_norm(h @ p("weight_hh").t(), (H4,), weight=p("ln_hh_weight"), eps=EPS)
    if p("bias_ih") is not None:
        a = a + p("bias_ih") + p("bias_hh")
    i, f, g, o = a.chunk(4, 1)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h_new = torch.sigmoid(o) * torch.tanh(
        F.layer_norm(c_new, (H4 // 4,), weight=p("ln_cell_weight"), bias=p("ln_cell_bias"), eps=EPS))
    return h_new, c_new


def reference_step(m, sfx, x_t, h, c):
    """One step of a torch.nn cell through rnnkern.reference.cell_from_projections."""
    p = lambda name: getattr(m, name + sfx, None)  # noqa: E731
    xp = x_t @ p("weight_ih").t()
    if p("bias_ih") is not None:
        xp = xp + p("bias_ih")
    return reference.cell_from_projections(m.cell, xp, h, c, p("weight_hh"), p("bias_hh"),
                                           p("weight_hr"))


def loop_module(m, x, hx, lengths=None, p=0.0):
    """``m``'s function step by step in Python: x [T, N, I] time-major, hx
    (h, [c]) [L*D, N, *] or None, lengths [N] or None, eval zoneout ``p``
    (``h = p * h_prev + (1 - p) * h_new``, c alike).  Returns [out, h_n(, c_n)]."""
    steps = ln_lstm_step if m.cell == "lstm_ln" else reference_step
    Tx, N = x.shape[:2]
    D = 2 if m.bidirectional else 1
    lstm = m.mode == "LSTM"
    lens = torch.full((N,), Tx) if lengths is None else torch.as_tensor(lengths)
    if hx is None:
        P = getattr(m, "proj_size", 0) or m.hidden_size
        hx = (x.new_zeros(m.num_layers * D, N, P), x.new_zeros(m.num_layers * D, N, m.hidden_size))
    hs, cs, inp = [], [], x
    for layer in range(m.num_layers):
        outs = []
        for d in range(D):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            h, c = hx[0][layer * D + d], hx[1][layer * D + d] if lstm else None
            out = [None] * Tx
            for t in (range(Tx - 1, -1, -1) if d else range(Tx)):
                h_new, c_new = steps(m, sfx, inp[t], h, c)
                if p:
                    h_new = p * h + (1 - p) * h_new
                    c_new = p * c + (1 - p) * c_new if lstm else None
                active = (t < lens).unsqueeze(1)
                h = torch.where(active, h_new, h)
                c = torch.where(active, c_new, c) if lstm else None
                out[t] = torch.where(active, h_new, torch.zeros_like(h_new))
            outs.append(torch.stack(out))
            hs.append(h)
            cs.append(c)
        inp = torch.cat(outs, 2)
    return [inp, torch.stack(hs)] + ([torch.stack(cs)] if lstm else [])


def twin_run(m, x, lengths, hx):
    """The pieces' truth: ``m``'s parameters run by torch.nn's module of the same
    configuration (packed, through torch.func.functional_call so gradients
    reach ``m``'s parameters), or by :func:`loop_module` for LayerNormLSTM.
    x [Tp, N, I] time-major, lengths [N] (>= 1), hx (h, [c]) [L*D, N, *]."""
    if m.cell == "lstm_ln":
        return loop_module(m, x, hx, lengths)
    cls = {"lstm": nn.LSTM, "gru": nn.GRU}.get(m.cell, nn.RNN)
    extra = {"nonlinearity": m.cell[4:]} if cls is nn.RNN else {}
    twin = cls(m.input_size, m.hidden_size, num_layers=m.num_layers, bias=m.bias,
               bidirectional=m.bidirectional, dtype=torch.float64, **extra)
    packed = pack_padded_sequence(x, torch.as_tensor(lengths), enforce_sorted=False)
    out, hidden = torch.func.functional_call(twin, dict(m.named_parameters()), (packed, hx_arg(hx)))
    out, _ = pad_packed_sequence(out, total_length=x.shape[0])
    return [out, *(hidden if isinstance(hidden, tuple) else (hidden,))]


def run_episodes_separately(m, x, resets, lengths, hx, p=0.0, reset_state=None):
    """What ``m(x, hx, lengths=lengths, resets=resets, reset_state=reset_state)``
    must compute, from the episodes alone: each sequence b is cut before every
    position t (0 < t < lengths[b]) where resets[t, b], every piece runs in one
    batch through :func:`twin_run` (with an evaluation zoneout ``p``: through
    :func:`loop_module`), and the pieces' outputs are put back in place.  A
    forward direction runs a piece from hx's row b if it is the sequence's
    first and no reset is at position 0, else from the reset state's row b
    (zeros without ``reset_state``); a reverse direction runs the sequence's last
    piece from hx, the others from the reset state.  The final state of a
    forward direction is its last piece's; of a reverse direction its first
    piece's (the reverse pass ends at position 0).
    x [T, B, I] time-major, resets [T, B], lengths [B] (>= 1)."""
    Tx, Bx = x.shape[:2]
    pieces = []  # (row, start, end)
    for b in range(Bx):
        cuts = [0] + [t for t in range(1, int(lengths[b])) if resets[t, b]] + [int(lengths[b])]
        pieces += [(b, s, e) for s, e in zip(cuts[:-1], cuts[1:])]
    D = 2 if m.bidirectional else 1
    if reset_state is None:
        reset_state = tuple(torch.zeros_like(h) for h in hx)

    def start_state(part, k, b, s, e):
        from_hx = (e == int(lengths[b])) if k % D == 1 else (s == 0 and not bool(resets[0, b]))
        return (hx if from_hx else reset_state)[part][k, b]

    piece_hx = tuple(torch.stack([torch.stack([start_state(i, k, b, s, e) for b, s, e in pieces])
                                  for k in range(hx[i].shape[0])]) for i in range(len(hx)))
    Tp = max(e - s for _, s, e in pieces)
    xp = torch.stack([torch.cat([x[s:e, b], x.new_zeros(Tp - (e - s), x.shape[2])])
                      for b, s, e in pieces], 1)
    piece_lengths = [e - s for _, s, e in pieces]
    result = loop_module(m, xp, piece_hx, piece_lengths, p=p) if p else \
        twin_run(m, xp, piece_lengths, piece_hx)
    out_p, states = result[0], result[1:]
    out = torch.stack([
        torch.cat([out_p[:e - s, k] for k, (bb, s, e) in enumerate(pieces) if bb == b]
                  + [out_p.new_zeros(Tx - int(lengths[b]), out_p.shape[2])])
        for b in range(Bx)], 1)
    first = [min(k for k, piece in enumerate(pieces) if piece[0] == b) for b in range(Bx)]
    last = [max(k for k, piece in enumerate(pieces) if piece[0] == b) for b in range(Bx)]
    finals = [torch.stack([torch.stack([s[k, (first if k % D == 1 else last)[b]] for b in range(Bx)])
                           for k in range(s.shape[0])]) for s in states]
    return [out, *finals]


# ------------------------------------------------------------------ resets ----

FORMS = ("padded", "lengths", "packed")
#: The Triton interpreter takes seconds per module call: it runs a cover of the
#: matrix (every cell, form and layout at least once), the other backends all of it.
TRITON_RESET_CASES = [("lstm", "packed", True), ("gru", "lengths", False), ("rnn_tanh", "padded", True),
                      ("lstm_ln", "packed", False), ("lstm_ln", "lengths", True)]
RESET_CASES = [(b, c, f, bf) for b in BACKENDS for c in CELLS for f in FORMS for bf in (False, True)
               if b != "triton" or (c, f, bf) in TRITON_RESET_CASES]
RESET_IDS = [f"{c}-{f}-{'bf' if bf else 'tf'}-{b}" for b, c, f, bf in RESET_CASES]


def reset_inputs(key, batch_first, lengths=(T, 3, T - 2)):
    """x (layout of batch_first, leaf), resets (same layout) and lengths: a few
    resets inside each sequence, one at position 0 (the reset state replaces hx
    there) and one past a sequence's end (ignored)."""
    g = generator("resets", *key)
    x = randn(g, T, B, I)
    resets = torch.rand(T, B, generator=g) < 0.3
    resets[0, 0] = True
    resets[2, 0] = True
    resets[1, 2] = True
    resets[5, 1] = True  # past row 1's end in the lengths forms
    if batch_first:
        return x.transpose(0, 1).contiguous().requires_grad_(), resets.t().contiguous(), list(lengths)
    return x.requires_grad_(), resets, list(lengths)


@pytest.mark.parametrize("backend,cell,form,batch_first", RESET_CASES, ids=RESET_IDS)
def test_resets_equal_the_episodes_run_separately(backend, cell, form, batch_first):
    """Two layers, bidirectional: outputs, final states and the gradients of the
    input, hx and every parameter equal those of the episodes run separately."""
    key = (cell, form, batch_first)
    m = make_module(cell, backend, num_layers=2, bidirectional=True, batch_first=batch_first)
    x, resets, lengths = reset_inputs(key, batch_first)
    if form == "padded":
        lengths = [T] * B
    hx = state_leaves(m, B, key)

    def ours():
        if form == "packed":
            packed = pack_padded_sequence(x, torch.tensor(lengths), batch_first=batch_first,
                                          enforce_sorted=False)
            out, hidden = m(packed, hx_arg(hx), resets=resets)
            assert isinstance(out, PackedSequence)
            out = pad_packed_sequence(out, batch_first=batch_first, total_length=T)[0]
            return flat((out, hidden))
        kw = {"lengths": torch.tensor(lengths)} if form == "lengths" else {}
        return flat(m(x, hx_arg(hx), resets=resets, **kw))

    if raises_unsupported(backend, used(cell, "resets"), ours):
        return
    leaves = [x, *hx, *m.parameters()]
    got = values_and_grads(ours(), leaves, key)
    x_tm = x.transpose(0, 1) if batch_first else x
    r_tm = resets.t() if batch_first else resets
    want = run_episodes_separately(m, x_tm, r_tm, lengths, hx)
    if batch_first:
        want[0] = want[0].transpose(0, 1)
    want = values_and_grads(want, leaves, key)
    labels = ["output", "h_n", "c_n"][:len(hx) + 1] + ["grad input"] + \
        [f"grad hx[{i}]" for i in range(len(hx))] + [f"grad {n}" for n, _ in m.named_parameters()]
    compare(got, want, labels, f"{backend} {cell} {form}")


def reset_pattern(pattern: str, key) -> torch.Tensor:
    """[T, B] masks: a reset at the first step only, at every step, never, or at
    random (40%)."""
    if pattern == "random":
        return torch.rand(T, B, generator=generator("pattern", *key)) < 0.4
    resets = torch.full((T, B), pattern == "every", dtype=torch.bool)
    if pattern == "first":
        resets[0] = True
    return resets


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", ["first", "every", "never", "random"])
def test_reset_patterns_within_1e_12_of_torch_nn_on_the_episodes(backend, pattern):
    """The resets' criterion: float64 outputs, final states and the gradients of
    the input, hx and every parameter within 1e-12 of torch.nn run on the
    episodes separately, for resets at t=0 only, at every step, never, and at
    random; two layers, bidirectional, variable lengths."""
    cell = "gru" if backend == "triton" else "lstm"  # (the interpreter is slow: one cell)
    key = ("patterns", cell, pattern)
    m = make_module(cell, backend, num_layers=2, bidirectional=True)
    g = generator(*key)
    x = randn(g, T, B, I).requires_grad_()
    lengths = [T, 3, T - 2]
    resets = reset_pattern(pattern, key)
    hx = state_leaves(m, B, key)
    call = lambda: flat(m(x, hx_arg(hx), lengths=torch.tensor(lengths), resets=resets))  # noqa: E731
    if raises_unsupported(backend, used(cell, "resets"), call):
        return
    leaves = [x, *hx, *m.parameters()]
    got = values_and_grads(call(), leaves, key)
    want = values_and_grads(run_episodes_separately(m, x, resets, lengths, hx), leaves, key)
    labels = ["output", "h_n", "c_n"][:len(hx) + 1] + ["grad input"] + \
        [f"grad hx[{i}]" for i in range(len(hx))] + [f"grad {n}" for n, _ in m.named_parameters()]
    assert len(got) == len(want) == len(labels)
    for label, a, b in zip(labels, got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lambda msg: f"{pattern} {label}: {msg}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_hx", [True, False], ids=["hx", "no-hx"])
def test_reset_rule_in_both_directions_by_hand(backend, with_hx):
    """A ReLU RNN that sums its inputs (w_ih = w_hh = 1, no bias, H = 1),
    bidirectional, x = 1..5, a reset at position 2 (and, in row 1 of length 3,
    one at 4, past its end).  Forward: step 0 starts from hx, step 2 from the
    reset state (zeros).  Reverse: each row's last step starts from hx, step 1
    from zeros (the boundary lies between positions 1 and 2)."""
    m = rnnkern.RNN(1, 1, nonlinearity="relu", bias=False, bidirectional=True, backend=backend,
                    dtype=torch.float64)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(1.0)
    x = torch.tensor([1.0, 2, 3, 4, 5], dtype=torch.float64).view(5, 1, 1).repeat(1, 2, 1)
    resets = torch.zeros(5, 2, dtype=torch.bool)
    resets[2, :] = True
    resets[4, 1] = True
    h0 = torch.tensor([[10.0, 20.0], [100.0, 200.0]], dtype=torch.float64).unsqueeze(2)
    hx = h0 if with_hx else None
    call = lambda: m(x, hx, lengths=torch.tensor([5, 3]), resets=resets)  # noqa: E731
    if raises_unsupported(backend, ("resets",), call):
        return
    out, h_n = call()
    if with_hx:
        fwd = [[11, 13, 3, 7, 12], [21, 23, 3, 0, 0]]
        rev = [[3, 2, 112, 109, 105], [3, 2, 203, 0, 0]]
    else:
        fwd = [[1, 3, 3, 7, 12], [1, 3, 3, 0, 0]]
        rev = [[3, 2, 12, 9, 5], [3, 2, 3, 0, 0]]
    want = torch.tensor([fwd, rev], dtype=torch.float64).permute(2, 1, 0)  # [T, B, 2]
    assert_close(out, want, what="output")
    assert_close(h_n, torch.stack([want[[4, 2], [0, 1], 0], want[0, :, 1]]).unsqueeze(2), what="h_n")


def test_reverse_direction_gets_the_shifted_mask(monkeypatch):
    """What each (layer, direction) hands to the op: the mask as given forward,
    shifted by one position in reverse (rev[t] = resets[t + 1], rev[T-1] = False)."""
    seen = []
    real = ops.run_recurrence

    def spy(*args):
        seen.append((args[10], args[11]))  # reverse, resets
        return real(*args)

    monkeypatch.setattr(ops, "run_recurrence", spy)
    m = make_module("gru", "reference", num_layers=2, bidirectional=True)
    x, resets, _ = reset_inputs(("shift",), False)
    m(x, resets=resets)
    shifted = torch.cat([resets[1:], torch.zeros(1, B, dtype=torch.bool)])
    assert [reverse for reverse, _ in seen] == [False, True, False, True]
    for reverse, mask in seen:
        assert torch.equal(mask, shifted if reverse else resets)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", ["lstm", "lstm_ln"])
def test_resets_unbatched_equal_batch_of_one(backend, cell):
    m = make_module(cell, backend, num_layers=2, bidirectional=True)
    g = generator("unbatched-resets", cell)
    x = randn(g, T, I)
    resets = torch.rand(T, generator=g) < 0.4
    resets[3] = True
    hx = tuple(h.detach() for h in state_leaves(m, 1, ("unbatched", cell), unbatched=True))
    call = lambda: m(x, hx, resets=resets)  # noqa: E731
    if raises_unsupported(backend, used(cell, "resets"), call):
        return
    got = flat(call())
    want = flat(m(x.unsqueeze(1), tuple(h.unsqueeze(1) for h in hx), resets=resets.unsqueeze(1)))
    compare(got, [want[0].squeeze(1)] + [h.squeeze(1) for h in want[1:]], ["output", "h_n", "c_n"])


@pytest.mark.parametrize("layout", ["time-major", "batch_first", "unbatched"])
def test_reset_masks_as_rl_libraries_keep_them(layout):
    """bool, uint8 and floating 0/1 masks (sb3-contrib keeps episode starts as
    float), each with a trailing 1 too (torchrl's is_init is [B, T, 1]), give
    the results of the bool mask (reference backend: the conversion happens
    before any backend)."""
    m = make_module("gru", "reference", batch_first=layout == "batch_first")
    g = generator("mask-formats", layout)
    mask = torch.rand(T, B, generator=g) < 0.4
    mask[0, 0] = mask[3, 1] = True
    x = randn(g, T, B, I)
    if layout == "batch_first":
        x, mask = x.transpose(0, 1).contiguous(), mask.t().contiguous()
    elif layout == "unbatched":
        x, mask = x[:, 1], mask[:, 1]
    want = flat(m(x, resets=mask))
    assert not torch.equal(want[0], flat(m(x))[0])  # the mask matters here
    for dtype in (torch.bool, torch.uint8, torch.float32, torch.float64):
        for trailing in (False, True):
            r = mask.to(dtype)
            r = r.unsqueeze(-1) if trailing else r
            compare(flat(m(x, resets=r)), want, ["output", "h_n"], f"{dtype} trailing={trailing}")


def test_no_resets_and_all_false_resets_agree():
    """An all-False mask changes nothing (reference backend; the others are
    held to the reference by tests/test_options.py)."""
    m = make_module("lstm", "reference", num_layers=2, bidirectional=True)
    x, _, _ = reset_inputs(("all-false",), False)
    compare(flat(m(x, resets=torch.zeros(T, B, dtype=torch.bool))), flat(m(x)), ["output", "h_n", "c_n"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_resets_with_dropout_zoneout_training_reproduce_with_a_seed(backend):
    """Every option at once in training: a seeded call reproduces, another seed
    differs, and evaluation is deterministic."""
    m = make_module("gru", backend, num_layers=3, bidirectional=True, dropout=0.3, zoneout=0.2)
    x, resets, lengths = reset_inputs(("all-options",), False)

    def call(seed):
        torch.manual_seed(seed)
        return flat(m(x, resets=resets, lengths=torch.tensor(lengths)))

    if raises_unsupported(backend, ("resets", "zoneout"), lambda: call(0)):
        return
    m.train()
    first, again, other = call(1), call(1), call(2)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])
    m.eval()
    for a, b in zip(call(3), call(4)):
        assert torch.equal(a, b)


# ----------------------------------------------------------------- zoneout ----

ZONEOUT_CASES = [("lstm", 0), ("lstm", 2), ("gru", 0), ("rnn_tanh", 0), ("lstm_ln", 0)]
ZONEOUT_IDS = [f"{c}-proj{p}" if p else c for c, p in ZONEOUT_CASES]


def zoneout_module(cell, proj, backend, p, **kwargs):
    extra = {"proj_size": proj} if proj else {}
    return make_module(cell, backend, num_layers=2, bidirectional=True, zoneout=p, **extra, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell,proj", ZONEOUT_CASES, ids=ZONEOUT_IDS)
def test_zoneout_eval_is_the_expectation(backend, cell, proj):
    """Evaluation: every step blends p * previous + (1 - p) * new (h and c), in
    every layer and direction, with lengths; against a per-step loop."""
    p = 0.3
    m = zoneout_module(cell, proj, backend, p).eval()
    x, _, lengths = reset_inputs(("zoneout-eval", cell, proj), False)
    hx = state_leaves(m, B, ("zoneout-eval", cell, proj))
    call = lambda: flat(m(x, hx_arg(hx), lengths=torch.tensor(lengths)))  # noqa: E731
    if raises_unsupported(backend, used(cell, "zoneout"), call):
        return
    leaves = [x, *hx, *m.parameters()]
    key = ("zoneout-eval", cell, proj)
    got = values_and_grads(call(), leaves, key)
    want = values_and_grads(loop_module(m, x, hx, lengths, p=p), leaves, key)
    labels = ["output", "h_n", "c_n"][:len(hx) + 1] + ["grad input"] + \
        [f"grad hx[{i}]" for i in range(len(hx))] + [f"grad {n}" for n, _ in m.named_parameters()]
    compare(got, want, labels, f"{backend} {cell}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell,proj", ZONEOUT_CASES, ids=ZONEOUT_IDS)
def test_zoneout_one_freezes_the_state(backend, cell, proj):
    """p = 1 in training: no unit ever updates, so every output is the last
    layer's h0 and the final states are hx."""
    m = zoneout_module(cell, proj, backend, 1.0).train()
    x, _, _ = reset_inputs(("zoneout-one", cell), False)
    hx = tuple(h.detach() for h in state_leaves(m, B, ("zoneout-one", cell)))
    call = lambda: flat(m(x, hx_arg(hx)))  # noqa: E731
    if raises_unsupported(backend, used(cell, "zoneout"), call):
        return
    out, *states = call()
    last = torch.cat([hx[0][-2], hx[0][-1]], 1)  # the last layer's two directions
    assert_close(out, last.expand(T, *last.shape), what="output")
    for got, want in zip(states, hx):
        assert_close(got, want, what="final state")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_zoneout_zero_is_no_zoneout(backend, cell, monkeypatch):
    """p = 0: no mask reaches the op, and the numbers are those of a module
    built without the keyword (training mode)."""
    m = make_module(cell, backend, num_layers=2, zoneout=0.0).train()
    plain = make_module(cell, backend, num_layers=2).train()
    plain.load_state_dict(m.state_dict())
    seen = []
    real = ops.run_recurrence
    monkeypatch.setattr(ops, "run_recurrence", lambda *a: seen.append(a[12]) or real(*a))
    x, _, _ = reset_inputs(("zoneout-zero", cell), False)
    for a, b in zip(flat(m(x)), flat(plain(x))):
        assert torch.equal(a, b)
    assert seen == [None] * 4


def capture_masks(monkeypatch):
    masks = []
    real = ops.run_recurrence

    def spy(*args):
        masks.append(args[12])
        return real(*args)

    monkeypatch.setattr(ops, "run_recurrence", spy)
    return masks


@pytest.mark.parametrize("cell,proj", ZONEOUT_CASES, ids=ZONEOUT_IDS)
def test_zoneout_training_masks(cell, proj, monkeypatch):
    """Training: one fresh Bernoulli mask per layer and direction, [T, B, Z]
    (Z = P + H for LSTMs, H otherwise), in the input's dtype, each unit 1
    (keep the previous value) with probability p; seeded runs draw the same
    masks.  Evaluation: p broadcast from one [Z] vector (strides (0, 0, 1))."""
    p, Tm, Bm = 0.3, 40, 16
    m = zoneout_module(cell, proj, "reference", p, hidden_size=6, input_size=2)
    masks = capture_masks(monkeypatch)
    x = randn(generator("mask-stats", cell), Tm, Bm, 2)
    torch.manual_seed(7)
    with torch.no_grad():
        m.train()(x)
    Z = (proj or 6) + 6 if cell.startswith("lstm") else 6
    assert len(masks) == 4
    n = Tm * Bm * Z
    for mask in masks:
        assert mask.shape == (Tm, Bm, Z) and mask.dtype == torch.float64
        assert set(mask.unique().tolist()) == {0.0, 1.0}
        assert abs(mask.mean().item() - p) < 5 * (p * (1 - p) / n) ** 0.5
    assert all(not torch.equal(masks[0], other) for other in masks[1:])
    first = list(masks)
    masks.clear()
    torch.manual_seed(7)
    with torch.no_grad():
        m(x)
    assert all(torch.equal(a, b) for a, b in zip(first, masks))
    masks.clear()
    with torch.no_grad():
        m.eval()(x)
    for mask in masks:
        assert mask.shape == (Tm, Bm, Z) and mask.stride() == (0, 0, 1)
        assert torch.equal(mask[0, 0], torch.full((Z,), p, dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zoneout_training_matches_the_masks(backend, monkeypatch):
    """Training with p = 0.5: each unit of each step either keeps its previous
    value or takes the plain update, as its mask says (one layer, checked
    against the reference recurrence fed the captured mask)."""
    m = make_module("lstm", backend, zoneout=0.5).train()
    masks = capture_masks(monkeypatch)
    x, _, _ = reset_inputs(("zoneout-train",), False)
    hx = tuple(h.detach() for h in state_leaves(m, B, ("zoneout-train",)))
    call = lambda: flat(m(x.detach(), hx))  # noqa: E731
    if raises_unsupported(backend, ("zoneout",), call):
        return
    torch.manual_seed(11)
    got = call()
    (mask,) = masks
    want = reference.layer("lstm", x.detach(), hx[0][0], hx[1][0], m.weight_ih_l0, m.weight_hh_l0,
                           m.bias_ih_l0, m.bias_hh_l0, zoneout=mask)
    compare(got, [want[0], want[1].unsqueeze(0), want[2].unsqueeze(0)], ["output", "h_n", "c_n"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", ["lstm", "gru", "lstm_ln"])
def test_module_and_cell_agree_in_eval_with_zoneout(backend, cell):
    """A cell sharing a one-layer module's weights, stepped in Python, gives
    the module's evaluation outputs with zoneout (the blend in the cell is the
    one the sequence kernels apply per step)."""
    p = 0.4
    m = make_module(cell, backend, zoneout=p).eval()
    cls = {"lstm": rnnkern.LSTMCell, "gru": rnnkern.GRUCell, "lstm_ln": rnnkern.LayerNormLSTMCell}[cell]
    c = cls(I, H, zoneout=p, backend=backend, dtype=torch.float64).eval()
    c.load_state_dict({k[:-3]: v for k, v in m.state_dict().items()})
    x, _, _ = reset_inputs(("module-cell", cell), False)
    hx = tuple(h.detach() for h in state_leaves(m, B, ("module-cell", cell)))
    if raises_unsupported(backend, used(cell, "zoneout"), lambda: m(x, hx_arg(hx))):
        return
    out, *states = flat(m(x, hx_arg(hx)))
    state = tuple(h[0] for h in hx)
    for t in range(T):
        state = c(x[t], hx_arg(state))
        state = state if isinstance(state, tuple) else (state,)
        assert_close(out[t], state[0], what=f"step {t}")
    for got, want in zip(states, state):
        assert_close(got[0], want, what="final state")


# ------------------------------------------------------------ zoneout, cells ----

CELL_CLASSES = ["RNNCell", "GRUCell", "LSTMCell", "LayerNormLSTMCell"]


def make_cell(cls: str, backend: str, **kwargs):
    torch.manual_seed(seed_of("cell", cls))
    c = getattr(rnnkern, cls)(I, H, backend=backend, dtype=torch.float64, **kwargs)
    if cls == "LayerNormLSTMCell":
        randomize_ln(c)
    return c


def cell_states(cls, key, batch=B):
    g = generator("cell-hx", cls, *key)
    h = randn(g, batch, H, scale=0.5, requires_grad=True)
    return (h, randn(g, batch, H, scale=0.5, requires_grad=True)) if "LSTM" in cls else (h,)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", CELL_CLASSES)
def test_cell_zoneout(backend, cls):
    """Cells: evaluation blends p * hx + (1 - p) * step (values and gradients);
    training with p = 1 returns hx; with p = 0.5 each unit is hx's or the
    step's, about half each, and a seeded call reproduces."""
    p = 0.35
    plain = make_cell(cls, backend)
    zoned = make_cell(cls, backend, zoneout=p)
    x = randn(generator("cell-zoneout", cls), B, I, requires_grad=True)
    hx = cell_states(cls, ("zoneout",))
    if raises_unsupported(backend, ("LayerNormLSTM",) if cls == "LayerNormLSTMCell" else (),
                          lambda: plain(x)):
        return

    def parts(r):
        return list(r) if isinstance(r, tuple) else [r]

    leaves = [x, *hx, *zoned.parameters()]
    got = values_and_grads(parts(zoned.eval()(x, hx_arg(hx))), leaves, (cls,))
    step = parts(torch.func.functional_call(plain, dict(zoned.named_parameters()), (x, hx_arg(hx))))
    want = values_and_grads([p * h + (1 - p) * s for h, s in zip(hx, step)], leaves, (cls,))
    compare(got, want, ["h", "c"][:len(hx)] + ["grad x"] + [f"grad hx[{i}]" for i in range(len(hx))]
            + [f"grad {n}" for n, _ in zoned.named_parameters()], cls)

    frozen = make_cell(cls, backend, zoneout=1.0).train()
    for a, b in zip(parts(frozen(x, hx_arg(hx))), hx):
        assert torch.equal(a, b)

    half = make_cell(cls, backend, zoneout=0.5).train()
    big_x = randn(generator("cell-zoneout-big", cls), 64, I)
    big_hx = tuple(h.detach() for h in cell_states(cls, ("big",), batch=64))
    torch.manual_seed(5)
    first = parts(half(big_x, hx_arg(big_hx)))
    torch.manual_seed(5)
    again = parts(half(big_x, hx_arg(big_hx)))
    plain_step = parts(plain(big_x, hx_arg(big_hx)))
    kept = 0
    for a, b, prev, new in zip(first, again, big_hx, plain_step):
        assert torch.equal(a, b)
        is_prev, is_new = a == prev, a == new
        assert (is_prev | is_new).all()
        kept += is_prev.sum().item()
    n = sum(t.numel() for t in first)
    assert abs(kept / n - 0.5) < 5 * (0.25 / n) ** 0.5


# ------------------------------------------------------------ LayerNormLSTM ----

LN_FORMS = ("padded", "lengths", "packed_unsorted", "unbatched")
LN_CASES = [(b, f, bf) for b in BACKENDS for i, f in enumerate(LN_FORMS) for bf in (False, True)
            if b != "triton" or bf == (i % 2 == 1)]  # (the interpreter: each form once)
LN_IDS = [f"{f}-{'bf' if bf else 'tf'}-{b}" for b, f, bf in LN_CASES]


@pytest.mark.parametrize("backend,form,batch_first", LN_CASES, ids=LN_IDS)
def test_layer_norm_lstm_matches_the_loop(backend, form, batch_first):
    """Two layers, bidirectional, hx given: outputs, final states and every
    gradient against the loop of layer norms and LSTM equations written here."""
    m = make_module("lstm_ln", backend, num_layers=2, bidirectional=True, batch_first=batch_first)
    key = ("ln-module", form, batch_first)
    g = generator(*key)
    lengths = [5, 7, 2] if form != "padded" and form != "unbatched" else [T] * B
    unbatched = form == "unbatched"
    x_tm = randn(g, T, 1 if unbatched else B, I)
    x = (x_tm.squeeze(1) if unbatched else x_tm.transpose(0, 1) if batch_first else x_tm) \
        .contiguous().requires_grad_()
    hx = state_leaves(m, B, key, unbatched=unbatched)

    def ours():
        if form == "packed_unsorted":
            packed = pack_padded_sequence(x, torch.tensor(lengths), batch_first=batch_first,
                                          enforce_sorted=False)
            out, hidden = m(packed, hx)
            out = pad_packed_sequence(out, batch_first=batch_first, total_length=T)[0]
            return flat((out, hidden))
        kw = {"lengths": torch.tensor(lengths)} if form == "lengths" else {}
        return flat(m(x, hx, **kw))

    if raises_unsupported(backend, ("LayerNormLSTM",), ours):
        return
    leaves = [x, *hx, *m.parameters()]
    got = values_and_grads(ours(), leaves, key)
    if unbatched:
        want = loop_module(m, x.unsqueeze(1), tuple(h.unsqueeze(1) for h in hx))
        want = [want[0].squeeze(1)] + [s.squeeze(1) for s in want[1:]]
    else:
        want = loop_module(m, x.transpose(0, 1) if batch_first else x, hx,
                           lengths if form != "padded" else None)
        if batch_first:
            want[0] = want[0].transpose(0, 1)
    want = values_and_grads(want, leaves, key)
    labels = ["output", "h_n", "c_n", "grad input", "grad h0", "grad c0"] + \
        [f"grad {n}" for n, _ in m.named_parameters()]
    compare(got, want, labels, f"{backend} {form}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_layer_norm_lstm_without_hx(backend, bias):
    m = make_module("lstm_ln", backend, bias=bias)
    x = randn(generator("ln-no-hx", bias), T, B, I)
    if raises_unsupported(backend, ("LayerNormLSTM",), lambda: m(x)):
        return
    compare(flat(m(x)), loop_module(m, x, None), ["output", "h_n", "c_n"], backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["batched", "unbatched", "no-hx"])
def test_layer_norm_lstm_cell_matches_the_step(backend, form):
    """LayerNormLSTMCell: (h, c) and every gradient against the step written here."""
    cell = make_cell("LayerNormLSTMCell", backend)
    g = generator("ln-cell", form)
    x = randn(g, *((I,) if form == "unbatched" else (B, I)), requires_grad=True)
    hx = None if form == "no-hx" else tuple(
        randn(g, *((H,) if form == "unbatched" else (B, H)), scale=0.5, requires_grad=True)
        for _ in range(2))
    if raises_unsupported(backend, ("LayerNormLSTM",), lambda: cell(x, hx)):
        return
    got = list(cell(x, hx))
    x2 = x if form != "unbatched" else x.unsqueeze(0)
    states = (torch.zeros(B, H, dtype=torch.float64),) * 2 if hx is None else \
        tuple(h if form != "unbatched" else h.unsqueeze(0) for h in hx)
    want = list(ln_lstm_step(cell, "", x2, *states))
    if form == "unbatched":
        want = [w.squeeze(0) for w in want]
    leaves = [x, *(hx or ()), *cell.parameters()]
    compare(values_and_grads(got, leaves, ("ln-cell", form)),
            values_and_grads(want, leaves, ("ln-cell", form)),
            ["h", "c", "grad x"] + [f"grad hx[{i}]" for i in range(len(hx or ()))]
            + [f"grad {n}" for n, _ in cell.named_parameters()], f"{backend} {form}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_norm_lstm_with_resets_and_packed_zoneout_eval(backend):
    """LayerNormLSTM with every option through a PackedSequence (evaluation,
    zoneout p, resets, two layers, bidirectional): the episodes run separately
    through the loop with the blend, values and gradients."""
    p = 0.25
    m = make_module("lstm_ln", backend, num_layers=2, bidirectional=True, zoneout=p).eval()
    x, resets, lengths = reset_inputs(("ln-all",), False)
    hx = state_leaves(m, B, ("ln-all",))
    packed = pack_padded_sequence(x, torch.tensor(lengths), enforce_sorted=False)

    def call():
        out, hidden = m(packed, hx, resets=resets)
        return flat((pad_packed_sequence(out, total_length=T)[0], hidden))

    if raises_unsupported(backend, ("LayerNormLSTM", "resets", "zoneout"), call):
        return
    leaves = [x, *hx, *m.parameters()]
    got = values_and_grads(call(), leaves, ("ln-all",))
    want = values_and_grads(run_episodes_separately(m, x, resets, lengths, hx, p=p), leaves, ("ln-all",))
    compare(got, want, ["output", "h_n", "c_n", "grad input", "grad h0", "grad c0"]
            + [f"grad {n}" for n, _ in m.named_parameters()], backend)


# ------------------------------------------------- parameters and serialisation ----

def test_layer_norm_lstm_parameters_and_initialisation():
    """torch.nn.LSTM's parameters first, drawn as torch.nn.LSTM draws them (same
    seed, same values), then the layer norms': gains 1, shift 0."""
    torch.manual_seed(9)
    theirs = nn.LSTM(3, 5, num_layers=2, bidirectional=True)
    torch.manual_seed(9)
    ours = rnnkern.LayerNormLSTM(3, 5, num_layers=2, bidirectional=True)
    assert not isinstance(ours, nn.LSTM) and isinstance(ours, nn.RNNBase)
    names = [n for n, _ in ours.named_parameters()]
    torch_names = [n for n, _ in theirs.named_parameters()]
    assert names[:len(torch_names)] == torch_names
    ln_names = [f"{stem}_l{k}{sfx}" for k in range(2) for sfx in ("", "_reverse")
                for stem in ("ln_ih_weight", "ln_hh_weight", "ln_cell_weight", "ln_cell_bias")]
    assert names[len(torch_names):] == ln_names
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name
    for name in ln_names:
        value = getattr(ours, name)
        assert value.shape == ((20,) if "ih" in name or "hh" in name else (5,))
        assert torch.equal(value, torch.full_like(value, 0.0 if "bias" in name else 1.0))
    ours.reset_parameters()
    assert torch.equal(ours.ln_cell_bias_l1_reverse, torch.zeros(5))
    assert repr(ours) == "LayerNormLSTM(3, 5, num_layers=2, bidirectional=True)"
    torch.manual_seed(9)
    cell_theirs = nn.LSTMCell(3, 5, bias=False)
    torch.manual_seed(9)
    cell = rnnkern.LayerNormLSTMCell(3, 5, bias=False, zoneout=0.1, backend="reference")
    assert [n for n, _ in cell.named_parameters()] == \
        ["weight_ih", "weight_hh", "ln_ih_weight", "ln_hh_weight", "ln_cell_weight", "ln_cell_bias"]
    assert torch.equal(cell.weight_ih, cell_theirs.weight_ih)
    assert torch.equal(cell.weight_hh, cell_theirs.weight_hh)
    assert repr(cell) == "LayerNormLSTMCell(3, 5, bias=False, zoneout=0.1, backend='reference')"
    assert rnnkern.convert(ours) is ours and type(ours) is rnnkern.LayerNormLSTM


def test_torch_nn_lstm_state_dict_loads_without_the_layer_norms():
    """A torch.nn.LSTM checkpoint loads with strict=False: only the layer norms'
    entries are missing, and the weights are the LSTM's."""
    theirs = nn.LSTM(3, 5, num_layers=2, bidirectional=True, bias=False)
    ours = rnnkern.LayerNormLSTM(3, 5, num_layers=2, bidirectional=True, bias=False)
    result = ours.load_state_dict(theirs.state_dict(), strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == [n for n, _ in ours.named_parameters() if n.startswith("ln_")]
    for name, value in theirs.state_dict().items():
        assert torch.equal(getattr(ours, name), value), name


def test_layer_norm_lstm_factory_kwargs():
    m = rnnkern.LayerNormLSTM(3, 5, device="meta", dtype=torch.float64)
    assert all(p.is_meta and p.dtype == torch.float64 for p in m.parameters())
    c = rnnkern.LayerNormLSTMCell(3, 5, device="meta", dtype=torch.float16)
    assert all(p.is_meta and p.dtype == torch.float16 for p in c.parameters())


@pytest.mark.parametrize("make", [
    lambda: rnnkern.LayerNormLSTM(3, 4, num_layers=2, bidirectional=True, zoneout=0.2,
                                  backend="reference"),
    lambda: rnnkern.LayerNormLSTMCell(3, 4, zoneout=0.2, backend="reference"),
], ids=["LayerNormLSTM", "LayerNormLSTMCell"])
def test_layer_norm_state_dict_pickle_deepcopy_torch_save(make):
    torch.manual_seed(2)
    source = make().double().eval()
    randomize_ln(source)
    torch.manual_seed(3)
    target = make().double().eval()
    target.load_state_dict(source.state_dict())
    x = randn(generator("ln-state-dict"), *((5, 2, 3) if isinstance(source, nn.RNNBase) else (2, 3)))

    def run(m):
        return torch.utils._pytree.tree_leaves(m(x))

    want = run(source)
    buffer = io.BytesIO()
    torch.save(source, buffer)
    buffer.seek(0)
    copies = [target, pickle.loads(pickle.dumps(source)), copy.deepcopy(source),
              torch.load(buffer, weights_only=False)]
    for m in copies:
        assert m.zoneout == 0.2 and m.backend == "reference"
        for a, b in zip(run(m), want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("theirs_cls,ours_cls,args", [
    (nn.RNN, rnnkern.RNN, (3, 5)), (nn.GRU, rnnkern.GRU, (3, 5)), (nn.LSTM, rnnkern.LSTM, (3, 5)),
    (nn.RNNCell, rnnkern.RNNCell, (3, 5)), (nn.GRUCell, rnnkern.GRUCell, (3, 5)),
    (nn.LSTMCell, rnnkern.LSTMCell, (3, 5)),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_zoneout_keeps_torch_nn_compatibility(theirs_cls, ours_cls, args):
    """zoneout is a plain attribute: the state_dict is torch.nn's (both ways), the
    repr is torch.nn's at 0 and names zoneout otherwise, pickling keeps it, and
    a module pickled before it existed reads 0."""
    torch.manual_seed(1)
    theirs = theirs_cls(*args)
    torch.manual_seed(1)
    ours = ours_cls(*args, zoneout=0.25)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert repr(ours_cls(*args)) == repr(theirs)
    assert repr(ours) == repr(theirs)[:-1] + ", zoneout=0.25)"
    assert pickle.loads(pickle.dumps(ours)).zoneout == 0.25
    old = pickle.loads(pickle.dumps(ours))
    del old.__dict__["zoneout"]  # as unpickled from before the attribute existed
    assert old.zoneout == 0.0 and repr(old) == repr(theirs)
    assert rnnkern.convert(theirs).zoneout == 0.0


# --------------------------------------------------------------- autocast ----

@pytest.mark.parametrize("cell,form", [("lstm_ln", "packed"), ("lstm_ln", "padded"),
                                       ("gru", "padded"), ("lstm", "lengths")])
def test_autocast_runs_the_options_in_the_autocast_dtype(cell, form):
    """CPU bfloat16 autocast with resets and zoneout (evaluation): the numbers of
    the same module cast to bfloat16 (reference backend, bitwise), and the
    result dtypes of the README's rule (LayerNormLSTM: all bfloat16)."""
    m = make_module(cell, "reference", num_layers=2, bidirectional=True, zoneout=0.3,
                    dtype=torch.float32).eval()
    low = copy.deepcopy(m).to(torch.bfloat16)
    x, resets, lengths = reset_inputs(("autocast", cell, form), False)
    x = x.detach().float()

    def call(module, inp):
        if form == "packed":
            out, hidden = module(pack_padded_sequence(inp, torch.tensor(lengths), enforce_sorted=False),
                                 resets=resets)
            return flat((pad_packed_sequence(out, total_length=T)[0], hidden))
        kw = {"lengths": torch.tensor(lengths)} if form == "lengths" else {}
        return flat(module(inp, resets=resets, **kw))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = call(m, x)
    want = call(low, x.to(torch.bfloat16))
    for a, b in zip(got, want):
        assert torch.equal(a.to(torch.bfloat16), b)
    # LayerNormLSTM: all in the autocast dtype; GRU and the LSTM with lengths
    # promote with the (absent, so the input's) float32 state.
    want_dtype = torch.bfloat16 if cell == "lstm_ln" else torch.float32
    assert all(t.dtype == want_dtype for t in got), [t.dtype for t in got]


def test_autocast_cell_zoneout():
    c = make_cell("LayerNormLSTMCell", "reference", zoneout=0.3).float().eval()
    low = copy.deepcopy(c).to(torch.bfloat16)
    x = randn(generator("autocast-cell"), B, I, dtype=torch.float32)
    hx = tuple(h.detach().float() for h in cell_states("LSTMCell", ("autocast",)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = c(x, hx)
    want = low(x.to(torch.bfloat16), tuple(h.to(torch.bfloat16) for h in hx))
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


# ---------------------------------------------------------- torch.compile ----

@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled_and_eager(m, make_call, key):
    """fullgraph compile (aot_eager: Dynamo and AOTAutograd without inductor's
    code generation, to keep CI fast) against eager: values and the gradients
    of the call's leaves and every parameter."""
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, m):
        result, leaves = make_call(fn)
        results.append(values_and_grads(result, leaves + list(m.parameters()), key))
    for k, (a, b) in enumerate(zip(*results)):
        assert_close(a, b, what=f"{key} result {k}")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("form", ["padded", "lengths"])
def test_compile_lstm_with_resets_and_zoneout(backend, form, dynamo):
    """torch.compile(fullgraph=True) of LSTM with resets= and zoneout
    (evaluation) agrees with eager, values and gradients (the flag torch.nn's
    classes need, see the README)."""
    m = make_module("lstm", backend, num_layers=2, bidirectional=True, zoneout=0.3,
                    batch_first=True, input_size=2, hidden_size=3).eval()
    g = generator("compile-resets", form)
    Tc, Bc = 4, 3
    resets = torch.zeros(Bc, Tc, dtype=torch.bool)
    resets[0, 2] = resets[2, 1] = True
    kw = {"lengths": torch.tensor([4, 2, 3])} if form == "lengths" else {}
    x0 = randn(g, Bc, Tc, 2)

    def make_call(fn):
        x = x0.clone().requires_grad_()
        return flat(fn(x, resets=resets, **kw)), [x]

    if raises_unsupported(backend, ("resets", "zoneout"), lambda: make_call(m)):
        return
    with torch._dynamo.config.patch(allow_rnn=True):
        compiled_and_eager(m, make_call, ("compile", backend, form))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_compile_layer_norm_lstm_packed_without_the_flag(backend, dynamo):
    """LayerNormLSTM is no torch.nn.LSTM: Dynamo compiles it without
    allow_rnn, with a PackedSequence and resets."""
    m = make_module("lstm_ln", backend, bidirectional=True, input_size=2, hidden_size=3)
    g = generator("compile-ln")
    x0 = randn(g, 4, 3, 2)
    resets = torch.tensor([[0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=torch.bool)

    def make_call(fn):
        x = x0.clone().requires_grad_()
        out, hidden = fn(pack_padded_sequence(x, torch.tensor([4, 2, 3]), enforce_sorted=False),
                         resets=resets)
        return flat((out, hidden)), [x]

    if raises_unsupported(backend, ("LayerNormLSTM", "resets"), lambda: make_call(m)):
        return
    with torch._dynamo.config.patch(allow_rnn=False):
        compiled_and_eager(m, make_call, ("compile-ln", backend))


def test_compile_zoneout_training_and_cells(dynamo):
    """Training masks are drawn inside the compiled graph: p = 1 keeps the state
    (a deterministic check of the compiled mask path); a LayerNormLSTMCell
    with zoneout compiles and agrees with eager in evaluation."""
    m = make_module("gru", "reference", zoneout=1.0, input_size=2, hidden_size=3).train()
    x = randn(generator("compile-zoneout"), 4, 2, 2)
    h0 = randn(generator("compile-zoneout-h"), 1, 2, 3)
    with torch._dynamo.config.patch(allow_rnn=True):
        out, h = torch.compile(m, fullgraph=True, backend="aot_eager")(x, h0)
    assert torch.equal(out, h0.expand(4, 2, 3)) and torch.equal(h, h0)
    c = make_cell("LayerNormLSTMCell", "reference", zoneout=0.3).eval()
    xc = randn(generator("compile-cell"), B, I, requires_grad=True)
    hc = cell_states("LSTMCell", ("compile",))

    def make_call(fn):
        return list(fn(xc, hc)), [xc, *hc]

    compiled_and_eager(c, make_call, ("compile-cell",))


# ----------------------------------------------------------- trace and export ----

def quiet_trace(m, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.trace(m, args)


class WithResets(nn.Module):
    """A model taking the reset mask as an input, as an RL policy does."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, resets):
        return self.rnn(x, resets=resets)[0]


class Passing(nn.Module):
    """A model around a module, passing its arguments on."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args)


@pytest.mark.parametrize("make,args,words", [
    (lambda: WithResets(rnnkern.LSTM(3, 4, backend="reference")),
     (torch.randn(5, 2, 3), torch.zeros(5, 2, dtype=torch.bool)), r"forward\(resets=\.\.\.\): .*has no resets"),
    (lambda: rnnkern.GRU(3, 4, zoneout=0.2), (torch.randn(5, 2, 3),), r"GRU\(zoneout=0\.2\): .*has no zoneout"),
    (lambda: rnnkern.LSTMCell(3, 4, zoneout=0.2), (torch.randn(2, 3),), r"LSTMCell\(zoneout=0\.2\)"),
    (lambda: rnnkern.LayerNormLSTM(3, 4), (torch.randn(5, 2, 3),), "LayerNormLSTM: .*layer-normalised"),
    (lambda: rnnkern.LayerNormLSTMCell(3, 4), (torch.randn(2, 3),), "LayerNormLSTMCell: .*layer-normalised"),
], ids=["resets", "zoneout", "cell-zoneout", "LayerNormLSTM", "LayerNormLSTMCell"])
def test_trace_and_onnx_export_say_what_works_instead(make, args, words):
    """torch.jit.trace and ONNX export record torch.nn's forward, which has none
    of these: a clear error naming the option and torch.export / torch.compile."""
    m = make().eval()
    pattern = words + r".*torch\.export\.export or torch\.compile"
    with pytest.raises(NotImplementedError, match=pattern):
        quiet_trace(m, *args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NotImplementedError, match=pattern):
            # (inside a model: the TorchScript exporter passes every keyword-only
            # default of a bare module's forward positionally)
            torch.onnx.export(Passing(m), args, io.BytesIO(), dynamo=False)


@pytest.mark.parametrize("make", [lambda: rnnkern.LayerNormLSTM(3, 4),
                                  lambda: rnnkern.LayerNormLSTMCell(3, 4)], ids=["module", "cell"])
def test_jit_script_of_layer_norm_says_what_works_instead(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(RuntimeError, match=r"cannot compile rnnkern\.LayerNormLSTM.*"
                                               r"torch\.export\.export or torch\.compile"):
            torch.jit.script(make())


@pytest.mark.parametrize("backend", BACKENDS[:2])
@pytest.mark.parametrize("cell", ["lstm", "lstm_ln"])
def test_torch_export_captures_the_options(backend, cell):
    """torch.export.export of a model with resets as an input and zoneout in
    evaluation: rnnkern's ops in the graph (except on the reference backend,
    plain torch ops), the eager numbers and gradients."""
    rnn = make_module(cell, backend, bidirectional=True, zoneout=0.3).eval()
    m = WithResets(rnn)
    x, resets, _ = reset_inputs(("export", cell), False)
    x = x.detach()
    if raises_unsupported(backend, used(cell, "resets", "zoneout"), lambda: m(x, resets)):
        return
    ep = torch.export.export(m, (x, resets))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    if backend != "reference":
        assert any(t.startswith("rnnkern.") for t in targets), targets
    exported = ep.module()
    results = []
    for fn in (exported, m):
        xi = x.clone().requires_grad_()
        names, params = zip(*sorted(fn.named_parameters()))
        out = fn(xi, resets)
        results.append((names, values_and_grads([out], [xi, *params], ("export", cell))))
    (names, got), (want_names, want) = results
    assert names == want_names
    compare(got, want, ["output", "grad input"] + [f"grad {n}" for n in names], f"export {backend}")


# ------------------------------------------------------------------- errors ----

@pytest.mark.parametrize("case,bad,exc,words", [
    ("padded-list", lambda m, x: m(x, resets=[[True] * B] * T), TypeError, ["resets", "[T, B] = [7, 3]"]),
    ("padded-int64", lambda m, x: m(x, resets=torch.zeros(T, B, dtype=torch.int64)), TypeError,
     ["resets", "torch.bool", "torch.uint8", "floating", "torch.int64"]),
    ("padded-float-not-0-1", lambda m, x: m(x, resets=torch.full((T, B), 0.5)), ValueError,
     ["resets", "only 0 and 1", "0.5"]),
    ("padded-uint8-2", lambda m, x: m(x, resets=torch.full((T, B), 2, dtype=torch.uint8)), ValueError,
     ["resets", "only 0 and 1", "2"]),
    ("padded-trailing-2", lambda m, x: m(x, resets=torch.zeros(T, B, 2, dtype=torch.bool)), ValueError,
     ["resets", "[T, B] = [7, 3]", "[7, 3, 1]", "[7, 3, 2]"]),
    ("padded-shape", lambda m, x: m(x, resets=torch.zeros(B, T, dtype=torch.bool)), ValueError,
     ["resets", "[T, B] = [7, 3]", "[3, 7]"]),
    ("padded-1d", lambda m, x: m(x, resets=torch.zeros(T, dtype=torch.bool)), ValueError,
     ["resets", "[T, B] = [7, 3]"]),
    ("device", lambda m, x: m(x, resets=torch.zeros(T, B, dtype=torch.bool, device="meta")), ValueError,
     ["resets", "cpu", "meta"]),
    ("unbatched", lambda m, x: m(x[:, 0], resets=torch.zeros(T, 2, dtype=torch.bool)), ValueError,
     ["resets", "[T] = [7]"]),
    ("packed", lambda m, x: m(pack_padded_sequence(x, [7, 5, 2]), resets=torch.zeros(5, B, dtype=torch.bool)),
     ValueError, ["resets", "[T, B] = [7, 3]", "[5, 3]"]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_resets_are_named_before_any_kernel(case, bad, exc, words, monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "run_recurrence", lambda *a: calls.append(a))
    m = make_module("lstm", "reference")
    x = randn(generator("bad-resets"), T, B, I)
    with pytest.raises(exc) as e:
        bad(m, x)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert calls == []


def test_bad_resets_batch_first_names_its_layout():
    m = make_module("gru", "reference", batch_first=True)
    with pytest.raises(ValueError, match=r"resets of shape \[B, T\] \(batch_first\) = \[3, 7\] \(or \[3, 7, 1\]\), got \[7, 3\]"):
        m(randn(generator("bf"), B, T, I), resets=torch.zeros(T, B, dtype=torch.bool))


@pytest.mark.parametrize("cls", ["RNN", "GRU", "LSTM", "LayerNormLSTM", "RNNCell", "GRUCell",
                                 "LSTMCell", "LayerNormLSTMCell"])
@pytest.mark.parametrize("value", [-0.1, 1.5, True, "0.1", None], ids=str)
def test_bad_zoneout(cls, value):
    with pytest.raises(ValueError, match=r"zoneout should be a number in range \[0, 1\]"):
        getattr(rnnkern, cls)(3, 5, zoneout=value)


@pytest.mark.parametrize("kwargs,words", [
    (dict(hidden_size=0), ["hidden_size", "greater than zero"]),
    (dict(num_layers=0), ["num_layers", "greater than zero"]),
    (dict(dropout=1.5), ["dropout", "[0, 1]"]),
    (dict(bias="yes"), ["bias", "bool"]),
    (dict(backend="fortran"), ["fortran", "reference"]),
])
def test_layer_norm_lstm_bad_constructor_arguments(kwargs, words):
    args = dict(input_size=3, hidden_size=5) | kwargs
    with pytest.raises((ValueError, TypeError)) as e:
        rnnkern.LayerNormLSTM(**args)
    if "backend" not in kwargs:
        with pytest.raises(type(e.value)):
            nn.LSTM(**args)
    for w in words:
        assert w in str(e.value)
    with pytest.raises(TypeError, match="proj_size"):
        rnnkern.LayerNormLSTM(3, 5, proj_size=2)


def _ln_cell_pair():
    torch.manual_seed(0)
    return nn.LSTMCell(4, 5), rnnkern.LayerNormLSTMCell(4, 5, backend="reference")


@pytest.mark.parametrize("bad,words", [
    (lambda m: m(torch.randn(3, 6)), ["input_size", "6", "4"]),
    (lambda m: m(torch.randn(2, 3, 4)), ["1D or 2D", "3D"]),
    (lambda m: m(torch.randn(3, 4), torch.randn(3, 5)), ["hx", "tuple"]),
    (lambda m: m(torch.randn(3, 4), (torch.randn(2, 5), torch.randn(2, 5))), ["batch size", "3", "2"]),
    (lambda m: m(torch.randn(3, 4), (torch.randn(3, 6), torch.randn(3, 6))), ["hidden_size", "6", "5"]),
], ids=["input-size", "input-3d", "hx-not-pair", "hx-batch", "hx-size"])
def test_layer_norm_lstm_cell_bad_input_like_torch(bad, words):
    """The same exception types as torch.nn.LSTMCell's, messages naming the argument."""
    theirs, ours = _ln_cell_pair()
    with pytest.raises(Exception) as want:
        bad(theirs)
    with pytest.raises(type(want.value)) as got:
        bad(ours)
    for w in words:
        assert w in str(got.value), (w, str(got.value))


@pytest.mark.parametrize("option,build,run", [
    ("resets", lambda: rnnkern.GRU(3, 5, backend="cpu"),
     lambda m: m(torch.randn(4, 2, 3), resets=torch.zeros(4, 2, dtype=torch.bool))),
    ("resets", lambda: rnnkern.LSTM(3, 5, backend="cpu"),
     lambda m: m(pack_padded_sequence(torch.randn(4, 2, 3), [4, 2]),
                 resets=torch.zeros(4, 2, dtype=torch.bool))),
    ("zoneout", lambda: rnnkern.RNN(3, 5, zoneout=0.1, backend="cpu"), lambda m: m(torch.randn(4, 2, 3))),
    ("zoneout", lambda: rnnkern.LSTM(3, 5, zoneout=0.1, backend="cpu").eval(),
     lambda m: m(torch.randn(4, 2, 3))),
    ("LayerNormLSTM", lambda: rnnkern.LayerNormLSTM(3, 5, backend="cpu"), lambda m: m(torch.randn(4, 2, 3))),
    ("LayerNormLSTM", lambda: rnnkern.LayerNormLSTMCell(3, 5, backend="cpu"), lambda m: m(torch.randn(2, 3))),
], ids=["resets", "resets-packed", "zoneout", "zoneout-eval", "LayerNormLSTM", "LayerNormLSTMCell"])
def test_unsupported_option_names_the_backends_that_can(monkeypatch, option, build, run):
    """A backend lacking an option raises NotImplementedError naming it and the
    backends that have it, before any op runs (the table patched here, so the
    test holds whatever the kernels' state)."""
    monkeypatch.setitem(modules.UNSUPPORTED, "cpu", frozenset({option}))
    monkeypatch.setitem(modules.UNSUPPORTED, "triton", frozenset({option}))
    monkeypatch.setitem(modules.UNSUPPORTED, "reference", frozenset())
    calls = []
    monkeypatch.setattr(ops, "run_recurrence", lambda *a: calls.append(a))
    monkeypatch.setattr(ops, "run_step", lambda *a: calls.append(a))
    m = build()
    with pytest.raises(NotImplementedError) as e:
        run(m)
    message = str(e.value)
    assert f"backend='cpu' does not support {option}" in message
    assert "reference" in message.split("backends that do:")[1]
    assert "triton" not in message.split("backends that do:")[1]
    assert calls == []


def test_cells_zoneout_needs_no_kernel_support(monkeypatch):
    """The cells blend in Python: zoneout is not a kernel option for them."""
    monkeypatch.setitem(modules.UNSUPPORTED, "cpu", frozenset({"zoneout"}))
    c = rnnkern.GRUCell(3, 5, zoneout=0.3, backend="cpu").eval()
    h = c(torch.randn(2, 3))
    assert h.shape == (2, 5)

"""Shared machinery and independent truths for the tests of the modules' options beyond torch.nn
(tests/test_options_*.py): ``resets=`` on forward,
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


# --------------------------------------- inputs and modules used by several files ----

FORMS = ("padded", "lengths", "packed")


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

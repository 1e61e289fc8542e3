"""torch.utils.flop_counter.FlopCounterMode (what Lightning's measure_flops and
MFU counters run) counts rnnkern's modules: every op carries a formula
(rnnkern/library.py), the matrix products at 2 * m * n * k each.

- A cell counts what torch.nn's counts (its addmm and mm), forward and backward,
  with and without a state that needs a gradient, on every backend.
- A sequence module counts what torch.nn's counts where torch.nn's runs as
  matrix products (float64 on the CPU; in float32 it runs oneDNN's op, which
  the counter does not count at all), padded and packed, when every input needs
  its gradient (torch.nn's backward skips the product for h0's gradient when
  h0 needs none; rnnkern's kernels make it, and the count says so).  A packed
  batch counts the positions the backend steps: the CPU backend its rows, the
  others the padded grid.
- Inference (float32 and bfloat16 run rnnkern::recurrence_from_input, the
  projection inside the steps) counts the products of the two ops it fuses.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence
from torch.utils.flop_counter import FlopCounterMode

import rnnkern
from rnnkern import ops
from conftest import TRITON_INTERPRET, randn, generator

BACKENDS = (["reference", "cpu"] + (["triton"] if TRITON_INTERPRET else [])
            + (["cuda_emulated"] if ops.WITH_CUDA_EMULATION else []))
CELLS = [(nn.RNNCell, rnnkern.RNNCell), (nn.GRUCell, rnnkern.GRUCell), (nn.LSTMCell, rnnkern.LSTMCell)]
SEQUENCES = [(nn.RNN, rnnkern.RNN, dict(nonlinearity="relu")),
             (nn.GRU, rnnkern.GRU, dict(num_layers=2, bidirectional=True)),
             (nn.LSTM, rnnkern.LSTM, dict(num_layers=2, proj_size=3))]


def flops(module, make_input, hx=None, backward=True):
    """The counter's total over a forward (and a backward of the output's sum)."""
    x = make_input()
    with FlopCounterMode(display=False) as counter:
        out = module(x) if hx is None else module(x, hx)
        out = out[0] if isinstance(out, tuple) else out
        if backward:
            (out.data if isinstance(out, PackedSequence) else out).sum().backward()
    return counter.get_total_flops()


def twins(theirs_cls, ours_cls, backend, kwargs=None):
    theirs = theirs_cls(5, 6, dtype=torch.float64, **(kwargs or {}))
    ours = ours_cls(5, 6, dtype=torch.float64, backend=backend, **(kwargs or {}))
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("theirs_cls,ours_cls", CELLS, ids=[c[0].__name__ for c in CELLS])
def test_cells_count_torch_nn_s_flops(theirs_cls, ours_cls, backend):
    theirs, ours = twins(theirs_cls, ours_cls, backend)
    gen = generator("flops", theirs_cls.__name__)
    x = randn(gen, 4, 5)
    h = randn(gen, 4, 6)
    c = randn(gen, 4, 6)
    for what, hx, backward in [("no state", None, True), ("no backward", None, False),
                               ("state needing grad", h, True)]:
        def make_input():
            return x.clone().requires_grad_(backward)

        def state():
            if hx is None:
                return None
            h_ = hx.clone().requires_grad_()
            return (h_, c.clone().requires_grad_()) if theirs_cls is nn.LSTMCell else h_

        want = flops(theirs, make_input, state(), backward)
        assert want > 0
        assert flops(ours, make_input, state(), backward) == want, what


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("theirs_cls,ours_cls,kwargs", SEQUENCES, ids=[s[0].__name__ for s in SEQUENCES])
def test_sequence_modules_count_torch_nn_s_flops(theirs_cls, ours_cls, kwargs, backend):
    if backend == "triton" and theirs_cls is not nn.GRU:
        pytest.skip("the interpreter takes seconds per launch: one configuration under Triton")
    theirs, ours = twins(theirs_cls, ours_cls, backend, kwargs)
    gen = generator("flops", theirs_cls.__name__, backend)
    layers = kwargs.get("num_layers", 1) * (2 if kwargs.get("bidirectional") else 1)
    x = randn(gen, 7, 3, 5)
    h0 = randn(gen, layers, 3, kwargs.get("proj_size") or 6)
    c0 = randn(gen, layers, 3, 6)

    def state():
        h = h0.clone().requires_grad_()
        return (h, c0.clone().requires_grad_()) if theirs_cls is nn.LSTM else h

    def padded():
        return x.clone().requires_grad_()

    def packed():
        return pack_padded_sequence(x.clone().requires_grad_(), [7, 4, 2])

    # The CPU backend steps a packed batch's rows; the others step the padded
    # grid [T, B] (masked past each row's length): 7 * 3 positions for 13 rows,
    # each with every layer's and direction's recurrent products.
    grid_steps = 0 if backend == "cpu" else 7 * 3 - 13
    recurrent = sum(p.numel() for name, p in theirs.named_parameters()
                    if name.startswith(("weight_hh", "weight_hr")))
    for what, make_input, padding in [("padded", padded, 0), ("packed", packed, grid_steps)]:
        want = flops(theirs, make_input, state())
        assert want > 0
        assert flops(ours, make_input, state()) == want + 6 * padding * recurrent, what
        with torch.no_grad():
            want = flops(theirs, make_input, state(), backward=False)
            assert flops(ours, make_input, state(), backward=False) == want + 2 * padding * recurrent, \
                f"{what} no_grad"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 2, 32])
def test_inference_counts_the_products_it_fuses(dtype, batch):
    """float32 and bfloat16 inference on the CPU backend runs one op per layer,
    rnnkern::recurrence_from_input, on each of its paths by batch: it counts
    the input projection and the recurrence, as the float64 call (the two ops)
    counts them."""
    ours = rnnkern.LSTM(5, 6, num_layers=2, dtype=dtype, backend="cpu")
    in64 = rnnkern.LSTM(5, 6, num_layers=2, dtype=torch.float64, backend="cpu")
    x = randn(generator("flops-inference", batch), 20, batch, 5)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        ours(x.to(dtype))
    with torch.no_grad(), FlopCounterMode(display=False) as counter64:
        in64(x)
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(by_op) == {"rnnkern.recurrence_from_input"}
    # per position: layer 0 W_ih [24, 5] and W_hh [24, 6], layer 1 both [24, 6]
    assert counter.get_total_flops() == counter64.get_total_flops() == 2 * 20 * batch * 24 * (5 + 3 * 6)


def test_counts_are_attributed_to_the_module_as_torch_nn_s():
    """The counter's per-module rows (ModuleTracker: forward and backward) put
    the module's FLOPs under its name in the model, as for torch.nn's."""
    class Model(nn.Module):
        def __init__(self, rnn):
            super().__init__()
            self.rnn = rnn
            self.head = nn.Linear(6, 2, dtype=torch.float64)

        def forward(self, x):
            return self.head(self.rnn(x)[0])

    theirs, ours = twins(nn.GRUCell, rnnkern.GRUCell, "cpu")
    x = randn(generator("flops-attribution"), 4, 5)
    rows = []
    for cell in (theirs, ours):
        with FlopCounterMode(display=False) as counter:
            Model(cell)(x.clone().requires_grad_()).sum().backward()
        rows.append({name: sum(by_op.values()) for name, by_op in counter.get_flop_counts().items()})
    assert rows[0]["Model.rnn"] > 0
    assert rows[1] == rows[0]

"""FlashRNN (NX-AI's ``flashrnn`` package, GPU only): torch.nn's weights mapped
to its layout."""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from rnnkern import reference

from .common import MODULES, Built, Layer, copy_module

#: FlashRNN JIT-compiles a CUDA kernel per (cell, hidden size, batch, dtype), one to
#: two minutes each, so by default it runs at the headline size only.
FLASHRNN_FAMILIES = ("headline",)

FLASHRNN_FUNCTIONS = {"lstm": "lstm", "gru": "gru", "rnn_tanh": "elman"}


def _flashrnn_unavailable(device):
    if device.type != "cuda":
        return "FlashRNN's kernels are CUDA only"
    try:
        importlib.import_module("flashrnn")
    except Exception as e:
        return f"the flashrnn package does not import: {type(e).__name__}: {e}"
    return None


def _flashrnn_skip(case, device, options):
    if case.call == "cell":
        return "FlashRNN has no cell (one-step) API"
    if case.cell not in FLASHRNN_FUNCTIONS:
        return f"FlashRNN has no {case.cell} cell"
    if not options.get("flashrnn_everywhere") and not set(case.families) & set(FLASHRNN_FAMILIES):
        return ("FlashRNN compiles a kernel per size at run time (1-2 min each): headline size "
                "only (--flashrnn-everywhere to time it on the whole grid)")
    return None


def flashrnn_layer(cell: str, params: list, dtype: torch.dtype, backend: str = "cuda_fused") -> Layer:
    """torch.nn's weights in FlashRNN's layout (one head), around ``flashrnn.flashrnn``.

    FlashRNN takes Wx [B, T, G, heads, D], R [G, heads, D_out, D_in], b [G', heads, D]
    and states [S, B, 1, heads, D]; it returns all states [S, B, T, heads, D] and
    the last ones [S, B, 1, heads, D].  LSTM gates i, f, g, o and the Elman cell map
    one to one.  Its GRU keeps the recurrent rows in the order (n, r, z) and four
    biases: b_hn (inside r * (.)), b_r, b_z (both biases summed), b_in.
    """
    from flashrnn import flashrnn

    w_ih, w_hh, b_ih, b_hh = params
    G = reference.gate_count(cell)
    lstm = cell == "lstm"
    function = FLASHRNN_FUNCTIONS[cell]
    dtype_name = str(dtype).replace("torch.", "")

    def layer(x, h0, c0):
        T, B, _ = x.shape
        H = h0.shape[1]
        wx = F.linear(x, w_ih).view(T, B, G, 1, H).transpose(0, 1)
        if cell == "gru":
            R = torch.cat([w_hh[2 * H:], w_hh[: 2 * H]]).view(3, 1, H, H)
            b = torch.stack([b_hh[2 * H:], b_ih[:H] + b_hh[:H], b_ih[H: 2 * H] + b_hh[H: 2 * H],
                             b_ih[2 * H:]]).view(4, 1, H)
        else:
            R = w_hh.view(G, 1, H, H)
            b = (b_ih + b_hh).view(G, 1, H)
        states = torch.stack([h0, c0] if lstm else [h0])[:, :, None, None, :]
        out, last = flashrnn(wx, R, b, states=states, function=function, backend=backend,
                             dtype=dtype_name)
        return (out[0, :, :, 0].transpose(0, 1), last[0, :, 0, 0],
                last[1, :, 0, 0] if lstm else None)

    return layer


def _build_flashrnn(case, src, device):
    m = copy_module(MODULES[case.cell][0], src, case, device, case.torch_dtype)
    params = [m.weight_ih_l0, m.weight_hh_l0, m.bias_ih_l0, m.bias_hh_l0]
    return Built(flashrnn_layer(case.cell, params, case.torch_dtype), params)

"""The seed formulas in plain PyTorch: the ground truth every kernel is tested against.

Everything here is differentiable by autograd and follows the conventions of the
rnnkern ops (csrc/ops.cpp): one layer, one direction, torch.nn's weight layout
(gates stacked along the rows of ``w_ih`` / ``w_hh``: RNN ``a``; LSTM ``i, f, g, o``;
GRU ``r, z, n``), time-major tensors.

Cells (``cell`` argument):

- ``rnn_tanh`` / ``rnn_relu``: ``H_t = phi([X_t, H_{t-1}] [W_xh; W_hh] + b_h)`` (seed 000)
- ``lstm``: seed 003, torch gate order i, f, g, o, optional projection ``h = W_hr (o * tanh c)``
- ``gru``: torch/cuDNN "reset after" form, ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``
- ``gru_reset_before``: the classic form of seed 000, ``n = tanh(W_in x + b_in + W_hn (r * h) + b_hn)``

In both GRU forms ``h_t = (1 - z) * n + z * h_{t-1}`` (torch's convention; seed 003
writes the same update with ``u = 1 - z``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

CELLS = ("rnn_tanh", "rnn_relu", "lstm", "gru", "gru_reset_before")

_GATES = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3, "gru_reset_before": 3}
# Values the kernels save per hidden unit and step for the backward (csrc/cells.h).
_WORKSPACE = {"rnn_tanh": 0, "rnn_relu": 0, "lstm": 5, "gru": 4, "gru_reset_before": 3}


def gate_count(cell: str) -> int:
    """Rows of ``w_hh`` per hidden unit."""
    check_cell(cell)
    return _GATES[cell]


def workspace_width(cell: str) -> int:
    """Values per hidden unit the kernels keep for the backward."""
    check_cell(cell)
    return _WORKSPACE[cell]


def check_cell(cell: str) -> None:
    if cell not in _GATES:
        raise ValueError(f"unknown cell {cell!r}; expected one of {', '.join(CELLS)}")


def _bias(b: Optional[Tensor]) -> Tensor | float:
    return 0.0 if b is None else b


def cell_from_projections(cell: str, xp: Tensor, h: Tensor, c: Optional[Tensor], w_hh: Tensor,
                          b_hh: Optional[Tensor], w_hr: Optional[Tensor] = None):
    """One step from the input projection ``xp = x W_ih^T + b_ih`` ([B, G*H]).

    Returns ``(h_new, c_new)`` (``c_new`` is None except for LSTM).
    """
    check_cell(cell)
    if cell == "gru_reset_before":
        # The reset gate acts on h before its product with W_hn (seed 000).
        H = w_hh.shape[0] // 3
        w_rz, w_n = w_hh[: 2 * H], w_hh[2 * H:]
        b_rz = None if b_hh is None else b_hh[: 2 * H]
        b_n = None if b_hh is None else b_hh[2 * H:]
        xr, xz, xn = xp.chunk(3, 1)
        hr, hz = (h @ w_rz.t() + _bias(b_rz)).chunk(2, 1)
        r = torch.sigmoid(xr + hr)
        z = torch.sigmoid(xz + hz)
        n = torch.tanh(xn + (r * h) @ w_n.t() + _bias(b_n))
        return (1 - z) * n + z * h, None
    hp = h @ w_hh.t() + _bias(b_hh)
    if cell == "rnn_tanh":
        return torch.tanh(xp + hp), None
    if cell == "rnn_relu":
        return torch.relu(xp + hp), None
    if cell == "gru":
        xr, xz, xn = xp.chunk(3, 1)
        hr, hz, hn = hp.chunk(3, 1)
        r = torch.sigmoid(xr + hr)
        z = torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return (1 - z) * n + z * h, None
    # lstm
    i, f, g, o = (xp + hp).chunk(4, 1)
    i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
    c_new = f * c + i * g
    h_new = o * torch.tanh(c_new)
    if w_hr is not None:
        h_new = h_new @ w_hr.t()
    return h_new, c_new


def step(cell: str, x: Tensor, h: Tensor, c: Optional[Tensor], w_ih: Tensor, w_hh: Tensor,
         b_ih: Optional[Tensor] = None, b_hh: Optional[Tensor] = None):
    """One step of a cell on ``x`` [B, I], ``h`` [B, H] (and ``c`` for LSTM).

    The pre-activation is the product of the concatenations
    ``[x, h] [W_ih; W_hh]^T`` (seed 000) wherever a gate takes x and h together,
    written as its split along K, ``x W_ih^T + h W_hh^T``: autograd then returns
    every gradient in its tensor's own layout, as torch.nn's cells do (through
    ``torch.cat`` the weight gradients would be strided slices of one buffer).
    The GRU candidate keeps its x and h parts apart, as its formula requires.
    """
    check_cell(cell)
    G = gate_count(cell)
    H = w_hh.shape[0] // G
    if cell in ("rnn_tanh", "rnn_relu", "lstm"):
        pre = x @ w_ih.t() + h @ w_hh.t() + _bias(b_ih) + _bias(b_hh)
        if cell == "rnn_tanh":
            return torch.tanh(pre), None
        if cell == "rnn_relu":
            return torch.relu(pre), None
        i, f, g, o = pre.chunk(4, 1)
        c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c_new), c_new
    # GRU: r and z from the (split) concatenated product, the candidate from its parts.
    b_ih_ = torch.zeros(3 * H, dtype=x.dtype, device=x.device) if b_ih is None else b_ih
    b_hh_ = torch.zeros(3 * H, dtype=x.dtype, device=x.device) if b_hh is None else b_hh
    rz = x @ w_ih[: 2 * H].t() + h @ w_hh[: 2 * H].t() + b_ih_[: 2 * H] + b_hh_[: 2 * H]
    r, z = torch.sigmoid(rz).chunk(2, 1)
    xn = x @ w_ih[2 * H:].t() + b_ih_[2 * H:]
    if cell == "gru":
        n = torch.tanh(xn + r * (h @ w_hh[2 * H:].t() + b_hh_[2 * H:]))
    else:
        n = torch.tanh(xn + (r * h) @ w_hh[2 * H:].t() + b_hh_[2 * H:])
    return (1 - z) * n + z * h, None


def recurrence(cell: str, xproj: Tensor, h0: Tensor, c0: Optional[Tensor], w_hh: Tensor,
               b_ih: Optional[Tensor] = None, b_hh: Optional[Tensor] = None,
               w_hr: Optional[Tensor] = None, lengths: Optional[Tensor] = None,
               reverse: bool = False):
    """The time loop of one layer in one direction.

    xproj [T, B, G*H] (``X W_ih^T``, the bias ``b_ih`` is added here), h0 [B, P],
    c0 [B, H] (LSTM), w_hh [G*H, P], b_ih, b_hh [G*H], w_hr [P, H] (LSTM
    projection), lengths [B] int64:
    sequence b has ``lengths[b]`` steps; after them its state stays and its
    outputs are 0.  With ``reverse`` each sequence runs from its own last step
    back to step 0.  Returns ``(output [T, B, P], h_n [B, P], c_n [B, H] or None)``.
    """
    check_cell(cell)
    T, B = xproj.shape[0], xproj.shape[1]
    P = h0.shape[1]
    if b_ih is not None:
        xproj = xproj + b_ih
    rows = torch.arange(B, device=xproj.device)
    if lengths is None:
        lens = torch.full((B,), T, dtype=torch.long, device=xproj.device)
    else:
        lens = lengths.to(device=xproj.device, dtype=torch.long)
    output = xproj.new_zeros((T, B, P))
    h, c = h0, c0
    for s in range(T):
        active = s < lens
        t_of_row = (lens - 1 - s if reverse else torch.full_like(lens, s)).clamp(min=0)
        h_new, c_new = cell_from_projections(cell, xproj[t_of_row, rows], h, c, w_hh, b_hh, w_hr)
        keep = active.unsqueeze(1)
        h = torch.where(keep, h_new, h)
        if c is not None:
            c = torch.where(keep, c_new, c)
        # Rows that have ended write back what their position already holds
        # (no boolean-mask indexing: its data-dependent shape trips inductor).
        output = output.index_put((t_of_row, rows), torch.where(keep, h_new, output[t_of_row, rows]))
    return output, h, c


def layer(cell: str, x: Tensor, h0: Tensor, c0: Optional[Tensor], w_ih: Tensor, w_hh: Tensor,
          b_ih: Optional[Tensor] = None, b_hh: Optional[Tensor] = None,
          w_hr: Optional[Tensor] = None, lengths: Optional[Tensor] = None, reverse: bool = False):
    """One layer on the input sequence ``x`` [T, B, I]: the input projection as one
    GEMM over all steps, then :func:`recurrence`."""
    return recurrence(cell, F.linear(x, w_ih), h0, c0, w_hh, b_ih, b_hh, w_hr, lengths, reverse)

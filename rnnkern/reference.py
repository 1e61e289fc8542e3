"""The textbook formulas in plain PyTorch: the ground truth every kernel is tested against.

Everything here is differentiable by autograd and follows the conventions of the
rnnkern ops (csrc/ops.cpp): one layer, one direction, torch.nn's weight layout
(gates stacked along the rows of ``w_ih`` / ``w_hh``: RNN ``a``; LSTM ``i, f, g, o``;
GRU ``r, z, n``), time-major tensors.

Cells (``cell`` argument):

- ``rnn_tanh`` / ``rnn_relu``: ``H_t = phi([X_t, H_{t-1}] [W_xh; W_hh] + b_h)`` (the Elman RNN)
- ``lstm``: the LSTM with forget gate, torch gate order i, f, g, o, optional projection ``h = W_hr (o * tanh c)``
- ``gru``: torch/cuDNN "reset after" form, ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``
- ``gru_reset_before``: the classic form (Cho et al.), ``n = tanh(W_in x + b_in + W_hn (r * h) + b_hn)``

In both GRU forms ``h_t = (1 - z) * n + z * h_{t-1}`` (torch's convention; some texts
write the same update with the update gate ``u = 1 - z``).

Beyond torch.nn (one more cell, two options of the recurrence):

- ``lstm_ln``: the layer-normalised LSTM (haste's formulation, torch's gate order)::

      a   = LN(x W_ih^T) * g_ih + LN(h_{t-1} W_hh^T) * g_hh + b_ih + b_hh
      c_t = sigmoid(f) * c_{t-1} + sigmoid(i) * tanh(g)
      h_t = sigmoid(o) * tanh(LN(c_t) * g_c + beta_c)

  ``LN`` normalises over its whole vector (4H values for the gates, H for the
  cell) with eps = 1e-5 and no affine part of its own; ``ln`` packs the gains
  and the shift as ``[g_ih (4H), g_hh (4H), g_c (H), beta_c (H)]`` (10H values).
- ``resets`` [T, B] bool: where ``resets[t, b]`` is true, the step at time
  position t of sequence b starts from ``h0[b]`` (and ``c0[b]``) instead of the
  previous step's state (an episode boundary in reinforcement learning).  The
  rule is by time position in both directions; the modules shift the mask for a
  reverse direction (rnnkern/modules/sequence.py).  With ``reset_h`` [B, P] (and
  ``reset_c`` [B, H] for the LSTMs) a reset step starts from those instead, and
  h0 (c0) only enters each sequence's first step, whatever ``resets`` says there
  (the modules pass the reset state as h0 for a sequence that resets at its
  first step: rnnkern/ops.py's run_recurrence_with_reset_state).
- ``zoneout`` [T, B, Z] (Z = P + H for LSTM: the h part, then the c part; H
  otherwise): per unit, the weight of the state the step started from in the
  state it ends with, ``h_t = m * h_{t-1} + (1 - m) * h~_t`` (and c alike): 0 or 1
  while training (a Bernoulli draw: 1 keeps the previous value), the zoneout
  probability itself in evaluation (the expectation).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

#: torch.nn's cells (and the classic GRU): every backend, every option.
CELLS = ("rnn_tanh", "rnn_relu", "lstm", "gru", "gru_reset_before")
#: Cells torch.nn lacks, with parameters of their own (``ln``).
LN_CELLS = ("lstm_ln",)
ALL_CELLS = CELLS + LN_CELLS
#: Layer norm's epsilon in ``lstm_ln`` (torch's default).
LN_EPS = 1e-5

_GATES = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3, "gru_reset_before": 3, "lstm_ln": 4}
# Values the kernels save per hidden unit and step for the backward (csrc/cells.h).
# lstm_ln keeps 3 values per row beyond (workspace_size).
_WORKSPACE = {"rnn_tanh": 0, "rnn_relu": 0, "lstm": 5, "gru": 4, "gru_reset_before": 3,
              "lstm_ln": 14}


def gate_count(cell: str) -> int:
    """Rows of ``w_hh`` per hidden unit."""
    check_cell(cell)
    return _GATES[cell]


def workspace_size(cell: str, H: int, zoneout: bool = False) -> int:
    """The workspace's last dimension: values per batch row and step (csrc/cells.h;
    with zoneout the RNN keeps its candidate h~, one value per unit)."""
    check_cell(cell)
    width = 1 if zoneout and cell in ("rnn_tanh", "rnn_relu") else _WORKSPACE[cell]
    return width * H + (3 if cell == "lstm_ln" else 0)


def workspace_width(cell: str) -> int:
    """Values per hidden unit the kernels keep for the backward."""
    check_cell(cell)
    return _WORKSPACE[cell]


def check_cell(cell: str) -> None:
    if cell not in _GATES:
        raise ValueError(f"unknown cell {cell!r}; expected one of {', '.join(ALL_CELLS)}")


def ln_width(cell: str) -> int:
    """Values of ``ln`` per hidden unit: 10 for ``lstm_ln``, 0 otherwise."""
    return 10 if cell == "lstm_ln" else 0


def zoneout_width(cell: str, H: int, P: int) -> int:
    """Units of a ``zoneout`` mask row: h's (P) and c's (H) for an LSTM, H otherwise."""
    return P + H if cell.startswith("lstm") else H


def _norm(v: Tensor) -> Tensor:
    """Layer norm over the last dimension, without an affine part."""
    return F.layer_norm(v, v.shape[-1:], eps=LN_EPS)


def lstm_ln_cell(xp: Tensor, h: Tensor, c: Tensor, w_hh: Tensor, b_ih: Optional[Tensor],
                 b_hh: Optional[Tensor], ln: Tensor):
    """One ``lstm_ln`` step from the raw input projection ``xp = x W_ih^T``
    ([B, 4H], no bias): returns ``(h_new, c_new)``."""
    H = c.shape[1]
    g_ih, g_hh, g_c, beta_c = ln[:4 * H], ln[4 * H:8 * H], ln[8 * H:9 * H], ln[9 * H:]
    pre = _norm(xp) * g_ih + _norm(h @ w_hh.t()) * g_hh + _bias(b_ih) + _bias(b_hh)
    i, f, g, o = pre.chunk(4, 1)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(_norm(c_new) * g_c + beta_c), c_new


def _bias(b: Optional[Tensor]) -> Tensor | float:
    return 0.0 if b is None else b


def cell_from_projections(cell: str, xp: Tensor, h: Tensor, c: Optional[Tensor], w_hh: Tensor,
                          b_hh: Optional[Tensor], w_hr: Optional[Tensor] = None):
    """One step from the input projection ``xp = x W_ih^T + b_ih`` ([B, G*H]).

    Returns ``(h_new, c_new)`` (``c_new`` is None except for LSTM).
    """
    check_cell(cell)
    if cell == "gru_reset_before":
        # The reset gate acts on h before its product with W_hn (the classic GRU).
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
         b_ih: Optional[Tensor] = None, b_hh: Optional[Tensor] = None,
         ln: Optional[Tensor] = None):
    """One step of a cell on ``x`` [B, I], ``h`` [B, H] (and ``c`` for LSTM;
    ``ln`` [10H] for ``lstm_ln``).

    The pre-activation is the product of the concatenations
    ``[x, h] [W_ih; W_hh]^T`` (the concatenated textbook form) wherever a gate takes x and h together,
    written as its split along K, ``x W_ih^T + h W_hh^T``: autograd then returns
    every gradient in its tensor's own layout, as torch.nn's cells do (through
    ``torch.cat`` the weight gradients would be strided slices of one buffer).
    The GRU candidate keeps its x and h parts apart, as its formula requires.
    """
    check_cell(cell)
    if cell == "lstm_ln":
        return lstm_ln_cell(x @ w_ih.t(), h, c, w_hh, b_ih, b_hh, ln)
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


def packed_positions(lengths: Tensor, T: int, device) -> tuple:
    """(time, batch) [N] of each row of a packed batch whose sequences, sorted
    longest first, have ``lengths``: time-major, as PackedSequence.data (step t
    holds one row for each sequence longer than t)."""
    batch_sizes = (lengths.cpu().unsqueeze(0) > torch.arange(T).unsqueeze(1)).sum(1)
    return rows_of_batch_sizes(batch_sizes, int(batch_sizes.sum()), device)


def live_rows(lengths: list, T: int) -> list:
    """Per step s < T, how many leading rows the step's products cover when
    sequence b has ``lengths[b]`` steps: up to the last row still running (a
    row runs while s < its length) -- csrc/cpu/rows.h's and csrc/cuda/params.h's
    rule.  Its sum is what a padded batch costs: the real steps exactly when
    the lengths are sorted longest first (a packed batch)."""
    live, k, suffix_max = [], len(lengths), [0] * (len(lengths) + 1)
    for b in reversed(range(len(lengths))):
        suffix_max[b] = max(suffix_max[b + 1], lengths[b])
    for s in range(T):
        while k > 0 and suffix_max[k - 1] <= s:
            k -= 1
        live.append(k)
    return live


def rows_of_batch_sizes(batch_sizes: Tensor, rows: int, device) -> tuple:
    """(time, batch) of the ``rows`` rows of a packed batch of ``batch_sizes``;
    sizes come from shapes only, so this traces under torch.compile."""
    steps = torch.arange(batch_sizes.numel())
    time = torch.repeat_interleave(steps, batch_sizes, output_size=rows)
    starts = torch.cumsum(batch_sizes, 0) - batch_sizes
    batch = torch.arange(rows) - starts[time]
    return time.to(device), batch.to(device)


def recurrence(cell: str, xproj: Tensor, h0: Tensor, c0: Optional[Tensor], w_hh: Tensor,
               b_ih: Optional[Tensor] = None, b_hh: Optional[Tensor] = None,
               w_hr: Optional[Tensor] = None, lengths: Optional[Tensor] = None,
               reverse: bool = False, resets: Optional[Tensor] = None,
               zoneout: Optional[Tensor] = None, ln: Optional[Tensor] = None,
               reset_h: Optional[Tensor] = None, reset_c: Optional[Tensor] = None,
               cell_steps: bool = False):
    """The time loop of one layer in one direction.

    xproj [T, B, G*H] (``X W_ih^T``, the bias ``b_ih`` is added here; or packed
    rows [N, G*H], lengths sorted longest first, and the output likewise), h0 [B, P],
    c0 [B, H] (LSTM), w_hh [G*H, P], b_ih, b_hh [G*H], w_hr [P, H] (LSTM
    projection), lengths [B] int64:
    sequence b has ``lengths[b]`` steps; after them its state stays and its
    outputs are 0.  With ``reverse`` each sequence runs from its own last step
    back to step 0.  ``resets`` [T, B] bool, ``zoneout`` [T, B, Z], ``ln``
    [10H] (``lstm_ln``), ``reset_h`` [B, P] and ``reset_c`` [B, H] as in the
    module docstring.
    Returns ``(output [T, B, P], h_n [B, P], c_n [B, H] or None)``; with
    ``cell_steps`` (``lstm`` only) c_n is the cell state after every step,
    [T, B, H] at the steps' time positions, zeros past a row's length.
    """
    check_cell(cell)
    if cell_steps and cell != "lstm":
        raise ValueError(f"rnnkern.recurrence: cell_steps (the cell state after every step) "
                         f"needs cell 'lstm', got '{cell}'")
    if xproj.dim() == 2:
        # Packed rows [N, G*H] (csrc/checks.h: lengths sorted longest first): the
        # same loop on the grid they fill, and its output's rows.
        T = int(lengths[0]) if lengths.numel() else 0
        time, batch = packed_positions(lengths.to(torch.long), T, xproj.device)
        grid = xproj.new_zeros((T, h0.shape[0], xproj.shape[1])).index_put((time, batch), xproj)
        out, h, c = recurrence(cell, grid, h0, c0, w_hh, b_ih, b_hh, w_hr, lengths, reverse,
                               resets, zoneout, ln, reset_h, reset_c, cell_steps)
        return out[time, batch], h, c
    T, B = xproj.shape[0], xproj.shape[1]
    P = h0.shape[1]
    ln_cell = cell == "lstm_ln"
    if b_ih is not None and not ln_cell:
        xproj = xproj + b_ih
    rows = torch.arange(B, device=xproj.device)
    if lengths is None:
        lens = torch.full((B,), T, dtype=torch.long, device=xproj.device)
    else:
        lens = lengths.to(device=xproj.device, dtype=torch.long)
    output = xproj.new_zeros((T, B, P))
    c_steps = xproj.new_zeros((T, B, c0.shape[1])) if cell_steps else None
    h, c = h0, c0
    if reset_h is None:  # a reset restarts from h0 (at the first step: no change)
        reset_h, reset_c = h0, c0
    for s in range(T):
        active = s < lens
        t_of_row = (lens - 1 - s if reverse else torch.full_like(lens, s)).clamp(min=0)
        if resets is not None:
            # (past a sequence's end its state stays, whatever resets says)
            # (and a first step starts from h0)
            restart = (resets[t_of_row, rows] & active).unsqueeze(1) & (s > 0)
            h = torch.where(restart, reset_h, h)
            if c is not None:
                c = torch.where(restart, reset_c, c)
        if ln_cell:
            h_new, c_new = lstm_ln_cell(xproj[t_of_row, rows], h, c, w_hh, b_ih, b_hh, ln)
        else:
            h_new, c_new = cell_from_projections(cell, xproj[t_of_row, rows], h, c, w_hh, b_hh,
                                                 w_hr)
        if zoneout is not None:
            m = zoneout[t_of_row, rows]
            h_new = m[:, :P] * h + (1 - m[:, :P]) * h_new
            if c is not None:
                c_new = m[:, P:] * c + (1 - m[:, P:]) * c_new
        keep = active.unsqueeze(1)
        h = torch.where(keep, h_new, h)
        if c is not None:
            c = torch.where(keep, c_new, c)
        # Rows that have ended write back what their position already holds
        # (no boolean-mask indexing: its data-dependent shape trips inductor).
        output = output.index_put((t_of_row, rows), torch.where(keep, h_new, output[t_of_row, rows]))
        if cell_steps:
            c_steps = c_steps.index_put((t_of_row, rows),
                                        torch.where(keep, c_new, c_steps[t_of_row, rows]))
    return output, h, (c_steps if cell_steps else c)


def layer(cell: str, x: Tensor, h0: Tensor, c0: Optional[Tensor], w_ih: Tensor, w_hh: Tensor,
          b_ih: Optional[Tensor] = None, b_hh: Optional[Tensor] = None,
          w_hr: Optional[Tensor] = None, lengths: Optional[Tensor] = None, reverse: bool = False,
          resets: Optional[Tensor] = None, zoneout: Optional[Tensor] = None,
          ln: Optional[Tensor] = None):
    """One layer on the input sequence ``x`` [T, B, I]: the input projection as one
    GEMM over all steps, then :func:`recurrence`."""
    return recurrence(cell, F.linear(x, w_ih), h0, c0, w_hh, b_ih, b_hh, w_hr, lengths, reverse,
                      resets, zoneout, ln)

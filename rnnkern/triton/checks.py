"""Argument checks of the Triton ops: the Python twin of the check_* functions
of csrc/ops.cpp, with the same rules and messages (op name, argument name,
expected shape).  TORCH_CHECK_VALUE becomes ValueError, TORCH_CHECK_TYPE
TypeError.  Every Triton op calls its check first, before any allocation or
launch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..library import acc_dtype, has_cell_state
from ..reference import ALL_CELLS, gate_count, workspace_size, zoneout_width

FLOATING = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class RecurrenceSizes:
    cell: str
    T: int  # time steps
    B: int  # batch
    H: int  # hidden units (cell state size for LSTM)
    P: int  # size of h: H, or proj_size for an LSTM with w_hr
    G: int  # gates per unit
    has_proj: bool
    has_resets: bool = False
    has_zoneout: bool = False
    # lstm only: c_n is every step's c [T, B, H] (forward), grad_c_n its gradient (backward)
    cell_steps: bool = False


@dataclass(frozen=True)
class StepSizes:
    cell: str
    B: int
    I: int
    H: int
    G: int


def parse_cell(cell: str) -> str:
    if cell not in ALL_CELLS:
        raise ValueError(f"rnnkern: unknown cell '{cell}'; expected one of {', '.join(ALL_CELLS)}")
    return cell


def check_ln(op: str, cell: str, ln: Optional[Tensor], H: int, ref: Tensor) -> None:
    """ln: the layer norms' gains and shift of lstm_ln ([10H]), absent for every other cell."""
    if cell == "lstm_ln":
        if ln is None:
            raise ValueError(f"{op}: lstm_ln needs ln (the layer norms' gains and shift, "
                             f"[{10 * H}])")
        check_arg(op, "ln", ln, [10 * H], ref)
    elif ln is not None:
        raise ValueError(f"{op}: ln is only defined for lstm_ln, got one for {cell}")


def check_resets_zoneout(op: str, cell: str, resets: Optional[Tensor], zoneout: Optional[Tensor],
                         T: int, B: int, H: int, P: int, ref: Tensor) -> None:
    """resets [T, B] bool and zoneout [T, B, Z] (the input's dtype), on the input's device."""
    if resets is not None:
        if resets.dim() != 2 or list(resets.shape) != [T, B]:
            raise ValueError(f"{op}: expected resets of shape [{T}, {B}] (time, batch), got "
                             f"{_shape(resets)}")
        if resets.dtype != torch.bool:
            raise TypeError(f"{op}: expected resets of dtype torch.bool, got {resets.dtype}")
        if resets.device != ref.device:
            raise ValueError(f"{op}: expected resets on {ref.device} (the device of the input), "
                             f"got {resets.device}")
    if zoneout is not None:
        check_arg(op, "zoneout", zoneout, [T, B, zoneout_width(cell, H, P)], ref)


def check_reset_state(op: str, cell: str, resets, reset_h, reset_c, B: int, H: int, P: int,
                      ref: Tensor) -> None:
    """reset_h [B, P] and reset_c [B, H] (the cells with a cell state: both or
    neither), the input's dtype and device; only with resets (csrc/checks.cpp)."""
    if reset_h is None:
        if reset_c is not None:
            raise ValueError(f"{op}: reset_c given without reset_h")
        return
    if resets is None:
        raise ValueError(f"{op}: reset_h given without resets (it is the state a reset step "
                         "starts from)")
    check_arg(op, "reset_h", reset_h, [B, P], ref)
    if has_cell_state(cell):
        if reset_c is None:
            raise ValueError(f"{op}: {cell} needs reset_c with reset_h")
        check_arg(op, "reset_c", reset_c, [B, H], ref)
    elif reset_c is not None:
        raise ValueError(f"{op}: reset_c is only defined for the cells with a cell state, got "
                         f"one for {cell}")


def _shape(t: Tensor) -> str:
    return str(list(t.shape))


def check_arg(op: str, name: str, t: Optional[Tensor], sizes: Sequence[int], ref: Tensor) -> None:
    """Dimensionality, sizes, dtype and device of one tensor argument."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{op}: {name} must be a tensor")
    if list(t.shape) != list(sizes):
        raise ValueError(f"{op}: expected {name} of shape {list(sizes)}, got {_shape(t)}")
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}: expected {name} of dtype {ref.dtype} (the dtype of the input), "
                        f"got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{op}: expected {name} on {ref.device} (the device of the input), "
                         f"got {t.device}")


def check_floating(op: str, name: str, t: Tensor) -> None:
    if t.dtype not in FLOATING:
        raise TypeError(f"{op}: expected {name} of a floating dtype (float64, float32, float16, "
                        f"bfloat16), got {t.dtype}")


def check_lengths(op: str, lengths: Optional[Tensor], T: int, B: int) -> None:
    if lengths is None:
        return
    if lengths.dim() != 1 or lengths.size(0) != B:
        raise ValueError(f"{op}: expected lengths of shape [{B}] (one per sequence), got "
                         f"{_shape(lengths)}")
    if lengths.dtype != torch.int64:
        raise TypeError(f"{op}: expected lengths of dtype int64, got {lengths.dtype}")
    if lengths.device.type != "cpu":
        raise ValueError(f"{op}: expected lengths on the CPU (as "
                         f"torch.nn.utils.rnn.pack_padded_sequence), got {lengths.device}")
    bad = ((lengths < 0) | (lengths > T)).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(f"{op}: lengths[{b}] = {int(lengths[b])} is outside [0, {T}] "
                         f"(T = xproj.size(0))")


def sizes_from_weights(op: str, cell: str, w_hh: Tensor, w_hr: Optional[Tensor]):
    """H from the gate rows of w_hh, P from its columns; (H, P, G)."""
    G = gate_count(cell)
    if w_hh.dim() != 2:
        raise ValueError(f"{op}: expected w_hh to be 2-D [G*H, P], got {_shape(w_hh)}")
    if w_hh.size(0) % G != 0 or w_hh.size(0) == 0:
        raise ValueError(f"{op}: w_hh has {w_hh.size(0)} rows, expected a positive multiple of "
                         f"{G} (the gates of {cell})")
    H, P = w_hh.size(0) // G, w_hh.size(1)
    if w_hr is not None:
        if cell != "lstm":
            raise ValueError(f"{op}: w_hr (projection) is only defined for lstm, got {cell}")
        if w_hr.dim() != 2 or list(w_hr.shape) != [P, H]:
            raise ValueError(f"{op}: expected w_hr of shape [{P}, {H}], got {_shape(w_hr)}")
    elif P != H:
        raise ValueError(f"{op}: expected w_hh of shape [{G * H}, {H}], got {_shape(w_hh)}")
    return H, P, G


def check_recurrence(cell, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, lengths, resets=None,
                     zoneout=None, ln=None, reset_h=None, reset_c=None,
                     cell_steps=False) -> RecurrenceSizes:
    op = "rnnkern_triton.recurrence"
    parse_cell(cell)
    check_floating(op, "xproj", xproj)
    if xproj.dim() != 3:
        raise ValueError(f"{op}: expected xproj to be 3-D [T, B, G*H], got {_shape(xproj)}")
    H, P, G = sizes_from_weights(op, cell, w_hh, w_hr)
    T, B = xproj.size(0), xproj.size(1)
    if xproj.size(2) != G * H:
        raise ValueError(f"{op}: expected xproj.size(2) == {G * H} ({G} gates x hidden size "
                         f"{H}), got {xproj.size(2)}")
    check_arg(op, "w_hh", w_hh, [G * H, P], xproj)
    check_arg(op, "h0", h0, [B, P], xproj)
    if has_cell_state(cell):
        if c0 is None:
            raise ValueError(f"{op}: {cell} needs c0")
        check_arg(op, "c0", c0, [B, H], xproj)
    elif c0 is not None:
        raise ValueError(f"{op}: c0 is only defined for lstm, got one for {cell}")
    if b_ih is not None:
        check_arg(op, "b_ih", b_ih, [G * H], xproj)
    if b_hh is not None:
        check_arg(op, "b_hh", b_hh, [G * H], xproj)
    if w_hr is not None:
        check_arg(op, "w_hr", w_hr, [P, H], xproj)
    check_lengths(op, lengths, T, B)
    check_resets_zoneout(op, cell, resets, zoneout, T, B, H, P, xproj)
    check_ln(op, cell, ln, H, xproj)
    check_reset_state(op, cell, resets, reset_h, reset_c, B, H, P, xproj)
    if cell_steps and cell != "lstm":
        raise ValueError(f"{op}: cell_steps (the cell state after every step) needs cell 'lstm', "
                         f"got '{cell}'")
    return RecurrenceSizes(cell, T, B, H, P, G, w_hr is not None, resets is not None,
                           zoneout is not None, bool(cell_steps))


def check_recurrence_backward(cell, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output,
                              workspace, lengths, resets=None, zoneout=None,
                              ln=None, reset_h=None, reset_c=None) -> RecurrenceSizes:
    op = "rnnkern_triton.recurrence_backward"
    parse_cell(cell)
    check_floating(op, "output", output)
    if output.dim() != 3:
        raise ValueError(f"{op}: expected output to be 3-D [T, B, P], got {_shape(output)}")
    H, P, G = sizes_from_weights(op, cell, w_hh, w_hr)
    T, B = output.size(0), output.size(1)
    check_arg(op, "output", output, [T, B, P], output)
    check_arg(op, "grad_output", grad_output, [T, B, P], output)
    check_arg(op, "grad_h_n", grad_h_n, [B, P], output)
    check_arg(op, "h0", h0, [B, P], output)
    check_arg(op, "w_hh", w_hh, [G * H, P], output)
    if w_hr is not None:
        check_arg(op, "w_hr", w_hr, [P, H], output)
    if has_cell_state(cell):
        if c0 is None or grad_c_n is None:
            raise ValueError(f"{op}: {cell} needs c0 and grad_c_n")
        check_arg(op, "c0", c0, [B, H], output)
        # [T, B, H]: the gradient of a cell_steps call's c_n (every step's c).
        cell_steps = cell == "lstm" and grad_c_n.dim() == 3
        check_arg(op, "grad_c_n", grad_c_n, [T, B, H] if cell_steps else [B, H], output)
    else:
        cell_steps = False
    W = workspace_size(cell, H, zoneout is not None)
    if W > 0:
        if workspace.dim() != 3:
            raise ValueError(f"{op}: the workspace is empty; the forward ran with train=False")
        if list(workspace.shape) != [T, B, W]:
            raise ValueError(f"{op}: expected workspace of shape [{T}, {B}, {W}], got "
                             f"{_shape(workspace)}")
        if workspace.dtype != acc_dtype(output.dtype):
            raise TypeError(f"{op}: expected workspace of dtype {acc_dtype(output.dtype)}, got "
                            f"{workspace.dtype}")
        if workspace.device != output.device:
            raise ValueError(f"{op}: expected workspace on {output.device}, got {workspace.device}")
    check_lengths(op, lengths, T, B)
    check_resets_zoneout(op, cell, resets, zoneout, T, B, H, P, output)
    check_ln(op, cell, ln, H, output)
    check_reset_state(op, cell, resets, reset_h, reset_c, B, H, P, output)
    return RecurrenceSizes(cell, T, B, H, P, G, w_hr is not None, resets is not None,
                           zoneout is not None, cell_steps)


def check_step(cell, x, h, c, w_ih, w_hh, b_ih, b_hh, ln=None,
               op="rnnkern_triton.step") -> StepSizes:
    parse_cell(cell)
    check_floating(op, "x", x)
    if x.dim() != 2:
        raise ValueError(f"{op}: expected x to be 2-D [B, I], got {_shape(x)}")
    H, _, G = sizes_from_weights(op, cell, w_hh, None)
    B, I = x.size(0), x.size(1)
    check_arg(op, "w_ih", w_ih, [G * H, I], x)
    check_arg(op, "w_hh", w_hh, [G * H, H], x)
    check_arg(op, "h", h, [B, H], x)
    check_ln(op, cell, ln, H, x)
    if has_cell_state(cell):
        if c is None:
            raise ValueError(f"{op}: {cell} needs c")
        check_arg(op, "c", c, [B, H], x)
    elif c is not None:
        raise ValueError(f"{op}: c is only defined for lstm, got one for {cell}")
    if b_ih is not None:
        check_arg(op, "b_ih", b_ih, [G * H], x)
    if b_hh is not None:
        check_arg(op, "b_hh", b_hh, [G * H], x)
    return StepSizes(cell, B, I, H, G)


def check_step_backward(cell, grad_h_new, grad_c_new, x, h, c, w_ih, w_hh, h_new,
                        workspace, ln=None) -> StepSizes:
    op = "rnnkern_triton.step_backward"
    s = check_step(cell, x, h, c, w_ih, w_hh, None, None, ln, op=op)
    check_arg(op, "grad_h_new", grad_h_new, [s.B, s.H], x)
    check_arg(op, "h_new", h_new, [s.B, s.H], x)
    if has_cell_state(cell):
        if grad_c_new is None:
            raise ValueError(f"{op}: {cell} needs grad_c_new")
        check_arg(op, "grad_c_new", grad_c_new, [s.B, s.H], x)
    W = workspace_size(cell, s.H)
    if list(workspace.shape) != [s.B, W]:
        raise ValueError(f"{op}: expected workspace of shape [{s.B}, {W}], got "
                         f"{_shape(workspace)}")
    if workspace.dtype != acc_dtype(x.dtype):
        raise TypeError(f"{op}: expected workspace of dtype {acc_dtype(x.dtype)}, got "
                        f"{workspace.dtype}")
    if workspace.device != x.device:
        raise ValueError(f"{op}: expected workspace on {x.device}, got {workspace.device}")
    return s

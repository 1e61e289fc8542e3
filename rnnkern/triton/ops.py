"""The Triton op family ``torch.ops.rnnkern_triton``: host wrappers and registration.

The four ops have the schemas of the C++ ops (csrc/ops.cpp), read from
``torch.ops.rnnkern`` so there is one source, and the same semantics: outputs,
workspace layout and dtype (float32 for half inputs), lengths, reverse, the
LSTM projection, both GRU forms, empty ``[0]`` placeholders.  rnnkern.library
defines them (with the fake implementations, autograd and FLOP formulas shared
with the C++ ops: :func:`rnnkern.library.register_op_family`) when rnnkern is
imported; this module implements them for CUDA and, under
``TRITON_INTERPRET=1``, for CPU tensors.

Each wrapper checks its arguments (:mod:`.checks`), then picks how to run the
recurrence:

``loop``  the whole time loop in one launch (:mod:`.sequence`), where the
          weights fit on chip (:func:`.sequence.fits_on_chip`);
``spread`` beyond that, the whole time loop in one launch spread over the SMs,
          one program per tile of units with a grid barrier per step
          (:mod:`.spread`), for every cell but LSTM-LN, with at most as many
          tiles as the GPU has SMs (:func:`.spread.tiles`);
``step``  one fused launch per step (:mod:`.step`) from a Python loop that never
          synchronises with the host, for any size: what is left.

:data:`PATH` (initialised from the environment variable ``RNNKERN_TRITON_PATH``)
forces one: ``"auto"`` (default), ``"loop"``, ``"spread"`` or ``"step"``.
Forcing ``"loop"`` or ``"spread"`` where it cannot run raises instead of
running.  The weight gradients are one large GEMM each over all steps, after
the time loop (torch.matmul on tensors the kernels saved in time order), in the
input dtype with float32 accumulation as torch.nn's
(:func:`_recurrence_weight_grads`).

The step options and the LayerNorm cell run on both paths, inside the kernels, as constexpr
flags (the kernels without them are unchanged): ``resets`` and ``zoneout``
(read through its strides: an evaluation mask stays an expanded vector), and
the cell ``lstm_ln`` with its ``ln`` gains.  Their weight gradients: W_hh
pairs each step's gradient with the state the step really started from (h0 at
a reset, :func:`_grad_by_previous_state`); lstm_ln's biases take the gates'
pre-activation gradients and its gains pair them with the normalised values
the workspace keeps.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..library import acc_dtype, has_cell_state, implement_family
from .. import reference
from ..reference import gate_count, workspace_size
from . import sequence, spread, step as step_kernels
from .cells import CELL_IDS
from .checks import check_recurrence, check_recurrence_backward, check_step, check_step_backward
from .sequence import block_size, fits_on_chip, loop_compiles
from .tuning import INTERPRET, batch_class

NAMESPACE = "rnnkern_triton"
PATHS = ("auto", "loop", "spread", "step")

#: How the recurrence runs: "auto", or forced to "loop" / "spread" / "step" (module docstring).
PATH = os.environ.get("RNNKERN_TRITON_PATH", "auto")

_TL_DTYPE = {torch.float64: tl.float64, torch.float32: tl.float32, torch.float16: tl.float16,
             torch.bfloat16: tl.bfloat16}


def _dot_dtype(dtype: torch.dtype):
    """The dtype of the tl.dot operands: the storage dtype.  Under the interpreter
    bfloat16 products run in float32 (Triton 3.8's interpreter computes tl.dot on
    bfloat16 operands wrongly)."""
    if INTERPRET and dtype == torch.bfloat16:
        return tl.float32
    return _TL_DTYPE[dtype]


def _result_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels write an op's results in: the op's own, except
    bfloat16 under the interpreter, where they write float32 and torch rounds
    (Triton 3.8's interpreter truncates float32 -> bfloat16 conversions: its
    cast_impl passes no rounding mode to _convert_float; a GPU rounds to
    nearest even, as torch does)."""
    if INTERPRET and dtype == torch.bfloat16:
        return torch.float32
    return dtype


def _check_device(op: str, t: Tensor) -> None:
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu":
        if INTERPRET:
            return
        raise RuntimeError(
            f"{op}: CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before triton "
            f"is imported, or move the tensors to a CUDA device")
    raise ValueError(f"{op}: runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), "
                     f"got tensors on {t.device}")


def choose_path(cell: str, H: int, P: int, dtype: torch.dtype, proj: bool,
                options: bool = False, B: int = 1,
                device: Optional[torch.device] = None) -> str:
    """"loop", "spread" or "step" for these sizes, following :data:`PATH`;
    ``options``: the call has resets or zoneout; B and device: the spread
    kernel's grid must fit the device's SMs."""
    if PATH not in PATHS:
        raise ValueError(f"rnnkern_triton: RNNKERN_TRITON_PATH / PATH is {PATH!r}; "
                         f"expected one of {', '.join(PATHS)}")
    fits = fits_on_chip(cell, H, P, dtype, proj)
    compiles = loop_compiles(dtype, options)
    if PATH == "loop" and not fits:
        raise ValueError(
            f"rnnkern_triton: the in-kernel time loop was forced (PATH='loop') but {cell} with "
            f"H={H}, P={P} in {dtype} needs {sequence.on_chip_bytes(cell, H, P, dtype, proj)} "
            f"bytes of weights on chip, more than {sequence.ON_CHIP_BYTES}; use 'auto' or 'step'")
    if PATH == "loop" and not compiles:
        raise ValueError(
            f"rnnkern_triton: the in-kernel time loop was forced (PATH='loop') but Triton cannot "
            f"compile it for {dtype} with resets or zoneout on a GPU; use 'auto' or 'step'")
    if PATH == "loop" or (PATH == "auto" and fits and compiles):
        return "loop"
    spreads = spread.tiles(cell, B, H, proj, device) is not None
    if PATH == "spread" and not spreads:
        raise ValueError(
            f"rnnkern_triton: the spread kernel was forced (PATH='spread') but it runs "
            f"{', '.join(spread.CELLS)}, at most one tile per SM; got {cell}, B={B}, H={H}; "
            f"use 'auto' or 'step'")
    if PATH == "auto":
        return "spread" if spreads else "step"
    return PATH


def _contiguous(*tensors: Optional[Tensor]):
    return [None if t is None else t.contiguous() for t in tensors]


def _empty(like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    return like.new_empty((0,), dtype=dtype or like.dtype)


class _Call:
    """What every kernel launch of one op call shares: the cell's sizes, the
    workspace's last dimension (WS) and the dtypes of the gate math (ACC) and
    of the tl.dot operands (DOT)."""

    def __init__(self, cell: str, dtype: torch.dtype, H: int, zoneout: bool = False):
        self.cell = cell
        self.G = gate_count(cell)
        self.WS = workspace_size(cell, H, zoneout)
        self.acc = acc_dtype(dtype)
        self.consts = dict(ACC=_TL_DTYPE[self.acc], DOT=_dot_dtype(dtype))


def _grid(B: int, N: int):
    return lambda meta: (triton.cdiv(B, meta["BLOCK_B"]), triton.cdiv(N, meta["BLOCK_H"]))


def _lengths_on(device: torch.device, lengths: Optional[Tensor]) -> Optional[Tensor]:
    """`lengths` (int64, on the CPU as the ops take them) on the kernels' device:
    from pinned memory, without waiting.  A plain .to(device) copies from pageable
    memory, which synchronises the stream first: the host would stop queueing
    work at every call until the GPU caught up."""
    if lengths is None or lengths.device == device:
        return lengths
    if device.type == "cuda" and lengths.device.type == "cpu":
        return lengths.pin_memory().to(device, non_blocking=True)
    return lengths.to(device)


def _live_rows(lengths: Optional[Tensor], T: int) -> Optional[list]:
    """Per step s, the rows [0, live[s]) the per-step path's kernels take: up to
    the last row still running (a row runs while s < its length), as the CUDA
    host loop (csrc/cuda/params.h's live_rows).  A batch sorted longest first
    (a packed batch) then costs its real steps, not rows x longest.  None
    without lengths (or for lengths already on the GPU: every step takes all rows)."""
    if lengths is None or lengths.device.type != "cpu":
        return None
    return reference.live_rows(lengths.tolist(), T)


def _loop_grid(B: int):
    return lambda meta: (triton.cdiv(B, meta["BLOCK_B"]),)


def _input_grad_grid(B: int, I: int, P: int):
    """input_grad_kernel: the column tiles of grad_x, then those of grad_h."""
    return lambda meta: (triton.cdiv(B, meta["BLOCK_B"]),
                         triton.cdiv(I, meta["BLOCK_H"]) + triton.cdiv(P, meta["BLOCK_H"]))


class _Options:
    """The per-step options of one recurrence call, as kernel arguments: the
    resets [T, B] bool (contiguous) and the zoneout mask [T, B, Z], read through
    its strides (an evaluation mask is an expanded [Z] vector: never copied),
    with placeholders where absent."""

    def __init__(self, resets: Optional[Tensor], zoneout: Optional[Tensor], dummy: Tensor):
        self.resets = None if resets is None else resets.contiguous()
        self.zoneout = zoneout
        self.p_resets = dummy if resets is None else self.resets
        self.p_zo = dummy if zoneout is None else zoneout
        self.strides = tuple(zoneout.stride()) if zoneout is not None else (0, 0, 0)
        self.flags = dict(HAS_RESETS=resets is not None, HAS_ZONEOUT=zoneout is not None)


# ------------------------------------------------------------- recurrence ----

def recurrence(cell: str, xproj: Tensor, h0: Tensor, c0: Optional[Tensor], w_hh: Tensor,
               b_ih: Optional[Tensor], b_hh: Optional[Tensor], w_hr: Optional[Tensor],
               lengths: Optional[Tensor], reverse: bool, train: bool,
               resets: Optional[Tensor] = None, zoneout: Optional[Tensor] = None,
               ln: Optional[Tensor] = None, reset_h: Optional[Tensor] = None,
               reset_c: Optional[Tensor] = None, cell_steps: bool = False):
    z = check_recurrence(cell, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, lengths, resets, zoneout, ln,
                         reset_h, reset_c, cell_steps)
    _check_device("rnnkern_triton.recurrence", xproj)
    T, B, H, P = z.T, z.B, z.H, z.P
    has_c = has_cell_state(cell)
    k = _Call(cell, xproj.dtype, H, z.has_zoneout)
    path = choose_path(cell, H, P, xproj.dtype, z.has_proj,
                       options=resets is not None or zoneout is not None, B=B,
                       device=xproj.device)
    xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, ln, reset_h, reset_c = _contiguous(
        xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, ln, reset_h, reset_c)

    dtype, rd = xproj.dtype, _result_dtype(xproj.dtype)
    # The per-step path with lengths visits only each step's live rows
    # (_forward_by_steps); where some step leaves rows unvisited, the [T, B]
    # arrays start as zeros, their padding (a finished row writes zeros there).
    # So on the spread path, whose tiles stop at their longest rows (spread.py).
    live = _live_rows(lengths, T) if path == "step" else None
    unvisited = (live is not None and T > 1 and live[T - 2] < B) or (
        path == "spread" and lengths is not None)
    grid = xproj.new_zeros if unvisited else xproj.new_empty
    output = grid((T, B, P), dtype=rd)
    h_n = xproj.new_empty((B, P), dtype=rd)
    # With cell_steps c_n is every step's c, [T, B, H] (the kernels write every position).
    c_n = ((grid((T, B, H), dtype=rd) if z.cell_steps else xproj.new_empty((B, H), dtype=rd))
           if has_c else _empty(xproj))
    ws = grid((T, B, k.WS), dtype=k.acc) if train else _empty(xproj, k.acc)
    if T == 0 or B == 0:
        h_n.copy_(h0)
        if has_c and not z.cell_steps:
            c_n.copy_(c0)
        return output.to(dtype), h_n.to(dtype), c_n.to(dtype), ws

    lens = _lengths_on(xproj.device, lengths)
    dummy = xproj
    opt = _Options(resets, zoneout, dummy)
    flags = dict(CELL=CELL_IDS[cell], G=k.G, WS=k.WS, HAS_B_IH=b_ih is not None,
                 HAS_B_HH=b_hh is not None, HAS_LENGTHS=lens is not None, REVERSE=bool(reverse),
                 TRAIN=bool(train), HAS_PROJ=z.has_proj, CELL_STEPS=z.cell_steps, **opt.flags,
                 **k.consts)
    args = [b if b is not None else dummy for b in (b_ih, b_hh, w_hr, lens)]
    # The state a reset restarts from (h0, c0 unless given).
    rh, rc = (h0, c0) if reset_h is None else (reset_h, reset_c)
    if path == "loop":
        sequence.forward_loop_kernel[_loop_grid(B)](
            xproj, h0, c0 if has_c else dummy, w_hh, *args, opt.p_resets, opt.p_zo,
            ln if ln is not None else dummy, rh, rc if has_c else dummy, output, h_n,
            c_n if has_c else dummy, ws if train else dummy, T, B, H, P, *opt.strides,
            BLOCK_H=block_size(H), BLOCK_P=block_size(P), HAS_RESET_STATE=reset_h is not None,
            **flags, B_CLASS=batch_class(B))
    elif path == "spread":
        _forward_spread(k, flags, opt, xproj, h0, c0, w_hh, *args, output, h_n, c_n, ws,
                        T, B, H, P, rh, rc)
    else:
        _forward_by_steps(k, flags, opt, xproj, h0, c0, w_hh, *args, ln, output, h_n, c_n, ws,
                          T, B, H, P, rh, rc, live)
    return output.to(dtype), h_n.to(dtype), c_n.to(dtype), ws


def _forward_by_steps(k, flags, opt, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, lens, ln, output,
                      h_n, c_n, ws, T, B, H, P, rh, rc, live=None):
    """The per-step path: the states ping-pong between two buffers in the
    accumulate dtype; nothing waits for the GPU, so the loop can be captured.
    Each step stores the state the next step starts from (the reset state rh /
    rc where that step is a reset), so the products read one buffer whatever
    the resets.

    With ``live`` (_live_rows) step s takes rows [0, live[s - 1]): a row that
    finishes at s is visited once more, which copies its state into the other
    buffer -- both then hold it, whichever is read at the end -- and writes its
    padding at s; after that no kernel visits it (output, ws and c_n then come
    zeroed: recurrence).  Its products thus cost its real steps plus one."""
    cell, dummy = k.cell, xproj
    has_c, rb, proj = has_cell_state(cell), cell == "gru_reset_before", flags["HAS_PROJ"]
    device = xproj.device
    h = [torch.empty((B, P), dtype=k.acc, device=device) for _ in range(2)]
    h[0].copy_(h0)
    c = ([torch.empty((B, H), dtype=k.acc, device=device) for _ in range(2)] if has_c
         else [dummy] * 2)
    if has_c:
        c[0].copy_(c0)
    aux = dummy
    if rb:
        aux = torch.empty((B, 4 * H), dtype=k.acc, device=device)
    elif proj:
        aux = torch.empty((B, H), dtype=k.acc, device=device)
    ws_ = ws if flags["TRAIN"] else dummy
    rc_ = rc if has_c else dummy
    common = dict(HAS_LENGTHS=flags["HAS_LENGTHS"], REVERSE=flags["REVERSE"], **opt.flags,
                  **k.consts)
    options = (opt.p_resets, opt.p_zo)
    if cell == "lstm_ln":
        hr = torch.empty((B, 4 * H), dtype=k.acc, device=device)   # h W_hh^T, raw
        tmp = torch.empty((B, 2 * H), dtype=k.acc, device=device)  # c~ and o between passes
        row_flags = dict(WS=k.WS, HAS_B_IH=flags["HAS_B_IH"], HAS_B_HH=flags["HAS_B_HH"],
                         TRAIN=flags["TRAIN"], STORE_STATE=True, **common)
        row_flags.pop("DOT")
    for s in range(T):
        rows = B if live is None or s == 0 else live[s - 1]  # (the grids; strides stay B)
        if rows == 0:
            break  # every row has finished: its state and padding are written
        if cell == "lstm_ln":
            step_kernels.ln_projections_kernel[_grid(rows, H)](
                dummy, dummy, h[0], w_hh, dummy, hr, B, 0, H, HAS_X=False, **k.consts,
                B_CLASS=batch_class(B))
            step_kernels.lstm_ln_forward_kernel[_loop_grid(rows)](
                xproj, hr, h[0], c[0], b_ih, b_hh, ln, lens, output, h[1], c[1], ws_, tmp,
                rh, rc, *options, s, T, B, H, *opt.strides, **row_flags, B_CLASS=batch_class(B))
        else:
            step_kernels.gates_forward_kernel[_grid(rows, H)](
                dummy, dummy, xproj, h[0], c[0], w_hh, b_ih, b_hh, lens,
                output, h[1], c[1], ws_, aux, rh, rc_, *options, c_n if flags["CELL_STEPS"]
                else dummy, s, T, B, 0, H, P,
                *opt.strides, HAS_X=False, STORE_STATE=True, **flags, B_CLASS=batch_class(B))
        if rb:
            step_kernels.gru_rb_candidate_kernel[_grid(rows, H)](
                aux, h[0], w_hh, b_hh, lens, output, h[1], ws_, rh, *options, s, T, B, H,
                *opt.strides, HAS_B_HH=flags["HAS_B_HH"], TRAIN=flags["TRAIN"],
                STORE_STATE=True, **common, B_CLASS=batch_class(B))
        if proj:
            step_kernels.projection_forward_kernel[_grid(rows, P)](
                aux, w_hr, h[0], lens, output, h[1], rh, *options, s, T, B, H, P, *opt.strides,
                **common, B_CLASS=batch_class(B))
        h.reverse()
        c.reverse()
    h_n.copy_(h[0])
    if has_c and not flags["CELL_STEPS"]:
        c_n.copy_(c[0])


def _forward_spread(k, flags, opt, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, lens, output, h_n,
                    c_n, ws, T, B, H, P, rh, rc):
    """The spread path (:mod:`.spread`): the per-step path's ping-pong buffers
    as one [2, B, *] tensor each, one launch for all T steps."""
    cell, dummy, device = k.cell, xproj, xproj.device
    has_c, proj = has_cell_state(cell), flags["HAS_PROJ"]
    blocks = spread.tiles(cell, B, H, proj, device)
    hs = torch.empty((2, B, P), dtype=k.acc, device=device)
    hs[0].copy_(h0)
    cs = torch.empty((2, B, H), dtype=k.acc, device=device) if has_c else dummy
    if has_c:
        cs[0].copy_(c0)
    # between the two stages of a step (as _forward_by_steps)
    aux = dummy
    if cell == "gru_reset_before":
        aux = torch.empty((B, 4 * H), dtype=k.acc, device=device)
    elif proj:
        aux = torch.empty((B, H), dtype=k.acc, device=device)
    grid = spread.grid(B, H, blocks)
    count = torch.zeros(grid[0], dtype=torch.int32, device=device)
    spread.launch(
        spread.forward_spread_kernel, grid, xproj, hs, cs, w_hh, b_ih, b_hh, w_hr, lens, output,
        ws if flags["TRAIN"] else dummy, aux, rh, rc if has_c else dummy, opt.p_resets,
        opt.p_zo, c_n if flags["CELL_STEPS"] else dummy, count, T, B, H, P, *opt.strides,
        CELL=flags["CELL"], G=k.G, WS=k.WS, HAS_B_IH=flags["HAS_B_IH"],
        HAS_B_HH=flags["HAS_B_HH"], HAS_PROJ=proj, HAS_LENGTHS=flags["HAS_LENGTHS"],
        REVERSE=flags["REVERSE"], TRAIN=flags["TRAIN"], CELL_STEPS=flags["CELL_STEPS"],
        **opt.flags, **k.consts, **blocks)
    h_n.copy_(hs[T % 2])
    if has_c and not flags["CELL_STEPS"]:
        c_n.copy_(cs[T % 2])


def recurrence_backward(cell: str, grad_output: Tensor, grad_h_n: Tensor,
                        grad_c_n: Optional[Tensor], h0: Tensor, c0: Optional[Tensor],
                        w_hh: Tensor, w_hr: Optional[Tensor], output: Tensor, workspace: Tensor,
                        lengths: Optional[Tensor], reverse: bool,
                        resets: Optional[Tensor] = None, zoneout: Optional[Tensor] = None,
                        ln: Optional[Tensor] = None, reset_h: Optional[Tensor] = None,
                        reset_c: Optional[Tensor] = None):
    z = check_recurrence_backward(cell, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr,
                                  output, workspace, lengths, resets, zoneout, ln, reset_h, reset_c)
    _check_device("rnnkern_triton.recurrence_backward", output)
    T, B, H, P, G = z.T, z.B, z.H, z.P, z.G
    has_c, proj, ln_cell = has_cell_state(cell), z.has_proj, cell == "lstm_ln"
    dtype = output.dtype
    k = _Call(cell, dtype, H, z.has_zoneout)
    path = choose_path(cell, H, P, dtype, proj, options=resets is not None or zoneout is not None,
                       B=B, device=output.device)
    (grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output, workspace, ln, reset_h,
     reset_c) = _contiguous(grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output, workspace,
                            ln, reset_h, reset_c)
    device = output.device
    own_reset = reset_h is not None
    rh, rc = (reset_h, reset_c) if own_reset else (h0, c0)

    def acc_empty(*shape):
        return torch.empty(shape, dtype=k.acc, device=device)

    # The per-step path with lengths visits only each step's live rows
    # (_backward_by_steps); where some step leaves rows unvisited, the [T, B]
    # arrays start as zeros, their padding.  So on the spread path, whose tiles
    # start at their longest rows (spread.py).
    live = _live_rows(lengths, T) if path == "step" else None
    unvisited = (live and live[T - 1] < B) or (path == "spread" and lengths is not None)
    acc_grid = (lambda *shape: torch.zeros(shape, dtype=k.acc, device=device)) if unvisited \
        else acc_empty
    dx = acc_grid(T, B, G * H)
    rd = _result_dtype(dtype)
    grad_h0 = output.new_empty((B, P), dtype=rd)
    grad_c0 = output.new_empty((B, H), dtype=rd) if has_c else _empty(output)
    grad_rh = output.new_empty((B, P), dtype=rd) if own_reset else _empty(output)
    grad_rc = output.new_empty((B, H), dtype=rd) if own_reset and has_c else _empty(output)
    # Time-ordered extras of the weight gradients (see backward_loop_kernel).
    aux_all = (acc_grid(T, B, H) if (cell in ("gru", "gru_reset_before", "lstm_ln") or proj)
               else None)
    dh_tot_all = acc_grid(T, B, P) if proj else None
    da_all = acc_grid(T, B, G * H) if ln_cell else None
    dhr_all = acc_grid(T, B, G * H) if ln_cell else None
    lens = _lengths_on(device, lengths)
    opt = _Options(resets, zoneout, output)
    if T == 0 or B == 0:
        grad_h0.copy_(grad_h_n)
        if has_c:
            grad_c0.zero_() if z.cell_steps else grad_c0.copy_(grad_c_n)
        grad_rh.zero_()
        grad_rc.zero_()
    else:
        dummy = output
        flags = dict(CELL=CELL_IDS[cell], G=G, WS=k.WS, HAS_PROJ=proj,
                     HAS_LENGTHS=lens is not None, REVERSE=bool(reverse),
                     CELL_STEPS=z.cell_steps, **opt.flags, **k.consts)
        extras = [dummy if t is None else t for t in (aux_all, dh_tot_all, da_all, dhr_all)]
        if path == "loop":
            sequence.backward_loop_kernel[_loop_grid(B)](
                grad_output, grad_h_n, grad_c_n if has_c else dummy, h0, c0 if has_c else dummy,
                w_hh, w_hr if proj else dummy, output, workspace if k.WS else dummy,
                lens if lens is not None else dummy, opt.p_resets, opt.p_zo,
                ln if ln is not None else dummy, rh, rc if has_c else dummy, dx, grad_h0,
                grad_c0 if has_c else dummy, grad_rh if own_reset else dummy,
                grad_rc if own_reset and has_c else dummy, *extras, T, B, H, P, *opt.strides,
                BLOCK_H=block_size(H), BLOCK_P=block_size(P), HAS_RESET_STATE=own_reset, **flags,
                B_CLASS=batch_class(B))
        elif path == "spread":
            _backward_spread(k, flags, opt, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh,
                             w_hr, output, workspace, lens, dx, grad_h0, grad_c0, aux_all,
                             dh_tot_all, T, B, H, P, rh, rc, grad_rh if own_reset else None,
                             grad_rc if own_reset and has_c else None)
        else:
            _backward_by_steps(k, flags, opt, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh,
                               w_hr, ln, output, workspace, lens, dx, grad_h0, grad_c0, *extras,
                               T, B, H, P, rh, rc, grad_rh if own_reset else None,
                               grad_rc if own_reset and has_c else None, live)
    dx = dx.to(dtype)
    grads = _recurrence_weight_grads(cell, dx, aux_all, dh_tot_all, da_all, dhr_all, workspace,
                                     output, h0, lens, reverse, opt.resets, H, P, rh)
    grad_ln = grads[4] if ln_cell else _empty(output)
    return ((dx, grad_h0.to(dtype), grad_c0.to(dtype))
            + tuple(g.to(dtype) for g in grads[:4])
            + (grad_ln.to(dtype), grad_rh.to(dtype), grad_rc.to(dtype)))


def _backward_by_steps(k, flags, opt, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, ln,
                       output, workspace, lens, dx, grad_h0, grad_c0, aux_all, dh_tot_all, da_all,
                       dhr_all, T, B, H, P, rh, rc, grad_rh, grad_rc, live=None):
    """The per-step BPTT: per step, one launch adds the GEMM part of the carried
    gradient (dA_{s+1} W_hh) for its columns and runs the step's backward
    (two launches for the reset-before GRU, the LSTM projection and LSTM-LN).
    Carries and gate gradients ping-pong between two buffers; grad_h0 is
    finished by input_grad_kernel.  With resets, the gradients of the reset
    steps' start states (rh, rc) sum into dh0 / dc0 (ping-pong buffers as
    well, so that every kernel can be re-run by the autotuner), added at the
    end, or the gradients of the reset state (grad_rh, grad_rc, where not
    None).  A step's kernels read its start state where it has no previous
    one from the h0 / c0 arguments: h0, c0 at step 0, rh, rc after.

    With ``live`` (_live_rows) step s takes rows [0, live[s]) only: the rows
    past them have not started (backwards).  Both buffers of each carry start
    as its initial value (grad_h_n, grad_c_n or 0; the gate gradients 0), so a
    row finds it in either when it starts; its padding comes zeroed
    (recurrence_backward)."""
    cell, dummy, device = k.cell, output, output.device
    has_c, rb, proj = has_cell_state(cell), cell == "gru_reset_before", flags["HAS_PROJ"]
    GH = k.G * H
    DA = 2 * H if rb else GH

    def acc_empty(*shape):
        return torch.empty(shape, dtype=k.acc, device=device)

    skips = live is not None and live[T - 1] < B  # some step leaves rows unvisited

    def pair(shape, first=None):
        """A ping-pong pair starting at `first` (0 where None); with skipped rows
        both buffers (see above), else the second one is written before read."""
        t = [acc_empty(*shape), acc_empty(*shape)]
        for u in t if skips else t[:1]:
            u.zero_() if first is None else u.copy_(first)
        return t

    da = pair((B, DA)) if skips else [acc_empty(B, DA), acc_empty(B, DA)]
    dh = pair((B, P), grad_h_n)
    cell_steps = flags["CELL_STEPS"]  # grad_c_n [T, B, H]: added at each step, the carry from 0
    dc = pair((B, H), None if cell_steps else grad_c_n) if has_c else [dummy] * 2
    dh_mid = acc_empty(B, H) if rb else dummy  # between the two stages of the reset-before GRU
    dn = acc_empty(B, H) if rb else dummy
    dh_tot = acc_empty(B, P) if proj else dummy
    resets = flags["HAS_RESETS"]
    dh0 = pair((B, P)) if resets else [dummy] * 2
    dc0 = pair((B, H)) if resets and has_c else [dummy] * 2
    lens_ = lens if lens is not None else dummy
    ws = workspace if k.WS else dummy
    aux_all_, da_all_, dhr_all_ = (dummy if t is None else t for t in (aux_all, da_all, dhr_all))
    ln_ = ln if ln is not None else dummy
    common = dict(HAS_LENGTHS=flags["HAS_LENGTHS"], REVERSE=flags["REVERSE"], **k.consts)
    options = (opt.p_resets, opt.p_zo)
    for s in reversed(range(T)):
        rows = B if live is None else live[s]  # (the grids; strides stay B)
        da_next, da_now = da[(s + 1) & 1], da[s & 1]
        has_next = s + 1 < T
        h_start, c_start = (h0, c0) if s == 0 else (rh, rc)
        if rows == 0:  # no row has started yet: nothing to run, the carries wait in both buffers
            dh.reverse()
            dc.reverse()
            if resets:
                dh0.reverse()
                dc0.reverse()
            continue
        if proj:
            step_kernels.projection_backward_kernel[_grid(rows, P)](
                grad_output, dh[0], da_next, w_hh, lens_, dh_tot, dh[1], dh_tot_all, *options,
                *dh0, s, T, B, H, P, *opt.strides, HAS_NEXT=has_next, **opt.flags, **common,
                B_CLASS=batch_class(B))
        step_kernels.gates_backward_kernel[_grid(rows, H)](
            grad_output, dh[0], da_next, w_hh, dc[0], ws, output, h_start,
            c_start if has_c else dummy,
            lens_, dh_tot, w_hr if proj else dummy,
            dx, da_now, dh_mid if rb else dh[1], dc[1], dn, aux_all_, *options, ln_, da_all_,
            *dh0, *dc0, grad_c_n if cell_steps else dummy, s, T, B, H, P, *opt.strides,
            HAS_GOUT=True, HAS_NEXT=has_next,
            **flags, B_CLASS=batch_class(B))
        if rb:
            step_kernels.gru_rb_reset_kernel[_grid(rows, H)](
                dn, w_hh, ws, output, h_start, lens_, dh_mid, dx, da_now, dh[1], aux_all_,
                opt.p_resets, s, T, B, H, HAS_RESETS=resets, **common, B_CLASS=batch_class(B))
        if cell == "lstm_ln":
            step_kernels.lstm_ln_backward_kernel[_loop_grid(rows)](
                ws, aux_all_, da_all_, dc[0], c_start, ln, lens_, *options, dx, da_now, dhr_all_,
                dc[1],
                *dc0, s, T, B, H, *opt.strides, WS=k.WS, ACC=k.consts["ACC"],
                HAS_LENGTHS=flags["HAS_LENGTHS"], REVERSE=flags["REVERSE"], **opt.flags,
                B_CLASS=batch_class(B))
        dh.reverse()
        dc.reverse()
        if resets:
            dh0.reverse()
            dc0.reverse()
    own_reset = grad_rh is not None
    if own_reset:
        grad_rh.copy_(dh0[0])
        if has_c:
            grad_rc.copy_(dc0[0])
    elif resets:
        dh[0] += dh0[0]
    # grad_h0 = dh + dA_0 W_hh (the GEMM part of the carry at the first step).
    step_kernels.input_grad_kernel[_input_grad_grid(B, 0, P)](
        dummy, dummy, da[0], w_hh, dh[0], dummy, grad_h0, B, 0, GH, DA, P, **k.consts,
        B_CLASS=batch_class(B))
    if has_c:
        grad_c0.copy_(dc[0] + dc0[0] if resets and not own_reset else dc[0])


def _backward_spread(k, flags, opt, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output,
                     workspace, lens, dx, grad_h0, grad_c0, aux_all, dh_tot_all, T, B, H, P, rh,
                     rc, grad_rh, grad_rc):
    """BPTT on the spread path (:mod:`.spread`): the per-step path's carries,
    gate gradients and reset-state sums as [2, B, *] ping-pong tensors, one
    launch for all T steps; grad_h0 is finished as on the per-step path."""
    cell, dummy, device = k.cell, output, output.device
    has_c, resets, proj = has_cell_state(cell), flags["HAS_RESETS"], flags["HAS_PROJ"]
    rb = cell == "gru_reset_before"
    GH = k.G * H
    DA = 2 if rb else k.G  # the gate gradients that multiply W_hh, in units of H
    blocks = spread.tiles(cell, B, H, proj, device)

    def acc_empty(*shape):
        return torch.empty(shape, dtype=k.acc, device=device)

    # With lengths a tile starts at the step below its longest row (spread.py):
    # its first step may read either buffer of a pair, both then hold the
    # start, and dA of the step after it is zero in both.
    both = flags["HAS_LENGTHS"]

    def pair(n, first=None):
        t = acc_empty(2, B, n)
        for i in (0, 1) if both else (0,):
            if first is None:
                t[i].zero_()
            else:
                t[i].copy_(first)
        return t

    dhs = pair(P, grad_h_n)
    dcs = (pair(H) if flags["CELL_STEPS"] else pair(H, grad_c_n)) if has_c else dummy
    das = acc_empty(2, B, DA * H)
    if both:
        das.zero_()
    else:
        das[T % 2].zero_()  # what step T-1 reads as dA of the step after it
    dh0s = pair(P) if resets else dummy
    dc0s = pair(H) if resets and has_c else dummy
    grid = spread.grid(B, H, blocks)
    count = torch.zeros(grid[0], dtype=torch.int32, device=device)
    spread.launch(
        spread.backward_spread_kernel, grid, grad_output, dhs, das, w_hh,
        w_hr if proj else dummy, dcs, workspace if k.WS else dummy, output, h0,
        c0 if has_c else dummy, rh, rc if has_c else dummy, lens if lens is not None else dummy,
        dx, acc_empty(B, H) if rb else dummy, aux_all if aux_all is not None else dummy,
        acc_empty(B, H) if rb else dummy, acc_empty(B, P) if proj else dummy,
        dh_tot_all if proj else dummy, opt.p_resets, opt.p_zo, dh0s, dc0s,
        grad_c_n if flags["CELL_STEPS"] else dummy, count, T, B, H, P, *opt.strides,
        CELL=flags["CELL"], G=k.G, DA=DA, WS=k.WS, HAS_PROJ=proj,
        HAS_LENGTHS=flags["HAS_LENGTHS"], REVERSE=flags["REVERSE"],
        CELL_STEPS=flags["CELL_STEPS"], **opt.flags, **k.consts, **blocks)
    last = T % 2
    dh = dhs[last]
    if grad_rh is not None:
        grad_rh.copy_(dh0s[last])
        if has_c:
            grad_rc.copy_(dc0s[last])
    elif resets:
        dh = dh + dh0s[last]
    # grad_h0 = dh + dA_0 W_hh (the GEMM part of the carry at the first step).
    step_kernels.input_grad_kernel[_input_grad_grid(B, 0, P)](
        dummy, dummy, das[0], w_hh, dh, dummy, grad_h0, B, 0, GH, DA * H, P, **k.consts,
        B_CLASS=batch_class(B))
    if has_c:
        grad_c0.copy_(dcs[last] + dc0s[last] if resets and grad_rh is None else dcs[last])


def _grad_by_previous_state(d: Tensor, output: Tensor, h0: Tensor, lens: Optional[Tensor],
                            reverse: bool, resets: Optional[Tensor] = None,
                            reset_h: Optional[Tensor] = None) -> Tensor:
    """sum over steps and rows of d[t, b]^T h_{t-1}[t, b]: d [T, B, N], output
    [T, B, P], h0 [B, P] -> [N, P], as one GEMM in output's dtype (see
    :func:`_recurrence_weight_grads`).  h_{t-1} of position t is the output one
    step earlier (t - 1, or t + 1 in reverse), h0 at each sequence's first
    position, and the reset state ``reset_h`` (h0 unless given) where
    ``resets`` [T, B] says a later step restarts (the op's rule); padding
    positions have d = 0, so what they pair with does not matter (as
    csrc/cpu/backward.cpp, weight_grad_by_prev_state).  The previous states are
    gathered into one [T, B, P] tensor rather than adding the first positions'
    product to the rest's: a second GEMM into a half-precision result would
    round the sum twice."""
    T, B, N = d.shape
    P = output.shape[2]
    if T == 0:
        return d.new_zeros((N, P), dtype=output.dtype)
    if reverse:
        prev = torch.cat([output[1:], h0.unsqueeze(0)])
        if lens is not None:  # each row's first position is lens - 1 (rows of length 0: all padding)
            prev[(lens - 1).clamp(min=0), torch.arange(B, device=d.device)] = h0
    else:
        prev = torch.cat([h0.unsqueeze(0), output[:-1]])
    if resets is not None and T > 1:
        # A reset step started from the reset state; a sequence's first position
        # keeps h0 (in reverse that is position lens - 1, beyond which is padding).
        restart = resets.clone()
        restart[T - 1 if reverse else 0] = False
        if reverse and lens is not None:
            restart &= torch.arange(T, device=d.device).unsqueeze(1) < (lens - 1).unsqueeze(0)
        prev = torch.where(restart.unsqueeze(2), h0 if reset_h is None else reset_h, prev)
    return _rows_product(d, prev, output.dtype)


def _rows_product(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """a^T b summed over every leading index (steps and rows): a [..., N],
    b [..., M] -> [N, M], one GEMM with both operands in ``dtype``, the input
    dtype (cuBLAS accumulates half types in float32, as torch.nn's weight
    gradients); every weight gradient of the Triton ops is one of these."""
    return a.reshape(-1, a.shape[-1]).to(dtype).t() @ b.reshape(-1, b.shape[-1]).to(dtype)


def _recurrence_weight_grads(cell, dx, aux_all, dh_tot_all, da_all, dhr_all, workspace, output,
                             h0, lens, reverse, resets, H, P, reset_h):
    """grad_w_hh, grad_b_ih, grad_b_hh, grad_w_hr (and for lstm_ln grad_ln),
    one GEMM or sum each over all steps; reset_h: the state a reset step
    starts from.  ``dx`` is the gradient of the input projection in the input
    dtype (what the op returns); the other per-step gradients are in the
    kernels' accumulation dtype.  Each GEMM multiplies in the input dtype,
    as torch.nn's half-precision weight gradients do: the operands are
    rounded once to it and the products summed in float32 (cuBLAS's compute
    type for half GEMMs; split-K partial sums in half precision where torch
    allows it, ``torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction``,
    as for every half matmul), at the tensor cores' rate instead of float32's,
    which for B=256 H=1024 T=256 was about ten times the time.  The sums
    (biases, LayerNorm gains) stay in the accumulation dtype."""
    T, B, GH = dx.shape
    dtype = output.dtype

    if cell == "lstm_ln":
        # b_ih and b_hh add to the pre-activations after the layer norms (da_all);
        # W_hh multiplies the gradient before its norm (dhr_all); the gains pair
        # with the normalised values the forward saved (csrc/cells.h layout).
        rows = T * B
        da = da_all.reshape(rows, GH)
        ws = workspace.reshape(rows, workspace.shape[-1])
        dy = aux_all.reshape(rows, H)
        grad_b_ih = da.sum(0)
        grad_ln = torch.cat([(da * ws[:, 5 * H:9 * H]).sum(0), (da * ws[:, 9 * H:13 * H]).sum(0),
                             (dy * ws[:, 13 * H:14 * H]).sum(0), dy.sum(0)])
        grad_w_hh = _grad_by_previous_state(dhr_all, output, h0, lens, reverse, resets, reset_h)
        return grad_w_hh, grad_b_ih, grad_b_ih.clone(), _empty(dx), grad_ln
    grad_b_ih = dx.sum((0, 1), dtype=acc_dtype(dtype))
    if cell in ("gru", "gru_reset_before"):
        dw_rz = _grad_by_previous_state(dx[:, :, :2 * H], output, h0, lens, reverse, resets,
                                        reset_h)
        if cell == "gru":  # n multiplies h_{t-1}; its gradient is dhn
            dw_n = _grad_by_previous_state(aux_all, output, h0, lens, reverse, resets, reset_h)
            grad_b_hh = torch.cat([grad_b_ih[:2 * H], aux_all.sum((0, 1))])
        else:  # n multiplies r * h_{t-1} (aux_all); its gradient is dn
            dw_n = _rows_product(dx[:, :, 2 * H:], aux_all, dtype)
            grad_b_hh = grad_b_ih.clone()
        grad_w_hh = torch.cat([dw_rz, dw_n])
    else:
        grad_w_hh = _grad_by_previous_state(dx, output, h0, lens, reverse, resets, reset_h)
        grad_b_hh = grad_b_ih.clone()
    grad_w_hr = (_rows_product(dh_tot_all, aux_all, dtype) if dh_tot_all is not None
                 else _empty(dx))
    return grad_w_hh, grad_b_ih, grad_b_hh, grad_w_hr


# ------------------------------------------------------------------- step ----

def step(cell: str, x: Tensor, h: Tensor, c: Optional[Tensor], w_ih: Tensor, w_hh: Tensor,
         b_ih: Optional[Tensor], b_hh: Optional[Tensor], ln: Optional[Tensor] = None):
    z = check_step(cell, x, h, c, w_ih, w_hh, b_ih, b_hh, ln)
    _check_device("rnnkern_triton.step", x)
    B, I, H, G = z.B, z.I, z.H, z.G
    has_c, rb = has_cell_state(cell), cell == "gru_reset_before"
    k = _Call(cell, x.dtype, H)
    x, h, c, w_ih, w_hh, b_ih, b_hh, ln = _contiguous(x, h, c, w_ih, w_hh, b_ih, b_hh, ln)
    dtype, rd = x.dtype, _result_dtype(x.dtype)
    h_new = x.new_empty((B, H), dtype=rd)
    c_new = x.new_empty((B, H), dtype=rd) if has_c else _empty(x)
    ws = x.new_empty((B, k.WS), dtype=k.acc)
    if B == 0:
        return h_new.to(dtype), c_new.to(dtype), ws
    dummy = x
    b_ih_ = b_ih if b_ih is not None else dummy
    b_hh_ = b_hh if b_hh is not None else dummy
    off = dict(HAS_LENGTHS=False, REVERSE=False, HAS_RESETS=False, HAS_ZONEOUT=False)
    if cell == "lstm_ln":
        # x W_ih^T and h W_hh^T apart (each has its layer norm), then the row kernel
        # with xr as a one-step xproj.
        xr = torch.empty((1, B, 4 * H), dtype=k.acc, device=x.device)
        hr = torch.empty((B, 4 * H), dtype=k.acc, device=x.device)
        tmp = torch.empty((B, 2 * H), dtype=k.acc, device=x.device)
        step_kernels.ln_projections_kernel[_grid(B, H)](
            x, w_ih, h, w_hh, xr, hr, B, I, H, HAS_X=True, **k.consts, B_CLASS=batch_class(B))
        step_kernels.lstm_ln_forward_kernel[_loop_grid(B)](
            xr, hr, h, c, b_ih_, b_hh_, ln, dummy, h_new, dummy, c_new, ws, tmp, dummy, dummy,
            dummy, dummy, 0, 1, B, H, 0, 0, 0, WS=k.WS, HAS_B_IH=b_ih is not None,
            HAS_B_HH=b_hh is not None, TRAIN=True, STORE_STATE=False, ACC=k.consts["ACC"], **off,
            B_CLASS=batch_class(B))
        return h_new.to(dtype), c_new.to(dtype), ws
    aux = torch.empty((B, 4 * H), dtype=k.acc, device=x.device) if rb else dummy
    flags = dict(CELL=CELL_IDS[cell], G=G, WS=k.WS, HAS_B_IH=b_ih is not None,
                 HAS_B_HH=b_hh is not None, TRAIN=True, HAS_PROJ=False, **off, **k.consts)
    step_kernels.gates_forward_kernel[_grid(B, H)](
        x, w_ih, dummy, h, c if has_c else dummy, w_hh, b_ih_, b_hh_,
        dummy, h_new, dummy, c_new if has_c else dummy, ws if k.WS else dummy, aux,
        dummy, dummy, dummy, dummy, dummy, 0, 1, B, I, H, H, 0, 0, 0,
        HAS_X=True, STORE_STATE=False, CELL_STEPS=False, **flags, B_CLASS=batch_class(B))
    if rb:
        step_kernels.gru_rb_candidate_kernel[_grid(B, H)](
            aux, h, w_hh, b_hh_, dummy, h_new, dummy, ws, dummy, dummy, dummy, 0, 1, B, H, 0, 0, 0,
            HAS_B_HH=b_hh is not None, TRAIN=True, STORE_STATE=False, **off, **k.consts,
            B_CLASS=batch_class(B))
    return h_new.to(dtype), c_new.to(dtype), ws


def step_backward(cell: str, grad_h_new: Tensor, grad_c_new: Optional[Tensor], x: Tensor,
                  h: Tensor, c: Optional[Tensor], w_ih: Tensor, w_hh: Tensor, h_new: Tensor,
                  workspace: Tensor, ln: Optional[Tensor] = None, needs: int = 255):
    z = check_step_backward(cell, grad_h_new, grad_c_new, x, h, c, w_ih, w_hh, h_new, workspace,
                            ln)
    _check_device("rnnkern_triton.step_backward", x)
    B, I, H, G = z.B, z.I, z.H, z.G
    has_c, rb, ln_cell = has_cell_state(cell), cell == "gru_reset_before", cell == "lstm_ln"
    GH = G * H
    DA = 2 * H if rb else GH
    dtype = x.dtype
    k = _Call(cell, dtype, H)
    grad_h_new, grad_c_new, x, h, c, w_ih, w_hh, h_new, workspace, ln = _contiguous(
        grad_h_new, grad_c_new, x, h, c, w_ih, w_hh, h_new, workspace, ln)
    device = x.device

    def acc_empty(*shape):
        return torch.empty(shape, dtype=k.acc, device=device)

    rd = _result_dtype(dtype)
    grad_x = x.new_empty((B, I), dtype=rd)
    grad_h = x.new_empty((B, H), dtype=rd)
    grad_c = x.new_empty((B, H), dtype=rd) if has_c else _empty(x)
    dx = acc_empty(B, GH)  # the gradient of x W_ih^T (+ b_ih)
    da = acc_empty(B, DA)  # the gradients that multiply W_hh
    aux_all = acc_empty(B, H) if cell in ("gru", "gru_reset_before", "lstm_ln") else None
    da_all = acc_empty(B, GH) if ln_cell else None  # lstm_ln: the pre-activation gradients
    if B > 0:
        dummy = x
        dh = acc_empty(B, H)
        dh_mid = acc_empty(B, H) if rb else dummy
        dn = acc_empty(B, H) if rb else dummy
        off = dict(HAS_LENGTHS=False, REVERSE=False, HAS_RESETS=False, HAS_ZONEOUT=False)
        flags = dict(CELL=CELL_IDS[cell], G=G, WS=k.WS, HAS_GOUT=False, HAS_NEXT=False,
                     HAS_PROJ=False, **off, **k.consts)
        step_kernels.gates_backward_kernel[_grid(B, H)](
            dummy, grad_h_new, dummy, w_hh, grad_c_new if has_c else dummy,
            workspace if k.WS else dummy, h_new, h, c if has_c else dummy, dummy, dummy, dummy,
            dx, da, dh_mid if rb else dh, grad_c if has_c else dummy, dn,
            aux_all if aux_all is not None else dummy, dummy, dummy,
            ln if ln is not None else dummy, da_all if ln_cell else dummy, dummy, dummy, dummy,
            dummy, dummy, 0, 1, B, H, H, 0, 0, 0, CELL_STEPS=False, **flags,
            B_CLASS=batch_class(B))
        if rb:
            step_kernels.gru_rb_reset_kernel[_grid(B, H)](
                dn, w_hh, workspace, h_new, h, dummy, dh_mid, dx, da, dh, aux_all, dummy,
                0, 1, B, H, HAS_LENGTHS=False, REVERSE=False, HAS_RESETS=False, **k.consts,
                B_CLASS=batch_class(B))
        if ln_cell:  # da: the gradient of h W_hh^T before its layer norm (also dhr_all, T = 1)
            step_kernels.lstm_ln_backward_kernel[_loop_grid(B)](
                workspace, aux_all, da_all, grad_c_new, c, ln, dummy, dummy, dummy, dx, da, da,
                grad_c, dummy, dummy, 0, 1, B, H, 0, 0, 0, WS=k.WS, ACC=k.consts["ACC"], **off,
                B_CLASS=batch_class(B))
        # [grad_x | grad_h] = [dx W_ih | dh + dA W_hh], one launch.
        step_kernels.input_grad_kernel[_input_grad_grid(B, I, H)](
            dx, w_ih, da, w_hh, dh, grad_x, grad_h, B, I, GH, DA, H, **k.consts, B_CLASS=batch_class(B))

    grad_w_ih = _rows_product(dx, x, dtype)
    grad_ln = _empty(x)
    if ln_cell:  # the biases add after the layer norms; the gains pair with the saved x^, h^, c^
        grad_b_ih = da_all.sum(0)
        grad_w_hh = _rows_product(da, h, dtype)
        grad_b_hh = grad_b_ih.clone()
        grad_ln = torch.cat([(da_all * workspace[:, 5 * H:9 * H]).sum(0),
                             (da_all * workspace[:, 9 * H:13 * H]).sum(0),
                             (aux_all * workspace[:, 13 * H:14 * H]).sum(0),
                             aux_all.sum(0)]).to(dtype)
    elif rb:  # rows r, z multiply h; row n multiplies r * h (aux_all), with gradient dn
        grad_b_ih = dx.sum(0)
        grad_w_hh = torch.cat([_rows_product(da, h, dtype),
                               _rows_product(dx[:, 2 * H:], aux_all, dtype)])
        grad_b_hh = grad_b_ih.clone()
    else:  # dA = [dr, dz, dhn] for the GRU, the gate gradients otherwise
        grad_b_ih = dx.sum(0)
        grad_w_hh = _rows_product(da, h, dtype)
        grad_b_hh = da.sum(0)
    grads = (grad_x.to(dtype), grad_h.to(dtype), grad_c.to(dtype), grad_w_ih.to(dtype),
             grad_w_hh.to(dtype), grad_b_ih.to(dtype), grad_b_hh.to(dtype), grad_ln)
    # Outputs not in `needs` are empty (schema: csrc/ops.cpp); all are computed here.
    return tuple(g if needs >> i & 1 else _empty(x) for i, g in enumerate(grads))


# ----------------------------------------------------------- registration ----

# The four ops (defined and registered by rnnkern.library with the schemas of
# torch.ops.rnnkern), implemented for CUDA and CPU (the interpreter).
_lib = implement_family(NAMESPACE, dict(recurrence=recurrence, recurrence_backward=recurrence_backward,
                                        step=step, step_backward=step_backward), ("CUDA", "CPU"))

"""Functional ops: one recurrent layer in one direction, and the single step.

This is the only layer that knows about backends.  Modules call :func:`recurrence`
and :func:`step`; these pick a backend and call its registered op:

=============  ==========================================  ===========================
backend        op                                          devices
=============  ==========================================  ===========================
``reference``  :mod:`rnnkern.reference` (autograd)          any
``cpu``        ``torch.ops.rnnkern.*`` (C++, csrc/cpu)      CPU
``cuda``       ``torch.ops.rnnkern.*`` (CUDA, csrc/cuda)    CUDA, when compiled in
``triton``     ``torch.ops.rnnkern_triton.*``               CUDA; CPU with TRITON_INTERPRET=1
``cuda_emulated``  the CUDA backend on an emulated device     CPU; tests only, present when
               (``torch.ops.rnnkern_cuda_emu.*``,             built with
               :mod:`rnnkern.cuda_emulated`)                  RNNKERN_CUDA_EMULATION=1
=============  ==========================================  ===========================

Every op family has the same four schemas (csrc/ops.cpp): ``recurrence``,
``recurrence_backward``, ``step``, ``step_backward``.  The CPU backend also
computes the input projection with its own op (``rnnkern::linear``), whose
GEMM and pooled buffers beat the BLAS bundled with torch on the CPUs measured;
the other backends use torch's matmul.  For inference it has one more,
``rnnkern::recurrence_from_input`` (:func:`run_recurrence_from_input`): the
two in one, at batch 1 and for LSTM batches with the projection made inside
the steps' products.  Their fake (meta) implementations and
their autograd formulas are registered once per family by
:func:`rnnkern.library.register_op_family`, so ``torch.compile(fullgraph=True)``
traces every backend without a graph break.  This module chooses the backend
only; the op library's plumbing lives in :mod:`rnnkern.library`.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch
from torch import Tensor
from torch.autograd import forward_ad

from . import _C, reference
# (WITH_CUDA_EMULATION, acc_dtype and register_op_family keep their old address here too)
from .library import WITH_CUDA_EMULATION, acc_dtype, has_cell_state, register_op_family  # noqa: F401
from .reference import ALL_CELLS, CELLS, check_cell

BACKENDS = ("auto", "reference", "cpu", "cuda", "triton") + (
    ("cuda_emulated",) if WITH_CUDA_EMULATION else ())

#: True when the CUDA kernels were compiled into rnnkern._C.
WITH_CUDA = bool(_C.WITH_CUDA)

__all__ = ["BACKENDS", "CELLS", "ALL_CELLS", "WITH_CUDA", "recurrence", "step", "input_projection",
           "run_recurrence", "run_step", "run_layers_step", "resolve_backend",
           "register_op_family", "empty_cpu_cache", "set_cuda_persistent", "cuda_persistent",
           "PERSISTENT_MODES"]


#: The persistent kernels' modes, by their code in the extension (Context::persistent).
PERSISTENT_MODES = ("never", "auto", "always")


def persistent_mode_code(mode, who: str = "set_cuda_persistent") -> int:
    """The extension's code of a persistent-kernel mode: "never", "auto" or
    "always", or a bool (True: "always", False: "never")."""
    if mode is True or mode is False:
        return 2 if mode else 0
    if isinstance(mode, str) and mode in PERSISTENT_MODES:
        return PERSISTENT_MODES.index(mode)
    raise ValueError(f"{who}: mode must be one of {', '.join(map(repr, PERSISTENT_MODES))} or a bool, "
                     f"got {mode!r}")


def set_cuda_persistent(mode="auto") -> None:
    """When backend="cuda" runs a layer as its persistent kernel
    (csrc/cuda/persistent.cuh: tanh/ReLU RNN, LSTM without projection, GRU with
    reset after; every option but the projection): one cooperative launch per
    layer and direction, W_hh resident in the SMs' shared memory, instead of a
    GEMM and a pointwise launch per step.  Process-wide.

    * ``"auto"`` (the default): where the GPU timings put it at least level with
      the host loop, each direction apart -- at most 65536 values of h (da) staged
      per step in float16/bfloat16 (B=16 H=768 for every cell, B=64 H=1024
      forward), 12288 in float32, 4096 in float64 -- and sequences of at least 32
      steps (csrc/cuda/params.h: persistent_chosen), never while the stream
      captures a CUDA graph;
    * ``"always"`` (or True): every layer it fits (for timing it);
    * ``"never"`` (or False): the host loop.

    RNNKERN_CUDA_PERSISTENT in the environment sets it at import ("1" is
    "always", "0" "never").  Without the CUDA kernels it raises."""
    code = persistent_mode_code(mode)
    if not WITH_CUDA:
        raise RuntimeError("set_cuda_persistent: rnnkern was built without its CUDA kernels")
    _C.set_cuda_persistent(code)


def cuda_persistent() -> str:
    """The persistent CUDA kernels' mode (see :func:`set_cuda_persistent`):
    "never" without the CUDA kernels."""
    return PERSISTENT_MODES[_C.cuda_persistent()] if WITH_CUDA else "never"


_env_persistent = os.environ.get("RNNKERN_CUDA_PERSISTENT")
if _env_persistent:
    _env_persistent = {"1": "always", "0": "never"}.get(_env_persistent, _env_persistent)
    if _env_persistent not in PERSISTENT_MODES:
        raise ValueError(f"RNNKERN_CUDA_PERSISTENT must be one of {', '.join(PERSISTENT_MODES)}, 1 or 0, "
                         f"got {os.environ['RNNKERN_CUDA_PERSISTENT']!r}")
    if WITH_CUDA:
        set_cuda_persistent(_env_persistent)


def empty_cpu_cache() -> int:
    """Returns the large CPU buffers rnnkern keeps for reuse (csrc/cpu/buffers.h)
    to the system; the number of bytes released.  The cache holds at most
    RNNKERN_CPU_CACHE_MB (default 1024) MiB; 0 disables it."""
    return _C.empty_cpu_cache()


# --------------------------------------------------------------------------
# Backend choice.

def _triton_ops():
    """The Triton op family, imported on first use (Triton is optional)."""
    try:
        from .triton import ops as triton_ops  # noqa: F401  (defines torch.ops.rnnkern_triton)
    except ImportError as e:
        raise RuntimeError(f"backend='triton' needs the triton package: {e}") from e
    return torch.ops.rnnkern_triton


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend for ``backend`` on ``device``; a clear error when it cannot run there."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type == "cpu" and (backend == "cpu" or backend == "auto"):
        return "cpu"  # the common case first: this runs on every call
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if device.type == "meta":
        # Shapes only (shape inference, deferred initialisation), as torch.nn's
        # modules run on meta tensors: the reference's ATen ops give them, for
        # whichever backend a module was built with.
        return "reference"
    if backend == "auto":
        if device.type == "cpu":
            return "cpu"
        if device.type == "cuda":
            return "cuda" if WITH_CUDA else "triton"
        return "reference"
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"backend='cpu' runs on CPU tensors, got tensors on {device}; "
                         "move them with .cpu() or choose backend='cuda' or 'triton'")
    if backend == "cuda":
        if device.type != "cuda":
            raise ValueError(f"backend='cuda' runs on CUDA tensors, got tensors on {device}; "
                             "move them with .cuda() or choose backend='cpu'")
        if not WITH_CUDA:
            raise RuntimeError("backend='cuda': rnnkern was built without its CUDA kernels "
                               "(nvcc or a CUDA build of torch was missing at build time); "
                               "rebuild, or use backend='triton'")
    if backend == "cuda_emulated" and device.type != "cpu":
        raise ValueError(f"backend='cuda_emulated' runs the CUDA kernels on an emulated device "
                         f"with CPU tensors, got tensors on {device}")
    if backend == "triton" and device.type != "cuda":
        if device.type != "cpu" or os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"backend='triton' runs on CUDA tensors (or CPU tensors under "
                             f"TRITON_INTERPRET=1), got tensors on {device}")
    return backend


def _op_family(backend: str):
    if backend == "triton":
        return _triton_ops()
    if backend == "cuda_emulated":
        from . import cuda_emulated  # noqa: F401  (defines torch.ops.rnnkern_cuda_emu)
        return torch.ops.rnnkern_cuda_emu
    return torch.ops.rnnkern


def _needs_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _transformed(*tensors: Optional[Tensor]) -> bool:
    """True under forward-mode AD with a dual input, or inside a torch.func
    transform (grad, vjp, jvp, jacrev, jacfwd, vmap).  The kernels' autograd
    formula is reverse-mode only and does not batch; the reference formulation
    is plain torch ops, which every transform knows how to differentiate and
    batch.  So these calls run the reference: torch.nn's results and
    derivatives, computed unfused (torch.nn's CPU path is unfused too)."""
    if torch.compiler.is_compiling():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return True
    return forward_ad._current_level >= 0 and any(
        t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


# --------------------------------------------------------------------------
# The functional ops.

def recurrence(cell: str, xproj: Tensor, h0: Tensor, c0: Optional[Tensor], w_hh: Tensor,
               b_ih: Optional[Tensor] = None, b_hh: Optional[Tensor] = None,
               w_hr: Optional[Tensor] = None, lengths: Optional[Tensor] = None,
               reverse: bool = False, backend: str = "auto", *, resets: Optional[Tensor] = None,
               zoneout: Optional[Tensor] = None, ln: Optional[Tensor] = None,
               reset_h: Optional[Tensor] = None, reset_c: Optional[Tensor] = None,
               cell_steps: bool = False):
    """The time loop of one layer in one direction (see :func:`rnnkern.reference.recurrence`).

    xproj [T, B, G*H] is the input projection ``X W_ih^T`` of all steps (without
    its bias: ``b_ih`` is added inside), h0 [B, P], c0 [B, H] (LSTM only),
    w_hh [G*H, P], b_ih, b_hh [G*H], w_hr [P, H] (LSTM projection), lengths [B]
    int64 on the CPU; resets [T, B] bool, zoneout [T, B, Z] (a mask, not
    differentiated), ln [10H] (``lstm_ln``), reset_h [B, P] and reset_c [B, H]
    (the state a reset step starts from; h0 enters only each row's first step)
    as in :mod:`rnnkern.reference`.  On the CPU backend xproj may instead be the
    rows of a packed batch, [N, G*H] time-major as PackedSequence.data, with
    lengths sorted longest first (no resets, zoneout or cell_steps); the output
    is then [N, P] likewise.
    Returns ``(output [T, B, P], h_n [B, P], c_n [B, H] or None)``.  With
    ``cell_steps=True`` (``lstm`` only) c_n is the cell state after every step,
    [T, B, H] at the steps' time positions (zeros past a row's length),
    differentiable like the rest: what an RL library's per-step recurrent
    state needs, without recomputing the gates.
    """
    check_cell(cell)
    return run_recurrence(resolve_backend(backend, xproj.device), cell, xproj, h0, c0, w_hh,
                          b_ih, b_hh, w_hr, lengths, reverse, resets, zoneout, ln, reset_h,
                          reset_c, cell_steps)


def run_recurrence(backend: str, cell: str, xproj: Tensor, h0: Tensor, c0: Optional[Tensor],
                   w_hh: Tensor, b_ih: Optional[Tensor], b_hh: Optional[Tensor],
                   w_hr: Optional[Tensor], lengths: Optional[Tensor], reverse: bool,
                   resets: Optional[Tensor] = None, zoneout: Optional[Tensor] = None,
                   ln: Optional[Tensor] = None, reset_h: Optional[Tensor] = None,
                   reset_c: Optional[Tensor] = None, cell_steps: bool = False,
                   ahead: Optional[list] = None):
    """:func:`recurrence` on a backend already resolved (:func:`resolve_backend`)
    and a checked cell name: the modules' per-call path.  ``ahead``: a list
    to which the call appends its outputs (and workspace) computed for
    training, below autograd -- no graph node -- for the caller to record
    its node later on its own thread (:func:`recorded_ahead`)."""
    if backend == "reference" or _transformed(xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, ln, reset_h,
                                              reset_c):
        return reference.recurrence(cell, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, lengths, reverse,
                                    resets, zoneout, ln, reset_h, reset_c, cell_steps)
    train = ahead is not None or _needs_grad(xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, ln, reset_h,
                                             reset_c)
    with torch._C._AutoDispatchBelowAutograd() if ahead is not None else contextlib.nullcontext():
        output, h_n, c_n, ws = _op_family(backend).recurrence.default(
            cell, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, lengths, reverse, train, resets, zoneout,
            ln, reset_h, reset_c, cell_steps)
    if ahead is not None:
        ahead.append((xproj, w_hh, reverse, cell, output, h_n, c_n, ws))
    return output, h_n, (c_n if has_cell_state(cell) else None)


@contextlib.contextmanager
def recorded_ahead(ahead: list):
    """Within: the recurrences in ``ahead`` (:func:`run_recurrence`'s entries,
    computed on any thread) are what this thread's recording calls of the op
    with the same xproj and w_hh, direction and cell take instead of running
    the kernel (csrc/autograd.h, recurrence_ahead): their graph nodes are made
    here, in this thread's order.  A bidirectional layer's two directions run
    at once in training so (rnnkern/modules: _RecurrentMixin._directions_at_once)
    and leave the graph, and every gradient's bits, of one after the other.
    What no call took is dropped on exit (its call ran the kernel again)."""
    for entry in ahead:
        _C.recurrence_ahead(*entry)
    try:
        yield
    finally:
        _C.clear_recurrences_ahead()


def backward_recurrences_at_once(out0: Tensor, grads0, out1: Tensor, grads1) -> int:
    """Two recurrence nodes' backward at once, one on each of two threads,
    ahead of the engine's calls of the nodes: ``out0`` and ``out1`` are outputs
    of the nodes, ``grads0`` and ``grads1`` the gradients (Tensors or None)
    each is about to receive for its out, h_n and c_n.  What each computes is
    kept for this thread's call of its node with the very same gradient
    tensors, which returns it instead of running the kernel (csrc/autograd.h):
    a bidirectional layer whose directions ran at once in the forward
    (rnnkern/modules: _BackwardsAtOnce).  How many were kept."""
    pad = [None] * (4 - len(grads0))  # (through c_n; ws has no gradient)
    return _C.backward_recurrences_at_once(out0, [*grads0, *pad], out1, [*grads1, *pad])


#: The cells recurrence_from_input runs (its plain cells: no options).
FROM_INPUT_CELLS = ("lstm", "gru", "rnn_tanh", "rnn_relu")


def from_input_applies(backend: str, cell: str, x: Tensor, h0: Tensor, c0: Optional[Tensor],
                       weights) -> bool:
    """Whether a layer stack's plain recurrences (no lengths, options or projection:
    the caller's to check) run as :func:`run_recurrence_from_input`: an inference
    call (nothing needs a gradient) in float32 or bfloat16 on the CPU backend, outside
    torch.compile and torch.func.  ``weights``: the stack's per-layer tuples."""
    if backend != "cpu" or cell not in FROM_INPUT_CELLS or x.dim() != 3 \
            or x.dtype not in (torch.float32, torch.bfloat16) or torch.compiler.is_compiling():
        return False
    flat = [w for ws in weights for w in ws]
    return not _needs_grad(x, h0, c0, *flat) and not _transformed(x, h0, c0, *flat)


def run_recurrence_from_input(cell: str, x: Tensor, w_ih: Tensor, h0: Tensor,
                              c0: Optional[Tensor], w_hh: Tensor, b_ih: Optional[Tensor],
                              b_hh: Optional[Tensor], reverse: bool):
    """:func:`run_recurrence` of ``input_projection(x, w_ih)`` in one op
    (``rnnkern::recurrence_from_input``, CPU, inference), with the same bits:
    at batch 1 the projection goes along with the steps' products, in the time
    the products wait on W_hh's stream (csrc/cpu/forward.cpp,
    forward_from_input); a batch of 16 rows or more makes each step's
    x_t W_ih^T in the step (ForwardArgs::x_rows), where the weights are small
    enough; other calls run the two ops.  Where :func:`from_input_applies`."""
    output, h_n, c_n = torch.ops.rnnkern.recurrence_from_input.default(
        cell, x, w_ih, h0, c0, w_hh, b_ih, b_hh, reverse)
    return output, h_n, (c_n if has_cell_state(cell) else None)


def run_recurrence_with_reset_state(backend: str, cell: str, xproj: Tensor, h0: Tensor,
                                    c0: Optional[Tensor], w_hh: Tensor, b_ih: Optional[Tensor],
                                    b_hh: Optional[Tensor], w_hr: Optional[Tensor],
                                    lengths: Optional[Tensor], reverse: bool, resets: Tensor,
                                    zoneout: Optional[Tensor], ln: Optional[Tensor],
                                    reset_h: Tensor, reset_c: Optional[Tensor],
                                    cell_steps: bool = False, ahead: Optional[list] = None):
    """:func:`run_recurrence` under the modules' reset rule: where ``resets[t, b]``
    the step at position t starts from the reset state (``reset_h``, ``reset_c``,
    [B, P] / [B, H]), position 0 included; hx (``h0``, ``c0``) enters each row's
    first step unless that step is a reset.  resets [T, B] bool in the op's
    processing sense (a reverse direction's mask already shifted), positions
    past a row's length ignored.

    One call of the op: its rule starts a row's first step from h0 whatever
    resets says there, so the rows that reset at their first step get the reset
    state as their h0 (a differentiable pick: each gradient goes where its
    state was used)."""
    T, B = resets.shape
    pos = torch.arange(T, device=resets.device).unsqueeze(1)  # [T, 1]
    if lengths is None:
        first_step = pos == (T - 1 if reverse else 0)
    else:
        n = lengths.to(resets.device).unsqueeze(0)
        first_step = (pos == n - 1) if reverse else (pos == 0) & (n > 0)
    fresh = (resets & first_step).any(0).unsqueeze(1)  # [B, 1]
    h_first = torch.where(fresh, reset_h, h0)
    c_first = torch.where(fresh, reset_c, c0) if c0 is not None else None
    return run_recurrence(backend, cell, xproj, h_first, c_first, w_hh, b_ih, b_hh, w_hr, lengths,
                          reverse, resets, zoneout, ln, reset_h, reset_c, cell_steps, ahead)


#: The multiply-adds of one direction's recurrence from which a bidirectional
#: CPU layer runs its directions at once (run_concurrently): some 200 us of a
#: core, against the ~50 us a thread takes to start and meet.
CONCURRENT_MIN_MACS = 1 << 22


def run_concurrently(a, b):
    """``(a(), b())``, the two calls at once on two of torch's threads
    (rnnkern._C's run_concurrently: b with this thread's autograd and dispatch
    state; inside, each call's own parallel loops run on its one thread).  A
    bidirectional layer's two directions at a small batch: each direction's
    steps are too small to split between threads, so one after the other they
    keep one core busy (LSTM B=1 H=512: 55 us a step streaming W_hh's 4 MB
    from L3), and at once they take the time of one.  The kernels give the
    same bits whatever their thread count."""
    return _C.run_concurrently(a, b)


def cpu_recurrence_threads(cell: str, B: int, H: int, P: int, elem_bytes: int) -> int:
    """The threads the CPU backend's recurrence of these sizes runs its steps on
    at torch's thread count (csrc/cpu/schedule.h: by rows, by hidden units, or
    one thread when a step is too small to split)."""
    return _C.cpu_recurrence_threads(cell, B, H, P, elem_bytes)


def concurrent_directions_pay(rows: int, G: int, H: int, P: int) -> bool:
    """Whether one direction's recurrence over ``rows`` (T*B) positions has work
    enough to pay for a thread of its own (CONCURRENT_MIN_MACS)."""
    return rows * G * H * P >= CONCURRENT_MIN_MACS


def input_projection(x: Tensor, w_ih: Tensor, backend: str = "auto") -> Tensor:
    """``x W_ih^T`` over all steps at once: x [T, B, I] -> [T, B, G*H] (no bias; the
    recurrence adds b_ih)."""
    backend = resolve_backend(backend, x.device)
    if backend != "cpu" or x.dtype != w_ih.dtype or _transformed(x, w_ih):
        return torch.nn.functional.linear(x, w_ih)
    T, B = x.shape[0], x.shape[1]
    return torch.ops.rnnkern.linear(rows_of(x), w_ih).view(T, B, w_ih.shape[0])


def rows_of(x: Tensor) -> Tensor:
    """A CPU tensor [T, B, F] as rows [T * B, F]: a view where its strides allow
    one (rnnkern.linear reads any 2D strides), else a dense copy through
    rnnkern::relayout (pooled, and its gradient comes back in x's layout): a
    batch-first input transposed to time-major, whose reshape would copy into
    fresh memory and whose gradient the caller would copy once more."""
    T, B, F = x.shape
    if torch.compiler.is_compiling() or T <= 1 or B <= 1 or x.stride(0) == B * x.stride(1):
        return x.reshape(T * B, F)
    return dense(x).view(T * B, F)


def dense(x: Tensor) -> Tensor:
    """x row-major (contiguous): x itself where it is already, as
    ``x.contiguous()`` (an RL rollout's [1, B, H] output transposed to
    sequence-major: the op's boxed call and copy cost ~30 us of a ~60 us
    step).  Else a CPU tensor through rnnkern::relayout, whose buffer comes
    from rnnkern's cache and whose gradient comes back laid out as x is (so a
    transposed caller gets a dense gradient of its own tensor); elsewhere,
    under torch.compile and under torch.func transforms (which the op does not
    batch), ``x.contiguous()``."""
    if x.is_contiguous() or x.device.type != "cpu" or torch.compiler.is_compiling() \
            or _transformed(x):
        return x.contiguous()
    return torch.ops.rnnkern.relayout(x, list(range(x.dim())))


def step(cell: str, x: Tensor, h: Tensor, c: Optional[Tensor], w_ih: Tensor, w_hh: Tensor,
         b_ih: Optional[Tensor] = None, b_hh: Optional[Tensor] = None, backend: str = "auto", *,
         ln: Optional[Tensor] = None):
    """One step of a cell, ``[x, h] [W_ih; W_hh]^T`` fused with the gates.

    x [B, I], h [B, H], c [B, H] (LSTM only), ln [10H] (``lstm_ln`` only).
    Returns ``(h_new, c_new or None)``.
    """
    check_cell(cell)
    return run_step(resolve_backend(backend, x.device), cell, x, h, c, w_ih, w_hh, b_ih, b_hh, ln)


def run_step(backend: str, cell: str, x: Tensor, h: Tensor, c: Optional[Tensor], w_ih: Tensor,
             w_hh: Tensor, b_ih: Optional[Tensor], b_hh: Optional[Tensor],
             ln: Optional[Tensor] = None):
    """:func:`step` on a backend already resolved (:func:`resolve_backend`) and a
    checked cell name: the modules' per-call path."""
    if backend == "reference" or _transformed(x, h, c, w_ih, w_hh, b_ih, b_hh, ln):
        return reference.step(cell, x, h, c, w_ih, w_hh, b_ih, b_hh, ln)
    if _unboxed_call(x, h, c, w_ih, w_hh, b_ih, b_hh, ln):
        h_new, c_new, _ = _C.step(_family_name(backend), cell, x, h, c, w_ih, w_hh, b_ih, b_hh, ln)
    else:
        h_new, c_new, _ = _op_family(backend).step.default(cell, x, h, c, w_ih, w_hh, b_ih, b_hh,
                                                           ln)
    return h_new, (c_new if has_cell_state(cell) else None)


def _unboxed_call(*tensors: Optional[Tensor]) -> bool:
    """Whether a call of the step ops may go through rnnkern._C's unboxed entry
    (csrc/eager_calls.cpp: the same op through the dispatcher, without
    torch.ops' boxing, which costs a small step ~2-4 us): in eager, with no
    __torch_function__ override among the arguments nor a TorchFunctionMode
    (torch.ops honours them; torch.compile traces torch.ops)."""
    return not torch.compiler.is_compiling() and not torch._C._has_torch_function(tensors)


def _family_name(backend: str) -> str:
    """The torch.ops namespace of a backend's op family."""
    return "rnnkern" if backend == "cpu" or backend == "cuda" else _op_family(backend).name


def run_layers_step(backend: str, cell: str, input: Tensor, h0: Tensor, c0: Optional[Tensor],
                    weights: list, num_layers: int, bidirectional: bool, batch_first: bool):
    """One step of a whole layer stack, every layer and direction by the fused
    step (the family's ``layers_step``, csrc/layers_step.cpp): input [1, B, I]
    ([B, 1, I] with ``batch_first``), h0 (c0) [L*D, B, H] and ``weights`` as
    torch.nn's hx and ``_flat_weights`` (no projection) -> (output, h_n, c_n or
    None).  On a backend with kernels (not ``reference``), tensors outside
    forward-mode AD and torch.func (:func:`_transformed`: the caller steps
    the reference); no dropout between layers and no resets (the caller's)."""
    if _unboxed_call(input, h0, c0, *weights):
        output, h_n, c_n = _C.layers_step(_family_name(backend), cell, input, h0, c0, weights,
                                          num_layers, bidirectional, batch_first)
    else:
        output, h_n, c_n = _op_family(backend).layers_step.default(
            cell, input, h0, c0, weights, num_layers, bidirectional, batch_first)
    return output, h_n, (c_n if c0 is not None else None)

"""The op library's plumbing, shared by every op family (one module, imported
downward by :mod:`rnnkern.ops`, :mod:`rnnkern.triton.ops` and
:mod:`rnnkern.cuda_emulated`).

An op family is ``torch.ops.<namespace>.{recurrence, recurrence_backward, step,
step_backward}`` and the composite ``layers_step`` (one step of a layer stack by
``step``) with rnnkern's schemas (csrc/ops.cpp): ``rnnkern`` (the C++ CPU
and CUDA kernels, defined by rnnkern._C), ``rnnkern_triton`` and
``rnnkern_cuda_emu``.  :func:`define_family` defines a family with those schemas;
:func:`register_op_family` adds what every family shares: the fake (meta)
implementations, so ``torch.compile(fullgraph=True)`` traces every backend
without a graph break, the autograd formulas (C++, csrc/autograd.cpp),
whose ``create_graph=True`` backward differentiates the reference
(``rnnkern::reference_grads``, here), and the FLOP formulas.  Every family is
defined and registered when rnnkern is imported (:data:`FAMILIES`); a backend's
module implements its ops when first used (:func:`implement_family`).
"""
from __future__ import annotations

import importlib.util
from math import prod
from typing import Sequence

import torch
from torch.utils.flop_counter import register_flop_formula

from . import _C, reference
from .reference import gate_count, ln_width, workspace_size

#: True when the emulated CUDA device was built (RNNKERN_CUDA_EMULATION=1): tests only.
WITH_CUDA_EMULATION = importlib.util.find_spec("rnnkern._C_cuda_emu") is not None

#: The ops of every family, in schema order.
OP_NAMES = ("recurrence", "recurrence_backward", "step", "step_backward")
#: The family's ops made of its others (CompositeImplicitAutograd, C++: one
#: implementation for every family, registered by :func:`register_op_family`).
COMPOSITE_NAMES = ("layers_step",)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the gate math runs in (and the workspace is kept in)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def has_cell_state(cell: str) -> bool:
    """True for the cells with a cell state c (the LSTMs)."""
    return cell in ("lstm", "lstm_ln")


# --------------------------------------------------------------------------
# Fake implementations and autograd, shared by every op family.


def _recurrence_fake(cell, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, lengths, reverse, train,
                     resets=None, zoneout=None, ln=None, reset_h=None, reset_c=None,
                     cell_steps=False):
    rows = tuple(xproj.shape[:-1])  # (T, B), or (N,) for packed rows (csrc/checks.h)
    B = h0.shape[0]
    H = w_hh.shape[0] // gate_count(cell)
    P = h0.shape[1]
    output = xproj.new_empty((*rows, P))
    h_n = xproj.new_empty((B, P))
    c_n = (xproj.new_empty((*rows, H) if cell_steps else (B, H)) if has_cell_state(cell)
           else xproj.new_empty((0,)))
    ws_shape = (*rows, workspace_size(cell, H, zoneout is not None)) if train else (0,)
    workspace = xproj.new_empty(ws_shape, dtype=acc_dtype(xproj.dtype))
    return output, h_n, c_n, workspace


def _recurrence_backward_fake(cell, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output,
                              workspace, lengths, reverse, resets=None, zoneout=None, ln=None,
                              reset_h=None, reset_c=None):
    rows = tuple(output.shape[:-1])  # (T, B), or (N,) for packed rows
    B = h0.shape[0]
    G = gate_count(cell)
    H = w_hh.shape[0] // G
    P = h0.shape[1]
    new = output.new_empty
    return (new((*rows, G * H)), new((B, P)), new((B, H)) if has_cell_state(cell) else new((0,)),
            new((G * H, P)), new((G * H,)), new((G * H,)),
            new((P, H)) if w_hr is not None else new((0,)),
            new((ln_width(cell) * H,)) if ln is not None else new((0,)),
            new((B, P)) if reset_h is not None else new((0,)),
            new((B, H)) if reset_c is not None else new((0,)))


def _step_fake(cell, x, h, c, w_ih, w_hh, b_ih, b_hh, ln=None):
    B = x.shape[0]
    H = w_hh.shape[0] // gate_count(cell)
    c_new = x.new_empty((B, H)) if has_cell_state(cell) else x.new_empty((0,))
    workspace = x.new_empty((B, workspace_size(cell, H)), dtype=acc_dtype(x.dtype))
    return x.new_empty((B, H)), c_new, workspace


def _step_backward_fake(cell, grad_h_new, grad_c_new, x, h, c, w_ih, w_hh, h_new, workspace,
                        ln=None, needs=255):
    B, I = x.shape
    G = gate_count(cell)
    H = w_hh.shape[0] // G
    new = x.new_empty
    shapes = ((B, I), (B, H), (B, H) if has_cell_state(cell) else (0,), (G * H, I), (G * H, H),
              (G * H,), (G * H,), (ln_width(cell) * H,) if ln is not None else (0,))
    # An output whose bit is clear in `needs` is empty (schema: csrc/ops.cpp).
    return tuple(new(shape if needs >> i & 1 else (0,)) for i, shape in enumerate(shapes))


def _differentiable_grads(fn, inputs, needs, outputs_grads):
    """The gradients of ``fn(*inputs)`` as a differentiable function of the
    saved inputs, for a backward run with ``create_graph=True`` (second
    derivatives: gradient penalties, Hessian-vector products).  ``fn`` is the
    reference formulation; it runs in the accumulate dtype, as the kernels do.
    Returns one gradient (or None) per input."""
    wrt = [t for t, need in zip(inputs, needs) if need and t is not None]
    if not wrt:
        return [None] * len(inputs)
    with torch.enable_grad():
        acc = acc_dtype(inputs[0].dtype)
        outputs = fn(*(None if t is None else t.to(acc) for t in inputs))
        pairs = [(o, g) for o, g in zip(outputs, outputs_grads) if o is not None and g is not None]
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                         create_graph=True, allow_unused=True))
    return [next(grads) if need and t is not None else None for t, need in zip(inputs, needs)]


@torch.library.impl("rnnkern::reference_grads", "CompositeImplicitAutograd")
def _reference_grads(op, cell, inputs, grads, constants, reverse, needs):
    """rnnkern::reference_grads (schema in csrc/ops.cpp): the create_graph=True
    backward of every op family, called by the autograd formulas in
    csrc/autograd.cpp.  The first-order backward runs the kernels' own backward
    ops; a differentiable one recomputes the reference from the saved inputs
    (xproj and the biases are saved for it) and differentiates that.
    ``inputs``: the op's differentiable arguments in its order, then ``ln``
    (and for recurrence reset_h, reset_c); ``constants``: lengths, resets,
    zoneout (recurrence)."""
    inputs = list(inputs)
    wanted = [bool(needs >> i & 1) for i in range(len(inputs))]
    if op == "recurrence":
        lengths, resets, zoneout = constants
        # A cell_steps call's c_n, and so its gradient, is [T, B, H] (every step's c).
        cell_steps = grads[2] is not None and grads[2].dim() == 3

        def fn(xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, ln, reset_h, reset_c):
            return reference.recurrence(cell, xproj, h0, c0, w_hh, b_ih, b_hh, w_hr, lengths,
                                        reverse, resets,
                                        None if zoneout is None else zoneout.to(xproj.dtype), ln,
                                        reset_h, reset_c, cell_steps=cell_steps)
    else:
        def fn(*tensors):
            return reference.step(cell, *tensors)
    result = _differentiable_grads(fn, inputs, wanted, list(grads))
    # Every wanted input gets a tensor (the schema returns Tensor[]); unused: zeros.
    return [torch.zeros_like(t) if g is None else g
            for g, t, want in zip(result, inputs, wanted) if want]


# --------------------------------------------------------------------------
# FLOP formulas (torch.utils.flop_counter.FlopCounterMode, which Lightning's
# measure_flops and MFU counters run): the matrix products, 2 * m * n * k
# each, as the counter counts torch.nn's cells (their addmm and mm); the gate
# math is elementwise and not counted, as torch's isn't.  Tensors arrive as
# their shapes.  Rows: (T, B), or (N,) for packed rows -- the positions that
# run (an unpacked batch with lengths counts its padded grid, an upper bound
# as the counter's masked-attention formulas are).


def _recurrence_flops(cell, xproj, h0, c0, w_hh, b_ih=None, b_hh=None, w_hr=None, *args,
                      out_shape=None, **kwargs):
    return 2 * prod(xproj[:-1]) * (prod(w_hh) + (prod(w_hr) if w_hr is not None else 0))


def _recurrence_backward_flops(cell, grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output,
                               *args, out_shape=None, **kwargs):
    # per product, the gradient of its input and of its weight
    return 4 * prod(output[:-1]) * (prod(w_hh) + (prod(w_hr) if w_hr is not None else 0))


def _step_flops(cell, x, h, c, w_ih, w_hh, *args, out_shape=None, **kwargs):
    return 2 * x[0] * (prod(w_ih) + prod(w_hh))


def _step_backward_flops(cell, grad_h_new, grad_c_new, x, h, c, w_ih, w_hh, h_new, workspace,
                         ln=None, needs=255, *, out_shape=None):
    # needs: grad_x bit 0, grad_h bit 1, grad_w_ih bit 3, grad_w_hh bit 4 (csrc/ops.cpp)
    wanted = {0: prod(w_ih), 1: prod(w_hh), 3: prod(w_ih), 4: prod(w_hh)}
    return 2 * x[0] * sum(n for bit, n in wanted.items() if needs >> bit & 1)


def _register_flop_formulas(namespace: str) -> None:
    ops = getattr(torch.ops, namespace)
    register_flop_formula(ops.recurrence)(_recurrence_flops)
    register_flop_formula(ops.recurrence_backward)(_recurrence_backward_flops)
    register_flop_formula(ops.step)(_step_flops)
    register_flop_formula(ops.step_backward)(_step_backward_flops)
    # layers_step is made of step; reference_grads (create_graph=True) of
    # torch's ops, which the counter sees: both composite.


def register_op_family(namespace: str) -> None:
    """Registers the fake implementations, the autograd formulas and the FLOP
    formulas of ``torch.ops.<namespace>.{recurrence, recurrence_backward, step,
    step_backward}`` (the autograd formulas are C++, csrc/autograd.cpp, one
    source for every family), and its composite ``layers_step``
    (csrc/layers_step.cpp)."""
    torch.library.register_fake(f"{namespace}::recurrence")(_recurrence_fake)
    torch.library.register_fake(f"{namespace}::recurrence_backward")(_recurrence_backward_fake)
    torch.library.register_fake(f"{namespace}::step")(_step_fake)
    torch.library.register_fake(f"{namespace}::step_backward")(_step_backward_fake)
    _C.register_autograd(namespace)
    _C.register_layers_step(namespace)
    _register_flop_formulas(namespace)


def define_family(namespace: str) -> torch.library.Library:
    """Defines ``torch.ops.<namespace>.{recurrence, recurrence_backward, step,
    step_backward}`` and the composite ``layers_step`` with the schemas of
    ``torch.ops.rnnkern`` (one source: csrc/ops.cpp).  The caller keeps the
    returned library alive and calls :func:`register_op_family`."""
    lib = torch.library.Library(namespace, "DEF")
    for name in OP_NAMES + COMPOSITE_NAMES:
        lib.define(str(getattr(torch.ops.rnnkern, name).default._schema).split("::", 1)[1])
    return lib


def implement_family(namespace: str, impls: dict, keys: Sequence[str]) -> torch.library.Library:
    """Implements each op of a defined family from ``impls`` (name -> function)
    for the dispatch ``keys``; the caller keeps the returned library alive."""
    lib = torch.library.Library(namespace, "IMPL")
    for name in OP_NAMES:
        for key in keys:
            lib.impl(name, impls[name], key)
    return lib


#: The op families' namespaces: the C++ kernels' (defined by rnnkern._C),
#: Triton's (implemented by rnnkern.triton.ops) and the emulated CUDA device's
#: (by rnnkern._C_cuda_emu).  All are defined and registered here, at import,
#: though Triton's and the emulated device's kernels load on first use:
#: FlopCounterMode reads the FLOP formulas when it is built, and a family
#: registered inside one would count nothing on its first calls.
FAMILIES = ("rnnkern", "rnnkern_triton") + (("rnnkern_cuda_emu",) if WITH_CUDA_EMULATION else ())
_DEFINED = [define_family(namespace) for namespace in FAMILIES[1:]]
for _namespace in FAMILIES:
    register_op_family(_namespace)


@torch.library.register_fake("rnnkern::linear")
def _linear_fake(x, weight):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("rnnkern::recurrence_from_input")
def _recurrence_from_input_fake(cell, x, w_ih, h0, c0, w_hh, b_ih, b_hh, reverse):
    T, B = x.shape[0], x.shape[1]
    H = w_hh.shape[0] // gate_count(cell)
    c_n = x.new_empty((B, H)) if has_cell_state(cell) else x.new_empty((0,))
    return x.new_empty((T, B, H)), x.new_empty((B, H)), c_n


@torch.library.register_fake("rnnkern::grid_zeros")
def _grid_zeros_fake(like, size):
    return like.new_zeros(size)


@torch.library.register_fake("rnnkern::relayout")
def _relayout_fake(x, order):
    inverse = sorted(range(len(order)), key=lambda i: order[i])
    return x.new_empty([x.shape[d] for d in order]).permute(inverse)


@torch.library.register_fake("rnnkern::linear_backward")
def _linear_backward_fake(grad_y, x, weight, need_x, need_weight):
    return (x.new_empty(x.shape) if need_x else x.new_empty((0,)),
            weight.new_empty(weight.shape) if need_weight else x.new_empty((0,)))


@register_flop_formula(torch.ops.rnnkern.linear)
def _linear_flops(x, weight, *, out_shape=None):
    return 2 * prod(x[:-1]) * prod(weight)


@register_flop_formula(torch.ops.rnnkern.recurrence_from_input)
def _recurrence_from_input_flops(cell, x, w_ih, h0, c0, w_hh, *args, out_shape=None, **kwargs):
    return 2 * prod(x[:-1]) * (prod(w_ih) + prod(w_hh))


@register_flop_formula(torch.ops.rnnkern.linear_backward)
def _linear_backward_flops(grad_y, x, weight, need_x, need_weight, *, out_shape=None):
    return 2 * prod(x[:-1]) * prod(weight) * (int(need_x) + int(need_weight))

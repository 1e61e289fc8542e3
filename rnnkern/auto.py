"""What ``backend="auto"`` runs: the fastest correct implementation, torch.nn's own included.

A module with ``backend="auto"`` asks :func:`choose` for a call (and keeps the
answer while nothing it depends on changes: the input's shape and dtype, grad
mode, the weights' requires_grad, the thread count, the table).  The answer
is torch.nn's implementation (the module's torch.nn base class: cuDNN on a GPU,
oneDNN on a CPU) or rnnkern's kernels for the tensors' device, with the reason:

1. A call torch.nn cannot express (``GRU(reset_after=False)``, ``resets=``,
   ``zoneout=``, ``lengths=``, the LayerNorm LSTM) runs rnnkern's kernels.
2. Where the shipped table (``auto_table.json``, written from benchmark results
   by ``python -m bench.auto_table``) has measurements for this device, cell and
   dtype, the faster of the two (rnnkern where it measured at least
   :data:`LEVEL`, 0.97x: level counts as rnnkern's) at the measured size nearest to the call's
   (log-distance in B, H and T; forward for inference, forward+backward when the
   call builds a graph) runs; on a CPU, from the rows measured at the thread
   count nearest to the call's (torch.get_num_threads()), of the call's regime
   (one-step rows for a T=1 call, sequence rows otherwise) where the table has
   them; a bidirectional call
   from the rows of bidirectional stacks where the table has them (bench/speech.py),
   else from the one-direction rows.  On a GPU, Triton's kernels are a third candidate,
   trusted only where the call would run the same Triton kernel as the
   measurement (the whole-sequence kernel that keeps W_hh on chip, or the
   spread or per-step paths: their speeds differ five- to fifty-fold, :func:`triton_path`)
   at a size within a factor of 4 in B and H of it.
3. Without a measurement: on a GPU, torch.nn (cuDNN) for what it supports; on a
   CPU, rnnkern's CPU kernels (measured faster than oneDNN on the CPU grid of
   the benchmark), except bfloat16 on CPUs with AVX512_BF16: there oneDNN runs
   the bf16 dot-product instructions.  rnnkern's kernels run their bfloat16
   products on them too (csrc/cpu/pairs.h), at 0.9-3x oneDNN's speed on a Zen 4
   depending on the cell (the LSTM forward is oneDNN's best case: its products at
   the instruction's peak), so a CPU class with the instruction and no row for the
   call's cell, dtype and phase keeps torch.nn; the Zen 4's bf16 rows
   (cpu:512bit+bf16) decide the rest.  A CPU with AMX's bf16 tiles (an Intel
   Xeon: ``+amx`` in its class) borrows no bf16 rows: oneDNN's bf16 runs on the
   tiles there, and rnnkern's too (csrc/cpu/pairs.h), at speeds of their own
   (measured on one, T=128 B=32 H=256 forward, one thread: LSTM 1.07x, GRU 3.61x,
   RNN 4.76x for rnnkern; 0.13-0.74x when rnnkern's ran on vdpbf16ps), so its bf16
   calls without a row of its own keep torch.nn; its other dtypes take the rows of
   its class without ``+amx``.

A CPU whose cores run AVX-512 on 512-bit FMA pipes (a Zen 5: ``+fma512`` in its
class) has its own rows, oneDNN and rnnkern gaining differently from the width
(the float32 LSTM forward at B=32-64 H=256-512: 1.04-1.17x on a Zen 4, 0.95-0.99x
on a Zen 5).  Where that class has no row of the call's regime and directions and
the class of the same ISA without the suffix has, that class's rows decide.

Explicit backends (``"cpu"``, ``"cuda"``, ``"triton"``, ``"reference"``) always
run rnnkern's own code.  :func:`rnnkern.explain` names the choice for a module
and an input without running anything.
"""
from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

#: The table shipped with the package; RNNKERN_AUTO_TABLE names another file
#: (read once, when auto first decides: a one-step call feels each microsecond).
TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "auto_table.json")

TORCH = "torch.nn"

#: A measured ratio (torch.nn's time / rnnkern's) at or above this is level or
#: better, and rnnkern runs: the benchmark's VMs spread by ~10% from run to run.
LEVEL = 0.97


@dataclass(frozen=True)
class Choice:
    """The implementation ``backend="auto"`` runs for a call, and why."""

    implementation: str  # "torch.nn" or rnnkern's backend name ("cpu", "cuda", "triton")
    reason: str

    @property
    def uses_torch(self) -> bool:
        return self.implementation == TORCH

    def __str__(self) -> str:
        name = self.implementation if self.uses_torch else f"rnnkern backend={self.implementation!r}"
        return f"{name}: {self.reason}"


@functools.lru_cache(maxsize=None)
def _load(path: str) -> dict:
    if not os.path.exists(path):
        return {"entries": []}
    with open(path) as f:
        return json.load(f)


def table() -> dict:
    """The measurements ``auto`` decides by (see the module docstring)."""
    return _load(_table_path())


@functools.lru_cache(maxsize=None)
def _table_path() -> str:
    return os.environ.get("RNNKERN_AUTO_TABLE", TABLE_PATH)


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset:
    """This CPU's ISA flags as Linux reports them (empty elsewhere), read once."""
    from .check.probe import cpuinfo  # the self-check's reader (it imports _C and ops: not at import time)
    return frozenset(cpuinfo()[1] or ())


def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU has the bf16 dot-product instructions (Linux's flags)."""
    return "avx512_bf16" in _cpu_flags()


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX's bf16 tile multiply (Linux's flags: Intel's Xeons
    from Sapphire Rapids on), which oneDNN runs torch.nn's bfloat16 products on."""
    return "amx_bf16" in _cpu_flags()


def fma_pipes_512bit(vendor: str, family: int, model: int) -> bool:
    """Whether a CPU's cores run a 512-bit FMA whole, as far as the table tells
    CPUs apart: AMD's server and desktop Zen 5 (family 0x1A, models 0x00-0x1F and
    0x40-0x4F); a Zen 4, like the mobile Zen 5, runs it as two 256-bit halves.
    (Intel's cores with 512-bit FMA units are not told apart: they keep the class
    of their ISA.)  The kernels' rule, for this process: ``_C.cpu_fma_pipe_bits()``
    (csrc/cpu/gemm.h), the same."""
    return vendor == "AuthenticAMD" and family == 0x1A and (model <= 0x1F or 0x40 <= model <= 0x4F)


#: The suffix of a CPU class whose 512-bit kernels run on 512-bit FMA pipes.
FMA512 = "+fma512"
#: The suffix of a CPU class with AMX's bf16 tiles: its own rows, no parent's (a
#: Zen 4's bf16 rows, measured against oneDNN on the dot products, say nothing here).
AMX = "+amx"


def cpu_class(vector_bits: int, bf16: bool, fma512: bool = False, amx: bool = False) -> str:
    """The table's key of a CPU: the width rnnkern's kernels run at, whether the
    CPU has the bf16 dot products, whether it has AMX's bf16 tiles (``+amx``:
    oneDNN's bfloat16 products run there, the LSTM's forward at T=128 B=32
    H=256 6-8x faster than on the dot products), and for 512-bit kernels whether
    its FMA pipes are 512 bits wide (oneDNN's speed and rnnkern's differ with
    each)."""
    return (f"cpu:{vector_bits}bit{'+bf16' if bf16 else ''}{AMX if amx else ''}"
            f"{FMA512 if fma512 and vector_bits == 512 else ''}")


def parent_class(key: str) -> Optional[str]:
    """The class whose rows stand in where ``key``'s have none (module docstring):
    a CPU class without its ``+fma512``; None for the others."""
    return key[:-len(FMA512)] if key.endswith(FMA512) else None


@functools.lru_cache(maxsize=None)
def _this_cpu_class() -> str:
    from . import _C
    return cpu_class(_C.cpu_vector_bits(), cpu_has_avx512_bf16(), _C.cpu_fma_pipe_bits() == 512,
                     cpu_has_amx_bf16())


def device_class(device: torch.device) -> str:
    """The key of a device in the table: ``cuda:sm_90``, ``cpu:512bit+bf16``, ..."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:sm_{major}{minor}"
    if device.type == "cpu":
        return _this_cpu_class()
    return device.type


# What is derived from the table (its index, answers) is kept per table: the
# caches below are emptied when table() gives another document or its entries
# change in number.  The document itself is held, so that its id cannot be
# reused by another one while the caches stand.
_CACHED_FOR: list = [None, -1]
_INDEXES: dict = {}
_CHOICES: dict = {}


def _current_table() -> dict:
    doc = table()
    n = len(doc.get("entries", []))
    if _CACHED_FOR[0] is not doc or _CACHED_FOR[1] != n:
        for cache in (_INDEXES, _CHOICES):
            cache.clear()
        _CACHED_FOR[:] = [doc, n]
    return doc


def _index() -> dict:
    """The table's entries by (device, cell, dtype, phase), built once per table."""
    doc = _current_table()
    if not _INDEXES:
        index: dict = {}
        for e in doc.get("entries", []):
            index.setdefault((e["device"], e["cell"], e["dtype"], e["phase"]), []).append(e)
        _INDEXES.update(index)  # whole (one C call): another thread never sees a part of it
    return _INDEXES


def _nearest_threads(rows: list, threads: int) -> Optional[int]:
    """Of the thread counts the rows were measured at, the nearest to ``threads``
    (log-distance; a tie goes to the larger); None when no row names one."""
    counts = {e["threads"] for e in rows if e.get("threads")}
    if not counts:
        return None
    return min(counts, key=lambda n: (abs(math.log(n / max(threads, 1))), -n))


def _at_threads(rows: list, threads: int) -> list:
    """The rows measured at the thread count nearest to ``threads`` (and those
    that name none): oneDNN and rnnkern scale differently with threads, so a
    2-thread row does not speak for a 1-thread call where a 1-thread row exists."""
    n = _nearest_threads(rows, threads)
    return rows if n is None else [e for e in rows if e.get("threads") in (n, None)]


def _nearest(entries: list, B: int, H: int, T: int) -> dict:
    def distance(e):
        return sum(math.log(max(a, 1) / max(b, 1)) ** 2 for a, b in ((e["B"], B), (e["H"], H), (e["T"], T)))
    return min(entries, key=distance)


#: How far (a factor in B and in H) a Triton measurement is trusted from its size.
TRITON_REACH = 4.0


#: SMs of the GPUs the table's Triton rows were measured on (H100 and H200: 132).
TABLE_SMS = 132


def triton_path(cell: str, H: int, P: int, dtype: torch.dtype, proj: bool, B: int = 1,
                sms: int = TABLE_SMS) -> str:
    """The Triton kernel a plain call of these sizes runs on a GPU of ``sms``
    SMs: ``"loop"`` (the whole-sequence kernel, W_hh on chip), ``"spread"``
    (one launch over the SMs, a grid barrier per step) or ``"step"`` (one
    launch per step), as rnnkern/triton/ops.py's ``choose_path`` decides by
    default.  (The table's Triton rows beyond the on-chip limit predate the
    spread kernels: they were measured per step, 0.11x - 0.33x of cuDNN, and
    stand for the spread kernels until a GPU run measures those; below 1x
    they never make ``auto`` pick Triton.)"""
    from .triton.sequence import fits_on_chip
    from .triton.spread import tiles_for
    if fits_on_chip(cell, H, P, dtype, proj):
        return "loop"
    return "spread" if tiles_for(cell, B, H, proj, sms) is not None else "step"


def _triton_usable() -> bool:
    from . import ops
    try:
        ops._triton_ops()  # the one place that imports Triton's op family
    except RuntimeError:  # (raised there when the triton package is missing)
        return False
    return True


def choose(*, cell: str, device: torch.device, dtype: torch.dtype, B: int, H: int, T: int,
           training: bool, torch_lacks: Optional[str], rnnkern_backend: str,
           device_key: Optional[str] = None, proj_size: int = 0,
           threads: Optional[int] = None, directions: int = 1) -> Choice:
    """The implementation for one call of a sequence module.

    ``torch_lacks``: the option of the call torch.nn cannot run (None: it can);
    ``rnnkern_backend``: rnnkern's backend for this device (``resolve_backend``);
    ``device_key``: the table's key for the device (default :func:`device_class`);
    ``proj_size``: the LSTM's projection (0: none), for Triton's kernel choice;
    ``threads``: the call's thread count (default torch's), for the CPU rows;
    ``directions``: 2 for a bidirectional module (see :func:`_for_directions`).
    Answers are remembered per table and arguments (each module also keeps its last)."""
    if torch_lacks is not None:
        return Choice(rnnkern_backend, f"torch.nn has no {torch_lacks}")
    key = device_key or device_class(device)
    threads = threads or torch.get_num_threads()
    _current_table()
    memo = (cell, device.type, dtype, B, H, T, training, rnnkern_backend, key, proj_size, threads,
            directions)
    choice = _CHOICES.get(memo)
    if choice is None:
        if len(_CHOICES) > 4096:
            _CHOICES.clear()
        choice = _CHOICES[memo] = _choose(cell, device, dtype, B, H, T, training, rnnkern_backend,
                                          key, proj_size, threads, directions)
    return choice


def _for_directions(rows: list, directions: int) -> list:
    """The rows that speak for a call of ``directions``: a bidirectional call's
    own rows where the table has them (bench/speech.py: on a CPU rnnkern runs
    the two directions at once, so its ratio there is not a
    one-direction row's), else the one-direction rows; a one-direction call's,
    those alone."""
    if directions == 2:
        own = [e for e in rows if e.get("directions", 1) == 2]
        if own:
            return own
    return [e for e in rows if e.get("directions", 1) == 1]


def _same_regime(rows: list, T: int) -> list:
    """The rows of the call's regime where the table has them: one-step rows
    (T=1) for a one-step call, sequence rows for a sequence call.  A one-step
    call costs its per-call work, a sequence its steps: on a Zen 4 at two
    threads the nearest rows of an LSTM's one-step forward were T=256 rows
    (0.95x, torch.nn ran) while the one-step rows, measured at one thread
    only, said 1.4-4.8x, as the call then measured at two (auto ran it at
    0.92-0.96x).  So a regime's rows at another thread count come before the
    other regime's at the call's."""
    same = [e for e in rows if (e["T"] == 1) == (T == 1)]
    return same or rows


def _class_rows(key: str, cell: str, dtype_name: str, phase: str, T: int, directions: int) -> list:
    """The rows of ``key`` for the call's cell, dtype and phase, or its parent
    class's (:func:`parent_class`) where ``key`` has none of the call's regime
    and directions and the parent has: a class without one-step rows of its own
    decides a one-step call by the parent's one-step rows, not by its own
    sequence rows."""
    index = _index()
    own = index.get((key, cell, dtype_name, phase), [])
    parent = parent_class(key)
    if parent is None and AMX in key and dtype_name != "bfloat16":
        parent = key.replace(AMX, "")  # oneDNN's other dtypes run no tiles: the ISA's rows speak
    if parent is None:
        return own

    def exact(rows):
        return any((e["T"] == 1) == (T == 1) and e.get("directions", 1) == directions for e in rows)

    inherited = index.get((parent, cell, dtype_name, phase), [])
    if exact(own) or not inherited:
        return own
    return inherited if exact(inherited) or not own else own


def _choose(cell: str, device: torch.device, dtype: torch.dtype, B: int, H: int, T: int,
            training: bool, rnnkern_backend: str, key: str, proj_size: int, threads: int,
            directions: int = 1) -> Choice:
    dtype_name = str(dtype).replace("torch.", "")
    phase = "forward_backward" if training else "forward"
    rows = _same_regime(_for_directions(_class_rows(key, cell, dtype_name, phase, T, directions),
                                        directions), T)
    if device.type == "cpu":
        rows = _at_threads(rows, threads)
    found = []  # (ratio, backend, entry)
    if rnnkern_backend != "triton":
        entries = [e for e in rows if rnnkern_backend in e["speedups"]]
        if entries:
            e = _nearest(entries, B, H, T)
            found.append((e["speedups"][rnnkern_backend], rnnkern_backend, e))
    if device.type == "cuda" and any("triton" in e["speedups"] for e in rows) and _triton_usable():
        sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if torch.cuda.is_available() else TABLE_SMS)
        path = triton_path(cell, H, proj_size or H, dtype, proj_size > 0, B, sms)
        entries = [e for e in rows if "triton" in e["speedups"]
                   and triton_path(cell, e["H"], e["H"], dtype, False, e["B"]) == path
                   and max(e["B"], B) <= TRITON_REACH * max(min(e["B"], B), 1)
                   and max(e["H"], H) <= TRITON_REACH * max(min(e["H"], H), 1)]
        if entries:
            e = _nearest(entries, B, H, T)
            found.append((e["speedups"]["triton"], "triton", e))
    if found:
        ratio, backend, e = max(found, key=lambda f: f[0])
        at_threads = f", {e['threads']} thread{'s' if e['threads'] > 1 else ''}" if e.get("threads") else ""
        stack = " bidirectional" if e.get("directions", 1) == 2 else ""
        where = (f"{cell}{stack} {dtype_name} {phase.replace('_', '+')} at B={e['B']} T={e['T']} H={e['H']}"
                 f"{at_threads} on {e['device']} ({e['source']})")
        if ratio >= LEVEL:
            return Choice(backend, f"measured {ratio:.2f}x torch.nn's speed: {where}")
        return Choice(TORCH, f"rnnkern measured {ratio:.2f}x torch.nn's speed: {where}")
    if device.type == "cuda":
        return Choice(TORCH, f"no measurement of rnnkern for {cell} {dtype_name} on {key}: "
                             "torch.nn's cuDNN path")
    if device.type == "cpu" and dtype == torch.bfloat16 and "+bf16" in key:
        return Choice(TORCH, f"no measurement of rnnkern for {cell} bfloat16 on {key}: oneDNN runs "
                             "this CPU's bf16 dot-product instructions, and no row measures rnnkern's "
                             "use of them for this call")
    return Choice(rnnkern_backend, f"rnnkern's {device.type} kernels (no measurement says otherwise)")


def explain(module, input, hx=None, **kwargs) -> Choice:
    """The implementation ``module(input, hx, **kwargs)`` would run, and why,
    without running it: for ``backend="auto"`` the choice above; otherwise the
    backend asked for."""
    data = input.data if not isinstance(input, torch.Tensor) and hasattr(input, "data") else input
    backend = getattr(module, "backend", None)
    if backend is None:
        raise TypeError(f"explain: expected an rnnkern module, got {type(module).__name__}")
    from . import ops
    if backend != "auto":
        return Choice(ops.resolve_backend(backend, data.device), f"backend={backend!r} was asked for")
    if not hasattr(module, "_auto_choice"):
        return Choice(ops.resolve_backend("auto", data.device),
                      "cells run rnnkern's fused step (the table covers sequence modules)")
    return module._auto_choice(input, hx, **kwargs)

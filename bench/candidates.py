"""The implementations a run compares, each behind one calling convention.

Every candidate turns the weights of a torch.nn module into a *layer*: a function
``layer(x [T, B, I], h0 [B, H], c0 [B, H] or None) -> (output [T, B, H], h_n, c_n or None)``
plus the list of weight tensors whose gradients the forward + backward phase asks
for (``weight_ih, weight_hh, bias_ih, bias_hh``, torch.nn's layout).  Each gets its
own copy of the same weights.

==========  ===========  ==================================================================
name        label        what runs
==========  ===========  ==================================================================
torch       torch.nn     torch.nn.LSTM / GRU / RNN: cuDNN on GPU, oneDNN / ATen on CPU.
                         The baseline: always run, every ratio is against it.
cpu         rnnkern-cpu  rnnkern's module with backend="cpu" (C++ kernels, csrc/cpu)
cuda        rnnkern-cuda rnnkern's module with backend="cuda" (CUDA kernels, csrc/cuda)
triton      rnnkern-triton  rnnkern's module with backend="triton"
reference   loop         the vanilla loop: the input projection as one GEMM, then a Python
                         loop over rnnkern.reference.cell_from_projections (seed formulas)
compile     loop+compile the same loop with the step torch.compile'd (dynamic shapes).  The
                         loop itself is not compiled: Dynamo unrolls it, which takes minutes
                         to compile at T=1024 and cannot finish at T=16k.
flashrnn    FlashRNN     the ``flashrnn`` package (NX-AI), backend "cuda_fused" (GRU falls
                         back to its alternating "cuda" kernels), weights mapped to its
                         layout; GPU only.
==========  ===========  ==================================================================
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import rnnkern
from rnnkern import reference

from .grid import Case

Layer = Callable[[Tensor, Tensor, Optional[Tensor]], tuple]

#: cell -> (torch.nn class, rnnkern class, constructor keywords)
MODULES = {
    "lstm": (nn.LSTM, rnnkern.LSTM, {}),
    "gru": (nn.GRU, rnnkern.GRU, {}),
    "rnn_tanh": (nn.RNN, rnnkern.RNN, {"nonlinearity": "tanh"}),
    "rnn_relu": (nn.RNN, rnnkern.RNN, {"nonlinearity": "relu"}),
}

#: The Python loops run a few kernels per step: beyond this many steps they only
#: repeat what the shorter sequences show (their time grows linearly in T), at a
#: cost that would dominate the run.
LOOP_MAX_T = {"cpu": 2048, "cuda": 4096}

#: FlashRNN JIT-compiles a CUDA kernel per (cell, hidden size, batch, dtype), one to
#: two minutes each, so by default it runs at the headline size only.
FLASHRNN_FAMILIES = ("headline",)


@dataclass
class Built:
    layer: Layer
    params: list  # weight_ih, weight_hh, bias_ih, bias_hh


@dataclass(frozen=True)
class Candidate:
    name: str
    label: str
    #: None when it can run on this device, else why not
    unavailable: Callable[[torch.device], Optional[str]]
    #: None when it runs this case, else why not
    skip: Callable[[Case, torch.device, dict], Optional[str]]
    build: Callable[[Case, nn.Module, torch.device], Built]


def torch_module(cell: str, I: int, H: int, seed: int) -> nn.Module:
    """The case's weights: a torch.nn module with torch's own initialisation, float64, CPU."""
    torch_cls, _, kw = MODULES[cell]
    torch.manual_seed(seed)
    return torch_cls(I, H, **kw).double()


def copy_module(cls, src: nn.Module, case: Case, device: torch.device, dtype, **extra) -> nn.Module:
    kw = MODULES[case.cell][2]
    m = cls(case.I, case.H, **kw, **extra).to(device=device, dtype=dtype)
    m.load_state_dict(src.state_dict())
    if hasattr(m, "flatten_parameters"):
        m.flatten_parameters()
    return m


def module_layer(m: nn.Module, lstm: bool) -> Built:
    def layer(x, h0, c0):
        if lstm:
            out, (h, c) = m(x, (h0.unsqueeze(0), c0.unsqueeze(0)))
            return out, h[0], c[0]
        out, h = m(x, h0.unsqueeze(0))
        return out, h[0], None

    params = [m.weight_ih_l0, m.weight_hh_l0, m.bias_ih_l0, m.bias_hh_l0]
    return Built(layer, params)


def _no_skip(case, device, options):
    return None


def _always(device):
    return None


# ------------------------------------------------------------ torch.nn ----

def _build_torch(case, src, device):
    m = copy_module(MODULES[case.cell][0], src, case, device, case.torch_dtype)
    return module_layer(m, case.cell == "lstm")


# ------------------------------------------------------------- rnnkern ----

def _rnnkern_unavailable(backend):
    def check(device):
        if backend == "cpu":
            return None if device.type == "cpu" else "the C++ CPU kernels run on CPU tensors"
        if device.type != "cuda":
            return f"backend={backend!r} runs on CUDA tensors" + (
                " (Triton's CPU interpreter is for tests, not timings)" if backend == "triton" else "")
        if backend == "cuda" and not rnnkern.ops.WITH_CUDA:
            return "rnnkern was built without its CUDA kernels"
        if backend == "triton":
            try:
                importlib.import_module("rnnkern.triton.ops")
            except Exception as e:  # ImportError, or triton failing to initialise
                return f"rnnkern.triton.ops does not import: {type(e).__name__}: {e}"
        return None
    return check


def _build_rnnkern(backend):
    def build(case, src, device):
        m = copy_module(MODULES[case.cell][1], src, case, device, case.torch_dtype, backend=backend)
        return module_layer(m, case.cell == "lstm")
    return build


# --------------------------------------------------------- vanilla loop ----

def loop_layer(cell: str, params: list, step) -> Layer:
    """The vanilla loop: one GEMM for the input projection of all steps, then one
    ``step`` call per time step (``step`` has the signature of
    :func:`rnnkern.reference.cell_from_projections`)."""
    w_ih, w_hh, b_ih, b_hh = params

    def layer(x, h0, c0):
        xp = F.linear(x, w_ih, b_ih)
        h, c = h0, c0
        outs = []
        for t in range(x.shape[0]):
            h, c = step(cell, xp[t], h, c, w_hh, b_hh)
            outs.append(h)
        return torch.stack(outs), h, c

    return layer


def _skip_long_loops(case, device, options):
    limit = LOOP_MAX_T[device.type]
    if case.T > limit:
        return (f"T={case.T} > {limit}: a Python loop's time grows linearly in T; "
                f"the shorter sequences show its per-step cost")
    return None


def _build_reference(case, src, device):
    m = copy_module(MODULES[case.cell][0], src, case, device, case.torch_dtype)
    params = [m.weight_ih_l0, m.weight_hh_l0, m.bias_ih_l0, m.bias_hh_l0]
    return Built(loop_layer(case.cell, params, reference.cell_from_projections), params)


_COMPILED_STEP = None


def compiled_step():
    """rnnkern.reference.cell_from_projections under torch.compile, made once per
    process.  Dynamic shapes, so a new size does not recompile; the recompile limit
    is raised (each cell, dtype and grad mode is its own graph) and hitting it fails
    loudly instead of silently running eager."""
    global _COMPILED_STEP
    if _COMPILED_STEP is None:
        cfg = torch._dynamo.config
        if hasattr(cfg, "recompile_limit"):
            cfg.recompile_limit = max(cfg.recompile_limit, 64)
        if hasattr(cfg, "fail_on_recompile_limit_hit"):
            cfg.fail_on_recompile_limit_hit = True
        _COMPILED_STEP = torch.compile(reference.cell_from_projections, dynamic=True)
    return _COMPILED_STEP


def _build_compile(case, src, device):
    m = copy_module(MODULES[case.cell][0], src, case, device, case.torch_dtype)
    params = [m.weight_ih_l0, m.weight_hh_l0, m.bias_ih_l0, m.bias_hh_l0]
    return Built(loop_layer(case.cell, params, compiled_step()), params)


# ------------------------------------------------------------- FlashRNN ----

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


# ----------------------------------------------------------- the table ----

CANDIDATES = {
    "torch": Candidate("torch", "torch.nn", _always, _no_skip, _build_torch),
    "cpu": Candidate("cpu", "rnnkern-cpu", _rnnkern_unavailable("cpu"), _no_skip, _build_rnnkern("cpu")),
    "cuda": Candidate("cuda", "rnnkern-cuda", _rnnkern_unavailable("cuda"), _no_skip, _build_rnnkern("cuda")),
    "triton": Candidate("triton", "rnnkern-triton", _rnnkern_unavailable("triton"), _no_skip,
                        _build_rnnkern("triton")),
    "reference": Candidate("reference", "loop", _always, _skip_long_loops, _build_reference),
    "compile": Candidate("compile", "loop+compile", _always, _skip_long_loops, _build_compile),
    "flashrnn": Candidate("flashrnn", "FlashRNN", _flashrnn_unavailable, _flashrnn_skip, _build_flashrnn),
}
BASELINE = "torch"
RNNKERN_BACKENDS = ("cpu", "cuda", "triton")

"""The implementations a run compares, each behind one calling convention.

Every candidate turns the weights of a torch.nn module into a *layer*: a function
``layer(x [T, B, I], h0 [B, H], c0 [B, H] or None) -> (output [T, B, H], h_n, c_n or None)``
plus the list of weight tensors whose gradients the forward + backward phase asks
for (``weight_ih, weight_hh, bias_ih, bias_hh``, torch.nn's layout).  Each gets its
own copy of the same weights.  For a cell call (``case.call == "cell"``, T = 1) the
layer runs the cell on ``x[0]`` and returns ``(h.unsqueeze(0), h, c)``
(:func:`cell_layer`): the module is then nn.LSTMCell & co. or rnnkern's cells.

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
onnxruntime ONNX Runtime torch.nn's module (the case's weights, float32) exported to ONNX
                         (:func:`onnx_model`) and run by an onnxruntime InferenceSession on
                         the CPU; forward only.
openvino    OpenVINO     the same ONNX model compiled by OpenVINO for "CPU" in float32
                         (INFERENCE_PRECISION_HINT f32); forward only.
==========  ===========  ==================================================================

The two inference engines ("peers", ``pip install rnnkern[peers]``) run the
forward phase only; their training phase is listed as not run.
"""
from __future__ import annotations

import importlib
import io
import warnings
from dataclasses import dataclass, field
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

#: cell -> (torch.nn cell class, rnnkern cell class, constructor keywords)
CELL_MODULES = {
    "lstm": (nn.LSTMCell, rnnkern.LSTMCell, {}),
    "gru": (nn.GRUCell, rnnkern.GRUCell, {}),
    "rnn_tanh": (nn.RNNCell, rnnkern.RNNCell, {"nonlinearity": "tanh"}),
    "rnn_relu": (nn.RNNCell, rnnkern.RNNCell, {"nonlinearity": "relu"}),
}
PHASES = ("forward", "forward_backward")

#: FlashRNN JIT-compiles a CUDA kernel per (cell, hidden size, batch, dtype), one to
#: two minutes each, so by default it runs at the headline size only.
FLASHRNN_FAMILIES = ("headline",)


@dataclass
class Built:
    layer: Layer
    params: list  # weight_ih, weight_hh, bias_ih, bias_hh
    #: what the candidate runs with, as the engine reports it back (the peers'
    #: session options / compiled-model properties); copied into the JSON as "engine"
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Candidate:
    name: str
    label: str
    #: None when it can run on this device, else why not
    unavailable: Callable[[torch.device], Optional[str]]
    #: None when it runs this case, else why not
    skip: Callable[[Case, torch.device, dict], Optional[str]]
    build: Callable[[Case, nn.Module, torch.device], Built]
    #: the phases it runs; the others are listed as not run, with ``phase_note``
    phases: tuple = PHASES
    phase_note: str = ""


def torch_module(cell: str, I: int, H: int, seed: int) -> nn.Module:
    """The case's weights: a torch.nn module with torch's own initialisation, float64, CPU."""
    torch_cls, _, kw = MODULES[cell]
    torch.manual_seed(seed)
    return torch_cls(I, H, **kw).double()


def copy_module(cls, src: nn.Module, case: Case, device: torch.device, dtype, **extra) -> nn.Module:
    """``cls`` (a layer or a cell class) with the weights of ``src`` (a one-layer
    torch.nn layer: a cell takes its ``*_l0`` weights)."""
    kw = MODULES[case.cell][2]
    m = cls(case.I, case.H, **kw, **extra).to(device=device, dtype=dtype)
    state = src.state_dict()
    if isinstance(m, nn.RNNCellBase):
        state = {k.removesuffix("_l0"): v for k, v in state.items()}
    m.load_state_dict(state)
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


def cell_layer(m: nn.Module, lstm: bool) -> Built:
    """A cell behind the layer convention: x [1, B, I] -> the cell on x[0] ->
    (h.unsqueeze(0), h, c)."""
    def layer(x, h0, c0):
        if lstm:
            h, c = m(x[0], (h0, c0))
            return h.unsqueeze(0), h, c
        h = m(x[0], h0)
        return h.unsqueeze(0), h, None

    params = [m.weight_ih, m.weight_hh, m.bias_ih, m.bias_hh]
    return Built(layer, params)


def case_module(which: int, src: nn.Module, case: Case, device, dtype, **extra) -> Built:
    """The case's module (``which``: 0 torch.nn, 1 rnnkern) as a layer: the
    sequence module, or for a cell call the cell."""
    lstm = case.cell == "lstm"
    if case.call == "cell":
        m = copy_module(CELL_MODULES[case.cell][which], src, case, device, dtype, **extra)
        return cell_layer(m, lstm)
    return module_layer(copy_module(MODULES[case.cell][which], src, case, device, dtype, **extra), lstm)


def _no_skip(case, device, options):
    return None


def _always(device):
    return None


# ------------------------------------------------------------ torch.nn ----

def _build_torch(case, src, device):
    return case_module(0, src, case, device, case.torch_dtype)


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
        return case_module(1, src, case, device, case.torch_dtype, backend=backend)
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


# ---------------------------------------------------- inference engines ----
#
# What a user who serves a recurrent model on the CPU would pick instead of torch:
# the case's torch.nn module exported to ONNX, run by ONNX Runtime or OpenVINO.
# Forward only (they do not train), float32 only, CPU only.

#: The ONNX opset of the export.  ONNX's LSTM, GRU and RNN operators last changed in
#: opset 14; every ONNX Runtime and OpenVINO release of recent years reads opset 17.
ONNX_OPSET = 17
PEERS = ("onnxruntime", "openvino")
PEER_INSTALL = "pip install 'rnnkern[peers]'"
PEER_PHASE_NOTE = "inference engine: forward only"
#: How the case's module is exported (recorded in the JSON).
ONNX_EXPORT = {
    "exporter": "torch.onnx.export(dynamo=False) (TorchScript-based)",
    "why": ("gives ONNX's own LSTM / GRU / RNN operator for a sequence call, as rnnkern's "
            "modules export (tests/test_export.py); the dynamo exporter unrolls nn.RNN "
            "over T and takes 5-25 s per export"),
    "opset": ONNX_OPSET,
    "shapes": "static: each case is exported at its own [T, B, I] (the engines may specialise)",
    "inputs": "x [T, B, I], h0 [B, H] (and c0 [B, H] for LSTM), float32",
    "outputs": "output [T, B, H], h_n [B, H] (and c_n)",
    "cell_calls": "the cell on x[0] (Gemm + pointwise ops), output = h unsqueezed",
    "weights": "the case's torch.nn module in float32 (the same weights as every candidate)",
}
#: OpenVINO's compile configuration; INFERENCE_NUM_THREADS is set per run (the run's
#: threads).  f32: on a CPU with AVX-512 BF16 or AMX, OpenVINO otherwise runs in
#: bfloat16 by default.  No thread pinning, as no other candidate pins.
OPENVINO_HINTS = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY",
                  "ENABLE_CPU_PINNING": False}
#: The compiled model's properties read back into the JSON.
OPENVINO_READBACK = ("INFERENCE_NUM_THREADS", "INFERENCE_PRECISION_HINT", "PERFORMANCE_HINT",
                     "NUM_STREAMS", "ENABLE_CPU_PINNING", "EXECUTION_MODE_HINT")


def onnx_names(cell: str) -> tuple[list, list]:
    """Input and output names of the exported model."""
    if cell == "lstm":
        return ["x", "h0", "c0"], ["output", "h_n", "c_n"]
    return ["x", "h0"], ["output", "h_n"]


class _Exported(nn.Module):
    """The case's torch.nn module behind the layer convention, for the exporter."""

    def __init__(self, module: nn.Module, case: Case):
        super().__init__()
        self.module = module
        self.cell_call = case.call == "cell"
        self.lstm = case.cell == "lstm"

    def forward(self, x, h0, c0=None):
        built = (cell_layer if self.cell_call else module_layer)(self.module, self.lstm)
        out, h, c = built.layer(x, h0, c0)
        return (out, h, c) if self.lstm else (out, h)


#: (case, weights, ONNX bytes) of the last export: both engines build from the same
#: bytes, so a case is exported once.  The weights module is held, so an identity
#: test cannot be fooled by a recycled id.
_LAST_EXPORT: Optional[tuple] = None


def onnx_model(case: Case, src: nn.Module) -> bytes:
    """The case's torch.nn module (``src``'s weights, float32, sequence or cell call)
    exported to ONNX at the case's shapes (see ONNX_EXPORT); cached per case."""
    global _LAST_EXPORT
    if _LAST_EXPORT is not None and _LAST_EXPORT[0] == case and _LAST_EXPORT[1] is src:
        return _LAST_EXPORT[2]
    cls = (CELL_MODULES if case.call == "cell" else MODULES)[case.cell][0]
    module = _Exported(copy_module(cls, src, case, torch.device("cpu"), torch.float32), case).eval()
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(case.T, case.B, case.I, generator=g), torch.randn(case.B, case.H, generator=g)]
    if case.cell == "lstm":
        args.append(torch.randn(case.B, case.H, generator=g))
    inputs, outputs = onnx_names(case.cell)
    f = io.BytesIO()
    with warnings.catch_warnings():
        # The TorchScript exporter's deprecation warning would repeat for every case;
        # bench/README.md ("The inference engines") says which exporter runs and why.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        # Its advice for LSTMs exported at a batch size other than 1 is to make h0 and
        # c0 inputs of the model, which they are.
        warnings.filterwarnings("ignore", message="Exporting a model to ONNX with a batch_size other than 1")
        # The trace is taken at the case's shapes on purpose (static shapes).
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(module, tuple(args), f, dynamo=False, opset_version=ONNX_OPSET,
                          input_names=inputs, output_names=outputs, do_constant_folding=True)
    _LAST_EXPORT = (case, src, f.getvalue())
    return _LAST_EXPORT[2]


def _peer_unavailable(package: str):
    def check(device):
        if device.type != "cpu":
            return f"{package} runs here on the CPU only"
        try:
            importlib.import_module(package)
        except ModuleNotFoundError:
            return f"the {package} package is not installed: {PEER_INSTALL}"
        except Exception as e:  # a broken install failing at import
            return f"the {package} package does not import ({type(e).__name__}: {e}): {PEER_INSTALL}"
        return None
    return check


def _peer_skip(case, device, options):
    if case.dtype != "float32":
        return f"an inference engine, timed in float32 only (not {case.dtype})"
    return None


def _numpy_inputs(x, h0, c0):
    """The inputs as numpy arrays sharing the tensors' memory (no copies)."""
    return [t.numpy() for t in ((x, h0) if c0 is None else (x, h0, c0))]


def ort_session(onnx_bytes: bytes, threads: int):
    """An onnxruntime CPU session: ``threads`` intra-op threads, one inter-op
    thread, the default graph optimisations (ORT_ENABLE_ALL)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(onnx_bytes, options, providers=["CPUExecutionProvider"])


def onnxruntime_layer(session, lstm: bool) -> Layer:
    """``session.run`` on numpy views of the inputs; the outputs (fresh arrays each
    call, owned by the caller) as torch tensors without a copy."""
    names = onnx_names("lstm" if lstm else "gru")[0]

    def layer(x, h0, c0):
        outs = session.run(None, dict(zip(names, _numpy_inputs(x, h0, c0))))
        return (torch.from_numpy(outs[0]), torch.from_numpy(outs[1]),
                torch.from_numpy(outs[2]) if lstm else None)

    return layer


def _build_onnxruntime(case, src, device):
    import onnxruntime as ort

    session = ort_session(onnx_model(case, src), torch.get_num_threads())
    opts = session.get_session_options()
    info = {"version": ort.__version__, "providers": session.get_providers(),
            "intra_op_num_threads": opts.intra_op_num_threads,
            "inter_op_num_threads": opts.inter_op_num_threads,
            "graph_optimization_level": str(opts.graph_optimization_level).split(".")[-1],
            "execution_mode": str(opts.execution_mode).split(".")[-1],
            "call": "InferenceSession.run(None, {name: tensor.numpy()}), outputs torch.from_numpy"}
    return Built(onnxruntime_layer(session, case.cell == "lstm"), [], info)


_OV_CORE = None


def openvino_compiled(onnx_bytes: bytes, threads: int):
    """The ONNX model compiled by OpenVINO for "CPU" with ``threads`` inference
    threads and OPENVINO_HINTS (float32).  Returns (model, compiled model)."""
    global _OV_CORE
    import numpy as np
    import openvino as ov

    if _OV_CORE is None:
        _OV_CORE = ov.Core()
    model = _OV_CORE.read_model(onnx_bytes, ov.Tensor(np.empty(0, dtype=np.uint8)))
    config = dict(OPENVINO_HINTS, INFERENCE_NUM_THREADS=threads)
    return model, _OV_CORE.compile_model(model, "CPU", config)


def openvino_layer(compiled, lstm: bool) -> Layer:
    """One infer request: the inputs bound as OpenVINO tensors sharing the torch
    tensors' memory, ``infer()``, the outputs copied out of the request's buffers
    (the caller owns them, as with every other candidate).  The fastest of the
    documented Python paths measured here: ``request.infer(inputs)`` and
    ``compiled(inputs)`` cost about 15 us more per call."""
    import openvino as ov

    ins, outs = onnx_names("lstm" if lstm else "gru")
    got = [p.get_any_name() for p in compiled.inputs]
    if got != ins:
        raise RuntimeError(f"OpenVINO's inputs are {got}, expected {ins}")
    request = compiled.create_infer_request()
    n_out = len(outs)

    def layer(x, h0, c0):
        for i, a in enumerate(_numpy_inputs(x, h0, c0)):
            request.set_input_tensor(i, ov.Tensor(a, shared_memory=True))
        request.infer()
        res = [torch.from_numpy(request.get_output_tensor(i).data.copy()) for i in range(n_out)]
        return res[0], res[1], res[2] if lstm else None

    return layer


def _json_value(v):
    """An OpenVINO property as JSON: element types by their short name ("f32")."""
    if isinstance(v, (bool, int, float, str)):
        return v
    return v.to_string() if hasattr(v, "to_string") else str(v)


def _build_openvino(case, src, device):
    import openvino as ov

    model, compiled = openvino_compiled(onnx_model(case, src), torch.get_num_threads())
    info = {"version": ov.get_version(), "device": "CPU",
            "config": dict(OPENVINO_HINTS, INFERENCE_NUM_THREADS=torch.get_num_threads()),
            "properties": {k: _json_value(compiled.get_property(k)) for k in OPENVINO_READBACK},
            "ops": sorted({op.get_type_name() for op in model.get_ordered_ops()}),
            "runtime_layers": sorted({op.get_rt_info()["layerType"].astype(str)
                                      for op in compiled.get_runtime_model().get_ordered_ops()}),
            "call": "set_input_tensor(Tensor(tensor.numpy(), shared_memory=True)); infer(); "
                    "outputs copied, torch.from_numpy"}
    return Built(openvino_layer(compiled, case.cell == "lstm"), [], info)


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
    "onnxruntime": Candidate("onnxruntime", "ONNX Runtime", _peer_unavailable("onnxruntime"), _peer_skip,
                             _build_onnxruntime, ("forward",), PEER_PHASE_NOTE),
    "openvino": Candidate("openvino", "OpenVINO", _peer_unavailable("openvino"), _peer_skip,
                          _build_openvino, ("forward",), PEER_PHASE_NOTE),
}
BASELINE = "torch"
RNNKERN_BACKENDS = ("cpu", "cuda", "triton")

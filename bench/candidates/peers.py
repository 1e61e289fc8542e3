"""The CPU inference engines ("peers", ``pip install rnnkern[peers]``): the
case's torch.nn module exported to ONNX, run by ONNX Runtime or OpenVINO.

What a user who serves a recurrent model on the CPU would pick instead of torch.
Forward only (they do not train), float32 only, CPU only.
"""
from __future__ import annotations

import importlib
import io
import warnings
from typing import Optional

import torch
import torch.nn as nn

from ..grid import Case
from .common import CELL_MODULES, MODULES, Built, Layer, cell_layer, copy_module, module_layer

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

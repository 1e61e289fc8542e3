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
persistent  rnnkern-persistent  backend="cuda" with the persistent kernels taking every
                         layer they fit (csrc/cuda/persistent.cuh, mode "always"; the
                         cuda candidate runs the default "auto": small batches only);
                         forward only: the backward runs after the layer call returns.
                         Both phases: RNNKERN_CUDA_PERSISTENT=always for the whole run
                         (then the "cuda" candidate is the persistent one;
                         RNNKERN_CUDA_PERSISTENT=never: the host loop)
triton      rnnkern-triton  rnnkern's module with backend="triton"
auto        rnnkern-auto rnnkern's module with backend="auto": what a user gets by default,
                         torch.nn's forward or rnnkern's kernels as rnnkern/auto.py chooses
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

The package, one family a module: common.py (the convention and the record),
modules.py (torch.nn, rnnkern), loop.py (the vanilla loop), flashrnn.py
(FlashRNN), peers.py (ONNX Runtime, OpenVINO).
"""
from __future__ import annotations

from .common import Built, Candidate, _always, _no_skip, copy_module, torch_module
from .flashrnn import FLASHRNN_FAMILIES, _build_flashrnn, _flashrnn_skip, _flashrnn_unavailable
from .loop import LOOP_MAX_T, _build_compile, _build_reference, _skip_long_loops
from .modules import _build_persistent, _build_rnnkern, _build_torch, _rnnkern_unavailable
from .peers import (ONNX_EXPORT, OPENVINO_HINTS, PEER_INSTALL, PEER_PHASE_NOTE, PEERS, _build_onnxruntime,
                    _build_openvino, _peer_skip, _peer_unavailable, onnx_model)

__all__ = ["CANDIDATES", "BASELINE", "Built", "Candidate", "copy_module", "torch_module", "FLASHRNN_FAMILIES",
           "LOOP_MAX_T", "ONNX_EXPORT", "OPENVINO_HINTS", "PEER_INSTALL", "PEERS", "onnx_model"]

CANDIDATES = {
    "torch": Candidate("torch", "torch.nn", _always, _no_skip, _build_torch),
    "cpu": Candidate("cpu", "rnnkern-cpu", _rnnkern_unavailable("cpu"), _no_skip, _build_rnnkern("cpu")),
    "cuda": Candidate("cuda", "rnnkern-cuda", _rnnkern_unavailable("cuda"), _no_skip, _build_rnnkern("cuda")),
    "persistent": Candidate("persistent", "rnnkern-persistent", _rnnkern_unavailable("cuda"), _no_skip,
                            _build_persistent, ("forward",),
                            "forward only: its backward runs outside the layer call (time both phases "
                            "with RNNKERN_CUDA_PERSISTENT=always and the cuda candidate)"),
    "triton": Candidate("triton", "rnnkern-triton", _rnnkern_unavailable("triton"), _no_skip,
                        _build_rnnkern("triton")),
    "auto": Candidate("auto", "rnnkern-auto", _always, _no_skip, _build_rnnkern("auto")),
    "reference": Candidate("reference", "loop", _always, _skip_long_loops, _build_reference),
    "compile": Candidate("compile", "loop+compile", _always, _skip_long_loops, _build_compile),
    "flashrnn": Candidate("flashrnn", "FlashRNN", _flashrnn_unavailable, _flashrnn_skip, _build_flashrnn),
    "onnxruntime": Candidate("onnxruntime", "ONNX Runtime", _peer_unavailable("onnxruntime"), _peer_skip,
                             _build_onnxruntime, ("forward",), PEER_PHASE_NOTE),
    "openvino": Candidate("openvino", "OpenVINO", _peer_unavailable("openvino"), _peer_skip,
                          _build_openvino, ("forward",), PEER_PHASE_NOTE),
}
BASELINE = "torch"

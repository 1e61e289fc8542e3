"""torch.nn (the baseline) and rnnkern's modules with each backend: the case's
module (or cell) with the case's weights."""
from __future__ import annotations

import importlib

import rnnkern

from .common import case_module

def _build_torch(case, src, device):
    return case_module(0, src, case, device, case.torch_dtype)


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


def _build_persistent(case, src, device):
    """backend="cuda" with the persistent kernels taking every layer they fit for
    this layer's calls (rnnkern.ops.set_cuda_persistent("always"); the layers they
    do not take run the host loop)."""
    built = case_module(1, src, case, device, case.torch_dtype, backend="cuda")
    inner = built.layer

    def layer(*args):
        before = rnnkern.ops.cuda_persistent()
        rnnkern.ops.set_cuda_persistent("always")
        try:
            return inner(*args)
        finally:
            rnnkern.ops.set_cuda_persistent(before)
    built.layer = layer
    return built

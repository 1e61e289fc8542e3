"""The vanilla loop: the input projection as one GEMM, then a Python loop over
rnnkern.reference.cell_from_projections, eager or with the step torch.compile'd."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rnnkern import reference

from .common import MODULES, Built, Layer, copy_module

#: The Python loops run a few kernels per step: beyond this many steps they only
#: repeat what the shorter sequences show (their time grows linearly in T), at a
#: cost that would dominate the run.
LOOP_MAX_T = {"cpu": 2048, "cuda": 4096}


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

"""Compiles the Triton kernels for an NVIDIA GPU target on a machine without one.

The interpreter runs the kernels' logic on the CPU, but not Triton's GPU
compiler (layouts, tl.dot lowering, dtype rules).  This runs the whole
pipeline (TTIR, TTGIR, LLVM, PTX, ptxas to a cubin) for a chosen architecture,
so a kernel that would not build on a GPU fails here first.  It needs Triton's
bundled ptxas and TRITON_INTERPRET unset:

    python -m rnnkern.triton.aot                     # a quick subset, sm_90, float16
    python -m rnnkern.triton.aot --all --arch 80     # every cell and dtype

Each line gives the kernel, its dynamic shared memory and the compile time.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..reference import CELLS, gate_count, workspace_width
from . import sequence, step
from .cells import CELL_IDS

_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
       torch.float64: tl.float64}
# Pointer arguments that hold accumulate-dtype buffers (workspace, states, gradients).
_ACC_BUFFERS = {"p_ws", "p_aux", "p_aux_all", "p_dx", "p_da", "p_da_next", "p_dh", "p_dh_out",
                "p_dc", "p_dc_out", "p_dh_tot", "p_dh_tot_all", "p_h_next", "p_c_next"}


def compile_kernel(kernel, dtype: torch.dtype, constexprs: dict, arch: int, num_warps: int = 4):
    """Compiles an (autotuned) kernel for sm_<arch> with the given constexprs."""
    fn = kernel.fn  # the JITFunction under the Autotuner
    acc = "fp64" if dtype == torch.float64 else "fp32"
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "p_len":
            signature[name] = "*i64"
        elif name.startswith("p_"):
            signature[name] = "*" + (acc if name in _ACC_BUFFERS else _TYPE[dtype])
        else:
            signature[name] = "i32"
    src = ASTSource(fn, signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=2))


def jobs(cell: str, dtype: torch.dtype, H: int = 64):
    """(kernel, constexprs) of every kernel the ops launch for this cell, with
    every flag on (lengths, reverse, training, biases, the LSTM projection)."""
    proj = cell == "lstm"
    G, W = gate_count(cell), workspace_width(cell)
    base = dict(ACC=tl.float64 if dtype == torch.float64 else tl.float32, DOT=_TL[dtype])
    flags = dict(CELL=CELL_IDS[cell], G=G, WS=W * H, HAS_LENGTHS=True, REVERSE=True, **base)
    loop = dict(BLOCK_B=16, BLOCK_H=H, BLOCK_P=H // 2 if proj else H)
    tile = dict(BLOCK_B=32, BLOCK_H=32, BLOCK_K=32)
    out = [
        (sequence.forward_loop_kernel, dict(HAS_B_IH=True, HAS_B_HH=True, HAS_PROJ=proj,
                                            TRAIN=True, **flags, **loop)),
        (sequence.backward_loop_kernel, dict(HAS_PROJ=proj, **flags, **loop)),
        (step.gates_forward_kernel, dict(HAS_X=False, HAS_B_IH=True, HAS_B_HH=True, TRAIN=True,
                                         HAS_PROJ=proj, STORE_STATE=True, **flags, **tile)),
        (step.gates_forward_kernel, dict(HAS_X=True, HAS_B_IH=True, HAS_B_HH=True, TRAIN=True,
                                         HAS_PROJ=False, STORE_STATE=False,
                                         **{**flags, "HAS_LENGTHS": False, "REVERSE": False},
                                         **tile)),
        (step.gates_backward_kernel, dict(HAS_GOUT=True, HAS_NEXT=True, HAS_PROJ=proj, **flags,
                                          **tile)),
        (step.input_grad_kernel, dict(**base, **tile)),
    ]
    common = dict(HAS_LENGTHS=True, REVERSE=True, **base, **tile)
    if cell == "gru_reset_before":
        out += [(step.gru_rb_candidate_kernel, dict(HAS_B_HH=True, TRAIN=True, STORE_STATE=True,
                                                    **common)),
                (step.gru_rb_reset_kernel, dict(common))]
    if proj:
        out += [(step.projection_forward_kernel, dict(common)),
                (step.projection_backward_kernel, dict(HAS_NEXT=True, **common))]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="SM version, e.g. 80, 90")
    parser.add_argument("--all", action="store_true",
                        help="every cell in float32, float16, bfloat16 and float64")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    if args.all:
        cases = [(cell, dtype, None) for cell, dtype in itertools.product(
            CELLS, [torch.float32, torch.float16, torch.bfloat16, torch.float64])]
    else:  # every kernel once (the LSTM with projection has the most branches), a float64 tl.dot
        cases = [("lstm", torch.float16, None),
                 ("gru_reset_before", torch.bfloat16, {"gru_rb_candidate_kernel", "gru_rb_reset_kernel"}),
                 ("gru", torch.float64, {"forward_loop_kernel"})]
    failures = 0
    for cell, dtype, names in cases:
        for kernel, constexprs in jobs(cell, dtype):
            name = kernel.fn.__name__
            if names is not None and name not in names:
                continue
            start = time.time()
            try:
                compiled = compile_kernel(kernel, dtype, constexprs, args.arch)
                print(f"ok    sm_{args.arch} {cell:16s} {_TYPE[dtype]} {name:27s} "
                      f"shared {compiled.metadata.shared:6d} B  {time.time() - start:4.1f} s",
                      flush=True)
            except Exception as e:  # report every kernel, then fail
                failures += 1
                print(f"FAIL  sm_{args.arch} {cell:16s} {_TYPE[dtype]} {name:27s} "
                      f"{type(e).__name__}: {e}", flush=True)
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

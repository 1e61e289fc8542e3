"""Compiles the Triton kernels for an NVIDIA GPU target on a machine without one.

The interpreter runs the kernels' logic on the CPU, but not Triton's GPU
compiler (layouts, tl.dot lowering, dtype rules).  This runs the whole
pipeline (TTIR, TTGIR, LLVM, PTX, ptxas to a cubin) for a chosen architecture,
so a kernel that would not build on a GPU fails here first.  It needs Triton's
bundled ptxas and TRITON_INTERPRET unset:

    python -m rnnkern.triton.aot                     # a quick subset, sm_90, float16
    python -m rnnkern.triton.aot --all --arch 80     # every cell and dtype, with and
                                                     # without resets and zoneout
    python -m rnnkern.triton.aot --all --jobs 2      # the same, two processes at once

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

from ..reference import ALL_CELLS, gate_count, workspace_size
from . import sequence, spread, step
from .cells import CELL_IDS

_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
       torch.float64: tl.float64}
# Pointer arguments that hold accumulate-dtype buffers (workspace, states, gradients).
_ACC_BUFFERS = {"p_ws", "p_aux", "p_aux_all", "p_dx", "p_da", "p_da_next", "p_dh", "p_dh_out",
                "p_dc", "p_dc_out", "p_dh_tot", "p_dh_tot_all", "p_h_next", "p_c_next",
                "p_da_all", "p_dhr", "p_dhr_all", "p_dy_all", "p_dh0_in", "p_dh0_out",
                "p_dc0_in", "p_dc0_out", "p_xr", "p_hr", "p_tmp", "p_hs", "p_cs", "p_dhs",
                "p_das", "p_dcs", "p_dh0s", "p_dc0s", "p_dh_mid"}


def compile_kernel(kernel, dtype: torch.dtype, constexprs: dict, arch: int, num_warps: int = 4,
                   acc_args=()):
    """Compiles an (autotuned) kernel for sm_<arch> with the given constexprs;
    ``acc_args``: more pointer arguments that hold accumulate-dtype buffers in this use."""
    # the JITFunction (under the Autotuner, for the autotuned kernels)
    fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
    acc = "fp64" if dtype == torch.float64 else "fp32"
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "p_len":
            signature[name] = "*i64"
        elif name == "p_resets":
            signature[name] = "*i1"
        elif name == "p_count":
            signature[name] = "*i32"
        elif name.startswith("p_"):
            signature[name] = "*" + (acc if name in _ACC_BUFFERS or name in acc_args
                                     else _TYPE[dtype])
        else:
            signature[name] = "i32"
    src = ASTSource(fn, signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=2))


def barrier_problems(ptx: str) -> list:
    """What is wrong with a spread kernel's grid barrier in its PTX: the
    arrival must be a release atomic and the wait an acquire load (or atomic),
    both at GPU scope, and no load anywhere may take the non-coherent read-only
    path (``ld.global.nc``), which could serve another SM's rows stale."""
    import re
    problems = []
    if not re.search(r"atom\.global\.gpu\.(release|acq_rel)\.add", ptx):
        problems.append("no atom.global.gpu.release.add (the arrival)")
    if not re.search(r"(ld\.global\.gpu\.acquire|atom\.global\.gpu\.(acquire|acq_rel))", ptx):
        problems.append("no acquire load or atomic at GPU scope (the wait)")
    nc = re.findall(r"ld\.global(\.\w+)*\.nc", ptx)
    if nc:
        problems.append(f"{len(nc)} non-coherent loads (ld.global.nc)")
    return problems


def jobs(cell: str, dtype: torch.dtype, H: int = 64, options: bool = False):
    """(kernel, constexprs, acc_args) of every kernel the ops launch for this
    cell, with every flag on (lengths, reverse, training, biases, the LSTM
    projection), and resets and zoneout when ``options``."""
    proj = cell == "lstm"
    steps = dict(CELL_STEPS=cell == "lstm")  # every step's c (ops.cpp's cell_steps): lstm only
    G = gate_count(cell)
    base = dict(ACC=tl.float64 if dtype == torch.float64 else tl.float32, DOT=_TL[dtype])
    opts = dict(HAS_RESETS=options, HAS_ZONEOUT=options)
    flags = dict(CELL=CELL_IDS[cell], G=G, WS=workspace_size(cell, H, options), HAS_LENGTHS=True,
                 REVERSE=True, **opts, **base)
    single = dict(HAS_LENGTHS=False, REVERSE=False, HAS_RESETS=False, HAS_ZONEOUT=False)
    loop = dict(BLOCK_B=16, BLOCK_H=H, BLOCK_P=H // 2 if proj else H)
    tile = dict(BLOCK_B=32, BLOCK_H=32, BLOCK_K=32)
    rows = dict(BLOCK_B=4, BLOCK_H=128)
    out = [
        (sequence.forward_loop_kernel, dict(HAS_B_IH=True, HAS_B_HH=True, HAS_PROJ=proj,
                                            TRAIN=True, HAS_RESET_STATE=options, **steps,
                                            **flags, **loop)),
        (sequence.backward_loop_kernel, dict(HAS_PROJ=proj, HAS_RESET_STATE=options, **steps,
                                             **flags, **loop)),
    ]
    if cell == "lstm_ln":
        row_fwd = dict(WS=flags["WS"], HAS_B_IH=True, HAS_B_HH=True, TRAIN=True, ACC=base["ACC"],
                       BLOCK_B=rows["BLOCK_B"], BLOCK_H=rows["BLOCK_H"])
        row_bwd = dict(WS=flags["WS"], ACC=base["ACC"], **rows)
        out += [
            (step.ln_projections_kernel, dict(HAS_X=False, **base, **tile)),
            (step.ln_projections_kernel, dict(HAS_X=True, **base, **tile)),
            (step.lstm_ln_forward_kernel, dict(STORE_STATE=True, HAS_LENGTHS=True, REVERSE=True,
                                               **opts, **row_fwd)),
            (step.lstm_ln_forward_kernel, dict(STORE_STATE=False, **single, **row_fwd),
             {"p_xp"}),
            (step.lstm_ln_backward_kernel, dict(HAS_LENGTHS=True, REVERSE=True, **opts,
                                                **row_bwd)),
            (step.lstm_ln_backward_kernel, dict(**single, **row_bwd)),
        ]
    else:
        out += [
            (step.gates_forward_kernel, dict(HAS_X=False, HAS_B_IH=True, HAS_B_HH=True,
                                             TRAIN=True, HAS_PROJ=proj, STORE_STATE=True,
                                             **steps, **flags, **tile)),
            (step.gates_forward_kernel, dict(HAS_X=True, HAS_B_IH=True, HAS_B_HH=True,
                                             TRAIN=True, HAS_PROJ=False, STORE_STATE=False,
                                             CELL_STEPS=False,
                                             **{**flags, **single,
                                                "WS": workspace_size(cell, H)}, **tile)),
        ]
    out += [
        (step.gates_backward_kernel, dict(HAS_GOUT=True, HAS_NEXT=True, HAS_PROJ=proj, **steps,
                                          **flags, **tile)),
        (step.input_grad_kernel, dict(**base, **tile)),
    ]
    common = dict(HAS_LENGTHS=True, REVERSE=True, **base, **tile)
    if cell == "gru_reset_before":
        out += [(step.gru_rb_candidate_kernel, dict(HAS_B_HH=True, TRAIN=True, STORE_STATE=True,
                                                    **opts, **common)),
                (step.gru_rb_reset_kernel, dict(HAS_RESETS=options, **common))]
    if proj:
        out += [(step.projection_forward_kernel, dict(**opts, **common)),
                (step.projection_backward_kernel, dict(HAS_NEXT=True, **opts, **common))]
    if cell in spread.CELLS:
        DA = 2 if cell == "gru_reset_before" else G
        out += [(spread.forward_spread_kernel, dict(HAS_B_IH=True, HAS_B_HH=True, TRAIN=True,
                                                    HAS_PROJ=proj, **steps, **flags, **tile)),
                (spread.backward_spread_kernel, dict(HAS_PROJ=proj, DA=DA, **steps, **flags,
                                                     **tile))]
    return [job if len(job) == 3 else job + ((),) for job in out]


def _run_in_processes(cases, args) -> int:
    """Each case in a process of its own, ``args.jobs`` at a time: compiling is
    CPU-bound, and a compiler that aborts (an assertion inside Triton) fails its
    case instead of ending the run."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def run(case):
        cell, dtype, options, _ = case
        spec = f"{cell}:{_TYPE[dtype]}:{'options' if options else 'plain'}"
        done = subprocess.run([sys.executable, "-m", "rnnkern.triton.aot", "--arch", str(args.arch),
                               "--case", spec], capture_output=True, text=True)
        lines = [l for l in done.stdout.splitlines() if l.split(" ", 1)[0] in ("ok", "FAIL", "skip")]
        if done.returncode not in (0, 1):  # killed: by an abort inside the compiler, say
            lines.append(f"FAIL  sm_{args.arch} {spec}: the compiler process ended with "
                         f"{done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
        return lines

    failures = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for lines in pool.map(run, cases):
            for line in lines:
                print(line, flush=True)
                failures += line.startswith("FAIL")
    print(f"{failures} failures")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="SM version, e.g. 80, 90")
    parser.add_argument("--all", action="store_true",
                        help="every cell in float32, float16, bfloat16 and float64")
    parser.add_argument("--jobs", type=int, default=1,
                        help="with --all: compile the cases in this many processes at once")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # CELL:DTYPE:options|plain, one process
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    if args.all:
        cases = [(cell, dtype, options, None) for cell, dtype, options in itertools.product(
            ALL_CELLS, [torch.float32, torch.float16, torch.bfloat16, torch.float64],
            [False, True])]
    else:  # every kernel once (the LSTM with projection has the most branches), a float64
        # tl.dot, then every kernel with resets and zoneout (lstm_ln: all of its own)
        cases = [("lstm", torch.float16, False, None),
                 ("gru_reset_before", torch.bfloat16, False,
                  {"gru_rb_candidate_kernel", "gru_rb_reset_kernel", "forward_spread_kernel",
                   "backward_spread_kernel"}),
                 ("gru", torch.float64, False, {"forward_loop_kernel"}),
                 ("gru", torch.float32, False, {"forward_spread_kernel", "backward_spread_kernel"}),
                 ("lstm", torch.float16, True, None),
                 ("gru_reset_before", torch.bfloat16, True,
                  {"gru_rb_candidate_kernel", "gru_rb_reset_kernel", "forward_spread_kernel",
                   "backward_spread_kernel"}),
                 ("lstm_ln", torch.bfloat16, True, None)]
    if args.case:
        cell, dtype, options = args.case.split(":")
        cases = [(cell, {v: k for k, v in _TYPE.items()}[dtype], options == "options", None)]
    elif args.all and args.jobs > 1:
        return _run_in_processes(cases, args)
    failures = 0
    for cell, dtype, options, names in cases:
        label = f"{cell}{'+options' if options else '':8s}"
        for kernel, constexprs, acc_args in jobs(cell, dtype, options=options):
            name = kernel.fn.__name__
            if names is not None and name not in names:
                continue
            if "loop" in name and not sequence.loop_compiles(dtype, options):
                print(f"skip  sm_{args.arch} {label:24s} {_TYPE[dtype]} {name:27s} never launched "
                      "on a GPU (sequence.loop_compiles: the ops take the per-step kernels)",
                      flush=True)
                continue
            start = time.time()
            try:
                compiled = compile_kernel(kernel, dtype, constexprs, args.arch, acc_args=acc_args)
                checked = ""
                if "spread" in name:
                    problems = barrier_problems(compiled.asm["ptx"])
                    if problems:
                        raise RuntimeError("grid barrier: " + "; ".join(problems))
                    checked = "  barrier ok (release/acquire at gpu scope, no ld.global.nc)"
                print(f"ok    sm_{args.arch} {label:24s} {_TYPE[dtype]} {name:27s} "
                      f"shared {compiled.metadata.shared:6d} B  {time.time() - start:4.1f} s"
                      f"{checked}", flush=True)
            except Exception as e:  # report every kernel, then fail
                failures += 1
                print(f"FAIL  sm_{args.arch} {label:24s} {_TYPE[dtype]} {name:27s} "
                      f"{type(e).__name__}: {e}", flush=True)
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

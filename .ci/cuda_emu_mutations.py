"""Mutation check of the emulated CUDA device: plants one bug at a time in a copy
of the CUDA sources, rebuilds the emulated extension there and runs the
emulated tests, which must fail on every mutant (and pass on the real code).

Usage (repository root, in the venv, after the in-place build):
    python .ci/cuda_emu_mutations.py [--keep DIR] [--only SUBSTRING]
Prints one line per mutant with the first failure the tests report.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, file, original text, mutated text[, sanitizer]): each original must occur
# exactly once.  A mutant with a sanitizer runs the tests on a build under it (a
# read one row past the end changes no result: AddressSanitizer's to catch).
MUTANTS = [
    ("removed __syncthreads after staging the step tiles", "csrc/cuda/step.cuh",
     "      __syncthreads();\n      tile.chunk(As, Ws, tid);",
     "      tile.chunk(As, Ws, tid);"),
    ("bound check b < B -> b <= B in the step kernel's staging", "csrc/cuda/step.cuh",
     "if (b < B && kk < K) v = kk < I", "if (b <= B && kk < K) v = kk < I", "asan"),
    ("swapped cuBLAS transpose flag of B", "csrc/cuda/gemm.cpp",
     "const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;",
     "const cublasOperation_t op_b = trans_b ? CUBLAS_OP_N : CUBLAS_OP_T;"),
    ("skipped write of the LSTM step's c_new", "csrc/cuda/step.cuh",
     "    store_at(a.c_new, o, r.c);\n", ""),
    ("barrier under if (tid < 64)", "csrc/cuda/step.cuh",
     "    tile.store(Ps, tid);\n    __syncthreads();",
     "    tile.store(Ps, tid);\n    if (tid < 64) __syncthreads();"),
    # the step options (resets, zoneout) and the LayerNorm cell
    ("removed the barrier between the levels of the row reductions (LSTM-LN)", "csrc/cuda/common.cuh",
     "      }\n    }\n    __syncthreads();\n  }", "      }\n    }\n  }"),
    ("carried dh not restarted after a reset", "csrc/cuda/pointwise_backward.cuh",
     "        dh0_reset[b * P + k] += d;\n        return A(0);",
     "        dh0_reset[b * P + k] += d;\n        return d;"),
    ("LSTM's c blended with the mask of h", "csrc/cuda/pointwise_forward.cuh",
     "st.mask(p, b, P + j), c_prev, r.c)", "st.mask(p, b, j), c_prev, r.c)"),
    ("a reset restarts from h0, not from the reset state given", "csrc/cuda/pointwise_forward.cuh",
     "h_next[b * P + j] = reset_next(b) ? reset_h[b * P + j] : v;",
     "h_next[b * P + j] = reset_next(b) ? h0[b * P + j] : v;"),
    ("a reset step's previous state read from h0 in the backward", "csrc/cuda/pointwise_backward.cuh",
     "    h_start = step == 0 ? h0 : reset_h;", "    h_start = h0;"),
    # the persistent kernels (one cooperative grid, a grid barrier per step)
    ("persistent forward: grid barrier removed", "csrc/cuda/persistent.cuh",
     "(st, s + 1, b, j0, units);\n      cooperative_groups::this_grid().sync();",
     "(st, s + 1, b, j0, units);"),
    ("persistent backward: grid barrier removed", "csrc/cuda/persistent.cuh",
     "    cooperative_groups::this_grid().sync();\n  }\n  carry(da_even, live(0));",
     "  }\n  carry(da_even, live(0));"),
    ("persistent backward: da read from the buffer of the step being written", "csrc/cuda/persistent.cuh",
     "carry((s + 1) % 2 == 0 ? da_even : da_other, live(s + 1));",
     "carry(s % 2 == 0 ? da_even : da_other, live(s + 1));"),
    ("persistent forward: h staged from the slot being written", "csrc/cuda/persistent.cuh",
     "persistent_stage_and_multiply(sh, plan, st.h_prev, b0, np, outputs);",
     "persistent_stage_and_multiply(sh, plan, slots ? st.h_next : st.h_prev, b0, np, outputs);"),
    ("persistent staging: a 16-byte chunk stored at its chunk index, not its first element's",
     "csrc/cuda/persistent.cuh",
     "S* dst = x + r * ldx + c * V;", "S* dst = x + r * ldx + c;"),
    # rows staged in pieces of k where a tile of whole rows does not fit
    ("persistent pieces: a piece's products not added to the pieces' before",
     "csrc/cuda/persistent.cuh",
     "sh.part, nb, outputs, kn, plan.split,\n                        k0 > 0);",
     "sh.part, nb, outputs, kn, plan.split,\n                        false);"),
    ("persistent pieces: every piece multiplied by W's first columns", "csrc/cuda/persistent.cuh",
     "persistent_products(sh.w + k0, int(plan.ld)", "persistent_products(sh.w, int(plan.ld)"),
    ("persistent pieces: the next piece staged while the last one's products read x",
     "csrc/cuda/persistent.cuh",
     "    if (k0 > 0) __syncthreads();  // the last piece's products are done with x\n", ""),
    # their prefetch of the next step's rows (a hint: only the counts and ASan see it)
    ("persistent prefetch: the forward's rows one past those that run the next step",
     "csrc/cuda/persistent.cuh",
     "for (int64_t b = threadIdx.x; b < live; b += blockDim.x)",
     "for (int64_t b = threadIdx.x; b <= live; b += blockDim.x)", "asan"),
    ("persistent prefetch: the backward's previous position not asked for",
     "csrc/cuda/persistent.cuh",
     "if (q >= 0) prefetch_l2(st.ws + (q * B + b) * 5 * H + 4 * H + j0, a_bytes);", ""),
    # every step's c (the recurrence op's cell_steps)
    ("cell_steps: a step's c not written", "csrc/cuda/pointwise_forward.cuh",
     "  if (st.c_steps != nullptr) st.c_steps[(p * st.B + b) * H + j] = Storage<S>::store(c);\n",
     ""),
    ("cell_steps: a step's c gradient not added to the carry", "csrc/cuda/pointwise_backward.cuh",
     "(st.gc_steps != nullptr ? load_at<A>(st.gc_steps, row * H + j) : A(0))", "A(0)"),
]

SOURCES = ["csrc", "rnnkern", "tests", "setup.py", "pyproject.toml"]


def build(repo: str, mode: str = "1") -> None:
    env = dict(os.environ, RNNKERN_CUDA_EMULATION=mode, RNNKERN_CUDA_EMULATION_ONLY="1",
               MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--build-temp",
                    f"build-{mode}"], cwd=repo, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.STDOUT)


def gcc_file(name: str) -> str:
    return subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True,
                          check=True).stdout.strip()


def run_tests(repo: str, mode: str = "1") -> tuple[int, str]:
    env = dict(os.environ, RNNKERN_REQUIRE_CUDA_EMULATION="1", PYTHONPATH=repo, OMP_NUM_THREADS="1")
    report = os.path.join(repo, "sanitizer-report")
    if mode == "asan":
        env.update(LD_PRELOAD=f"{gcc_file('libasan.so')} {gcc_file('libstdc++.so')}",
                   ASAN_OPTIONS=f"detect_leaks=0:log_path={report}")
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/test_cuda_emulated.py",
                           "tests/test_cuda_emulated_persistent.py", "tests/test_backend_contract.py",
                           "tests/test_cell_steps.py",
                           "-k", "not (test_backend_contract or test_cell_steps) or cuda_emulated",
                           "-x", "-q", "-p", "no:cacheprovider"], cwd=repo, env=env, capture_output=True, text=True)
    for f in sorted(os.listdir(repo)):
        if f.startswith("sanitizer-report"):
            text = open(os.path.join(repo, f)).read()
            os.remove(os.path.join(repo, f))
            errors = [ln for ln in text.splitlines() if "ERROR:" in ln or ln.lstrip().startswith("#0 ")]
            if "SUMMARY:" in text:
                return proc.returncode or 1, " | ".join(errors[:2])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("E ", "FAILED"))]
    return proc.returncode, (lines[0] + " | " + lines[-1]) if lines else proc.stdout[-300:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="work in this directory and keep it")
    parser.add_argument("--only", default="", help="only the mutants whose name contains this")
    args = parser.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="rnnkern-mutants-")
    repo = os.path.join(work, "repo")
    shutil.rmtree(repo, ignore_errors=True)
    os.makedirs(repo)
    for name in SOURCES:
        src = os.path.join(ROOT, name)
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(repo, name))
    for f in os.listdir(os.path.join(repo, "rnnkern")):
        if f.startswith("_C_cuda_emu"):
            os.remove(os.path.join(repo, "rnnkern", f))
    build(repo)
    code, what = run_tests(repo)
    print(f"real code: {'passes' if code == 0 else 'FAILS: ' + what}", flush=True)
    missed = code != 0
    for name, path, old, new, *sanitizer in MUTANTS:
        if args.only not in name:
            continue
        mode = sanitizer[0] if sanitizer else "1"
        full = os.path.join(repo, path)
        text = open(full).read()
        assert text.count(old) == 1, f"{name}: the original text occurs {text.count(old)} times in {path}"
        open(full, "w").write(text.replace(old, new))
        try:
            build(repo, mode)
            code, what = run_tests(repo, mode)
        finally:
            open(full, "w").write(text)
        if mode != "1":
            name += f" (under {mode})"
        caught = code != 0
        missed |= not caught
        print(f"{'caught' if caught else 'MISSED'}: {name}: {what}", flush=True)
    if not args.keep:
        shutil.rmtree(work)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Everything a session with a lent GPU should run first, in one device call:
#
#     bash bench/gpu_check.sh OUTDIR              # on the GPU machine
#     bash bench/gpu_check.sh --rehearse OUTDIR   # on a machine without a GPU (CI)
#
# Stage plan, ordered by what a short GPU window must answer first.  "H100" is
# the time each stage took in the first run on an H100 (torch 2.11 / triton 3.6,
# cold caches: bench/results/gpu-h100-2026-11-26/check/summary.json); "cap" is
# its limit here (a stage also never runs past what is left of the budget).
#
#   stage        what                                                  H100   cap
#   build        pip install -e . (CPU + CUDA kernels for sm_90)         70   300
#   env          versions, device, ceilings (copy GB/s, bf16 TFLOP/s)     5    90
#   tests_cuda   pytest -m gpu tests/test_cuda.py                        49   200
#   memcheck     compute-sanitizer memcheck, bench/sanitizer_cases.py      9   120
#   bench        python -m bench --device cuda $BENCH_ARGS (CUDA         25   150
#                against cuDNN at the headline sizes, bf16, fp16)
#   racecheck    compute-sanitizer racecheck, float32 and bfloat16         9    90
#   tests_other  pytest -m gpu on the other test files (Triton...)      129   240
#   initcheck    compute-sanitizer initcheck, float32                      5   120
#   summary      summary.json, logs.tar.gz                               ~1   (15 kept)
#
# The tree that travels to the device must stay under 64 MiB; the tracked tree
# passed that on 2026-12-06 (75 MiB, 73 of them bench/results, which no stage
# reads).  Move bench/results aside for the device calls and back after (the
# seventh run's way; the bench JSON's meta.git then says "-dirty"):
#
#     mv bench/results /work/results_hold   # ...the device calls...   then back
#
# Budget: GPU_CHECK_BUDGET=540 s of a 600 s device call (60 s for starting the
# command and returning the files).  Measured: 70+5+49+9+25+9+95+5 = 267 s
# (273 s wall), so every stage fits with ~265 s to spare for a slower build or
# tests; the caps add up to 1310 s, so a stage that hangs costs at most its cap
# and the later ones get what is left (a stage with under 10 s left is skipped).
# The second run (2026-11-27, 300 s wall) found tests_other at 183 tests: with 4
# workers 159 ran in its former 120 s cap (Triton compiles every kernel from a
# cold cache), the 24 others took 130 s on 12 workers.  So tests_other now gets
# 240 s and, on a machine of 16 cores or more, 8 workers.
# Each stage is stopped with SIGINT at its limit (pytest then still writes its
# junit XML; SIGKILL 20 s later) and writes its results as it goes.
#
# What does not fit, as a second call on the same warm machine (the build and
# Triton's cache are still there; the Triton benchmark autotunes 4-6
# configurations per kernel from a cold cache: 8 of 45 headline/throughput
# cases in 150 s on the H100, so give it the whole call):
#
#     STAGES=bench GPU_CHECK_BUDGET=580 BENCH_CAP=560 BENCH_ARGS="--families headline throughput \
#       --dtypes bfloat16 float16 --backends cuda triton" bash bench/gpu_check.sh OUT2
#
# and, on a third call if time is left, the whole CUDA grid (85 s on the H100):
#
#     STAGES=bench GPU_CHECK_BUDGET=580 BENCH_CAP=560 BENCH_ARGS="--families latency throughput long \
#       headline --dtypes bfloat16 float16 float32 --backends cuda" bash bench/gpu_check.sh OUT3
#
# The persistent kernels (csrc/cuda/persistent.cuh; by default, mode "auto", up to the
# staged sizes in csrc/cuda/params.h's persistent_chosen; their GPU tests run in tests_cuda): the
# grid with them taking every layer they fit, then with the host loop only, both phases
# (compare case by case, each with cuDNN in its own file; the fifth session's pair:
# bench/results/gpu-h100-2026-11-27-session5, 80 s and 70 s for latency + headline;
# the sixth's on an H200, bench/results/gpu-h200-2026-12-04, 63 s and 65 s, and 61 s and
# 60 s for throughput + long):
#
#     RNNKERN_CUDA_PERSISTENT=always STAGES=bench GPU_CHECK_BUDGET=200 BENCH_CAP=190 BENCH_ARGS="--families \
#       latency headline --dtypes bfloat16 float16 float32 --backends cuda" bash bench/gpu_check.sh OUT4
#     RNNKERN_CUDA_PERSISTENT=never STAGES=bench GPU_CHECK_BUDGET=150 BENCH_CAP=140 BENCH_ARGS="--families \
#       latency headline --dtypes bfloat16 float16 float32 --backends cuda" bash bench/gpu_check.sh OUT5
#
# Their prefetch of the next step's cold rows (input projection; output gradient and
# workspace backward) into L2 before each grid barrier (persistent.cuh: persistent_prefetch,
# on by default, untimed when it landed): the OUT4 grid again with it off, case by case
# against OUT4:
#
#     RNNKERN_CUDA_PERSISTENT=always RNNKERN_CUDA_PREFETCH=0 STAGES=bench GPU_CHECK_BUDGET=200 \
#       BENCH_CAP=190 BENCH_ARGS="--families latency headline --dtypes bfloat16 float16 float32 \
#       --backends cuda" bash bench/gpu_check.sh OUT8
#
# Their rows staged in pieces of k (persistent.cuh: where W's slice and whole rows do not fit
# together, the LSTM's half-type backward from H ~ 900; untimed when it landed, the sixth run's
# "always" having run the host loop's backward there): the same pair on the LSTM's latency and
# throughput grids (B=64 H=1024 and B=256 H=1024 in pieces; B=1 H=256, B=16 H=768 and B=256
# H=512 in whole rows), the forward + backward less the forward in each:
#
#     RNNKERN_CUDA_PERSISTENT=always STAGES=bench GPU_CHECK_BUDGET=150 BENCH_CAP=140 BENCH_ARGS="--families \
#       latency throughput --cells lstm --dtypes bfloat16 float16 --backends cuda" bash bench/gpu_check.sh OUT9
#     RNNKERN_CUDA_PERSISTENT=never STAGES=bench GPU_CHECK_BUDGET=150 BENCH_CAP=140 BENCH_ARGS="--families \
#       latency throughput --cells lstm --dtypes bfloat16 float16 --backends cuda" bash bench/gpu_check.sh OUT10
#
# Triton's spread kernels (rnnkern/triton/spread.py: beyond the on-chip limit, the whole
# sequence in one launch with a grid barrier per step; not yet timed on a GPU), against the
# per-step path they replaced (each with cuDNN in its own file):
#
#     STAGES=bench GPU_CHECK_BUDGET=300 BENCH_CAP=290 BENCH_ARGS="--families headline \
#       --dtypes bfloat16 float16 --backends triton" bash bench/gpu_check.sh OUT6
#     RNNKERN_TRITON_PATH=step STAGES=bench GPU_CHECK_BUDGET=300 BENCH_CAP=290 BENCH_ARGS="--families \
#       headline --dtypes bfloat16 float16 --backends triton" bash bench/gpu_check.sh OUT7
#
# A stage that fails does not stop the others.  OUTDIR receives at most six
# files (the device tool returns eight): summary.json (versions, ceilings, each
# stage's exit code, time and result, pass counts, sanitizer and benchmark
# figures), gpu_check.log, junit_cuda.xml, junit_other.xml, bench_gpu.json and
# logs.tar.gz (every stage's full log, sanitizer reports, plots).
#
# --rehearse: every stage's real command on a machine without a GPU, the same
# files, summary.json with "rehearsal": true, so that CI keeps this script from
# rotting.  build runs pip install -e as above, or, when the extension is
# already built in place and newer than every source (CI: .ci/run built it),
# pip install -e --dry-run, which needs no recompile; env records device "none"
# and null ceilings; tests_cuda runs tests/test_cuda_emulated.py on the emulated
# device (result "no emulated device" if rnnkern._C_cuda_emu is not built);
# memcheck, racecheck, initcheck and bench record "no GPU" (memcheck runs
# bench/sanitizer_cases.py --emulated on float32 and bfloat16 if the emulated
# device is built, bench its real command, which must say that no CUDA device
# is visible); tests_other runs a bounded subset of tests/test_triton.py under
# TRITON_INTERPRET=1.  Exit 0 when every stage did what a rehearsal expects, 1
# otherwise (a stage broke, timed out or was skipped).  Measured on 2 CPU cores
# shared with other work (load average ~17; 126 s of CPU time in all): build
# 35 s (pip --dry-run), env 15, tests_cuda 161 (315 emulated tests), memcheck
# 26 (emulated cases), bench 17, tests_other 73 (20 Triton tests, interpreted):
# 355 s wall of the 540 s budget; on 2 idle cores an estimated 2-3 minutes.
#
# Knobs: STAGES (default build,env,tests,sanitizer,bench), PYTHON (default
# python3), MAX_JOBS (default: all cores), GPU_CHECK_BUDGET, XDIST_WORKERS
# (default 8 on 16 cores or more, else 4; 0 runs the tests in one process),
# BENCH_ARGS (see above), BENCH_CAP (the bench stage's cap, default 150 s: the
# budget alone does not lift it -- the third H100 session's second call stopped
# at 150 s with 6 of 12 cases),
# REHEARSE_CUDA_K and REHEARSE_TRITON_K (the rehearsal's -k expressions for
# tests/test_cuda_emulated.py and tests/test_triton.py: CI's test run has run them
# whole; the rehearsal checks that the stages' commands work),
# REHEARSE_SANITIZER_DTYPES (the dtypes of the rehearsal's emulated sanitizer
# cases, default float32,bfloat16; empty: none).
set -u
cd "$(dirname "$0")/.."

REHEARSE=0
if [[ "${1:-}" == "--rehearse" ]]; then
  REHEARSE=1
  shift
fi
OUT=${1:?usage: bench/gpu_check.sh [--rehearse] OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
PY=${PYTHON:-python3}
STAGES=${STAGES:-build,env,tests,sanitizer,bench}
BUDGET=${GPU_CHECK_BUDGET:-540}
START=$(date +%s)
DEADLINE=$((START + BUDGET))
RESERVE=15  # kept for the summary and packing
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # rnnkern importable even if pip install -e fails
LOG="$OUT/gpu_check.log"
: >"$LOG"
: >"$WORK/stages.tsv"

say() { echo "[gpu_check +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
wants() { [[ ",$STAGES," == *",$1,"* ]]; }
((REHEARSE)) && say "rehearsal: no GPU expected; every stage's command runs as far as a CPU machine allows"

# record NAME RESULT: a stage that did not run its command, with the reason.
record() {
  say "$1: $2"
  printf '%s\t-\t0\t0\t%s\n' "$1" "$2" >>"$WORK/stages.tsv"
}

# run_stage NAME CAP_SECONDS COMMAND...: runs COMMAND under a time limit (its
# cap or what is left of the budget), output to $WORK/NAME.log; records name,
# exit code, seconds, limit and result in stages.tsv.  124: timed out.
# RESULT_IF_OK, if set: the result of exit 0 instead of "ok".
# EXPECT_FAIL (a regex), if set: a non-zero exit whose log matches it is the
# expected result RESULT_IF_EXPECTED (the rehearsal's "no GPU").
run_stage() {
  local name=$1 cap=$2
  shift 2
  local left=$((DEADLINE - $(date +%s) - RESERVE))
  local limit=$((cap < left ? cap : left))
  if ((limit < 10)); then
    say "$name: skipped, no time left"
    printf '%s\tskipped\t0\t0\tskipped (no time left)\n' "$name" >>"$WORK/stages.tsv"
    return 0
  fi
  say "$name: start (limit ${limit}s)"
  local t0 rc result
  t0=$(date +%s)
  timeout -s INT --kill-after=20 "$limit" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  local secs=$(($(date +%s) - t0))
  if ((rc == 0)); then result=${RESULT_IF_OK:-ok}
  elif ((rc == 124 || rc == 137)); then result="timed out"
  elif [[ -n "${EXPECT_FAIL:-}" ]] && ! grep -q '^Traceback' "$WORK/$name.log" &&
       grep -Eq "$EXPECT_FAIL" "$WORK/$name.log"; then result=$RESULT_IF_EXPECTED
  else result=failed; fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$limit" "$result" >>"$WORK/stages.tsv"
  say "$name: exit $rc after ${secs}s: $result"
  tail -n 5 "$WORK/$name.log" | sed 's/^/    /' | tee -a "$LOG"
  return 0
}

# has_emulation: rnnkern._C_cuda_emu is built (the rehearsal's CUDA device), asked once.
has_emulation() {
  if [[ -z "${HAS_EMU:-}" ]]; then
    HAS_EMU=0
    "$PY" -c "import sys; from rnnkern import ops; sys.exit(0 if ops.WITH_CUDA_EMULATION else 1)" 2>/dev/null && HAS_EMU=1
  fi
  ((HAS_EMU))
}

# ------------------------------------------------------------------ build ----
build() {
  export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-$(nproc)}
  local pip=("$PY" -m pip install --no-build-isolation --no-deps -v -e .)
  if ((REHEARSE)) && "$PY" - <<'EOF'
# Built in place and newer than every source: exit 0 (the rehearsal then need not recompile).
import glob, os, sys
so = glob.glob("rnnkern/_C.*.so")
src = [f for f in glob.glob("csrc/**/*", recursive=True) if os.path.isfile(f)] + ["setup.py"]
sys.exit(0 if so and min(map(os.path.getmtime, so)) > max(map(os.path.getmtime, src)) else 1)
EOF
  then
    echo "rehearsal: rnnkern/_C is built in place and newer than every source: pip install -e" \
         "--dry-run (pip, setup.py and the package metadata; no recompile)"
    pip+=(--dry-run)
  fi
  "${pip[@]}" ||
    { echo "pip install -e failed; building in place with setup.py (PYTHONPATH has the tree)"
      "$PY" setup.py build_ext --inplace; } || return 1
  # The tree's rnnkern, the CUDA kernels in it (a rehearsal only reports them).
  "$PY" -c "import os, rnnkern; print('rnnkern', rnnkern.__file__, 'WITH_CUDA', rnnkern.ops.WITH_CUDA,
'emulated CUDA device', rnnkern.ops.WITH_CUDA_EMULATION)
assert os.path.realpath(rnnkern.__file__).startswith(os.path.realpath('.') + os.sep), 'not this tree'
assert rnnkern.ops.WITH_CUDA or os.environ.get('REHEARSE') == '1'"
}
if wants build; then
  export -f build
  export PY REHEARSE
  run_stage build 300 bash -c build
fi

# -------------------------------------------------------------------- env ----
cat >"$WORK/env.py" <<'EOF'
import json, platform, subprocess, sys, time
import torch

def run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as e:  # a missing tool is recorded, not fatal
        return f"unavailable: {e}"

def events_ms(fn, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps

info = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": sys.version.split()[0],
        "platform": platform.platform(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version()}
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
info["nvcc"] = run(["nvcc", "--version"]).splitlines()[-1:] or None
info["driver"] = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
info["git_commit"] = run(["git", "rev-parse", "HEAD"]) or None
if not torch.cuda.is_available():  # a rehearsal: recorded, no ceilings to measure
    info["device"], info["ceilings"] = "none", None
    json.dump(info, open(sys.argv[1], "w"), indent=2)
    print(json.dumps(info, indent=2))
    sys.exit(0)
p = torch.cuda.get_device_properties(0)
info["device"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                  "memory_gib": round(p.total_memory / 2**30, 1)}
# Ceilings: a 1 GiB device-to-device copy (bytes read + written), and an
# 8192^3 bf16 matrix product on random data; warm-up first, mean of the reps.
x = torch.randn(2**28, device="cuda")
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
ms = events_ms(lambda: y.copy_(x), 20)
copy_gbs = 2 * x.numel() * 4 / (ms * 1e-3) / 1e9
del x, y
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ b
ms = events_ms(lambda: a @ b, 10)
tflops = 2 * 8192**3 / (ms * 1e-3) / 1e12
info["ceilings"] = {"d2d_copy_GBps": round(copy_gbs, 1), "bf16_gemm_TFLOPs": round(tflops, 1)}
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info, indent=2))
EOF
if wants env; then
  run_stage env 90 "$PY" "$WORK/env.py" "$WORK/env.json"
fi

# ------------------------------------------------------------------ tests ----
if wants tests; then
  read -r has_xdist has_timeout < <("$PY" -c "import importlib.util as u
print(*(int(u.find_spec(m) is not None) for m in ('xdist', 'pytest_timeout')))" 2>/dev/null || echo 0 0)
  XDIST=()
  workers=${XDIST_WORKERS:-$(( $(nproc) >= 16 ? 8 : 4 ))}
  if ((workers > 0 && has_xdist)); then XDIST=(-n "$workers"); fi
  TIMEOUT=()
  if ((has_timeout)); then TIMEOUT=(--timeout=240); fi
  PYTEST=("$PY" -m pytest -p no:cacheprovider -q -rfE --durations=20 -o junit_family=xunit2
          --continue-on-collection-errors "${XDIST[@]}" "${TIMEOUT[@]}")
  if ((REHEARSE)); then
    # The CUDA kernels' code on the emulated device (its tests are not marked gpu).
    if has_emulation; then
      RNNKERN_REQUIRE_CUDA_EMULATION=1 run_stage tests_cuda 200 "${PYTEST[@]}" tests/test_cuda_emulated.py \
        -k "${REHEARSE_CUDA_K:-test_backend_is_listed or test_ops_match_cpu_backend or test_step_ops_match_cpu_backend}" \
        --junitxml="$OUT/junit_cuda.xml"
    else
      record tests_cuda "no emulated device (rnnkern._C_cuda_emu not built: RNNKERN_CUDA_EMULATION=1)"
    fi
  else
    run_stage tests_cuda 200 "${PYTEST[@]}" -m gpu tests/test_cuda.py --junitxml="$OUT/junit_cuda.xml"
  fi
fi

# -------------------------------------------------------------- sanitizer ----
# sanitize TOOL CAP ARGS...: compute-sanitizer TOOL on bench/sanitizer_cases.py
# ARGS; without a GPU (a rehearsal) the result "no GPU", without the tool
# "compute-sanitizer not found".
sanitize() {
  local tool=$1 cap=$2
  shift 2
  if ((REHEARSE)) && [[ "$tool" == memcheck && -n "${REHEARSE_SANITIZER_DTYPES-x}" ]] && has_emulation; then
    # No GPU, no compute-sanitizer: the cases themselves, once, on the emulated device.
    RESULT_IF_OK="no GPU" run_stage "$tool" "$cap" "$PY" bench/sanitizer_cases.py --emulated \
      --dtypes "${REHEARSE_SANITIZER_DTYPES:-float32,bfloat16}"
  elif ((REHEARSE)); then
    record "$tool" "no GPU"
  elif [[ -z "$SAN" ]]; then
    record "$tool" "compute-sanitizer not found"
  else
    local filter=()
    [[ "$tool" == racecheck ]] && filter=("${FILTER[@]}")
    # initcheck and memcheck: every tensor its own allocation, so an access past one's end is caught.
    if [[ "$tool" != racecheck ]]; then export PYTORCH_NO_CUDA_MEMORY_CACHING=1; fi
    run_stage "$tool" "$cap" "$SAN" --tool "$tool" --error-exitcode 99 --print-limit 100 "${filter[@]}" \
      "$PY" bench/sanitizer_cases.py "$@"
    unset PYTORCH_NO_CUDA_MEMORY_CACHING
  fi
}
if wants sanitizer; then
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -n 1)
  # Restrict racecheck's reports to rnnkern's kernels where the tool can
  # filter by kernel name.
  FILTER=()
  if [[ -n "$SAN" ]]; then
    if "$SAN" --help 2>&1 | grep -q -- '--kernel-name '; then FILTER=(--kernel-name kns=rnnkern)
    elif "$SAN" --help 2>&1 | grep -q -- '--filter'; then FILTER=(--filter kns=rnnkern); fi
  fi
  sanitize memcheck 120
fi

# ------------------------------------------------------------------ bench ----
cat >"$WORK/bench_fallback.py" <<'EOF'
"""rnnkern (backend="cuda") against torch.nn (cuDNN), same weights and inputs,
forward (no grad) and forward + backward; CUDA events, median of the reps."""
import json, statistics, sys
import torch
from torch import nn
import rnnkern

CONFIGS = [("B16-H768-T1024-bf16", 16, 768, 1024, torch.bfloat16),
           ("B16-H768-T1024-fp16", 16, 768, 1024, torch.float16),
           ("B256-H1024-T256-bf16", 256, 1024, 256, torch.bfloat16)]
CELLS = {"lstm": (nn.LSTM, rnnkern.LSTM, {}), "gru": (nn.GRU, rnnkern.GRU, {}),
         "rnn_tanh": (nn.RNN, rnnkern.RNN, {"nonlinearity": "tanh"})}

def median_ms(fn, warmup=2, reps=7):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)

rows = []
for label, B, H, T, dtype in CONFIGS:
    for cell, (theirs_cls, ours_cls, kw) in CELLS.items():
        torch.manual_seed(0)
        theirs = theirs_cls(H, H, **kw).to("cuda", dtype)
        ours = ours_cls(H, H, backend="cuda", **kw).to("cuda", dtype)
        ours.load_state_dict(theirs.state_dict())
        x = torch.randn(T, B, H, device="cuda", dtype=dtype)
        gy = torch.randn(T, B, H, device="cuda", dtype=dtype)
        with torch.no_grad():
            a, b = theirs(x)[0].float(), ours(x)[0].float()
        agree = ((a - b).norm() / a.norm()).item()
        row = {"config": label, "cell": cell, "B": B, "H": H, "T": T, "dtype": str(dtype),
               "rel_diff_output": agree}
        for mode in ("forward", "forward_backward"):
            for name, m in (("torch", theirs), ("rnnkern", ours)):
                params = list(m.parameters())
                if mode == "forward":
                    def fn(m=m):
                        with torch.no_grad():
                            m(x)
                else:
                    def fn(m=m, params=params):
                        xr = x.detach().requires_grad_()
                        torch.autograd.grad(m(xr)[0], [xr, *params], gy)
                row[f"{mode}_{name}_ms"] = median_ms(fn)
            row[f"{mode}_speedup"] = row[f"{mode}_torch_ms"] / row[f"{mode}_rnnkern_ms"]
            row[f"{mode}_rnnkern_us_per_step"] = 1e3 * row[f"{mode}_rnnkern_ms"] / T
        rows.append(row)
        print(f"{label:22s} {cell:9s} fwd {row['forward_torch_ms']:8.2f} / {row['forward_rnnkern_ms']:8.2f} ms "
              f"= {row['forward_speedup']:5.2f}x   fwd+bwd {row['forward_backward_torch_ms']:8.2f} / "
              f"{row['forward_backward_rnnkern_ms']:8.2f} ms = {row['forward_backward_speedup']:5.2f}x   "
              f"(rel diff {agree:.1e})", flush=True)
json.dump({"kind": "gpu_check fallback timing (speedup = torch.nn / rnnkern)",
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "results": rows}, open(sys.argv[1], "w"), indent=2)
EOF
if wants bench; then
  if "$PY" -m bench --help 2>&1 | grep -q -- '--device'; then
    # Plots and markdown go into logs.tar.gz: the device tool returns few files.
    # A rehearsal runs the same command: it must stop saying that no CUDA device is visible.
    read -r -a bench_args <<<"${BENCH_ARGS---families headline throughput --dtypes bfloat16 float16 --backends cuda}"
    EXPECT_FAIL=$( ((REHEARSE)) && echo 'no CUDA device' ) RESULT_IF_EXPECTED="no GPU" \
      run_stage bench "${BENCH_CAP:-150}" "$PY" -m bench --device cuda --no-progress "${bench_args[@]}" \
      --json "$OUT/bench_gpu.json" --markdown "$WORK/bench_gpu.md" --plots "$WORK/plots"
  elif ((REHEARSE)); then
    record bench "no GPU (python -m bench has no --device: the fallback timing would run)"
  else
    say "bench: python -m bench has no --device yet; running the fallback timing"
    run_stage bench 200 "$PY" "$WORK/bench_fallback.py" "$OUT/bench_gpu.json"
  fi
fi

# Then, while time is left: races, the Triton and other GPU tests, uninitialised reads.
if wants sanitizer; then
  sanitize racecheck 90 --dtypes float32,bfloat16
fi
if wants tests; then
  if ((REHEARSE)); then
    # The Triton kernels under Triton's interpreter: a bounded subset of tests/test_triton.py
    # (the whole file takes many minutes on a CPU; CI's main test run has the rest).
    TRITON_INTERPRET=1 run_stage tests_other 120 "${PYTEST[@]}" tests/test_triton.py \
      -k "${REHEARSE_TRITON_K:-test_step_matches_reference or test_cells_match_torch_nn_float32 or (test_recurrence_matches_reference_float64 and loop-plain)}" \
      --junitxml="$OUT/junit_other.xml"
  else
    run_stage tests_other 240 "${PYTEST[@]}" -m gpu tests --ignore=tests/test_cuda.py --junitxml="$OUT/junit_other.xml"
  fi
fi

# An extra check while time is left: reads of memory nothing wrote.
if wants sanitizer; then
  sanitize initcheck 120 --dtypes float32
fi

# ---------------------------------------------------------------- summary ----
cat >"$WORK/summary.py" <<'EOF'
import glob, json, os, re, sys, time
import xml.etree.ElementTree as ET

out, work, start, rehearsal = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1"
summary = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "wall_seconds": round(time.time() - start), "rehearsal": rehearsal}
env = os.path.join(work, "env.json")
summary["env"] = json.load(open(env)) if os.path.exists(env) else None
summary["stages"] = {}
for line in open(os.path.join(work, "stages.tsv")):
    name, rc, secs, limit, result = line.rstrip("\n").split("\t")
    summary["stages"][name] = {"exit": rc, "seconds": int(secs), "limit": int(limit),
                               "timed_out": result == "timed out", "result": result}
# A rehearsal expects each stage to run its command to the end (ok), or to
# record why it cannot without a GPU; a failure, a timeout or a skip is a break.
broken = [n for n, st in summary["stages"].items()
          if st["result"] in ("failed", "timed out") or st["result"].startswith("skipped")]
if rehearsal:
    summary["rehearsal_broken_stages"] = broken
tests = {}
for path in sorted(glob.glob(os.path.join(out, "junit_*.xml"))):
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        tests[os.path.basename(path)] = {"error": str(e)}
        continue
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    c = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    c["passed"] = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
    c["time_s"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    c["failed_ids"] = [f"{tc.get('classname')}::{tc.get('name')}" for s in suites for tc in s.iter("testcase")
                       if tc.find("failure") is not None or tc.find("error") is not None][:50]
    tests[os.path.basename(path)] = c
summary["tests"] = tests
san = {}
for tool in ("memcheck", "racecheck", "initcheck"):
    path = os.path.join(work, f"{tool}.log")
    if os.path.exists(path):
        text = open(path, errors="replace").read()
        m = re.search(r"ERROR SUMMARY: (\d+) error", text) or re.search(r"\((\d+) errors?,", text)
        wrong = re.search(r"sanitizer_cases: (\d+) wrong", text)
        san[tool] = {"errors": int(m.group(1)) if m else None,
                     "wrong_results": int(wrong.group(1)) if wrong else None,
                     "summary_line": next((l for l in text.splitlines() if "SUMMARY" in l), None)}
summary["sanitizer"] = san
bench = os.path.join(out, "bench_gpu.json")
if os.path.exists(bench):
    try:
        data = json.load(open(bench))
        rows = []
        for r in data.get("results", []):
            if "candidates" in r:  # python -m bench: one record per case and phase
                case = f"{r['cell']} B{r['B']} T{r['T']} H{r['H']} {r['dtype']}"
                for name, e in r["candidates"].items():
                    rows.append({"case": case, "phase": r["phase"], "candidate": name,
                                 "status": e.get("status"), "ms": e.get("median_ms"),
                                 "speedup_vs_torch": e.get("speedup_vs_torch")})
            else:  # the fallback timing
                rows.append({k: r[k] for k in ("config", "cell", "forward_speedup",
                                               "forward_backward_speedup") if k in r})
        summary["bench"] = rows
    except (ValueError, KeyError, TypeError) as e:
        summary["bench"] = {"unreadable": str(e)}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
print(json.dumps({k: summary[k] for k in ("stages", "tests", "sanitizer")}, indent=2))
if rehearsal:
    print("rehearsal: " + (f"broken stages: {', '.join(broken)}" if broken else "every stage did what it should"))
sys.exit(1 if rehearsal and broken else 0)
EOF
say "summary"
"$PY" "$WORK/summary.py" "$OUT" "$WORK" "$START" "$REHEARSE" >"$WORK/summary.log" 2>&1
status=$?
tee -a "$LOG" <"$WORK/summary.log"
((status == 0)) || say "summary: exit $status"
tar czf "$OUT/logs.tar.gz" -C "$WORK" . 2>/dev/null
say "done: $(ls "$OUT" | tr '\n' ' ')"
rm -rf "$WORK"
exit "$status"

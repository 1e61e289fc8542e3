#!/usr/bin/env bash
# Everything a session with a lent GPU should run, in one call:
#
#     bash bench/gpu_check.sh OUTDIR
#
# 1. build   the extension in place (pip install -e, CUDA kernels for sm_90)
# 2. env     device, driver, torch / CUDA / cuDNN / Triton versions, and the
#            two measured ceilings: device-to-device copy GB/s, bf16 GEMM TFLOP/s
# 3. tests   the GPU tests (pytest -m gpu): tests/test_cuda.py first, then the rest
# 4. sanitizer  compute-sanitizer memcheck and racecheck (then initcheck, if
#            time is left) on bench/sanitizer_cases.py: a small case of every kernel
# 5. bench   the GPU benchmark: python -m bench --device cuda $BENCH_ARGS (by
#            default the headline and throughput sizes only, bf16 and
#            fp16, so that it fits after the build and the tests; BENCH_ARGS=""
#            in a call of its own runs the suite's whole grid), or a small timing
#            of rnnkern against torch.nn/cuDNN where that CLI is not there
#
# A stage that fails does not stop the others.  The whole run keeps to a
# budget (GPU_CHECK_BUDGET seconds, default 540: a device call allows 600);
# each stage gets what is left, up to its own cap.  OUTDIR receives at most
# six files (the device tool returns eight): summary.json (versions, ceilings,
# pass counts, timings, date), gpu_check.log, junit_cuda.xml, junit_other.xml,
# bench_gpu.json and logs.tar.gz (every stage's full log, sanitizer reports, plots).
#
# Knobs: STAGES (default build,env,tests,sanitizer,bench), PYTHON (default
# python3), MAX_JOBS (default: all cores), GPU_CHECK_BUDGET, XDIST_WORKERS
# (default 4; 0 runs the tests in one process), BENCH_ARGS (see 5).
# A second call on a warm machine: STAGES=bench BENCH_ARGS="" GPU_CHECK_BUDGET=580.
set -u
cd "$(dirname "$0")/.."

OUT=${1:?usage: bench/gpu_check.sh OUTDIR}
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

# run_stage NAME CAP_SECONDS COMMAND...: runs COMMAND under a time limit (its
# cap or what is left of the budget), output to $WORK/NAME.log; records
# name, exit code, seconds and limit in stages.tsv.  124: timed out.
run_stage() {
  local name=$1 cap=$2
  shift 2
  local left=$((DEADLINE - $(date +%s) - RESERVE))
  local limit=$((cap < left ? cap : left))
  if ((limit < 10)); then
    say "$name: skipped, no time left"
    printf '%s\tskipped\t0\t0\n' "$name" >>"$WORK/stages.tsv"
    return 0
  fi
  say "$name: start (limit ${limit}s)"
  local t0 rc
  t0=$(date +%s)
  timeout -s INT --kill-after=20 "$limit" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  local secs=$(($(date +%s) - t0))
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$limit" >>"$WORK/stages.tsv"
  say "$name: exit $rc after ${secs}s$( ((rc == 124)) && echo ' (timed out)')"
  tail -n 5 "$WORK/$name.log" | sed 's/^/    /' | tee -a "$LOG"
  return 0
}

# ------------------------------------------------------------------ build ----
build() {
  export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-$(nproc)}
  "$PY" -m pip install --no-build-isolation --no-deps -v -e . ||
    { echo "pip install -e failed; building in place with setup.py"; "$PY" setup.py build_ext --inplace; } || return 1
  "$PY" -c "import rnnkern, torch; print('rnnkern', rnnkern.__file__, 'WITH_CUDA', rnnkern.ops.WITH_CUDA); assert rnnkern.ops.WITH_CUDA"
}
if wants build; then
  export -f build
  export PY
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
  XDIST=()
  workers=${XDIST_WORKERS:-4}
  if ((workers > 0)) && "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n "$workers"); fi
  TIMEOUT=()
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then TIMEOUT=(--timeout=240); fi
  PYTEST=("$PY" -m pytest -m gpu -p no:cacheprovider -q -rfE --durations=20 -o junit_family=xunit2
          --continue-on-collection-errors "${XDIST[@]}" "${TIMEOUT[@]}")
  run_stage tests_cuda 200 "${PYTEST[@]}" tests/test_cuda.py --junitxml="$OUT/junit_cuda.xml"
fi

# -------------------------------------------------------------- sanitizer ----
if wants sanitizer; then
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -n 1)
  if [[ -z "$SAN" ]]; then
    say "sanitizer: compute-sanitizer not found"
    printf 'memcheck\tmissing\t0\t0\n' >>"$WORK/stages.tsv"
  else
    # Restrict racecheck / initcheck reports to rnnkern's kernels where the
    # tool can filter by kernel name.
    FILTER=()
    if "$SAN" --help 2>&1 | grep -q -- '--kernel-name '; then FILTER=(--kernel-name kns=rnnkern)
    elif "$SAN" --help 2>&1 | grep -q -- '--filter'; then FILTER=(--filter kns=rnnkern); fi
    # Every tensor its own allocation, so an access past one's end is caught.
    export PYTORCH_NO_CUDA_MEMORY_CACHING=1
    run_stage memcheck 120 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 100 \
      "$PY" bench/sanitizer_cases.py
    unset PYTORCH_NO_CUDA_MEMORY_CACHING
  fi
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
    read -r -a bench_args <<<"${BENCH_ARGS---families headline throughput --dtypes bfloat16 float16 --backends cuda}"
    run_stage bench 150 "$PY" -m bench --device cuda --no-progress "${bench_args[@]}" \
      --json "$OUT/bench_gpu.json" --markdown "$WORK/bench_gpu.md" --plots "$WORK/plots"
  else
    say "bench: python -m bench has no --device yet; running the fallback timing"
    run_stage bench 200 "$PY" "$WORK/bench_fallback.py" "$OUT/bench_gpu.json"
  fi
fi

# Then, while time is left: races, the Triton and other GPU tests, uninitialised reads.
if wants sanitizer && [[ -n "${SAN:-}" ]]; then
  run_stage racecheck 90 "$SAN" --tool racecheck --error-exitcode 99 --print-limit 100 "${FILTER[@]}" \
    "$PY" bench/sanitizer_cases.py --dtypes float32,bfloat16
fi
if wants tests; then
  run_stage tests_other 120 "${PYTEST[@]}" tests --ignore=tests/test_cuda.py --junitxml="$OUT/junit_other.xml"
fi

# An extra check while time is left: reads of memory nothing wrote.
if wants sanitizer && [[ -n "${SAN:-}" ]]; then
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  run_stage initcheck 120 "$SAN" --tool initcheck --error-exitcode 99 --print-limit 100 \
    "$PY" bench/sanitizer_cases.py --dtypes float32
  unset PYTORCH_NO_CUDA_MEMORY_CACHING
fi

# ---------------------------------------------------------------- summary ----
cat >"$WORK/summary.py" <<'EOF'
import glob, json, os, re, sys, time
import xml.etree.ElementTree as ET

out, work, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
summary = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "wall_seconds": round(time.time() - start)}
env = os.path.join(work, "env.json")
summary["env"] = json.load(open(env)) if os.path.exists(env) else None
summary["stages"] = {}
for line in open(os.path.join(work, "stages.tsv")):
    name, rc, secs, limit = line.rstrip("\n").split("\t")
    summary["stages"][name] = {"exit": rc, "seconds": int(secs), "limit": int(limit),
                               "timed_out": rc == "124"}
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
EOF
say "summary"
"$PY" "$WORK/summary.py" "$OUT" "$WORK" "$START" 2>&1 | tee -a "$LOG"
tar czf "$OUT/logs.tar.gz" -C "$WORK" . 2>/dev/null
say "done: $(ls "$OUT" | tr '\n' ' ')"

#!/usr/bin/env bash
# The GPU image's versions, rehearsed on the CPU: torch 2.11.0 and triton 3.6.0,
# without expecttest (the image has none: the suite must collect without it).
# numpy < 2.4 here, because Triton 3.6's interpreter fails on every kernel with
# numpy >= 2.4 (the image's numpy 2.5 only meets Triton's compiler, on the GPU).
#
#   1. the CPU build against torch 2.11, pinned to the baseline ISA level x86-64
#      (RNNKERN_CPU_ISA): this is also CI's one build of the lowest level's code
#      (.ci/isa_levels.sh tests the levels in between), one CPU build fewer in CI;
#   2. the tests where a torch or Triton version shows: torch.compile, the torch.nn
#      contract file's collection without expecttest, and the backend contract
#      (gradcheck, opcheck) of the CPU kernels and of the Triton kernels under
#      Triton 3.6's interpreter; and the x86-64 level's tests: tests/test_cpu.py,
#      tests/test_cpu_bf16.py (the bf16 pairs' emulation), the backend contract's
#      cpu cases,
#   3. every Triton kernel compiled for sm_90 in every dtype, with and without
#      resets and zoneout (python -m rnnkern.triton.aot --all), as the GPU will.
#
# It builds a copy of the tracked tree, so the main environment's in-place
# build stays as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
ROOT=$PWD
VENV=$ROOT/.venv-2.11
TREE=$(mktemp -d)
trap 'rm -rf "$TREE"' EXIT
git ls-files -z | (cd "$ROOT" && xargs -0 cp --parents -t "$TREE")

if [[ ! -x "$VENV/bin/python" ]]; then python3 -m venv "$VENV"; fi
"$VENV/bin/python" -m pip install -q torch==2.11.0 triton==3.6.0 "numpy<2.4" "setuptools<82" \
  ninja pybind11 pytest pytest-xdist hypothesis
# --install-only: just the environment (.ci/run makes it in the background during the
# ISA-level tests); a later full run finds it ready.
if [[ "${1:-}" == --install-only ]]; then echo "== torch 2.11: installed at $((SECONDS - start)) s"; exit 0; fi
"$VENV/bin/python" -c "import importlib.util as u, torch, triton, numpy; \
print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__, \
'expecttest', u.find_spec('expecttest') is not None)"
echo "== torch 2.11: installed at $((SECONDS - start)) s"

cd "$TREE"
PATH="$VENV/bin:$PATH" RNNKERN_SKIP_CUDA=1 RNNKERN_CPU_ISA=x86-64 MAX_JOBS=${MAX_JOBS:-2} \
  "$VENV/bin/python" setup.py -q build_ext --inplace
echo "== torch 2.11: built (CPU kernels pinned to x86-64) at $((SECONDS - start)) s"

# test_cpu_isa_level_is_the_expected_one checks that the pinned build is the one tested.
RNNKERN_EXPECT_CPU_ISA=x86-64 "$VENV/bin/python" -m pytest -q -n auto -p no:cacheprovider \
  tests/test_compile.py tests/test_torch_contract.py tests/test_cpu.py tests/test_cpu_bf16.py \
  tests/test_backend_contract.py -k "not test_backend_contract or triton or cpu"
echo "== torch 2.11: tests done at $((SECONDS - start)) s"

env -u TRITON_INTERPRET "$VENV/bin/python" -m rnnkern.triton.aot --all --arch 90 --jobs "${MAX_JOBS:-2}"
echo "== torch 2.11: every Triton kernel compiled for sm_90 at $((SECONDS - start)) s"

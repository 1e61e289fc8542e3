#!/usr/bin/env bash
# The CPU kernels' vectorised loops are compiled for three x86 ISA levels and the
# fastest one this CPU has is picked at load time (csrc/cpu/isa.h), so the main
# test run only exercises that one.  This builds the CPU kernels once more pinned
# to each lower level (RNNKERN_CPU_ISA) and runs the CPU kernel tests on them:
# the baseline x86-64 everywhere, and x86-64-v3 (AVX2) on an AVX-512 machine.
# Usage: bash .ci/isa_levels.sh [LEVEL...]  (from the repository root, in the venv):
# the named levels that are below this CPU's (the main test run covers its own), by
# default x86-64 and x86-64-v3.  CI names x86-64-v3 only: its torch 2.11 stage
# (.ci/torch_2_11.sh) builds and tests x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."

order=(x86-64 x86-64-v2 x86-64-v3 x86-64-v4)
rank() { local i; for i in "${!order[@]}"; do [ "${order[$i]}" = "$1" ] && echo "$i" && return; done
         echo "unknown ISA level '$1': expected one of ${order[*]}" >&2; exit 2; }
picked=$(python -c "import rnnkern; print(rnnkern._C.cpu_isa())")
[ $# -gt 0 ] || set -- x86-64 x86-64-v3
below=$(rank "$picked") || exit 2
levels=()
for level in "$@"; do
    r=$(rank "$level") || exit 2
    if [ "$r" -lt "$below" ]; then levels+=("$level"); fi
done
echo "== this CPU's kernels run at $picked; testing the pinned levels: ${levels[*]:-none}"

for level in "${levels[@]+"${levels[@]}"}"; do
    out=build/isa-$level
    rm -rf "$out"
    mkdir -p "$out"
    RNNKERN_SKIP_CUDA=1 RNNKERN_CPU_ISA=$level MAX_JOBS=${MAX_JOBS:-2} \
        python setup.py -q build_ext --build-lib "$out" --build-temp "$out-obj" >"$out.log" 2>&1 \
        || { cat "$out.log"; exit 1; }
    # The Python package beside the pinned extension; pytest runs from there, so
    # `import rnnkern` finds it first (python -m puts the working directory ahead
    # of the editable install).
    (cd rnnkern && find . -name '*.py' -exec install -D -m 644 {} "../$out/rnnkern/{}" \;)
    echo "== ISA level $level: tests/test_cpu.py, tests/test_cpu_bf16.py (the bf16 pairs' emulation) and the cpu cases of tests/test_backend_contract.py"
    # Two workers (CI's machine has two cores; each worker imports the pinned build
    # from here, which test_cpu_isa_level_is_the_expected_one checks).
    (cd "$out" && RNNKERN_EXPECT_CPU_ISA=$level python -m pytest "$OLDPWD/tests/test_cpu.py" "$OLDPWD/tests/test_cpu_bf16.py" "$OLDPWD/tests/test_backend_contract.py" -k "not test_backend_contract or cpu" -q -p no:cacheprovider -n "${RNNKERN_ISA_WORKERS:-2}")
done

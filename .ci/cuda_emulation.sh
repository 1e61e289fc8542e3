#!/usr/bin/env bash
# The CUDA kernels, executed on the CPU by the emulated device (csrc/cuda_emu,
# tests/test_cuda_emulated.py), once more under the sanitizers:
#   asan  every emulated test but the gradchecks (the kernels and sizes of the
#         tests that compare outputs and every gradient with the reference,
#         test_options_match_reference_float64 and the like, launched many times
#         over: the LSTM-LN ones took half the stage), and three of auto's
#         bf16 bounds at thousands of rows (214 s, 57 s and 19 s of the stage's
#         491 s under ASan on a 2-core Xeon: the tanh RNN's exact bound,
#         B=4096, and the host loop one row past each; the LSTM's exact bound,
#         both phases persistent with their staging full, stays), AddressSanitizer +
#         UBSan (out-of-bounds reads and writes, use after free, undefined
#         behaviour), fiber switches annotated;
#   tsan  the kernels with barriers -- the step kernel (shared memory, WMMA),
#         the LSTM-LN row kernels (block reductions), the cooperative grid's
#         test kernel (blocks exchanging values across grid.sync(); its planted
#         faults, which race by design, are left out) and the persistent
#         recurrence kernels (119 of tests/test_cuda_emulated_persistent.py: every
#         cell and variant over uneven CTAs, every option, every order, the
#         tensor-core tiles, the steps that skip finished rows, the next step's
#         rows prefetched before the barrier (read by the emulator), rows staged in
#         pieces of k; the rest are the same launches at other sizes) -- in
#         every thread-resume order, ThreadSanitizer with one TSan fiber per
#         CUDA thread and the barriers as release/acquire (csrc/cuda_emu/runtime.cpp);
#         two workers, as ASan's (each worker preloads the runtime and writes its
#         own report: the cooperative test's planted races were reported by both;
#         93 s against 134 s in one process on a 2-core Xeon);
# The mutation check (python .ci/cuda_emu_mutations.py, ~20 minutes: twenty-two planted
# bugs, each caught) runs on demand, not in CI, to keep CI short.
# Zero sanitizer reports is the bar.  Each sanitized build is the emulated
# extension alone, beside a copy of the package in build/emu-<mode>.
# Usage: bash .ci/cuda_emulation.sh  (repository root, in the venv, after the
# in-place build of .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
preload_stdcxx=$(gcc -print-file-name=libstdc++.so)  # ASan/TSan intercept __cxa_throw: load it first

run_mode() {
    local mode=$1 runtime=$2 select=$3 workers=$4  # pytest-xdist workers (each its own report file)
    local out=$root/build/emu-$mode
    rm -rf "$out" "$out-obj" && mkdir -p "$out"
    cp -r rnnkern "$out/" && rm -f "$out"/rnnkern/_C_cuda_emu*.so
    RNNKERN_CUDA_EMULATION=$mode RNNKERN_CUDA_EMULATION_ONLY=1 MAX_JOBS=${MAX_JOBS:-2} \
        python setup.py -q build_ext --build-lib "$out" --build-temp "$out-obj" >"$out.log" 2>&1 \
        || { cat "$out.log"; exit 1; }
    echo "== emulated CUDA under $mode: tests/test_cuda_emulated{,_cooperative,_persistent}.py -k '$select'"
    local status=0
    (cd "$out" && LD_PRELOAD="$(gcc -print-file-name="$runtime") $preload_stdcxx" \
        OMP_NUM_THREADS=1 RNNKERN_REQUIRE_CUDA_EMULATION=1 \
        ASAN_OPTIONS="detect_leaks=0:log_path=$out/report" \
        UBSAN_OPTIONS="print_stacktrace=1:log_path=$out/report" \
        TSAN_OPTIONS="log_path=$out/report" \
        python -m pytest "$root/tests/test_cuda_emulated.py" "$root/tests/test_cuda_emulated_cooperative.py" \
            "$root/tests/test_cuda_emulated_persistent.py" -q -n "$workers" -p no:cacheprovider -k "$select") || status=$?
    # Every sanitizer report ends with a SUMMARY line (ASan's one-time notice
    # about swapcontext, which the fiber annotations address, is not a report).
    if compgen -G "$out/report*" >/dev/null && grep -q "SUMMARY:" "$out"/report*; then
        echo "== $mode reports:"; cat "$out"/report*; exit 1
    fi
    [ "$status" -eq 0 ] || { echo "== $mode: tests failed ($status)"; exit 1; }
    echo "== $mode: zero reports"
}

run_mode asan libasan.so "not gradcheck and not (auto_takes_small_batches and (bf16-rnn_tanh-backward or bf16-rnn_tanh-past or bf16-lstm-past))" auto
run_mode tsan libtsan.so "step or row_kernels or (cooperative and not mutation) or (persistent and (H10 or thread_order or tensor_core or options_match or live_rows or prefetched or pieces))" 2

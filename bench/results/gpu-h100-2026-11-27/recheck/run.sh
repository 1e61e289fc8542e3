#!/bin/bash
# Second device call of 2026-11-27 (fresh machine): the build, the two fixes
# (TF32 test at tensor-core sizes, autocast's run dtype), then the 24 Triton
# tests the check's tests_other stage had no time for (not_run_in_check.txt).
set -u
s=$SECONDS
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
python -m pip install -q --no-build-isolation --no-deps -e . > $OUT/build.log 2>&1 \
  || python setup.py build_ext --inplace >> $OUT/build.log 2>&1
echo "build rc=$? at $((SECONDS-s)) s" > $OUT/times.txt
P="python -m pytest -p no:cacheprovider -q -rfE -o junit_family=xunit2"
timeout -s INT 60 $P -n 4 --junitxml=$OUT/junit_fixes.xml tests/test_cuda.py::test_tf32_is_honoured_and_close \
  tests/test_modules.py -m gpu -k "autocast" > $OUT/fixes.log 2>&1
echo "fixes rc=$? at $((SECONDS-s)) s" >> $OUT/times.txt
timeout -s INT ${T2:-230} $P -n 12 --durations=30 --junitxml=$OUT/junit_triton.xml \
  $(cat bench/results/gpu-h100-2026-11-27/recheck/not_run_in_check.txt) > $OUT/triton.log 2>&1
echo "triton rc=$? at $((SECONDS-s)) s" >> $OUT/times.txt

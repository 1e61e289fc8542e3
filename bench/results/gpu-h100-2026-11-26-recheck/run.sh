#!/bin/bash
# One-off GPU recheck (not committed): the build, then what failed on the first GPU run.
set -u
s=$SECONDS
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
nvidia-smi -L > $OUT/times.txt 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/times.txt 2>&1
python -m pip install -q --no-build-isolation --no-deps -e . > $OUT/build.log 2>&1 \
  || python setup.py build_ext --inplace >> $OUT/build.log 2>&1
echo "build rc=$? at $((SECONDS-s)) s" >> $OUT/times.txt
X=""; python -c "import xdist" 2>/dev/null && X="-n 8"
timeout ${T1:-75} python -m pytest -p no:cacheprovider -q -rfE $X -o junit_family=xunit2 \
  --junitxml=$OUT/junit1.xml tests/test_triton.py::test_gpu_matches_torch_nn \
  tests/test_cuda.py::test_matches_cudnn_float32 tests/test_modules.py::test_autocast_cuda_dtypes \
  tests/test_triton.py::test_gpu_gradcheck_float64 -k "512 or cudnn or autocast or gradcheck" \
  > $OUT/tests1.log 2>&1
echo "tests1 rc=$? at $((SECONDS-s)) s" >> $OUT/times.txt
DEV=cuda timeout 20 python gpu_tmp/prec.py rnn_relu:512 > $OUT/prec.log 2>&1
echo "prec rc=$? at $((SECONDS-s)) s" >> $OUT/times.txt
timeout ${T2:-60} python -m pytest -p no:cacheprovider -q -rfE $X -o junit_family=xunit2 \
  --junitxml=$OUT/junit2.xml tests/test_modules.py::test_parity_grid_gpu -k triton \
  > $OUT/tests2.log 2>&1
echo "tests2 rc=$? at $((SECONDS-s)) s" >> $OUT/times.txt

#!/usr/bin/env bash
# Builds and runs bench/cooperative_check.cu on this machine's GPU: the emulated
# device's cooperative-grid model against the real one (seconds).
#   bash bench/cooperative_check.sh OUT.json
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash bench/cooperative_check.sh OUT.json}
# cuBLAS's headers (common.cuh includes them) from torch's nvidia-* wheels, else the toolkit's.
inc=$(python -c 'import glob, nvidia; print(" ".join("-isystem " + p.rsplit("/", 1)[0] for b in nvidia.__path__ for p in glob.glob(b + "/*/include/cublas_v2.h")))' 2>/dev/null || true)
exe=$(mktemp)
trap 'rm -f "$exe"' EXIT
# shellcheck disable=SC2086
nvcc -arch=sm_90 -O3 -std=c++17 -I csrc/cuda_emu $inc -o "$exe" bench/cooperative_check.cu
"$exe" | tee "$out"

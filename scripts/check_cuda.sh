#!/usr/bin/env bash
# Compile-check every csrc/*/*.cu for sm_80 and sm_90a (what build.py targets on Hopper) with nvcc
# (no GPU needed), using the flags torch's extension builder adds. Fails on the first compiler error.
# VERBOSE=1 prints ptxas's register / spill report.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "check_cuda.sh: $NVCC not found" >&2; exit 1; }
FLAGS=(-std=c++17 -O3 --expt-relaxed-constexpr -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
       -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__)
[ "${VERBOSE:-0}" = 1 ] && FLAGS+=(-Xptxas -v)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
shopt -s nullglob
sources=(csrc/*/*.cu)
[ ${#sources[@]} -gt 0 ] || { echo "check_cuda.sh: no csrc/*/*.cu" >&2; exit 1; }
pids=()
for src in "${sources[@]}"; do
  for arch in 80 90a; do
    obj="$out/$(basename "$(dirname "$src")")_$(basename "$src" .cu)_sm$arch.o"
    echo "nvcc -gencode=arch=compute_$arch,code=sm_$arch -c $src"
    "$NVCC" "${FLAGS[@]}" -gencode=arch=compute_$arch,code=sm_$arch -c "$src" -o "$obj" &
    pids+=($!)
  done
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
[ $status = 0 ] && echo "check_cuda.sh: all sources compile for sm_80 and sm_90a"
exit $status

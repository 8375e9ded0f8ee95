#!/usr/bin/env bash
# Compile-check every litquant/csrc/*/*.cu for sm_80 and sm_90a (what build.py targets on Hopper) with nvcc
# (no GPU needed), using the flags torch's extension builder adds, and the CUDA benchmarks (benchmarks/*.cu, Hopper
# programs) for sm_90a. Fails on the first compiler error.
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
sources=(litquant/csrc/*/*.cu)
[ ${#sources[@]} -gt 0 ] || { echo "check_cuda.sh: no litquant/csrc/*/*.cu" >&2; exit 1; }
pids=()
compile() {  # compile <source> <arch> [nvcc options]
  local src=$1 arch=$2 obj="$out/$(basename "$(dirname "$1")")_$(basename "$1" .cu)_sm$2.o"
  shift 2
  echo "nvcc -gencode=arch=compute_$arch,code=sm_$arch -DLITQUANT_TARGET_ARCH=${arch%a} $* -c $src"
  "$NVCC" "${FLAGS[@]}" "$@" -gencode=arch=compute_$arch,code=sm_$arch -DLITQUANT_TARGET_ARCH=${arch%a} -c "$src" -o "$obj" &
  pids+=($!)
}
for src in "${sources[@]}"; do compile "$src" 80; compile "$src" 90a; done
for src in benchmarks/*.cu; do compile "$src" 90a -I litquant/csrc/marlin; done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
[ $status = 0 ] && echo "check_cuda.sh: all sources compile (kernels for sm_80 and sm_90a, benchmarks for sm_90a)"
exit $status

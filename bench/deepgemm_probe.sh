#!/usr/bin/env bash
# Builds the DeepGEMM probes into build/: deepgemm_probe (fp8, bench/deepgemm_probe.cu) and
# deepgemm_bf16_probe (bf16, bench/deepgemm_bf16_probe.cu), from make setup's
# .deps/cuda-headers (the PyPI wheels sgl-deep-gemm and nvidia-cutlass). Needs nvcc; run the
# binaries on an H100/H200 (132 SMs).  bench/deepgemm_probe.sh [fp8|bf16|both]
set -euo pipefail
cd "$(dirname "$0")/.."
which=${1:-both}
deepgemm=.deps/cuda-headers/deep_gemm/include
[[ -f $deepgemm/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh ]] || { echo "deepgemm_probe: no DeepGEMM headers: run make setup" >&2; exit 1; }
cutlass=.deps/cuda-headers/cutlass_library/source/include
[[ -f $cutlass/cutlass/cutlass.h ]] || { echo "deepgemm_probe: no CUTLASS headers: run make setup" >&2; exit 1; }
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
mkdir -p build
build() {
  # CUTLASS's cute first: the wheel's include/ carries its own copy.
  "$nvcc" -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -w \
    -I"$cutlass" -I"$deepgemm" "bench/$1.cu" -o "build/$1"
  echo "built build/$1"
}
case $which in
  fp8) build deepgemm_probe ;;
  bf16) build deepgemm_bf16_probe ;;
  both)
    build deepgemm_probe & fp8=$!
    build deepgemm_bf16_probe & bf16=$!
    wait $fp8 && wait $bf16 ;;
  *) echo "deepgemm_probe.sh: unknown probe '$which' (fp8, bf16 or both)" >&2; exit 1 ;;
esac

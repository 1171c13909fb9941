#!/usr/bin/env bash
# Builds bench/deepgemm_probe.cu into build/deepgemm_probe: DeepGEMM's and CUTLASS's headers
# from make setup's .deps/cuda-headers (the PyPI wheels sgl-deep-gemm and nvidia-cutlass).
# Needs nvcc; run the binary on an H100/H200 (132 SMs).
set -euo pipefail
cd "$(dirname "$0")/.."
deepgemm=.deps/cuda-headers/deep_gemm/include
[[ -f $deepgemm/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh ]] || { echo "deepgemm_probe: no DeepGEMM headers: run make setup" >&2; exit 1; }
cutlass=.deps/cuda-headers/cutlass_library/source/include
[[ -f $cutlass/cutlass/cutlass.h ]] || { echo "deepgemm_probe: no CUTLASS headers: run make setup" >&2; exit 1; }
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
mkdir -p build
# CUTLASS's cute first: the wheel's include/ carries its own copy.
"$nvcc" -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -w \
  -I"$cutlass" -I"$deepgemm" bench/deepgemm_probe.cu -o build/deepgemm_probe
echo "built build/deepgemm_probe"

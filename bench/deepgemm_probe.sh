#!/usr/bin/env bash
# Builds bench/deepgemm_probe.cu into build/deepgemm_probe: DeepGEMM's headers from the PyPI
# wheel sgl-deep-gemm (pinned; unpacked into .deps/deepgemm, only include/ is used), CUTLASS's
# from make setup's .deps/cuda-headers. Needs nvcc; run the binary on an H100/H200 (132 SMs).
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.2.5
dir=.deps/deepgemm
if [[ ! -f $dir/$version/deep_gemm/include/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh ]]; then
  rm -rf "$dir" && mkdir -p "$dir/$version"
  python3 -m pip download -q --disable-pip-version-check --no-deps -d "$dir" "sgl-deep-gemm==$version"
  python3 -m zipfile -e "$dir"/sgl_deep_gemm-"$version"-*.whl "$dir/$version"
fi
cutlass=.deps/cuda-headers/cutlass_library/source/include
[[ -f $cutlass/cutlass/cutlass.h ]] || { echo "deepgemm_probe: no CUTLASS headers: run make setup" >&2; exit 1; }
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
mkdir -p build
# CUTLASS's cute first: the wheel's include/ carries its own copy.
"$nvcc" -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -w \
  -I"$cutlass" -I"$dir/$version/deep_gemm/include" bench/deepgemm_probe.cu -o build/deepgemm_probe
echo "built build/deepgemm_probe"

#!/usr/bin/env bash
# Installs the Debian packages the build, the tests and the default run need.
# Only what is missing is installed; a machine that has everything is left alone.
set -euo pipefail
packages=(
  cmake ninja-build g++ make pkg-config
  libopenblas-dev libtomlplusplus-dev libcli11-dev nlohmann-json3-dev
  libfmt-dev libspdlog-dev libgtest-dev libgmock-dev
  libutf8proc-dev   # Unicode categories and NFC for the BPE tokenizer
  libsentencepiece-dev libsentencepiece0   # SentencePiece .model tokenizers
  libxxhash-dev   # XXH3 checksums of checkpoints
  python3.11-doc   # the default training corpus (html/_sources/*.rst.txt)
  libcpp-httplib-dev libjs-chart.js   # the dashboard's HTTP server and charts
  chromium   # headless browser test of the dashboard page
  openmpi-bin libopenmpi-dev   # MPI backend of the communicator and the mpi-labelled tests
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q || echo "setup: apt-get update failed; trying with the cached package lists"
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# Python test oracles (tokenizers, safetensors, tensorboard, numpy) from PyPI into an
# ignored virtual environment; the C++ build never needs them. Reinstalled only when
# scripts/requirements-test.txt changes.
venv=.deps/venv
stamp=$venv/.requirements-installed
if [[ ! -f $stamp ]] || ! cmp -s scripts/requirements-test.txt "$stamp"; then
  echo "setup: installing the Python test oracles into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r scripts/requirements-test.txt
  cp scripts/requirements-test.txt "$stamp"
fi

# Header-only CUDA libraries from PyPI (cudnn-frontend for flash attention, CUTLASS for
# the experts' grouped GEMM), unpacked into .deps/cuda-headers; only where nvcc is present. Pinned in
# scripts/requirements-cuda.txt and reinstalled when that file changes.
if command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  headers=.deps/cuda-headers
  cuda_stamp=$headers/.requirements-installed
  if [[ ! -f $cuda_stamp ]] || ! cmp -s scripts/requirements-cuda.txt "$cuda_stamp"; then
    echo "setup: installing the CUDA header libraries into $headers"
    rm -rf "$headers"
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --target "$headers" -r scripts/requirements-cuda.txt
    cp scripts/requirements-cuda.txt "$cuda_stamp"
  fi
fi

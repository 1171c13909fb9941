#!/bin/bash
# Bundles built binaries with the shared libraries they load that a GPU node may lack (the
# build machine's Debian packages: fmt, spdlog, OpenBLAS, Open MPI, ...) into one tarball,
# for nodes that have the NVIDIA driver and CUDA's libraries (cuBLAS, NCCL, cuDNN) but not
# this build's packages. glibc, libstdc++ and the CUDA stack are left to the node.
#   scripts/bundle.sh OUT.tgz [BINARY...]     (default: build/moe, and build/moe_gpu_tests if built)
# On the node: tar -xzf OUT.tgz -C DIR && source DIR/env.sh && moe ...
# A host crash there (no debugger on the node): LD_PRELOAD=DIR/lib/libcrash_trace.so prints
# the frames (scripts/crash_trace.c says how to resolve them here).
set -euo pipefail
out=${1:?usage: scripts/bundle.sh OUT.tgz [BINARY...]}
shift
binaries=("$@")
if ((${#binaries[@]} == 0)); then
  binaries=(build/moe)
  [[ -x build/moe_gpu_tests ]] && binaries+=(build/moe_gpu_tests)
fi
for b in "${binaries[@]}"; do
  [[ -x $b ]] || { echo "bundle: $b is not a built executable" >&2; exit 1; }
done
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
for b in "${binaries[@]}"; do strip --strip-debug -o "$stage/bin/$(basename "$b")" "$b"; done
for b in "${binaries[@]}"; do ldd "$b" | awk '/=> \//{print $3}'; done | sort -u | while read -r lib; do
  case $(basename "$lib") in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++*|libgcc_s*) ;;  # the node's own
    libcuda.so*|libcublas*|libnccl*|libcudnn*|libcudart*|libnvidia*|libnvrtc*) ;;  # the node's CUDA stack
    *) cp -L "$lib" "$stage/lib/" ;;
  esac
done
if command -v cc > /dev/null; then
  cc -O1 -shared -fPIC -o "$stage/lib/libcrash_trace.so" "$(dirname "$0")/crash_trace.c"
fi
cat > "$stage/env.sh" <<'ENV'
# Sourced on the node: the bundle's binaries and libraries first.
bundle_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PATH=$bundle_dir/bin:$PATH
export LD_LIBRARY_PATH=$bundle_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
ENV
tar -C "$stage" -czf "$out" bin lib env.sh
echo "bundle: $out ($(du -h "$out" | cut -f1)): ${binaries[*]}, $(ls "$stage/lib" | wc -l) libraries"

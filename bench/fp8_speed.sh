#!/usr/bin/env bash
# FP8 step speed against bf16 (issue 21 point 3, docs/FP8.md section 4): `moe bench` of each
# bench model in bf16, in fp8 with the expert weights quantised once per optimizer step
# (training.fp8_weight_cache = true, the default) and in fp8 quantising them before every
# GEMM (false), then `moe bench --kernels` in fp8 (the per-GEMM and quantisation-kernel
# table, GB/s). Writes OUT/<model>-<mode>.log and prints each run's summary lines (step ms,
# tokens/s, MFU, device memory, time by phase).
# Usage: bench/fp8_speed.sh MOE_BINARY OUT [model ...] (default: mixtral-mini fine-grained;
# extra --section.key=value overrides go in EXTRA="...").
set -euo pipefail
moe=$1 out=$2
shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
models=("$@")
[[ ${#models[@]} -eq 0 ]] && models=(mixtral-mini fine-grained)
mkdir -p "$out"
read -r -a extra <<<"${EXTRA:-}"
for model in "${models[@]}"; do
  config=$here/configs/bench/$model.toml
  for mode in bf16 fp8 fp8-per-use; do
    args=()
    case $mode in
      fp8) args=(--training.precision=fp8) ;;
      fp8-per-use) args=(--training.precision=fp8 --training.fp8_weight_cache=false) ;;
    esac
    log=$out/$model-$mode.log
    "$moe" bench -c "$config" "${args[@]}" "${extra[@]}" >"$log" 2>&1 || { echo "$model $mode failed:"; tail -5 "$log"; exit 1; }
    echo "== $model $mode"
    grep -E "^mode:|^steps:|MFU|^device memory|^  [a-z]" "$log"
  done
  log=$out/$model-kernels.log
  "$moe" bench -c "$config" --training.precision=fp8 --kernels "${extra[@]}" >"$log" 2>&1 || { tail -5 "$log"; exit 1; }
  echo "== $model kernels (fp8)"
  sed -n '/^fp8 (e4m3/,$p' "$log"
done

#!/usr/bin/env bash
# bf16 expert gradients and the step without a gradient zeroing pass, each measured on its
# own on configs/bench/fine-grained.toml (one GPU): `moe bench` of
#   1. BASE_BINARY (main before these changes: memset + beta-1 GEMMs, fp32 gradients),
#   2. MOE_BINARY with fp32 expert gradients (no zeroing pass over the expert gradients),
#   3. MOE_BINARY with training.expert_grad_dtype = bf16 (and no zeroing pass),
# printing each one's step time, MFU, memory and the optimizer and experts phases, and (moe
# bench --kernels) the gate|up weight-gradient GEMM alone with fp32 / bf16 output and beta
# 1 / 0; then 40 training
# steps of the small default model with fp32 and bf16 expert gradients (losses side by side).
# Usage: bench/expert_grads.sh BASE_BINARY MOE_BINARY DATA_DIR OUT_DIR [extra --section.key=value ...]
set -euo pipefail
base=$1 moe=$2 data=$3 out=$4
shift 4
mkdir -p "$out"
bench() {  # name binary args...
  local name=$1 bin=$2
  shift 2
  "$bin" bench -c configs/bench/fine-grained.toml "$@" >"$out/bench_$name.txt" 2>&1 || { tail -5 "$out/bench_$name.txt"; exit 1; }
  echo "== $name"
  grep -E '^mode:|^steps:|^tokens/s|^device memory|^  (optimizer|experts|host gaps) ' "$out/bench_$name.txt" | cut -c1-160
}
bench base "$base" "$@"
bench fp32_no_zeroing "$moe" "$@"
bench bf16_no_zeroing "$moe" --training.expert_grad_dtype=bf16 --kernels "$@"
grep -E 'wgrad gate\|up variants' "$out/bench_bf16_no_zeroing.txt" | tr ';' '\n'
for dtype in fp32 bf16; do
  "$moe" train -c configs/default.toml --data.dir="$data" --training.device=cuda --training.steps=40 \
    --training.val_interval=20 --metrics.dir="$out/train_$dtype" --training.expert_grad_dtype=$dtype "$@" \
    >"$out/train_$dtype.txt" 2>&1 || { tail -5 "$out/train_$dtype.txt"; exit 1; }
done
echo "step, loss with fp32 expert gradients, loss with bf16 ones:"
paste <(grep -E '^step +[0-9]+/' "$out/train_fp32.txt" | awk '{print $2, $5}') \
      <(grep -E '^step +[0-9]+/' "$out/train_bf16.txt" | awk '{print $5}')

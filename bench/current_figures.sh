#!/usr/bin/env bash
# BENCHMARKS.md's "Current figures" rows, measured: `moe bench` of each bench model in each
# mode the table keeps, one run a row, printed as the table's markdown rows (date, commit,
# tokens/s, MFU, step, device memory; the peer's columns left empty: BENCH.md's figures, or a
# same-hour peer run, go there by hand), then the card and each run's mean SM clock (the 700 W
# cap moves a step by 1-2% from board to board: compare rows of one card only).
# Usage: bench/current_figures.sh MOE [PATTERN]
#   PATTERN: an extended regex; only the rows whose "model, mode" matches run (default all).
#   OUT (environment): where the logs go (default a temp dir).
set -euo pipefail
source "$(dirname "$0")/common.sh"
if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: $0 MOE [PATTERN]" >&2
  exit 2
fi
moe=$1 pattern=${2:-.}
[[ -x $moe ]] || { echo "$0: $moe is not an executable" >&2; exit 2; }
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
low="--optimizer.state_dtype=bf16 --training.expert_grad_dtype=bf16"
fp8_moments="--optimizer.state_dtype=fp8 --training.expert_grad_dtype=bf16"
fp8_gemms="--training.precision=fp8 --training.fp8_weight_gradients=true --training.fp8_weight_gradient_scales=128x128"
fp8="$fp8_gemms $low"
# model | mode | overrides
rows=(
  "mixtral-mini|defaults|"
  "mixtral-mini|low memory, \`recompute_experts = swiglu\`|$low --training.recompute_experts=swiglu"
  "mixtral-mini|bf16 expert gradients, fp8 AdamW moments, no recomputation|$fp8_moments"
  "mixtral-mini|\`precision = fp8\`, low memory, fp8 weight gradients (128x128)|$fp8"
  "mixtral-mini|\`precision = fp8\`, fp8 AdamW moments, fp8 weight gradients (128x128)|$fp8_gemms $fp8_moments"
  "mixtral-mini|bf16 expert gradients, fp8 AdamW moments, no recomputation, CUDA graphs|$fp8_moments --training.cuda_graphs=true"
  "mixtral-mini|\`precision = fp8\`, fp8 AdamW moments, fp8 weight gradients (128x128), CUDA graphs|$fp8_gemms $fp8_moments --training.cuda_graphs=true"
  "mixtral-mini|bf16 expert gradients, fp8 AdamW moments, no recomputation, \`deterministic = false\`|$fp8_moments --training.deterministic=false"
  "mixtral-mini|\`precision = fp8\`, fp8 AdamW moments, fp8 weight gradients (128x128), \`deterministic = false\`|$fp8_gemms $fp8_moments --training.deterministic=false"
  "olmoe-mini|defaults|"
  "olmoe-mini|low memory, \`recompute_experts = swiglu\` in the first 3 of 16 MoE layers|$low --training.recompute_experts=swiglu --training.recompute_experts_layers=3"
  "olmoe-mini|bf16 expert gradients, fp8 AdamW moments, no recomputation|$fp8_moments"
  "fine-grained|defaults|"
  "fine-grained|low memory|$low"
)
date=$(date -u +%Y-%m-%d)
commit=$("$moe" --version | sed -nE '1s/^moe-train ([^ ]+).*/\1/p' | cut -c1-7)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
clocks=()
n=0
for row in "${rows[@]}"; do
  IFS='|' read -r model mode overrides <<<"$row"
  [[ "$model, $mode" =~ $pattern ]] || continue
  n=$((n + 1))
  log=$out/$n.log
  read -r -a args <<<"$overrides"
  "$moe" bench -c "configs/bench/$model.toml" "${args[@]}" >"$log" 2>&1 || { echo "$model, $mode failed:"; tail -3 "$log"; continue; }
  read_bench_log "$log"
  printf '| %s, %s | %s | %s | %s | %s%% | %s ms | %s GB | | | |\n' "$model" "$mode" "$date" "$commit" \
    "$(sed -E ':a;s/^([0-9]+)([0-9]{3})/\1,\2/;ta' <<<"${tokens:-?}")" "${mfu:-?}" "${step:-?}" "${memory:-?}"
  clocks+=("$model, $mode: ${clock:-no clock}")
done
[[ $n -gt 0 ]] || { echo "$0: no row matches $pattern" >&2; exit 2; }
echo "card: ${card:-unknown}; logs: $out"
printf '  %s\n' "${clocks[@]}"

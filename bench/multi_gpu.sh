#!/usr/bin/env bash
# The multi-GPU measurements of BENCHMARKS.md (issue 8) on one host with N GPUs, in one go:
#   1. correctness: the default model for 50 steps on 1 GPU (micro-batch 8) against N GPUs
#      in data parallel (micro-batch 8 / N, the same global batch): the loss lines;
#   2. weak scaling of the bench models in data parallel (micro-batch per GPU fixed, the
#      global batch N times larger): tokens/s of 1 and N GPUs and the efficiency;
#   3. the MoE exchanges alone (`moe a2a-bench`) at the bench token counts, flat, and
#      hierarchical with the GPUs split into 2 simulated nodes.
# Usage: bench/multi_gpu.sh MOE_BINARY CORPUS_DIR [N_GPUS] [OUT_DIR]
# NCCL_NVLS_ENABLE=0 stays set (the lent machines need NVLink multicast off).
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 MOE_BINARY CORPUS_DIR [N_GPUS] [OUT_DIR]" >&2
  exit 2
fi
moe=$1
corpus=$2
n=${3:-$(nvidia-smi -L | wc -l)}
out=${4:-multi_gpu_out}
export NCCL_NVLS_ENABLE=0
[[ -x $moe ]] || { echo "$0: $moe is not an executable" >&2; exit 2; }
[[ -d $corpus ]] || { echo "$0: corpus directory $corpus does not exist" >&2; exit 2; }
(( n >= 2 && 8 % n == 0 )) || { echo "$0: N_GPUS must be 2, 4 or 8, got $n" >&2; exit 2; }
mkdir -p "$out"

summary() { grep -E "^summary:" "$1" | tail -1; }
# Median tok/s of the step lines after the first three (warm-up).
tokens_per_s() { grep -oE "tok/s [0-9]+" "$1" | awk 'NR > 3 { print $2 }' | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

echo "== 1. data-parallel correctness, default model, 50 steps"
common=(-c configs/default.toml --device cuda --data.dir="$corpus" --training.steps=50 --metrics.log_interval=10)
"$moe" train "${common[@]}" --training.micro_batch=8 > "$out/dp1.txt" 2>&1
"$moe" launch --nproc-per-node "$n" -- train "${common[@]}" --parallel.backend=nccl \
  --training.micro_batch=$((8 / n)) > "$out/dpn.txt" 2>&1
echo "1 GPU:  $(summary "$out/dp1.txt")"
echo "$n GPUs: $(summary "$out/dpn.txt")"

echo "== 2. weak scaling, data parallel"
for model in mixtral-mini olmoe-mini; do
  cfg=configs/bench/$model.toml
  run=(-c "$cfg" --device cuda --data.dir="$corpus" --training.steps=10 --metrics.log_interval=1)
  "$moe" train "${run[@]}" > "$out/ws1_$model.txt" 2>&1
  tokens=$(grep -oE "global_batch_tokens *= *[0-9]+" "$cfg" | grep -oE "[0-9]+$")
  "$moe" launch --nproc-per-node "$n" -- train "${run[@]}" --parallel.backend=nccl \
    --training.global_batch_tokens=$((tokens * n)) > "$out/wsn_$model.txt" 2>&1
  one=$(tokens_per_s "$out/ws1_$model.txt")
  many=$(tokens_per_s "$out/wsn_$model.txt")
  echo "$model: 1 GPU $one tokens/s, $n GPUs $many tokens/s, efficiency" \
    "$(awk -v a="$one" -v b="$many" -v n="$n" 'BEGIN { printf "%.1f%%", 100 * b / (n * a) }')"
done

echo "== 3. all-to-all alone (dispatch and combine), EP $n"
for model in mixtral-mini olmoe-mini; do
  "$moe" launch --nproc-per-node "$n" -- a2a-bench -c configs/bench/$model.toml --parallel.backend=nccl \
    --parallel.expert_parallel="$n" > "$out/a2a_$model.txt" 2>&1
  MOE_RANKS_PER_NODE=$((n / 2)) "$moe" launch --nproc-per-node "$n" -- a2a-bench -c configs/bench/$model.toml \
    --parallel.backend=nccl --parallel.expert_parallel="$n" > "$out/a2a_2nodes_$model.txt" 2>&1
  echo "$model, one node:";            grep -E "^a2a-bench|^  (flat|hierarchical)" "$out/a2a_$model.txt"
  echo "$model, 2 simulated nodes:";   grep -E "^  hierarchical" "$out/a2a_2nodes_$model.txt"
done

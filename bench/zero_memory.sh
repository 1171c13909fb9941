#!/usr/bin/env bash
# Per-rank device state under ZeRO (parallel.zero): the same model over 1, 2, 4 and 8
# data-parallel ranks as threads sharing one GPU (`moe train --thread-ranks`), ZeRO 0 and
# 1, 2 and 3, 3 steps each; prints rank 0's "device state" line (weights, gradients and AdamW
# state it keeps) and the losses. ZeRO-1 keeps the master lo halves and the moments of a
# rank's own pieces only: 6 + 10 / N bytes per parameter with fp32 moments (16 at N = 1);
# ZeRO-2 also the fp32 gradients (2 + 14 / N, plus two pools that hold a stage's gradients in
# flight); ZeRO-3 the bf16 weights too. `moe plan` counts the same (docs/MEMORY_PLAN.md).
# Usage: bench/zero_memory.sh MOE_BINARY DATA_DIR [extra --section.key=value ...]
set -euo pipefail
moe=$1 data=$2
shift 2
# The model of bench/ep_memory.sh: 8 layers of 64 experts, dim 512, 0.42 B parameters.
args=(--data.dir="$data" --training.device=cuda --model.dim=512 --model.n_heads=8 --model.n_kv_heads=4
      --model.n_layers=8 --model.seq_len=512 --moe.n_experts=64 --moe.expert_hidden=512 --training.micro_batch=1
      --training.steps=3 --training.val_interval=0 --metrics.log_interval=1 --training.cuda_graphs=false "$@")
for ranks in 1 2 4 8; do
  for zero in 0 1 2 3; do
    (( ranks == 1 && zero > 0 )) && continue
    threads=(); (( ranks > 1 )) && threads=(--thread-ranks "$ranks")
    out=$("$moe" train -c configs/default.toml "${threads[@]}" --parallel.zero="$zero" \
      --training.global_batch_tokens=$((512 * ranks)) "${args[@]}" 2>&1) || { echo "$out" | tail -5; exit 1; }
    echo "ranks $ranks, zero $zero: $(echo "$out" | grep -m1 'device state' | sed 's/.*device state/device state/')"
    echo "$out" | grep -E '^step +[0-9]+/' | awk '{print "  " $0}' | cut -c1-80
  done
done

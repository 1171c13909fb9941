#!/usr/bin/env bash
# Per-rank device state under expert parallelism: the same model over 1, 2, 4 and 8 ranks
# (EP = ranks) as threads sharing one GPU (`moe train --thread-ranks`), 3 steps each; prints
# rank 0's "device state" line (weights, gradients and AdamW moments it keeps) and the
# losses. A rank keeps memory for its own experts only, so the expert part falls as 1/P.
# Usage: bench/ep_memory.sh MOE_BINARY DATA_DIR [extra --section.key=value ...]
set -euo pipefail
moe=$1 data=$2
shift 2
# 8 layers of 64 experts (3 x 512 x 512 each), dim 512: 0.40 B expert parameters of 0.42 B.
args=(--data.dir="$data" --training.device=cuda --model.dim=512 --model.n_heads=8 --model.n_kv_heads=4
      --model.n_layers=8 --model.seq_len=512 --moe.n_experts=64 --moe.expert_hidden=512 --training.micro_batch=1
      --training.global_batch_tokens=4096 --training.steps=3 --training.val_interval=0 --metrics.log_interval=1
      --training.cuda_graphs=false "$@")
for ranks in 1 2 4 8; do
  if [[ $ranks == 1 ]]; then
    out=$("$moe" train -c configs/default.toml "${args[@]}" 2>&1) || { echo "$out" | tail -5; exit 1; }
  else
    out=$("$moe" train -c configs/default.toml --thread-ranks "$ranks" --parallel.expert_parallel="$ranks" \
      "${args[@]}" 2>&1) || { echo "$out" | tail -5; exit 1; }
  fi
  echo "ranks $ranks: $(echo "$out" | grep -m1 'device state' | sed 's/.*device state/device state/')"
  echo "$out" | grep -E '^step +[0-9]+/' | awk '{print "  " $0}' | cut -c1-110
done

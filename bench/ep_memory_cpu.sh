#!/usr/bin/env bash
# Per-rank resident memory of CPU ranks under expert parallelism: the same model over 1, 2
# and 4 tcp ranks (EP = ranks, `moe launch`), 2 steps each; prints rank 0's resident set
# (metrics.jsonl, memory.rss_bytes) after the last step. A rank keeps memory for its own
# experts only (ParameterStore::set_resident), so the expert part falls as 1/P.
# Usage: bench/ep_memory_cpu.sh MOE_BINARY DATA_DIR OUT_DIR [extra --section.key=value ...]
set -euo pipefail
moe=$1 data=$2 out=$3
shift 3
mkdir -p "$out"
# 4 layers of 32 experts (3 x 256 x 1024 each), dim 256: 101 M expert parameters.
args=(--data.dir="$data" --training.device=cpu --model.dim=256 --model.n_heads=4 --model.n_kv_heads=2
      --model.n_layers=4 --model.seq_len=64 --moe.n_experts=32 --moe.expert_hidden=1024 --training.micro_batch=1
      --training.global_batch_tokens=256 --training.steps=2 --training.val_interval=0 --metrics.log_interval=1
      --parallel.backend=tcp "$@")
for ranks in 1 2 4; do
  dir="$out/ranks_$ranks"
  if [[ $ranks == 1 ]]; then
    "$moe" train -c configs/default.toml --metrics.dir="$dir" "${args[@]}" > "$dir.log" 2>&1
  else
    "$moe" launch --nproc-per-node "$ranks" -- train -c configs/default.toml --metrics.dir="$dir" \
      --parallel.expert_parallel="$ranks" "${args[@]}" > "$dir.log" 2>&1
  fi
  rss=$(python3 -c "import json,sys
rows=[json.loads(l) for l in open('$dir/metrics.jsonl') if '\"memory\"' in l]
print(f\"{rows[-1]['memory']['rss_bytes']/1e9:.3f}\")")
  echo "ranks $ranks: rank 0 resident set $rss GB; $(grep -E '^step +2/' "$dir.log" | cut -c1-60)"
done

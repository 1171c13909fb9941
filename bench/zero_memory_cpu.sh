#!/usr/bin/env bash
# Per-rank resident memory of CPU ranks at each ZeRO level: the same model over one process
# and over 2 and 4 tcp ranks (`moe launch`, data parallel), parallel.zero = 0..3, 2 steps of
# 2 micro-batches each; prints rank 0's resident set after the last step (metrics.jsonl,
# memory.rss_bytes) and the parameter state the backend says rank 0 keeps (its startup line).
# 0 keeps everything; 1 frees the other ranks' moments; 2 their gradients too (released after
# each micro-batch's reduce-scatter); 3 their parameters too (gathered stage by stage).
# Then 4 ranks with expert parallelism 2 (each rank computes 4 of the 8 experts, each expert
# on two replicas) at each level: the dense parameters as above over the 4 ranks, the own
# experts' state over their 2 replicas (1: moments, 2: gradients too, 3: weights too).
# SECTIONS (default "dp ep"): which of the two sets of rows to run. glibc keeps freed
# buffers of up to 32 MB in the heap once one was freed (its dynamic mmap threshold):
# MALLOC_MMAP_THRESHOLD_=131072 in the environment measures without that.
# Usage: bench/zero_memory_cpu.sh MOE_BINARY DATA_DIR OUT_DIR [extra --section.key=value ...]
set -euo pipefail
moe=$1 data=$2 out=$3
shift 3
mkdir -p "$out"
# 4 layers of 8 experts (3 x 512 x 1024 each), dim 512: 55 M parameters, 0.88 GB of fp32
# values, gradients and moments.
args=(--data.dir="$data" --training.device=cpu --model.dim=512 --model.n_heads=8 --model.n_kv_heads=4
      --model.n_layers=4 --model.seq_len=64 --moe.n_experts=8 --moe.expert_hidden=1024 --training.micro_batch=1
      --training.steps=2 --training.val_interval=0 --metrics.log_interval=1 --parallel.backend=tcp "$@")
report() {  # dir, label
  local rss state
  rss=$(python3 -c "import json
rows=[json.loads(l) for l in open('$1/metrics.jsonl') if '\"memory\"' in l]
print(f\"{rows[-1]['memory']['rss_bytes']/1e9:.3f}\")")
  state=$(grep -o 'ZeRO [0-3] over .*' "$1.log" | head -1 || true)
  echo "$2: rank 0 resident set $rss GB | ${state:-one process} | $(grep -E '^step +2/' "$1.log" | cut -c1-40)"
}
sections=${SECTIONS:-dp ep}
if [[ " $sections " == *" dp "* ]]; then
  dir="$out/ranks_1"
  "$moe" train -c configs/default.toml --metrics.dir="$dir" --training.global_batch_tokens=128 "${args[@]}" > "$dir.log" 2>&1
  report "$dir" "1 process"
  for ranks in 2 4; do
    for zero in 0 1 2 3; do
      dir="$out/ranks_${ranks}_zero_$zero"
      "$moe" launch --nproc-per-node "$ranks" -- train -c configs/default.toml --metrics.dir="$dir" \
        --training.global_batch_tokens=$((ranks * 128)) --parallel.zero="$zero" "${args[@]}" > "$dir.log" 2>&1
      report "$dir" "$ranks ranks, zero $zero"
    done
  done
fi
if [[ " $sections " == *" ep "* ]]; then
  for zero in 0 1 2 3; do
    dir="$out/ranks_4_ep_2_zero_$zero"
    "$moe" launch --nproc-per-node 4 -- train -c configs/default.toml --metrics.dir="$dir" \
      --training.global_batch_tokens=512 --parallel.expert_parallel=2 --parallel.zero="$zero" "${args[@]}" \
      > "$dir.log" 2>&1
    report "$dir" "4 ranks, EP 2, zero $zero"
  done
fi

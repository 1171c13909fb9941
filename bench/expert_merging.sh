#!/usr/bin/env bash
# Expert merging (docs/EXPERT_MERGING.md) against no merging on the default corpus: the
# 64-expert model of configs/bench/merge-64e.toml, equal tokens (same steps, batch, seed
# and data), without merging and with merging every 100 steps (2 and 8 pairs per MoE layer
# per event, the most similar pairs whatever their cosine: moe.merge_similarity = -1).
# Writes OUT/<run>/metrics.jsonl, OUT/expert_merging.png (val_loss, train loss, max
# imbalance) and prints a table of final val_loss and experts remaining (split mode keeps
# all 64: a freed expert restarts as a split of the most loaded one).
# Usage: bench/expert_merging.sh MOE_BINARY CORPUS_DIR OUT_DIR [cuda|cpu] [extra --section.key=value ...]
# MERGE_INTERVAL=N overrides the 100 steps between merges (a tiny try on the CPU:
# MERGE_INTERVAL=2 bench/expert_merging.sh build/moe CORPUS /tmp/m cpu --training.steps=4 \
#   --training.val_interval=2 --training.val_batches=1 --training.global_batch_tokens=4096 --training.micro_batch=8)
set -euo pipefail
moe=$1 data=$2 out=$3 device=${4:-cuda}
shift $(( $# >= 4 ? 4 : 3 ))
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.deps/venv/bin/python}
mkdir -p "$out"
interval=${MERGE_INTERVAL:-100}
runs=("none:--moe.merge_interval=0"
      "merge2:--moe.merge_interval=$interval --moe.merge_pairs=2 --moe.merge_similarity=-1"
      "merge8:--moe.merge_interval=$interval --moe.merge_pairs=8 --moe.merge_similarity=-1")
plot_args=()
printf '%-8s %10s %10s %8s %18s\n' run val_loss train_loss merges experts_remaining
for spec in "${runs[@]}"; do
  name=${spec%%:*} flags=${spec#*:}
  rm -rf "${out:?}/$name"
  # shellcheck disable=SC2086
  "$moe" train -c "$here/configs/bench/merge-64e.toml" --data.dir="$data" --training.device="$device" \
    --metrics.dir="$out/$name" "$@" $flags > "$out/$name.log" 2>&1 || { tail -5 "$out/$name.log"; exit 1; }
  jsonl="$out/$name/metrics.jsonl"
  "$python" - "$jsonl" "$name" <<'PY'
import json, sys
path, name = sys.argv[1], sys.argv[2]
val = loss = None
merges = 0
experts = 0
for line in open(path):
    r = json.loads(line)
    if r.get("type") == "val":
        val = r["val_loss"]
    elif r.get("type") == "step":
        loss = r["loss"]
        experts = len(r["layers"][0]["tokens_per_expert"]) if r["layers"] else 0
        merges += sum(len(l.get("merges", [])) for l in r["layers"])
print(f"{name:<8} {val:10.4f} {loss:10.4f} {merges:8d} {experts:18d}")
PY
  plot_args+=("$name=$jsonl")
done
"$python" "$here/scripts/plot_metrics.py" --out "$out/expert_merging.png" --metric val_loss --metric loss \
  --metric layers.0.imbalance --smooth 10 --title "expert merging, 64 experts top-2 (configs/bench/merge-64e.toml)" \
  "${plot_args[@]}"

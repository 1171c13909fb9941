#!/usr/bin/env bash
# FP8 against bf16 (issue 21 point 3, docs/FP8.md section 5): one model of ~160 M
# parameters (dim 512, 8 layers, 8 experts top-2 of hidden 1536), 1,000 steps on the
# default corpus in bf16 and in fp8 (training.precision: the experts' and the dense
# projections' forward and data-gradient GEMMs), same seed (same init and data order),
# validation every 100 steps.
# Writes OUT/{bf16,fp8}/metrics.jsonl, the PNG docs/fp8_quality.png (loss and val_loss over
# steps), and prints both final validation losses, their gap and the 1% verdict.
# Usage: bench/fp8_quality.sh MOE_BINARY DATA_DIR OUT [extra --section.key=value ...]
# (extra keys go to both runs, e.g. --training.steps=20 for a smoke test; PLOTS=DIR writes
# the PNG there instead of docs/).
set -euo pipefail
moe=$1 data=$2 out=$3
shift 3
here=$(cd "$(dirname "$0")/.." && pwd)
plots=${PLOTS:-$here/docs}
mkdir -p "$out" "$plots"
python=python3
[[ -x "$here/.deps/venv/bin/python" ]] && python="$here/.deps/venv/bin/python"
args=(--data.dir="$data" --training.device=cuda --model.dim=512 --model.n_layers=8 --model.n_heads=8
      --model.n_kv_heads=4 --model.seq_len=512 --moe.n_experts=8 --moe.top_k=2 --moe.expert_hidden=1536
      --training.micro_batch=16 --training.global_batch_tokens=16384 --training.steps=1000
      --training.val_interval=100 --lr.warmup_steps=50 --metrics.log_interval=10 --metrics.tensorboard=false "$@")
for precision in bf16 fp8; do
  dir=$out/$precision
  rm -rf "$dir"
  "$moe" train -c "$here/configs/default.toml" "${args[@]}" --training.precision="$precision" \
    --metrics.dir="$dir" >"$dir.log" 2>&1 || { tail -5 "$dir.log"; exit 1; }
  echo "$precision: $(grep -m1 '^summary' "$dir.log" || tail -1 "$dir.log")"
done
"$python" "$here/scripts/plot_metrics.py" --out "$plots/fp8_quality.png" --title "fp8 (experts and projections) against bf16" \
  --smooth 5 --metric loss --metric val_loss "bf16=$out/bf16/metrics.jsonl" "fp8=$out/fp8/metrics.jsonl"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
final = {}
for p in ("bf16", "fp8"):
    vals = [json.loads(l) for l in open(f"{out}/{p}/metrics.jsonl")]
    vals = [r for r in vals if r.get("type") == "val"]
    final[p] = vals[-1]["val_loss"] if vals else float("nan")
gap = (final["fp8"] - final["bf16"]) / final["bf16"]
print(f"final val_loss: bf16 {final['bf16']:.4f}  fp8 {final['fp8']:.4f}  gap {100 * gap:+.2f}%  "
      f"({'within' if abs(gap) <= 0.01 else 'NOT within'} 1%)")
PY

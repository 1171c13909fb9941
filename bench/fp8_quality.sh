#!/usr/bin/env bash
# FP8 against bf16 (issue 21 point 3, docs/FP8.md section 5): one model of ~160 M
# parameters (dim 512, 8 layers, 8 experts top-2 of hidden 1536), 1,000 steps on the
# default corpus in bf16 and in fp8 (training.precision: the experts' and the dense
# projections' forward and data-gradient GEMMs), same seed (same init and data order),
# validation every 100 steps.
# RUNS (default "bf16 fp8") picks the runs, bf16 first: bf16; fp8; fp8-wgrad (the experts'
# weight gradients in fp8 too, 1x128 columns); fp8-wgrad-128x128 (their B side 128x128);
# deepgemm (fp8-wgrad-128x128 with training.fp8_gemm_backend = deepgemm: the benchmarks' mode);
# bf16-deepgemm (bf16 with training.bf16_gemm_backend = deepgemm); bf16-moments and fp8-moments
# (bf16 GEMMs, the AdamW moments in bf16 or fp8: optimizer.state_dtype); deepgemm-fp8-moments
# (deepgemm's fp8 GEMMs with fp8 AdamW moments).
# Writes OUT/<run>/metrics.jsonl, the PNG docs/fp8_quality.png (loss and val_loss over
# steps), and prints the final validation losses, each gap to bf16 and the 1% verdict.
# Usage: bench/fp8_quality.sh MOE_BINARY DATA_DIR OUT [extra --section.key=value ...]
# (extra keys go to every run, e.g. --training.steps=20 for a smoke test; PLOTS=DIR writes
# the PNG there instead of docs/, PNG=name.png names it, TITLE its title).
set -euo pipefail
moe=$1 data=$2 out=$3
shift 3
here=$(cd "$(dirname "$0")/.." && pwd)
plots=${PLOTS:-$here/docs}
runs=(${RUNS:-bf16 fp8})
[[ ${runs[0]} == bf16 ]] || { echo "RUNS must start with bf16 (the reference), got '${RUNS}'" >&2; exit 2; }
mkdir -p "$out" "$plots"
python=python3
[[ -x "$here/.deps/venv/bin/python" ]] && python="$here/.deps/venv/bin/python"
args=(--data.dir="$data" --training.device=cuda --model.dim=512 --model.n_layers=8 --model.n_heads=8
      --model.n_kv_heads=4 --model.seq_len=512 --moe.n_experts=8 --moe.top_k=2 --moe.expert_hidden=1536
      --training.micro_batch=16 --training.global_batch_tokens=16384 --training.steps=1000
      --training.val_interval=100 --lr.warmup_steps=50 --metrics.log_interval=10 --metrics.tensorboard=false "$@")
curves=()
for run in "${runs[@]}"; do
  case $run in
    bf16) keys=(--training.precision=bf16) ;;
    fp8) keys=(--training.precision=fp8) ;;
    fp8-wgrad) keys=(--training.precision=fp8 --training.fp8_weight_gradients=true) ;;
    fp8-wgrad-128x128) keys=(--training.precision=fp8 --training.fp8_weight_gradients=true
                             --training.fp8_weight_gradient_scales=128x128) ;;
    bf16-deepgemm) keys=(--training.precision=bf16 --training.bf16_gemm_backend=deepgemm) ;;
    bf16-moments) keys=(--training.precision=bf16 --optimizer.state_dtype=bf16) ;;
    fp8-moments) keys=(--training.precision=bf16 --optimizer.state_dtype=fp8) ;;
    deepgemm) keys=(--training.precision=fp8 --training.fp8_weight_gradients=true
                    --training.fp8_weight_gradient_scales=128x128 --training.fp8_gemm_backend=deepgemm) ;;
    deepgemm-fp8-moments) keys=(--training.precision=fp8 --training.fp8_weight_gradients=true
                                --training.fp8_weight_gradient_scales=128x128 --training.fp8_gemm_backend=deepgemm
                                --optimizer.state_dtype=fp8) ;;
    *) echo "unknown run '$run' (bf16, fp8, fp8-wgrad, fp8-wgrad-128x128, deepgemm, bf16-deepgemm, bf16-moments," \
            "fp8-moments, deepgemm-fp8-moments)" >&2; exit 2 ;;
  esac
  dir=$out/$run
  rm -rf "$dir"
  "$moe" train -c "$here/configs/default.toml" "${args[@]}" "${keys[@]}" \
    --metrics.dir="$dir" >"$dir.log" 2>&1 || { tail -5 "$dir.log"; exit 1; }
  echo "$run: $(grep -m1 '^summary' "$dir.log" || tail -1 "$dir.log")"
  curves+=("$run=$dir/metrics.jsonl")
done
"$python" "$here/scripts/plot_metrics.py" --out "$plots/${PNG:-fp8_quality.png}" \
  --title "${TITLE:-fp8 against bf16}" --smooth 5 --metric loss --metric val_loss "${curves[@]}"
python3 - "$out" "${runs[@]}" <<'PY'
import json, sys
out, runs = sys.argv[1], sys.argv[2:]
def final(run):
    vals = [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl")]
    vals = [r for r in vals if r.get("type") == "val"]
    return vals[-1]["val_loss"] if vals else float("nan")
ref = final("bf16")
print(f"final val_loss: bf16 {ref:.4f}")
for run in runs[1:]:
    v = final(run)
    gap = (v - ref) / ref
    print(f"  {run} {v:.4f}  gap {100 * gap:+.2f}%  ({'within' if abs(gap) <= 0.01 else 'NOT within'} 1%)")
PY

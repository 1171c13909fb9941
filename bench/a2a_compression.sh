#!/usr/bin/env bash
# parallel.a2a_compression: the same 64-expert model (configs/bench/a2a-64e.toml) trained
# STEPS steps (default 300) over 4 expert-parallel ranks with the exchange's token rows
# uncompressed, as fp8 and auto (metrics.alert_comm_wait as configured): final losses (mean of the last 50
# steps' logged losses), rank 0's a2a bytes per step, comm wait, and a PNG of the loss
# curves (scripts/plot_metrics.py; needs matplotlib, .deps/venv/bin/python when present).
#   device cuda (default): 4 thread ranks on one GPU (`moe train --thread-ranks 4`), none,
#     fp8 and auto. About 5 minutes on an H200 (MODES="none auto" to run fewer).
#   device cpu: 4 tcp ranks (`moe launch --nproc-per-node 4`), none, fp8 and auto; slow on
#     a small machine: STEPS=60 and a smaller model (SMALL=1: dim 128, 2 layers) fit.
# Usage: bench/a2a_compression.sh MOE_BINARY CORPUS_DIR OUT_DIR [cuda|cpu]
set -euo pipefail
if [[ $# -lt 3 ]]; then
  echo "usage: $0 MOE_BINARY CORPUS_DIR OUT_DIR [cuda|cpu]" >&2
  exit 2
fi
moe=$1 corpus=$2 out=$3 device=${4:-cuda}
steps=${STEPS:-300}
[[ -x $moe ]] || { echo "$0: $moe is not an executable" >&2; exit 2; }
[[ -d $corpus ]] || { echo "$0: corpus directory $corpus does not exist" >&2; exit 2; }
mkdir -p "$out"
args=(-c configs/bench/a2a-64e.toml --data.dir="$corpus" --training.steps="$steps" --parallel.expert_parallel=4
      --metrics.tensorboard=false)
[[ -n ${SMALL:-} ]] && args+=(--model.dim=128 --model.n_layers=2 --moe.expert_hidden=128)
case $device in
  cuda|cpu) read -r -a modes <<< "${MODES:-none fp8 auto}" ;;
  *) echo "$0: device must be cuda or cpu, got $device" >&2; exit 2 ;;
esac
for mode in "${modes[@]}"; do
  dir=$out/$mode
  rm -rf "$dir"
  start=$(date +%s)
  if [[ $device == cuda ]]; then
    "$moe" train "${args[@]}" --training.device=cuda --thread-ranks 4 --parallel.a2a_compression="$mode" \
      --metrics.dir="$dir" > "$out/$mode.log" 2>&1 || { tail -5 "$out/$mode.log"; exit 1; }
  else
    "$moe" launch --nproc-per-node 4 -- train "${args[@]}" --training.device=cpu --training.threads=1 \
      --parallel.backend=tcp --parallel.a2a_compression="$mode" --metrics.dir="$dir" \
      > "$out/$mode.log" 2>&1 || { tail -5 "$out/$mode.log"; exit 1; }
  fi
  echo "$mode: $(( $(date +%s) - start )) s"
done
python3 - "$out" "${modes[@]}" <<'PY'
import json, sys
out, modes = sys.argv[1], sys.argv[2:]
base = None
for mode in modes:
    steps = [json.loads(l) for l in open(f"{out}/{mode}/metrics.jsonl")]
    steps = [r for r in steps if r.get("type") == "step"]
    last = steps[-min(len(steps), 5):] if len(steps) < 50 else [r for r in steps if r["step"] > steps[-1]["step"] - 50]
    loss = sum(r["loss"] for r in last) / len(last)
    per_step = sum(r["a2a_bytes"] for r in steps) / len(steps)
    wait = sum(r["comm_wait_fraction"] for r in steps) / len(steps)
    fp8 = sum(sum(l.get("a2a_fp8", 0) for l in r["layers"]) for r in steps) / len(steps)
    base = base or per_step
    print(f"{mode:5s} final loss {loss:.4f} (mean of the last {len(last)} logged steps) | a2a {per_step / 1e6:.2f} MB/step "
          f"(rank 0; {per_step / base:.3f} of none) | comm wait {100 * wait:.1f}% | fp8 layers per step {fp8:.2f}")
PY
py=python3
[[ -x .deps/venv/bin/python ]] && py=.deps/venv/bin/python
runs=()
for mode in "${modes[@]}"; do runs+=("$mode=$out/$mode/metrics.jsonl"); done
$py scripts/plot_metrics.py --out "$out/a2a_compression.png" --metric loss --metric a2a_bytes --smooth 10 \
  --title "64 experts top-2, EP 4 ($device), a2a compression" "${runs[@]}" || echo "(no plot: matplotlib missing)"

#!/usr/bin/env bash
# Gate temperature auto-tuning against the other balancing schemes (docs/ROUTING.md): on
# the default config (8 experts) and on configs/bench/routing-64e.toml (64 experts top-2),
# four runs each: fixed temperature with the aux loss, aux-loss-free bias balancing,
# temperature control (on top of the aux loss), and temperature control with bias
# balancing. Writes OUT/<model>-<variant>/metrics.jsonl, the PNGs
# docs/routing-temperature-{default,64e}.png (max_imbalance and val_loss over steps) and
# prints a table: final validation loss, mean max_imbalance over the last 20% of the logged
# steps, mean temperature over the MoE layers at the end.
# Usage: bench/temperature_control.sh MOE_BINARY DATA_DIR OUT [cpu|cuda] [extra --section.key=value ...]
# (extra keys go to every run, e.g. --training.steps=8 for a smoke test; PLOTS=DIR writes
# the PNGs there instead of docs/).
set -euo pipefail
moe=$1 data=$2 out=$3 device=${4:-cuda}
shift 3
[[ $# -gt 0 ]] && shift
here=$(cd "$(dirname "$0")/.." && pwd)
plots=${PLOTS:-$here/docs}
mkdir -p "$out" "$plots"
python=python3
[[ -x "$here/.deps/venv/bin/python" ]] && python="$here/.deps/venv/bin/python"

variants=(fixed bias control control+bias)
flags_of() {
  case $1 in
    fixed) echo "" ;;
    bias) echo "--moe.bias_balancing=true --moe.aux_loss_coef=0" ;;
    control) echo "--moe.temperature_control=true" ;;
    control+bias) echo "--moe.temperature_control=true --moe.bias_balancing=true --moe.aux_loss_coef=0" ;;
  esac
}

run() {  # model config variant [extra ...]
  local model=$1 config=$2 variant=$3
  shift 3
  local dir="$out/$model-$variant"
  rm -rf "$dir"
  # shellcheck disable=SC2046
  "$moe" train -c "$config" --data.dir="$data" --training.device="$device" --metrics.dir="$dir" \
    --metrics.tensorboard=false --metrics.log_interval=5 $(flags_of "$variant") "$@" >"$dir.log" 2>&1 ||
    { tail -5 "$dir.log"; exit 1; }
  echo "$model $variant: $(grep -m1 '^summary' "$dir.log" || tail -1 "$dir.log")"
}

for model in default 64e; do
  config=$here/configs/default.toml
  [[ $model == 64e ]] && config=$here/configs/bench/routing-64e.toml
  for v in "${variants[@]}"; do run "$model" "$config" "$v" "$@"; done
  args=()
  for v in "${variants[@]}"; do args+=("$v=$out/$model-$v/metrics.jsonl"); done
  "$python" "$here/scripts/plot_metrics.py" --out "$plots/routing-temperature-$model.png" \
    --title "$model: imbalance and validation loss" --smooth 5 --metric max_imbalance --metric val_loss "${args[@]}"
done

python3 - "$out" "${variants[@]}" <<'PY'
import json, sys
out, variants = sys.argv[1], sys.argv[2:]
print(f"{'model':8} {'variant':13} {'val_loss':>9} {'imbalance(last 20%)':>20} {'temperature(end)':>17}")
for model in ("default", "64e"):
    for v in variants:
        steps, vals = [], []
        with open(f"{out}/{model}-{v}/metrics.jsonl") as f:
            for line in f:
                r = json.loads(line)
                if r.get("type") == "step": steps.append(r)
                elif r.get("type") == "val": vals.append(r)
        tail = steps[int(len(steps) * 0.8):] or steps[-1:]
        imbalance = sum(r["max_imbalance"] for r in tail) / len(tail)
        temps = [l.get("temperature", 0) for l in steps[-1]["layers"]]
        val = vals[-1]["val_loss"] if vals else float("nan")
        print(f"{model:8} {v:13} {val:9.4f} {imbalance:20.3f} {sum(temps) / len(temps):17.3f}")
PY

#!/usr/bin/env bash
# Calibrates `moe plan --simulate` (docs/SIMULATOR.md) on one H200 machine:
#   1. `moe bench --json` of mixtral-mini (bf16 moments) and olmoe-mini: the compute
#      profiles (OUT/profile_MODEL.json) that replace the hand-typed
#      configs/hardware/profiles/h200-mixtral-mini-8ebd42c.json;
#   2. 1-GPU training of each (10 steps, median tok/s of steps 4-10) against the simulator's
#      1-GPU prediction from the profile just measured (predicted vs measured, error);
#   3. thread ranks of the default model (2 and 4 ranks on this one GPU, EP = ranks, in 2
#      simulated nodes; 4 ranks also with node-first routing `moe.route_groups = 2,
#      route_top_groups = 1`): the bytes rank 0 sends per step to other ranks and to the
#      other node (a2a_bytes, a2a_off_node_bytes of metrics.jsonl) against the simulator's. Thread ranks share one GPU, so their step times are not
#      a multi-GPU measurement and are not compared;
#   4. with more than one GPU visible (the x2/x4 kinds), `moe a2a-bench --json` over them and
#      the 2- and 4-GPU predictions for BENCHMARKS.md's weak-scaling runs; the measured
#      multi-GPU runs themselves come from `bench/multi_gpu.sh BINARY CORPUS N OUT scaling`.
# Usage: bench/simulator_calibration.sh MOE_BINARY CORPUS_DIR [OUT_DIR]
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 MOE_BINARY CORPUS_DIR [OUT_DIR]" >&2
  exit 2
fi
moe=$1
corpus=$2
out=${3:-simulator_calibration_out}
[[ -x $moe ]] || { echo "$0: $moe is not an executable" >&2; exit 2; }
[[ -d $corpus ]] || { echo "$0: corpus directory $corpus does not exist" >&2; exit 2; }
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
hw=configs/hardware/h200-8x400g.toml
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || echo 1)

median_field() {
  grep -oE "$2 [0-9.]+" "$1" | awk 'NR >= 4 { print $NF }' | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}
predict() {  # predict PROFILE CONFIG ARGS...: the flat column's tokens/s per GPU
  "$moe" plan --simulate -c "$2" --hardware "$hw" --compute "$1" --micro-batches 1 --json "${@:3}" |
    python3 -c 'import json, sys; print("%.0f" % json.load(sys.stdin)["flat"]["tokens_per_s_per_gpu"])'
}
error() { awk -v p="$1" -v m="$2" 'BEGIN { printf "%+.1f%%", 100 * (p - m) / m }'; }

echo "== 1. compute profiles (moe bench --json)"
for model in mixtral-mini olmoe-mini; do
  extra=()
  [[ $model == mixtral-mini ]] && extra=(--optimizer.state_dtype=bf16)
  "$moe" bench -c configs/bench/$model.toml --warmup 3 --steps 10 --json "$out/profile_$model.json" "${extra[@]}" \
    > "$out/bench_$model.txt" 2>&1
  grep -E "^steps:|^tokens/s" "$out/bench_$model.txt"
done

echo "== 2. one GPU: predicted (from the profile) against a training run"
for model in mixtral-mini olmoe-mini; do
  extra=()
  [[ $model == mixtral-mini ]] && extra=(--optimizer.state_dtype=bf16)
  "$moe" train -c configs/bench/$model.toml --device cuda --data.dir="$corpus" --training.steps=10 \
    --metrics.log_interval=1 --metrics.dir="$out/train1_$model" "${extra[@]}" > "$out/train1_$model.txt" 2>&1
  measured=$(median_field "$out/train1_$model.txt" "tok/s")
  predicted=$(predict "$out/profile_$model.json" configs/bench/$model.toml --gpus 1 "${extra[@]}")
  echo "$model 1 GPU: measured $measured tok/s, predicted $predicted, error $(error "$predicted" "$measured")"
done

echo "== 3. thread ranks: bytes sent per rank per step against the simulator's rows (default model)"
for groups in 0 2; do
  route=(--moe.route_groups="$groups")
  (( groups > 1 )) && route+=(--moe.route_top_groups=1)
  for ranks in 2 4; do
    name=tr${ranks}_groups$groups
    (( groups > 1 && ranks == 2 )) && continue
    "$moe" train -c configs/default.toml --device cuda --data.dir="$corpus" --training.steps=6 \
      --metrics.log_interval=1 --metrics.dir="$out/$name" --thread-ranks "$ranks" --thread-ranks-per-node $((ranks / 2)) \
      --parallel.expert_parallel="$ranks" --parallel.zero=0 "${route[@]}" > "$out/$name.txt" 2>&1 ||
      { echo "$name failed: see $out/$name.txt"; continue; }
    "$moe" plan --simulate -c configs/default.toml --model.vocab_size=4096 --hardware "$hw" --gpus "$ranks" \
      --gpus-per-node $((ranks / 2)) --parallel.expert_parallel="$ranks" "${route[@]}" --json > "$out/$name.json"
    python3 - "$out/$name" "$name" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"a2a_off_node_bytes"' in l]
j = json.load(open(sys.argv[1] + ".json"))
per_row = j["a2a_row_bytes_per_step"] / (j["rows_same_node"] + j["rows_other_nodes"])
m = rows[-1]
print(f"{sys.argv[2]}: to other ranks predicted {j['a2a_row_bytes_per_step'] / 1e6:.2f} MB (rows only), measured "
      f"{m['a2a_bytes'] / 1e6:.2f} MB (rows, counts, routing); to the other node predicted "
      f"{j['rows_other_nodes'] * per_row / 1e6:.2f} MB, measured {m['a2a_off_node_bytes'] / 1e6:.2f} MB")
PY
  done
done

if (( gpus >= 2 )); then
  echo "== 4. $gpus GPUs: a2a-bench --json and the weak-scaling predictions"
  "$moe" launch --nproc-per-node "$gpus" -- a2a-bench -c configs/bench/mixtral-mini.toml --parallel.backend=nccl \
    --parallel.expert_parallel="$gpus" --json "$out/a2a_$gpus.json" > "$out/a2a_$gpus.txt" 2>&1
  grep -E "^  (flat|hierarchical)" "$out/a2a_$gpus.txt"
  p=$out/profile_mixtral-mini.json
  for mode in "dp:--parallel.zero=1" "ep:--parallel.expert_parallel=$gpus"; do
    echo "mixtral-mini ${mode%%:*} $gpus GPUs predicted tok/s per GPU: $(predict "$p" configs/bench/mixtral-mini.toml \
      --gpus "$gpus" --collectives "$out/a2a_$gpus.json" --optimizer.state_dtype=bf16 "${mode#*:}")"
  done
  echo "(measured: bench/multi_gpu.sh $moe $corpus $gpus OUT scaling)"
else
  echo "== 4. one GPU visible: the 2- and 4-GPU calibration needs the x2/x4 machines (bench/multi_gpu.sh ... simulate)"
fi

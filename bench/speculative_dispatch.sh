#!/usr/bin/env bash
# Speculative dispatch (moe.speculative_dispatch, docs/ROUTING_CACHE.md) against the exact
# dispatch on 4 CPU ranks of expert parallelism (EP 4, `moe launch` over tcp, or mpirun
# with LAUNCH=mpi): the same 16-expert model trained with speculation off, on (guessing
# top_k experts per token) and on guessing 4, each REPEAT times, alternating. Per run it
# prints the losses' checksum (the same for every variant: the math is unchanged), the
# mean per-layer dispatch wait (ms per step, the ExpertExchangeOverComm wait of the
# forwards' dispatches, mean over ranks), the step time and comm wait, and for the
# speculating layers the share of remote rows sent early and used, the wasted and
# corrected rows, and the bytes sent early vs late (rows x dim x 4 B, fp32 rows).
# Usage: bench/speculative_dispatch.sh MOE_BINARY DATA_DIR OUT_DIR [extra --section.key=value ...]
# Env: STEPS (40), REPEAT (2), LAUNCH (tcp | mpi), DEVICE (cpu).
set -euo pipefail
moe=$1 data=$2 out=$3
shift 3
steps=${STEPS:-40} repeat=${REPEAT:-2} launch=${LAUNCH:-tcp} device=${DEVICE:-cpu}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
# 4 layers of 16 experts (top-2, hidden 128), dim 128, 4 x 4 x 128 tokens per micro-batch.
args=(-c "$here/configs/default.toml" --data.dir="$data" --training.device="$device" --model.dim=128
      --model.seq_len=128 --moe.n_experts=16 --moe.expert_hidden=128 --training.micro_batch=4
      --training.global_batch_tokens=4096 --training.steps="$steps" --training.val_interval=0
      --metrics.log_interval=10 --parallel.expert_parallel=4 --moe.route_cache=true "$@")
run() {  # name, extra args...
  local name=$1
  shift
  if [[ $launch == mpi ]]; then
    mpirun --oversubscribe --allow-run-as-root -np 4 "$moe" train "${args[@]}" --metrics.dir="$out/$name" "$@" \
      > "$out/$name.log" 2>&1
  else
    "$moe" launch --nproc-per-node 4 -- train "${args[@]}" --metrics.dir="$out/$name" "$@" > "$out/$name.log" 2>&1
  fi
}
for r in $(seq 1 "$repeat"); do
  run "exact_$r" --moe.speculative_dispatch=false
  run "spec_$r" --moe.speculative_dispatch=true
  run "spec_guess4_$r" --moe.speculative_dispatch=true --moe.route_cache_predict=4
done
python3 - "$out" "$repeat" <<'PY' | tee "$out/summary.txt"
import glob, hashlib, json, os, sys
out, repeat = sys.argv[1], int(sys.argv[2])
def steps(name):
    path = glob.glob(os.path.join(out, name, "**", "metrics.jsonl"), recursive=True)
    return [j for j in map(json.loads, open(path[0])) if j.get("type") == "step"]
print(f"{'run':16} {'loss sum':>10} {'dispatch wait ms/layer/step':>28} {'step s':>7} {'comm wait s':>11}"
      f" {'used share':>10} {'wasted':>7} {'corrected':>9} {'early MB':>8} {'late MB':>7}")
for r in range(1, repeat + 1):
    for variant in ("exact", "spec", "spec_guess4"):
        s = steps(f"{variant}_{r}")
        body = s[5:]  # the first steps fill the routing cache and warm up
        loss = hashlib.sha1(repr([x["loss"] for x in s]).encode()).hexdigest()[:10]
        waits = [sum(l["a2a_dispatch_wait_ms"] for l in x["layers"]) / len(x["layers"]) for x in body]
        step_s = sum(x["time_s"]["step"] for x in body) / len(body)
        comm = sum(x["time_s"]["comm_wait"] for x in body) / len(body)
        spec = [l for x in body for l in x["layers"] if "spec_rows_used" in l]
        line = f"{variant + '_' + str(r):16} {loss:>10} {sum(waits) / len(waits):28.2f} {step_s:7.3f} {comm:11.3f}"
        if spec:
            used = sum(l["spec_rows_used"] for l in spec)
            wasted = sum(l["spec_rows_wasted"] for l in spec)
            corr = sum(l["spec_rows_corrected"] for l in spec)
            row = 128 * 4
            line += (f" {used / (used + corr):10.3f} {wasted / len(body):7.0f} {corr / len(body):9.0f}"
                     f" {(used + wasted) * row / len(body) / 1e6:8.2f} {corr * row / len(body) / 1e6:7.2f}")
        print(line)
print("(per step, steps 6.., the speculating layers 2..4 summed over the 4 ranks for rows and bytes)")
PY

#!/usr/bin/env bash
# Speculative dispatch (moe.speculative_dispatch, docs/ROUTING_CACHE.md) against the exact
# dispatch on 4 CPU ranks of expert parallelism (EP 4, `moe launch` over tcp, or mpirun
# with LAUNCH=mpi): the same 16-expert model trained with speculation off, on (guessing
# top_k experts per token) and on guessing 4, each REPEAT times, alternating. Per run it
# prints the losses' checksum (the same for every variant: the math is unchanged), the
# mean per-layer dispatch wait (a2a_dispatch_wait_ms per step, mean over ranks: on the
# CPU the ExpertExchangeOverComm wait of the forwards' dispatches, on the GPU the model
# stream's time from the router's end to the expert rows in place), the first MoE layer's
# (never speculated: the control) and the later layers', the step time and comm wait, and
# for the speculating layers the share of remote rows sent early and used, the wasted and
# corrected rows, and the bytes sent early vs late (rows x row bytes: fp32 rows on the
# CPU, bf16 on the GPU).
# Usage: bench/speculative_dispatch.sh MOE_BINARY DATA_DIR OUT_DIR [extra --section.key=value ...]
# Env: STEPS (40), REPEAT (2), NPROC (4: ranks, all expert-parallel), DEVICE (cpu | cuda),
# LAUNCH (tcp: `moe launch`, processes over tcp on the CPU or NCCL on NPROC GPUs | mpi:
# mpirun | threads: `moe train --thread-ranks NPROC`, the ranks as threads on one GPU).
# DEVICE=cuda trains a larger model (64 experts, dim 1024, 8 x 512 tokens per rank and
# micro-batch: bf16 rows of 2 KB) whose exchange is worth hiding.
set -euo pipefail
moe=$1 data=$2 out=$3
shift 3
steps=${STEPS:-40} repeat=${REPEAT:-2} launch=${LAUNCH:-tcp} device=${DEVICE:-cpu} nproc=${NPROC:-4}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
if [[ $device == cuda ]]; then
  # 4 MoE layers of 64 experts (top-2, hidden 512), dim 1024, 8 x 512 tokens per rank and micro-batch.
  model=(--model.dim=1024 --model.n_heads=8 --model.n_kv_heads=4 --model.seq_len=512 --moe.n_experts=64
         --moe.expert_hidden=512 --training.micro_batch=8
         --training.global_batch_tokens=$((2 * 8 * 512 * nproc)))
  row_bytes=2048
else
  # 4 layers of 16 experts (top-2, hidden 128), dim 128, 4 x 4 x 128 tokens per micro-batch.
  model=(--model.dim=128 --model.seq_len=128 --moe.n_experts=16 --moe.expert_hidden=128 --training.micro_batch=4
         --training.global_batch_tokens=4096)
  row_bytes=512
fi
args=(-c "$here/configs/default.toml" --data.dir="$data" --training.device="$device" "${model[@]}"
      --training.steps="$steps" --training.val_interval=0 --metrics.log_interval=10
      --parallel.expert_parallel="$nproc" --moe.route_cache=true "$@")
run() {  # name, extra args...
  local name=$1
  shift
  case $launch in
    mpi) mpirun --oversubscribe --allow-run-as-root -np "$nproc" "$moe" train "${args[@]}" --metrics.dir="$out/$name" "$@" \
           > "$out/$name.log" 2>&1 ;;
    threads) "$moe" train --thread-ranks "$nproc" "${args[@]}" --metrics.dir="$out/$name" "$@" > "$out/$name.log" 2>&1 ;;
    *) "$moe" launch --nproc-per-node "$nproc" -- train "${args[@]}" --metrics.dir="$out/$name" "$@" \
         > "$out/$name.log" 2>&1 ;;
  esac
}
for r in $(seq 1 "$repeat"); do
  run "exact_$r" --moe.speculative_dispatch=false
  run "spec_$r" --moe.speculative_dispatch=true
  run "spec_guess4_$r" --moe.speculative_dispatch=true --moe.route_cache_predict=4
done
python3 - "$out" "$repeat" "$row_bytes" "$nproc" <<'PY' | tee "$out/summary.txt"
import glob, hashlib, json, os, sys
out, repeat, row, nproc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def steps(name):
    path = glob.glob(os.path.join(out, name, "**", "metrics.jsonl"), recursive=True)
    return [j for j in map(json.loads, open(path[0])) if j.get("type") == "step"]
print(f"{'run':16} {'loss sum':>10} {'dispatch wait ms/layer/step (layer 1 / later)':>28} {'step s':>7} {'comm wait s':>11}"
      f" {'used share':>10} {'wasted':>7} {'corrected':>9} {'early MB':>8} {'late MB':>7}")
for r in range(1, repeat + 1):
    for variant in ("exact", "spec", "spec_guess4"):
        s = steps(f"{variant}_{r}")
        body = s[5:]  # the first steps fill the routing cache and warm up
        loss = hashlib.sha1(repr([x["loss"] for x in s]).encode()).hexdigest()[:10]
        waits = [sum(l["a2a_dispatch_wait_ms"] for l in x["layers"]) / len(x["layers"]) for x in body]
        first = [x["layers"][0]["a2a_dispatch_wait_ms"] for x in body]
        later = [sum(l["a2a_dispatch_wait_ms"] for l in x["layers"][1:]) / (len(x["layers"]) - 1) for x in body]
        step_s = sum(x["time_s"]["step"] for x in body) / len(body)
        comm = sum(x["time_s"]["comm_wait"] for x in body) / len(body)
        spec = [l for x in body for l in x["layers"] if "spec_rows_used" in l]
        line = (f"{variant + '_' + str(r):16} {loss:>10} {sum(waits) / len(waits):9.2f} ({sum(first) / len(first):6.2f} /"
                f" {sum(later) / len(later):6.2f}) {step_s:7.3f} {comm:11.3f}")
        if spec:
            used = sum(l["spec_rows_used"] for l in spec)
            wasted = sum(l["spec_rows_wasted"] for l in spec)
            corr = sum(l["spec_rows_corrected"] for l in spec)
            line += (f" {used / (used + corr):10.3f} {wasted / len(body):7.0f} {corr / len(body):9.0f}"
                     f" {(used + wasted) * row / len(body) / 1e6:8.2f} {corr * row / len(body) / 1e6:7.2f}")
        print(line)
print(f"(per step, steps 6.., the speculating layers 2..4 summed over the {nproc} ranks for rows and bytes,"
      f" rows of {row} B)")
PY

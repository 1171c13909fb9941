#!/usr/bin/env bash
# The multi-GPU measurements of BENCHMARKS.md (issue 8) on one host with N GPUs:
#   correctness  the default model for 50 steps on 1 GPU (micro-batch 8) against N GPUs in
#                data parallel and in expert parallel (EP = N), micro-batch 8 / N each (the
#                same global batch), and EP = N with the experts re-placed by load every 10
#                steps (unequal counts allowed): the loss lines;
#   scaling      weak scaling of the bench models (micro-batch per GPU fixed, the global
#                batch N times larger), data parallel and expert parallel (EP = N): tokens/s
#                of 1 and N GPUs, the efficiency, and the step's communication wait;
#   comm         data parallel over N GPUs with the gradient sums' settings varied:
#                parallel.comm_sms, grad_reduce_dtype and parallel.zero (0 or 1), for
#                both bench models (efficiency against the scaling section's 1-GPU run,
#                which it runs itself when that section did not); COMM_SETTINGS
#                (environment): the "sms,dtype,zero" triples to run, space-separated;
#   a2a          the MoE exchanges alone (`moe a2a-bench`) at the bench token counts, flat,
#                and hierarchical with the GPUs split into 2 simulated nodes;
#   compression  parallel.a2a_compression over N GPUs (NCCL): both bench models at EP = N,
#                token rows uncompressed (bf16) and fp8 (e4m3 + a scale per row): median
#                tokens/s and comm wait, rank 0's all-to-all MB per step and GB/s (the last
#                step line), and the loss at the last step (STEPS, default 10);
#   speculative  moe.speculative_dispatch over N GPUs (NCCL): bench/speculative_dispatch.sh's
#                64-expert model at EP = N, exact, speculating with top_k guesses and with 4:
#                the losses' checksum (the same), the dispatch wait of the first MoE layer
#                (never speculated) and of the later ones, step time, rows early / late;
#   memory       expert state only where it is computed: per-GPU device state (the "device
#                state" line) of bench/ep_memory.sh's model at EP = N, and mixtral-mini at
#                EP = N with fp32 AdamW moments (each GPU holds 1/N of the experts), 6 steps;
#                then the same small model data parallel at parallel.zero 0-3 and at EP N / 2
#                with parallel.zero 0-3 (from 4 GPUs), mixtral-mini at EP N with ZeRO 3, and
#                data parallel at ZeRO 2 (1/N of its gradients and optimizer state);
#   resume       runs of the default model saving at step 4 of 8, resumed from that
#                checkpoint: steps 5-8 of both runs (each rank writes its shard, all read), data
#                parallel, expert parallel (EP = N) and EP = N with split experts
#                re-placed every 2 steps, and the EP checkpoint resumed on one GPU.
# Usage: bench/multi_gpu.sh MOE_BINARY CORPUS_DIR [N_GPUS] [OUT_DIR] [SECTIONS]
# SECTIONS: a comma-separated subset of correctness,scaling,comm,a2a,compression,speculative,memory,resume,
# simulate (default: all but comm, compression, speculative and simulate; simulate: the step simulator's calibration with
# measured all-to-all and all-reduce curves, docs/SIMULATOR.md).
# MODES (environment): the parallel modes scaling measures, "dp ep dpz3 epz3" by default
# (dpz3: data parallel at ZeRO 3; epz3: EP N / 2 at ZeRO 3, each expert sharded over its 2
# GPUs, from 4 GPUs on); "epr" adds
# EP = N with the experts re-placed by load every REBALANCE_INTERVAL steps (default 5),
# up to E - N + 1 experts per GPU; "eps" EP = N with split experts (parallel.split_experts:
# each GPU also computes part of the next GPU's first expert, the rows evened every
# micro-batch); "epsr" split experts re-placed every REBALANCE_INTERVAL steps (the
# heaviest experts made hinges, up to E - N + 1 experts per GPU's window).
# STEPS and MEDIAN_FROM (environment): the scaling and comm runs' length (default 10) and the
# first step of the median (default 4); e.g. STEPS=30 MEDIAN_FROM=21 for the steps after a
# re-placement has caught up with the routing.
# SCALING_ARGS (environment): more overrides for every scaling run, 1 GPU included
# (e.g. "--moe.capacity_factor=1.25", or "--metrics.phase_times=true": then the scaling
# and comm sections also print each run's last per-phase line, to see which phases grow).
# NCCL_NVLS_ENABLE=0 stays set (the lent machines need NVLink multicast off).
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 MOE_BINARY CORPUS_DIR [N_GPUS] [OUT_DIR] [SECTIONS]" >&2
  exit 2
fi
moe=$1
corpus=$2
n=${3:-$(nvidia-smi -L | wc -l)}
out=${4:-multi_gpu_out}
sections=,${5:-correctness,scaling,a2a,memory,resume},
modes=" ${MODES:-dp ep dpz3 epz3} "
export NCCL_NVLS_ENABLE=0
[[ -x $moe ]] || { echo "$0: $moe is not an executable" >&2; exit 2; }
[[ -d $corpus ]] || { echo "$0: corpus directory $corpus does not exist" >&2; exit 2; }
(( n >= 2 && 8 % n == 0 )) || { echo "$0: N_GPUS must be 2, 4 or 8, got $n" >&2; exit 2; }
mkdir -p "$out"

summary() { grep -E "^summary:" "$1" | tail -1; }
# The last per-phase line of a log (metrics.phase_times), indented; nothing without one.
phases() { grep -E "phases \(ms\):" "$1" | tail -1 | sed 's/^ */    /' || true; }
# Median of the step lines' field from step MEDIAN_FROM on (the first ones warm up): tok/s, or comm wait %.
median_field() {
  grep -oE "$2 [0-9.]+" "$1" | awk -v from="${MEDIAN_FROM:-4}" 'NR >= from { print $NF }' | sort -g |
    awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}
efficiency() { awk -v a="$1" -v b="$2" -v n="$n" 'BEGIN { printf "%.1f%%", 100 * b / (n * a) }'; }
# THREAD_RANKS=1 (environment): the N ranks as N threads on one GPU (`moe train
# --thread-ranks N`): a rehearsal of the correctness and resume sections, not a timing.
launch() {
  if [[ -n ${THREAD_RANKS:-} ]]; then "$moe" "$1" --thread-ranks "$n" "${@:2}"
  else "$moe" launch --nproc-per-node "$n" -- "$@"; fi
}
# The 10-step bench run of a model (scaling and comm sections): sets run, extra and tokens
# (the config's global batch). mixtral-mini runs with bf16 moments (data parallelism keeps
# every weight on every GPU plus its buffers; before issue 19 expert parallelism did too),
# the 1-GPU baseline with them as well, as in the recorded figures. SCALING_ARGS apply to
# every run, 1 GPU included.
bench_run() {
  local cfg=configs/bench/$1.toml
  extra=()
  [[ $1 == mixtral-mini ]] && extra=(--optimizer.state_dtype=bf16)
  # shellcheck disable=SC2206  # SCALING_ARGS is a list of overrides
  extra+=(${SCALING_ARGS:-})
  run=(-c "$cfg" --device cuda --data.dir="$corpus" --training.steps="${STEPS:-10}" --metrics.log_interval=1 "${extra[@]}")
  tokens=$(grep -oE "global_batch_tokens *= *[0-9]+" "$cfg" | grep -oE "[0-9]+$")
}

if [[ $sections == *,correctness,* ]]; then
  echo "== correctness, default model, 50 steps"
  common=(-c configs/default.toml --device cuda --data.dir="$corpus" --training.steps=50 --metrics.log_interval=10)
  "$moe" train "${common[@]}" --training.micro_batch=8 > "$out/dp1.txt" 2>&1
  launch train "${common[@]}" --parallel.backend=nccl --training.micro_batch=$((8 / n)) > "$out/dpn.txt" 2>&1
  launch train "${common[@]}" --parallel.backend=nccl --parallel.expert_parallel="$n" \
    --training.micro_batch=$((8 / n)) > "$out/epn.txt" 2>&1
  launch train "${common[@]}" --parallel.backend=nccl --parallel.expert_parallel="$n" \
    --training.micro_batch=$((8 / n)) --parallel.rebalance_interval=10 --parallel.zero=0 \
    --parallel.rebalance_max_experts=$((8 - n + 1)) > "$out/epr.txt" 2>&1
  launch train "${common[@]}" --parallel.backend=nccl --parallel.expert_parallel="$n" \
    --training.micro_batch=$((8 / n)) --parallel.split_experts=true --parallel.rebalance_interval=10 \
    --parallel.zero=0 > "$out/eps.txt" 2>&1
  echo "1 GPU:         $(summary "$out/dp1.txt")"
  echo "$n GPUs, DP:    $(summary "$out/dpn.txt")"
  echo "$n GPUs, EP $n: $(summary "$out/epn.txt")"
  echo "$n GPUs, EP $n re-placed: $(summary "$out/epr.txt")"
  echo "$n GPUs, EP $n split, re-placed: $(summary "$out/eps.txt")"
  grep -E "re-placed experts" "$out/epr.txt" "$out/eps.txt" | head -6 || true
  for f in dp1 dpn epn epr eps; do echo "$f losses: $(grep -oE "^step +[0-9]+/[0-9]+ \| loss [0-9.]+" "$out/$f.txt" | awk '{ print $NF }' | paste -sd' ')"; done
fi

if [[ $sections == *,scaling,* ]]; then
  echo "== weak scaling (micro-batch per GPU fixed), data parallel and EP $n"
  for model in mixtral-mini olmoe-mini; do
    bench_run "$model"
    "$moe" train "${run[@]}" > "$out/ws1_$model.txt" 2>&1
    one=$(median_field "$out/ws1_$model.txt" "tok/s")
    line="$model ${extra[*]}: 1 GPU $one tokens/s"
    if [[ $modes == *" dp "* ]]; then
      launch train "${run[@]}" --parallel.backend=nccl --training.global_batch_tokens=$((tokens * n)) \
        > "$out/wsn_$model.txt" 2>&1
      dp=$(median_field "$out/wsn_$model.txt" "tok/s")
      line+=" | DP $n: $dp tokens/s, efficiency $(efficiency "$one" "$dp"), comm wait $(median_field "$out/wsn_$model.txt" "comm wait")%"
    fi
    if [[ $modes == *" ep "* ]]; then
      launch train "${run[@]}" --parallel.backend=nccl --parallel.expert_parallel="$n" \
        --training.global_batch_tokens=$((tokens * n)) > "$out/wsep_$model.txt" 2>&1
      ep=$(median_field "$out/wsep_$model.txt" "tok/s")
      line+=" | EP $n: $ep tokens/s, efficiency $(efficiency "$one" "$ep"), comm wait $(median_field "$out/wsep_$model.txt" "comm wait")%"
    fi
    if [[ $modes == *" epr "* ]]; then
      experts=$(grep -oE "^n_experts *= *[0-9]+" "configs/bench/$model.toml" | grep -oE "[0-9]+$")
      launch train "${run[@]}" --parallel.backend=nccl --parallel.expert_parallel="$n" \
        --training.global_batch_tokens=$((tokens * n)) --parallel.rebalance_interval="${REBALANCE_INTERVAL:-5}" \
        --parallel.rebalance_max_experts=$((experts - n + 1)) --parallel.zero=0 > "$out/wsepr_$model.txt" 2>&1
      epr=$(median_field "$out/wsepr_$model.txt" "tok/s")
      line+=" | EP $n re-placed: $epr tokens/s, efficiency $(efficiency "$one" "$epr"), comm wait $(median_field "$out/wsepr_$model.txt" "comm wait")%"
    fi
    # ZeRO 3: data parallel over the N GPUs, and EP N / 2 (each expert on 2 GPUs, sharded
    # over them; the shared parameters over all N).
    for z3 in dpz3 epz3; do
      [[ $modes == *" $z3 "* ]] || continue
      layout=(--parallel.zero=3 --training.cuda_graphs=false) label="DP $n ZeRO 3"
      if [[ $z3 == epz3 ]]; then
        (( n >= 4 )) || continue
        layout+=(--parallel.expert_parallel=$((n / 2))) label="EP $((n / 2)) ZeRO 3"
      fi
      launch train "${run[@]}" --parallel.backend=nccl --training.global_batch_tokens=$((tokens * n)) "${layout[@]}" \
        > "$out/ws${z3}_$model.txt" 2>&1
      tps=$(median_field "$out/ws${z3}_$model.txt" "tok/s")
      line+=" | $label: $tps tokens/s, efficiency $(efficiency "$one" "$tps"), comm wait $(median_field "$out/ws${z3}_$model.txt" "comm wait")%"
    done
    for split in eps epsr; do
      [[ $modes == *" $split "* ]] || continue
      replace=()
      experts=$(grep -oE "^n_experts *= *[0-9]+" "configs/bench/$model.toml" | grep -oE "[0-9]+$")
      [[ $split == epsr ]] && replace=(--parallel.rebalance_interval="${REBALANCE_INTERVAL:-5}"
        --parallel.rebalance_max_experts=$((experts - n + 1)))
      launch train "${run[@]}" --parallel.backend=nccl --parallel.expert_parallel="$n" \
        --training.global_batch_tokens=$((tokens * n)) --parallel.split_experts=true "${replace[@]}" \
        --parallel.zero=0 > "$out/ws${split}_$model.txt" 2>&1
      tps=$(median_field "$out/ws${split}_$model.txt" "tok/s")
      line+=" | EP $n split${replace:+, re-placed}: $tps tokens/s, efficiency $(efficiency "$one" "$tps"), comm wait $(median_field "$out/ws${split}_$model.txt" "comm wait")%"
    done
    echo "$line"
    grep -E "re-placed experts" "$out/wsepr_$model.txt" "$out/wsepsr_$model.txt" 2>/dev/null | head -4 || true
    for log in "$out"/ws{1,n,ep,epr,eps,epsr,dpz3,epz3}_"$model".txt; do [[ -s $log ]] && phases "$log"; done
    if [[ $modes == *" ep "* ]]; then grep -E "all-to-all [0-9.]+ MB" "$out/wsep_$model.txt" | tail -1 || true; fi
  done
fi

if [[ $sections == *,comm,* ]]; then
  echo "== data parallel over $n GPUs: SMs left to NCCL (parallel.comm_sms) and the sums' dtype"
  for model in mixtral-mini olmoe-mini; do
    bench_run "$model"
    [[ -s $out/ws1_$model.txt ]] || "$moe" train "${run[@]}" > "$out/ws1_$model.txt" 2>&1
    one=$(median_field "$out/ws1_$model.txt" "tok/s")
    echo "$model: 1 GPU $one tokens/s"
    phases "$out/ws1_$model.txt"
    settings=(0,fp32,1 16,fp32,1 32,fp32,1 32,bf16,1 32,fp32,0 0,fp32,0)
    [[ -n ${COMM_SETTINGS:-} ]] && read -ra settings <<< "$COMM_SETTINGS"
    for setting in "${settings[@]}"; do
      IFS=, read -r sms dtype zero <<< "$setting"
      log="$out/comm_${model}_sms${sms}_${dtype}_zero$zero.txt"
      launch train "${run[@]}" --parallel.backend=nccl --training.global_batch_tokens=$((tokens * n)) \
        --parallel.comm_sms="$sms" --parallel.grad_reduce_dtype="$dtype" --parallel.zero="$zero" > "$log" 2>&1
      dp=$(median_field "$log" "tok/s")
      echo "  comm_sms $sms, $dtype sums, zero $zero: $dp tokens/s, efficiency $(efficiency "$one" "$dp"), comm wait $(median_field "$log" "comm wait")%"
      phases "$log"
    done
  done
fi

if [[ $sections == *,a2a,* ]]; then
  echo "== all-to-all alone (dispatch and combine), EP $n"
  for model in mixtral-mini olmoe-mini; do
    launch a2a-bench -c configs/bench/$model.toml --parallel.backend=nccl --parallel.expert_parallel="$n" \
      > "$out/a2a_$model.txt" 2>&1
    MOE_RANKS_PER_NODE=$((n / 2)) launch a2a-bench -c configs/bench/$model.toml --parallel.backend=nccl \
      --parallel.expert_parallel="$n" > "$out/a2a_2nodes_$model.txt" 2>&1
    echo "$model, one node:";          grep -E "^a2a-bench|^  (flat|hierarchical)" "$out/a2a_$model.txt"
    echo "$model, 2 simulated nodes:"; grep -E "^  hierarchical" "$out/a2a_2nodes_$model.txt"
  done
fi

if [[ $sections == *,compression,* ]]; then
  echo "== a2a compression (parallel.a2a_compression), EP $n, weak-scaling batch"
  for model in mixtral-mini olmoe-mini; do
    bench_run "$model"
    for mode in none fp8; do
      log="$out/compression_${model}_$mode.txt"
      launch train "${run[@]}" --parallel.backend=nccl --parallel.expert_parallel="$n" \
        --training.global_batch_tokens=$((tokens * n)) --parallel.a2a_compression="$mode" > "$log" 2>&1
      echo "$model $mode: $(median_field "$log" "tok/s") tokens/s, comm wait $(median_field "$log" "comm wait")%," \
        "$(grep -oE "all-to-all [0-9.]+ MB at [0-9.]+ GB/s" "$log" | tail -1), last loss" \
        "$(grep -oE "^step +[0-9]+/[0-9]+ \| loss [0-9.]+" "$log" | tail -1 | awk '{ print $NF }')"
    done
  done
fi

if [[ $sections == *,speculative,* ]]; then
  echo "== speculative dispatch (moe.speculative_dispatch), EP $n over NCCL"
  STEPS=${STEPS:-30} REPEAT=1 NPROC="$n" DEVICE=cuda LAUNCH=tcp bash bench/speculative_dispatch.sh "$moe" "$corpus" \
    "$out/speculative" --parallel.backend=nccl
fi

if [[ $sections == *,memory,* ]]; then
  echo "== expert state per GPU, EP $n (issue 19: each GPU keeps its own experts only)"
  # bench/ep_memory.sh's model (8 layers x 64 experts, dim 512) over the N GPUs.
  launch train -c configs/default.toml --data.dir="$corpus" --training.device=cuda --model.dim=512 \
    --model.n_heads=8 --model.n_kv_heads=4 --model.n_layers=8 --model.seq_len=512 --moe.n_experts=64 \
    --moe.expert_hidden=512 --training.micro_batch=1 --training.global_batch_tokens=$((512 * n)) --training.steps=3 \
    --training.val_interval=0 --metrics.log_interval=1 --parallel.expert_parallel="$n" > "$out/memory_ep.txt" 2>&1
  grep -m1 "device state" "$out/memory_ep.txt" | sed 's/.*device state/  device state/'
  # mixtral-mini with fp32 moments at EP N: 76 GB of state on one GPU, 1/N of its experts here.
  launch train -c configs/bench/mixtral-mini.toml --device cuda --data.dir="$corpus" --training.steps=6 \
    --training.global_batch_tokens=$((16384 * n)) --metrics.log_interval=1 --training.val_interval=0 \
    --parallel.expert_parallel="$n" > "$out/memory_mixtral.txt" 2>&1
  grep -m1 "device state" "$out/memory_mixtral.txt" | sed 's/.*device state/  mixtral-mini device state/'
  grep -E "^step +6/" "$out/memory_mixtral.txt" | cut -c1-100 | sed 's/^/  /'
  echo "== optimizer and gradient state per GPU, data parallel over $n GPUs (issue 19: parallel.zero)"
  for zero in 0 1 2 3; do
    launch train -c configs/default.toml --data.dir="$corpus" --training.device=cuda --model.dim=512 \
      --model.n_heads=8 --model.n_kv_heads=4 --model.n_layers=8 --model.seq_len=512 --moe.n_experts=64 \
      --moe.expert_hidden=512 --training.micro_batch=1 --training.global_batch_tokens=$((512 * n)) --training.steps=3 \
      --training.val_interval=0 --metrics.log_interval=1 --training.cuda_graphs=false --parallel.zero="$zero" \
      > "$out/memory_zero$zero.txt" 2>&1
    grep -m1 "device state" "$out/memory_zero$zero.txt" | sed "s/.*device state/  zero $zero: device state/"
  done
  echo "== expert and shared state per GPU, EP $((n / 2)) over $n GPUs (issue 19: parallel.zero under expert parallelism)"
  for zero in 0 1 2 3; do
    (( n >= 4 )) || break
    launch train -c configs/default.toml --data.dir="$corpus" --training.device=cuda --model.dim=512 \
      --model.n_heads=8 --model.n_kv_heads=4 --model.n_layers=8 --model.seq_len=512 --moe.n_experts=64 \
      --moe.expert_hidden=512 --training.micro_batch=1 --training.global_batch_tokens=$((512 * n)) --training.steps=3 \
      --training.val_interval=0 --metrics.log_interval=1 --training.cuda_graphs=false --parallel.zero="$zero" \
      --parallel.expert_parallel=$((n / 2)) > "$out/memory_ep_zero$zero.txt" 2>&1
    grep -m1 "device state" "$out/memory_ep_zero$zero.txt" | sed "s/.*device state/  EP $((n / 2)), zero $zero: device state/"
  done
  launch train -c configs/bench/mixtral-mini.toml --device cuda --data.dir="$corpus" --training.steps=6 \
    --training.global_batch_tokens=$((16384 * n)) --metrics.log_interval=1 --training.val_interval=0 \
    --training.cuda_graphs=false --parallel.zero=3 --parallel.expert_parallel="$n" > "$out/memory_mixtral_ep_zero3.txt" 2>&1
  grep -m1 "device state" "$out/memory_mixtral_ep_zero3.txt" | sed "s/.*device state/  mixtral-mini EP $n ZeRO 3 device state/"
  grep -E "^step +6/" "$out/memory_mixtral_ep_zero3.txt" | cut -c1-100 | sed 's/^/  /'
  launch train -c configs/bench/mixtral-mini.toml --device cuda --data.dir="$corpus" --training.steps=6 \
    --training.global_batch_tokens=$((16384 * n)) --metrics.log_interval=1 --training.val_interval=0 \
    --training.cuda_graphs=false --parallel.zero=2 > "$out/memory_mixtral_zero2.txt" 2>&1
  grep -m1 "device state" "$out/memory_mixtral_zero2.txt" | sed 's/.*device state/  mixtral-mini ZeRO 2 device state/'
  grep -E "^step +6/" "$out/memory_mixtral_zero2.txt" | cut -c1-100 | sed 's/^/  /'
fi

if [[ $sections == *,resume,* ]]; then
  losses() { grep -oE "^step +[5-8]/8 \| loss [0-9.]+" "$1" | awk '{ print $NF }' | paste -sd' '; }
  # eps: split experts re-placed every 2 steps (a resumed run starts from equal blocks:
  # close to the uninterrupted run, not bit for bit).
  for mode in dp ep eps; do
    echo "== resume: $mode over $n GPUs, checkpoint at step 4 of 8"
    ckpt=$(mktemp -d)
    run=(-c configs/default.toml --device cuda --data.dir="$corpus" --training.steps=8 --metrics.log_interval=1
         --parallel.backend=nccl --training.micro_batch=$((8 / n)) --checkpoint.dir="$ckpt" --checkpoint.interval=4)
    [[ $mode == ep ]] && run+=(--parallel.expert_parallel="$n")
    [[ $mode == eps ]] && run+=(--parallel.expert_parallel="$n" --parallel.split_experts=true --parallel.rebalance_interval=2
                                --parallel.zero=0)
    launch train "${run[@]}" > "$out/resume_${mode}_whole.txt" 2>&1
    launch train "${run[@]}" --resume "$ckpt/step_00000004" --discard-newer-checkpoints > "$out/resume_${mode}_after.txt" 2>&1
    echo "uninterrupted, steps 5-8: $(losses "$out/resume_${mode}_whole.txt")"
    echo "resumed,       steps 5-8: $(losses "$out/resume_${mode}_after.txt")"
    if [[ $mode == ep ]]; then
      # The EP checkpoint is an ordinary one: one GPU (micro-batch 8, the same global batch) resumes it.
      "$moe" train -c configs/default.toml --device cuda --data.dir="$corpus" --training.steps=8 \
        --metrics.log_interval=1 --training.micro_batch=8 --checkpoint.dir="$ckpt/one" \
        --resume "$ckpt/step_00000004" > "$out/resume_ep_one_gpu.txt" 2>&1
      echo "on one GPU,    steps 5-8: $(losses "$out/resume_ep_one_gpu.txt")"
    fi
    rm -rf "$ckpt"
  done
fi

if [[ $sections == *,simulate,* ]]; then
  # The step simulator (docs/SIMULATOR.md) against N real GPUs: a2a-bench --json inside the
  # node, a measured compute profile, mixtral-mini's weak-scaling runs (1 GPU, DP N, EP N),
  # and the predictions from those inputs; then EP N in 2 simulated nodes with and without
  # node-first routing (route_groups 2, top 1): the bytes each rank sent to the other
  # simulated node (a2a_off_node_bytes) against the simulator's rows.
  echo "== simulator calibration, $n GPUs"
  hw=configs/hardware/h200-8x400g.toml
  "$moe" bench -c configs/bench/mixtral-mini.toml --optimizer.state_dtype=bf16 --warmup 3 --steps 10 \
    --json "$out/profile_mixtral-mini.json" > "$out/sim_bench.txt" 2>&1
  launch a2a-bench -c configs/bench/mixtral-mini.toml --parallel.backend=nccl --parallel.expert_parallel="$n" \
    --json "$out/sim_a2a.json" > "$out/sim_a2a.txt" 2>&1
  # The all-reduce sweep (4 KB to 1 GB): the reductions' latency and bus bandwidth.
  launch allreduce-bench --parallel.backend=nccl --json "$out/sim_allreduce.json" > "$out/sim_allreduce.txt" 2>&1
  grep -E "^ +(4096|1073741824) " "$out/sim_allreduce.txt" || true
  sim() {
    "$moe" plan --simulate -c configs/bench/mixtral-mini.toml --hardware "$hw" --compute "$out/profile_mixtral-mini.json" \
      --collectives "$out/sim_a2a.json" --collectives "$out/sim_allreduce.json" --optimizer.state_dtype=bf16 \
      --micro-batches 1 --json "$@" |
      python3 -c 'import json, sys; print("%.0f" % json.load(sys.stdin)["flat"]["tokens_per_s_per_gpu"])'
  }
  bench_run mixtral-mini
  "$moe" train "${run[@]}" > "$out/sim_1.txt" 2>&1
  launch train "${run[@]}" --parallel.backend=nccl --training.global_batch_tokens=$((tokens * n)) > "$out/sim_dp.txt" 2>&1
  launch train "${run[@]}" --parallel.backend=nccl --parallel.expert_parallel="$n" \
    --training.global_batch_tokens=$((tokens * n)) --metrics.dir="$out/sim_ep_metrics" > "$out/sim_ep.txt" 2>&1
  # The EP run's own routing, the steps the median reads (MEDIAN_FROM on): --expert-loads.
  python3 - "$out/sim_ep_metrics/metrics.jsonl" "${MEDIAN_FROM:-4}" > "$out/sim_ep_loads.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("type") == "step" and r.get("step", 0) >= int(sys.argv[2]): print(line, end="")
PY
  one=$(median_field "$out/sim_1.txt" "tok/s")
  echo "1 GPU:  measured $one tok/s, predicted $(sim --gpus 1)"
  echo "DP $n:   measured per GPU $(awk -v t="$(median_field "$out/sim_dp.txt" "tok/s")" -v n="$n" 'BEGIN { printf "%.0f", t / n }'), predicted $(sim --gpus "$n")"
  echo "EP $n:   measured per GPU $(awk -v t="$(median_field "$out/sim_ep.txt" "tok/s")" -v n="$n" 'BEGIN { printf "%.0f", t / n }'), predicted $(sim --gpus "$n" --parallel.expert_parallel="$n") (even rows), $(sim --gpus "$n" --parallel.expert_parallel="$n" --expert-loads "$out/sim_ep_loads.jsonl") (its logged routing)"
  if (( n >= 4 )); then
    for groups in 0 2; do
      route=(--moe.route_groups="$groups")
      (( groups > 1 )) && route+=(--moe.route_top_groups=1)
      MOE_RANKS_PER_NODE=$((n / 2)) launch train -c configs/bench/olmoe-mini.toml --device cuda --data.dir="$corpus" \
        --training.steps=6 --metrics.log_interval=1 --metrics.dir="$out/sim_nodes_$groups" --parallel.backend=nccl \
        --parallel.expert_parallel="$n" "${route[@]}" > "$out/sim_nodes_$groups.txt" 2>&1
      "$moe" plan --simulate -c configs/bench/olmoe-mini.toml --hardware "$hw" --gpus "$n" --gpus-per-node $((n / 2)) \
        --parallel.expert_parallel="$n" "${route[@]}" --json > "$out/sim_nodes_$groups.json"
      python3 - "$out/sim_nodes_$groups" "$groups" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"a2a_off_node_bytes"' in l]
j = json.load(open(sys.argv[1] + ".json"))
per_row = j["a2a_row_bytes_per_step"] / (j["rows_same_node"] + j["rows_other_nodes"])
print(f"route_groups {sys.argv[2]}: off-node bytes per step measured {rows[-1]['a2a_off_node_bytes'] / 1e9:.3f} GB "
      f"(all to other ranks {rows[-1]['a2a_bytes'] / 1e9:.3f}), predicted {j['rows_other_nodes'] * per_row / 1e9:.3f} GB "
      f"(uniform routing)")
PY
    done
  fi
fi

#!/usr/bin/env bash
# A against B on one GPU under its power cap: `moe bench` of the same config with two
# binaries (or two sets of overrides), run alternately ROUNDS times (default 2: A B A B),
# since single runs at the 700 W limit move by +-1-2% with the board's clock. Prints each
# run's median step, MFU, mean SM clock, memory and last loss (a change meant to keep the
# bits must keep the loss), then the mean of each side's medians. A change that moves the
# bits moves the bench's trajectory too (peak learning rate from step 1, synthetic tokens),
# and with it the routing and every MoE phase's time: compare such changes with
# --lr.peak=1e-30 as well, where the updates are below the weights' last bit, so both sides
# keep the initial weights and routing and only the kernels' cost differs.
# Usage: bench/ab_steps.sh MOE_A MOE_B CONFIG [--section.key=value ...]
#   A_ARGS / B_ARGS (environment): overrides for one side only, e.g. to compare two modes
#   of one binary (MOE_A = MOE_B). OUT (environment): where the logs go (default a temp dir).
set -euo pipefail
source "$(dirname "$0")/common.sh"
ab_start 3 "MOE_A MOE_B CONFIG [--section.key=value ...]" "$@"
shift 3
read -r -a a_args <<<"${A_ARGS:-}"
read -r -a b_args <<<"${B_ARGS:-}"
declare -A sum=([A]=0 [B]=0)
for ((i = 1; i <= rounds; ++i)); do
  for side in A B; do
    if [[ $side == A ]]; then moe=$moe_a args=("${a_args[@]}"); else moe=$moe_b args=("${b_args[@]}"); fi
    log=$out/$side-$i.log
    "$moe" bench -c "$config" "$@" "${args[@]}" >"$log" 2>&1 || { echo "$side $i failed:"; tail -5 "$log"; exit 1; }
    read_bench_log "$log"
    echo "$side $i: ${step:-?} ms | MFU ${mfu:-?}% | ${clock:-no clock} | ${memory:-?} GB | last loss ${loss:-?}"
    sum[$side]=$(awk -v s="${sum[$side]}" -v m="${step:-0}" 'BEGIN { print s + m }')
  done
done
awk -v a="${sum[A]}" -v b="${sum[B]}" -v n="$rounds" \
  'BEGIN { printf "mean of medians: A %.1f ms, B %.1f ms, B - A %+.1f ms\n", a / n, b / n, (b - a) / n }'
echo "logs: $out"

#!/usr/bin/env bash
# A against B on one GPU, kernel by kernel: `moe bench --kernels --no-steps` of the same config
# with two binaries (or two environments of one), only the listed sections, run alternately
# ROUNDS times (default 2: A B A B), since one sample of a ~2 ms kernel moves by +-0.06 ms
# between runs (BENCHMARKS.md, 2026-12-06). Prints each run's timing lines labelled with side
# and round.
# Usage: bench/ab_kernels.sh MOE_A MOE_B CONFIG SECTIONS [--section.key=value ...]
#   SECTIONS: comma-separated, of gemms, swiglu, wgrad, fp8 (moe bench --kernel-sections).
#   A_ENV / B_ENV (environment): NAME=VALUE words set for one side only, e.g.
#   B_ENV=NAME=VALUE with MOE_A = MOE_B (a variable the binary reads). OUT: where the logs go.
set -euo pipefail
source "$(dirname "$0")/common.sh"
ab_start 4 "MOE_A MOE_B CONFIG SECTIONS [--section.key=value ...]" "$@"
sections=$4
shift 4
read -r -a a_env <<<"${A_ENV:-}"
read -r -a b_env <<<"${B_ENV:-}"
for ((i = 1; i <= rounds; ++i)); do
  for side in A B; do
    if [[ $side == A ]]; then moe=$moe_a vars=("${a_env[@]}"); else moe=$moe_b vars=("${b_env[@]}"); fi
    log=$out/$side-$i.log
    env "${vars[@]}" "$moe" bench -c "$config" --kernels --no-steps --kernel-sections "$sections" "$@" >"$log" 2>&1 ||
      { echo "$side $i failed:"; tail -5 "$log"; exit 1; }
    grep -E '[0-9]ms|[0-9] ms' "$log" | sed "s/^/$side $i: /"
  done
done

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
if [[ $# -lt 4 ]]; then
  echo "usage: $0 MOE_A MOE_B CONFIG SECTIONS [--section.key=value ...]" >&2
  exit 2
fi
moe_a=$1 moe_b=$2 config=$3 sections=$4
shift 4
for b in "$moe_a" "$moe_b"; do [[ -x $b ]] || { echo "$0: $b is not an executable" >&2; exit 2; }; done
[[ -f $config ]] || { echo "$0: no config $config" >&2; exit 2; }
rounds=${ROUNDS:-2}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
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

# Sourced by the bench scripts (ab_steps.sh, ab_kernels.sh, current_figures.sh): their shared
# pieces.

# ab_start MIN_ARGS USAGE "$@": checks the argument count, the two binaries and the config;
# sets moe_a, moe_b, config, rounds (ROUNDS, default 2) and out (OUT, default a temp dir).
ab_start() {
  local min=$1 usage=$2
  shift 2
  if [[ $# -lt $min ]]; then
    echo "usage: $0 $usage" >&2
    exit 2
  fi
  moe_a=$1 moe_b=$2 config=$3
  local b
  for b in "$moe_a" "$moe_b"; do [[ -x $b ]] || { echo "$0: $b is not an executable" >&2; exit 2; }; done
  [[ -f $config ]] || { echo "$0: no config $config" >&2; exit 2; }
  rounds=${ROUNDS:-2}
  out=${OUT:-$(mktemp -d)}
  mkdir -p "$out"
}

# read_bench_log LOG: a `moe bench` log's figures, empty where the log lacks the line: step
# (median ms), loss (last), tokens (tokens/s), mfu (%), memory (device GB), clock ("SM clock N
# MHz mean").
read_bench_log() {
  local log=$1
  step=$(sed -nE 's/^steps:.*median ([0-9.]+) ms.*/\1/p' "$log")
  loss=$(sed -nE 's/^steps:.*last loss ([0-9.e+-]+).*/\1/p' "$log")
  tokens=$(sed -nE 's/^tokens\/s ([0-9]+) \| MFU ([0-9.]+)%.*/\1/p' "$log")
  mfu=$(sed -nE 's/^tokens\/s ([0-9]+) \| MFU ([0-9.]+)%.*/\2/p' "$log")
  memory=$(sed -nE 's/^device memory in use: ([0-9.]+) GB.*/\1/p' "$log")
  clock=$(grep -oE 'SM clock [0-9]+ MHz mean' "$log" | head -1 || true)
}

# Sourced by bench/ab_steps.sh and bench/ab_kernels.sh: their shared start.
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

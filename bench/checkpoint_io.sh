#!/usr/bin/env bash
# Checkpoint save and load speed (issue 19, point 3): a benchmark to run by hand, not a
# test. Trains a bench model a few steps with a checkpoint every INTERVAL steps, first
# with synchronous saves, then with checkpoint.async, then resumes the last checkpoint;
# prints each save's line (total GB/s, this rank's own shard and GB/s, the time training
# was held up) and the resume line (bytes this rank read, GB/s).
#
#   bench/checkpoint_io.sh MOE CORPUS_DIR [OUT_DIR] [-- OVERRIDES...]
#
# MODEL (environment): a configs/bench model, mixtral-mini by default. RANKS (environment):
# N > 1 launches N GPUs (`moe launch --nproc-per-node N`); THREAD_RANKS=1 runs them as
# threads on one GPU instead (a rehearsal: one GPU's PCIe and one disk shared). DEVICE
# (environment): cuda (default) or cpu. STEPS (default 6) and INTERVAL (default 2);
# STEPS=INTERVAL saves once per mode (the synchronous run's checkpoints are deleted before
# the asynchronous run, which the resume reads, then deleted too). MODES (default
# "sync async"): the modes to run (the resume needs async).
# The figures go to BENCHMARKS.md: per rank save GB/s (the "this rank's shard" figure),
# load GB/s (the resume line) and the pause with checkpoint.async ("training paused").
set -euo pipefail
if [[ $# -lt 2 ]]; then
  sed -n '2,15p' "$0" >&2
  exit 2
fi
moe=$1 corpus=$2
out=${3:-checkpoint_io_$(date +%Y%m%d_%H%M%S)}
shift $(( $# >= 3 ? 3 : 2 ))
[[ $# -gt 0 && $1 == -- ]] && shift
model=${MODEL:-mixtral-mini} ranks=${RANKS:-1} steps=${STEPS:-6} interval=${INTERVAL:-2}
[[ -x $moe ]] || { echo "$0: $moe is not an executable" >&2; exit 2; }
[[ -d $corpus ]] || { echo "$0: corpus directory $corpus does not exist" >&2; exit 2; }
[[ -e $out ]] && { echo "$0: $out exists; give a fresh folder" >&2; exit 2; }
mkdir -p "$out"

launch() {
  if (( ranks <= 1 )); then "$moe" "$@"
  elif [[ -n ${THREAD_RANKS:-} ]]; then "$moe" "$1" --thread-ranks "$ranks" "${@:2}"
  else "$moe" launch --nproc-per-node "$ranks" -- "$@"; fi
}
run=(-c "configs/bench/$model.toml" --device "${DEVICE:-cuda}" --data.dir="$corpus" --training.steps="$steps"
     --checkpoint.interval="$interval" --checkpoint.keep_last=2 --metrics.log_interval=1 "$@")

for mode in ${MODES:-sync async}; do
  echo "== $model, $ranks rank(s), checkpoint.async = $([[ $mode == async ]] && echo true || echo false)"
  launch train "${run[@]}" --checkpoint.dir="$out/ckpt_$mode" --checkpoint.async="$([[ $mode == async ]] && echo true || echo false)" \
    > "$out/$mode.txt" 2>&1
  grep -E "^checkpoint:" "$out/$mode.txt" | sed 's/^/  /'
  grep -E "^summary:" "$out/$mode.txt" | grep -oE "checkpoint_seconds=[0-9.]+" | sed 's/^/  held up in all: /'
  # One mixtral-mini checkpoint (57 GB) is all the H200 machine's 64 GB disk holds.
  [[ $mode == sync ]] && rm -rf "$out/ckpt_sync"
done
echo "== resume of the last asynchronous checkpoint, $ranks rank(s)"
last=$(ls -d "$out/ckpt_async"/step_* | sort | tail -1)
launch train "${run[@]}" --training.steps="$((steps + 1))" --checkpoint.dir= --resume "$last" \
  > "$out/resume.txt" 2>&1
grep -E "^resume:" "$out/resume.txt" | sed 's/^/  /'
du -sh "$last" | sed 's/^/  checkpoint size: /'
rm -rf "$out/ckpt_async" "$out/ckpt_resume"

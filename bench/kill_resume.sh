#!/usr/bin/env bash
# A run killed with SIGKILL at random moments and continued each time with --resume auto
# ends with the uninterrupted run's weights, bit for bit (training.deterministic).
#
#   bench/kill_resume.sh MOE CONFIG OUT [KILLS] [SEED] [-- OVERRIDES...]
#
# MOE: the moe binary; CONFIG: a run config; OUT: a fresh folder for the two runs. The
# uninterrupted run goes to OUT/whole, the killed one to OUT/killed (each with its own
# checkpoint.dir, a checkpoint every checkpoint.interval steps: set it in the config or
# the overrides, and make training.steps a multiple of it so both runs save the last
# step). KILLS random steps are drawn (SEED fixes them); each segment is killed a random
# 0-400 ms after printing its step, then continued with --resume auto. Then the final
# checkpoints' tensors are compared name by name, byte for byte.
# Prints one line per kill and a last line `kill_resume: kills=N identical=yes|no ...`;
# exits 0 only when the weights are identical.
set -euo pipefail
if [[ $# -lt 3 ]]; then
  sed -n '2,15p' "$0" >&2
  exit 2
fi
MOE=$1 CONFIG=$2 OUT=$3
shift 3
KILLS=5 SEED=$RANDOM
if [[ $# -gt 0 && $1 != -- ]]; then KILLS=$1; shift; fi
if [[ $# -gt 0 && $1 != -- ]]; then SEED=$1; shift; fi
[[ $# -gt 0 && $1 == -- ]] && shift
OVERRIDES=("$@" --metrics.log_interval=1)
[[ -x $MOE ]] || { echo "kill_resume: $MOE is not an executable" >&2; exit 2; }
[[ -f $CONFIG ]] || { echo "kill_resume: no config file $CONFIG" >&2; exit 2; }
[[ -e $OUT ]] && { echo "kill_resume: $OUT exists; give a fresh folder" >&2; exit 2; }
mkdir -p "$OUT"
RANDOM=$SEED

now() { date +%s.%N; }

start=$(now)
"$MOE" train --config "$CONFIG" "${OVERRIDES[@]}" --checkpoint.dir="$OUT/whole/ckpt" --metrics.dir="$OUT/whole/metrics" \
  >"$OUT/whole.log" 2>&1
wall=$(awk -v a="$(now)" -v b="$start" 'BEGIN { printf "%.3f", a - b }')
echo "uninterrupted: ${wall}s"

# KILLS distinct random steps in [2, steps - 1], in order: segment i is killed once its
# log shows step target_i, after a further random 0-400 ms (inside the next step, a
# validation or a checkpoint write).
steps=$(grep -o 'step *[0-9]*/[0-9]*' "$OUT/whole.log" | tail -1 | cut -d/ -f2)
[[ -n $steps && $steps -gt $((KILLS + 2)) ]] || { echo "kill_resume: the run has too few steps ($steps) for $KILLS kills" >&2; exit 2; }
targets=($(seq 2 $((steps - 1)) | shuf -n "$KILLS" --random-source=<(yes "$SEED") | sort -n))
echo "kill after steps: ${targets[*]}"
kills=0 segment=0 pid=
trap '[[ -n $pid ]] && kill -9 "$pid" 2>/dev/null; true' EXIT  # never leave a trainer behind
while true; do
  segment=$((segment + 1))
  log="$OUT/killed_$segment.log"
  "$MOE" train --config "$CONFIG" "${OVERRIDES[@]}" --checkpoint.dir="$OUT/killed/ckpt" \
    --metrics.dir="$OUT/killed/metrics" --resume auto >"$log" 2>&1 &
  pid=$!
  if [[ $kills -lt ${#targets[@]} ]]; then
    target=${targets[$kills]}
    while kill -0 "$pid" 2>/dev/null; do
      last=$(grep -o '^step *[0-9]*/' "$log" | tail -1 | tr -dc '0-9' || true)
      [[ -n $last && $last -ge $target ]] && break
      sleep 0.02
    done
    delay_ms=$((RANDOM % 400))
    sleep "$(awk -v d="$delay_ms" 'BEGIN { printf "%.3f", d / 1000 }')"
    if kill -9 "$pid" 2>/dev/null; then
      wait "$pid" 2>/dev/null || true
      kills=$((kills + 1))
      echo "kill $kills: SIGKILL ${delay_ms} ms after step $target was printed (segment $segment)"
      continue
    fi
  fi
  wait "$pid" || { echo "kill_resume: segment $segment failed (see $log)" >&2; exit 1; }
  break
done

latest() { find "$1" -maxdepth 1 -name 'step_*' -type d | sort | tail -1; }
whole_ckpt=$(latest "$OUT/whole/ckpt")
killed_ckpt=$(latest "$OUT/killed/ckpt")
PYTHON=${PYTHON:-python3}
"$PYTHON" - "$whole_ckpt" "$killed_ckpt" "$kills" <<'EOF'
# Compares every tensor of two checkpoints' rank shards byte for byte (safetensors: an
# 8-byte header length, a JSON header of name -> dtype, shape, offsets, then the data).
import glob, json, os, struct, sys

def tensors(ckpt):
    out = {}
    for path in sorted(glob.glob(os.path.join(ckpt, "rank_*.safetensors"))):
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            data = f.read()
        for name, t in header.items():
            if name == "__metadata__":
                continue
            a, b = t["data_offsets"]
            out[(os.path.basename(path), name)] = data[a:b]
    return out

whole, killed, kills = sys.argv[1], sys.argv[2], sys.argv[3]
a, b = tensors(whole), tensors(killed)
differ = sorted(k[1] for k in a if k not in b or a[k] != b[k])
same_step = os.path.basename(whole) == os.path.basename(killed)
ok = same_step and not differ and len(a) == len(b) and len(a) > 0
print(f"kill_resume: kills={kills} final={os.path.basename(killed)} tensors={len(a)} "
      f"bytes={sum(len(v) for v in a.values())} differing={len(differ)} identical={'yes' if ok else 'no'}"
      + (f" first_differing={differ[0]}" if differ else ""))
sys.exit(0 if ok else 1)
EOF

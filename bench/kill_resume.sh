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
# step). Each kill comes at a random moment between 10% and 90% of the uninterrupted
# run's wall time after that segment starts (SEED fixes the moments). Then the final
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
OVERRIDES=("$@")
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

kills=0 segment=0
while true; do
  segment=$((segment + 1))
  log="$OUT/killed_$segment.log"
  "$MOE" train --config "$CONFIG" "${OVERRIDES[@]}" --checkpoint.dir="$OUT/killed/ckpt" \
    --metrics.dir="$OUT/killed/metrics" --resume auto >"$log" 2>&1 &
  pid=$!
  if [[ $kills -lt $KILLS ]]; then
    # A moment between 10% and 90% of the whole run's time, in milliseconds.
    delay_ms=$(awk -v w="$wall" -v r="$RANDOM" 'BEGIN { printf "%d", w * 1000 * (0.1 + 0.8 * r / 32767) }')
    deadline=$(awk -v a="$(now)" -v d="$delay_ms" 'BEGIN { printf "%.3f", a + d / 1000 }')
    while kill -0 "$pid" 2>/dev/null && awk -v a="$(now)" -v d="$deadline" 'BEGIN { exit !(a < d) }'; do sleep 0.05; done
    if kill -9 "$pid" 2>/dev/null; then
      wait "$pid" 2>/dev/null || true
      kills=$((kills + 1))
      last=$(grep -o 'step *[0-9]*/' "$log" | tail -1 | tr -dc '0-9' || true)
      echo "kill $kills: SIGKILL after ${delay_ms} ms of segment $segment (last step printed: ${last:-none})"
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

#!/usr/bin/env bash
# Mutation audit of the CPU test suite (not part of CI; see docs/TESTING.md).
#
#   scripts/mutants.sh BUILD_DIR [NAME_REGEX]
#
# BUILD_DIR: a CPU-only build directory (cmake -S . -B BUILD_DIR -G Ninja
# -DCMAKE_BUILD_TYPE=Release -DMOE_ENABLE_CUDA=OFF); it is configured here if empty.
# NAME_REGEX: only the mutants whose name matches (e.g. 'train/' or 'clip').
#
# Each mutant below is one small, plausible bug in a CPU source file: a file and an exact
# text that must occur in it exactly once (else the script stops: the source moved on and
# the mutant must be updated), and its replacement. One at a time, the mutant is applied,
# the tree is built incrementally, the cpu|mpi suite runs (stopping at the first failure),
# and the file is restored, always, even on Ctrl-C. A mutant is caught when a test fails;
# a build failure makes it invalid (counted apart). The report lists the survivors.
#
# Environment: MUTANTS_CHECK_ONLY=1 (only check that every mutant applies, and list them),
# MUTANTS_JOBS (ctest and build parallelism, default 2), MUTANTS_SKIP_BASELINE=1
# (skip the unmutated build-and-test run that must pass first), MUTANTS_TIMEOUT (seconds per
# test, default 600).
set -uo pipefail

usage() { echo "usage: scripts/mutants.sh BUILD_DIR [NAME_REGEX]" >&2; exit 2; }
[[ $# -ge 1 && $# -le 2 ]] || usage
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$(mkdir -p "$1" && cd "$1" && pwd)
FILTER=${2:-}
JOBS=${MUTANTS_JOBS:-2}
TIMEOUT=${MUTANTS_TIMEOUT:-600}
LOGS="$BUILD/mutants"
mkdir -p "$LOGS"

NAMES=() FILES=() OLDS=() NEWS=()
# mutant NAME FILE OLD NEW: NAME is layer/what, FILE relative to the repository root.
mutant() { NAMES+=("$1"); FILES+=("$2"); OLDS+=("$3"); NEWS+=("$4"); }

# --- train ---------------------------------------------------------------------------
mutant train/grad-clip-squared-norm src/optim/grad_clip.cpp \
  'if (max_expert_norm > 0 && norm > max_expert_norm) {' \
  'if (max_expert_norm > 0 && sq > max_expert_norm) {'
mutant train/lr-linear-decay src/optim/lr_schedule.cpp \
  '0.5 * (1.0 + std::cos(M_PI * progress))' \
  '(1.0 - progress)'
mutant train/lr-warmup-off-by-one src/optim/lr_schedule.cpp \
  'static_cast<double>(step + 1) / static_cast<double>(lr.warmup_steps)' \
  'static_cast<double>(step) / static_cast<double>(lr.warmup_steps)'
mutant train/bias-never-updated src/train/trainer.cpp \
  'for (auto* layer : model_.moe_layers()) layer->update_balancing_bias();' \
  'for (auto* layer : model_.moe_layers()) (void)layer;'
mutant train/validation-not-reset src/train/trainer.cpp \
  '  val_data_->reset();' \
  ''
mutant train/entropy-per-assignment src/train/trainer.cpp \
  'routing.entropy_sum / static_cast<double>(routing.tokens)' \
  'routing.entropy_sum / static_cast<double>(routing.tokens * config.moe.top_k)'
mutant train/accumulation-sums src/train/trainer.cpp \
  'const double scale = 1.0 / static_cast<double>(micro_steps_);' \
  'const double scale = 1.0;'
mutant train/adamw-decays-norms src/optim/adamw.cpp \
  'const float decay = params_.spec(id).weight_decay ? s.decay_factor : 1.0f;' \
  'const float decay = s.decay_factor;'
mutant train/prune-keeps-one-more src/train/checkpoint.cpp \
  'static_cast<int64_t>(complete.size()) - keep_last;' \
  'static_cast<int64_t>(complete.size()) - keep_last - 1;'
mutant train/config-top-k-unbounded src/config/run_config.cpp \
  'if (e.top_k < 1 || e.top_k > e.n_experts)' \
  'if (e.top_k < 1)'
mutant train/plan-ordered-before-recompute src/train/memory_plan.cpp \
  'std::make_tuple(f.layout.ordered_attention != ordered_attention, recompute_rank(f.layout), f.layout.zero,' \
  'std::make_tuple(recompute_rank(f.layout), f.layout.ordered_attention != ordered_attention, f.layout.zero,'
mutant train/plan-shared-gate-up-half src/train/memory_plan.cpp \
  'if (share_gate_up) m.recompute_set += RL * 2 * a.F * 2;' \
  'if (share_gate_up) m.recompute_set += RL * a.F * 2;'
mutant train/plan-scratch-without-attention src/train/memory_plan.cpp \
  'attention_workspace_estimate(a.B, a.H, a.S, a.d, attention_dq_of(config, layout)));' \
  'int64_t{0});'
mutant train/plan-split-rank-least src/train/memory_plan.cpp \
  'if (rank.total() > state.total()) state = rank;' \
  'if (rank.total() < state.total()) state = rank;'
mutant train/batch-halving-keeps-steps src/train/batch_controller.cpp \
  '    plan.micro_steps *= 2;' \
  ''
mutant train/batch-limit-inclusive src/train/batch_controller.cpp \
  'if (bytes > limit_bytes) {' \
  'if (bytes >= limit_bytes) {'
mutant train/shard-size-unchecked src/train/checkpoint_shards.cpp \
  'if (static_cast<uint64_t>(st.st_size) != entry.bytes)' \
  'if (false)'
mutant train/shard-foreign-rank-accepted src/train/checkpoint_shards.cpp \
  'if (meta("save_id") != manifest.save_id || meta("rank") != std::to_string(entry.rank))' \
  'if (meta("save_id") != manifest.save_id)'
mutant train/shard-piece-hash-skipped src/train/checkpoint_shards.cpp \
  'if (!piece.hash.empty() &&' \
  'if (piece.hash.empty() &&'

# --- config --------------------------------------------------------------------------
mutant config/gemm-backend-fp8-key-only src/config/training_config.h \
  'return p == TrainingPrecision::Fp8 ? fp8_gemm_backend : bf16_gemm_backend;' \
  'return fp8_gemm_backend;'
mutant config/query-chunks-past-the-sequence src/config/config_rules.cpp \
  'if (t.attention_query_chunks < 1 || t.attention_query_chunks > c.model.seq_len)' \
  'if (t.attention_query_chunks < 1)'
mutant model/attention-chunk-rows-whole src/model/gpu_buffer_sizes.cpp \
  'const int64_t rows = seq - seq * (chunks - 1) / chunks;' \
  'const int64_t rows = seq;'
mutant config/deepgemm-any-dims src/config/config_rules.cpp \
  'if (c.model.dim % 128 != 0 || c.model.moe.expert_hidden % 128 != 0)' \
  'if (false)'
mutant config/gemm-backend-bf16-key-only src/config/training_config.h \
  'return p == TrainingPrecision::Fp8 ? fp8_gemm_backend : bf16_gemm_backend;' \
  'return bf16_gemm_backend;'
mutant optim/fp8-moments-no-floor src/kernels/adamw_math.h \
  'return positive_floor && code == 0 && value > 0.0f ? uint8_t{1} : code;' \
  'return code;'
mutant optim/fp8-moments-scale-one-too-small src/kernels/adamw_math.h \
  '((u & 0x7fffffu) > 0x600000u ? 1 : 0)' \
  '((u & 0x7fffffu) > 0x700000u ? 1 : 0)'
mutant optim/fp8-moments-v-coded-as-v src/kernels/adamw_math.h \
  'const uint8_t xv = moment_block_codes(v, n, true, index, step, codes);' \
  'const uint8_t xv = moment_block_codes(v, n, false, index, step, codes);'
mutant optim/fp8-moments-rounding-biased src/kernels/adamw_math.h \
  'uint32_t code = (w >> 20) - 960u + (w << 12 > r ? 1u : 0u);' \
  'uint32_t code = (w >> 20) - 960u + (w << 12 > r / 2 ? 1u : 0u);'
mutant train/plan-fp8-scales-left-out src/train/memory_plan.cpp \
  'if (fp8) state.moments += packed' \
  'if (false) state.moments += packed'
mutant config/fp8-moments-with-expert-parallel src/config/config_rules.cpp \
  'if (c.optimizer.state_dtype == MomentDtype::Fp8 && p.expert_parallel > 1)' \
  'if (false)'

# --- dist ----------------------------------------------------------------------------
mutant dist/sharded-clip-squared-norm src/train/backends/parallel_cpu_backend.cpp \
  'if (max_expert_norm > 0 && norm > max_expert_norm) {' \
  'if (max_expert_norm > 0 && sums[i] > max_expert_norm) {'
mutant dist/ep-clip-squared-norm src/dist/expert_optimizer.cpp \
  'if (max_norm > 0 && norm > max_norm) {' \
  'if (max_norm > 0 && sq > max_norm) {'
mutant dist/entropy-per-assignment src/train/backends/parallel_cpu_backend.cpp \
  'r.router_entropy = tokens > 0 ? s[2 * E + 1] / tokens : 0;' \
  'r.router_entropy = tokens > 0 ? s[2 * E + 1] / (tokens * m.moe.top_k) : 0;'
mutant dist/bias-never-updated src/train/backends/parallel_cpu_backend.cpp \
  'layers[i]->update_balancing_bias();' \
  '(void)layers[i];'
mutant dist/zero-expert-scale-offset src/dist/zero_optimizer.cpp \
  'grad_[static_cast<size_t>(at + i)] *= factors[static_cast<size_t>(group * E + (first + i) / per_expert)];' \
  'grad_[static_cast<size_t>(at + i)] *= factors[static_cast<size_t>(group * E + i / per_expert)];'
mutant dist/reduce-max-is-min src/dist/comm_util.cpp \
  'inout[i] = std::max(inout[i], in[i]);' \
  'inout[i] = std::min(inout[i], in[i]);'
mutant data/rank-slices-contiguous src/data/rank_sliced_source.cpp \
  'const size_t from = static_cast<size_t>(b * world_ + rank_) * S' \
  'const size_t from = static_cast<size_t>(rank_ * batch + b) * S'

# --- model ---------------------------------------------------------------------------
mutant model/entropy-tokens-times-k src/model/moe_layer.cpp \
  'routing_.tokens += T_;' \
  'routing_.tokens += T_ * K_;'
# (Not a mutant: positions counted across the micro-batch instead of per sequence. RoPE
# depends on position differences only, so it changes nothing beyond rounding.)
mutant model/capacity-per-rank src/model/moe_layer.cpp \
  'expert_capacity(cfg_.capacity_factor, T_ * batch_ranks, K_, E_)' \
  'expert_capacity(cfg_.capacity_factor, T_, K_, E_)'
mutant model/backward-stage-off-by-one src/model/transformer.cpp \
  'return L - layer;' \
  'return L - layer - 1;'

# --- moe -----------------------------------------------------------------------------
mutant moe/capacity-keeps-one-more src/moe/dispatch.cpp \
  '} else if (counts_E[e] < capacity) {' \
  '} else if (counts_E[e] <= capacity) {'
mutant moe/capacity-floor src/moe/dispatch.cpp \
  'nearest : std::ceil(exact);' \
  'nearest : std::floor(exact);'
mutant moe/top-k-ties-higher-index src/moe/router.cpp \
  'if (best < 0 || ke > best_key) {' \
  'if (best < 0 || ke >= best_key) {'
mutant moe/z-loss-gradient-halved src/moe/router.cpp \
  'const double scale = dloss * coef * 2.0 / double(T_) * inv_temp;' \
  'const double scale = dloss * coef / double(T_) * inv_temp;'

# --- kernels/cpu ---------------------------------------------------------------------
mutant kernels/rmsnorm-mean-over-d-minus-1 src/kernels/cpu/rmsnorm.cpp \
  'sum_sq / T(D) + T(eps)' \
  'sum_sq / T(D - 1) + T(eps)'
mutant kernels/rmsnorm-dw-without-rstd src/kernels/cpu/rmsnorm.cpp \
  'sum[c - c0] += dy[c] * x[c] * rstd;' \
  'sum[c - c0] += dy[c] * x[c];'
mutant kernels/cross-entropy-mean-over-ignored src/kernels/cpu/cross_entropy.cpp \
  'return total / static_cast<double>(n_valid);' \
  'return total / static_cast<double>(T_);'
mutant kernels/attention-sees-next-token src/kernels/cpu/attention.cpp \
  'causal_softmax_row(p + i * S, i, S);' \
  'causal_softmax_row(p + i * S, std::min(i + 1, S - 1), S);'
mutant kernels/embedding-backward-overwrites src/kernels/cpu/embedding.cpp \
  'for (int64_t c = c0; c < c1; ++c) drow[c] += g[c];' \
  'for (int64_t c = c0; c < c1; ++c) drow[c] = g[c];'
mutant kernels/swiglu-derivative src/kernels/cpu/swiglu.cpp \
  '(T(1) + x * (T(1) - s))' \
  '(T(1) + x * s)'

# --- data ----------------------------------------------------------------------------
mutant data/loader-ranks-overlap src/data/loader.cpp \
  'state_.position += seq_len_ * world_size_;' \
  'state_.position += seq_len_;'
mutant data/loader-epoch-without-eos src/data/loader.cpp \
  'tokens_per_epoch_ = docs.n_docs();' \
  'tokens_per_epoch_ = 0;'
mutant data/shard-doc-count src/data/shard.cpp \
  'h.n_docs = index_.size() - 1;' \
  'h.n_docs = index_.size();'
mutant data/bpe-rightmost-merge src/data/bpe.cpp \
  'if (m < best) best = m, at = i;' \
  'if (m <= best) best = m, at = i;'

# --- obs -----------------------------------------------------------------------------
mutant obs/imbalance-ratio src/obs/metrics.cpp \
  'return static_cast<double>(max_load) / mean - 1.0;' \
  'return static_cast<double>(max_load) / mean;'
mutant obs/cv-sample-variance src/obs/metrics.cpp \
  'return std::sqrt(sq / n) / mean;' \
  'return std::sqrt(sq / (n - 1)) / mean;'
mutant obs/tensorboard-mask-rotation src/obs/tensorboard.cpp \
  'return ((c >> 15) | (c << 17)) + 0xA282EAD8u;' \
  'return ((c >> 17) | (c << 15)) + 0xA282EAD8u;'
mutant obs/alert-never-clears src/obs/alerts.cpp \
  '      active_.erase(it);' \
  ''

# --- core ----------------------------------------------------------------------------
mutant core/span-cut-empty-pieces src/core/span_cut.cpp \
  'if (from < to) pieces.push_back' \
  'if (from <= to) pieces.push_back'
mutant core/philox-nine-rounds src/core/rng.cpp \
  'for (int round = 0; round < 10; ++round)' \
  'for (int round = 0; round < 9; ++round)'
mutant core/arena-measures-unaligned src/core/arena.cpp \
  '    used_ += aligned;
    high_water_ = std::max(high_water_, used_);
    return Tensor(nullptr, dtype, shape);' \
  '    used_ += bytes;
    high_water_ = std::max(high_water_, used_);
    return Tensor(nullptr, dtype, shape);'

# --- cli -----------------------------------------------------------------------------
mutant cli/config-error-exit-1 src/cli/main.cpp \
  'moe::dist::abort_mpi_world_if_running(2);  // the other ranks may wait in a collective
    return 2;' \
  'moe::dist::abort_mpi_world_if_running(2);  // the other ranks may wait in a collective
    return 1;'
mutant cli/unknown-command-exit-0 src/cli/main.cpp \
  '<< known << ")\n";
    return 2;' \
  '<< known << ")\n";
    return 0;'

# -------------------------------------------------------------------------------------

# count FILE TEXT: how many times TEXT occurs in FILE.
count() { python3 -c 'import sys; print(open(sys.argv[1], "rb").read().count(sys.argv[2].encode()))' "$1" "$2"; }
# replace FILE OLD NEW (OLD occurs exactly once, checked before).
replace() {
  python3 -c 'import sys
p, old, new = sys.argv[1], sys.argv[2].encode(), sys.argv[3].encode()
s = open(p, "rb").read()
open(p, "wb").write(s.replace(old, new, 1))' "$1" "$2" "$3"
}

SELECTED=()
for i in "${!NAMES[@]}"; do
  [[ -z "$FILTER" || "${NAMES[$i]}" =~ $FILTER ]] && SELECTED+=("$i")
done
[[ ${#SELECTED[@]} -gt 0 ]] || { echo "mutants: no mutant matches '$FILTER'" >&2; exit 2; }

# Every selected mutant must still apply exactly once, and its file must be unmodified
# (a leftover of an interrupted run would otherwise be taken for the original).
bad=0
for i in "${SELECTED[@]}"; do
  f="$ROOT/${FILES[$i]}"
  case "${FILES[$i]}" in *.cu | */cuda/*) echo "mutants: ${NAMES[$i]}: ${FILES[$i]} is CUDA code" >&2; bad=1; continue ;; esac
  [[ -f "$f" ]] || { echo "mutants: ${NAMES[$i]}: ${FILES[$i]} does not exist" >&2; bad=1; continue; }
  n=$(count "$f" "${OLDS[$i]}")
  if [[ "$n" != 1 ]]; then
    echo "mutants: ${NAMES[$i]}: its text occurs $n times in ${FILES[$i]} (must be once): update the mutant" >&2
    bad=1
  fi
  if ! git -C "$ROOT" diff --quiet -- "${FILES[$i]}"; then
    echo "mutants: ${FILES[$i]} has uncommitted changes (a leftover mutant?): commit or restore it first" >&2
    bad=1
  fi
done
[[ $bad == 0 ]] || exit 2
if [[ "${MUTANTS_CHECK_ONLY:-0}" == 1 ]]; then
  for i in "${SELECTED[@]}"; do printf '%-42s %s\n' "${NAMES[$i]}" "${FILES[$i]}"; done
  echo "mutants: all ${#SELECTED[@]} apply"
  exit 0
fi

BACKUP=$(mktemp -d)
CURRENT=""  # index of the applied mutant, if any
restore() {
  if [[ -n "$CURRENT" ]]; then
    # A fresh modification time, so that the build recompiles the restored file.
    cp "$BACKUP/original" "$ROOT/${FILES[$CURRENT]}"
    CURRENT=""
  fi
}
cleanup() { restore; rm -rf "$BACKUP"; }
trap cleanup EXIT
trap 'echo; echo "mutants: interrupted; the source is restored" >&2; exit 130' INT TERM

build() { cmake --build "$BUILD" -j "$JOBS" >"$1" 2>&1; }
suite() {
  ctest --test-dir "$BUILD" -L 'cpu|mpi' -j "$JOBS" --stop-on-failure --output-on-failure --timeout "$TIMEOUT" >"$1" 2>&1
}
first_failure() { grep -m1 -E '\*\*\*(Failed|Timeout|Exception)|Failed +[0-9.]+ sec' "$1" | sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: //; s/ +\.+.*//'; }

if [[ ! -f "$BUILD/build.ninja" && ! -f "$BUILD/Makefile" ]]; then
  echo "mutants: configuring $BUILD (CPU only)"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ENABLE_CUDA=OFF >"$LOGS/configure.log" 2>&1 ||
    { echo "mutants: configure failed, see $LOGS/configure.log" >&2; exit 1; }
fi
if [[ "${MUTANTS_SKIP_BASELINE:-0}" != 1 ]]; then
  echo "mutants: baseline (unmutated) build and suite"
  build "$LOGS/baseline.build.log" || { echo "mutants: the unmutated tree does not build, see $LOGS/baseline.build.log" >&2; exit 1; }
  suite "$LOGS/baseline.test.log" ||
    { echo "mutants: the unmutated suite fails ($(first_failure "$LOGS/baseline.test.log")), see $LOGS/baseline.test.log" >&2; exit 1; }
fi

caught=0 invalid=0 total=0
survivors=() invalids=()
start=$(date +%s)
for i in "${SELECTED[@]}"; do
  name=${NAMES[$i]} log="$LOGS/${NAMES[$i]//\//_}"
  total=$((total + 1))
  cp "$ROOT/${FILES[$i]}" "$BACKUP/original"
  CURRENT=$i
  replace "$ROOT/${FILES[$i]}" "${OLDS[$i]}" "${NEWS[$i]}"
  t0=$(date +%s)
  if ! build "$log.build.log"; then
    verdict="invalid (does not build)"
    invalid=$((invalid + 1)) invalids+=("$name")
  elif suite "$log.test.log"; then
    verdict="SURVIVED"
    survivors+=("$name")
  else
    verdict="caught by $(first_failure "$log.test.log")"
    caught=$((caught + 1))
  fi
  restore
  printf '%-42s %s (%ss)\n' "$name" "$verdict" $(($(date +%s) - t0))
done
echo "mutants: rebuilding the unmutated tree"
build "$LOGS/final.build.log" || echo "mutants: warning: the final rebuild failed, see $LOGS/final.build.log" >&2

valid=$((total - invalid))
echo
echo "mutants: $caught of $valid caught ($((valid > 0 ? 100 * caught / valid : 0))%), $invalid invalid, $total in all," \
  "$(( ($(date +%s) - start) / 60 )) min"
[[ ${#survivors[@]} -eq 0 ]] || printf 'survived: %s\n' "${survivors[@]}"
[[ ${#invalids[@]} -eq 0 ]] || printf 'invalid: %s\n' "${invalids[@]}"
[[ ${#survivors[@]} -eq 0 ]]

// The [training] section: steps, batch, devices, clipping, faults and the GPU's memory and
// speed switches (docs/CONFIG.md describes every key).
#pragma once
#include <array>
#include <cstdint>

#include "config/enum_names.h"

namespace moe {

// Where the model trains; Auto: a GPU when the CUDA backend has one.
enum class TrainingDevice { Auto, Cpu, Cuda };
inline constexpr std::array<EnumName<TrainingDevice>, 3> kTrainingDeviceNames{
    {{TrainingDevice::Auto, "auto"}, {TrainingDevice::Cpu, "cpu"}, {TrainingDevice::Cuda, "cuda"}}};
constexpr std::span<const EnumName<TrainingDevice>> enum_names(TrainingDevice) { return kTrainingDeviceNames; }

// What the GPU's MoE layers recompute in the backward instead of keeping: nothing, the
// SwiGLU activations (kept: the gate/up rows), or the gate/up GEMM too (kept: the
// permuted input rows only). Bit-identical results either way.
enum class ExpertRecompute { None, Swiglu, All };
inline constexpr std::array<EnumName<ExpertRecompute>, 3> kExpertRecomputeNames{
    {{ExpertRecompute::None, "none"}, {ExpertRecompute::Swiglu, "swiglu"}, {ExpertRecompute::All, "all"}}};
constexpr std::span<const EnumName<ExpertRecompute>> enum_names(ExpertRecompute) { return kExpertRecomputeNames; }

// Storage of the expert tensors' gradients on the GPU: fp32, or bf16 (fp32 accumulation
// inside each grouped weight-gradient GEMM, one rounding per micro-batch; the fp32 master
// weights stay). docs/MEMORY_PLAN.md.
enum class GradDtype { Fp32, Bf16 };
inline constexpr std::array<EnumName<GradDtype>, 2> kGradDtypeNames{
    {{GradDtype::Fp32, "fp32"}, {GradDtype::Bf16, "bf16"}}};
constexpr std::span<const EnumName<GradDtype>> enum_names(GradDtype) { return kGradDtypeNames; }
// The precision of the experts' and the dense projections' GEMMs on the GPU: bf16, or fp8
// (e4m3 with 1x128 activation and 128x128 weight scales, docs/FP8.md) for their forward
// and data-gradient GEMMs (a projection whose shape the dense FP8 GEMM does not take stays
// bf16); weight gradients, master weights and everything else stay as in bf16.
enum class TrainingPrecision { Bf16, Fp8 };
inline constexpr std::array<EnumName<TrainingPrecision>, 2> kTrainingPrecisionNames{
    {{TrainingPrecision::Bf16, "bf16"}, {TrainingPrecision::Fp8, "fp8"}}};
constexpr std::span<const EnumName<TrainingPrecision>> enum_names(TrainingPrecision) { return kTrainingPrecisionNames; }

// training.fp8_weight_gradients: the scales of the weight-gradient GEMMs' B operand (x's and
// act's token columns): one per feature and 128 tokens (1x128, as every activation), or one
// per 128 features and 128 tokens (128x128: CUTLASS's faster blockwise kernel, coarser
// scales; docs/FP8.md). dy's columns (the A operand) stay 1x128 either way.
// GPU: the GEMMs' kernels. training.fp8_gemm_backend (fp8 runs): CUTLASS's blockwise-scaled
// ones, or DeepGEMM's (an H100 / H200, no expert parallelism): the experts' forward and
// data-gradient GEMMs over rows padded per expert to 128 (cuda::PaddedExpertGemmFp8) and the
// dense projections' that do not accumulate. training.bf16_gemm_backend (bf16 runs): the
// experts' grouped GEMMs, CUTLASS's or DeepGEMM's over rows padded the same way
// (cuda::PaddedExpertGemmBf16). Auto: DeepGEMM's where the run allows it and the GPU runs
// it, as the launch resolves it (gemm_backend_for); unresolved, CUTLASS's.
enum class GemmBackend { Auto, Cutlass, DeepGemm };
// DeepGEMM's grouped kernels are compiled for at most this many experts (cuda::PaddedExpertGemm*).
inline constexpr int64_t kDeepGemmMaxExperts = 256;
inline constexpr std::array<EnumName<GemmBackend>, 3> kGemmBackendNames{
    {{GemmBackend::Auto, "auto"}, {GemmBackend::Cutlass, "cutlass"}, {GemmBackend::DeepGemm, "deepgemm"}}};
constexpr std::span<const EnumName<GemmBackend>> enum_names(GemmBackend) { return kGemmBackendNames; }

// GPU, training.deterministic = true: how the attention backward sums dQ over the key/value
// tiles in a fixed order. Workspace: cuDNN's dP decomposition (a B x H x S x S bf16 buffer,
// then a dQ GEMM); Ordered: the tiles add into dQ one after another (cuDNN >= 9.25 on a
// Hopper GPU; workspace linear in S). Both bit-identical from run to run (docs/DETERMINISM.md).
enum class DeterministicAttention { Workspace, Ordered };
inline constexpr std::array<EnumName<DeterministicAttention>, 2> kDeterministicAttentionNames{
    {{DeterministicAttention::Workspace, "workspace"}, {DeterministicAttention::Ordered, "ordered"}}};
constexpr std::span<const EnumName<DeterministicAttention>> enum_names(DeterministicAttention) {
  return kDeterministicAttentionNames;
}

// How the GPU's attention backward sums dQ over the key/value tiles, as training.deterministic
// and deterministic_attention choose it: atomics (dQ's last bits differ from run to run), the
// dP workspace or the ordered tiles. The names say so in `moe bench` and `moe plan`.
enum class AttentionDq { Atomic, Workspace, Ordered };
inline constexpr std::array<EnumName<AttentionDq>, 3> kAttentionDqNames{
    {{AttentionDq::Atomic, "dQ summed by atomics (not deterministic)"},
     {AttentionDq::Workspace, "deterministic, dQ through a B x H x S x S dP workspace"},
     {AttentionDq::Ordered, "deterministic, dQ's tiles added in order"}}};
constexpr std::span<const EnumName<AttentionDq>> enum_names(AttentionDq) { return kAttentionDqNames; }
constexpr AttentionDq attention_dq(bool deterministic, DeterministicAttention form) {
  if (!deterministic) return AttentionDq::Atomic;
  return form == DeterministicAttention::Ordered ? AttentionDq::Ordered : AttentionDq::Workspace;
}

enum class Fp8ColumnScales { Tile1x128, Block128x128 };
inline constexpr std::array<EnumName<Fp8ColumnScales>, 2> kFp8ColumnScalesNames{
    {{Fp8ColumnScales::Tile1x128, "1x128"}, {Fp8ColumnScales::Block128x128, "128x128"}}};
constexpr std::span<const EnumName<Fp8ColumnScales>> enum_names(Fp8ColumnScales) { return kFp8ColumnScalesNames; }

struct TrainingConfig {
  int64_t steps = 300;                // optimizer steps
  int64_t global_batch_tokens = 8192; // tokens per optimizer step (reached by accumulation)
  int64_t micro_batch = 8;            // sequences per micro-batch
  uint64_t seed = 1234;               // weights, data order
  int64_t threads = 0;                // 0: all cores
  TrainingDevice device = TrainingDevice::Auto;
  double grad_clip = 1.0;             // global gradient-norm clip; 0 disables
  double expert_grad_clip = 0.0;      // per-expert gradient-norm clip; 0 disables
  int64_t val_interval = 50;          // validation every N steps (and at the start and end); 0: start and end only
  int64_t val_batches = 8;            // micro-batches of held-out data per validation
  int64_t stop_at = 0;                // stop (and checkpoint) after this step as if preempted; 0: run to steps
  int64_t nan_max_skips = 3;          // non-finite steps in a row before reloading the last checkpoint; 0: never
  double nan_lr_factor = 0.5;         // each such reload multiplies the learning rate by this
  double loss_spike_factor = 3.0;     // warn when a loss exceeds this times the running mean; 0: off
  int64_t memory_limit_mb = 0;        // activation memory per micro-batch; over it the micro-batch is halved; 0: none
  int64_t recompute_layers = 0;       // GPU: recompute the activations of the first N layers in the backward; -1: all
  int64_t recompute_experts_layers = -1;  // GPU: the first N MoE layers do recompute_experts, the later keep their rows; -1: all
  ExpertRecompute recompute_experts = ExpertRecompute::None;  // GPU
  bool cuda_graphs = false;           // GPU: capture forward + backward of a micro-batch once, replay it
  bool deterministic = true;          // GPU: every reduction in a fixed order (bit-identical reruns)
  DeterministicAttention deterministic_attention = DeterministicAttention::Workspace;  // GPU: dQ's fixed order
  int64_t attention_query_chunks = 1;  // GPU: the attention backward in this many query blocks (~1/n of dP's memory)
  bool fp8_weight_cache = true;       // GPU fp8: the experts' weights quantised once per change, not per GEMM
  bool fp8_weight_gradients = false;  // GPU fp8: the experts' weight-gradient GEMMs in fp8 too
  bool interleave_gate_up = true;     // GPU bf16 DeepGEMM: w1|w3 kept per expert, gate|up one GEMM each way
  bool swiglu_in_gemm = true;         // GPU bf16 DeepGEMM, gate|up interleaved: SwiGLU in the gate|up GEMM, its backward in the down data gradient
  GradDtype expert_grad_dtype = GradDtype::Fp32;  // GPU: the expert weights' gradients; bf16: one rank only
  TrainingPrecision precision = TrainingPrecision::Bf16;  // GPU: the experts' and projections' GEMMs
  Fp8ColumnScales fp8_weight_gradient_scales = Fp8ColumnScales::Tile1x128;  // GPU fp8 weight gradients: B's scales
  GemmBackend fp8_gemm_backend = GemmBackend::Auto;  // GPU fp8: the GEMMs' kernels
  GemmBackend bf16_gemm_backend = GemmBackend::Auto;  // GPU bf16: the experts' grouped GEMMs' kernels

  // The key `p`'s GEMMs read (fp8 runs fp8_gemm_backend, bf16 runs bf16_gemm_backend): its one owner.
  GemmBackend& gemm_backend(TrainingPrecision p) {
    return p == TrainingPrecision::Fp8 ? fp8_gemm_backend : bf16_gemm_backend;
  }
  GemmBackend gemm_backend(TrainingPrecision p) const { return const_cast<TrainingConfig&>(*this).gemm_backend(p); }
};

}  // namespace moe

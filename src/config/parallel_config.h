// The [parallel] section: data and expert parallelism across ranks; the world size comes
// from the launcher (mpirun, Slurm, torchrun-style variables; src/dist/launch_env.h).
// docs/CONFIG.md describes every key.
#pragma once
#include <array>
#include <cstdint>

#include "config/enum_names.h"

namespace moe {

// The expert-parallel all-to-all: one exchange over the EP group, or intra-node first
// and then inter-node (src/dist/hierarchical_all_to_all.h).
enum class AllToAllKind { Flat, Hierarchical };
inline constexpr std::array<EnumName<AllToAllKind>, 2> kAllToAllKindNames{
    {{AllToAllKind::Flat, "flat"}, {AllToAllKind::Hierarchical, "hierarchical"}}};
constexpr std::span<const EnumName<AllToAllKind>> enum_names(AllToAllKind) { return kAllToAllKindNames; }

// Element type of the GPU's data-parallel gradient sums (bf16: half the bytes, sums rounded).
enum class ReduceDtype { Fp32, Bf16 };
inline constexpr std::array<EnumName<ReduceDtype>, 2> kReduceDtypeNames{
    {{ReduceDtype::Fp32, "fp32"}, {ReduceDtype::Bf16, "bf16"}}};
constexpr std::span<const EnumName<ReduceDtype>> enum_names(ReduceDtype) { return kReduceDtypeNames; }

// The expert exchange's token rows on the wire (docs/EXPERT_PARALLEL.md section 10): as
// they are, fp8 e4m3 with a per-row scale, or fp8 per MoE layer while the measured
// communication wait is high (metrics.alert_comm_wait).
enum class A2aCompression { None, Fp8, Auto };
inline constexpr std::array<EnumName<A2aCompression>, 3> kA2aCompressionNames{
    {{A2aCompression::None, "none"}, {A2aCompression::Fp8, "fp8"}, {A2aCompression::Auto, "auto"}}};
constexpr std::span<const EnumName<A2aCompression>> enum_names(A2aCompression) { return kA2aCompressionNames; }

// How the ranks talk (src/dist/communicator.h); Auto: from the launcher.
enum class CommBackend { Auto, Mpi, Single, Tcp, Nccl };
inline constexpr std::array<EnumName<CommBackend>, 5> kCommBackendNames{{{CommBackend::Auto, "auto"},
                                                                         {CommBackend::Mpi, "mpi"},
                                                                         {CommBackend::Single, "single"},
                                                                         {CommBackend::Tcp, "tcp"},
                                                                         {CommBackend::Nccl, "nccl"}}};
constexpr std::span<const EnumName<CommBackend>> enum_names(CommBackend) { return kCommBackendNames; }

struct ParallelConfig {
  int64_t expert_parallel = 1;        // EP size: ranks that share one copy of the experts; divides world and moe.n_experts
  AllToAllKind all_to_all = AllToAllKind::Flat;
  double bucket_mb = 25.0;            // gradient buckets (at most, inside one backward stage); 0: one per stage
  int64_t a2a_chunks = 1;             // CPU EP: chunks of the token blocks, each all-to-all overlapping the experts' compute
  A2aCompression a2a_compression = A2aCompression::None;  // EP token rows: none, fp8, auto (per layer, by comm wait)
  ReduceDtype grad_reduce_dtype = ReduceDtype::Fp32;  // GPU data parallel
  int64_t comm_sms = 0;               // GPU: multiprocessors the GEMMs leave to NCCL while gradient sums overlap backward
  // ZeRO level over the data-parallel group (for experts: the ranks holding the same ones):
  // 0 replicas; 1 each rank keeps the moments and master remainders of its pieces only;
  // 2 also only its pieces' fp32 gradients; 3 also only its pieces' bf16 weights
  // (all-gathered layer by layer for the forward and again for the backward).
  int64_t zero = 1;
  int64_t rebalance_interval = 0;     // steps between re-placements of the experts by measured load; 0: never
  int64_t rebalance_max_experts = 0;  // most experts one EP rank may hold after a re-placement; 0: n_experts / EP (equal)
  bool split_experts = false;         // EP: each rank's first expert shared with the rank before, rows evened per micro-batch
  CommBackend backend = CommBackend::Auto;
};

}  // namespace moe

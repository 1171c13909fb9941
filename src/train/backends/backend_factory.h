// The one place that decides which ModelBackend trains a run: the CPU reference, the CPU
// model over MPI/tcp ranks, or the GPU model on one GPU or over NCCL ranks.
#pragma once
#include <memory>

#include "config/run_config.h"
#include "train/backends/model_backend.h"

namespace moe {

namespace dist {
class Communicator;
}

// Whether training.device puts the model on the GPU (Auto: when one is visible). Throws
// ConfigError for cuda without a CUDA build or without a visible GPU.
bool wants_gpu(const TrainingConfig& training);

// The run precision's training.fp8_gemm_backend or bf16_gemm_backend as this process runs it
// (gemm_backend_for), in place: auto becomes deepgemm where training.device resolves to a
// GPU that runs DeepGEMM's kernels and the run allows it, else cutlass; every other value
// (and the other precision's key) as given.
void resolve_gemm_backends(RunConfig& config);
// The same for another machine than this one (`moe plan`'s target): `deepgemm_runs` says
// whether its GPUs run DeepGEMM's kernels.
void resolve_gemm_backends(RunConfig& config, bool deepgemm_runs);

// parallel.backend as the launch resolves it: Auto becomes Nccl when the launch has
// several ranks and training.device resolves to the GPU.
CommBackend resolve_comm_backend(const RunConfig& config);

// The backend for `config` over `world` (collective; a world of one trains in this
// process), with its host state: the model initialised from training.seed and its AdamW.
// Combinations the backends do not support are refused here, with one line naming the keys.
std::unique_ptr<ModelBackend> make_backend(const RunConfig& config, std::unique_ptr<dist::Communicator> world);

}  // namespace moe

// The GPU backend (built with the CUDA backend only; backend_factory.cpp is its one caller).
#pragma once
#include <cstddef>
#include <memory>

#include "config/run_config.h"
#include "train/backends/model_backend.h"

namespace moe {

namespace dist {
class Communicator;
}

// The model, gradients and optimizer state on the GPU. `world`: an NCCL (or threads)
// world for data and expert parallelism, or null for one GPU alone. The host model holds
// the initial weights and, after sync_host_model, the trained ones.
std::unique_ptr<ModelBackend> make_gpu_backend(const RunConfig& config, HostState host,
                                               std::unique_ptr<dist::Communicator> world);

// Whether this process sees a CUDA device.
bool gpu_present();
// Whether it sees one that runs DeepGEMM's fp8 kernel (cuda::deepgemm_available).
bool deepgemm_present();
// The current device's memory in bytes (cudaMemGetInfo's total).
size_t gpu_memory_bytes();

}  // namespace moe

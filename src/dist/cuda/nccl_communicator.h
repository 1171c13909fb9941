// The NCCL backend: device buffers, collectives on a CUDA stream of the communicator's
// own, ordered after the caller's stream (Communicator::set_stream). Built only with
// CUDA (MOE_HAVE_CUDA).
#pragma once
#include <memory>

#include "dist/communicator.h"
#include "dist/launch_env.h"

namespace moe::dist {

// Selects GPU device_rank % device count (the launcher's local rank), then builds the world from a unique id that
// rank 0 makes and sends: by MPI broadcast under mpirun, else through the TCP rendezvous
// at MASTER_ADDR:MASTER_PORT (`moe launch`). A world of one needs neither.
std::unique_ptr<Communicator> make_nccl_world(const LaunchEnv& env);

}  // namespace moe::dist

// The tcp backend: host buffers over a full mesh of TCP connections, for CPU runs started
// by `moe launch` (no mpirun needed). The mesh is built through the rendezvous at
// MASTER_ADDR:MASTER_PORT. Collectives run in issue order on one communication thread
// per process (shared by all groups split from the world), so *_async overlaps the
// caller's compute; every rank must issue collectives in the same order (as any SPMD
// program does). Reductions add the ranks' blocks in rank order, so every rank gets the
// same bits.
#pragma once
#include <memory>

#include "dist/communicator.h"
#include "dist/launch_env.h"

namespace moe::dist {

std::unique_ptr<Communicator> make_tcp_world(const LaunchEnv& env);

}  // namespace moe::dist

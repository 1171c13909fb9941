// make_world_communicator: picks and builds the backend of the launch.
#include <spdlog/spdlog.h>

#include <cstring>

#include "core/error.h"
#include "dist/communicator.h"
#include "dist/launch_env.h"
#include "dist/mpi_communicator.h"
#include "dist/single_communicator.h"
#include "dist/tcp_communicator.h"
#include "dist/topology.h"
#ifdef MOE_HAVE_CUDA
#include "dist/cuda/nccl_communicator.h"
#endif

namespace moe::dist {

std::shared_ptr<void> Communicator::allocate(size_t bytes) {
  return std::shared_ptr<void>(new char[bytes > 0 ? bytes : 1], [](void* p) { delete[] static_cast<char*>(p); });
}

void Communicator::copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

std::unique_ptr<Communicator> make_world_communicator(CommBackend backend) {
  const LaunchEnv env = read_launch_env();
  CommBackend chosen = backend;
  if (chosen == CommBackend::Auto) {
    if (env.world_size == 1 && !launched_by_mpi())
      chosen = CommBackend::Single;
    else if (env.source == "torchrun")
      chosen = CommBackend::Tcp;
    else
      chosen = CommBackend::Mpi;  // mpirun, or srun with PMIx
  }
  if (chosen == CommBackend::Single) {
    if (env.world_size != 1)
      MOE_CONFIG_ERROR("backend 'single' in a launch of {} ranks (use auto, mpi, tcp or nccl)", env.world_size);
    return make_single_communicator();
  }
  if (chosen == CommBackend::Mpi) {
    auto world = make_mpi_world();
    // srun without PMIx starts every task as an MPI singleton: a world of one each.
    if (env.source != "none" && world->size() != env.world_size)
      MOE_CONFIG_ERROR("MPI sees {} rank(s) but the launch environment ({}) says {}: under Slurm use srun --mpi=pmix, "
                       "or start with mpirun or moe launch",
                       world->size(), env.source, env.world_size);
    if (world->size() > 1) bind_worker(env, -1);  // CPU workers: a CPU slice when MOE_BIND_CPUS=1
    return world;
  }
  if (chosen == CommBackend::Tcp) {
    if (env.world_size > 1) bind_worker(env, -1);
    return make_tcp_world(env);
  }
#ifdef MOE_HAVE_CUDA
  return make_nccl_world(env);
#else
  MOE_CONFIG_ERROR("backend 'nccl' needs the CUDA build (this binary was built without CUDA)");
#endif
}

}  // namespace moe::dist

// The MPI backend (OpenMPI): host buffers, non-blocking MPI_I* collectives. MPI is
// initialised on first use (MPI_Init_thread) and finalised at process exit.
#pragma once
#include <cstdint>
#include <memory>

#include "dist/communicator.h"

namespace moe::dist {

// MPI_COMM_WORLD (a duplicate of it). Needs mpirun/srun for more than one rank.
std::unique_ptr<Communicator> make_mpi_world();

// True when this process was started by an MPI launcher (OMPI_COMM_WORLD_SIZE or PMIX_RANK
// is set), so MPI_Init will join a world instead of starting a singleton.
bool launched_by_mpi();

// MPI counts are int: messages above this many elements are split into several, and an
// all-to-all whose counts or offsets do not fit goes through point-to-point messages.
// Tests lower it to exercise those paths; 0 restores the default (INT_MAX).
void set_mpi_max_message_elements(int64_t max_elements);

// MPI_Abort of the world when MPI is running with more than one rank (so that a rank
// failing with an exception does not leave the others blocked in a collective); else
// nothing.
void abort_mpi_world_if_running(int exit_code);

}  // namespace moe::dist

// The world communicator of a moe_mpi_tests process (see test_comm_mpi_main.cpp).
#pragma once
#include <memory>

#include "dist/communicator.h"

namespace moe::dist::testing {
Communicator& world();
std::unique_ptr<Communicator>& world_storage();
}  // namespace moe::dist::testing

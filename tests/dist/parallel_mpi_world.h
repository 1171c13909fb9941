// The world communicator of a moe_parallel_mpi_tests process (test_parallel_mpi_main.cpp).
#pragma once
#include <memory>

#include "dist/communicator.h"

namespace moe::dist::testing {
std::unique_ptr<Communicator>& parallel_world();
}  // namespace moe::dist::testing

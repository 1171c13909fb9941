// main() of moe_mpi_tests: one world per process (backend from MOE_TEST_BACKEND, default
// auto: mpi under mpirun, tcp under `moe launch`), then the GoogleTest cases, which all
// run on every rank in the same order. Only rank 0 prints; any rank failing fails the run.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string_view>

#include "comm_mpi_world.h"
#include "config/parallel_config.h"
#include "core/error.h"
#include "dist/mpi_communicator.h"

namespace moe::dist::testing {

Communicator& world() { return *world_storage(); }

std::unique_ptr<Communicator>& world_storage() {
  static std::unique_ptr<Communicator> world;
  return world;
}

}  // namespace moe::dist::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  try {
    const char* backend = std::getenv("MOE_TEST_BACKEND");
    auto& world = moe::dist::testing::world_storage();
    moe::CommBackend kind = moe::CommBackend::Auto;
    if (backend && !moe::parse_enum(std::string_view(backend), kind)) {
      std::fprintf(stderr, "MOE_TEST_BACKEND=%s: not a parallel.backend name\n", backend);
      return 2;
    }
    world = moe::dist::make_world_communicator(kind);
    if (world->rank() != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
    }
    int failed = RUN_ALL_TESTS();
    // Every rank learns whether any rank failed, so that the exit codes agree.
    world->all_reduce(&failed, 1, moe::dist::DType::i32, moe::dist::ReduceOp::max);
    if (world->rank() == 0) std::cout << "moe_mpi_tests: " << world->size() << " ranks, backend " << world->backend()
                                      << (failed ? ": FAILED" : ": all passed") << "\n";
    world.reset();
    return failed ? 1 : 0;
  } catch (const std::exception& error) {
    std::cerr << "moe_mpi_tests: " << error.what() << "\n";
    moe::dist::abort_mpi_world_if_running(1);
    return 1;
  }
}

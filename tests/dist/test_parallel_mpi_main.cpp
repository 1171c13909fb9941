// main() of moe_parallel_mpi_tests: training under mpirun (label mpi). One world per
// process; the GoogleTest cases run on every rank in the same order, only rank 0 prints,
// and any rank failing fails the run.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>

#include "core/threads.h"
#include "dist/mpi_communicator.h"
#include "parallel_mpi_world.h"

namespace moe::dist::testing {

std::unique_ptr<Communicator>& parallel_world() {
  static std::unique_ptr<Communicator> world;
  return world;
}

}  // namespace moe::dist::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  try {
    moe::set_num_threads(1);  // several ranks share the cores
    auto& world = moe::dist::testing::parallel_world();
    world = moe::dist::make_world_communicator(moe::CommBackend::Auto);
    if (world->rank() != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
    }
    int failed = RUN_ALL_TESTS();
    world->all_reduce(&failed, 1, moe::dist::DType::i32, moe::dist::ReduceOp::max);
    if (world->rank() == 0)
      std::cout << "moe_parallel_mpi_tests: " << world->size() << " ranks" << (failed ? ": FAILED" : ": all passed")
                << "\n";
    world.reset();
    return failed ? 1 : 0;
  } catch (const std::exception& error) {
    std::cerr << "moe_parallel_mpi_tests: " << error.what() << "\n";
    moe::dist::abort_mpi_world_if_running(1);
    return 1;
  }
}

// The trainer over N thread ranks on one GPU (dist::make_thread_communicators), for the
// GPU tests of the multi-rank paths: one Trainer per thread on the LookBack task.
#pragma once
#include <exception>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dist/cuda/thread_communicator.h"
#include "train/synthetic.h"
#include "train/trainer.h"

namespace moe::test {

// Runs `config` on n thread ranks: `before(rank, trainer)` sets its hooks, `after(rank,
// trainer)` reads it once the run is done. ranks_per_node > 0 simulates nodes of that many
// ranks (the hierarchical all-to-all). Returns each rank's error ("" when none).
inline std::vector<std::string> run_thread_trainers(const RunConfig& config, int n,
                                                    const std::function<void(int, Trainer&)>& before,
                                                    const std::function<void(int, Trainer&)>& after = {},
                                                    int ranks_per_node = 0) {
  std::vector<std::unique_ptr<dist::Communicator>> worlds = dist::make_thread_communicators(n, ranks_per_node);
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        const auto& m = config.model;
        Trainer trainer(config, std::make_unique<LookBackTask>(m.vocab_size, m.seq_len, 1),
                        std::make_unique<LookBackTask>(m.vocab_size, m.seq_len, 2),
                        std::move(worlds[static_cast<size_t>(r)]));
        before(r, trainer);
        std::ostringstream log;
        trainer.run(log);
        if (after) after(r, trainer);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace moe::test

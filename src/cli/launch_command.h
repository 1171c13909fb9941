// `moe launch`: starts the workers of one node (torchrun-style) and watches them.
#pragma once
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace moe {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master;          // HOST:PORT of rank 0's rendezvous; default 127.0.0.1 and a free port (one node)
  double grace_seconds = 5.0;  // after SIGTERM, how long workers get before SIGKILL
  // The worker command: a `moe` subcommand and its arguments (`train -c run.toml`), or a
  // program given by a path (containing '/') and its arguments.
  std::vector<std::string> command;
};

CLI::App* add_launch_command(CLI::App& app, LaunchOptions& options);

// Runs the workers to the end. 0 when every worker exits with 0; else the first failing
// worker's exit code (128 + signal for a signal), after stopping the others; 128 + signal
// when the launcher itself was interrupted (the signal is forwarded to the workers).
int run_launch(const LaunchOptions& options);

}  // namespace moe

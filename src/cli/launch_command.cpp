#include "cli/launch_command.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "dist/rendezvous.h"

extern char** environ;

namespace moe {
namespace {

volatile sig_atomic_t g_received_signal = 0;

void remember_signal(int signal_number) { g_received_signal = signal_number; }

struct Worker {
  pid_t pid = -1;
  int rank = 0;
  bool running = false;
};

// HOST:PORT, or HOST alone (port 0: pick one).
void split_master(const std::string& master, std::string* host, int* port) {
  const size_t colon = master.rfind(':');
  *host = master.substr(0, colon);
  *port = 0;
  if (colon != std::string::npos) {
    const std::string digits = master.substr(colon + 1);
    char* end = nullptr;
    const long value = std::strtol(digits.c_str(), &end, 10);
    if (digits.empty() || *end != '\0' || value < 0 || value > 65535)
      MOE_CONFIG_ERROR("--master '{}': the port must be a number in 0..65535", master);
    *port = static_cast<int>(value);
  }
  if (host->empty()) MOE_CONFIG_ERROR("--master '{}' names no host", master);
}

std::string self_executable() {
  char path[4096];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) MOE_THROW("cannot find the moe binary (/proc/self/exe): {}", std::strerror(errno));
  return std::string(path, static_cast<size_t>(n));
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return fmt::format("exited with code {}", WEXITSTATUS(status));
}

int exit_code_of(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

// In the child: the rank's variables, then exec. Never returns.
[[noreturn]] void exec_worker(const std::vector<std::string>& argv,
                              const std::vector<std::pair<std::string, std::string>>& env, pid_t launcher) {
  // A launcher started under mpirun or srun must not hand its own identity down.
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                           "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"})
    unsetenv(name);
  for (const auto& [name, value] : env) setenv(name.c_str(), value.c_str(), 1);
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  // Workers must not outlive a launcher that was killed outright (SIGKILL, OOM killer).
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != launcher) _exit(1);  // it died before prctl took effect
  execv(args[0], args.data());
  std::fprintf(stderr, "moe launch: cannot run %s: %s\n", args[0], std::strerror(errno));
  _exit(127);
}

}  // namespace

CLI::App* add_launch_command(CLI::App& app, LaunchOptions& options) {
  CLI::App* cmd = app.add_subcommand(
      "launch", "Start the workers of this node (sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) and watch them");
  cmd->add_option("--nproc-per-node", options.nproc_per_node, "Workers on this node (one per GPU)")
      ->required()
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--nnodes", options.nnodes, "Nodes in the job")->check(CLI::Range(1, 65536));
  cmd->add_option("--node-rank", options.node_rank, "Index of this node (0 holds rank 0)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--master", options.master,
                  "HOST:PORT where rank 0 listens for the rendezvous (default 127.0.0.1 and a free port; required "
                  "with --nnodes > 1)");
  cmd->add_option("--grace-period", options.grace_seconds, "Seconds between SIGTERM and SIGKILL when stopping workers")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("command", options.command,
                  "After --: a moe command and its arguments (train -c run.toml), or a program path and its arguments")
      ->required();
  cmd->footer("Example: moe launch --nproc-per-node 4 -- train -c configs/default.toml");
  return cmd;
}

int run_launch(const LaunchOptions& options) {
  if (options.node_rank >= options.nnodes)
    MOE_CONFIG_ERROR("--node-rank {} must be below --nnodes {}", options.node_rank, options.nnodes);
  if (options.nnodes > 1 && options.master.empty())
    MOE_CONFIG_ERROR("--master HOST:PORT is required with --nnodes {}", options.nnodes);
  if (options.command.empty()) MOE_CONFIG_ERROR("moe launch needs a worker command after --");
  std::string host = "127.0.0.1";
  int port = 0;
  if (!options.master.empty()) split_master(options.master, &host, &port);
  // A free port for rank 0's rendezvous, held by the launcher until the workers end: a
  // port only probed and released could be taken (another job's bind, or the local port
  // of any outgoing connection) before rank 0 listens on it, or between two rounds.
  int reservation = -1;
  if (port == 0) {
    if (options.nnodes > 1) MOE_CONFIG_ERROR("--master '{}': give a port when the job spans nodes", options.master);
    reservation = dist::net::reserve_port(&port);
  }

  std::vector<std::string> argv = options.command;
  if (argv[0].find('/') == std::string::npos) argv.insert(argv.begin(), self_executable());
  const int world_size = options.nnodes * options.nproc_per_node;

  struct sigaction action {};
  action.sa_handler = remember_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);

  std::vector<Worker> workers(static_cast<size_t>(options.nproc_per_node));
  const pid_t launcher_pid = getpid();
  for (int local = 0; local < options.nproc_per_node; ++local) {
    const int rank = options.node_rank * options.nproc_per_node + local;
    const std::vector<std::pair<std::string, std::string>> env = {
        {"RANK", std::to_string(rank)},
        {"WORLD_SIZE", std::to_string(world_size)},
        {"LOCAL_RANK", std::to_string(local)},
        {"LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node)},
        {"GROUP_RANK", std::to_string(options.node_rank)},
        {"NODE_RANK", std::to_string(options.node_rank)},
        {"MASTER_ADDR", host},
        {"MASTER_PORT", std::to_string(port)},
    };
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid < 0) MOE_THROW("fork(): {}", std::strerror(errno));
    if (pid == 0) exec_worker(argv, env, launcher_pid);
    workers[local] = {pid, rank, true};
  }
  std::fprintf(stderr, "moe launch: %d workers on node %d of %d (ranks %d..%d of %d), rendezvous at %s:%d\n",
               options.nproc_per_node, options.node_rank, options.nnodes, workers.front().rank, workers.back().rank,
               world_size, host.c_str(), port);

  using Clock = std::chrono::steady_clock;
  int result = 0;
  bool stopping = false;
  Clock::time_point stop_started;
  int running = options.nproc_per_node;
  auto signal_all = [&](int signal_number) {
    for (const Worker& w : workers)
      if (w.running) kill(w.pid, signal_number);
  };
  auto begin_stop = [&](int signal_number) {
    if (!stopping) stop_started = Clock::now();
    stopping = true;
    signal_all(signal_number);
  };
  while (running > 0) {
    if (g_received_signal != 0) {
      const int signal_number = g_received_signal;
      g_received_signal = 0;
      std::fprintf(stderr, "moe launch: got signal %d, passing it to the workers\n", signal_number);
      if (result == 0) result = 128 + signal_number;
      begin_stop(signal_number);
    }
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (Worker& w : workers) {
        if (w.pid != pid || !w.running) continue;
        w.running = false;
        --running;
        const bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
        if (failed && !stopping) {
          std::fprintf(stderr, "moe launch: rank %d %s; stopping the other workers\n", w.rank,
                       describe_status(status).c_str());
          result = exit_code_of(status);
          begin_stop(SIGTERM);
        } else if (failed && result == 0) {
          result = exit_code_of(status);
        }
      }
      continue;
    }
    if (pid < 0 && errno != EINTR) break;  // no children left
    if (stopping && std::chrono::duration<double>(Clock::now() - stop_started).count() > options.grace_seconds) {
      std::fprintf(stderr, "moe launch: workers still running %.0f s after SIGTERM: SIGKILL\n", options.grace_seconds);
      signal_all(SIGKILL);
      stop_started = Clock::now() + std::chrono::hours(24);  // once
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (result != 0) std::fprintf(stderr, "moe launch: failed (exit code %d)\n", result);
  if (reservation >= 0) dist::net::close_fd(reservation);
  return result;
}

}  // namespace moe

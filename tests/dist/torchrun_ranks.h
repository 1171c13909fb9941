// `torchrun --nproc-per-node N --no-python moe train ...` without torch: N `moe` processes
// with the variables torchrun gives its workers, and a stand-in for its agent's TCPStore
// listening on MASTER_PORT for the whole job.
#pragma once
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dist/rendezvous.h"

extern char** environ;

namespace moe::test {

struct RankOutcome {
  int exit_code = -1;  // 128 + signal when killed
  std::string output;  // stdout and stderr
};

// Runs `moe args...` as `ranks` torchrun workers; each gets `timeout_s` before being killed.
// Output files go to `dir`.
inline std::vector<RankOutcome> run_torchrun_ranks(const std::string& moe, const std::vector<std::string>& args,
                                                   int ranks, const std::filesystem::path& dir, double timeout_s) {
  // The agent's store: MASTER_PORT is taken for as long as the job runs.
  int master_port = 0;
  int store = -1;
  for (int attempt = 0; attempt < 100 && store < 0; ++attempt) {
    store = dist::net::listen_on(0, 4, &master_port);
    int next = -1;
    try {
      next = dist::net::listen_on(master_port + 1, 1, nullptr);  // free for the rendezvous?
    } catch (const std::exception&) {
    }
    if (next >= 0) {
      dist::net::close_fd(next);
    } else {
      dist::net::close_fd(store);
      store = -1;
    }
  }
  // The test's own environment, less any launcher's variables.
  std::vector<std::string> base;
  for (char** e = environ; *e; ++e) {
    const std::string var = *e;
    const std::string name = var.substr(0, var.find('='));
    const bool launcher = name.starts_with("OMPI_") || name.starts_with("PMIX_") || name.starts_with("SLURM_") ||
                          name.starts_with("TORCHELASTIC_") || name == "RANK" || name == "WORLD_SIZE" ||
                          name == "LOCAL_RANK" || name == "LOCAL_WORLD_SIZE" || name == "GROUP_RANK" ||
                          name == "MASTER_ADDR" || name == "MASTER_PORT" || name == "MOE_RENDEZVOUS_PORT";
    if (!launcher) base.push_back(var);
  }
  std::vector<pid_t> pids;
  for (int rank = 0; rank < ranks; ++rank) {
    std::vector<std::string> env = base;
    const std::string r = std::to_string(rank), n = std::to_string(ranks);
    const std::vector<std::string> torchrun = {
        "LOCAL_RANK=" + r, "RANK=" + r, "GROUP_RANK=0", "ROLE_RANK=" + r, "ROLE_NAME=default",
        "LOCAL_WORLD_SIZE=" + n, "WORLD_SIZE=" + n, "GROUP_WORLD_SIZE=1", "ROLE_WORLD_SIZE=" + n,
        "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(master_port), "TORCHELASTIC_RESTART_COUNT=0",
        "TORCHELASTIC_MAX_RESTARTS=0", "TORCHELASTIC_RUN_ID=none", "TORCHELASTIC_USE_AGENT_STORE=True",
        "MOE_RENDEZVOUS_TIMEOUT=30"};
    for (const std::string& var : torchrun)
      env.push_back(var);
    std::vector<char*> envp, argv;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_strings = {moe};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    for (std::string& a : argv_strings) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string log = (dir / ("rank" + r + ".log")).string();
    posix_spawn_file_actions_t files;
    posix_spawn_file_actions_init(&files);
    posix_spawn_file_actions_addopen(&files, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&files, STDOUT_FILENO, STDERR_FILENO);
    pid_t pid = -1;
    if (posix_spawn(&pid, moe.c_str(), &files, nullptr, argv.data(), envp.data()) != 0) pid = -1;
    posix_spawn_file_actions_destroy(&files);
    pids.push_back(pid);
  }
  std::vector<RankOutcome> outcomes(static_cast<size_t>(ranks));
  const auto start = std::chrono::steady_clock::now();
  for (int rank = 0; rank < ranks; ++rank) {
    const pid_t pid = pids[static_cast<size_t>(rank)];
    if (pid < 0) continue;
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_s) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    RankOutcome& outcome = outcomes[static_cast<size_t>(rank)];
    outcome.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::ifstream in(dir / ("rank" + std::to_string(rank) + ".log"));
    std::stringstream text;
    text << in.rdbuf();
    outcome.output = text.str();
  }
  dist::net::close_fd(store);
  return outcomes;
}

}  // namespace moe::test

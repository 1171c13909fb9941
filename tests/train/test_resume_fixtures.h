// Shared by the checkpoint, resume and fault tests: a tiny model config and a synthetic
// batch source whose position can be saved and restored, and helpers to run the `moe`
// binary on a small text corpus.
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <map>
#include <sstream>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/threads.h"
#include "data/batch_source.h"
#include "config/run_config.h"
#include "train/trainer.h"

namespace moe::test {

// Random tokens; the target is the token two places back plus one (mod vocab).
class ResumableTask final : public BatchSource {
 public:
  ResumableTask(int64_t vocab, int64_t seq_len, uint64_t stream)
      : vocab_(vocab), seq_len_(seq_len), rng_(stream, "resumable") {}
  void next_batch(int64_t batch, int32_t* inputs_BS, int32_t* targets_BS) override {
    for (int64_t i = 0; i < batch * seq_len_; ++i)
      inputs_BS[i] = static_cast<int32_t>(rng_.bits(counter_++)[0] % static_cast<uint32_t>(vocab_));
    for (int64_t i = 0; i < batch * seq_len_; ++i)
      targets_BS[i] = i % seq_len_ < 2 ? -1 : static_cast<int32_t>((inputs_BS[i - 2] + 1) % vocab_);
  }
  void reset() override { counter_ = 0; }
  std::vector<int64_t> state() const override { return {static_cast<int64_t>(counter_)}; }
  void restore(const std::vector<int64_t>& state) override {
    MOE_CHECK(state.size() == 1 && state[0] >= 0, "bad task state");
    counter_ = static_cast<uint64_t>(state[0]);
  }

 private:
  int64_t vocab_, seq_len_;
  CounterRng rng_;
  uint64_t counter_ = 0;
};

inline RunConfig tiny_config() {
  RunConfig c;
  ModelConfig& m = c.model;
  m.vocab_size = 257;  // a config that validates (checkpoints store and re-read it); the task uses 16 ids
  m.dim = 16;
  m.n_layers = 2;
  m.n_heads = 2;
  m.n_kv_heads = 1;
  m.seq_len = 8;
  m.moe.n_experts = 4;
  m.moe.top_k = 2;
  m.moe.expert_hidden = 16;
  m.moe.bias_balancing = true;  // the balancing bias must survive a resume too
  c.training.micro_batch = 4;
  c.training.global_batch_tokens = 64;  // 2 micro-batches
  c.training.steps = 8;
  c.training.val_batches = 1;
  c.training.val_interval = 0;
  c.lr.peak = 1e-2;
  c.lr.warmup_steps = 2;
  c.metrics.log_interval = 1;
  return c;
}

inline std::unique_ptr<Trainer> make_trainer(const RunConfig& config) {
  const auto& m = config.model;
  return std::make_unique<Trainer>(config, std::make_unique<ResumableTask>(16, m.seq_len, 1),
                                   std::make_unique<ResumableTask>(16, m.seq_len, 2));
}

inline std::vector<float> all_weights(Trainer& trainer) {
  auto& params = trainer.model().params();
  std::vector<float> weights;
  for (int id = 0; id < params.size(); ++id)
    weights.insert(weights.end(), params.value(id), params.value(id) + params.numel(id));
  return weights;
}

// A fresh directory per test, removed afterwards.
// Two checkpoints hold the same state: every global tensor bit for bit, the progress and
// the data position (their save ids, and so their shard bytes, differ).
inline void expect_same_checkpoint_state(const std::filesystem::path& a, const std::filesystem::path& b) {
  const LoadedCheckpoint x = read_checkpoint(a), y = read_checkpoint(b);
  ASSERT_EQ(x.manifest.tensors.size(), y.manifest.tensors.size()) << a << " vs " << b;
  for (const ManifestTensor& t : y.manifest.tensors)
    EXPECT_TRUE(read_tensor(x, t.name) == read_tensor(y, t.name)) << t.name << ": " << a << " vs " << b;
  EXPECT_EQ(checkpoint_progress(x), checkpoint_progress(y));
  EXPECT_EQ(x.manifest.adam_steps, y.manifest.adam_steps);
  EXPECT_EQ(x.manifest.source_state, y.manifest.source_state);
}

class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    set_num_threads(1);  // tiny matmuls: threads only add contention when ctest runs in parallel
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    // Parameterized tests are named "Prefix/Suite.Name/0": one directory, not a tree
    // whose parents would stay behind.
    std::string name = std::string(info->test_suite_name()) + "_" + info->name();
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ = std::filesystem::temp_directory_path() / ("moe_ckpt_" + std::to_string(::getpid()) + "_" + name);
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

inline std::string moe_binary() {
  const char* path = std::getenv("MOE_BINARY");
  if (path && *path) return path;
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "moe").string();
}

// A small text corpus and a run config for the binary that trains in well under a second.
inline std::filesystem::path write_binary_run(const std::filesystem::path& dir, int steps) {
  std::filesystem::create_directories(dir / "text");
  for (int i = 0; i < 30; ++i)
    std::ofstream(dir / "text" / ("doc" + std::to_string(i) + ".txt"))
        << "Document " << i << ": the quick brown fox jumps over the lazy dog. " << std::string(40, 'a' + i % 26)
        << "\n";
  const auto path = dir / "run.toml";
  std::ofstream(path) << "[model]\ndim = 16\nn_layers = 1\nn_heads = 2\nn_kv_heads = 1\nseq_len = 16\n"
                      << "[moe]\nn_experts = 4\nexpert_hidden = 16\nbias_balancing = true\n"
                      << "[training]\nsteps = " << steps << "\nglobal_batch_tokens = 64\nmicro_batch = 2\n"
                      << "val_batches = 1\nval_interval = 0\nthreads = 1\n"
                      << "[lr]\nwarmup_steps = 2\n"
                      << "[data]\ndir = \"" << (dir / "text").string() << "\"\nval_fraction = 0.2\n"
                      << "[metrics]\nlog_interval = 1\n"
                      << "[checkpoint]\ndir = \"" << (dir / "ckpt").string() << "\"\ninterval = 1\nkeep_last = 2\n";
  return path;
}

// The `moe` binary as a child process whose output (stdout and stderr) is read as it comes.
class Child {
 public:
  explicit Child(const std::vector<std::string>& args) {
    int fds[2];
    EXPECT_EQ(::pipe(fds), 0);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(fds[1], 1);
      ::dup2(fds[1], 2);
      ::close(fds[0]);
      ::close(fds[1]);
      std::vector<char*> argv;
      const std::string binary = moe_binary();
      argv.push_back(const_cast<char*>(binary.c_str()));
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    fd_ = fds[0];
  }
  ~Child() {
    if (pid_ > 0 && status_ < 0) {
      ::kill(pid_, SIGKILL);
      wait();
    }
    if (fd_ >= 0) ::close(fd_);
  }
  // Reads until `text` has appeared in the output (true) or the output ends (false).
  bool read_until(const std::string& text) {
    while (output_.find(text, scanned_) == std::string::npos) {
      char buffer[4096];
      const ssize_t n = ::read(fd_, buffer, sizeof buffer);
      if (n <= 0) return false;
      output_.append(buffer, static_cast<size_t>(n));
    }
    scanned_ = output_.find(text, scanned_) + text.size();
    return true;
  }
  void signal(int sig) { ::kill(pid_, sig); }
  // Reads the rest of the output and reaps the child; returns the raw wait status.
  int wait() {
    while (read_until("\x01never\x01")) {
    }
    int status = 0;
    ::waitpid(pid_, &status, 0);
    status_ = status;
    return status;
  }
  const std::string& output() const { return output_; }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  int status_ = -1;
  std::string output_;
  size_t scanned_ = 0;
};

// The last "step N/M | loss X" line for each step in a log, "N:X" joined by spaces.
inline std::string losses_by_step(const std::string& log) {
  std::map<int, std::string> losses;
  std::istringstream lines(log);
  std::string line;
  while (std::getline(lines, line)) {
    if (!line.starts_with("step ")) continue;
    const int step = std::stoi(line.substr(5));
    const auto at = line.find("| loss ");
    if (at != std::string::npos) losses[step] = line.substr(at + 7, line.find(' ', at + 7) - at - 7);
  }
  std::string out;
  for (const auto& [step, loss] : losses) out += std::to_string(step) + ":" + loss + " ";
  return out;
}

}  // namespace moe::test

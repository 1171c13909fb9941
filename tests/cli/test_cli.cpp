// The `moe` binary as users run it: exit codes, one-line errors, and a short real run
// on a small text directory whose output ends with the machine-readable summary.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "cli/moe_process.h"

namespace {

using Result = moe::test::MoeResult;
using moe::test::moe_binary;

// `moe ARGS` through moe_process.h (killed after 120 s, so a hang fails the test).
Result run(const std::string& args) { return moe::test::run_moe(args); }

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

int count_lines(const std::string& text) {
  int lines = 0;
  for (char c : text) lines += c == '\n';
  return lines;
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("moe_cli_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_ / "text" / "sub");
    for (int i = 0; i < 40; ++i) {
      std::ofstream(dir_ / "text" / (i % 2 ? "sub" : "") / ("doc" + std::to_string(i) + ".txt"))
          << "Document " << i << ": the quick brown fox jumps over the lazy dog. " << std::string(50, 'a' + i % 26)
          << "\n";
    }
    std::ofstream(dir_ / "tiny.toml") << "[model]\ndim = 16\nn_layers = 1\nn_heads = 2\nn_kv_heads = 1\nseq_len = 32\n"
                                      << "[moe]\nn_experts = 4\nexpert_hidden = 16\n"
                                      << "[training]\nsteps = 6\nglobal_batch_tokens = 128\nmicro_batch = 2\n"
                                      << "val_batches = 2\nval_interval = 3\n"
                                      << "[data]\ndir = \"" << (dir_ / "text").string() << "\"\nval_fraction = 0.2\n"
                                      << "[metrics]\nlog_interval = 2\n";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string config() const { return (dir_ / "tiny.toml").string(); }
  std::filesystem::path dir_;
};

// `moe eval` on a checkpoint of the run: with the run's validation batches it prints the
// loss the run reported at that step; by default the whole held-out split (761 tokens: 23
// sequences of 32, 11 micro-batches of 2); bad input is one line and exit code 2.
TEST_F(Cli, EvalPrintsTheRunsValidationLoss) {
  const std::string ckpt = (dir_ / "ckpt").string();
  Result r = run("train --config " + config() + " --device cpu --checkpoint.dir=" + ckpt + " --checkpoint.interval=6");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto at = r.output.find("val_loss_end=");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string val_loss = r.output.substr(at + 13, 6);  // 4 decimals, as eval prints it
  const std::string step6 = ckpt + "/step_00000006";
  Result e = run("eval --checkpoint " + step6 + " --batches 2");
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_NE(e.output.find("(step 6) | 2 x 2 sequences of 32 tokens | loss " + val_loss + " | perplexity "),
            std::string::npos)
      << e.output;
  Result all = run("eval --checkpoint " + step6);
  ASSERT_EQ(all.exit_code, 0) << all.output;
  EXPECT_NE(all.output.find("| 11 x 2 sequences of 32 tokens | loss "), std::string::npos) << all.output;
  moe::test::expect_one_line_error(run("eval --checkpoint " + (dir_ / "none").string()), 2,
                                   {"no such checkpoint directory"});
  moe::test::expect_one_line_error(run("eval --checkpoint " + (dir_ / "text").string()), 2, {"no config.toml"});
  moe::test::expect_one_line_error(run("eval --checkpoint " + step6 + " --batches 0"), 2, {"--batches must be >= 1"});
  Result other = run("eval --checkpoint " + step6 + " --model.dim=32");  // after the data line
  EXPECT_EQ(other.exit_code, 2) << other.output;
  EXPECT_NE(other.output.find("moe: error: " + step6 + ": cannot resume: model.dim is 16"), std::string::npos)
      << other.output;
}

// `moe generate` on a checkpoint of the run (byte tokenizer, 32-token context): the prompt
// then its continuation on stdout, what was loaded on stderr; greedy and seeded runs
// repeat; bad input is one line and exit code 2.
TEST_F(Cli, GenerateContinuesAPromptFromACheckpoint) {
  const std::string ckpt = (dir_ / "ckpt").string();
  Result r = run("train --config " + config() + " --device cpu --checkpoint.dir=" + ckpt + " --checkpoint.interval=6");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string step6 = ckpt + "/step_00000006";
  const std::string generate = "generate --checkpoint " + step6 + " ";
  const std::string greedy_args = generate + "--prompt 'Document 7: the' --max-tokens 12 --temperature 0";
  const std::string log = (dir_ / "stderr.txt").string();
  auto text_of = [&](const std::string& args) { return moe::test::run_moe(args + " 2>" + log, 120, false); };
  Result greedy = text_of(greedy_args);  // stdout alone: the text
  ASSERT_EQ(greedy.exit_code, 0) << greedy.output;
  EXPECT_EQ(greedy.output.rfind("Document 7: the", 0), 0u) << greedy.output;
  EXPECT_EQ(greedy.output.back(), '\n');
  EXPECT_LE(greedy.output.size(), std::string("Document 7: the").size() + 12 + 1);  // a byte per token at most
  const std::string logged = read_text(log);
  EXPECT_EQ(text_of(greedy_args).output, greedy.output);
  EXPECT_NE(logged.find("generate: " + step6 + " (step 6) | tokenizer byte (kept in the checkpoint) | prompt 15 tokens, context 32 | cpu | "
                               "greedy | seed 0\n"),
            std::string::npos)
      << logged;
  EXPECT_TRUE(logged.find("generate: 12 tokens in ") != std::string::npos ||
              logged.find("stopped at the end-of-text token") != std::string::npos)
      << logged;
  // Sampling past the 32-token context slides the window; the same seed repeats the text.
  const std::string prompt_file = (dir_ / "prompt.txt").string();
  std::ofstream(prompt_file) << "The quick";
  const std::string sampled_args = generate + "--prompt-file " + prompt_file + " --max-tokens 60 --temperature 1.2 "
                                   "--top-k 20 --top-p 0.9 --seed 3 --device cpu";
  Result sampled = text_of(sampled_args);
  ASSERT_EQ(sampled.exit_code, 0) << sampled.output;
  EXPECT_EQ(sampled.output.rfind("The quick", 0), 0u) << sampled.output;
  EXPECT_NE(read_text(log).find("the context window slid"), std::string::npos) << read_text(log);
  EXPECT_EQ(text_of(sampled_args).output, sampled.output);

  using moe::test::expect_one_line_error;
  expect_one_line_error(run("generate --checkpoint " + (dir_ / "none").string() + " --prompt x"), 2,
                        {"no such checkpoint directory"});
  expect_one_line_error(run("generate --checkpoint " + (dir_ / "text").string() + " --prompt x"), 2, {"no config.toml"});
  expect_one_line_error(run(generate + "--prompt ''"), 2, {"--prompt is empty"});
  expect_one_line_error(run(generate), 2, {"--prompt or --prompt-file"});
  expect_one_line_error(run(generate + "--prompt x --prompt-file " + prompt_file), 2, {"not both"});
  expect_one_line_error(run(generate + "--prompt-file " + (dir_ / "missing.txt").string()), 2, {"no such file"});
  expect_one_line_error(run(generate + "--prompt x --top-p 0"), 2, {"--top-p must be in (0, 1]"});
  expect_one_line_error(run(generate + "--prompt x --top-p 1.5"), 2, {"--top-p must be in (0, 1]"});
  expect_one_line_error(run(generate + "--prompt x --temperature -1"), 2, {"--temperature must be >= 0"});
  expect_one_line_error(run(generate + "--prompt x --max-tokens 0"), 2, {"--max-tokens must be >= 1"});
  expect_one_line_error(run(generate + "--prompt x --device tpu"), 2, {"--device must be cpu, gpu or auto"});
  expect_one_line_error(run(generate + "--prompt " + std::string(33, 'a')), 2,
                        {"the prompt is 33 tokens, longer than the model's context of 32"});
  expect_one_line_error(run(generate + "--prompt x --bogus"), 2, {"unknown argument '--bogus'"});
  expect_one_line_error(run(generate + "--prompt x --model.dim=32"), 2, {"cannot resume: model.dim is 16"});
#ifndef MOE_HAVE_CUDA
  expect_one_line_error(run(generate + "--prompt x --device gpu"), 2, {"--device gpu", "no CUDA backend"});
#endif
}

// `moe --version` names the commit, build type and compiler, then the GPU libraries (or
// that the build has none); overrides also take the value as the next argument.
TEST_F(Cli, VersionAndSpaceSeparatedOverrides) {
  Result v = run("--version");
  ASSERT_EQ(v.exit_code, 0) << v.output;
  EXPECT_EQ(v.output.rfind("moe-train ", 0), 0u) << v.output;
  EXPECT_NE(v.output.find(" build, "), std::string::npos) << v.output;
  EXPECT_TRUE(v.output.find("\nCUDA runtime ") != std::string::npos ||
              v.output.find("\nCPU-only build") != std::string::npos)
      << v.output;
  if (std::filesystem::exists(std::filesystem::path(MOE_TEST_SOURCE_DIR) / ".git"))  // built from a clone
    EXPECT_EQ(v.output.find("unknown"), std::string::npos) << "no commit: " << v.output;
  Result r = run("train --config " + config() + " --device cpu --training.steps 2 --metrics.log_interval 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("summary: steps=2 "), std::string::npos) << r.output;
  moe::test::expect_one_line_error(run("train --config " + config() + " --training.steps"), 2,
                                   {"unknown argument '--training.steps'", "--section.key value"});
}

TEST_F(Cli, TrainsAndEndsWithSummary) {
  Result r = run("train --config " + config());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto last_line_start = r.output.rfind('\n', r.output.size() - 2) + 1;
  const std::string last = r.output.substr(last_line_start);
  EXPECT_EQ(last.rfind("summary: steps=6 tokens=768 seconds=", 0), 0u) << r.output;
  EXPECT_NE(last.find("val_loss_start="), std::string::npos);
  EXPECT_NE(last.find("val_loss_end="), std::string::npos);
  EXPECT_NE(r.output.find("step 6/6 | loss "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("val step 3 | val_loss"), std::string::npos) << r.output;
  for (const char* field : {"aux ", "lr ", "grad_norm ", "tok/s ", "eta "})
    EXPECT_NE(r.output.find(field), std::string::npos) << field;
}

TEST_F(Cli, HelpExitsZero) {
  for (const char* args : {"--help", "train --help", "config --help"}) {
    Result r = run(args);
    EXPECT_EQ(r.exit_code, 0) << args << ": " << r.output;
    EXPECT_NE(r.output.find("Usage"), std::string::npos) << args;
  }
  EXPECT_NE(run("train --help").output.find("--section.key=value"), std::string::npos);
}

TEST_F(Cli, ConfigErrorsAreOneLineAndExitTwo) {
  struct Case {
    std::string args, expected;
  };
  const Case cases[] = {
      {"train --config " + config() + " --model.dimm=3", "model.dimm"},
      {"train --config " + config() + " --moe.top_k=9", "top_k"},
      {"train --config " + config() + " --moe.score_func=relu", "score_func"},
      {"train --config " + config() + " --training.steps=abc", "training.steps"},
      {"train --config " + config() + " --data.dir=/nonexistent/dir", "/nonexistent/dir"},
      {"train --config " + config() + " --bogus", "--bogus"},
      {"train --config " + config() + " --device cpu --thread-ranks 2", "--thread-ranks"},
      {"train --config " + config() + " --thread-ranks-per-node 2", "--thread-ranks-per-node"},
      {"train --config /nonexistent.toml", "nonexistent.toml"},
      {"train", "--config"},
      {"frobnicate", "frobnicate"},
  };
  for (const Case& c : cases) {
    Result r = run(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << ": " << r.output;
    EXPECT_EQ(count_lines(r.output), 1) << c.args << ": " << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.args << ": " << r.output;
  }
}

TEST_F(Cli, ConfigPrintsResolvedToml) {
  Result r = run("config --config " + config() + " --moe.temperature=0.3 --training.steps=7");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("temperature = 0.3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("steps = 7"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("dim = 16"), std::string::npos) << r.output;
  Result defaults = run("config");
  ASSERT_EQ(defaults.exit_code, 0) << defaults.output;
  EXPECT_NE(defaults.output.find("[checkpoint]"), std::string::npos);
}

}  // namespace

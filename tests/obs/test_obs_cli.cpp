// `moe train --dashboard PORT` and `moe report RUN_DIR` as users run them: output lines,
// the report file, and one-line errors with exit codes 2 (usage) and 1 (runtime).
#include <gtest/gtest.h>

#include "obs/dashboard.h"
#include "obs_helpers.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

int count_lines(const std::string& text) { return static_cast<int>(std::count(text.begin(), text.end(), '\n')); }

class ObsCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::scratch_dir("cli");
    fs::create_directories(dir_ / "text");
    for (int i = 0; i < 20; ++i)
      std::ofstream(dir_ / "text" / ("doc" + std::to_string(i) + ".txt"))
          << "Document " << i << ": the quick brown fox jumps over the lazy dog. " << std::string(60, 'a' + i) << "\n";
    std::ofstream(dir_ / "tiny.toml") << "[model]\ndim = 16\nn_layers = 1\nn_heads = 2\nn_kv_heads = 1\nseq_len = 32\n"
                                      << "[moe]\nn_experts = 4\nexpert_hidden = 16\n"
                                      << "[training]\nsteps = 4\nglobal_batch_tokens = 128\nmicro_batch = 2\n"
                                      << "val_batches = 1\nthreads = 1\n"
                                      << "[data]\ndir = \"" << (dir_ / "text").string() << "\"\nval_fraction = 0.2\n"
                                      << "[metrics]\nlog_interval = 2\ndir = \"" << (dir_ / "run").string() << "\"\n";
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string moe(const std::string& args) const { return test::moe_binary() + " " + args; }
  fs::path dir_;
};

TEST_F(ObsCli, TrainWithDashboardThenReport) {
  auto r = test::run_command(moe("train --config " + (dir_ / "tiny.toml").string() + " --dashboard 0"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("dashboard: http://127.0.0.1:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("mfu: flops/token = 6 x "), std::string::npos) << r.output;
  // Not a terminal: plain lines, no progress bar.
  EXPECT_EQ(r.output.find('\r'), std::string::npos);
  const auto last = r.output.substr(r.output.rfind('\n', r.output.size() - 2) + 1);
  EXPECT_EQ(last.rfind("summary: steps=4 tokens=512 ", 0), 0u) << r.output;
  EXPECT_TRUE(fs::exists(dir_ / "run" / "metrics.jsonl"));

  r = test::run_command(moe("report " + (dir_ / "run").string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, "report: " + (dir_ / "run" / "report.html").string() + "\n");
  const std::string html = test::read_file(dir_ / "run" / "report.html");
  EXPECT_NE(html.find("window.MOE_DATA = {"), std::string::npos);
  EXPECT_EQ(html.find("<script src="), std::string::npos) << "the report must not load anything";
  r = test::run_command(moe("report " + (dir_ / "run").string() + " --output " + (dir_ / "r.html").string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(test::read_file(dir_ / "r.html"), html);
  for (const auto& entry : fs::directory_iterator(dir_ / "run"))
    EXPECT_EQ(entry.path().string().find(".tmp"), std::string::npos) << "left behind: " << entry.path();
}

TEST_F(ObsCli, ErrorsAreOneLine) {
  struct Case {
    std::string args, expected;
    int exit_code;
  };
  fs::create_directories(dir_ / "empty");
  fs::create_directories(dir_ / "bad");
  std::ofstream(dir_ / "bad" / "metrics.jsonl") << "{\"type\":\"run\"}\n{oops\n";
  Dashboard busy(0);
  const Case cases[] = {
      {"report " + (dir_ / "missing").string(), "not a run directory", 2},
      {"report " + (dir_ / "empty").string(), "no metrics.jsonl", 2},
      {"report " + (dir_ / "bad").string(), (dir_ / "bad" / "metrics.jsonl").string() + ":2: not a metrics record", 1},
      {"report", "run_dir", 2},
      {"train --config " + (dir_ / "tiny.toml").string() + " --dashboard 70000", "--dashboard", 2},
      {"train --config " + (dir_ / "tiny.toml").string() + " --dashboard " + std::to_string(busy.port()),
       "cannot listen on 127.0.0.1:" + std::to_string(busy.port()), 1},
      {"train --config " + (dir_ / "tiny.toml").string() + " --metrics.peak_tflops=0", "metrics.peak_tflops", 2},
  };
  for (const Case& c : cases) {
    const auto r = test::run_command(moe(c.args));
    EXPECT_EQ(r.exit_code, c.exit_code) << c.args << ": " << r.output;
    // The busy-port case prints the data line first; the error itself is one line.
    const std::string last = r.output.substr(r.output.rfind('\n', r.output.size() - 2) + 1);
    EXPECT_NE(last.find(c.expected), std::string::npos) << c.args << ": " << r.output;
    EXPECT_LE(count_lines(r.output), c.exit_code == 1 && c.args.find("train") == 0 ? 2 : 1) << c.args << ": " << r.output;
  }
}

}  // namespace
}  // namespace moe

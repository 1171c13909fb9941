// Careless and hostile input through the `moe` binary, as a new user would try it: each
// is refused with a one-line error and exit code 2, or does the documented thing.
#include <omp.h>
#include <sys/stat.h>

#include <fstream>

#include "cli/moe_process.h"

namespace moe::test {
namespace {

namespace fs = std::filesystem;

class CliInput : public CliTempDir {
 protected:
  void SetUp() override {
    CliTempDir::SetUp();
    fs::create_directories(dir_ / "text" / "sub");
    for (int i = 0; i < 40; ++i)
      std::ofstream(dir_ / "text" / (i % 2 ? "sub" : "") / ("doc" + std::to_string(i) + ".txt"))
          << "Document " << i << ": the quick brown fox jumps over the lazy dog. " << std::string(50, 'a' + i % 26);
    std::ofstream(dir_ / "tiny.toml") << "[model]\ndim = 16\nn_layers = 1\nn_heads = 2\nn_kv_heads = 1\nseq_len = 32\n"
                                      << "[moe]\nn_experts = 4\nexpert_hidden = 16\n"
                                      << "[training]\nsteps = 2\nglobal_batch_tokens = 128\nmicro_batch = 2\n"
                                      << "val_batches = 1\n"
                                      << "[data]\ndir = \"" << p("text") << "\"\nval_fraction = 0.2\n";
  }
  std::string train(const std::string& extra) const { return "train --config " + p("tiny.toml") + " " + extra; }
};

// --threads 100000 crashed inside OpenMP; now refused. Above the cores it is lowered to
// the core count with a warning (results do not depend on the thread count).
TEST_F(CliInput, ThreadCountIsBounded) {
  expect_one_line_error(run_moe(train("--threads 100000")), 2,
                        {"command line", "training.threads must be between 0 (all cores) and 1024, got 100000"});
  expect_one_line_error(run_moe("tokenize --tokenizer byte --input " + p("text") + " --output " + p("shards") +
                                " --threads 5000 --no-progress"),
                        2, {"--threads must be between 0 (all cores) and 1024, got 5000"});
  EXPECT_FALSE(fs::exists(dir_ / "shards"));
  const int cores = omp_get_num_procs();
  if (cores >= 1024) GTEST_SKIP() << "this machine has 1024 cores or more";
  const MoeResult r = run_moe(train("--threads 1024"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: training.threads = 1024 is more than the " + std::to_string(cores) +
                          " cores; using " + std::to_string(cores) + "\n"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("| device cpu | threads " + std::to_string(cores) + "\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("mfu: flops/token = "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("peak 989 TFLOP/s"), std::string::npos) << "an H100 peak on the CPU: " << r.output;
}

// model.n_layers = 1000000 hung for minutes before; every shape key has a bound.
// --init-from-hf: a folder that is not a Hugging Face model, or one given with --resume.
TEST_F(CliInput, InitFromHfRefusesWhatItCannotRead) {
  expect_one_line_error(run_moe(train("--init-from-hf " + p("text"))), 2,
                        {"--init-from-hf " + p("text"), "no config.json"});
  fs::create_directories(dir_ / "hf");
  std::ofstream(dir_ / "hf" / "config.json") << R"({"model_type": "llama"})";
  expect_one_line_error(run_moe(train("--init-from-hf " + p("hf"))), 2, {"model_type \"llama\""});
  expect_one_line_error(run_moe(train("--init-from-hf " + p("hf") + " --resume auto")), 2,
                        {"--init-from-hf starts a new run"});
}

TEST_F(CliInput, ModelShapesAreBounded) {
  expect_one_line_error(run_moe(train("--model.n_layers=1000000"), 30), 2,
                        {"command line", "model.n_layers must be at most 1024, got 1000000"});
  expect_one_line_error(run_moe(train("--moe.n_experts=1000000"), 30), 2,
                        {"moe.n_experts must be at most 65536, got 1000000"});
}

// `--output out/` names the folder out; it used to fail and leave a hidden half-export
// inside out/ that made every rerun refuse out/ as not empty.
TEST_F(CliInput, ExportToAFolderWithATrailingSlash) {
  const MoeResult run = run_moe(train("--checkpoint.dir=" + p("ckpt")));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const std::string checkpoint = p("ckpt/step_00000002");
  fs::create_directories(dir_ / "empty");
  for (const std::string folder : {"new", "empty"}) {  // to be created, or there and empty
    const MoeResult r = run_moe("export --allow-inexact --checkpoint " + checkpoint + " --output " + p(folder) + "/");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(fs::exists(dir_ / folder / "model.safetensors"));
    EXPECT_TRUE(fs::exists(dir_ / folder / "config.json"));
    for (const fs::path& where : {dir_, dir_ / folder})
      for (const auto& entry : fs::directory_iterator(where))
        EXPECT_NE(entry.path().filename().string()[0], '.') << "left behind: " << entry.path();
  }
  // A second export there is refused: the folder is not empty.
  expect_one_line_error(run_moe("export --allow-inexact --checkpoint " + checkpoint + " --output " + p("new") + "/"), 2,
                        {"exists and is not an empty directory"});
}

// A document that cannot be read: exit 2 and the reason, not exit 1 or a silent skip.
// (As root permission bits do not stop reading: a broken symlink and an EIO read.)
TEST_F(CliInput, UnreadableCorpusFilesAreNamedWithTheReason) {
  fs::create_symlink(p("nowhere"), dir_ / "text" / "sub" / "broken.txt");
  expect_one_line_error(run_moe(train("")), 2,
                        {"data.dir", p("text/sub/broken.txt"), "No such file or directory"});
  fs::remove(dir_ / "text" / "sub" / "broken.txt");
  fs::create_symlink("/proc/self/mem", dir_ / "text" / "mem.txt");
  std::ifstream probe("/proc/self/mem", std::ios::binary);
  char byte;
  if (probe && !probe.read(&byte, 1))
    expect_one_line_error(run_moe(train("")), 2, {p("text/mem.txt"), "cannot be read: Input/output error"});
  fs::remove(dir_ / "text" / "mem.txt");
  // A FIFO given as input is refused at once instead of blocking on its open.
  ASSERT_EQ(::mkfifo(p("fifo.txt").c_str(), 0600), 0);
  expect_one_line_error(run_moe("tokenize --tokenizer byte --input " + p("fifo.txt") + " --output " + p("shards") +
                                " --no-progress"),
                        2, {p("fifo.txt"), "is not a regular file or a directory"});
}

// The data readers through `moe train`: a JSONL line without the text, a corrupt Megatron
// index, a data.sources path that is nothing: each one line naming the file, exit code 2.
TEST_F(CliInput, BadDataFilesAreOneLineErrors) {
  fs::create_directories(dir_ / "jsonl");
  std::ofstream(dir_ / "jsonl" / "a.jsonl") << "{\"text\": \"fine\"}\n{\"body\": \"no text\"}\n";
  expect_one_line_error(run_moe(train("--data.dir=" + p("jsonl") + " --data.extension=.jsonl")), 2,
                        {p("jsonl/a.jsonl") + ":2: no string field 'text' (data.text_field)"});
  std::ofstream(dir_ / "ds.idx") << "MMIDIDX";  // truncated
  std::ofstream(dir_ / "ds.bin") << "";
  expect_one_line_error(run_moe(train("--data.sources=" + p("ds"))), 2,
                        {"megatron index '" + p("ds.idx") + "': truncated"});
  expect_one_line_error(run_moe(train("--data.sources=0.5:" + p("text") + ",0.5:" + p("nothing"))), 2,
                        {"data.sources: '" + p("nothing") + "' is neither a directory nor a Megatron dataset"});
}

// moe bench --sustain-ms times --kernels' GEMMs: alone, or with a negative time, one line.
TEST_F(CliInput, BenchSustainNeedsKernelsAndATime) {
  expect_one_line_error(run_moe("bench -c " + p("tiny.toml") + " --sustain-ms 100"), 2,
                        {"--sustain-ms requires --kernels"});
  expect_one_line_error(run_moe("bench -c " + p("tiny.toml") + " --kernels --sustain-ms -5"), 2,
                        {"--sustain-ms", "-5", "not in range 0 to 600000"});
}

// moe bench --no-steps and --kernel-sections narrow --kernels: alone, with --json (which needs
// the steps' phases) or with a section that does not exist, one line.
TEST_F(CliInput, BenchKernelOptionsNeedKernelsAndKnownSections) {
  const std::string bench = "bench -c " + p("tiny.toml");
  expect_one_line_error(run_moe(bench + " --no-steps"), 2, {"--no-steps requires --kernels"});
  expect_one_line_error(run_moe(bench + " --kernel-sections swiglu"), 2, {"--kernel-sections requires --kernels"});
  expect_one_line_error(run_moe(bench + " --kernels --kernel-sections gemms,fp9"), 2,
                        {"--kernel-sections", "fp9", "gemms,swiglu,wgrad,fp8"});
  expect_one_line_error(run_moe(bench + " --kernels --no-steps --sustain-ms 100 --kernel-sections gemms,wgrad"), 2,
                        {"--sustain-ms", "not swiglu or wgrad"});
  expect_one_line_error(run_moe(bench + " --kernels --no-steps --json " + p("profile.json")), 2,
                        {"--no-steps excludes --json"});
  EXPECT_FALSE(fs::exists(dir_ / "profile.json"));
}

}  // namespace
}  // namespace moe::test

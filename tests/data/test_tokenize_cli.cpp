// The `moe tokenizer train` / `moe tokenize` commands and training from shards, through
// the binary: exit codes, one-line errors naming the file, no partial output.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>

#include "bpe_test_util.h"

namespace moe {
namespace {

using namespace testing_bpe;

struct Result {
  int exit_code = -1;
  std::string output;
};

Result moe(const std::string& args) {
  std::string binary = env_or_empty("MOE_BINARY");
  if (binary.empty()) binary = (fs::read_symlink("/proc/self/exe").parent_path() / "moe").string();
  Result r;
  FILE* pipe = popen((binary + " " + args + " 2>&1").c_str(), "r");
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// A failed command: the expected exit code, one line, naming `names`.
void expect_failure(const Result& r, int code, std::initializer_list<std::string> names) {
  EXPECT_EQ(r.exit_code, code) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  for (const auto& name : names) EXPECT_NE(r.output.find(name), std::string::npos) << name << " not in: " << r.output;
}

class TokenizeCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = scratch_dir(std::string("tokcli_") + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_ / "text");
    for (int i = 0; i < 30; ++i)
      std::ofstream(dir_ / "text" / ("doc" + std::to_string(i) + ".txt"))
          << "Document " << i << ": the quick brown fox jumps over the lazy dog, isn't it? " << i * 7919 << "\n";
    std::ofstream(dir_ / "tiny.toml") << "[model]\ndim = 16\nn_layers = 1\nn_heads = 2\nn_kv_heads = 1\nseq_len = 32\n"
                                      << "[moe]\nn_experts = 4\nexpert_hidden = 16\n"
                                      << "[training]\nsteps = 4\nglobal_batch_tokens = 128\nmicro_batch = 2\n"
                                      << "val_batches = 2\nval_interval = 2\n";
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(TokenizeCli, TrainTokenizeAndTrainFromShards) {
  Result t = moe("tokenizer train --vocab-size 320 --input " + p("text") + " --output " + p("tok.json"));
  ASSERT_EQ(t.exit_code, 0) << t.output;
  EXPECT_NE(t.output.find("vocab 320"), std::string::npos) << t.output;
  Result k = moe("tokenize --tokenizer " + p("tok.json") + " --input " + p("text") + " --output " + p("shards") +
                 " --val-fraction 0.3 --threads 2");
  ASSERT_EQ(k.exit_code, 0) << k.output;
  EXPECT_NE(k.output.find("MB/s"), std::string::npos) << k.output;  // the progress line
  EXPECT_NE(k.output.find("eta"), std::string::npos) << k.output;
  ASSERT_TRUE(fs::exists(dir_ / "shards" / "train_00000.bin"));
  ASSERT_TRUE(fs::exists(dir_ / "shards" / "val_00000.bin"));
  Result r = moe("train --config " + p("tiny.toml") + " --data.shards=" + p("shards") + " --data.tokenizer=" + p("tok.json"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("summary: steps=4"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(vocab 320)"), std::string::npos) << r.output;

  // Corrupt shards stop training with one line naming the file and the problem.
  const std::string shard = (dir_ / "shards" / "train_00000.bin").string();
  std::string bytes = read_file(shard);
  std::ofstream(shard, std::ios::binary) << bytes.substr(0, bytes.size() - 3);
  expect_failure(moe("train --config " + p("tiny.toml") + " --data.shards=" + p("shards") + " --data.tokenizer=" + p("tok.json")),
                 1, {shard, "truncated"});
  bytes[0] = 'Z';
  std::ofstream(shard, std::ios::binary) << bytes;
  expect_failure(moe("train --config " + p("tiny.toml") + " --data.shards=" + p("shards") + " --data.tokenizer=" + p("tok.json")),
                 1, {shard, "wrong magic"});
  bytes[0] = 'M';
  bytes[bytes.size() - 20] ^= 0x40;
  std::ofstream(shard, std::ios::binary) << bytes;
  expect_failure(moe("train --config " + p("tiny.toml") + " --data.shards=" + p("shards") + " --data.tokenizer=" + p("tok.json")),
                 1, {shard, "checksum"});
  // Shards written for another vocabulary.
  bytes[bytes.size() - 20] ^= 0x40;
  std::ofstream(shard, std::ios::binary) << bytes;
  expect_failure(moe("train --config " + p("tiny.toml") + " --data.shards=" + p("shards") + " --data.tokenizer=byte"), 2,
                 {"data.shards", "320"});
}

// `moe tokenizer bench` repeats the documents whole until a pass holds --min-pass-mb:
// with bytes as tokens, every count follows from the corpus size.
TEST_F(TokenizeCli, BenchRepeatsTheCorpusPerPass) {
  int64_t corpus_bytes = 0;
  for (const auto& e : fs::directory_iterator(dir_ / "text")) corpus_bytes += static_cast<int64_t>(fs::file_size(e));
  auto field = [](const std::string& line, const std::string& key) {
    const size_t at = line.find(" " + key + "=");
    EXPECT_NE(at, std::string::npos) << key << " not in: " << line;
    return at == std::string::npos ? int64_t{-1} : std::stoll(line.substr(at + key.size() + 2));
  };
  for (double mb : {0.0, 0.01}) {
    Result r = moe("tokenizer bench --tokenizer byte --input " + p("text") + " --threads 3 --repeats 1 --min-pass-mb " +
                   std::to_string(mb));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const int64_t copies = mb == 0 ? 1 : (10'000 + corpus_bytes - 1) / corpus_bytes;
    EXPECT_EQ(field(r.output, "copies"), copies) << r.output;
    EXPECT_EQ(field(r.output, "corpus_bytes"), corpus_bytes) << r.output;
    EXPECT_EQ(field(r.output, "bytes"), copies * corpus_bytes) << r.output;
    EXPECT_EQ(field(r.output, "tokens"), copies * corpus_bytes) << r.output;
    EXPECT_EQ(field(r.output, "docs"), copies * 30) << r.output;
    EXPECT_NE(r.output.find(" busy_thread_mb_per_s="), std::string::npos) << r.output;
  }
  expect_failure(moe("tokenizer bench --tokenizer byte --input " + p("text") + " --min-pass-mb=-1"), 2,
                 {"--min-pass-mb"});
}

// A tokenizer trained with a custom --special: the first --special ends documents, so
// `moe tokenize` and `moe train` accept it (they refused it before).
TEST_F(TokenizeCli, ACustomSpecialEndsDocuments) {
  Result t = moe("tokenizer train --vocab-size 300 --special '<my_eos>' --input " + p("text") + " --output " +
                 p("tok.json"));
  ASSERT_EQ(t.exit_code, 0) << t.output;
  Result k = moe("tokenize --tokenizer " + p("tok.json") + " --input " + p("text") + " --output " + p("shards") +
                 " --val-fraction 0.2 --no-progress");
  ASSERT_EQ(k.exit_code, 0) << k.output;
  Result r = moe("train --config " + p("tiny.toml") + " --data.shards=" + p("shards") + " --data.tokenizer=" +
                 p("tok.json"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  expect_failure(moe("tokenizer train --vocab-size 300 --special '<e>' --special '<e>' --input " + p("text") +
                     " --output " + p("twice.json")),
                 2, {"--special: '<e>' is given twice"});
  EXPECT_FALSE(fs::exists(dir_ / "twice.json"));
  expect_failure(moe("tokenizer train --vocab-size 300 --special '<pad>' --special '<|endoftext|>' --input " +
                     p("missing") + " --output " + p("late.json")),
                 2, {"give '<|endoftext|>' first"});  // refused before the inputs are read
}

// SentencePiece .model and byte-fallback tokenizer.json files (made by the PyPI oracles)
// work in `moe tokenize` and `moe train`; broken ones are one line and exit 2.
TEST_F(TokenizeCli, SentencePieceAndByteFallbackFiles) {
  std::vector<std::string> texts;
  for (const auto& e : fs::directory_iterator(dir_ / "text")) texts.push_back(read_file(e.path()));
  write_texts(dir_ / "texts.json", texts);
  run_oracle("train-spm --model-type bpe --vocab 320 --texts " + p("texts.json") + " --out " + p("m.model"),
             "sentencepiece_oracle.py");
  run_oracle("train-hf --style legacy --vocab 400 --texts " + p("texts.json") + " --out " + p("llama.json"),
             "sentencepiece_oracle.py");
  if (HasFatalFailure()) return;
  for (const std::string spec : {"sentencepiece:" + p("m.model"), "hf:" + p("llama.json")}) {
    fs::remove_all(dir_ / "shards");
    Result k = moe("tokenize --tokenizer " + spec + " --input " + p("text") + " --output " + p("shards") +
                   " --val-fraction 0.3 --no-progress");
    ASSERT_EQ(k.exit_code, 0) << k.output;
    Result r = moe("train --config " + p("tiny.toml") + " --data.shards=" + p("shards") + " --data.tokenizer=" + spec);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("summary: steps=4"), std::string::npos) << r.output;
  }
  // From the text itself, each document ended by the model's </s>; the HF export names
  // the model's </s> and <s> ids.
  Result d = moe("train --config " + p("tiny.toml") + " --data.dir=" + p("text") + " --data.val_fraction=0.3 --data.tokenizer=" +
                 p("m.model") + " --checkpoint.dir=" + p("ckpt"));
  EXPECT_EQ(d.exit_code, 0) << d.output;
  Result x = moe("export --allow-inexact --checkpoint " + p("ckpt/step_00000004") + " --output " + p("hf"));
  ASSERT_EQ(x.exit_code, 0) << x.output;
  const nlohmann::json hf = read_json(dir_ / "hf" / "config.json");
  EXPECT_EQ(hf["eos_token_id"], 2);
  EXPECT_EQ(hf["bos_token_id"], 1);

  const std::string bytes = read_file(p("m.model"));
  std::ofstream(p("cut.model"), std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  expect_failure(moe("tokenize --tokenizer sentencepiece:" + p("cut.model") + " --input " + p("text") + " --output " +
                     p("out")),
                 2, {p("cut.model"), "not a SentencePiece model"});
  expect_failure(moe("train --config " + p("tiny.toml") + " --data.tokenizer=" + p("cut.model")), 2,
                 {"data.tokenizer", p("cut.model"), "not a SentencePiece model"});
  nlohmann::json llama = read_json(p("llama.json"));
  llama["model"]["vocab"].erase("<0xFF>");
  std::ofstream(p("no_ff.json")) << llama.dump();
  expect_failure(moe("tokenize --tokenizer hf:" + p("no_ff.json") + " --input " + p("text") + " --output " + p("out")), 2,
                 {p("no_ff.json"), "has no '<0xFF>'"});
  EXPECT_TRUE(!fs::exists(dir_ / "out") || fs::is_empty(dir_ / "out"));
}

TEST_F(TokenizeCli, BadInputIsOneLineAndLeavesNothing) {
  expect_failure(moe("tokenizer train --vocab-size 300 --input " + p("missing") + " --output " + p("t.json")), 2,
                 {p("missing"), "does not exist"});
  EXPECT_FALSE(fs::exists(dir_ / "t.json"));
  std::ofstream(dir_ / "wp.json") << R"({"model": {"type": "WordPiece", "vocab": {}}})";
  expect_failure(moe("tokenize --tokenizer " + p("wp.json") + " --input " + p("text") + " --output " + p("out")), 2,
                 {p("wp.json"), "unsupported model type 'WordPiece'"});
  std::ofstream(dir_ / "broken.json") << R"({"model": )";
  expect_failure(moe("tokenize --tokenizer " + p("broken.json") + " --input " + p("text") + " --output " + p("out")), 2,
                 {p("broken.json"), "not valid JSON"});
  expect_failure(moe("tokenize --tokenizer " + p("nope.json") + " --input " + p("text") + " --output " + p("out")), 2,
                 {p("nope.json"), "does not exist"});
  expect_failure(moe("tokenize --tokenizer byte --input " + p("missing.jsonl") + " --output " + p("out")), 2,
                 {p("missing.jsonl")});
  std::ofstream(dir_ / "bad.jsonl") << "{\"text\": \"fine\"}\nnot json\n";
  expect_failure(moe("tokenize --tokenizer byte --input " + p("text") + " " + p("bad.jsonl") + " --output " + p("out") +
                     " --no-progress"),
                 2, {p("bad.jsonl") + ":2", "not valid JSON"});
  EXPECT_TRUE(!fs::exists(dir_ / "out") || fs::is_empty(dir_ / "out"));
  expect_failure(moe("train --config " + p("tiny.toml") + " --data.shards=" + p("text") + " --data.tokenizer=byte"), 2,
                 {p("text"), "train_*.bin"});
}

}  // namespace
}  // namespace moe

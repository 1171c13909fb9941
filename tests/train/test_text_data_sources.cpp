// data.sources: text folders, JSONL and Megatron datasets blended by weight. Each sequence's
// source follows the weights; a restored position continues exactly as an uninterrupted
// read, in the loader and through the binary's stop and resume; bad sources are refused
// on one line.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "data/blended_source.h"
#include "data/shard.h"
#include "train/test_resume_fixtures.h"
#include "train/text_data.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

// A Megatron dataset (uint16 ids) written from the format's description in
// data/megatron_dataset.h: one sequence per document.
void write_megatron(const fs::path& prefix, const std::vector<std::vector<uint16_t>>& docs) {
  std::ofstream bin(prefix.string() + ".bin", std::ios::binary), idx(prefix.string() + ".idx", std::ios::binary);
  std::vector<int32_t> sizes;
  std::vector<int64_t> pointers, doc_index{0};
  int64_t offset = 0;
  for (const auto& doc : docs) {
    bin.write(reinterpret_cast<const char*>(doc.data()), static_cast<std::streamsize>(doc.size() * 2));
    sizes.push_back(static_cast<int32_t>(doc.size()));
    pointers.push_back(offset);
    offset += static_cast<int64_t>(doc.size()) * 2;
    doc_index.push_back(static_cast<int64_t>(sizes.size()));
  }
  const uint64_t version = 1, n = sizes.size(), m = doc_index.size();
  const uint8_t uint16_code = 8;
  idx.write("MMIDIDX\0\0", 9);
  idx.write(reinterpret_cast<const char*>(&version), 8);
  idx.write(reinterpret_cast<const char*>(&uint16_code), 1);
  idx.write(reinterpret_cast<const char*>(&n), 8);
  idx.write(reinterpret_cast<const char*>(&m), 8);
  idx.write(reinterpret_cast<const char*>(sizes.data()), static_cast<std::streamsize>(4 * n));
  idx.write(reinterpret_cast<const char*>(pointers.data()), static_cast<std::streamsize>(8 * n));
  idx.write(reinterpret_cast<const char*>(doc_index.data()), static_cast<std::streamsize>(8 * m));
}

// Three sources whose every document is made of one letter: 'a' (text files), 'b' (JSONL
// lines), 'c' (Megatron ids of the byte tokenizer).
void write_sources(const fs::path& dir) {
  fs::create_directories(dir / "a");
  fs::create_directories(dir / "b");
  for (int i = 0; i < 40; ++i) std::ofstream(dir / "a" / ("doc" + std::to_string(i) + ".txt")) << std::string(20 + i, 'a');
  std::ofstream jsonl(dir / "b" / "lines.jsonl");
  for (int i = 0; i < 40; ++i) jsonl << "{\"text\": \"" << std::string(30 + i, 'b') << "\"}\n";
  std::vector<std::vector<uint16_t>> docs;
  for (int i = 0; i < 40; ++i) docs.emplace_back(static_cast<size_t>(25 + i), uint16_t{'c'});
  write_megatron(dir / "c_text_document", docs);
}

RunConfig sources_config(const fs::path& dir, const std::string& weights_abc) {
  RunConfig c = test::tiny_config();
  c.model.vocab_size = 0;
  c.model.seq_len = 16;
  c.data.val_fraction = 0.25;
  c.data.extension = "";
  std::vector<std::string> w;
  std::string rest = weights_abc;
  for (size_t at; (at = rest.find(',')) != std::string::npos; rest = rest.substr(at + 1)) w.push_back(rest.substr(0, at));
  w.push_back(rest);
  c.data.sources = w[0] + ":" + (dir / "a").string() + "," + w[1] + ":" + (dir / "b").string() + "," + w[2] + ":" +
                   (dir / "c_text_document").string();
  return c;
}

// The letter most of a row's inputs are (EOS aside).
char letter_of(const int32_t* row, int64_t S) {
  int counts[3] = {0, 0, 0};
  for (int64_t s = 0; s < S; ++s)
    if (row[s] >= 'a' && row[s] <= 'c') ++counts[row[s] - 'a'];
  return static_cast<char>('a' + (std::max_element(counts, counts + 3) - counts));
}

std::vector<int32_t> read(BatchSource& source, int64_t batches, int64_t B, int64_t S) {
  std::vector<int32_t> all;
  std::vector<int32_t> inputs(static_cast<size_t>(B * S)), targets(inputs.size());
  for (int64_t i = 0; i < batches; ++i) {
    source.next_batch(B, inputs.data(), targets.data());
    all.insert(all.end(), inputs.begin(), inputs.end());
    all.insert(all.end(), targets.begin(), targets.end());
  }
  return all;
}

class DataSources : public test::TempDirTest {};

TEST_F(DataSources, SequencesFollowTheWeights) {
  write_sources(dir_);
  RunConfig config = sources_config(dir_, "0.5,0.3,0.2");
  TextData data = load_text_data(config, 1);
  EXPECT_EQ(config.model.vocab_size, 257);
  EXPECT_EQ(data.description, config.data.sources);
  const int64_t S = 16, n = 6000;
  std::vector<int32_t> inputs(static_cast<size_t>(n * S)), targets(inputs.size());
  data.train->next_batch(n, inputs.data(), targets.data());
  std::map<char, int> counts;
  for (int64_t i = 0; i < n; ++i) ++counts[letter_of(inputs.data() + i * S, S)];
  EXPECT_NEAR(counts['a'] / double(n), 0.5, 0.025);
  EXPECT_NEAR(counts['b'] / double(n), 0.3, 0.025);
  EXPECT_NEAR(counts['c'] / double(n), 0.2, 0.025);
  // Validation blends the held-out splits, the same batches after each reset.
  const std::vector<int32_t> first = read(*data.validation, 3, 4, S);
  data.validation->reset();
  EXPECT_EQ(read(*data.validation, 3, 4, S), first);
  EXPECT_GT(data.val_docs, 0);
  EXPECT_GT(data.train_docs, data.val_docs);
}

TEST_F(DataSources, ARestoredPositionContinuesTheUninterruptedStream) {
  write_sources(dir_);
  RunConfig config = sources_config(dir_, "2,1,1");
  TextData whole = load_text_data(config, 1);
  read(*whole.train, 37, 4, 16);  // past an epoch of some sources
  const std::vector<int64_t> saved = whole.train->state();
  const std::vector<int32_t> expected = read(*whole.train, 25, 4, 16);

  TextData resumed = load_text_data(config, 1);
  resumed.train->restore(saved);
  EXPECT_EQ(resumed.train->state(), saved);
  EXPECT_EQ(read(*resumed.train, 25, 4, 16), expected);
  EXPECT_EQ(resumed.train->state(), whole.train->state());
  // A position from another blend does not fit.
  EXPECT_THROW(resumed.train->restore({3, 2, 0, 0}), Error);
  EXPECT_THROW(resumed.train->restore({}), Error);
}

TEST(BlendedSourceUnit, ChoiceIsAPureFunctionOfSeedAndIndex) {
  auto counter = [] { return std::make_unique<test::ResumableTask>(16, 4, 1); };
  std::vector<std::unique_ptr<BatchSource>> a, b;
  for (int k = 0; k < 2; ++k) a.push_back(counter()), b.push_back(counter());
  BlendedSource x(std::move(a), {1, 3}, 7, 4), y(std::move(b), {1, 3}, 8, 4);
  int same = 0, second = 0;
  for (uint64_t i = 0; i < 4000; ++i) {
    same += x.source_of(i) == y.source_of(i);
    second += x.source_of(i);
    EXPECT_EQ(x.source_of(i), x.source_of(i));
  }
  EXPECT_NEAR(second / 4000.0, 0.75, 0.03);
  EXPECT_LT(same, 3600);  // another seed, another draw
}

TEST_F(DataSources, BadSourcesAreOneLineConfigErrors) {
  write_sources(dir_);
  auto message = [](RunConfig config) -> std::string {
    try {
      load_text_data(config, 1);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  RunConfig config = sources_config(dir_, "1,1,1");
  config.data.sources += ",1:" + (dir_ / "nowhere").string();
  EXPECT_NE(message(config).find("data.sources: '" + (dir_ / "nowhere").string() +
                                 "' is neither a directory nor a Megatron dataset"),
            std::string::npos)
      << message(config);
  config = sources_config(dir_, "1,1,1");
  config.data.tokenizer = "bpe:300";
  EXPECT_NE(message(config).find("holds token ids, so data.tokenizer must name the tokenizer"), std::string::npos);
  // Ids beyond the model's vocabulary.
  write_megatron(dir_ / "big", std::vector<std::vector<uint16_t>>(20, std::vector<uint16_t>{1, 2, 400}));
  config = sources_config(dir_, "1,1,1");
  config.data.sources = "1:" + (dir_ / "big").string();
  EXPECT_NE(message(config).find("big.bin': token id 400 outside the vocabulary of 257 (model.vocab_size)"),
            std::string::npos)
      << message(config);
  config.model.vocab_size = 401;  // fits: accepted
  EXPECT_EQ(message(config), "(accepted)");
}

// A `moe tokenize` folder is a source too: its train_ and val_ shards, ids checked
// against the tokenizer's vocabulary.
TEST_F(DataSources, ShardFoldersBlendWithText) {
  write_sources(dir_);
  auto write_shards = [&](const std::string& name, int64_t vocab) {
    fs::create_directories(dir_ / name);
    for (const char* split : {"train", "val"}) {
      ShardWriter writer((dir_ / name / (std::string(split) + "_00000.bin")).string(), vocab);
      for (int d = 0; d < 10; ++d) writer.add_document(std::vector<int32_t>(static_cast<size_t>(30 + d), 'c'));
      writer.commit();
    }
  };
  write_shards("shards", 257);
  write_shards("shards300", 300);
  RunConfig config = sources_config(dir_, "1,1,1");
  config.data.sources = "0.25:" + (dir_ / "a").string() + ",0.75:" + (dir_ / "shards").string();
  TextData data = load_text_data(config, 1);
  const int64_t S = 16, n = 2000;
  std::vector<int32_t> inputs(static_cast<size_t>(n * S)), targets(inputs.size());
  data.train->next_batch(n, inputs.data(), targets.data());
  int from_shards = 0;
  for (int64_t i = 0; i < n; ++i) from_shards += letter_of(inputs.data() + i * S, S) == 'c';
  EXPECT_NEAR(from_shards / double(n), 0.75, 0.04);
  EXPECT_GT(data.val_docs, 10);  // the val shard's 10 and a's held-out files
  // Shards of another vocabulary than data.tokenizer's: one line naming the folder.
  config.data.sources = "0.25:" + (dir_ / "a").string() + ",0.75:" + (dir_ / "shards300").string();
  try {
    load_text_data(config, 1);
    ADD_FAILURE() << "shards of another vocabulary accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("data.sources: the shards in '" + (dir_ / "shards300").string() +
                                         "' were written for a vocabulary of 300, data.tokenizer byte has 257"),
              std::string::npos)
        << e.what();
  }
}

// Through the binary: a blended run stopped at step 4 and resumed ends as one run does,
// checkpoint for checkpoint (the data position included).
TEST_F(DataSources, StopAndResumeThroughTheBinaryMatchesOneRun) {
  write_sources(dir_);
  const fs::path config = test::write_binary_run(dir_, 6);
  const std::string sources = "--data.sources=0.6:" + (dir_ / "a").string() + ",0.4:" + (dir_ / "c_text_document").string();
  test::Child full({"train", "-c", config.string(), sources, "--checkpoint.dir=" + (dir_ / "full").string()});
  ASSERT_EQ(full.wait(), 0) << full.output();
  EXPECT_NE(full.output().find("data: " + sources.substr(15) + " | tokenizer"), std::string::npos) << full.output();
  test::Child first({"train", "-c", config.string(), sources, "--training.stop_at=4"});
  ASSERT_EQ(first.wait(), 0) << first.output();
  test::Child second({"train", "-c", config.string(), sources, "--resume=auto"});
  ASSERT_EQ(second.wait(), 0) << second.output();
  EXPECT_EQ(test::losses_by_step(first.output() + second.output()), test::losses_by_step(full.output()));
  test::expect_same_checkpoint_state(dir_ / "ckpt" / "step_00000006", dir_ / "full" / "step_00000006");
  EXPECT_GT(read_checkpoint(dir_ / "full" / "step_00000006").manifest.source_state.size(), 3u);
  // Bad data.sources text: one line, exit 2.
  test::Child bad({"train", "-c", config.string(), "--data.sources=0:" + (dir_ / "a").string()});
  EXPECT_EQ(WEXITSTATUS(bad.wait()), 2) << bad.output();
  EXPECT_NE(bad.output().find("data.sources must be comma-separated WEIGHT:PATH entries"), std::string::npos)
      << bad.output();
}

}  // namespace
}  // namespace moe

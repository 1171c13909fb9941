// Replays the inputs the fuzzers (fuzz/) found, plus their seed corpora, through the same
// entry points: each must parse or throw moe::Error (never another exception), a parsed
// config must write back to itself, and every tensor of an accepted safetensors file must
// read. Under the fuzz build's sanitizers these inputs crashed once; here they pin the fix.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "data/bpe.h"
#include "data/megatron_dataset.h"
#include "data/sentencepiece_tokenizer.h"
#include "core/atomic_file.h"
#include "config/run_config.h"
#include "train/checkpoint_manifest.h"
#include "train/safetensors.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

fs::path source_dir() {
  if (const char* dir = std::getenv("MOE_SOURCE_DIR"); dir && *dir) return dir;
  return fs::path(__FILE__).parent_path().parent_path().parent_path();
}

std::vector<fs::path> inputs(const std::string& target) {
  std::vector<fs::path> files;
  for (const fs::path& dir : {source_dir() / "tests/fuzz_regression" / target, source_dir() / "fuzz/corpus" / target})
    if (fs::is_directory(dir))
      for (const auto& e : fs::directory_iterator(dir))
        if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

// Runs `parse` on every input; true when it parsed, false when it threw moe::Error.
int replay(const std::string& target, const std::function<void(const std::string&)>& parse) {
  const auto files = inputs(target);
  EXPECT_FALSE(files.empty()) << "no inputs for " << target;
  int parsed = 0;
  for (const auto& file : files) {
    SCOPED_TRACE(file.string());
    try {
      parse(read_file_bytes(file));
      ++parsed;
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "threw a non-moe exception: " << e.what();
    }
  }
  return parsed;
}

TEST(FuzzRegression, Config) {
  const int parsed = replay("config", [](const std::string& text) {
    RunConfig config = parse_config(text, "fuzz.toml");
    const std::string written = config_to_toml(config);
    EXPECT_EQ(config_to_toml(parse_config(written, "written")), written);
  });
  EXPECT_GE(parsed, 1);  // the seeds parse
}

TEST(FuzzRegression, SafeTensors) {
  const int parsed = replay("safetensors", [](const std::string& bytes) {
    SafeTensorsFile file = SafeTensorsFile::from_bytes(bytes, "fuzz");
    for (const auto& t : file.header().tensors) {
      if (t.dtype != "F32") continue;
      std::vector<float> out(static_cast<size_t>(t.numel()));
      file.read_f32(t.name, out.data(), t.numel());
    }
  });
  EXPECT_GE(parsed, 2);
}

// Checkpoint manifests: parsed (coverage exactly once) or refused on one line; an
// accepted version-2 manifest writes back to itself.
TEST(FuzzRegression, CheckpointManifest) {
  const int parsed = replay("checkpoint_manifest", [](const std::string& text) {
    const CheckpointManifest manifest = parse_checkpoint_manifest(text, "fuzz");
    if (manifest.version < 2) return;
    const std::string written = manifest_to_json(manifest);
    EXPECT_EQ(manifest_to_json(parse_checkpoint_manifest(written, "written")), written);
  });
  EXPECT_GE(parsed, 2);  // the version-1 and version-2 seeds
}

// Megatron .idx files: parsed (documents from token 0 to the last, never decreasing) or
// refused on one line.
TEST(FuzzRegression, MegatronIndex) {
  const int parsed = replay("megatron_index", [](const std::string& bytes) {
    const MegatronIndex index = parse_megatron_index(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), "fuzz");
    ASSERT_FALSE(index.doc_offsets.empty());
    EXPECT_EQ(index.doc_offsets.front(), 0);
    EXPECT_EQ(index.doc_offsets.back(), index.n_tokens);
    EXPECT_TRUE(std::is_sorted(index.doc_offsets.begin(), index.doc_offsets.end()));
  });
  EXPECT_EQ(parsed, 3);  // the seeds but the truncated one
}

TEST(FuzzRegression, TokenizerJson) {
  const fs::path path = fs::temp_directory_path() / ("moe_fuzz_regression_" + std::to_string(::getpid()) + ".json");
  const int parsed = replay("tokenizer_json", [&](const std::string& bytes) {
    std::ofstream(path, std::ios::binary) << bytes;
    BpeTokenizer tok(load_hf_tokenizer(path.string()), path.string());
    for (bool special : {false, true}) tok.decode(tok.encode("a  b\xff\xfe \xe6\x97\xa5\xf0\x9f\x8e\x89\n</s>", special));
  });
  fs::remove(path);
  EXPECT_GE(parsed, 3);  // the GPT-2 style, Llama-2 style and Metaspace seeds
}

TEST(FuzzRegression, SentencePieceModel) {
  const fs::path path = fs::temp_directory_path() / ("moe_fuzz_regression_" + std::to_string(::getpid()) + ".model");
  const int parsed = replay("sentencepiece_model", [&](const std::string& bytes) {
    std::ofstream(path, std::ios::binary) << bytes;
    SentencePieceTokenizer tok(path.string());
    tok.decode(tok.encode("a  b\xff\xfe \xe6\x97\xa5\xf0\x9f\x8e\x89\n</s>"));
  });
  fs::remove(path);
  EXPECT_GE(parsed, 2);  // the BPE (byte fallback) and unigram seeds
}

}  // namespace
}  // namespace moe

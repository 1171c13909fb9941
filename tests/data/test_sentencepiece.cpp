// SentencePiece .model files through libsentencepiece against the PyPI `sentencepiece`
// package: models it trained (BPE and unigram with byte fallback, unigram with unk) must
// give the same ids and decoded text on the default corpus and hostile text (raw bytes,
// invalid UTF-8 included); bad files are one-line errors naming the file; the spec forms.
#include <gtest/gtest.h>

#include "bpe_test_util.h"
#include "config/data_config.h"
#include "core/error.h"
#include "data/sentencepiece_tokenizer.h"
#include "data/tokenizer.h"

namespace moe {
namespace {

using namespace testing_bpe;

struct SpmStyle {
  const char* name;
  const char* flags;
};

std::string train_model(const fs::path& dir, const std::string& flags, const std::vector<std::string>& texts) {
  write_texts(dir / "texts.json", texts);
  const std::string path = (dir / "tok.model").string();
  run_oracle("train-spm " + flags + " --texts " + (dir / "texts.json").string() + " --out " + path,
             "sentencepiece_oracle.py");
  return path;
}

class SentencePieceModels : public ::testing::TestWithParam<SpmStyle> {};

TEST_P(SentencePieceModels, EncodeAndDecodeMatchSentencePiece) {
  fs::path dir = scratch_dir(std::string("spm_") + GetParam().name);
  std::vector<std::string> texts = corpus_sample(250'000);
  for (auto& t : hostile_texts()) texts.push_back(std::move(t));
  const std::string path = train_model(dir, GetParam().flags, texts);
  if (HasFatalFailure()) return;
  run_oracle("encode-spm --model " + path + " --texts " + (dir / "texts.json").string() + " --out " +
             (dir / "ids.json").string(), "sentencepiece_oracle.py");
  if (HasFatalFailure()) return;
  const nlohmann::json oracle = read_json(dir / "ids.json");
  std::unique_ptr<Tokenizer> tok = make_tokenizer("sentencepiece:" + path);
  EXPECT_EQ(tok->vocab_size(), oracle["vocab_size"].get<int64_t>());
  EXPECT_EQ(tok->eos_id(), oracle["eos"].get<int32_t>());
  EXPECT_EQ(tok->bos_id(), oracle["bos"].get<int32_t>());
  EXPECT_EQ(tok->eos_id(), 2);
  ASSERT_EQ(oracle["ids"].size(), texts.size());
  int mismatches = 0;
  size_t byte_pieces = 0;  // ids of <0xNN> pieces seen (3..258 in a byte-fallback model)
  for (size_t i = 0; i < texts.size() && mismatches < 3; ++i) {
    const std::vector<int32_t> ours = tok->encode(texts[i]);
    if (ours != oracle["ids"][i].get<std::vector<int32_t>>()) {
      ADD_FAILURE() << "text " << i << " (" << texts[i].size() << " bytes): ids differ";
      ++mismatches;
      continue;
    }
    byte_pieces += std::count_if(ours.begin(), ours.end(), [](int32_t id) { return id >= 3 && id < 259; });
    EXPECT_EQ(tok->decode(ours), from_base64(oracle["decoded"][i].get<std::string>())) << "decode of text " << i;
  }
  if (std::string(GetParam().flags).find("no-byte-fallback") == std::string::npos) EXPECT_GT(byte_pieces, 100u);
  // Out-of-range ids are errors, not reads past the vocabulary.
  EXPECT_THROW(tok->decode(std::vector<int32_t>{static_cast<int32_t>(tok->vocab_size())}), Error);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Styles, SentencePieceModels,
                         ::testing::Values(SpmStyle{"bpe", "--model-type bpe --vocab 1000"},
                                           SpmStyle{"unigram", "--model-type unigram --vocab 1000"},
                                           SpmStyle{"bpe_identity", "--model-type bpe --vocab 1000 --normalization identity"},
                                           SpmStyle{"unigram_unk", "--model-type unigram --vocab 1000 --no-byte-fallback"}),
                         [](const auto& info) { return std::string(info.param.name); });

// `spec` is refused with a ConfigError of one line holding `fragments`.
void expect_refused(const std::string& spec, const std::vector<std::string>& fragments) {
  try {
    make_tokenizer(spec);
    ADD_FAILURE() << "loaded " << spec;
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    for (const auto& f : fragments) EXPECT_NE(what.find(f), std::string::npos) << f << " not in: " << what;
  }
}

TEST(SentencePieceFiles, BadFilesAreRefusedInOneLine) {
  fs::path dir = scratch_dir("spm_bad");
  const std::vector<std::string> texts = corpus_sample(20'000);
  const std::string path = train_model(dir, "--model-type bpe --vocab 400", texts);
  if (HasFatalFailure()) return;
  ASSERT_NO_THROW(make_tokenizer(path));  // a path ending in .model
  const std::string bytes = read_file(path);
  for (size_t keep : {size_t{1}, size_t{10}, bytes.size() / 3, bytes.size() / 2, bytes.size() - 1}) {
    const std::string cut = (dir / ("cut_" + std::to_string(keep) + ".model")).string();
    std::ofstream(cut, std::ios::binary) << bytes.substr(0, keep);
    expect_refused("sentencepiece:" + cut, {cut + ": not a SentencePiece model"});
  }
  const std::string empty = (dir / "empty.model").string();
  std::ofstream{empty};
  expect_refused(empty, {empty + ": not a SentencePiece model"});
  const std::string json = (dir / "tokenizer.json").string();
  std::ofstream(json) << R"({"model": {"type": "BPE", "vocab": {}, "merges": []}})";
  expect_refused("sentencepiece:" + json, {json + ": not a SentencePiece model"});
  expect_refused("sentencepiece:" + (dir / "missing.model").string(), {"missing.model"});
  // A model without </s> cannot end documents.
  const std::string no_eos = train_model(dir, "--model-type bpe --vocab 400 --no-eos", texts);
  if (HasFatalFailure()) return;
  expect_refused("sentencepiece:" + no_eos, {no_eos + ": no end-of-sentence piece"});
  fs::remove_all(dir);
}

TEST(TokenizerSpecs, SentencePieceAndHfForms) {
  EXPECT_EQ(parse_tokenizer_spec("sentencepiece:/a/tok.bin").kind, TokenizerKind::SentencePiece);
  EXPECT_EQ(parse_tokenizer_spec("sentencepiece:/a/tok.bin").path, "/a/tok.bin");
  EXPECT_EQ(parse_tokenizer_spec("/a/tokenizer.model").kind, TokenizerKind::SentencePiece);
  EXPECT_EQ(parse_tokenizer_spec("hf:/a/tok").kind, TokenizerKind::HfJson);
  EXPECT_EQ(parse_tokenizer_spec("hf:/a/tok").path, "/a/tok");
  EXPECT_EQ(parse_tokenizer_spec("/a/tokenizer.json").path, "/a/tokenizer.json");
  EXPECT_EQ(parse_tokenizer_spec("tiktoken:gpt2:/a/r.tiktoken").path, "/a/r.tiktoken");
  EXPECT_EQ(parse_tokenizer_spec("sentencepiece:").kind, TokenizerKind::Invalid);
  EXPECT_EQ(parse_tokenizer_spec("hf:").kind, TokenizerKind::Invalid);
}

}  // namespace
}  // namespace moe

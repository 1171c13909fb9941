// Byte-fallback BPE from a tokenizer.json of the Llama-2 / Mistral kind (SentencePiece-style:
// "▁" for spaces, merges over characters, <0xNN> byte tokens) against HF `tokenizers`: files
// trained by it in each pipeline those models ship (normalizer Prepend + Replace; Metaspace
// prepend_scheme first, split off; Metaspace always, split on), one without byte fallback
// (unk, fused), and one whose merges reach across "e▁" and "s▁" (first in rank), so that
// pieces cannot be cut before a "▁". Ids must match exactly on the default corpus and
// hostile text; bad files are one-line errors naming the file.
#include <gtest/gtest.h>

#include "bpe_test_util.h"
#include "core/error.h"
#include "data/bpe.h"
#include "data/tokenizer.h"

namespace moe {
namespace {

using namespace testing_bpe;
using nlohmann::json;

std::vector<std::string> fallback_texts() {
  std::vector<std::string> texts = corpus_sample(250'000);
  for (auto& t : hostile_texts()) texts.push_back(std::move(t));
  // What the Metaspace pipelines treat specially: added tokens, leading spaces, "▁" itself,
  // text that spells a byte token.
  for (const char* t : {"a</s>b <s> c</s>", "<s>hello", "</s>", " leading", "  two  ", "\xe2\x96\x81 x \xe2\x96\x81\xe2\x96\x81y",
                        "<0x41><0xE6>", "tab\there\n", "</s> after"})
    texts.emplace_back(t);
  return texts;
}

std::string train_file(const fs::path& dir, const std::string& style, const std::vector<std::string>& texts) {
  write_texts(dir / "texts.json", texts);
  const std::string path = (dir / (style + ".json")).string();
  run_oracle("train-hf --style " + style + " --vocab 1200 --texts " + (dir / "texts.json").string() + " --out " + path,
             "sentencepiece_oracle.py");
  return path;
}

class ByteFallbackFiles : public ::testing::TestWithParam<const char*> {};

TEST_P(ByteFallbackFiles, EncodeAndDecodeMatchTokenizers) {
  const std::string style = GetParam();
  fs::path dir = scratch_dir("bpe_fallback_" + style);
  const std::vector<std::string> texts = fallback_texts();
  const std::string path = train_file(dir, style, texts);
  if (HasFatalFailure()) return;
  BpeModel model = load_hf_tokenizer(path);
  EXPECT_TRUE(model.char_level);
  EXPECT_EQ(model.byte_fallback, style != "unk");
  check_against_hf(dir, path, texts);
  // Pieces cut before "▁" are cached: a document encoded again merges nothing. Not so when
  // merges reach across "e▁": the whole document is one piece, merged every time.
  const BpeTokenizer bpe(load_hf_tokenizer(path), path);
  ASSERT_GT(texts[0].size(), 256u);
  bpe.encode(texts[0]);
  const uint64_t misses = bpe.cache_misses_on_this_thread();
  bpe.encode(texts[0]);
  EXPECT_EQ(bpe.cache_misses_on_this_thread() == misses, style != "legacy-spanning");
  // The file's </s> ends documents and <s> begins them (Llama-2's ids 2 and 1).
  std::unique_ptr<Tokenizer> tok = make_tokenizer(path);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->bos_id(), 1);
  if (style != "unk") {  // characters outside the vocabulary really went through the byte tokens
    const std::vector<int32_t> ids = tok->encode("\xf0\x9f\x8e\x89");  // 🎉
    ASSERT_GE(ids.size(), 4u);
    EXPECT_EQ(std::vector<int32_t>(ids.end() - 4, ids.end()), (std::vector<int32_t>{3 + 0xf0, 3 + 0x9f, 3 + 0x8e, 3 + 0x89}));
    EXPECT_EQ(tok->decode(ids), "\xf0\x9f\x8e\x89");
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Styles, ByteFallbackFiles,
                         ::testing::Values("legacy", "legacy-spanning", "metaspace-first", "metaspace-split", "unk"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// Loading `j` fails with a ConfigError naming the file and `fragment`, on one line.
void expect_refused(const fs::path& dir, const json& j, const std::string& fragment) {
  const std::string path = (dir / "bad.json").string();
  std::ofstream(path) << j.dump();
  try {
    make_tokenizer("hf:" + path);
    ADD_FAILURE() << "loaded: " << fragment;
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    EXPECT_EQ(what.rfind(path + ": ", 0), 0u) << what;
    EXPECT_NE(what.find(fragment), std::string::npos) << fragment << " not in: " << what;
  }
}

TEST(ByteFallbackFiles, BadFilesAreRefusedInOneLine) {
  fs::path dir = scratch_dir("bpe_fallback_bad");
  const std::string path = train_file(dir, "legacy", {"the quick brown fox jumps over the lazy dog", "the dog"});
  if (HasFatalFailure()) return;
  const json good = read_json(path);
  ASSERT_NO_THROW(make_tokenizer("hf:" + path));

  json j = good;
  j["model"]["vocab"].erase("<0x0A>");
  expect_refused(dir, j, "model.byte_fallback is true but model.vocab has no '<0x0A>'");
  j = good;
  j["model"]["byte_fallback"] = false;
  j["model"]["unk_token"] = nullptr;
  expect_refused(dir, j, "model.byte_fallback is false and model.unk_token is unset");
  j = good;
  j["model"]["unk_token"] = "<nope>";
  expect_refused(dir, j, "model.unk_token '<nope>' is not in model.vocab");
  j = good;
  j["decoder"] = nullptr;
  expect_refused(dir, j, "unsupported decoder");
  j = good;
  j["decoder"]["decoders"].erase(1);  // no ByteFallback: HF would print <0xE6> as text
  expect_refused(dir, j, "unsupported decoder");
  j = good;
  j["normalizer"]["normalizers"].push_back({{"type", "Lowercase"}});
  expect_refused(dir, j, "unsupported normalizer step");
  j = good;
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}, {"prepend_scheme", "first"}, {"split", false}};
  expect_refused(dir, j, "unsupported Metaspace replacement '_'");
  j["pre_tokenizer"]["replacement"] = "\xe2\x96\x81";
  j["pre_tokenizer"]["prepend_scheme"] = "sometimes";
  expect_refused(dir, j, "unsupported Metaspace prepend_scheme 'sometimes'");
  j = good;  // byte fallback asked of a GPT-2 style byte-level file
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  expect_refused(dir, j, "model.byte_fallback is true, but the file is not SentencePiece-style");
  j = good;
  j["model"]["merges"].push_back({"\xe2\x96\x81q", "zz"});
  expect_refused(dir, j, "uses or makes a token not in model.vocab");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moe

// BPE against the PyPI oracles: tokenizer.json files written by HF `tokenizers` in the
// GPT-2, Llama-3 and Qwen2 styles, our trainer's output loaded by HF, and tiktoken on a
// rank file derived from our trained vocabulary (tiktoken cannot download its own
// encodings here). Ids must match exactly on the default corpus and on hostile text.
#include <gtest/gtest.h>

#include "bpe_test_util.h"
#include "data/bpe.h"
#include "data/bpe_train.h"
#include "data/unicode.h"

namespace moe {
namespace {

using namespace testing_bpe;

std::vector<std::string> oracle_texts() {
  std::vector<std::string> texts = corpus_sample(250'000);
  for (auto& t : hostile_texts()) texts.push_back(std::move(t));
  return texts;
}

struct HfStyle {
  const char* pattern;
  const char* flags;
};

class BpeHfFiles : public ::testing::TestWithParam<HfStyle> {};

TEST_P(BpeHfFiles, EncodeAndDecodeMatchTokenizers) {
  const HfStyle style = GetParam();
  fs::path dir = scratch_dir(std::string("bpe_hf_") + style.pattern);
  std::vector<std::string> texts = oracle_texts();
  write_texts(dir / "texts.json", texts);
  const std::string json_path = (dir / "tokenizer.json").string();
  run_oracle(std::string("train --pattern ") + style.pattern + " --vocab 1200 " + style.flags + " --texts " +
             (dir / "texts.json").string() + " --out " + json_path);
  check_against_hf(dir, json_path, texts);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Styles, BpeHfFiles,
                         ::testing::Values(HfStyle{"gpt2", ""}, HfStyle{"llama3", "--ignore-merges"},
                                           HfStyle{"qwen2", "--nfc"}),
                         [](const auto& info) { return std::string(info.param.pattern); });

class BpeTrained : public ::testing::TestWithParam<PretokPattern> {};

// Our trainer's tokenizer.json: HF loads it and encodes exactly as we do.
TEST_P(BpeTrained, OutputLoadsInTokenizersAndMatches) {
  fs::path dir = scratch_dir(std::string("bpe_train_") + std::string(pattern_name(GetParam())));
  std::vector<std::string> texts = oracle_texts();
  write_texts(dir / "texts.json", texts);
  std::vector<std::string_view> views(texts.begin(), texts.end());
  BpeTrainOptions options;
  options.vocab_size = 1500;
  options.pattern = GetParam();
  BpeModel model = train_bpe(views, options);
  ASSERT_EQ(model.vocab.size(), 1500u);
  const std::string json_path = (dir / "tokenizer.json").string();
  save_hf_tokenizer(model, json_path);
  check_against_hf(dir, json_path, texts);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Patterns, BpeTrained, ::testing::Values(PretokPattern::Gpt2, PretokPattern::Llama3),
                         [](const auto& info) { return std::string(pattern_name(info.param)); });

// A tiktoken rank file written from our trained vocabulary (rank = id - 1, EOS dropped):
// load_tiktoken must encode exactly as tiktoken does on it.
TEST(BpeTiktoken, RankFileMatchesTiktoken) {
  fs::path dir = scratch_dir("bpe_tiktoken");
  std::vector<std::string> texts = oracle_texts();
  write_texts(dir / "texts.json", texts);
  std::vector<std::string_view> views(texts.begin(), texts.end());
  BpeTrainOptions options;
  options.vocab_size = 1500;
  options.pattern = PretokPattern::Llama3;
  BpeModel trained = train_bpe(views, options);
  {
    std::ofstream ranks(dir / "ranks.tiktoken");
    for (size_t id = 1; id < trained.vocab.size(); ++id) ranks << base64(trained.vocab[id]) << ' ' << id - 1 << '\n';
  }
  run_oracle("tiktoken --pattern llama3 --ranks " + (dir / "ranks.tiktoken").string() + " --texts " +
             (dir / "texts.json").string() + " --out " + (dir / "ids.json").string());
  nlohmann::json oracle = read_json(dir / "ids.json");
  BpeTokenizer tok(load_tiktoken((dir / "ranks.tiktoken").string(), PretokPattern::Llama3, {"<|endoftext|>"}), "tt");
  EXPECT_EQ(tok.vocab_size(), 1500);
  EXPECT_EQ(tok.eos_id(), 1499);
  int mismatches = 0;
  for (size_t i = 0; i < texts.size() && mismatches < 3; ++i) {
    std::vector<int32_t> ours = tok.encode(texts[i]);
    if (ours != oracle["ids"][i].get<std::vector<int32_t>>()) ADD_FAILURE() << "text " << i, ++mismatches;
    else EXPECT_EQ(tok.decode(ours), unicode::repair_utf8(texts[i])) << "text " << i;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moe

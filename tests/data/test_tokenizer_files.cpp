// Hostile tokenizer files, and which special token ends documents.
// Ids are bounded and checked (a stray id of 500000000 made the loader allocate ~16 GB;
// 2^32 + k was truncated to k and overwrote that token); each bad file is a one-line
// ConfigError naming the file and the id.
#include <gtest/gtest.h>

#include <algorithm>

#include "bpe_test_util.h"
#include "core/error.h"
#include "data/bpe.h"
#include "data/bpe_train.h"
#include "data/tokenizer.h"

namespace moe {
namespace {

using namespace testing_bpe;
using nlohmann::json;

class TokenizerFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = scratch_dir(std::string("tokfiles_") + ::testing::UnitTest::GetInstance()->current_test_info()->name());
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A small trained tokenizer.json (specials first: ids 0..), as JSON.
  json trained(const std::vector<std::string>& specials = {"<|endoftext|>"}) {
    const std::vector<std::string> texts = {"the quick brown fox jumps over the lazy dog", "the the the dog dog"};
    std::vector<std::string_view> views(texts.begin(), texts.end());
    BpeTrainOptions options;
    options.vocab_size = 280;
    options.specials = specials;
    options.threads = 1;
    save_hf_tokenizer(train_bpe(views, options), (dir_ / "trained.json").string());
    return read_json(dir_ / "trained.json");
  }
  std::string write(const json& j, const std::string& name) {
    const fs::path path = dir_ / name;
    std::ofstream(path) << j.dump();
    return path.string();
  }
  // Loading `j` fails with a ConfigError naming the file and every fragment, on one line.
  void expect_refused(const json& j, const std::vector<std::string>& fragments) {
    const std::string path = write(j, "bad.json");
    try {
      load_hf_tokenizer(path);
      ADD_FAILURE() << "loaded: " << fragments.front();
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
      EXPECT_EQ(what.rfind(path + ": ", 0), 0u) << what;
      for (const auto& f : fragments) EXPECT_NE(what.find(f), std::string::npos) << f << " not in: " << what;
    }
  }
  fs::path dir_;
};

// The vocabulary token with id `id` in a tokenizer.json.
std::string token_with_id(const json& j, int64_t id) {
  for (const auto& [token, value] : j["model"]["vocab"].items())
    if (value.get<int64_t>() == id) return token;
  return "";
}

TEST_F(TokenizerFiles, IdsAreBoundedIntegersWithoutDuplicates) {
  const json good = trained();
  ASSERT_NO_THROW(load_hf_tokenizer(write(good, "good.json")));
  const size_t listed = good["model"]["vocab"].size() + good["added_tokens"].size();
  const std::string bound = "ids must be integers in [0, " + std::to_string(2 * listed) + ")";
  int64_t last = 0;  // the largest id: a merged token
  for (const auto& [token, value] : good["model"]["vocab"].items()) last = std::max(last, value.get<int64_t>());
  const std::string fox = token_with_id(good, last);
  ASSERT_GT(last, 257);
  auto with_vocab_id = [&](const json& id) {
    json j = good;
    j["model"]["vocab"][fox] = id;
    return j;
  };
  // Far past the tokens listed (each id is a slot of the vocabulary): refused, not allocated.
  expect_refused(with_vocab_id(1000000), {"model.vocab: token '" + fox + "' has id 1000000", bound});
  // 2^32 + 5 is not 5.
  expect_refused(with_vocab_id(4294967301ull), {"has id 4294967301", bound});
  expect_refused(with_vocab_id(-1), {"has id -1", bound});
  expect_refused(with_vocab_id(3.5), {"has id 3.5"});
  expect_refused(with_vocab_id("7"), {"has id \"7\""});
  // Two tokens with one id: the second would silently replace the first.
  expect_refused(with_vocab_id(5), {"has id 5, as another token does"});

  json added = good;
  added["added_tokens"].push_back({{"id", 4294967296ull}, {"content", "<x>"}, {"special", true}});
  expect_refused(added, {"added token '<x>' has id 4294967296"});
  added["added_tokens"].back()["id"] = 0;
  expect_refused(added, {"added tokens '<|endoftext|>' and '<x>' have the same id 0"});
  added["added_tokens"].back()["id"] = last;
  expect_refused(added, {"model.vocab: token '" + fox + "' has id " + std::to_string(last) +
                             ", which added token '<x>' has"});
  // GPT-2 (and our writer) list <|endoftext|> in both places with one id: the same token.
  ASSERT_EQ(good["model"]["vocab"]["<|endoftext|>"], 0);
  EXPECT_EQ(make_tokenizer(write(good, "twice.json"))->eos_id(), 0);
}

TEST_F(TokenizerFiles, TiktokenRanksAreBounded) {
  std::ofstream(dir_ / "ranks.tiktoken") << base64("a") << " 0\n" << base64("b") << " 1\n" << base64("ab") << " 1000000\n";
  try {
    load_tiktoken((dir_ / "ranks.tiktoken").string(), PretokPattern::Gpt2, {"<|endoftext|>"});
    ADD_FAILURE() << "rank 1000000 of a 3-line file loaded";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("ranks.tiktoken:3: rank is not an integer in [0, 8)"), std::string::npos)
        << e.what();
  }
}

// A piece longer than the piece cache keeps (256 bytes) that is itself a token is found
// whole (tiktoken ranks, ignore_merges), as a short one is, every time it is encoded.
TEST_F(TokenizerFiles, LongPiecesAreFoundWhole) {
  const std::string long_token(300, 'x');
  std::ofstream(dir_ / "long.tiktoken") << base64("x") << " 0\n" << base64(long_token) << " 1\n";
  BpeTokenizer tok(load_tiktoken((dir_ / "long.tiktoken").string(), PretokPattern::Gpt2, {"<|endoftext|>"}), "long");
  for (int pass = 0; pass < 2; ++pass) EXPECT_EQ(tok.encode(long_token), std::vector<int32_t>{1}) << "pass " << pass;
  EXPECT_EQ(tok.encode(long_token + "x"), std::vector<int32_t>(301, 0));  // no merge reaches 301 x's
}

// `moe tokenizer train --special "<my_eos>"`: the first --special ends documents. It gets
// the lowest id, and the loaders take the special token with the lowest id when none has a
// usual end-of-text name, so `moe tokenize` and `moe train` accept what the trainer wrote
// (they refused it before). An order the loaders would read differently is refused.
TEST_F(TokenizerFiles, TheFirstSpecialEndsDocuments) {
  EXPECT_EQ(make_tokenizer(write(trained({"<my_eos>"}), "mine.json"))->eos_id(), 0);
  EXPECT_EQ(make_tokenizer(write(trained({"<my_eos>", "<pad>"}), "two.json"))->eos_id(), 0);
  EXPECT_EQ(make_tokenizer(write(trained({"<|endoftext|>", "<pad>"}), "usual.json"))->eos_id(), 0);
  // A usual name anywhere wins over the lowest id (files written elsewhere: Llama-3's
  // <|begin_of_text|> comes before <|end_of_text|>).
  json llama = trained({"<|begin_of_text|>"});
  llama["added_tokens"].push_back({{"id", 280}, {"content", "<|end_of_text|>"}, {"special", true}});
  EXPECT_EQ(make_tokenizer(write(llama, "llama.json"))->eos_id(), 280);
  // No special token at all: refused, saying what is needed.
  json plain = trained();
  for (auto& t : plain["added_tokens"]) t["special"] = false;
  try {
    make_tokenizer(write(plain, "plain.json"));
    ADD_FAILURE() << "no special token, but loaded";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("no end-of-text token: a special added token is needed"), std::string::npos)
        << e.what();
  }
  // Refused up front: the loaders would end documents with another token, a repeat, "".
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"<pad>", "<|endoftext|>"}, "the first special token ('<pad>') ends documents, but readers of the tokenizer "
                                   "take '<|endoftext|>' (a usual end-of-text name) instead; give '<|endoftext|>' first"},
      {{"</s>", "<|endoftext|>"}, "take '<|endoftext|>'"},
      {{"<e>", "<e>"}, "--special: '<e>' is given twice"},
      {{""}, "cannot be empty"},
      {{}, "at least one special token"},
  };
  for (const auto& [specials, message] : refused) {
    try {
      check_specials(specials);
      ADD_FAILURE() << "accepted: " << message;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
    BpeTrainOptions options;
    options.vocab_size = 300;
    options.specials = specials;
    EXPECT_THROW(train_bpe({}, options), ConfigError);
  }
}

}  // namespace
}  // namespace moe

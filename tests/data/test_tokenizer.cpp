#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "data/tokenizer.h"
#include "config/run_config.h"

namespace moe {
namespace {

TEST(Tokenizer, ByteRoundTripsEveryByte) {
  ByteTokenizer tok;
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  std::vector<int32_t> ids = tok.encode(all);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);  // unsigned: byte 0xff is id 255, not -1
  EXPECT_EQ(tok.decode(ids), all);

  // Random bytes, including invalid UTF-8 and NULs.
  CounterRng rng(7, "test.bytes");
  std::string random;
  for (int i = 0; i < 1000; ++i) random.push_back(static_cast<char>(rng.bits(i)[0] & 0xff));
  EXPECT_EQ(tok.decode(tok.encode(random)), random);
  EXPECT_TRUE(tok.encode("").empty());
}

TEST(Tokenizer, ByteVocabularyAndEos) {
  ByteTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 257);
  EXPECT_EQ(tok.eos_id(), 256);
  EXPECT_EQ(tok.name(), "byte");
  // EOS decodes to nothing; ids outside the vocabulary are errors.
  std::vector<int32_t> ids = {'a', 256, 'b', 256};
  EXPECT_EQ(tok.decode(ids), "ab");
  std::vector<int32_t> bad = {'a', 257};
  EXPECT_THROW(tok.decode(bad), Error);
  std::vector<int32_t> negative = {-1};
  EXPECT_THROW(tok.decode(negative), Error);
}

TEST(Tokenizer, MakeTokenizerByName) {
  DataConfig config;
  auto tok = make_tokenizer(config);
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->name(), "byte");
  EXPECT_EQ(tok->vocab_size(), kByteVocabSize);
  config.tokenizer = "bpe";
  try {
    make_tokenizer(config);
    ADD_FAILURE() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("data.tokenizer"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moe

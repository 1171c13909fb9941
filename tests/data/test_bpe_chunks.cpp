// Cutting documents into chunks (Tokenizer::find_cuts) and encoding them in parallel
// (ParallelEncoder, `moe tokenize`) must give exactly the ids of encoding each document
// whole, for every pre-tokeniser pattern and thread count, on the default corpus and on
// hostile text. The per-cut property is checked directly (every allowed cut at once),
// and a cut the rules refuse is shown to change the ids, so the checks can fail.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "bpe_test_util.h"
#include "data/bpe.h"
#include "data/bpe_train.h"
#include "data/shard.h"
#include "data/tokenize_files.h"

namespace moe {
namespace {

using namespace testing_bpe;

// Text full of the boundaries find_cuts looks at: '\n' before letters, digits,
// punctuation, spaces, CJK, emoji, combining marks, invalid bytes, and runs of each.
std::vector<std::string> newline_texts() {
  const std::vector<std::string> atoms = {
      "\n", "\n", "\n\n", "\r\n", " \n", "  \n", "\t\n", "\nA", "\nz", "\n1", "\n12345", "\n.", "\n'", "\n's", "\n 'll",
      "\n ", "\n  x", "\n\t", "\n\xe6\x97\xa5", "\n\xf0\x9f\x99\x82", "\n\xcc\x81", "\ne\xcc\x81", "\n\xc2\xa0",
      "\n\xe3\x80\x80", "\n\xff", "\n\xe2\x82", "x", "word", " word", "'s", "'S", "123", "4567", "!?", "(", " ",
      "   ", "\xe4\xb8\xad\xe6\x96\x87", "\xf0\x9f\x8e\x89", "\xed\xa0\x80", "e\xcc\x81", "\xef\xac\x81", "_",
      "<|endoftext|>"};
  CounterRng rng(23, "bpe.chunks");
  std::vector<std::string> texts;
  for (int k = 0; k < 40; ++k) {
    std::string s;
    const int n = 20 + static_cast<int>(rng.bits(k)[0] % 400);
    for (int i = 0; i < n; ++i) s += atoms[rng.bits(1000 + k * 1000 + i)[0] % atoms.size()];
    texts.push_back(s);
  }
  texts.push_back(std::string(5000, '\n') + "a" + std::string(3000, '\n'));
  texts.push_back("a\n" + std::string(4000, ' ') + "\nb\n" + std::string(2000, '7') + "\nc");
  std::string lines;
  for (int i = 0; i < 2000; ++i) lines += (i % 3 ? "line " : "  ") + std::to_string(i) + "\n";
  texts.push_back(lines);
  return texts;
}

std::vector<std::string> all_texts() {
  std::vector<std::string> texts = corpus_sample(400'000);
  for (auto& t : hostile_texts()) texts.push_back(std::move(t));
  for (auto& t : newline_texts()) texts.push_back(std::move(t));
  return texts;
}

// A small vocabulary trained on the texts themselves, so that merges across spaces,
// newlines and digits exist (they make a wrong cut visible).
BpeModel trained(const std::vector<std::string>& texts, PretokPattern pattern) {
  std::vector<std::string_view> views(texts.begin(), texts.end());
  BpeTrainOptions options;
  options.vocab_size = 900;
  options.pattern = pattern;
  options.threads = 2;
  return train_bpe(views, options);
}

std::vector<int32_t> encode_parts(const Tokenizer& tok, std::string_view text, const std::vector<size_t>& cuts) {
  std::vector<int32_t> ids;
  size_t begin = 0;
  for (size_t cut : cuts) tok.encode_append(text.substr(begin, cut - begin), ids), begin = cut;
  tok.encode_append(text.substr(begin), ids);
  return ids;
}

// Every cut find_cuts allows (chunk_bytes = 1), and cuts spaced as asked, leave the ids unchanged.
void expect_cuts_are_invisible(const Tokenizer& tok, const std::vector<std::string>& texts, bool expect_cuts) {
  size_t n_cuts = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::vector<int32_t> whole = tok.encode(texts[i]);
    std::vector<int32_t> appended = {7};
    tok.encode_append(texts[i], appended);
    ASSERT_EQ(std::vector<int32_t>(appended.begin() + 1, appended.end()), whole) << "encode_append, text " << i;
    for (size_t chunk : {size_t{1}, size_t{2}, size_t{64}, size_t{4096}}) {
      std::vector<size_t> cuts;
      tok.find_cuts(texts[i], chunk, cuts);
      for (size_t k = 0; k < cuts.size(); ++k) {
        ASSERT_GE(cuts[k], (k ? cuts[k - 1] : 0) + chunk) << "text " << i;
        ASSERT_LT(cuts[k], texts[i].size()) << "text " << i;
      }
      if (chunk == 1) n_cuts += cuts.size();
      const std::vector<int32_t> parts = encode_parts(tok, texts[i], cuts);
      if (parts != whole) {
        size_t at = 0;
        while (at < parts.size() && at < whole.size() && parts[at] == whole[at]) ++at;
        FAIL() << tok.name() << ": text " << i << " (" << texts[i].size() << " bytes) cut every >= " << chunk
               << " bytes (" << cuts.size() << " cuts): ids differ first at index " << at;
      }
    }
  }
  if (expect_cuts) EXPECT_GT(n_cuts, 1000u) << tok.name();
  else EXPECT_EQ(n_cuts, 0u) << tok.name();
}

// The reference: one document at a time, each encoded whole.
TokenizedDocuments whole_documents(const Tokenizer& tok, std::span<const std::string_view> views) {
  TokenizedDocuments want;
  for (std::string_view t : views) {
    std::vector<int32_t> ids = tok.encode(t);
    want.tokens.insert(want.tokens.end(), ids.begin(), ids.end());
    want.doc_offsets.push_back(want.n_tokens());
  }
  return want;
}

// ParallelEncoder with small chunks on 1, 2 and 7 threads: the same ids as one document at a time.
void expect_parallel_matches(const Tokenizer& tok, const std::vector<std::string>& texts, bool expect_cuts) {
  std::vector<std::string_view> views(texts.begin(), texts.end());
  const TokenizedDocuments want = whole_documents(tok, views);
  for (int threads : {1, 2, 7}) {
    ParallelEncoder encoder(tok, threads);
    encoder.chunk_min = encoder.chunk_max = 300;
    TokenizedDocuments got;
    for (int pass = 0; pass < 2; ++pass) {  // the second pass reuses the buffers and `got`
      encoder.encode(views, got);
      EXPECT_EQ(got.doc_offsets, want.doc_offsets) << tok.name() << ", " << threads << " threads";
      EXPECT_TRUE(got.tokens == want.tokens) << tok.name() << ", " << threads << " threads";
    }
    const auto n_docs = static_cast<int64_t>(texts.size());
    if (expect_cuts) EXPECT_GT(encoder.last_chunks(), n_docs + 10) << tok.name();
    else EXPECT_EQ(encoder.last_chunks(), n_docs) << tok.name();
  }
}

struct Variant {
  const char* name;
  PretokPattern pattern;
  bool nfc = false, ignore_merges = false, prefix_space = false, tiktoken = false;
  bool cuts = true;
};

class ChunkedEncoding : public ::testing::TestWithParam<Variant> {};

TEST_P(ChunkedEncoding, SameIdsAsWholeDocuments) {
  const Variant v = GetParam();
  const std::vector<std::string> texts = all_texts();
  BpeModel model = trained(texts, v.pattern);
  model.nfc = v.nfc;
  model.ignore_merges = v.ignore_merges;
  model.add_prefix_space = v.prefix_space;
  if (v.tiktoken) {  // as load_tiktoken builds it: ranks from the vocabulary, specials after it
    model.tiktoken_ranks = true;
    model.merges.clear();
  }
  BpeTokenizer tok(std::move(model), v.name);
  expect_cuts_are_invisible(tok, texts, v.cuts);
  expect_parallel_matches(tok, texts, v.cuts);
}

INSTANTIATE_TEST_SUITE_P(
    Patterns, ChunkedEncoding,
    ::testing::Values(Variant{"gpt2", PretokPattern::Gpt2}, Variant{"llama3", PretokPattern::Llama3},
                      Variant{"llama3_ignore_merges", PretokPattern::Llama3, false, true},
                      Variant{"llama3_tiktoken", PretokPattern::Llama3, false, false, false, true},
                      Variant{"qwen2_nfc", PretokPattern::Qwen2, true}, Variant{"qwen2", PretokPattern::Qwen2},
                      Variant{"gpt2_prefix_space", PretokPattern::Gpt2, false, false, true, false, false}),
    [](const auto& info) { return std::string(info.param.name); });

// Added tokens: one holding "\n" before its end could span a cut, so none is made; one
// ending in "\n" cannot, so cuts stay (and are still invisible).
TEST(ChunkedEncoding, AddedTokensAcrossNewlines) {
  const std::vector<std::string> texts = {"a\nb\nfoo\nbar\nc\nfoo\nd\nx foo\n\nbar\ny\n",
                                          "foo\nbar" + std::string(50, '\n') + "q\nfoo\nfoo\nbar\nfoo\n"};
  for (auto [content, cuts] : {std::pair{"foo\nbar", false}, std::pair{"foo\n", true}}) {
    BpeModel model = trained(all_texts(), PretokPattern::Llama3);
    model.added.push_back({content, static_cast<int32_t>(model.vocab.size()), false});
    BpeTokenizer tok(std::move(model), content);
    std::vector<std::string> with = texts;
    for (int i = 0; i < 30; ++i) with.push_back("line\n" + std::string(content) + "\nAfter\n" + std::to_string(i));
    size_t n = 0;
    for (const auto& t : with) {
      std::vector<size_t> c;
      tok.find_cuts(t, 1, c);
      n += c.size();
      EXPECT_EQ(encode_parts(tok, t, c), tok.encode(t)) << content;
    }
    EXPECT_EQ(n > 0, cuts) << content;
  }
}

// A hand-made model: the 256 bytes, then `merges` (pairs of existing tokens) in rank order.
BpeTokenizer tiny(PretokPattern pattern, const std::vector<std::pair<std::string, std::string>>& merges) {
  BpeModel m;
  m.pattern = pattern;
  for (int b = 0; b < 256; ++b) m.vocab.push_back(std::string(1, static_cast<char>(b)));
  auto id = [&](const std::string& t) {
    return static_cast<int32_t>(std::find(m.vocab.begin(), m.vocab.end(), t) - m.vocab.begin());
  };
  for (const auto& [l, r] : merges) {
    m.merges.emplace_back(id(l), id(r));
    m.vocab.push_back(l + r);
  }
  m.added.push_back({"<|endoftext|>", static_cast<int32_t>(m.vocab.size()), true});
  return BpeTokenizer(std::move(m), std::string(pattern_name(pattern)));
}

// The conditions are needed: for GPT-2 a cut after " \n" (whitespace before the '\n')
// changes the ids, and for Llama-3 a cut after '\n' before a space does.
TEST(ChunkedEncoding, RefusedCutsWouldChangeTheIds) {
  BpeTokenizer gpt2 = tiny(PretokPattern::Gpt2, {{" ", "\n"}});
  const std::string a = "x \nA";  // whole: "x" " " "\n" "A"; cut after '\n': "x" " \n" | "A"
  EXPECT_NE(encode_parts(gpt2, a, {3}), gpt2.encode(a));
  std::vector<size_t> cuts;
  gpt2.find_cuts(a, 1, cuts);
  EXPECT_TRUE(cuts.empty());
  gpt2.find_cuts("x\nA", 1, cuts);
  EXPECT_EQ(cuts, std::vector<size_t>{2});

  BpeTokenizer llama3 = tiny(PretokPattern::Llama3, {{"\n", " "}, {"\n ", " "}});
  const std::string b = "x\n  \nD";  // whole: "x" "\n  \n" "D"; cut after the first '\n': "\n" | "  \n"
  EXPECT_NE(encode_parts(llama3, b, {2}), llama3.encode(b));
  cuts.clear();
  llama3.find_cuts(b, 1, cuts);
  EXPECT_EQ(cuts, std::vector<size_t>{5});
  EXPECT_EQ(encode_parts(llama3, b, cuts), llama3.encode(b));
  cuts.clear();
  llama3.find_cuts("x  \nA\n1\n.\n\xe6\x97\xa5\n\xff", 1, cuts);  // llama3 needs nothing before the '\n'
  EXPECT_EQ(cuts, (std::vector<size_t>{4, 6, 8, 10, 14}));
}

// The per-thread piece cache evicts and grows: a piece gets the same ids whether it is
// merged afresh, found in the cache, or merged again after eviction (the first pass
// inserts 150k distinct pieces, far more than the smallest table holds).
TEST(ChunkedEncoding, PieceCacheEvictionKeepsIds) {
  BpeTokenizer tok(trained(all_texts(), PretokPattern::Llama3), "llama3");
  CounterRng rng(5, "bpe.cache");
  std::vector<std::string> words;
  for (int i = 0; i < 150'000; ++i) {
    const auto bits = rng.bits(i);
    std::string w(1, ' ');
    for (uint32_t k = 0; k < 3 + bits[0] % 12; ++k) w.push_back(static_cast<char>('a' + (bits[1] >> (k * 2)) % 26));
    if (i % 7 == 0) w += "\xe4\xb8\xad\xe6\x96\x87\xe5\xad\x97";  // CJK: more ids than a cache line holds
    words.push_back(w);
  }
  std::vector<std::vector<int32_t>> first;
  for (const auto& w : words) first.push_back(tok.encode(w));
  for (size_t i = words.size(); i-- > 0;) ASSERT_EQ(tok.encode(words[i]), first[i]) << i;
  BpeTokenizer fresh(trained(all_texts(), PretokPattern::Llama3), "fresh");  // its own, empty cache
  for (size_t i = 0; i < words.size(); i += 97) ASSERT_EQ(fresh.encode(words[i]), first[i]) << i;
}

TEST(ChunkedEncoding, ByteTokenizerCutsAnywhere) {
  ByteTokenizer tok;
  std::vector<std::string> texts = hostile_texts();
  std::vector<size_t> cuts;
  tok.find_cuts("abcdefg", 3, cuts);
  EXPECT_EQ(cuts, (std::vector<size_t>{3, 6}));
  expect_parallel_matches(tok, texts, true);
}

// An exception in a worker thread reaches the caller instead of ending the process.
TEST(ChunkedEncoding, ErrorsInWorkersReachTheCaller) {
  struct Failing final : Tokenizer {
    std::vector<int32_t> encode(std::string_view text) const override {
      if (text.find('!') != std::string_view::npos) throw std::runtime_error("bad text");
      return {1};
    }
    std::string decode(std::span<const int32_t>) const override { return ""; }
    int64_t vocab_size() const override { return 2; }
    int32_t eos_id() const override { return 0; }
    std::string name() const override { return "failing"; }
  } tok;
  std::vector<std::string_view> texts(50, "fine");
  texts[31] = "not fine!";
  ParallelEncoder encoder(tok, 3);
  EXPECT_THROW(encoder.encode(texts), std::runtime_error);
  texts[31] = "fine again";
  EXPECT_EQ(encoder.encode(texts).n_tokens(), 50);
}

// More threads than chunks, and than cores; few documents of very different sizes; one
// thread's buffer holding several chunks of one document: the ids are placed in order.
TEST(ParallelEncoder, ManyThreadsFewDocuments) {
  const std::vector<std::string> sample = corpus_sample(120'000);
  std::string big;
  for (const auto& t : sample) big += t;
  BpeTokenizer tok(trained(sample, PretokPattern::Llama3), "llama3");
  const std::vector<std::vector<std::string_view>> batches = {
      {"one short document\n"},
      {"a\nb", big, "tail\n"},
      {std::string_view(big).substr(0, 5000), std::string_view(big).substr(7, 40), big}};
  for (const auto& views : batches) {
    const TokenizedDocuments want = whole_documents(tok, views);
    for (int threads : {3, 16, 33}) {
      for (size_t chunk : {size_t{200}, size_t{8} << 10}) {
        ParallelEncoder encoder(tok, threads);
        encoder.chunk_min = encoder.chunk_max = chunk;
        const TokenizedDocuments got = encoder.encode(views);
        EXPECT_EQ(got.doc_offsets, want.doc_offsets) << threads << " threads, chunks of " << chunk;
        EXPECT_TRUE(got.tokens == want.tokens) << threads << " threads, chunks of " << chunk;
        if (views.size() > 1 && chunk == 200) EXPECT_GT(encoder.last_chunks(), 3 * threads);
      }
    }
  }
}

// The profile counts the piece-cache misses: a fresh tokenizer misses every piece once,
// and a second pass over the same documents misses far less, on one thread and on many
// (what each thread learnt in the first pass is shared with the others before the
// second). The ids never change.
TEST(ParallelEncoder, ProfileCountsPieceCacheMissesAndThreadsShareWhatTheyLearn) {
  const std::vector<std::string> sample = corpus_sample(60'000);
  const std::vector<std::string_view> views(sample.begin(), sample.end());
  for (int threads : {1, 8}) {
    SCOPED_TRACE(std::to_string(threads) + " threads");
    BpeTokenizer tok(trained(sample, PretokPattern::Llama3), "llama3");
    ParallelEncoder encoder(tok, threads);
    encoder.chunk_min = encoder.chunk_max = 512;  // many chunks, spread over the threads
    const TokenizedDocuments first_ids = encoder.encode(views);
    const uint64_t first = encoder.profile().cache_misses;
    EXPECT_GT(first, 100u);
    encoder.reset_profile();
    const TokenizedDocuments second_ids = encoder.encode(views);
    EXPECT_LT(encoder.profile().cache_misses * 10, first);
    EXPECT_TRUE(second_ids.tokens == first_ids.tokens);
    EXPECT_TRUE(first_ids.tokens == whole_documents(tok, views).tokens);
  }
  ByteTokenizer bytes;
  ParallelEncoder byte_encoder(bytes, 2);
  byte_encoder.encode(views);
  EXPECT_EQ(byte_encoder.profile().cache_misses, 0u);  // no cache to miss
}

// Empty documents (alone, first, last, between) and the empty batch; `out` reused from a
// larger batch shrinks to the new one, and grows again.
TEST(ParallelEncoder, EmptyDocumentsAndReuse) {
  const std::vector<std::string> sample = corpus_sample(60'000);
  BpeTokenizer tok(trained(sample, PretokPattern::Gpt2), "gpt2");
  std::vector<std::string_view> mixed = {"", sample[0], "", "", sample[1], ""};
  std::vector<std::string_view> all_sample(sample.begin(), sample.end());
  const std::vector<std::vector<std::string_view>> batches = {
      all_sample, {"", "", ""}, {}, mixed, {""}, all_sample, {sample[2]}, mixed};
  for (int threads : {1, 4}) {
    ParallelEncoder encoder(tok, threads);
    encoder.chunk_min = encoder.chunk_max = 256;
    TokenizedDocuments got;
    for (size_t b = 0; b < batches.size(); ++b) {
      encoder.encode(batches[b], got);
      const TokenizedDocuments want = whole_documents(tok, batches[b]);
      ASSERT_EQ(got.doc_offsets, want.doc_offsets) << "batch " << b << ", " << threads << " threads";
      ASSERT_TRUE(got.tokens == want.tokens) << "batch " << b << ", " << threads << " threads";
      EXPECT_EQ(got.n_docs(), static_cast<int64_t>(batches[b].size()));
    }
    EXPECT_EQ(encoder.profile().passes, static_cast<int64_t>(batches.size()));
  }
}

// One document of several MB with the default chunk sizes: cut into > 8 chunks per
// thread, encoded on 5 threads, the same ids as encoding it whole (BPE and bytes).
TEST(ParallelEncoder, OneHugeDocument) {
  const std::vector<std::string> sample = corpus_sample(400'000);
  std::string huge;
  while (huge.size() < (size_t{3} << 20))
    for (const auto& t : sample) huge += t;
  BpeTokenizer bpe(trained(sample, PretokPattern::Qwen2), "qwen2");
  ByteTokenizer bytes;
  for (const Tokenizer* tok : {static_cast<const Tokenizer*>(&bpe), static_cast<const Tokenizer*>(&bytes)}) {
    const std::vector<std::string_view> views = {huge};
    const TokenizedDocuments want = whole_documents(*tok, views);
    ParallelEncoder encoder(*tok, 5);
    const TokenizedDocuments got = encoder.encode(views);
    EXPECT_GT(encoder.last_chunks(), 5 * 8) << tok->name();
    EXPECT_EQ(got.doc_offsets, want.doc_offsets) << tok->name();
    EXPECT_TRUE(got.tokens == want.tokens) << tok->name();
    const ParallelEncoder::Profile& p = encoder.profile();
    EXPECT_EQ(p.passes, 1);
    EXPECT_GT(p.busy_seconds, 0.0);
    EXPECT_LE(p.busy_seconds, 5 * p.encode_seconds * 1.0001 + 1e-6);  // no thread is busy longer than the phase
    encoder.reset_profile();
    EXPECT_EQ(encoder.profile().passes, 0);
  }
}

// `moe tokenize` over many small batches (reading and writing overlap the encoding):
// the shards hold exactly the whole-document ids, in input order, for any thread count.
TEST(ChunkedEncoding, ShardsFromManyBatches) {
  fs::path dir = scratch_dir("chunked_shards");
  std::vector<std::string> texts = corpus_sample(200'000);
  for (auto& t : newline_texts()) texts.push_back(std::move(t));
  fs::create_directories(dir / "in");
  std::vector<std::string> names;
  for (size_t i = 0; i < texts.size(); ++i) {
    names.push_back(fmt::format("doc{:04d}.txt", i));
    std::ofstream(dir / "in" / names.back(), std::ios::binary) << texts[i];
  }
  BpeTokenizer tok(trained(texts, PretokPattern::Llama3), "llama3");
  for (int threads : {1, 2, 7}) {
    TokenizeOptions o;
    o.input.paths = {(dir / "in").string()};
    o.output_dir = (dir / ("out" + std::to_string(threads))).string();
    o.threads = threads;
    o.batch_bytes = 20'000;
    o.val_fraction = 0.2;
    o.progress = false;
    TokenizeStats stats = tokenize_to_shards(tok, o);
    EXPECT_EQ(stats.docs, static_cast<int64_t>(texts.size()));
    int64_t next[2] = {0, 0};  // train, val
    ShardSet train(ShardSet::list(o.output_dir, "train")), val(ShardSet::list(o.output_dir, "val"));
    ASSERT_EQ(train.n_docs() + val.n_docs(), static_cast<int64_t>(texts.size()));
    for (size_t i = 0; i < texts.size(); ++i) {
      const bool held_out = is_validation_document(names[i], o.val_fraction);
      ShardSet& set = held_out ? val : train;
      const int64_t d = next[held_out]++;
      std::vector<int32_t> ids(static_cast<size_t>(set.doc_size(d)));
      set.copy(d, 0, set.doc_size(d), ids.data());
      ASSERT_EQ(ids, tok.encode(texts[i])) << threads << " threads, document " << i;
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moe

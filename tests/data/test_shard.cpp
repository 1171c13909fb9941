// Token shards (format, validation errors), the loader over them (ranks, resume,
// document boundaries) and `moe tokenize` end to end.
#include <gtest/gtest.h>

#include <fstream>

#include "bpe_test_util.h"
#include "core/error.h"
#include "data/bpe.h"
#include "data/bpe_train.h"
#include "data/loader.h"
#include "data/shard.h"
#include "data/tokenize_files.h"

namespace moe {
namespace {

using namespace testing_bpe;

TokenizedDocuments sample_docs(int64_t vocab, int n_docs, uint64_t seed) {
  TokenizedDocuments docs;
  CounterRng rng(seed, "shard.docs");
  for (int d = 0; d < n_docs; ++d) {
    const int len = d == 3 ? 0 : static_cast<int>(rng.bits(d)[0] % 200);  // doc 3 is empty
    for (int i = 0; i < len; ++i) docs.tokens.push_back(static_cast<int32_t>(rng.bits(1000 + d * 1000 + i)[1] % vocab));
    docs.doc_offsets.push_back(static_cast<int64_t>(docs.tokens.size()));
  }
  return docs;
}

std::string write_shard(const fs::path& path, const TokenizedDocuments& docs, int64_t vocab) {
  ShardWriter writer(path.string(), vocab);
  for (int64_t d = 0; d < docs.n_docs(); ++d) writer.add_document(docs.doc(d));
  writer.commit();
  return path.string();
}

std::vector<int32_t> all_tokens(const DocumentSource& src) {
  std::vector<int32_t> out;
  for (int64_t d = 0; d < src.n_docs(); ++d) {
    std::vector<int32_t> doc(static_cast<size_t>(src.doc_size(d)));
    src.copy(d, 0, src.doc_size(d), doc.data());
    out.insert(out.end(), doc.begin(), doc.end());
    out.push_back(-1);
  }
  return out;
}

TEST(Shard, RoundTripsUint16AndUint32) {
  fs::path dir = scratch_dir("shard_roundtrip");
  for (int64_t vocab : {int64_t{300}, int64_t{65536}, int64_t{70000}}) {
    TokenizedDocuments docs = sample_docs(vocab, 40, static_cast<uint64_t>(vocab));
    docs.tokens.push_back(static_cast<int32_t>(vocab - 1));  // the largest id survives the narrow type
    docs.doc_offsets.push_back(docs.n_tokens());
    std::string path = write_shard(dir / "train_00000.bin", docs, vocab);
    ShardReader reader(path);
    EXPECT_EQ(reader.token_bytes(), vocab <= 65536 ? 2u : 4u);
    EXPECT_EQ(reader.n_docs(), docs.n_docs());
    EXPECT_EQ(reader.n_tokens(), docs.n_tokens());
    EXPECT_EQ(reader.vocab_size(), vocab);
    EXPECT_EQ(all_tokens(ShardSet({path})), all_tokens(docs));
    EXPECT_FALSE(fs::exists(path + ".tmp-" + std::to_string(::getpid())));
  }
  ShardWriter bad((dir / "bad.bin").string(), 300);
  std::vector<int32_t> out_of_range = {300};
  EXPECT_THROW(bad.add_document(out_of_range), Error);
  fs::remove_all(dir);
}

void expect_error(const std::string& path, const std::string& what) {
  try {
    ShardReader reader(path);
    ADD_FAILURE() << "expected an error containing '" << what << "'";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST(Shard, CorruptionIsReportedWithFileAndProblem) {
  fs::path dir = scratch_dir("shard_corrupt");
  TokenizedDocuments docs = sample_docs(1000, 20, 5);
  const std::string good = write_shard(dir / "good.bin", docs, 1000);
  const std::string bytes = read_file(good);
  auto variant = [&](const std::string& name, std::string content) {
    std::ofstream((dir / name).string(), std::ios::binary) << content;
    return (dir / name).string();
  };
  expect_error(variant("short.bin", bytes.substr(0, 40)), "truncated");
  expect_error(variant("cut.bin", bytes.substr(0, bytes.size() - 8)), "truncated");
  std::string magic = bytes;
  magic[0] = 'X';
  expect_error(variant("magic.bin", magic), "wrong magic");
  std::string payload = bytes;
  payload[kShardHeaderBytes + 5] ^= 1;
  expect_error(variant("payload.bin", payload), "checksum mismatch");
  std::string header = bytes;
  header[16] ^= 1;  // n_tokens
  expect_error(variant("header.bin", header), "header checksum");
  std::string version = bytes;
  version[8] = 9;
  expect_error(variant("version.bin", version), "unsupported version");
  expect_error((dir / "missing.bin").string(), "cannot open");
  EXPECT_THROW(ShardSet::list(dir.string(), "train"), ConfigError);  // no train_*.bin here
  fs::remove_all(dir);
}

struct Rows {
  std::vector<int32_t> inputs, targets, doc_ids;
};

Rows read_rows(PackedLoader& loader, int64_t batch) {
  const size_t n = static_cast<size_t>(batch * loader.seq_len());
  Rows r{std::vector<int32_t>(n), std::vector<int32_t>(n), std::vector<int32_t>(n)};
  loader.next_batch(batch, r.inputs.data(), r.targets.data(), r.doc_ids.data());
  return r;
}

TEST(ShardLoader, SameBatchesAsInMemoryAcrossShards) {
  fs::path dir = scratch_dir("shard_loader");
  TokenizedDocuments docs = sample_docs(5000, 30, 9), a, b;
  for (int64_t d = 0; d < docs.n_docs(); ++d) {
    TokenizedDocuments& part = d < 12 ? a : b;
    part.tokens.insert(part.tokens.end(), docs.doc(d).begin(), docs.doc(d).end());
    part.doc_offsets.push_back(part.n_tokens());
  }
  write_shard(dir / "train_00000.bin", a, 5000);
  write_shard(dir / "train_00001.bin", b, 5000);
  ShardSet set(ShardSet::list(dir.string(), "train"));
  ASSERT_EQ(set.n_docs(), 30);
  PackedLoader mem(docs, 4999, 64, 7, true), mapped(set, 4999, 64, 7, true);
  for (int step = 0; step < 40; ++step) {
    Rows x = read_rows(mem, 3), y = read_rows(mapped, 3);
    ASSERT_EQ(x.inputs, y.inputs) << step;
    ASSERT_EQ(x.targets, y.targets) << step;
  }
  fs::remove_all(dir);
}

TEST(ShardLoader, RanksAreDisjointSlicesOfTheSingleRankStream) {
  TokenizedDocuments docs = sample_docs(5000, 25, 3);
  const int64_t S = 16, world = 3;
  PackedLoader single(docs, 4999, S, 11, true);
  std::vector<std::unique_ptr<PackedLoader>> ranks;
  for (int64_t r = 0; r < world; ++r) ranks.push_back(std::make_unique<PackedLoader>(docs, 4999, S, 11, true, r, world));
  for (int step = 0; step < 30; ++step) {
    // One batch of 2 rows per rank covers 6 consecutive single-rank sequences.
    std::vector<Rows> per_rank;
    for (auto& l : ranks) per_rank.push_back(read_rows(*l, 2));
    Rows all = read_rows(single, 2 * world);
    for (int64_t row = 0; row < 2; ++row)
      for (int64_t r = 0; r < world; ++r) {
        auto got = std::vector<int32_t>(per_rank[r].inputs.begin() + row * S, per_rank[r].inputs.begin() + (row + 1) * S);
        const int64_t g = row * world + r;
        auto want = std::vector<int32_t>(all.inputs.begin() + g * S, all.inputs.begin() + (g + 1) * S);
        ASSERT_EQ(got, want) << "step " << step << " row " << row << " rank " << r;
      }
    for (auto& l : ranks) ASSERT_EQ(l->state(), single.state());
  }
}

TEST(ShardLoader, ResumeFromStateYieldsTheSameBatches) {
  TokenizedDocuments docs = sample_docs(5000, 25, 4);
  PackedLoader first(docs, 4999, 32, 5, true, 1, 2);
  for (int i = 0; i < 17; ++i) read_rows(first, 3);
  LoaderState saved = first.state();
  PackedLoader resumed(docs, 4999, 32, 5, true, 1, 2);
  resumed.restore(saved);
  for (int i = 0; i < 20; ++i) ASSERT_EQ(read_rows(first, 3).inputs, read_rows(resumed, 3).inputs) << i;
}

TEST(ShardLoader, DocumentIdsStartAfterEachEos) {
  TokenizedDocuments docs;
  for (int len : {5, 0, 3, 9}) {
    for (int i = 0; i < len; ++i) docs.tokens.push_back(1 + i);
    docs.doc_offsets.push_back(docs.n_tokens());
  }
  PackedLoader loader(docs, 0, 12, 1, false);
  Rows r = read_rows(loader, 1);
  // Stream: 1 2 3 4 5 E | E | 1 2 3 E | 1 ...
  EXPECT_EQ(r.inputs, (std::vector<int32_t>{1, 2, 3, 4, 5, 0, 0, 1, 2, 3, 0, 1}));
  EXPECT_EQ(r.doc_ids, (std::vector<int32_t>{0, 0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 3}));
}

void write(const fs::path& path, std::string_view text) { std::ofstream(path, std::ios::binary) << text; }

TEST(Tokenize, ShardsHoldTheEncodedDocumentsInOrder) {
  fs::path dir = scratch_dir("tokenize_ok");
  fs::create_directories(dir / "in" / "sub");
  write(dir / "in" / "b.txt", "second document\n");
  write(dir / "in" / "a.txt", "first document, with \xff invalid bytes");
  write(dir / "in" / "sub" / "c.txt", "");
  write(dir / "in" / "skip.md", "not read");
  write(dir / "d.jsonl", "{\"body\": \"jsonl one\"}\n\n{\"body\": \"jsonl two \\ud83d\\ude42\"}\n");
  std::vector<std::string> texts = {"first document, with \xff invalid bytes", "second document\n", "", "jsonl one",
                                    "jsonl two \xf0\x9f\x99\x82"};
  std::vector<std::string_view> views(texts.begin(), texts.end());
  BpeTrainOptions train;
  train.vocab_size = 300;
  BpeTokenizer tok(train_bpe(views, train), "t");

  std::vector<std::string> bytes_by_threads;
  for (int threads : {1, 2}) {
    TokenizeOptions o;
    o.input = {{(dir / "in").string(), (dir / "d.jsonl").string()}, ".txt", "body"};
    o.output_dir = (dir / ("out" + std::to_string(threads))).string();
    o.threads = threads;
    o.shard_tokens = 12;  // several shards
    o.progress = false;
    TokenizeStats stats = tokenize_to_shards(tok, o);
    EXPECT_EQ(stats.docs, 5);
    ShardSet set(ShardSet::list(o.output_dir, "train"));
    EXPECT_GT(stats.shards, 1);
    ASSERT_EQ(set.n_docs(), 5);
    std::string all;
    for (int64_t d = 0; d < 5; ++d) {
      std::vector<int32_t> ids(static_cast<size_t>(set.doc_size(d)));
      set.copy(d, 0, set.doc_size(d), ids.data());
      EXPECT_EQ(ids, tok.encode(texts[d])) << d;
      all += read_file(ShardSet::list(o.output_dir, "train")[0]);
    }
    bytes_by_threads.push_back(all);
  }
  EXPECT_EQ(bytes_by_threads[0], bytes_by_threads[1]);
  fs::remove_all(dir);
}

// --val-fraction holds out the documents data.dir would: by the hash of the path below --input.
TEST(Tokenize, ValidationSplitMatchesDataDir) {
  fs::path dir = scratch_dir("tokenize_split");
  fs::create_directories(dir / "in" / "sub");
  int64_t want_val = 0, want_train = 0;
  for (int i = 0; i < 40; ++i) {
    const std::string name = (i % 2 ? "sub/" : "") + std::string("doc") + std::to_string(i) + ".txt";
    write(dir / "in" / name, std::string(static_cast<size_t>(i + 1), 'x'));  // length names the document
    (is_validation_document(name, 0.3) ? want_val : want_train) += i + 1;
  }
  ByteTokenizer tok;
  TokenizeOptions o;
  o.input.paths = {(dir / "in").string()};
  o.output_dir = (dir / "out").string();
  o.val_fraction = 0.3;
  o.progress = false;
  tokenize_to_shards(tok, o);
  ASSERT_GT(want_val, 0);
  EXPECT_EQ(ShardSet(ShardSet::list(o.output_dir, "val")).n_tokens(), want_val);
  EXPECT_EQ(ShardSet(ShardSet::list(o.output_dir, "train")).n_tokens(), want_train);
  fs::remove_all(dir);
}

TEST(Tokenize, BadInputLeavesNoPartialOutput) {
  fs::path dir = scratch_dir("tokenize_bad");
  write(dir / "a.txt", "fine text");
  write(dir / "b.jsonl", "{\"text\": \"ok\"}\n{\"text\": 3}\n");
  ByteTokenizer tok;
  TokenizeOptions o;
  o.output_dir = (dir / "out").string();
  o.progress = false;
  o.input.paths = {(dir / "a.txt").string()};
  tokenize_to_shards(tok, o);
  const std::string before = read_file(dir / "out" / "train_00000.bin");
  o.input.paths = {(dir / "a.txt").string(), (dir / "b.jsonl").string()};
  try {
    tokenize_to_shards(tok, o);
    ADD_FAILURE() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("b.jsonl:2: no string field 'text'"), std::string::npos) << e.what();
  }
  // The earlier run's shard is untouched and no temporary file is left.
  EXPECT_EQ(read_file(dir / "out" / "train_00000.bin"), before);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir / "out"), fs::directory_iterator()), 1);
  o.input.paths = {(dir / "missing").string()};
  EXPECT_THROW(tokenize_to_shards(tok, o), ConfigError);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moe

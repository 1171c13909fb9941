#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <vector>

#include "core/error.h"
#include "data/loader.h"

namespace moe {
namespace {

constexpr int32_t kEos = 9999;

// Document d holds tokens d*100, d*100+1, ... so every token names its document.
TokenizedDocuments make_docs(const std::vector<int>& lengths) {
  TokenizedDocuments docs;
  for (size_t d = 0; d < lengths.size(); ++d) {
    for (int i = 0; i < lengths[d]; ++i) docs.tokens.push_back(static_cast<int32_t>(d * 100 + i));
    docs.doc_offsets.push_back(static_cast<int64_t>(docs.tokens.size()));
  }
  return docs;
}

// The expected stream of one epoch: documents in `order`, each followed by EOS.
std::vector<int32_t> epoch_stream(const TokenizedDocuments& docs, const std::vector<int64_t>& order) {
  std::vector<int32_t> stream;
  for (int64_t d : order) {
    auto doc = docs.doc(d);
    stream.insert(stream.end(), doc.begin(), doc.end());
    stream.push_back(kEos);
  }
  return stream;
}

struct Batch {
  std::vector<int32_t> inputs, targets;
  bool operator==(const Batch&) const = default;
};

Batch next(PackedLoader& loader, int64_t batch) {
  Batch b{std::vector<int32_t>(batch * loader.seq_len()), std::vector<int32_t>(batch * loader.seq_len())};
  loader.next_batch(batch, b.inputs.data(), b.targets.data());
  return b;
}

// Inputs of consecutive batches, concatenated: the stream itself.
std::vector<int32_t> read_stream(PackedLoader& loader, int64_t n_batches, int64_t batch) {
  std::vector<int32_t> stream;
  for (int64_t i = 0; i < n_batches; ++i) {
    Batch b = next(loader, batch);
    stream.insert(stream.end(), b.inputs.begin(), b.inputs.end());
  }
  return stream;
}

TEST(Loader, TargetsAreInputsShiftedByOne) {
  TokenizedDocuments docs = make_docs({30, 5, 0, 17, 44, 9});
  PackedLoader loader(docs, kEos, 8, 1, true);
  const int64_t S = 8, B = 3;
  Batch prev = next(loader, B);
  for (int step = 0; step < 20; ++step) {
    Batch cur = next(loader, B);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t s = 0; s + 1 < S; ++s) EXPECT_EQ(prev.targets[b * S + s], prev.inputs[b * S + s + 1]);
      // The last target is the first input of the next sequence.
      int32_t next_first = b + 1 < B ? prev.inputs[(b + 1) * S] : cur.inputs[0];
      EXPECT_EQ(prev.targets[b * S + S - 1], next_first);
    }
    prev = cur;
  }
}

TEST(Loader, StreamIsDocumentsSeparatedByEos) {
  TokenizedDocuments docs = make_docs({7, 0, 3, 12});  // an empty document is just an EOS
  std::vector<int64_t> identity = {0, 1, 2, 3};
  PackedLoader loader(docs, kEos, 5, 1, /*shuffle=*/false);
  ASSERT_EQ(loader.tokens_per_epoch(), 22 + 4);
  std::vector<int32_t> stream = read_stream(loader, 12, 2);  // 120 tokens: over 4 epochs
  std::vector<int32_t> expected;
  while (expected.size() < stream.size()) {
    auto epoch = epoch_stream(docs, identity);
    expected.insert(expected.end(), epoch.begin(), epoch.end());
  }
  expected.resize(stream.size());
  EXPECT_EQ(stream, expected);
  EXPECT_EQ(loader.state().epoch, 120 / 26);
  EXPECT_EQ(loader.state().position, 120 % 26);
}

TEST(Loader, ShuffledEpochsCrossSeamlessly) {
  TokenizedDocuments docs = make_docs({11, 4, 0, 25, 8, 13, 2});
  PackedLoader loader(docs, kEos, 16, 42, true);
  const int64_t per_epoch = loader.tokens_per_epoch();
  std::vector<int32_t> stream = read_stream(loader, 20, 2);  // 640 tokens, several epochs
  std::vector<int32_t> expected;
  for (int64_t e = 0; static_cast<int64_t>(expected.size()) < static_cast<int64_t>(stream.size()); ++e) {
    std::vector<int64_t> order = loader.epoch_order(e);
    std::vector<int64_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}));  // a permutation
    auto epoch = epoch_stream(docs, order);
    expected.insert(expected.end(), epoch.begin(), epoch.end());
  }
  expected.resize(stream.size());
  EXPECT_EQ(stream, expected);
  EXPECT_EQ(loader.state().epoch, 640 / per_epoch);
  EXPECT_NE(loader.epoch_order(0), loader.epoch_order(1));
}

TEST(Loader, OrderIsAFunctionOfSeedAndEpoch) {
  std::vector<int> lengths(20, 3);
  TokenizedDocuments docs = make_docs(lengths);
  PackedLoader a(docs, kEos, 8, 5, true), b(docs, kEos, 8, 5, true), c(docs, kEos, 8, 6, true);
  for (int i = 0; i < 30; ++i) EXPECT_EQ(next(a, 4), next(b, 4));
  EXPECT_EQ(a.epoch_order(3), b.epoch_order(3));  // regardless of how far each has read
  EXPECT_NE(a.epoch_order(0), c.epoch_order(0));
  PackedLoader a2(docs, kEos, 8, 5, true), c2(docs, kEos, 8, 6, true);
  EXPECT_NE(next(a2, 4), next(c2, 4));

  // Every document leads some epoch: the shuffle is not stuck near the identity.
  std::set<int64_t> first;
  for (int64_t e = 0; e < 300; ++e) first.insert(a.epoch_order(e).front());
  EXPECT_EQ(first.size(), 20u);
}

TEST(Loader, RestoreResumesExactly) {
  TokenizedDocuments docs = make_docs({13, 2, 40, 0, 7, 21});
  PackedLoader loader(docs, kEos, 12, 3, true);
  for (int i = 0; i < 7; ++i) next(loader, 2);
  LoaderState saved = loader.state();
  std::vector<Batch> after;
  for (int i = 0; i < 10; ++i) after.push_back(next(loader, 2));  // crosses epoch boundaries

  PackedLoader resumed(docs, kEos, 12, 3, true);
  resumed.restore(saved);
  EXPECT_EQ(resumed.state(), saved);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(next(resumed, 2), after[i]) << i;

  EXPECT_THROW(resumed.restore({0, resumed.tokens_per_epoch()}), Error);
  EXPECT_THROW(resumed.restore({-1, 0}), Error);
}

TEST(Loader, ResetStartsOver) {
  TokenizedDocuments docs = make_docs({9, 14, 3});
  PackedLoader val(docs, kEos, 6, 1, false);
  Batch first = next(val, 2);
  next(val, 5);
  val.reset();
  EXPECT_EQ(val.state(), LoaderState{});
  EXPECT_EQ(next(val, 2), first);
}

TEST(Loader, CorpusSmallerThanOneSequenceWraps) {
  TokenizedDocuments docs = make_docs({2, 1});  // stream 0 1 EOS 100 EOS, 5 tokens
  PackedLoader loader(docs, kEos, 12, 1, false);
  Batch b = next(loader, 2);
  const std::vector<int32_t> cycle = {0, 1, kEos, 100, kEos};
  for (size_t i = 0; i < b.inputs.size(); ++i) EXPECT_EQ(b.inputs[i], cycle[i % 5]) << i;
  for (size_t i = 0; i < b.targets.size(); ++i) EXPECT_EQ(b.targets[i], cycle[(i + 1) % 5]) << i;
  EXPECT_EQ(loader.state(), (LoaderState{24 / 5, 24 % 5}));

  // Shuffled, a sequence can span several epochs with different orders.
  PackedLoader shuffled(docs, kEos, 12, 9, true);
  std::vector<int32_t> stream = read_stream(shuffled, 4, 1);
  std::vector<int32_t> expected;
  for (int64_t e = 0; expected.size() < stream.size(); ++e) {
    auto epoch = epoch_stream(docs, shuffled.epoch_order(e));
    expected.insert(expected.end(), epoch.begin(), epoch.end());
  }
  expected.resize(stream.size());
  EXPECT_EQ(stream, expected);
}

// Rank r of N reads sequences k * N + r of the one-rank stream: the ranks' reads are
// disjoint and together are that stream, across epoch boundaries too.
TEST(Loader, RanksReadInterleavedSequencesOfTheOneStream) {
  TokenizedDocuments docs = make_docs({13, 2, 40, 0, 7, 21});
  PackedLoader whole(docs, kEos, 10, 4, true);
  std::vector<Batch> sequences;
  for (int i = 0; i < 12; ++i) sequences.push_back(next(whole, 1));  // 120 tokens: over one epoch (89)
  for (int64_t rank = 0; rank < 3; ++rank) {
    PackedLoader mine(docs, kEos, 10, 4, true, rank, 3);
    for (int i = 0; i < 2; ++i) {
      const Batch two = next(mine, 2);  // sequences (2i) * 3 + rank and (2i + 1) * 3 + rank
      for (int b = 0; b < 2; ++b) {
        const Batch& want = sequences[static_cast<size_t>((2 * i + b) * 3 + rank)];
        EXPECT_TRUE(std::equal(want.inputs.begin(), want.inputs.end(), two.inputs.begin() + b * 10))
            << "rank " << rank << " batch " << i << " row " << b;
        EXPECT_TRUE(std::equal(want.targets.begin(), want.targets.end(), two.targets.begin() + b * 10))
            << "rank " << rank << " batch " << i << " row " << b;
      }
    }
    EXPECT_EQ(mine.state(), whole.state());  // the position is the stream's, the same on every rank
  }
}

TEST(Loader, RejectsEmptyCorpus) {
  TokenizedDocuments none;
  EXPECT_THROW(PackedLoader(none, kEos, 8, 1, true), Error);
}

}  // namespace
}  // namespace moe

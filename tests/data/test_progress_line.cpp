// The start-up progress line: quiet while the work is short, then at most one update per
// interval naming bytes, documents and the rate; tokenizing with a label gives the same
// ids as without.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "data/corpus.h"
#include "data/progress_line.h"
#include "data/tokenizer.h"

namespace moe {
namespace {

std::string contents(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string text;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, f)) > 0;) text.append(buffer, n);
  return text;
}

TEST(ProgressLine, QuietForShortWork) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  ProgressLine progress("tokenize", 1000, f);  // 2 s quiet by default
  for (int i = 1; i <= 100; ++i) progress.update(i * 10, i);
  progress.finish(1000, 100);
  EXPECT_EQ(progress.updates_printed(), 0);
  EXPECT_EQ(contents(f), "");
  std::fclose(f);
}

TEST(ProgressLine, LongWorkPrintsAtMostOncePerInterval) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  ProgressLine progress("tokenize corpus", 4'000'000, f, /*quiet_seconds=*/0.05, /*interval_seconds=*/0.2);
  progress.update(1'000'000, 10);  // within the quiet time: nothing
  EXPECT_EQ(progress.updates_printed(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(80));
  progress.update(2'000'000, 20);  // printed
  for (int i = 0; i < 50; ++i) progress.update(2'000'000 + i, 20);  // within the interval: nothing
  EXPECT_EQ(progress.updates_printed(), 1);
  progress.finish(4'000'000, 40);
  EXPECT_EQ(progress.updates_printed(), 2);
  const std::string out = contents(f);
  EXPECT_NE(out.find("tokenize corpus: 2.0/4.0 MB (50%) | 20 docs | "), std::string::npos) << out;
  EXPECT_NE(out.find("tokenize corpus: 4.0/4.0 MB (100%) | 40 docs | "), std::string::npos) << out;
  EXPECT_NE(out.find(" MB/s | "), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 2) << out;  // a file is no terminal: a line each
  std::fclose(f);
}

TEST(ProgressLine, TokenizingWithProgressGivesTheSameIds) {
  std::vector<Document> docs;
  for (int i = 0; i < 300; ++i) docs.push_back({"d" + std::to_string(i), std::string(1000 + i * 997 % 5000, 'a' + i % 26)});
  const auto tokenizer = make_tokenizer("byte");
  const TokenizedDocuments plain = tokenize_documents(docs, *tokenizer, 2);
  // Many batches of about 20 kB: the same ids as one pass.
  const TokenizedDocuments shown = tokenize_documents(docs, *tokenizer, 2, "tokenize test", 20'000);
  EXPECT_EQ(shown.tokens, plain.tokens);
  EXPECT_EQ(shown.doc_offsets, plain.doc_offsets);
}

}  // namespace
}  // namespace moe

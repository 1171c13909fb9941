#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "core/error.h"
#include "data/corpus.h"
#include "config/run_config.h"

namespace fs = std::filesystem;

namespace moe {
namespace {

// A corpus in a fresh temporary directory, removed afterwards.
class CorpusDir {
 public:
  CorpusDir() {
    static int counter = 0;
    root_ = fs::temp_directory_path() / ("moe_corpus_test_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  ~CorpusDir() { fs::remove_all(root_); }
  void write(const std::string& relative, const std::string& text) {
    fs::path path = root_ / relative;
    fs::create_directories(path.parent_path());
    std::ofstream(path, std::ios::binary) << text;
  }
  std::string path() const { return root_.string(); }

 private:
  fs::path root_;
};

// 40 documents in nested folders plus files that must be ignored.
void fill(CorpusDir& dir, std::vector<std::string>* expected_paths) {
  for (int i = 0; i < 40; ++i) {
    std::string rel = (i % 3 == 0 ? "" : i % 3 == 1 ? "sub/" : "sub/deeper/") + ("doc" + std::to_string(i) + ".txt");
    dir.write(rel, "text of " + rel + "\n" + std::string(i, 'x'));
    expected_paths->push_back(rel);
  }
  dir.write("notes.md", "ignored");
  dir.write("sub/old.txt.bak", "ignored");
  dir.write("sub/empty.txt", "");  // an empty document is still a document
  expected_paths->push_back("sub/empty.txt");
  std::sort(expected_paths->begin(), expected_paths->end());
}

DataConfig config_for(const CorpusDir& dir, double val_fraction = 0.25) {
  DataConfig config;
  config.dir = dir.path();
  config.val_fraction = val_fraction;
  return config;
}

std::vector<std::string> paths_of(const std::vector<Document>& docs) {
  std::vector<std::string> paths;
  for (const auto& d : docs) paths.push_back(d.relative_path);
  return paths;
}

void expect_config_error(const DataConfig& config, const std::vector<std::string>& fragments) {
  try {
    read_corpus(config);
    ADD_FAILURE() << "expected ConfigError";
  } catch (const ConfigError& e) {
    for (const auto& f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
  }
}

TEST(Corpus, ReadsMatchingFilesAndSplitsByPathHash) {
  CorpusDir dir;
  std::vector<std::string> expected;
  fill(dir, &expected);
  DataConfig config = config_for(dir);
  CorpusSplit split = read_corpus(config);

  std::vector<std::string> train = paths_of(split.train), val = paths_of(split.validation);
  EXPECT_TRUE(std::is_sorted(train.begin(), train.end()));
  EXPECT_TRUE(std::is_sorted(val.begin(), val.end()));
  EXPECT_FALSE(train.empty());
  EXPECT_FALSE(val.empty());
  // Disjoint, and together exactly the matching files.
  std::vector<std::string> all = train;
  all.insert(all.end(), val.begin(), val.end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, expected);
  for (const auto& p : val) EXPECT_TRUE(is_validation_document(p, config.val_fraction)) << p;
  for (const auto& p : train) EXPECT_FALSE(is_validation_document(p, config.val_fraction)) << p;
  for (const auto& d : split.train)
    if (d.relative_path != "sub/empty.txt") EXPECT_TRUE(d.text.starts_with("text of " + d.relative_path));

  // Deterministic across calls.
  CorpusSplit again = read_corpus(config);
  EXPECT_EQ(paths_of(again.train), train);
  EXPECT_EQ(paths_of(again.validation), val);
}

TEST(Corpus, ValidationShareFollowsFraction) {
  int held_out = 0;
  for (int i = 0; i < 20000; ++i) held_out += is_validation_document("dir/file" + std::to_string(i) + ".txt", 0.1);
  EXPECT_GT(held_out, 1700);
  EXPECT_LT(held_out, 2300);
  EXPECT_FALSE(is_validation_document("anything", 1e-9));
}

TEST(Corpus, MaxBytesReadsAPrefixInPathOrder) {
  CorpusDir dir;
  std::vector<std::string> expected;
  fill(dir, &expected);
  DataConfig config = config_for(dir, 0.5);
  CorpusSplit full = read_corpus(config);
  int64_t full_bytes = 0;
  for (const auto* docs : {&full.train, &full.validation})
    for (const auto& d : *docs) full_bytes += static_cast<int64_t>(d.text.size());

  config.max_bytes = full_bytes / 2 + 3;  // lands inside a document
  CorpusSplit part = read_corpus(config);
  int64_t bytes = 0;
  std::vector<std::string> paths;
  for (const auto* docs : {&part.train, &part.validation})
    for (const auto& d : *docs) bytes += static_cast<int64_t>(d.text.size()), paths.push_back(d.relative_path);
  EXPECT_EQ(bytes, config.max_bytes);
  std::sort(paths.begin(), paths.end());
  ASSERT_LT(paths.size(), expected.size());
  EXPECT_TRUE(std::equal(paths.begin(), paths.end(), expected.begin()));  // a prefix of the sorted list
}

TEST(Corpus, ErrorsNameThePath) {
  CorpusDir dir;
  DataConfig config = config_for(dir);
  config.dir = dir.path() + "/missing";
  expect_config_error(config, {"data.dir", dir.path() + "/missing", "does not exist"});

  dir.write("file.txt", "x");
  config.dir = dir.path() + "/file.txt";
  expect_config_error(config, {"data.dir", "not a directory"});

  dir.write("a/notes.md", "x");
  config.dir = dir.path() + "/a";
  expect_config_error(config, {"data.dir", "no files ending in '.txt'", dir.path() + "/a"});

  config.dir = dir.path();  // one document cannot fill both splits
  expect_config_error(config, {"split", "is empty", "data.val_fraction"});
}

// A document that cannot be read is a one-line ConfigError with the reason, never skipped.
// Tests run as root, where permissions do not stop reading: the cases are a broken
// symlink, a file whose read fails (/proc/self/mem: EIO at offset 0), and, when not root,
// a subdirectory without permissions.
TEST(Corpus, UnreadableDocumentsAreErrorsWithTheReason) {
  CorpusDir dir;
  std::vector<std::string> expected;
  fill(dir, &expected);
  DataConfig config = config_for(dir);
  const std::string broken = dir.path() + "/sub/broken.txt";
  fs::create_symlink(dir.path() + "/sub/missing-target", broken);
  expect_config_error(config, {"data.dir", broken, "No such file or directory", "broken symbolic link"});
  fs::remove(broken);
  // Not matching data.extension: not a document, ignored.
  fs::create_symlink(dir.path() + "/missing-target", dir.path() + "/broken.md");
  EXPECT_EQ(read_corpus(config).train.size() + read_corpus(config).validation.size(), expected.size());

  const std::string unreadable = dir.path() + "/sub/mem.txt";
  fs::create_symlink("/proc/self/mem", unreadable);
  char byte;
  std::ifstream probe("/proc/self/mem", std::ios::binary);
  if (probe && !probe.read(&byte, 1)) expect_config_error(config, {"data.dir", unreadable, "Input/output error"});
  fs::remove(unreadable);

  if (geteuid() != 0) {  // root reads through any permission bits
    fs::permissions(dir.path() + "/sub/deeper", fs::perms::none);
    expect_config_error(config, {"data.dir", dir.path() + "/sub/deeper", "Permission denied"});
    fs::permissions(dir.path() + "/sub/deeper", fs::perms::owner_all);
  }
}

TEST(Corpus, TokenizationIsIndependentOfThreadCount) {
  std::vector<Document> docs;
  for (int i = 0; i < 57; ++i) docs.push_back({"d" + std::to_string(i), std::string(static_cast<size_t>(i * 7 % 23), static_cast<char>('a' + i % 26))});
  ByteTokenizer tok;
  TokenizedDocuments one = tokenize_documents(docs, tok, 1);
  TokenizedDocuments three = tokenize_documents(docs, tok, 3);
  EXPECT_EQ(one.tokens, three.tokens);
  EXPECT_EQ(one.doc_offsets, three.doc_offsets);
  ASSERT_EQ(one.n_docs(), 57);
  for (int i = 0; i < 57; ++i) {
    auto doc = one.doc(i);
    EXPECT_EQ(std::vector<int32_t>(doc.begin(), doc.end()), tok.encode(docs[i].text)) << i;
  }
  EXPECT_EQ(tokenize_documents({}, tok).n_docs(), 0);
}

TEST(Corpus, RealCorpusPrefixLoads) {
  DataConfig config;
  if (!fs::is_directory(config.dir)) GTEST_SKIP() << config.dir << " is not installed";
  config.max_bytes = 1 << 20;
  config.val_fraction = 0.2;
  ByteTokenizer tok;
  TokenizedCorpus corpus = load_corpus(config, tok);
  EXPECT_EQ(corpus.train.n_tokens() + corpus.validation.n_tokens(), config.max_bytes);  // bytes == tokens
  EXPECT_GT(corpus.train.n_docs(), corpus.validation.n_docs());
  EXPECT_GT(corpus.validation.n_docs(), 0);
}

TEST(DocumentSubset, ReadsTheChosenDocumentsInOrder) {
  auto base = std::make_shared<TokenizedDocuments>();
  base->tokens = {1, 2, 3, 4, 5, 6};
  base->doc_offsets = {0, 1, 3, 6};
  DocumentSubset subset(base, {2, 0});
  ASSERT_EQ(subset.n_docs(), 2);
  EXPECT_EQ(subset.n_tokens(), 4);
  EXPECT_EQ(subset.doc_size(0), 3);
  std::vector<int32_t> got(3);
  subset.copy(0, 0, 3, got.data());
  EXPECT_EQ(got, (std::vector<int32_t>{4, 5, 6}));
  subset.copy(1, 0, 1, got.data());
  EXPECT_EQ(got[0], 1);
}

}  // namespace
}  // namespace moe

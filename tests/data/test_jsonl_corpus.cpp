// data.dir with JSON Lines files: each line's data.text_field is a document named
// "<path>:<line>"; a line that is not a JSON object holding that string field is a
// one-line ConfigError naming the file and line, never text to train on.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "config/run_config.h"
#include "core/error.h"
#include "core/rng.h"
#include "data/corpus.h"
#include "data/inputs.h"

namespace fs = std::filesystem;

namespace moe {
namespace {

class JsonlCorpus : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("moe_jsonl_" + std::to_string(getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_ / "sub");
  }
  void TearDown() override { fs::remove_all(root_); }
  void write(const std::string& relative, const std::string& text) {
    std::ofstream(root_ / relative, std::ios::binary) << text;
  }
  DataConfig config(const std::string& extension = ".jsonl") const {
    DataConfig c;
    c.dir = root_.string();
    c.extension = extension;
    c.val_fraction = 0.3;
    return c;
  }
  std::string error_of(const DataConfig& c) {
    try {
      read_corpus(c);
    } catch (const ConfigError& e) {
      return e.what();
    }
    ADD_FAILURE() << "expected a ConfigError";
    return "";
  }
  fs::path root_;
};

std::map<std::string, std::string> by_name(const CorpusSplit& split) {
  std::map<std::string, std::string> docs;
  for (const auto* part : {&split.train, &split.validation})
    for (const Document& d : *part) docs[d.relative_path] = d.text;
  return docs;
}

TEST_F(JsonlCorpus, EachLinesTextFieldIsADocument) {
  std::string lines;
  for (int i = 1; i <= 30; ++i) lines += R"({"id": )" + std::to_string(i) + R"(, "text": "line \")" + std::to_string(i) + "\\u00e9\"}\n";
  write("a.jsonl", lines + "\n  \n");  // blank lines are skipped
  write("sub/b.jsonl", R"({"text": "b one"})" "\n" R"({"text": ""})");  // no final newline; an empty text is a document
  write("c.txt", "{not json, not read: data.extension is .jsonl}");
  const CorpusSplit split = read_corpus(config());
  const auto docs = by_name(split);
  ASSERT_EQ(docs.size(), 32u);
  EXPECT_EQ(docs.at("a.jsonl:1"), "line \"1\xc3\xa9");
  EXPECT_EQ(docs.at("a.jsonl:30"), "line \"30\xc3\xa9");
  EXPECT_EQ(docs.at("sub/b.jsonl:1"), "b one");
  EXPECT_EQ(docs.at("sub/b.jsonl:2"), "");
  for (const auto& [name, text] : docs) EXPECT_EQ(text.find("\"text\""), std::string::npos) << name;
  // The split follows the names, as `moe tokenize` splits the same file.
  for (const Document& d : split.validation) EXPECT_TRUE(is_validation_document(d.relative_path, 0.3));
  for (const Document& d : split.train) EXPECT_FALSE(is_validation_document(d.relative_path, 0.3));
  EXPECT_FALSE(split.train.empty());
  EXPECT_FALSE(split.validation.empty());
  // `moe tokenize --input DIR` reads the same documents under the same names.
  InputOptions input;
  input.paths = {root_.string()};
  input.extension = ".jsonl";
  std::map<std::string, std::string> tokenized;
  for (const Document& d : read_all_inputs(input)) tokenized[d.relative_path] = d.text;
  EXPECT_EQ(tokenized, docs);
}

TEST_F(JsonlCorpus, TextFieldAndEmptyExtensionAndMaxBytes) {
  write("a.jsonl", R"({"content": "0123456789", "text": "no"})" "\n" R"({"content": "abcdefghij"})" "\n");
  write("b.txt", "plain text");
  DataConfig c = config("");  // every file: .jsonl files still by line, others whole
  c.text_field = "content";
  // A val_fraction between the two lines' hashes holds out exactly one of them, so both
  // splits are non-empty however few documents there are.
  const auto h1 = static_cast<double>(fnv1a64("a.jsonl:1") % 1'000'000), h2 = static_cast<double>(fnv1a64("a.jsonl:2") % 1'000'000);
  c.val_fraction = (h1 + h2 + 2) / 2 / 1e6;
  auto docs = by_name(read_corpus(c));
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(docs.at("a.jsonl:1"), "0123456789");
  EXPECT_EQ(docs.at("a.jsonl:2"), "abcdefghij");
  EXPECT_EQ(docs.at("b.txt"), "plain text");
  c.max_bytes = 15;  // the second line is cut short; b.txt is not read
  docs = by_name(read_corpus(c));
  EXPECT_EQ(docs.size(), 2u);
  EXPECT_EQ(docs.at("a.jsonl:2"), "abcde");
}

TEST_F(JsonlCorpus, BadLinesAreOneLineErrorsNamingFileAndLine) {
  const std::string path = (root_ / "x.jsonl").string();
  struct Case {
    std::string text, fragment;
  };
  for (const Case& c : {Case{"{\"text\": \"ok\"}\nplain text, not JSON\n", path + ":2: not valid JSON"},
                        Case{"{\"text\": \"ok\"}\n\n[\"an\", \"array\"]\n", path + ":3: not a JSON object"},
                        Case{"{\"body\": \"x\"}\n", path + ":1: no string field 'text' (data.text_field)"},
                        Case{"{\"text\": 42}\n", path + ":1: no string field 'text'"},
                        Case{"{\"text\": \"a\"} trailing\n", path + ":1: not valid JSON"}}) {
    write("x.jsonl", c.text);
    const std::string message = error_of(config());
    EXPECT_NE(message.find(c.fragment), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(DataSourcesSpec, ParsesWeightsAndPaths) {
  std::string error;
  auto s = parse_data_sources("0.7:/data/web, 0.3:/data/code,/data/megatron/pile_text_document", &error);
  ASSERT_EQ(s.size(), 3u) << error;
  EXPECT_EQ(s[0].weight, 0.7);
  EXPECT_EQ(s[0].path, "/data/web");
  EXPECT_EQ(s[1].weight, 0.3);
  EXPECT_EQ(s[1].path, "/data/code");
  EXPECT_EQ(s[2].weight, 1.0);
  EXPECT_EQ(s[2].path, "/data/megatron/pile_text_document");
  s = parse_data_sources("2:c:/odd:path", &error);  // only the first ':' after a number splits
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].path, "c:/odd:path");
  for (const char* bad : {"", "0.5:a,", "0:a", "-1:a", "1e999:a", "1.2.3:a", "0.5:", "a,,b"}) {
    error.clear();
    EXPECT_TRUE(parse_data_sources(bad, &error).empty()) << bad;
    EXPECT_FALSE(error.empty()) << bad;
  }
}

TEST(DataSourcesSpec, ConfigValidationIsOneLine) {
  auto message = [](const std::vector<std::string>& overrides) -> std::string {
    try {
      parse_config("", "test.toml", overrides);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  EXPECT_NE(message({"data.sources=0:/a"}).find("data.sources must be comma-separated WEIGHT:PATH entries"),
            std::string::npos);
  EXPECT_NE(message({"data.sources=1:/a", "data.shards=/b"}).find("data.sources and data.shards exclude each other"),
            std::string::npos);
  EXPECT_NE(message({"data.text_field="}).find("data.text_field must name a JSON field"), std::string::npos);
  EXPECT_EQ(message({"data.sources=0.7:/a,0.3:/b", "data.text_field=content"}), "(accepted)");
  // Both keys write back.
  const RunConfig c = parse_config("", "t", {"data.sources=0.7:/a,0.3:/b", "data.text_field=content"});
  const std::string toml = config_to_toml(c);
  EXPECT_NE(toml.find("sources = \"0.7:/a,0.3:/b\""), std::string::npos) << toml;
  EXPECT_NE(toml.find("text_field = \"content\""), std::string::npos) << toml;
}

}  // namespace
}  // namespace moe

// Shared pieces of the BPE tests: a scratch directory, the Python oracle, sample texts.
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/rng.h"
#include "data/bpe.h"
#include "data/unicode.h"

namespace moe::testing_bpe {

namespace fs = std::filesystem;

inline fs::path scratch_dir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("moe_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

inline std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// Runs tests/data/<script> (default bpe_oracle.py) with `args`; fails the test when it exits non-zero.
inline void run_oracle(const std::string& args, const std::string& script = "bpe_oracle.py") {
  std::string python = env_or_empty("MOE_PYTHON"), source = env_or_empty("MOE_SOURCE_DIR");
  ASSERT_FALSE(python.empty() || source.empty()) << "MOE_PYTHON and MOE_SOURCE_DIR must be set (ctest sets them)";
  std::string cmd = python + " " + source + "/tests/data/" + script + " " + args;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

inline std::string base64(std::string_view bytes) {
  static const char* table = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    uint32_t v = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8) | uint8_t(bytes[i + 2]);
    for (int k = 3; k >= 0; --k) out += table[(v >> (6 * k)) & 63];
  }
  if (size_t rest = bytes.size() - i) {
    uint32_t v = uint8_t(bytes[i]) << 16 | (rest == 2 ? uint8_t(bytes[i + 1]) << 8 : 0);
    out += table[(v >> 18) & 63];
    out += table[(v >> 12) & 63];
    out += rest == 2 ? table[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

inline std::string from_base64(std::string_view text) {
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : text) {
    int v = c >= 'A' && c <= 'Z' ? c - 'A' : c >= 'a' && c <= 'z' ? c - 'a' + 26 : c >= '0' && c <= '9' ? c - '0' + 52
            : c == '+' ? 62 : c == '/' ? 63 : -1;
    if (v < 0) break;
    acc = (acc << 6) | v, bits += 6;
    if (bits >= 8) bits -= 8, out.push_back(static_cast<char>((acc >> bits) & 0xff));
  }
  return out;
}

inline void write_texts(const fs::path& path, const std::vector<std::string>& texts) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& t : texts) list.push_back(base64(t));
  std::ofstream(path) << list.dump();
}

inline nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

inline std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Up to `max_bytes` of the default corpus (the Python docs), in path order.
inline std::vector<std::string> corpus_sample(size_t max_bytes) {
  std::vector<fs::path> files;
  for (auto& e : fs::recursive_directory_iterator("/usr/share/doc/python3.11-doc/html/_sources"))
    if (e.is_regular_file() && e.path().string().ends_with(".txt")) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::vector<std::string> docs;
  size_t total = 0;
  for (const auto& f : files) {
    if (total >= max_bytes) break;
    docs.push_back(read_file(f));
    total += docs.back().size();
  }
  return docs;
}

// Texts that stress pre-tokenisation and byte handling.
inline std::vector<std::string> hostile_texts() {
  std::vector<std::string> t = {
      "",
      std::string(1000, ' '),
      std::string(700, ' ') + "x" + std::string(300, '\n') + "y\r\n\r\n  \t z  ",
      "1234567890123 45 6 " + std::string(400, '7') + " \xd9\xa1\xd9\xa2\xd9\xa3 \xe2\x85\xab\xc2\xbd x2y",
      "\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7 \xf0\x9f\x8e\x89 hi\xf0\x9f\x99\x82\xf0\x9f\x99\x82!!",
      "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae\xe3\x83\x86\xe3\x82\xad\xe3\x82\xb9\xe3\x83\x88\xe3\x80\x81\xe4\xb8\xad\xe6\x96\x87 \xed\x95\x9c\xea\xb5\xad\xec\x96\xb4",
      std::string("\x00\x01\x07\x1b[31mred\x7f\x08\x0c\x0b", 14) + "end",
      "\xff\xfe abc \xc3\x28 \xe2\x82 \xed\xa0\x80 \xf4\x90\x80\x80 \xf0\x9f\x98 \xc0\xaf \xe0\x80\xaf \x80\x80 z\xf0",
      "I'll we've He'S it's 'S '\xc5\xbf don't 'LL 'Re ''s '' 's",
      "\xc2\xa0\xe2\x80\x83\xe3\x80\x80x\xe2\x80\xa8y\xc2\x85z \xe1\x9a\x80 \t\x0b\x0c end",
      "e\xcc\x81 cafe\xcc\x81 \xef\xac\x81 \xe2\x84\xab",
      std::string(3000, 'a'),
      [] { std::string s; for (int i = 0; i < 1500; ++i) s += "ab"; return s; }(),
      "a <|endoftext|> b<|endoftext|><|endoftext|>c <|endoftext",
      "(foo) [bar]\n\n\tbaz;  qux...  --x ==y\r\n",
  };
  // Random bytes, and random mixes of the pieces above.
  CounterRng rng(11, "bpe.hostile");
  for (int k = 0; k < 8; ++k) {
    std::string s;
    for (int i = 0; i < 300; ++i) s.push_back(static_cast<char>(rng.bits(k * 1000 + i)[0] & 0xff));
    t.push_back(s);
  }
  const std::vector<std::string> atoms = {" ", "  ", "\n", "\r\n", "\t", "a", "Z", "'s", "'", "1", "23", "\xc3\xa9",
                                          "\xe6\x97\xa5", "\xf0\x9f\x99\x82", ".", "!?", "\xc2\xa0", "\xe2\x80\x83", "_", "\xef\xbf\xbd"};
  for (int k = 0; k < 20; ++k) {
    std::string s;
    for (int i = 0; i < 200; ++i) s += atoms[rng.bits(100000 + k * 1000 + i)[0] % atoms.size()];
    t.push_back(s);
  }
  return t;
}

// Encodes `texts` with ours and compares with the oracle's ids and decoded text (bpe_oracle.py encode).
inline void expect_same(const BpeTokenizer& tok, const std::vector<std::string>& texts, const nlohmann::json& oracle,
                        bool special) {
  ASSERT_EQ(oracle["ids"].size(), texts.size());
  int mismatches = 0;
  for (size_t i = 0; i < texts.size() && mismatches < 3; ++i) {
    std::vector<int32_t> ours = tok.encode(texts[i], special);
    auto want = oracle["ids"][i].get<std::vector<int32_t>>();
    if (ours != want) {
      size_t at = 0;
      while (at < ours.size() && at < want.size() && ours[at] == want[at]) ++at;
      ADD_FAILURE() << "text " << i << " (" << texts[i].size() << " bytes, special=" << special
                    << "): ids differ first at index " << at << " of " << ours.size() << " vs " << want.size();
      ++mismatches;
      continue;
    }
    EXPECT_EQ(unicode::repair_utf8(tok.decode(ours)), from_base64(oracle["decoded"][i].get<std::string>()))
        << "decode of text " << i;
  }
}

// HF's ids for `texts` (written to dir/texts.json) with and without parsing special tokens.
inline void check_against_hf(const fs::path& dir, const std::string& json_path, const std::vector<std::string>& texts) {
  BpeTokenizer tok(load_hf_tokenizer(json_path), json_path);
  for (bool special : {false, true}) {
    fs::path out = dir / (special ? "ids_special.json" : "ids.json");
    run_oracle("encode --tokenizer " + json_path + " --texts " + (dir / "texts.json").string() + " --out " +
               out.string() + (special ? " --special" : ""));
    nlohmann::json oracle = read_json(out);
    EXPECT_EQ(tok.vocab_size(), oracle["vocab_size"].get<int64_t>());
    expect_same(tok, texts, oracle, special);
  }
}

}  // namespace moe::testing_bpe

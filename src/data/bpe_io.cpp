// tokenizer.json (byte-level and SentencePiece-style) and tiktoken rank files <-> BpeModel.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/atomic_file.h"
#include "core/error.h"
#include "data/bpe.h"
#include "data/file_util.h"

namespace moe {
namespace {

using nlohmann::json;

// Byte-level string (each char one of byte_level_chars) -> raw bytes; false if a char is not one.
bool unmap_byte_level(std::string_view token, std::string& bytes) {
  static const std::map<std::string, unsigned char, std::less<>> inverse = [] {
    std::map<std::string, unsigned char, std::less<>> m;
    for (int b = 0; b < 256; ++b) m.emplace(byte_level_chars()[b], static_cast<unsigned char>(b));
    return m;
  }();
  bytes.clear();
  size_t pos = 0;
  while (pos < token.size()) {
    const size_t len = static_cast<unsigned char>(token[pos]) < 0x80 ? 1 : 2;
    auto it = inverse.find(token.substr(pos, len));
    if (it == inverse.end()) return false;
    bytes.push_back(static_cast<char>(it->second));
    pos += len;
  }
  return true;
}

std::string map_byte_level(std::string_view bytes) {
  std::string out;
  for (char c : bytes) out += byte_level_chars()[static_cast<unsigned char>(c)];
  return out;
}

bool is_null_or(const json& j, const char* key, auto value) {
  return !j.contains(key) || j[key].is_null() || j[key] == value;
}

using Fail = std::function<void(const std::string&)>;

// The normalizer, pre-tokenizer and decoder of a byte-level file (GPT-2, Llama-3, Qwen2).
void read_byte_level_pipeline(const json& root, BpeModel& model, const Fail& fail) {
  const json normalizer = root.value("normalizer", json());
  if (!normalizer.is_null()) {
    if (normalizer.value("type", "") == "NFC") model.nfc = true;
    else fail("unsupported normalizer '" + normalizer.value("type", std::string("?")) + "' (supported: none, NFC)");
  }
  const json pre = root.value("pre_tokenizer", json());
  auto byte_level_ok = [](const json& p) { return p.is_object() && p.value("type", "") == "ByteLevel"; };
  if (byte_level_ok(pre) && pre.value("use_regex", true)) {
    model.pattern = PretokPattern::Gpt2;
    model.byte_level_regex = true;
    model.add_prefix_space = pre.value("add_prefix_space", false);
  } else if (pre.is_object() && pre.value("type", "") == "Sequence" && pre.contains("pretokenizers") &&
             pre["pretokenizers"].size() == 2 && byte_level_ok(pre["pretokenizers"][1]) &&
             !pre["pretokenizers"][1].value("use_regex", true) && !pre["pretokenizers"][1].value("add_prefix_space", false)) {
    const json& split = pre["pretokenizers"][0];
    if (split.value("type", "") != "Split" || split.value("behavior", "") != "Isolated" || split.value("invert", false) ||
        !split.contains("pattern") || !split["pattern"].contains("Regex"))
      fail("unsupported pre_tokenizer: expected Split(Regex, Isolated) then ByteLevel");
    const std::string regex = split["pattern"]["Regex"].get<std::string>();
    auto pattern = pattern_from_regex(regex);
    if (!pattern) fail("unsupported pre_tokenizer regex (supported: the GPT-2, Llama-3 and Qwen2 patterns): " + regex);
    model.pattern = *pattern;
    model.byte_level_regex = false;
  } else {
    fail("unsupported pre_tokenizer (supported: ByteLevel with use_regex, or Sequence[Split(GPT-2/Llama-3/Qwen2 regex), ByteLevel])");
  }
  const json decoder = root.value("decoder", json());
  if (!decoder.is_null() && decoder.value("type", "") != "ByteLevel")
    fail("unsupported decoder '" + decoder.value("type", std::string("?")) + "' (supported: ByteLevel)");
}

// SentencePiece-style files (Llama-2, Mistral): normalizer Prepend("▁") + Replace(" ", "▁")
// and no pre_tokenizer, or a Metaspace pre_tokenizer. False (nothing read) when the file
// is neither, to be read as byte-level.
bool read_metaspace_pipeline(const json& root, BpeModel& model, const Fail& fail) {
  const json normalizer = root.value("normalizer", json());
  const json pre = root.value("pre_tokenizer", json());
  auto is = [](const json& j, const char* type) { return j.is_object() && j.value("type", "") == type; };
  auto replaces = [](const json& j, std::string_view from, std::string_view to) {
    return j.value("type", "") == "Replace" && j.contains("pattern") && j["pattern"].is_object() &&
           j["pattern"].value("String", "") == from && j.value("content", "") == to;
  };
  const bool metaspace = is(pre, "Metaspace");
  const bool sequence = is(normalizer, "Sequence") && normalizer.contains("normalizers") && normalizer["normalizers"].is_array();
  if (!metaspace && !(pre.is_null() && sequence)) return false;
  model.char_level = true;
  if (metaspace) {
    if (!normalizer.is_null()) fail("unsupported normalizer with a Metaspace pre_tokenizer (supported: none)");
    if (pre.value("replacement", std::string(kMetaspace)) != kMetaspace)
      fail("unsupported Metaspace replacement '" + pre.value("replacement", std::string()) + "' (supported: '▁')");
    std::string scheme = pre.contains("prepend_scheme") ? pre.value("prepend_scheme", "")
                         : pre.value("add_prefix_space", true) ? "always" : "never";
    if (scheme == "always") model.prefix = MetaspacePrefix::UnlessMetaspace;
    else if (scheme == "first") model.prefix = MetaspacePrefix::FirstUnlessMetaspace;
    else if (scheme != "never") fail("unsupported Metaspace prepend_scheme '" + scheme + "' (supported: always, first, never)");
    model.metaspace_split = pre.value("split", true);
  } else {
    bool replace = false;
    for (const json& n : normalizer["normalizers"]) {
      if (replaces(n, " ", kMetaspace)) replace = true;
      else if (n.value("type", "") == "Prepend" && n.value("prepend", "") == kMetaspace) model.prefix = MetaspacePrefix::Always;
      else fail("unsupported normalizer step " + n.dump() + " (supported for SentencePiece-style files: Prepend('▁'), Replace(' ', '▁'))");
    }
    if (!replace) fail("unsupported normalizer: no Replace(' ', '▁') (needed by a SentencePiece-style file without a Metaspace pre_tokenizer)");
  }
  const json decoder = root.value("decoder", json());
  const char* supported = " (supported for SentencePiece-style files: Sequence[Replace('▁', ' '), ByteFallback, Fuse, "
                          "Strip(' ', N, 0)], ByteFallback and Strip optional; or Metaspace without byte_fallback)";
  if (is(decoder, "Metaspace")) {
    if (model.byte_fallback) fail(std::string("unsupported decoder Metaspace with model.byte_fallback") + supported);
    model.strip_leading_spaces = decoder.value("prepend_scheme", decoder.value("add_prefix_space", true) ? "always" : "never") != "never";
    return true;
  }
  if (!is(decoder, "Sequence") || !decoder.contains("decoders") || !decoder["decoders"].is_array())
    fail("unsupported decoder" + std::string(supported));
  std::vector<std::string> steps;
  for (const json& d : decoder["decoders"]) {
    const std::string type = d.is_object() ? d.value("type", "") : "";
    if (type == "Strip") {
      if (d.value("content", "") != " " || d.value("stop", 0) != 0 || d.value("start", 0) < 0)
        fail("unsupported decoder step " + d.dump() + supported);
      model.strip_leading_spaces = d.value("start", 0);
    } else if (type == "Replace" && !replaces(d, kMetaspace, " ")) {
      fail("unsupported decoder step " + d.dump() + supported);
    }
    steps.push_back(type);
  }
  std::vector<std::string> wanted = {"Replace"};
  if (model.byte_fallback) wanted.push_back("ByteFallback");
  wanted.push_back("Fuse");
  std::vector<std::string> given = steps;
  if (!given.empty() && given.back() == "Strip") given.pop_back();
  if (!model.byte_fallback && given.size() > 1 && given[1] == "ByteFallback") given.erase(given.begin() + 1);  // harmless
  if (given != wanted) fail("unsupported decoder" + std::string(supported));
  return true;
}

// Byte-fallback and unk tokens of a SentencePiece-style file, which must be in model.vocab.
void read_fallback_tokens(const json& m, BpeModel& model, const std::unordered_map<std::string, int32_t>& ids,
                          const Fail& fail) {
  if (model.byte_fallback) {
    for (int b = 0; b < 256; ++b) {
      const std::string token = fmt::format("<0x{:02X}>", b);
      if (!ids.count(token))
        fail("model.byte_fallback is true but model.vocab has no '" + token +
             "' (a byte-fallback vocabulary holds all 256 byte tokens <0x00>..<0xFF>)");
    }
  }
  if (m.contains("unk_token") && !m["unk_token"].is_null()) {
    const std::string unk = m["unk_token"].get<std::string>();
    if (!m["vocab"].contains(unk)) fail("model.unk_token '" + unk + "' is not in model.vocab");
    model.unk_id = m["vocab"][unk].get<int32_t>();
    model.fuse_unk = m.value("fuse_unk", false);
  } else if (!model.byte_fallback) {
    fail("model.byte_fallback is false and model.unk_token is unset: characters missing from model.vocab would be "
         "dropped (a SentencePiece-style file needs byte_fallback or an unk_token)");
  }
}
}  // namespace

BpeModel load_hf_tokenizer(const std::string& path) { return parse_hf_tokenizer(read_whole_file(path, "tokenizer"), path); }

BpeModel parse_hf_tokenizer(std::string text, const std::string& path) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    MOE_CONFIG_ERROR("{}: not valid JSON: {}", path, e.what());
  }
  auto fail = [&](const std::string& what) -> void { MOE_CONFIG_ERROR("{}: {}", path, what); };
  try {
    if (!root.is_object() || !root.contains("model") || !root["model"].is_object()) fail("no \"model\" object (not a tokenizer.json)");
    const json& m = root["model"];
    const std::string type = m.value("type", std::string("BPE"));
    if (type != "BPE") fail("unsupported model type '" + type + "' (only BPE is supported: byte-level or byte-fallback)");
    if (!is_null_or(m, "dropout", 0.0)) fail("unsupported: model.dropout is set");
    if (!is_null_or(m, "continuing_subword_prefix", "")) fail("unsupported: model.continuing_subword_prefix is set");
    if (!is_null_or(m, "end_of_word_suffix", "")) fail("unsupported: model.end_of_word_suffix is set");

    BpeModel model;
    model.byte_fallback = m.contains("byte_fallback") && m["byte_fallback"].is_boolean() && m["byte_fallback"].get<bool>();
    if (!read_metaspace_pipeline(root, model, fail)) {
      if (model.byte_fallback)
        fail("model.byte_fallback is true, but the file is not SentencePiece-style (byte fallback needs a normalizer "
             "Prepend('▁') + Replace(' ', '▁') without pre_tokenizer, or a Metaspace pre_tokenizer)");
      read_byte_level_pipeline(root, model, fail);
    }
    // Tokens of a SentencePiece-style file are text as is; of a byte-level one, bytes as GPT-2's characters.
    auto token_bytes = [&](const std::string& token, std::string& bytes) {
      if (!model.char_level) return unmap_byte_level(token, bytes);
      bytes = token;
      return true;
    };
    model.ignore_merges = m.value("ignore_merges", false);
    if (!m.contains("vocab") || !m["vocab"].is_object()) fail("model.vocab is missing or not an object");
    const bool has_added = root.contains("added_tokens") && root["added_tokens"].is_array();
    // Ids must be integers below twice the number of tokens the file lists (gaps are
    // allowed, up to that): the vocabulary is allocated up to the largest id, so one
    // stray id must not cost gigabytes, and an id must never be truncated to another.
    const size_t listed = m["vocab"].size() + (has_added ? root["added_tokens"].size() : 0);
    const int64_t id_limit = std::min<int64_t>(2 * static_cast<int64_t>(listed), std::numeric_limits<int32_t>::max());
    auto id_of = [&](const json& value, const std::string& what) -> int32_t {
      const bool in_range = value.is_number_unsigned()  ? value.get<uint64_t>() < static_cast<uint64_t>(id_limit)
                            : value.is_number_integer() ? value.get<int64_t>() >= 0 && value.get<int64_t>() < id_limit
                                                        : false;
      if (!in_range)
        fail(fmt::format("{} has id {}: ids must be integers in [0, {}) (below twice the {} tokens the file lists)",
                         what, value.dump(), id_limit, listed));
      return static_cast<int32_t>(value.get<int64_t>());
    };
    std::map<int32_t, AddedToken> added;
    if (has_added) {
      for (const json& t : root["added_tokens"]) {
        const std::string content = t.at("content").get<std::string>();
        if (t.value("lstrip", false) || t.value("rstrip", false) || t.value("single_word", false))
          fail("unsupported: added token '" + content + "' uses lstrip, rstrip or single_word");
        AddedToken a{content, id_of(t.at("id"), "added token '" + content + "'"), t.value("special", false)};
        if (auto [it, fresh] = added.emplace(a.id, a); !fresh)
          fail(fmt::format("added tokens '{}' and '{}' have the same id {}", it->second.content, content, a.id));
      }
    }
    std::string bytes;
    std::vector<bool> taken;  // vocab ids seen so far
    for (const auto& [token, id_json] : m["vocab"].items()) {
      const int32_t id = id_of(id_json, "model.vocab: token '" + token + "'");
      if (static_cast<size_t>(id) >= model.vocab.size()) {
        model.vocab.resize(static_cast<size_t>(id) + 1);
        taken.resize(static_cast<size_t>(id) + 1);
      }
      if (taken[id]) fail(fmt::format("model.vocab: token '{}' has id {}, as another token does", token, id));
      taken[id] = true;
      if (auto it = added.find(id); it != added.end()) {  // listed twice, as GPT-2's <|endoftext|>: the same token
        if (it->second.content != token)
          fail(fmt::format("model.vocab: token '{}' has id {}, which added token '{}' has", token, id,
                           it->second.content));
        continue;
      }
      if (!token_bytes(token, bytes))
        fail("model.vocab: token '" + token + "' (id " + std::to_string(id) + ") is not byte-level (not a GPT-2 style byte-level BPE)");
      model.vocab[id] = bytes;
    }
    for (auto& [id, a] : added) model.added.push_back(a);

    std::unordered_map<std::string, int32_t> ids;
    for (size_t id = 0; id < model.vocab.size(); ++id)
      if (!added.count(static_cast<int32_t>(id))) ids.emplace(model.vocab[id], static_cast<int32_t>(id));
    if (!m.contains("merges") || !m["merges"].is_array()) fail("model.merges is missing or not an array");
    size_t rank = 0;
    for (const json& merge : m["merges"]) {
      std::string left, right;
      if (merge.is_string()) {
        const std::string s = merge.get<std::string>();
        const size_t space = s.find(' ');
        if (space == std::string::npos) fail("model.merges[" + std::to_string(rank) + "]: '" + s + "' is not two tokens");
        left = s.substr(0, space), right = s.substr(space + 1);
      } else if (merge.is_array() && merge.size() == 2) {
        left = merge[0].get<std::string>(), right = merge[1].get<std::string>();
      } else {
        fail("model.merges[" + std::to_string(rank) + "] is neither \"a b\" nor [a, b]");
      }
      std::string lb, rb;
      auto l = token_bytes(left, lb) ? ids.find(lb) : ids.end();
      auto r = token_bytes(right, rb) ? ids.find(rb) : ids.end();
      if (l == ids.end() || r == ids.end() || !ids.count(lb + rb))
        fail("model.merges[" + std::to_string(rank) + "]: '" + left + " " + right + "' uses or makes a token not in model.vocab");
      model.merges.emplace_back(l->second, r->second);
      ++rank;
    }
    if (model.char_level) read_fallback_tokens(m, model, ids, fail);
    model.source_json = std::move(text);
    return model;
  } catch (const json::exception& e) {
    MOE_CONFIG_ERROR("{}: malformed tokenizer.json: {}", path, e.what());
  }
}

std::string hf_tokenizer_json(const BpeModel& model) {
  MOE_CHECK(!model.char_level, "hf_tokenizer_json writes byte-level models only");
  json added = json::array();
  for (const AddedToken& t : model.added)
    added.push_back({{"id", t.id}, {"content", t.content}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", t.special}});
  json vocab = json::object();
  for (size_t id = 0; id < model.vocab.size(); ++id) vocab[map_byte_level(model.vocab[id])] = id;
  for (const AddedToken& t : model.added) vocab[t.content] = t.id;
  json merges = json::array();
  for (auto [l, r] : model.merges) merges.push_back({map_byte_level(model.vocab[l]), map_byte_level(model.vocab[r])});
  json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", model.add_prefix_space}, {"trim_offsets", true},
                     {"use_regex", model.byte_level_regex}};
  json pre = byte_level;
  if (!model.byte_level_regex) {
    json split = {{"type", "Split"}, {"pattern", {{"Regex", std::string(pattern_regex(model.pattern))}}},
                  {"behavior", "Isolated"}, {"invert", false}};
    pre = {{"type", "Sequence"}, {"pretokenizers", {split, byte_level}}};
  }
  json root = {
      {"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}, {"added_tokens", added},
      {"normalizer", model.nfc ? json{{"type", "NFC"}} : json()}, {"pre_tokenizer", pre},
      {"post_processor", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
                 {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
                 {"ignore_merges", model.ignore_merges}, {"vocab", vocab}, {"merges", merges}}},
  };
  return root.dump(1);
}

void save_hf_tokenizer(const BpeModel& model, const std::string& path) {
  write_file_atomic(path, hf_tokenizer_json(model));
}

BpeModel load_tiktoken(const std::string& path, PretokPattern pattern, const std::vector<std::string>& specials) {
  std::string text = read_whole_file(path, "tiktoken rank file");
  auto b64 = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
  };
  BpeModel model;
  model.pattern = pattern;
  model.byte_level_regex = false;
  model.tiktoken_ranks = true;
  // As for tokenizer.json: ranks below twice the lines of the file, so that one stray rank
  // cannot make the vocabulary allocation huge.
  const int64_t lines = std::count(text.begin(), text.end(), '\n') + 1;
  const int64_t rank_limit = std::min<int64_t>(2 * lines, (int64_t{1} << 31) - 1024);
  std::istringstream in(text);
  std::string line;
  int64_t line_no = 0;
  std::unordered_map<std::string, int64_t> seen;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    auto bad = [&](const char* what) { MOE_CONFIG_ERROR("{}:{}: {} (expected 'base64-token rank')", path, line_no, what); };
    if (space == std::string::npos) bad("no space");
    std::string bytes;
    uint32_t acc = 0;
    int bits = 0;
    for (char c : line.substr(0, space)) {
      if (c == '=') break;
      const int v = b64(c);
      if (v < 0) bad("invalid base64");
      acc = (acc << 6) | static_cast<uint32_t>(v);
      bits += 6;
      if (bits >= 8) bits -= 8, bytes.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
    int64_t rank = -1;
    try {
      size_t used = 0;
      rank = std::stoll(line.substr(space + 1), &used);
      if (used != line.size() - space - 1) rank = -1;
    } catch (const std::exception&) {
    }
    if (rank < 0 || rank >= rank_limit)
      bad(fmt::format("rank is not an integer in [0, {}) (below twice the lines of the file)", rank_limit).c_str());
    if (bytes.empty()) bad("empty token");
    if (!seen.emplace(bytes, rank).second) bad("token listed twice");
    if (static_cast<size_t>(rank) >= model.vocab.size()) model.vocab.resize(static_cast<size_t>(rank) + 1);
    if (!model.vocab[rank].empty()) bad("rank listed twice");
    model.vocab[rank] = bytes;
  }
  if (model.vocab.empty()) MOE_CONFIG_ERROR("{}: no tokens (not a tiktoken rank file)", path);
  for (const std::string& s : specials)
    model.added.push_back({s, static_cast<int32_t>(model.vocab.size() + model.added.size()), true});
  return model;
}

}  // namespace moe

#include "data/bpe.h"

#include <algorithm>
#include <atomic>
#include <queue>

#include "core/error.h"
#include "data/unicode.h"

namespace moe {
namespace {

constexpr uint64_t kNoMerge = ~uint64_t{0};

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

uint64_t mix(uint64_t x) {  // splitmix64 finaliser: spreads pair keys over the table
  x ^= x >> 30, x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27, x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// Per-thread cache of piece -> ids; ids live in one arena to avoid an allocation per entry.
struct PieceCache {
  uint64_t owner = 0;
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, StringHash, std::equal_to<>> map;
  std::vector<int32_t> arena;

  void reset(uint64_t serial) {
    owner = serial;
    map.clear();
    arena.clear();
  }
};
constexpr size_t kMaxCacheEntries = 1 << 18;

std::atomic<uint64_t> next_serial{1};

}  // namespace

const std::array<std::string, 256>& byte_level_chars() {
  static const std::array<std::string, 256> chars = [] {
    std::array<std::string, 256> out;
    auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff); };
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const char32_t cp = printable(b) ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      std::string s;  // cp < 0x800: one or two UTF-8 bytes
      if (cp < 0x80) s.push_back(static_cast<char>(cp));
      else s = {static_cast<char>(0xc0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3f))};
      out[b] = s;
    }
    return out;
  }();
  return chars;
}

BpeTokenizer::BpeTokenizer(BpeModel model, std::string name)
    : model_(std::move(model)), name_(std::move(name)), serial_(next_serial++) {
  for (const AddedToken& t : model_.added) {
    MOE_CHECK(t.id >= 0, "added token '{}' has a negative id", t.content);
    if (static_cast<size_t>(t.id) >= model_.vocab.size()) model_.vocab.resize(static_cast<size_t>(t.id) + 1);
    model_.vocab[t.id] = t.content;
  }
  is_special_.assign(model_.vocab.size(), false);
  for (const AddedToken& t : model_.added) is_special_[t.id] = t.special;
  ids_.reserve(model_.vocab.size());
  for (size_t id = 0; id < model_.vocab.size(); ++id)
    if (!model_.vocab[id].empty() && !is_special_[id]) ids_.emplace(model_.vocab[id], static_cast<int32_t>(id));
  for (int b = 0; b < 256; ++b) {
    auto it = ids_.find(std::string(1, static_cast<char>(b)));
    byte_ids_[b] = it == ids_.end() ? -1 : it->second;
  }

  // Merge table: HF lists merges by rank; tiktoken ranks a pair by the rank of its result.
  std::vector<std::pair<uint64_t, uint64_t>> entries;
  if (model_.tiktoken_ranks) {
    for (size_t id = 0; id < model_.vocab.size(); ++id) {
      const std::string& t = model_.vocab[id];
      if (is_special_[id]) continue;
      for (size_t k = 1; k < t.size(); ++k) {
        auto l = ids_.find(t.substr(0, k)), r = ids_.find(t.substr(k));
        if (l != ids_.end() && r != ids_.end()) entries.emplace_back(pair_key(l->second, r->second), (uint64_t{id} << 32) | id);
      }
    }
  } else {
    for (size_t rank = 0; rank < model_.merges.size(); ++rank) {
      auto [l, r] = model_.merges[rank];
      auto it = ids_.find(model_.vocab.at(l) + model_.vocab.at(r));
      MOE_CHECK(it != ids_.end(), "merge {} ({} {}) makes a token that is not in the vocabulary", rank, l, r);
      entries.emplace_back(pair_key(l, r), (uint64_t{rank} << 32) | static_cast<uint32_t>(it->second));
    }
  }
  size_t capacity = 16;
  while (capacity < entries.size() * 2) capacity *= 2;
  merge_keys_.assign(capacity, kNoMerge);
  merge_values_.assign(capacity, kNoMerge);
  merge_mask_ = capacity - 1;
  for (auto [key, value] : entries) {
    uint64_t slot = mix(key) & merge_mask_;
    while (merge_keys_[slot] != kNoMerge && merge_keys_[slot] != key) slot = (slot + 1) & merge_mask_;
    merge_keys_[slot] = key;  // a repeated pair keeps its last rank, as HF's HashMap does
    merge_values_[slot] = value;
  }

  for (std::string_view name : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>"}) {
    for (const AddedToken& t : model_.added)
      if (t.special && t.content == name && eos_ < 0) eos_ = t.id;
  }
}

int32_t BpeTokenizer::eos_id() const {
  if (eos_ < 0) MOE_THROW("tokenizer '{}' has no end-of-text special token (<|endoftext|>, <|end_of_text|>, </s>, <eos>, <|im_end|>)", name_);
  return eos_;
}

int32_t BpeTokenizer::token_id(std::string_view bytes) const {
  auto it = ids_.find(std::string(bytes));
  return it == ids_.end() ? -1 : it->second;
}

uint64_t BpeTokenizer::find_merge(int32_t left, int32_t right) const {
  const uint64_t key = pair_key(left, right);
  uint64_t slot = mix(key) & merge_mask_;
  while (true) {
    const uint64_t k = merge_keys_[slot];
    if (k == key) return merge_values_[slot];
    if (k == kNoMerge) return kNoMerge;
    slot = (slot + 1) & merge_mask_;
  }
}

// Merges the lowest-ranked adjacent pair, leftmost first, until none is left.
void BpeTokenizer::merge_piece(std::string_view piece, std::vector<int32_t>& out) const {
  thread_local std::vector<int32_t> sym;
  sym.clear();
  for (char c : piece) {
    int32_t id = byte_ids_[static_cast<unsigned char>(c)];
    if (id >= 0) sym.push_back(id);  // a byte missing from the vocabulary is dropped, as HF does without unk
  }
  if (sym.size() <= 64) {
    while (sym.size() > 1) {
      uint64_t best = kNoMerge;
      size_t at = 0;
      for (size_t i = 0; i + 1 < sym.size(); ++i) {
        uint64_t m = find_merge(sym[i], sym[i + 1]);
        if (m < best) best = m, at = i;
      }
      if (best == kNoMerge) break;
      sym[at] = static_cast<int32_t>(best & 0xffffffffu);
      sym.erase(sym.begin() + static_cast<ptrdiff_t>(at) + 1);
    }
    out.insert(out.end(), sym.begin(), sym.end());
    return;
  }
  // Long pieces (runs of spaces or digits): a heap of candidate pairs over a linked list.
  const auto n = static_cast<int32_t>(sym.size());
  std::vector<int32_t> next(n), prev(n);
  for (int32_t i = 0; i < n; ++i) next[i] = i + 1 < n ? i + 1 : -1, prev[i] = i - 1;
  using Entry = std::pair<uint64_t, int32_t>;  // ((rank << 32 | id), left position): min rank, then leftmost
  auto later = [](const Entry& a, const Entry& b) {
    return (a.first >> 32) != (b.first >> 32) ? (a.first >> 32) > (b.first >> 32) : a.second > b.second;
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(later)> heap(later);
  auto push = [&](int32_t i) {
    if (i < 0 || next[i] < 0) return;
    uint64_t m = find_merge(sym[i], sym[next[i]]);
    if (m != kNoMerge) heap.emplace(m, i);
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    auto [m, i] = heap.top();
    heap.pop();
    if (sym[i] < 0 || next[i] < 0 || find_merge(sym[i], sym[next[i]]) != m) continue;  // stale
    const int32_t j = next[i];
    sym[i] = static_cast<int32_t>(m & 0xffffffffu);
    sym[j] = -1;
    next[i] = next[j];
    if (next[j] >= 0) prev[next[j]] = i;
    push(prev[i]);
    push(i);
  }
  for (int32_t i = 0; i >= 0; i = next[i]) out.push_back(sym[i]);
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (model_.ignore_merges || model_.tiktoken_ranks) {
    auto it = ids_.find(std::string(piece));
    if (it != ids_.end()) return out.push_back(it->second);
  }
  thread_local PieceCache cache;
  if (cache.owner != serial_ || cache.map.size() >= kMaxCacheEntries) cache.reset(serial_);
  if (auto it = cache.map.find(piece); it != cache.map.end()) {
    out.insert(out.end(), cache.arena.begin() + it->second.first,
               cache.arena.begin() + it->second.first + it->second.second);
    return;
  }
  const size_t start = out.size();
  merge_piece(piece, out);
  const auto offset = static_cast<uint32_t>(cache.arena.size());
  cache.arena.insert(cache.arena.end(), out.begin() + static_cast<ptrdiff_t>(start), out.end());
  cache.map.emplace(std::string(piece), std::pair{offset, static_cast<uint32_t>(out.size() - start)});
}

void BpeTokenizer::encode_segment(std::string_view text, std::vector<int32_t>& out) const {
  std::string normalized;
  if (model_.nfc) {
    normalized = unicode::nfc(text);
    text = normalized;
  }
  if (model_.add_prefix_space && !text.starts_with(' ')) {
    normalized = " " + std::string(text);
    text = normalized;
  }
  thread_local std::vector<uint32_t> ends;
  ends.clear();
  pretokenize(text, model_.pattern, ends);
  uint32_t begin = 0;
  for (uint32_t end : ends) {
    encode_piece(text.substr(begin, end - begin), out);
    begin = end;
  }
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const { return encode(text, false); }

std::vector<int32_t> BpeTokenizer::encode(std::string_view raw, bool parse_special) const {
  std::string repaired;
  std::string_view text = raw;
  if (!unicode::is_valid_utf8(raw)) {
    repaired = unicode::repair_utf8(raw);
    text = repaired;
  }
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  // Added tokens, leftmost-longest; special ones only when parse_special.
  size_t seg_begin = 0, pos = 0;
  bool any = false;
  for (const AddedToken& t : model_.added) any |= parse_special || !t.special;
  while (any && pos < text.size()) {
    const AddedToken* best = nullptr;
    for (const AddedToken& t : model_.added) {
      if ((parse_special || !t.special) && !t.content.empty() && text.compare(pos, t.content.size(), t.content) == 0 &&
          (!best || t.content.size() > best->content.size()))
        best = &t;
    }
    if (!best) {
      ++pos;
      continue;
    }
    if (pos > seg_begin) encode_segment(text.substr(seg_begin, pos - seg_begin), out);
    out.push_back(best->id);
    pos += best->content.size();
    seg_begin = pos;
  }
  if (seg_begin < text.size()) encode_segment(text.substr(seg_begin), out);
  return out;
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= vocab_size())
      MOE_THROW("tokenizer '{}': token id {} at index {} is outside [0, {})", name_, id, i, vocab_size());
    if (!is_special_[id]) text += model_.vocab[id];
  }
  return text;
}

}  // namespace moe

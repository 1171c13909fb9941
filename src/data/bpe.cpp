#include "data/bpe.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
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

// Per-thread cache of piece -> ids. Short pieces with few ids (nearly all of them) live in
// a 2-way set-associative table of one 64-byte line per entry, so a hit costs one memory
// access (node-based hash maps cost several dependent misses once 16 threads' copies no
// longer fit in the shared L3). The table starts at 512 KiB and doubles, up to 8 MiB,
// while entries keep being evicted: a miss (a BPE merge) costs ~10x an access to memory.
// Longer pieces go to a bounded hash map with the ids in one arena. Behind it, a table
// shared by the threads (SharedLines) holds the short pieces every thread merged, so that
// with T threads a piece is merged about once, not T times (each thread's own cache only
// sees 1/T of the text: 6,724 misses per MB at 32 threads against 1,365 at one, before).
// Threads hand their new lines over and the table is republished between passes.
struct alignas(64) CacheLine {
  uint64_t hash;  // 0: empty
  uint8_t key_len, n_ids;
  char key[22];
  int32_t ids[7];
};
static_assert(sizeof(CacheLine) == 64);
constexpr size_t kMinCacheSets = size_t{1} << 12, kMaxCacheSets = size_t{1} << 16;
constexpr size_t kMaxLongEntries = 1 << 16;
// Longer pieces are merged every time: SentencePiece-style files make whole segments (often
// whole documents) one piece, which would fill the long-piece cache (65536 entries) with
// text that never repeats.
constexpr size_t kMaxCachedPiece = 256;  // bytes

uint64_t piece_hash(std::string_view s) {
  uint64_t h = 0x9e3779b97f4a7c15ULL ^ s.size();
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0xff51afd7ed558ccdULL;
    h ^= h >> 32;
  }
  uint64_t w = 0;
  std::memcpy(&w, s.data() + i, s.size() - i);
  return mix(h ^ w) | 1;
}

struct PieceCache {
  uint64_t owner = 0;
  std::vector<CacheLine> lines;  // 2 per set
  size_t sets = 0, inserts = 0;  // inserts since the last resize
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, StringHash, std::equal_to<>> long_pieces;
  std::vector<int32_t> arena;

  void reset(uint64_t serial) {
    owner = serial;
    resize(kMinCacheSets);
    long_pieces.clear();
    arena.clear();
  }
  void resize(size_t n_sets) {  // drops the entries; they come back on their next miss
    sets = n_sets, inserts = 0;
    lines.assign(2 * n_sets, CacheLine{});
  }
  CacheLine* set_of(uint64_t hash) { return &lines[2 * ((hash >> 17) & (sets - 1))]; }
  CacheLine& insert_line(uint64_t hash) {
    if (++inserts > 4 * sets && sets < kMaxCacheSets) resize(2 * sets);  // twice as many misses as lines
    CacheLine* set = set_of(hash);
    set[1] = set[0];  // the older entry of the set is dropped
    return set[0];
  }
  static bool holds(const CacheLine& line, uint64_t hash, std::string_view piece) {
    return line.hash == hash && line.key_len == piece.size() && std::memcmp(line.key, piece.data(), piece.size()) == 0;
  }
};

thread_local PieceCache thread_cache;
thread_local uint64_t thread_cache_misses = 0;  // over every tokenizer this thread used
std::atomic<uint64_t> next_serial{1};

// Lines every thread has learnt (BpeTokenizer::publish_shared_cache): open addressing with
// linear probing over whole lines, at most half full, immutable once published.
struct SharedLines {
  std::vector<CacheLine> lines;
  size_t mask = 0, used = 0;

  explicit SharedLines(size_t capacity) : lines(capacity, CacheLine{}), mask(capacity - 1) {}
  const CacheLine* find(uint64_t hash, std::string_view piece) const {
    for (size_t slot = hash & mask;; slot = (slot + 1) & mask) {
      const CacheLine& line = lines[slot];
      if (line.hash == 0) return nullptr;
      if (PieceCache::holds(line, hash, piece)) return &line;
    }
  }
  void insert(const CacheLine& entry) {
    const std::string_view key(entry.key, entry.key_len);
    for (size_t slot = entry.hash & mask;; slot = (slot + 1) & mask) {
      CacheLine& line = lines[slot];
      if (line.hash == 0) {
        line = entry;
        ++used;
        return;
      }
      if (PieceCache::holds(line, entry.hash, key)) return;  // learnt by another thread too
    }
  }
};

// Lines one thread merged since it last shared them (bounded: the rest it keeps to itself).
constexpr size_t kMaxFreshLines = size_t{1} << 16;
// The shared table stops growing at 2^21 lines (128 MiB; up to 2^20 pieces, half full).
constexpr size_t kMaxSharedCapacity = size_t{1} << 21;

struct ThreadShared {  // per thread: what it has not shared yet, and the table it reads
  uint64_t owner = 0;
  std::vector<CacheLine> fresh;
  uint64_t version = 0;
  std::shared_ptr<const SharedLines> table;
};
thread_local ThreadShared thread_shared;

}  // namespace

struct BpeTokenizer::SharedCache {
  std::mutex mutex;
  std::vector<CacheLine> staged;               // handed over, not yet published
  std::shared_ptr<const SharedLines> table;    // guarded by mutex; readers copy it when version moves
  std::atomic<uint64_t> version{0};
};

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
    : model_(std::move(model)), name_(std::move(name)), serial_(next_serial++),
      shared_(std::make_shared<SharedCache>()) {
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
    // Byte-level: the token of the byte itself; SentencePiece-style: its <0xNN> token.
    auto it = ids_.find(model_.char_level ? fmt::format("<0x{:02X}>", b) : std::string(1, static_cast<char>(b)));
    byte_ids_[b] = it == ids_.end() ? -1 : it->second;
  }
  decoded_ = model_.vocab;
  if (model_.char_level) {
    for (size_t id = 0; id < decoded_.size(); ++id) {
      std::string& d = decoded_[id];
      for (size_t at = d.find(kMetaspace); at != std::string::npos; at = d.find(kMetaspace, at + 1))
        d.replace(at, kMetaspace.size(), " ");
    }
    for (int b = 0; b < 256; ++b)
      if (byte_ids_[b] >= 0) decoded_[byte_ids_[b]] = std::string(1, static_cast<char>(b));
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

  // A merge can reach across "X▁" (X not "▁") only through a token holding that pair:
  // without one, pieces cut before such a "▁" merge as the whole would (their merges never
  // meet), and can be cached. ignore_merges is excluded: a piece could then be found whole.
  if (model_.char_level && !model_.metaspace_split && !model_.ignore_merges && ids_.count(std::string(kMetaspace))) {
    cut_before_metaspace_ = true;
    for (size_t id = 0; id < model_.vocab.size() && cut_before_metaspace_; ++id) {
      const std::string& t = model_.vocab[id];
      for (size_t at = t.find(kMetaspace, 1); at != std::string::npos && !is_special_[id]; at = t.find(kMetaspace, at + 1))
        if (at < kMetaspace.size() || t.compare(at - kMetaspace.size(), kMetaspace.size(), kMetaspace) != 0)
          cut_before_metaspace_ = false;
    }
  }
  // SentencePiece-style pieces span whole segments (no pre-tokeniser), so no cut is safe.
  cuttable_ = !model_.add_prefix_space && !model_.char_level;
  for (const AddedToken& t : model_.added)
    if (!t.special && t.content.find('\n') < t.content.size() - 1) cuttable_ = false;

  eos_ = find_end_of_text(model_.added);
  bos_ = find_begin_of_text(model_.added);
}

int32_t find_end_of_text(const std::vector<AddedToken>& added) {
  for (std::string_view name : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>"})
    for (const AddedToken& t : added)
      if (t.special && t.content == name) return t.id;
  int32_t lowest = -1;
  for (const AddedToken& t : added)
    if (t.special && (lowest < 0 || t.id < lowest)) lowest = t.id;
  return lowest;
}

int32_t find_begin_of_text(const std::vector<AddedToken>& added) {
  for (std::string_view name : {"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"})
    for (const AddedToken& t : added)
      if (t.special && t.content == name) return t.id;
  return -1;
}

// A loaded file is given back as it was; a trained byte-level model is written out.
// tiktoken rank files have no merge list to write (HF's converter derives one): none.
std::string BpeTokenizer::hf_tokenizer_json() const {
  if (!model_.source_json.empty()) return model_.source_json;
  return model_.tiktoken_ranks || model_.char_level ? std::string() : moe::hf_tokenizer_json(model_);
}

int32_t BpeTokenizer::eos_id() const {
  if (eos_ < 0) MOE_THROW("tokenizer '{}' has no special token to end documents", name_);
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
  if (model_.char_level) {
    split_into_characters(piece, sym);
  } else {
    for (char c : piece) {
      int32_t id = byte_ids_[static_cast<unsigned char>(c)];
      if (id >= 0) sym.push_back(id);  // a byte missing from the vocabulary is dropped, as HF does without unk
    }
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

// HF's BPE word start: each character's token, else its <0xNN> byte tokens when the
// model falls back to bytes and has them all, else unk (one for a run when fuse_unk),
// else nothing. `piece` is well-formed UTF-8 (encode_into repairs it).
void BpeTokenizer::split_into_characters(std::string_view piece, std::vector<int32_t>& sym) const {
  thread_local std::string character;
  bool after_unk = false;
  for (size_t pos = 0; pos < piece.size();) {
    const auto lead = static_cast<unsigned char>(piece[pos]);
    const size_t len = lead < 0x80 ? 1 : lead < 0xe0 ? 2 : lead < 0xf0 ? 3 : 4;
    character.assign(piece.substr(pos, len));
    pos += len;
    if (auto it = ids_.find(character); it != ids_.end()) {
      sym.push_back(it->second);
      after_unk = false;
      continue;
    }
    if (model_.byte_fallback &&
        std::all_of(character.begin(), character.end(), [&](char c) { return byte_ids_[static_cast<unsigned char>(c)] >= 0; })) {
      for (char c : character) sym.push_back(byte_ids_[static_cast<unsigned char>(c)]);
      after_unk = false;
      continue;
    }
    if (model_.unk_id < 0) continue;
    if (!(after_unk && model_.fuse_unk)) sym.push_back(model_.unk_id);
    after_unk = true;
  }
}

void BpeTokenizer::encode_piece(std::string_view piece, uint64_t hash, std::vector<int32_t>& out) const {
  PieceCache& cache = thread_cache;
  const bool short_piece = piece.size() <= sizeof(CacheLine::key);
  if (short_piece) {
    const CacheLine* set = cache.set_of(hash);
    for (int way = 0; way < 2; ++way) {
      if (PieceCache::holds(set[way], hash, piece)) {
        out.insert(out.end(), set[way].ids, set[way].ids + set[way].n_ids);
        return;
      }
    }
  }
  // What another thread learnt and shared: copied into this thread's cache.
  if (short_piece && thread_shared.table) {
    if (const CacheLine* line = thread_shared.table->find(hash, piece)) {
      out.insert(out.end(), line->ids, line->ids + line->n_ids);
      cache.insert_line(hash) = *line;
      return;
    }
  }
  // Not in a line: long, or short with more ids than a line holds (or not seen yet).
  if (auto it = cache.long_pieces.find(piece); it != cache.long_pieces.end()) {
    const auto begin = cache.arena.begin() + it->second.first;
    out.insert(out.end(), begin, begin + it->second.second);
    return;
  }

  ++thread_cache_misses;
  const size_t start = out.size();
  auto whole = (model_.ignore_merges || model_.tiktoken_ranks) ? ids_.find(std::string(piece)) : ids_.end();
  if (whole != ids_.end()) out.push_back(whole->second);
  else merge_piece(piece, out);
  if (piece.size() > kMaxCachedPiece) return;
  const size_t count = out.size() - start;
  if (short_piece && count <= std::size(CacheLine{}.ids)) {
    CacheLine& line = cache.insert_line(hash);
    line.hash = hash;
    line.key_len = static_cast<uint8_t>(piece.size());
    line.n_ids = static_cast<uint8_t>(count);
    std::memcpy(line.key, piece.data(), piece.size());
    std::copy(out.begin() + static_cast<ptrdiff_t>(start), out.end(), line.ids);
    if (thread_shared.fresh.size() < kMaxFreshLines) thread_shared.fresh.push_back(line);
  } else {
    if (cache.long_pieces.size() >= kMaxLongEntries) cache.long_pieces.clear(), cache.arena.clear();
    const auto offset = static_cast<uint32_t>(cache.arena.size());
    cache.arena.insert(cache.arena.end(), out.begin() + static_cast<ptrdiff_t>(start), out.end());
    cache.long_pieces.emplace(std::string(piece), std::pair{offset, static_cast<uint32_t>(count)});
  }
}

uint64_t BpeTokenizer::cache_misses_on_this_thread() const { return thread_cache_misses; }

void BpeTokenizer::share_this_threads_cache() const {
  ThreadShared& shared = thread_shared;
  if (shared.owner != serial_ || shared.fresh.empty()) return;
  std::lock_guard lock(shared_->mutex);
  shared_->staged.insert(shared_->staged.end(), shared.fresh.begin(), shared.fresh.end());
  shared.fresh.clear();
}

// Publishing copies the table (readers may hold the old one), so it waits until the lines
// handed over are at least 1/8 of those published: each line is copied ~8 times at most.
void BpeTokenizer::publish_shared_cache() const {
  std::lock_guard lock(shared_->mutex);
  const SharedLines* old = shared_->table.get();
  if (old && 2 * (old->used + 1) > old->lines.size() && old->lines.size() >= kMaxSharedCapacity)
    shared_->staged.clear();  // full for good
  if (shared_->staged.empty() || (old && 8 * shared_->staged.size() < old->used)) return;
  const size_t wanted = 2 * ((old ? old->used : 0) + shared_->staged.size());
  size_t capacity = size_t{1} << 12;
  while (capacity < wanted && capacity < kMaxSharedCapacity) capacity *= 2;
  auto table = std::make_shared<SharedLines>(capacity);
  if (old)
    for (const CacheLine& line : old->lines)
      if (line.hash != 0) table->insert(line);
  for (const CacheLine& line : shared_->staged) {
    if (2 * (table->used + 1) > capacity) break;  // full: what is left stays per thread
    table->insert(line);
  }
  shared_->staged.clear();
  shared_->table = std::move(table);
  shared_->version.fetch_add(1, std::memory_order_release);
}

void BpeTokenizer::encode_segment(std::string_view text, bool at_start, std::vector<int32_t>& out) const {
  if (model_.char_level) return encode_metaspace_segment(text, at_start, out);
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
  thread_local std::vector<uint64_t> hashes;
  ends.clear();
  pretokenize(text, model_.pattern, ends);
  // Hash the pieces first, so that the cache lines of later pieces can be fetched from
  // memory while earlier ones are looked up (the lookups are otherwise latency bound).
  hashes.resize(ends.size());
  for (size_t i = 0, begin = 0; i < ends.size(); begin = ends[i++]) {
    const std::string_view piece = text.substr(begin, ends[i] - begin);
    hashes[i] = piece.size() <= sizeof(CacheLine::key) ? piece_hash(piece) : 0;
  }
  PieceCache& cache = thread_cache;
  prepare_thread_caches();
  constexpr size_t kAhead = 8;
  for (size_t i = 0, begin = 0; i < ends.size(); begin = ends[i++]) {
    if (i + kAhead < ends.size()) {
      const char* set = reinterpret_cast<const char*>(cache.set_of(hashes[i + kAhead]));
      __builtin_prefetch(set), __builtin_prefetch(set + sizeof(CacheLine));
    }
    encode_piece(text.substr(begin, ends[i] - begin), hashes[i], out);
  }
}

// Makes this thread's caches this tokenizer's, and picks up what other threads published.
void BpeTokenizer::prepare_thread_caches() const {
  PieceCache& cache = thread_cache;
  if (cache.owner != serial_) cache.reset(serial_);
  ThreadShared& shared = thread_shared;
  if (shared.owner != serial_) shared = ThreadShared{serial_};
  if (const uint64_t version = shared_->version.load(std::memory_order_acquire); version != shared.version) {
    std::lock_guard lock(shared_->mutex);
    shared.table = shared_->table;
    shared.version = shared_->version.load(std::memory_order_relaxed);
  }
}

// ' ' -> "▁", the prefix "▁" as the file asks, then one piece, or (Metaspace split) a piece
// from each "▁" to the next (HF's MergedWithNext).
void BpeTokenizer::encode_metaspace_segment(std::string_view text, bool at_start, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  thread_local std::string normalized;
  normalized.clear();
  for (char c : text) {
    if (c == ' ') normalized += kMetaspace;
    else normalized.push_back(c);
  }
  const bool starts_with_metaspace = std::string_view(normalized).starts_with(kMetaspace);
  const MetaspacePrefix prefix = model_.prefix;
  if (prefix == MetaspacePrefix::Always || (prefix == MetaspacePrefix::UnlessMetaspace && !starts_with_metaspace) ||
      (prefix == MetaspacePrefix::FirstUnlessMetaspace && at_start && !starts_with_metaspace))
    normalized.insert(0, kMetaspace);
  prepare_thread_caches();
  const std::string_view all(normalized);
  if (!model_.metaspace_split && !cut_before_metaspace_)
    return encode_piece(all, all.size() <= sizeof(CacheLine::key) ? piece_hash(all) : 0, out);
  auto cut_at = [&](size_t at) {  // before every "▁" (split), or only before one ending a run of other characters
    return model_.metaspace_split || at < kMetaspace.size() ||
           all.compare(at - kMetaspace.size(), kMetaspace.size(), kMetaspace) != 0;
  };
  for (size_t begin = 0; begin < all.size();) {
    size_t end = all.find(kMetaspace, begin + 1);
    while (end != std::string_view::npos && !cut_at(end)) end = all.find(kMetaspace, end + 1);
    if (end == std::string_view::npos) end = all.size();
    const std::string_view piece = all.substr(begin, end - begin);
    encode_piece(piece, piece.size() <= sizeof(CacheLine::key) ? piece_hash(piece) : 0, out);
    begin = end;
  }
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const { return encode(text, false); }

std::vector<int32_t> BpeTokenizer::encode(std::string_view raw, bool parse_special) const {
  std::vector<int32_t> out;
  out.reserve(raw.size() / 3 + 4);
  encode_into(raw, parse_special, out);
  return out;
}

void BpeTokenizer::encode_append(std::string_view text, std::vector<int32_t>& out) const {
  encode_into(text, false, out);
}

void BpeTokenizer::encode_into(std::string_view raw, bool parse_special, std::vector<int32_t>& out) const {
  std::string repaired;
  std::string_view text = raw;
  if (!unicode::is_valid_utf8(raw)) {
    repaired = unicode::repair_utf8(raw);
    text = repaired;
  }
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
    if (pos > seg_begin) encode_segment(text.substr(seg_begin, pos - seg_begin), seg_begin == 0, out);
    out.push_back(best->id);
    pos += best->content.size();
    seg_begin = pos;
  }
  if (seg_begin < text.size()) encode_segment(text.substr(seg_begin), seg_begin == 0, out);
}

// Why a cut between A = "...\n" and B, whose first character c is not whitespace (\s),
// cannot change the ids of encode(A + B):
// - UTF-8 repair and NFC act on A and B apart: '\n' is ASCII, so no ill-formed sequence
//   spans it, and it is a starter that composes with nothing. Added tokens (only non-special
//   ones are matched here) could span the cut only if one held a '\n' before its last
//   byte, and ByteLevel's add_prefix_space would put a space before B: cuttable_ rules
//   both out. What is left is that the pre-tokeniser's leftmost-first scan ends a piece
//   exactly at the cut, and that the pieces on each side do not depend on the other side.
// - Llama-3 and Qwen2, (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
//   (or \p{N})| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+: no match holds both the
//   '\n' and c: the contractions and \p{N} hold no '\n', [^\r\n\p{L}\p{N}]? cannot take '\n'
//   as the prefix of \p{L}+, and the other alternatives reach past a '\n' only through
//   [\r\n] or \s, which c is not. So the scan of A + B starts a piece at c, and from there it
//   sees only B (no lookbehind). Before the cut, a match reaching the '\n' looks at c only
//   as a [\r\n]* / [\r\n]+ / \s continuation that stops at c just as at the end of A;
//   \s+(?!\S), the one lookahead, is tried only where \s*[\r\n]+ failed, i.e. from a
//   whitespace run that stops (at a non-space) before the '\n'. So A's pieces are the same.
// - GPT-2, 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+: the
//   optional prefix is only ' ', so again no match holds both the '\n' and c. But a
//   whitespace run ending in the '\n' is one piece at the end of A and loses its last
//   character to (?!\S) before c; so the character before the '\n' must not be whitespace
//   either. Then the '\n' is a run of its own, a piece by itself on both sides (\s+(?!\S)
//   at the end of A, \s+ before c), and the matches before it stop before it.
// c is checked in the raw bytes: an ASCII non-space; with NFC only that (NFC could merge a
// non-ASCII c with what follows into something else); otherwise also a well-formed
// non-space code point or an ill-formed sequence (repaired to U+FFFD). For GPT-2 the byte
// before the '\n' must be an ASCII non-space (repair and NFC keep it as it is).
void BpeTokenizer::find_cuts(std::string_view text, size_t chunk_bytes, std::vector<size_t>& cuts) const {
  if (!cuttable_) return;
  auto non_space = [](char32_t cp) {
    const uint8_t c = unicode::char_class(cp);
    return c != unicode::kSpace && c != unicode::kNewline;
  };
  auto starts_non_space = [&](size_t at) {
    const auto b = static_cast<unsigned char>(text[at]);
    if (b < 0x80) return non_space(b);
    if (model_.nfc) return false;
    const size_t len = b >= 0xf0 ? 4 : b >= 0xe0 ? 3 : 2;
    if (at + len > text.size() || !unicode::is_valid_utf8(text.substr(at, len))) return true;  // -> U+FFFD
    int decoded = 0;
    return non_space(unicode::decode_at(text, at, decoded));
  };
  const bool gpt2 = model_.pattern == PretokPattern::Gpt2;
  size_t cut = std::max<size_t>(chunk_bytes, 2);  // the earliest allowed cut
  while (cut < text.size()) {
    const void* hit = std::memchr(text.data() + cut - 1, '\n', text.size() - (cut - 1));
    if (!hit) break;
    const size_t newline = static_cast<size_t>(static_cast<const char*>(hit) - text.data());
    cut = newline + 1;
    if (cut >= text.size()) break;
    const auto before = static_cast<unsigned char>(text[newline - 1]);
    if (starts_non_space(cut) && (!gpt2 || (before < 0x80 && non_space(before)))) {
      cuts.push_back(cut);
      cut += std::max<size_t>(chunk_bytes, 1);
    } else {
      cut += 1;
    }
  }
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= vocab_size())
      MOE_THROW("tokenizer '{}': token id {} at index {} is outside [0, {})", name_, id, i, vocab_size());
    if (!is_special_[id]) text += decoded_[id];
  }
  // Decoder Strip(' ', start=N) after Fuse: from the start of the whole text.
  size_t strip = 0;
  while (strip < static_cast<size_t>(model_.strip_leading_spaces) && strip < text.size() && text[strip] == ' ') ++strip;
  text.erase(0, strip);
  return text;
}

}  // namespace moe

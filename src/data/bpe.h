// BPE compatible with Hugging Face `tokenizers` (tokenizer.json) and with tiktoken rank
// files, in two kinds:
// - byte-level (GPT-2, Llama-3, Qwen2, tiktoken): split off added tokens, repair invalid
//   UTF-8 to U+FFFD (as Python's errors="replace"), optional NFC, pre-tokenise with one of
//   the GPT-2 / Llama-3 / Qwen2 patterns, then merge each piece's bytes by rank;
// - SentencePiece-style (Llama-2, Mistral: `char_level`): the same added tokens and
//   repair, then ' ' -> "▁" with a "▁" prepended (normalizer Prepend + Replace, or a
//   Metaspace pre-tokenizer), then merge each piece's characters by rank; a character
//   missing from the vocabulary becomes its UTF-8 bytes as <0xNN> tokens (byte_fallback)
//   or the unknown token.
// Piece results are cached per thread. Post-processing (BOS templates) is not applied:
// callers add what they need.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "data/pretokenize.h"
#include "data/tokenizer.h"

namespace moe {

// Where a SentencePiece-style tokenizer puts "▁" before a segment of text (the text
// between added tokens), after ' ' became "▁".
enum class MetaspacePrefix : uint8_t {
  None,
  Always,            // normalizer Prepend("▁"): every non-empty segment
  UnlessMetaspace,   // Metaspace prepend_scheme "always": every segment not starting with "▁"
  FirstUnlessMetaspace,  // "first": only a segment at the start of the text, not starting with "▁"
};

// The UTF-8 text of "▁" (U+2581), SentencePiece's visible space.
inline constexpr std::string_view kMetaspace = "\xe2\x96\x81";

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool special = true;
};

// Everything that defines a byte-level BPE model; produced by the loaders and the trainer.
struct BpeModel {
  std::vector<std::string> vocab;                          // id -> token bytes ("" for unused ids)
  std::vector<std::pair<int32_t, int32_t>> merges;         // in rank order: (left id, right id)
  std::vector<AddedToken> added;                           // matched in text before pre-tokenisation
  PretokPattern pattern = PretokPattern::Gpt2;
  bool byte_level_regex = true;   // GPT-2 pattern given as ByteLevel(use_regex=true) instead of Split
  bool add_prefix_space = false;  // ByteLevel: prepend ' ' to each text segment not starting with one
  bool nfc = false;               // NFC normalizer (Qwen2)
  bool ignore_merges = false;     // a piece that is itself a token is emitted whole (Llama-3, tiktoken)
  bool tiktoken_ranks = false;    // merges come from tiktoken ranks (ignore_merges implied)

  // SentencePiece-style models: vocab holds token text (UTF-8, ' ' written as "▁"), merged
  // from characters; `pattern` and the byte-level flags are unused.
  bool char_level = false;
  bool byte_fallback = false;     // a character not in vocab -> its bytes as <0xNN> tokens (all 256 present)
  int32_t unk_id = -1;            // else this token (-1: the character is dropped, as HF does)
  bool fuse_unk = false;          // consecutive unknown characters give one unk
  MetaspacePrefix prefix = MetaspacePrefix::None;
  bool metaspace_split = false;   // Metaspace(split=true): a piece starts at every "▁"; else a segment is one piece
  int strip_leading_spaces = 0;   // decoder Strip(' ', start=N) / Metaspace: spaces dropped from the decoded start

  std::string source_json;  // the tokenizer.json it was loaded from (what hf_tokenizer_json gives back); "" if made
};

// The GPT-2 byte -> printable character map (bytes_to_unicode), as UTF-8 strings.
const std::array<std::string, 256>& byte_level_chars();

class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(BpeModel model, std::string name);

  // Text only: added tokens (including EOS) are not recognised, so this never emits
  // eos_id(); the same as HF with encode_special_tokens = true for special tokens.
  std::vector<int32_t> encode(std::string_view text) const override;
  // parse_special: added tokens in `text` become their ids (HF's default).
  std::vector<int32_t> encode(std::string_view text, bool parse_special) const;
  void encode_append(std::string_view text, std::vector<int32_t>& out) const override;  // encode(text)
  // Cuts just after a '\n' that is followed by a non-whitespace character (for the GPT-2
  // pattern also preceded by one); none when added tokens or add_prefix_space could make
  // a cut visible. Holds for encode(text), not for parse_special. See bpe.cpp for why.
  void find_cuts(std::string_view text, size_t chunk_bytes, std::vector<size_t>& cuts) const override;
  // Special tokens decode to nothing (HF's skip_special_tokens). Returns raw bytes, which
  // can be ill-formed UTF-8 when a sequence ends inside a character.
  std::string decode(std::span<const int32_t> ids) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(model_.vocab.size()); }
  int32_t eos_id() const override;
  int32_t bos_id() const override { return bos_; }
  std::string name() const override { return name_; }
  std::string hf_tokenizer_json() const override;
  // Pieces found in none of the piece caches (then merged or looked up whole).
  uint64_t cache_misses_on_this_thread() const override;
  // Short pieces a thread merged since it last shared go to a table every thread reads
  // behind its own cache, so T threads learn each piece once, not T times.
  void share_this_threads_cache() const override;
  void publish_shared_cache() const override;

  const BpeModel& model() const { return model_; }
  // The id of a token given by its bytes, or -1.
  int32_t token_id(std::string_view bytes) const;

 private:
  void encode_into(std::string_view raw, bool parse_special, std::vector<int32_t>& out) const;
  void encode_segment(std::string_view text, bool at_start, std::vector<int32_t>& out) const;
  void encode_metaspace_segment(std::string_view text, bool at_start, std::vector<int32_t>& out) const;
  void split_into_characters(std::string_view piece, std::vector<int32_t>& sym) const;  // char_level
  void prepare_thread_caches() const;
  void encode_piece(std::string_view piece, uint64_t hash, std::vector<int32_t>& out) const;  // hash: piece_hash
  void merge_piece(std::string_view piece, std::vector<int32_t>& out) const;
  uint64_t find_merge(int32_t left, int32_t right) const;  // (rank << 32 | merged id), or ~0

  struct SharedCache;  // bpe.cpp

  BpeModel model_;
  std::string name_;
  uint64_t serial_;  // identifies this instance in the per-thread piece caches
  std::shared_ptr<SharedCache> shared_;
  std::unordered_map<std::string, int32_t> ids_;
  int32_t byte_ids_[256];
  // Open-addressing table (left, right) -> (rank << 32 | merged id).
  std::vector<uint64_t> merge_keys_, merge_values_;
  uint64_t merge_mask_ = 0;
  std::vector<bool> is_special_;
  std::vector<std::string> decoded_;  // id -> what it decodes to (char_level: "▁" -> ' ', <0xNN> -> the byte)
  int32_t eos_ = -1, bos_ = -1;
  bool cuttable_ = false;  // find_cuts may cut (see there)
  bool cut_before_metaspace_ = false;  // SentencePiece-style without split: pieces may still be cut (see the constructor)
};

// The token that ends documents among `added`: the first special token with a usual
// end-of-text name, in the order <|endoftext|>, <|end_of_text|>, </s>, <eos>, <|im_end|>;
// else the special token with the lowest id (`moe tokenizer train` gives its first
// --special the lowest id). -1 when no token is special.
int32_t find_end_of_text(const std::vector<AddedToken>& added);

// The token that begins documents among `added` (special, named <s>, <|begin_of_text|>,
// <bos> or <|startoftext|>), or -1.
int32_t find_begin_of_text(const std::vector<AddedToken>& added);

// Loads a tokenizer.json (BPE model with a byte-level pre-tokenizer, or SentencePiece-style). Throws ConfigError
// naming the file and what is missing or unsupported.
BpeModel load_hf_tokenizer(const std::string& path);
// The same from the file's text; `path` names it in errors.
BpeModel parse_hf_tokenizer(std::string text, const std::string& path);
// `model` as the text of a tokenizer.json that HF tokenizers loads.
std::string hf_tokenizer_json(const BpeModel& model);
// Writes hf_tokenizer_json(model) to `path` (atomically).
void save_hf_tokenizer(const BpeModel& model, const std::string& path);
// Loads a tiktoken rank file (lines "base64(token) rank"). `pattern` is the pre-tokeniser
// (rank files do not carry it); `specials` are appended after the largest rank.
BpeModel load_tiktoken(const std::string& path, PretokPattern pattern, const std::vector<std::string>& specials);

}  // namespace moe

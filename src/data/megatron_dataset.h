// Megatron-LM's indexed datasets (MMapIndexedDataset, what tools/preprocess_data.py
// writes), read in place: PREFIX.idx describes the token runs of PREFIX.bin.
//
// .idx layout (little-endian): the 9 bytes "MMIDIDX\0\0", u64 version (1), u8 dtype code
// of the .bin's ids (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16; 6 and 7 are
// floats, refused), u64 sequence count N, u64 document-index count M, then int32 sizes[N]
// (tokens per sequence), int64 pointers[N] (byte offset of each sequence in .bin),
// int64 document_index[M] (document d is sequences [document_index[d], document_index[d+1]),
// so it starts with 0 and ends with N), and for multimodal data int8 modes[N] (ignored).
// The arrays follow the 34-byte header unaligned. The .bin holds the ids back to back.
//
// Each Megatron document (its sequences, usually one) is one of our documents; the packed
// loader appends the tokenizer's EOS after it as after any document.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "data/corpus.h"

namespace moe {

inline constexpr char kMegatronIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr size_t kMegatronIndexHeaderBytes = 34;

// A validated .idx: every check that needs only its bytes (and the .bin's size when given).
struct MegatronIndex {
  uint8_t dtype_code = 0;
  uint32_t token_bytes = 0;
  bool token_signed = false;
  int64_t n_sequences = 0;
  int64_t n_tokens = 0;                // the sum of the sizes
  std::vector<int64_t> doc_offsets;    // n_docs + 1 token offsets into .bin: document d is [doc_offsets[d], doc_offsets[d+1])
  int64_t n_docs() const { return static_cast<int64_t>(doc_offsets.size()) - 1; }
};

// Parses and checks an .idx: magic, version, dtype, counts against the size, sizes >= 0,
// pointers that are the running sum of the sizes (the ids back to back), a document index
// from 0 to N that never decreases; bin_bytes >= 0 must then be exactly the ids' bytes.
// Throws ConfigError "megatron index '<name>': <what is wrong>".
MegatronIndex parse_megatron_index(std::span<const uint8_t> bytes, std::string_view name, int64_t bin_bytes = -1);

// PREFIX.idx and PREFIX.bin, both memory-mapped; the .idx is parsed on open.
class MegatronDataset final : public DocumentSource {
 public:
  // `path` is the prefix, or either file's name. ConfigError naming the file when one is
  // missing, unreadable or does not parse.
  explicit MegatronDataset(const std::string& path);
  ~MegatronDataset() override;
  MegatronDataset(const MegatronDataset&) = delete;
  MegatronDataset& operator=(const MegatronDataset&) = delete;

  int64_t n_docs() const override { return index_.n_docs(); }
  int64_t doc_size(int64_t d) const override { return index_.doc_offsets[d + 1] - index_.doc_offsets[d]; }
  void copy(int64_t d, int64_t offset, int64_t count, int32_t* out) const override;
  int64_t n_tokens() const { return index_.n_tokens; }
  const std::string& prefix() const { return prefix_; }
  // The smallest and largest id of the .bin (one parallel pass, on the first call).
  std::pair<int64_t, int64_t> token_range() const;
  // ConfigError "megatron dataset '<prefix>.bin': token id X outside the vocabulary of V"
  // unless every id is in [0, vocab_size).
  void check_vocabulary(int64_t vocab_size, std::string_view vocab_key) const;

 private:
  std::string prefix_;
  MegatronIndex index_;
  void* bin_map_ = nullptr;
  size_t bin_size_ = 0;
  mutable bool range_known_ = false;
  mutable std::pair<int64_t, int64_t> range_{0, 0};
};

// Megatron's dataset prefix for a path that names the prefix, PREFIX.idx or PREFIX.bin;
// "" when neither PREFIX.idx exists.
std::string megatron_prefix(const std::string& path);

}  // namespace moe

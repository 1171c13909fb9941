// Byte-level BPE training: count pre-tokenised pieces, then repeatedly merge the most
// frequent adjacent pair (ties: the smaller (left id, right id)) until the vocabulary
// has the requested size. Ids: special tokens first, then the 256 bytes, then merges.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/bpe.h"
#include "data/corpus.h"

namespace moe {

struct BpeTrainOptions {
  int64_t vocab_size = 4096;  // including the special tokens and the 256 bytes
  PretokPattern pattern = PretokPattern::Gpt2;
  std::vector<std::string> specials = {"<|endoftext|>"};
  int threads = 0;            // 0: all
};

// The --special list of `moe tokenizer train`: at least one, none empty or repeated, and
// the first is the one find_end_of_text (data/bpe.h) picks from the file, so the token
// that ends documents is the first given. Throws ConfigError otherwise.
void check_specials(const std::vector<std::string>& specials);

// Deterministic: the result does not depend on the thread count. Stops short of
// vocab_size when no pair is left to merge (tiny corpora).
BpeModel train_bpe(std::span<const std::string_view> docs, const BpeTrainOptions& options);

// data.tokenizer = "bpe:<vocab>": the tokenizer trained on `docs` (Llama-3 pattern, EOS
// <|endoftext|>), reused from `cache_dir`/bpe-<vocab>-<hash of the documents>.json when an
// earlier run wrote it. `how` says which happened, for the log.
std::unique_ptr<BpeTokenizer> load_or_train_bpe(std::span<const Document> docs, int64_t vocab_size,
                                                const std::string& cache_dir, int threads, std::string& how);

}  // namespace moe

// Tokenizers turn text into int32 token ids and back: the byte tokenizer, BPE (data/bpe.h)
// and SentencePiece (data/sentencepiece_tokenizer.h) implement the same interface, so the
// corpus reader, the loader and the trainer never depend on which one is in use.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "config/data_config.h"  // DataConfig, kByteVocabSize

namespace moe {

// The byte tokenizer's fixed vocabulary: ids 0..255 are bytes, 256 ends a document.
inline constexpr int32_t kByteEosId = 256;

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Never emits eos_id(); document boundaries are added by the loader. Called from
  // several threads at once, so const calls must be thread-safe.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Appends encode(text) to `out`: lets callers reuse one buffer for many texts.
  virtual void encode_append(std::string_view text, std::vector<int32_t>& out) const {
    std::vector<int32_t> ids = encode(text);
    out.insert(out.end(), ids.begin(), ids.end());
  }
  // Appends to `cuts`, increasing, byte offsets in (0, text.size()) where `text` may be cut
  // without changing its ids: encoding the parts one by one and concatenating gives exactly
  // encode(text). Cuts are at least `chunk_bytes` apart (the first at >= chunk_bytes), as
  // close to that as the text allows. Default: none (the text is encoded whole).
  virtual void find_cuts(std::string_view text, size_t chunk_bytes, std::vector<size_t>& cuts) const {
    (void)text, (void)chunk_bytes, (void)cuts;
  }
  // Throws moe::Error on an id outside [0, vocab_size()).
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int32_t eos_id() const = 0;
  // The token the file names as beginning documents, or -1 (none, or the byte tokenizer).
  // Never emitted by encode: callers that want it prepend it.
  virtual int32_t bos_id() const { return -1; }
  virtual std::string name() const = 0;
  // The tokenizer as the text of a Hugging Face tokenizer.json giving the same ids (what
  // checkpoints keep and `moe export` ships), or "" when it has no such form.
  virtual std::string hf_tokenizer_json() const { return {}; }
  // For profiling: the texts this thread has encoded without help from the tokenizer's
  // caches so far (BPE: pieces merged from bytes), counted per thread from its start.
  virtual uint64_t cache_misses_on_this_thread() const { return 0; }
  // Caches shared between threads, for encoders that run passes over many threads
  // (ParallelEncoder): at the end of its part of a pass each thread hands over what it
  // learnt (share_this_threads_cache), then one thread, while the others wait, makes all
  // of it visible to every thread (publish_shared_cache). Results never change.
  virtual void share_this_threads_cache() const {}
  virtual void publish_shared_cache() const {}
};

// Every byte is its own token, so any input (including invalid UTF-8) round-trips.
// EOS decodes to nothing: decode(encode(text)) == text, and sampled text reads cleanly;
// callers that need boundaries split on eos_id() before decoding.
class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override;
  void encode_append(std::string_view text, std::vector<int32_t>& out) const override;
  void find_cuts(std::string_view text, size_t chunk_bytes, std::vector<size_t>& cuts) const override;  // anywhere
  std::string decode(std::span<const int32_t> ids) const override;
  int64_t vocab_size() const override { return kByteVocabSize; }
  int32_t eos_id() const override { return kByteEosId; }
  std::string name() const override { return "byte"; }
  // A byte-level BPE with the 256 bytes as ids 0..255, no merges and <|endoftext|> as 256.
  std::string hf_tokenizer_json() const override;
};

// A tokenizer from its spec: "byte"; a Hugging Face tokenizer.json (a path ending in .json,
// or "hf:<path>"; byte-level or byte-fallback BPE); "tiktoken:<gpt2|llama3|qwen2>:<rank
// file>" (EOS <|endoftext|> appended); a SentencePiece model ("sentencepiece:<path>", or a
// path ending in .model).
// Throws ConfigError naming the spec or file and the problem.
std::unique_ptr<Tokenizer> make_tokenizer(std::string_view spec);
// The tokenizer named by data.tokenizer ("bpe:N" must have been resolved to a file by
// the caller, see train/text_data.cpp).
std::unique_ptr<Tokenizer> make_tokenizer(const DataConfig& config);
// A tokenizer.json's text (what checkpoints keep, Tokenizer::hf_tokenizer_json) as its
// tokenizer; `source` names it in errors and is its name().
std::unique_ptr<Tokenizer> tokenizer_from_hf_json(std::string text, const std::string& source);

}  // namespace moe

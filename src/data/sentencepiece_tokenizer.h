// SentencePiece `.model` files (Llama-2, Mistral, T5 ...), BPE or unigram, through Debian's
// libsentencepiece: ids are the library's own, so they equal the Python package's.
#pragma once
#include <memory>
#include <string>

#include "data/tokenizer.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace moe {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // Throws ConfigError naming `path` when it cannot be read or is not a SentencePiece model.
  explicit SentencePieceTokenizer(const std::string& path);
  ~SentencePieceTokenizer() override;

  // The model's normalisation and dummy prefix apply; BOS/EOS are never added.
  std::vector<int32_t> encode(std::string_view text) const override;
  void encode_append(std::string_view text, std::vector<int32_t>& out) const override;
  // Control pieces (BOS, EOS) decode to nothing, unknown ones to " ⁇ ", as the library does.
  std::string decode(std::span<const int32_t> ids) const override;
  int64_t vocab_size() const override;
  // The model's </s> piece; throws when the model has none (eos_id = -1 when trained).
  int32_t eos_id() const override;
  int32_t bos_id() const override;
  std::string name() const override { return path_; }

 private:
  std::string path_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;
};

}  // namespace moe

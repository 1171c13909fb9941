#include "data/tokenizer.h"

#include "core/error.h"
#include "train/config.h"

namespace moe {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  text.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    int32_t id = ids[i];
    if (id == kByteEosId) continue;
    if (id < 0 || id > 255) MOE_THROW("byte tokenizer: token id {} at index {} is outside [0, {})", id, i, kByteVocabSize);
    text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
  }
  return text;
}

std::unique_ptr<Tokenizer> make_tokenizer(const DataConfig& config) {
  if (config.tokenizer == "byte") return std::make_unique<ByteTokenizer>();
  MOE_CONFIG_ERROR("data.tokenizer must be one of byte, got \"{}\"", config.tokenizer);
}

}  // namespace moe

#include "data/tokenizer.h"

#include <algorithm>

#include "core/error.h"
#include "data/bpe.h"
#include "data/sentencepiece_tokenizer.h"
#include "config/data_config.h"

namespace moe {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

void ByteTokenizer::encode_append(std::string_view text, std::vector<int32_t>& out) const {
  for (char c : text) out.push_back(static_cast<unsigned char>(c));
}

void ByteTokenizer::find_cuts(std::string_view text, size_t chunk_bytes, std::vector<size_t>& cuts) const {
  for (size_t at = std::max<size_t>(chunk_bytes, 1); at < text.size(); at += std::max<size_t>(chunk_bytes, 1))
    cuts.push_back(at);
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

std::string ByteTokenizer::hf_tokenizer_json() const {
  BpeModel model;
  model.vocab.resize(256);
  for (int b = 0; b < 256; ++b) model.vocab[static_cast<size_t>(b)] = std::string(1, static_cast<char>(b));
  model.added.push_back({"<|endoftext|>", kByteEosId, true});
  return moe::hf_tokenizer_json(model);
}

std::unique_ptr<Tokenizer> tokenizer_from_hf_json(std::string text, const std::string& source) {
  return std::make_unique<BpeTokenizer>(parse_hf_tokenizer(std::move(text), source), source);
}

std::unique_ptr<Tokenizer> make_tokenizer(std::string_view spec) {
  const TokenizerSpec parsed = parse_tokenizer_spec(spec);
  if (parsed.kind == TokenizerKind::Byte) return std::make_unique<ByteTokenizer>();
  std::unique_ptr<Tokenizer> tokenizer;
  if (parsed.kind == TokenizerKind::Tiktoken) {
    std::string_view rest = spec.substr(9);
    const size_t colon = rest.find(':');
    auto pattern = pattern_from_name(rest.substr(0, colon));
    if (colon == std::string_view::npos || !pattern)
      MOE_CONFIG_ERROR("tokenizer '{}': expected tiktoken:<gpt2|llama3|qwen2>:<rank file>", spec);
    tokenizer = std::make_unique<BpeTokenizer>(load_tiktoken(parsed.path, *pattern, {"<|endoftext|>"}), parsed.path);
  } else if (parsed.kind == TokenizerKind::HfJson) {
    tokenizer = std::make_unique<BpeTokenizer>(load_hf_tokenizer(parsed.path), parsed.path);
  } else if (parsed.kind == TokenizerKind::SentencePiece) {
    tokenizer = std::make_unique<SentencePieceTokenizer>(parsed.path);
  } else {
    MOE_CONFIG_ERROR("tokenizer '{}' is neither byte, a tokenizer.json path (or hf:<path>), tiktoken:<pattern>:<file>, "
                     "sentencepiece:<path> nor a .model path", spec);
  }
  try {
    tokenizer->eos_id();
  } catch (const Error&) {
    if (parsed.kind == TokenizerKind::SentencePiece)
      MOE_CONFIG_ERROR("{}: no end-of-sentence piece (the model was trained with eos_id = -1); one is needed to end "
                       "documents", parsed.path);
    MOE_CONFIG_ERROR("{}: no end-of-text token: a special added token is needed (<|endoftext|>, <|end_of_text|>, </s>, "
                     "<eos> or <|im_end|> is taken first, else the special token with the lowest id)", parsed.path);
  }
  return tokenizer;
}

std::unique_ptr<Tokenizer> make_tokenizer(const DataConfig& config) {
  try {
    return make_tokenizer(config.tokenizer);
  } catch (const ConfigError& e) {
    MOE_CONFIG_ERROR("data.tokenizer: {}", e.what());
  }
}

}  // namespace moe

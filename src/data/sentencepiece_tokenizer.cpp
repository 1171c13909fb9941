#include "data/sentencepiece_tokenizer.h"

#include <sentencepiece_processor.h>

#include <algorithm>

#include "core/error.h"
#include "data/file_util.h"

namespace moe {

SentencePieceTokenizer::SentencePieceTokenizer(const std::string& path)
    : path_(path), processor_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  const std::string bytes = read_whole_file(path, "SentencePiece model");
  sentencepiece::util::Status status;
  try {
    status = processor_->LoadFromSerializedProto(bytes);
  } catch (const std::exception& e) {  // the library's trie builder throws on some models (an empty piece)
    status = sentencepiece::util::Status(sentencepiece::util::StatusCode::kInvalidArgument, e.what());
  }
  if (!status.ok()) {
    std::string why = status.ToString();
    std::replace(why.begin(), why.end(), '\n', ' ');  // errors are one line
    MOE_CONFIG_ERROR("{}: not a SentencePiece model (truncated, corrupt or another format): {}", path, why);
  }
  if (processor_->GetPieceSize() <= 0) MOE_CONFIG_ERROR("{}: not a SentencePiece model: no pieces", path);
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::vector<int32_t> SentencePieceTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  encode_append(text, out);
  return out;
}

void SentencePieceTokenizer::encode_append(std::string_view text, std::vector<int32_t>& out) const {
  thread_local std::vector<int> ids;
  ids.clear();
  const auto status = processor_->Encode(text, &ids);
  if (!status.ok()) MOE_THROW("{}: encoding failed: {}", path_, status.ToString());
  out.insert(out.end(), ids.begin(), ids.end());
}

std::string SentencePieceTokenizer::decode(std::span<const int32_t> ids) const {
  const int64_t n = vocab_size();
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= n) MOE_THROW("tokenizer '{}': token id {} at index {} is outside [0, {})", path_, ids[i], i, n);
  std::string text;
  const auto status = processor_->Decode(std::vector<int>(ids.begin(), ids.end()), &text);
  if (!status.ok()) MOE_THROW("{}: decoding failed: {}", path_, status.ToString());
  return text;
}

int64_t SentencePieceTokenizer::vocab_size() const { return processor_->GetPieceSize(); }

int32_t SentencePieceTokenizer::eos_id() const {
  const int id = processor_->eos_id();
  if (id < 0 || id >= processor_->GetPieceSize()) MOE_THROW("tokenizer '{}' has no end-of-sentence piece", path_);
  return id;
}

int32_t SentencePieceTokenizer::bos_id() const {
  const int id = processor_->bos_id();
  return id >= 0 && id < processor_->GetPieceSize() ? id : -1;
}

}  // namespace moe

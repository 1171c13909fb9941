// What text generation decodes with: a model behind a KV cache, fed tokens and answering
// with the next token's logits. The CPU decoder wraps Transformer<float>; a GPU decoder
// over the GPU model implements the same interface (docs/GENERATION.md).
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model/kv_cache.h"
#include "model/transformer.h"

namespace moe {

class Decoder {
 public:
  virtual ~Decoder() = default;
  // The most positions the cache holds: model.seq_len, the context the model was trained on.
  virtual int64_t context() const = 0;
  // Positions cached so far.
  virtual int64_t length() const = 0;
  virtual int64_t vocab_size() const = 0;
  // Empties the cache: the next forward_step starts at position 0.
  virtual void reset() = 0;
  // Appends `tokens` (one pass however many: a prompt is prefilled at once) at positions
  // length().. and returns the logits that follow the last of them, valid until the next
  // call. length() + tokens.size() must not exceed context().
  virtual std::span<const float> forward_step(std::span<const int32_t> tokens) = 0;
  // "cpu" or the GPU's name, for the start-up line.
  virtual std::string device() const = 0;
};

// Decoding on the CPU with the training model's own layers (Transformer::forward_cached).
class CpuDecoder final : public Decoder {
 public:
  // `model` must outlive the decoder.
  explicit CpuDecoder(const Transformer<float>& model)
      : model_(model), cache_(model.config(), model.config().seq_len),
        logits_V_(static_cast<size_t>(model.config().vocab_size)) {}
  int64_t context() const override { return cache_.capacity(); }
  int64_t length() const override { return cache_.length(); }
  int64_t vocab_size() const override { return static_cast<int64_t>(logits_V_.size()); }
  void reset() override { cache_.clear(); }
  std::span<const float> forward_step(std::span<const int32_t> tokens) override {
    model_.forward_cached(tokens.data(), static_cast<int64_t>(tokens.size()), cache_, logits_V_.data());
    return logits_V_;
  }
  std::string device() const override { return "cpu"; }

 private:
  const Transformer<float>& model_;
  KvCache<float> cache_;
  std::vector<float> logits_V_;
};

}  // namespace moe

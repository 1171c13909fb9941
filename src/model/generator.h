// Text generation over a Decoder: the prompt prefilled in one pass, then one sampled token
// at a time through the KV cache. Past the context (model.seq_len) the window slides: the
// newest half of the tokens is re-encoded from position 0 (docs/GENERATION.md).
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "model/decoder.h"
#include "model/sampler.h"

namespace moe {

struct GenerateOptions {
  int64_t max_tokens = 256;    // new tokens at most
  SamplingOptions sampling;
  uint64_t seed = 0;           // step i draws CounterRng(seed, "generate").uniform(i)
  std::optional<int32_t> eos;  // stop when this token is sampled (it is not emitted)
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // the continuation, without the prompt
  bool stopped_at_eos = false;
  int64_t slides = 0;           // times the window slid
};

// The prompt must hold 1 ..= decoder.context() tokens. on_token sees each new token as
// soon as it is sampled (streaming).
GenerateResult generate(Decoder& decoder, std::span<const int32_t> prompt, const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token = {});

}  // namespace moe

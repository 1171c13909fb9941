#include "model/generator.h"

#include <algorithm>

#include "core/error.h"
#include "core/rng.h"

namespace moe {

GenerateResult generate(Decoder& decoder, std::span<const int32_t> prompt, const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token) {
  const auto prompt_tokens = static_cast<int64_t>(prompt.size());
  MOE_CHECK(prompt_tokens >= 1 && prompt_tokens <= decoder.context(),
            "a prompt of {} tokens for a context of {} (1 ..= context)", prompt_tokens, decoder.context());
  MOE_CHECK(options.max_tokens >= 0, "max_tokens {} < 0", options.max_tokens);
  check_sampling_options(options.sampling);
  const CounterRng rng(options.seed, "generate");
  std::vector<int32_t> history(prompt.begin(), prompt.end());
  GenerateResult result;
  decoder.reset();
  std::span<const float> logits = decoder.forward_step(prompt);
  for (int64_t step = 0; step < options.max_tokens; ++step) {
    const int32_t token = sample_token(logits, options.sampling, rng.uniform(static_cast<uint64_t>(step)));
    if (options.eos && token == *options.eos) {
      result.stopped_at_eos = true;
      break;
    }
    result.tokens.push_back(token);
    history.push_back(token);
    if (on_token) on_token(token);
    if (step + 1 == options.max_tokens) break;  // no need for the logits after the last token
    if (decoder.length() < decoder.context()) {
      logits = decoder.forward_step(std::span<const int32_t>(&history.back(), 1));
      continue;
    }
    // The cache is full: slide the window by re-encoding the newest half at positions 0..,
    // which keeps RoPE positions within those trained, at one prefill per context / 2 tokens.
    const auto keep = static_cast<size_t>(std::max<int64_t>(1, decoder.context() / 2));
    decoder.reset();
    logits = decoder.forward_step(std::span<const int32_t>(history).last(keep));
    ++result.slides;
  }
  return result;
}

}  // namespace moe

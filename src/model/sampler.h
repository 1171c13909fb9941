// Choosing the next token from logits: temperature, then top-k, then top-p (nucleus),
// then a draw with a given uniform number; temperature 0 is greedy. The rules are in
// docs/GENERATION.md.
#pragma once
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace moe {

struct SamplingOptions {
  double temperature = 1.0;  // 0: greedy (the most likely token, the lowest id among ties)
  int64_t top_k = 0;         // keep the k most likely tokens; 0: all
  double top_p = 1.0;        // then the smallest most-likely-first set whose mass reaches p, in (0, 1]
};

// Throws ConfigError naming the option when a value is out of range (temperature < 0 or
// not finite, top_k < 0, top_p outside (0, 1]).
void check_sampling_options(const SamplingOptions& options);

// The distribution a draw picks from: (token, probability) of the tokens kept, most likely
// first (ties: the lower id first), probabilities summing to 1. Greedy: the argmax alone.
std::vector<std::pair<int32_t, double>> sampling_distribution(std::span<const float> logits,
                                                              const SamplingOptions& options);

// A token from sampling_distribution(logits, options) by inverse CDF at `uniform` in (0, 1)
// (most likely tokens first), so one uniform number per step makes a seeded run repeatable.
int32_t sample_token(std::span<const float> logits, const SamplingOptions& options, double uniform);

}  // namespace moe

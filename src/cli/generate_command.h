// `moe generate`: text sampled from a checkpoint with a KV cache (docs/GENERATION.md),
// callable from tests without a process.
#pragma once
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace moe {

struct GenerateCommandOptions {
  std::string checkpoint;                  // checkpoint.dir/step_N
  std::optional<std::string> prompt;       // exactly one of prompt / prompt_file
  std::optional<std::string> prompt_file;
  int64_t max_tokens = 200;
  double temperature = 0.8;  // 0: greedy
  int64_t top_k = 0;         // 0: every token
  double top_p = 0.95;
  uint64_t seed = 0;
  std::string device = "auto";  // cpu | gpu | auto
  std::vector<std::string> overrides;  // "section.key=value", over the checkpoint's config
};

// Writes the prompt and then each token's text as it is sampled (flushed) to `out`, and
// what was loaded and how fast it ran to `log`. Bad options are ConfigErrors (exit code 2).
int run_generate(const GenerateCommandOptions& options, std::ostream& out, std::ostream& log);

}  // namespace moe

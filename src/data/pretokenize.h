// Pre-tokenisation: splitting text into the pieces BPE merges within. Each supported
// pattern is matched by hand (no regex engine), alternative by alternative, with the
// same leftmost-first results as the regexes below under Oniguruma, which HF tokenizers uses.
#pragma once
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace moe {

enum class PretokPattern {
  Gpt2,    // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  Llama3,  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  Qwen2,   // as Llama3 with \p{N} instead of \p{N}{1,3}
};

// The regex text of a pattern, as it appears in a tokenizer.json Split pre-tokenizer.
std::string_view pattern_regex(PretokPattern pattern);
// The pattern whose regex text is `regex`, if it is one we implement.
std::optional<PretokPattern> pattern_from_regex(std::string_view regex);
// "gpt2", "llama3", "qwen2".
std::string_view pattern_name(PretokPattern pattern);
std::optional<PretokPattern> pattern_from_name(std::string_view name);

// Appends the end offset (in bytes) of every piece of `text` (well-formed UTF-8) to `ends`.
// The pieces cover the text: piece i is [ends[i-1], ends[i]).
void pretokenize(std::string_view text, PretokPattern pattern, std::vector<uint32_t>& ends);

}  // namespace moe

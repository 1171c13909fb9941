#include "data/pretokenize.h"

#include <array>

#include "data/unicode.h"

namespace moe {
namespace {

using unicode::CharClass;

constexpr std::array<std::string_view, 3> kRegexes = {
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
};
constexpr std::array<std::string_view, 3> kNames = {"gpt2", "llama3", "qwen2"};

// The text as code points with their classes and byte offsets, decoded once per call into
// buffers that are kept per thread (they only grow).
struct Chars {
  std::vector<char32_t> cp;
  std::vector<uint8_t> cls;
  std::vector<uint32_t> offset;  // n + 1 entries: byte offset of each code point, then the end
  size_t n = 0;

  void decode(std::string_view text) {
    static const std::array<uint8_t, 128> ascii = [] {
      std::array<uint8_t, 128> table{};
      for (char32_t c = 0; c < 128; ++c) table[c] = unicode::char_class(c);
      return table;
    }();
    if (offset.size() < text.size() + 1) {
      cp.resize(text.size()), cls.resize(text.size()), offset.resize(text.size() + 1);
    }
    n = 0;
    size_t pos = 0;
    while (pos < text.size()) {
      const auto b = static_cast<unsigned char>(text[pos]);
      offset[n] = static_cast<uint32_t>(pos);
      if (b < 0x80) {
        cp[n] = b, cls[n] = ascii[b], ++pos;
      } else {
        int len = 1;
        const char32_t c = unicode::decode_at(text, pos, len);
        cp[n] = c, cls[n] = unicode::char_class(c), pos += static_cast<size_t>(len);
      }
      ++n;
    }
    offset[n] = static_cast<uint32_t>(text.size());
  }
  size_t size() const { return n; }
};

bool is_ws(uint8_t c) { return c == unicode::kSpace || c == unicode::kNewline; }

// 's|'t|'re|'ve|'m|'ll|'d at i: the match length, or 0. Case-insensitive matching folds
// as Oniguruma does: S and the long s U+017F match s.
size_t contraction(const Chars& s, size_t i, bool ignore_case) {
  if (s.cp[i] != '\'' || i + 1 >= s.size()) return 0;
  auto lower = [&](size_t k) -> char32_t {
    if (k >= s.size()) return 0;
    char32_t c = s.cp[k];
    if (!ignore_case) return c;
    if (c >= 'A' && c <= 'Z') return c + 32;
    if (c == 0x17f) return 's';
    return c;
  };
  char32_t a = lower(i + 1);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  char32_t b = lower(i + 2);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// End of the run of code points of class `c` starting at i.
size_t run_end(const Chars& s, size_t i, auto&& pred) {
  while (i < s.size() && pred(s.cls[i])) ++i;
  return i;
}

// \s+(?!\S) then \s+ at i (s.cls[i] is whitespace): the end of the match.
size_t whitespace_tail(const Chars& s, size_t i) {
  size_t j = run_end(s, i, is_ws);
  if (j == s.size()) return j;         // the run reaches the end: all of it
  return j - 1 > i ? j - 1 : j;        // leave the last space to prefix the next piece
}

size_t match_gpt2(const Chars& s, size_t i) {
  if (size_t n = contraction(s, i, false)) return i + n;
  size_t j = i + (s.cp[i] == ' ' && i + 1 < s.size() ? 1 : 0);
  const uint8_t c = s.cls[j];
  if (c == unicode::kLetter || c == unicode::kNumber || c == unicode::kOther)
    return run_end(s, j, [c](uint8_t x) { return x == c; });
  return whitespace_tail(s, i);  // j == i here: s[i] is whitespace
}

size_t match_llama3(const Chars& s, size_t i, size_t max_digits) {
  if (size_t n = contraction(s, i, true)) return i + n;
  const uint8_t c = s.cls[i];
  auto letter = [](uint8_t x) { return x == unicode::kLetter; };
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (c == unicode::kLetter) return run_end(s, i, letter);
  if ((c == unicode::kSpace || c == unicode::kOther) && i + 1 < s.size() && s.cls[i + 1] == unicode::kLetter)
    return run_end(s, i + 1, letter);
  // \p{N}{1,max}
  if (c == unicode::kNumber) {
    size_t j = i;
    while (j < s.size() && j - i < max_digits && s.cls[j] == unicode::kNumber) ++j;
    return j;
  }
  //  ?[^\s\p{L}\p{N}]+[\r\n]*
  size_t j = i + (s.cp[i] == ' ' && i + 1 < s.size() ? 1 : 0);
  if (s.cls[j] == unicode::kOther) {
    j = run_end(s, j, [](uint8_t x) { return x == unicode::kOther; });
    return run_end(s, j, [](uint8_t x) { return x == unicode::kNewline; });
  }
  // \s*[\r\n]+ : up to and including the last newline of the whitespace run.
  size_t end = run_end(s, i, is_ws);
  for (size_t k = end; k > i; --k)
    if (s.cls[k - 1] == unicode::kNewline) return k;
  return whitespace_tail(s, i);
}

}  // namespace

std::string_view pattern_regex(PretokPattern pattern) { return kRegexes[static_cast<size_t>(pattern)]; }
std::string_view pattern_name(PretokPattern pattern) { return kNames[static_cast<size_t>(pattern)]; }

std::optional<PretokPattern> pattern_from_regex(std::string_view regex) {
  for (size_t i = 0; i < kRegexes.size(); ++i)
    if (kRegexes[i] == regex) return static_cast<PretokPattern>(i);
  return std::nullopt;
}

std::optional<PretokPattern> pattern_from_name(std::string_view name) {
  for (size_t i = 0; i < kNames.size(); ++i)
    if (kNames[i] == name) return static_cast<PretokPattern>(i);
  return std::nullopt;
}

void pretokenize(std::string_view text, PretokPattern pattern, std::vector<uint32_t>& ends) {
  thread_local Chars chars;
  chars.decode(text);
  size_t i = 0;
  while (i < chars.size()) {
    switch (pattern) {
      case PretokPattern::Gpt2: i = match_gpt2(chars, i); break;
      case PretokPattern::Llama3: i = match_llama3(chars, i, 3); break;
      case PretokPattern::Qwen2: i = match_llama3(chars, i, 1); break;
    }
    ends.push_back(chars.offset[i]);
  }
}

}  // namespace moe

// Unicode helpers for the BPE tokenizer: UTF-8 repair, the character classes the
// pre-tokeniser regexes need (\p{L}, \p{N}, \s), and NFC. Properties come from
// utf8proc (Debian libutf8proc-dev).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace moe::unicode {

// The classes the GPT-2 / Llama-3 / Qwen2 pre-tokeniser patterns distinguish.
enum CharClass : uint8_t {
  kOther = 0,    // [^\s\p{L}\p{N}]
  kLetter = 1,   // \p{L}
  kNumber = 2,   // \p{N}
  kSpace = 3,    // \s other than \r and \n
  kNewline = 4,  // \r or \n
};

// Class of a code point (0 ..= 0x10FFFF), from a table built once on first use.
CharClass char_class(char32_t cp);

// True iff `text` is well-formed UTF-8 (no surrogates, overlongs or values past U+10FFFF).
bool is_valid_utf8(std::string_view text);

// Replaces each maximal ill-formed subsequence with U+FFFD, exactly as Python's
// bytes.decode("utf-8", errors="replace") and Rust's String::from_utf8_lossy do.
std::string repair_utf8(std::string_view text);

// Decodes the code point at text[pos] of well-formed UTF-8; sets `len` to its byte length.
inline char32_t decode_at(std::string_view text, size_t pos, int& len) {
  auto b0 = static_cast<unsigned char>(text[pos]);
  if (b0 < 0x80) return len = 1, b0;
  auto cont = [&](size_t i) { return static_cast<char32_t>(static_cast<unsigned char>(text[pos + i]) & 0x3f); };
  if (b0 < 0xe0) return len = 2, (static_cast<char32_t>(b0 & 0x1f) << 6) | cont(1);
  if (b0 < 0xf0) return len = 3, (static_cast<char32_t>(b0 & 0x0f) << 12) | (cont(1) << 6) | cont(2);
  return len = 4, (static_cast<char32_t>(b0 & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
}

// NFC of well-formed UTF-8 (Qwen2's normalizer).
std::string nfc(std::string_view text);

}  // namespace moe::unicode

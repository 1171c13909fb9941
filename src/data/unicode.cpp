#include "data/unicode.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>
#include <vector>

#include "core/error.h"

namespace moe::unicode {
namespace {

constexpr char32_t kMaxCodePoint = 0x10FFFF;

// \s as Oniguruma (the regex engine of HF tokenizers) defines it: Unicode White_Space.
bool is_white_space(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0d) || cp == 0x20 || cp == 0x85 || cp == 0xa0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 || cp == 0x202f || cp == 0x205f ||
         cp == 0x3000;
}

std::vector<uint8_t> build_table() {
  std::vector<uint8_t> table(kMaxCodePoint + 1);
  for (char32_t cp = 0; cp <= kMaxCodePoint; ++cp) {
    CharClass c = kOther;
    if (cp == '\r' || cp == '\n') c = kNewline;
    else if (is_white_space(cp)) c = kSpace;
    else {
      switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
        case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
        case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: c = kLetter; break;
        case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO: c = kNumber; break;
        default: break;
      }
    }
    table[cp] = c;
  }
  return table;
}

// Length of the maximal well-formed prefix of a sequence starting at text[pos] when it is
// ill-formed (>= 1), or 0 when text[pos] starts a well-formed sequence of length `len`.
size_t ill_formed_length(std::string_view text, size_t pos, int& len) {
  auto at = [&](size_t i) { return static_cast<unsigned char>(text[pos + i]); };
  const unsigned char b0 = at(0);
  if (b0 < 0x80) return len = 1, 0;
  unsigned char lo = 0x80, hi = 0xbf;  // allowed range of the second byte (Unicode Table 3-7)
  if (b0 >= 0xc2 && b0 <= 0xdf) len = 2;
  else if (b0 >= 0xe0 && b0 <= 0xef) {
    len = 3;
    if (b0 == 0xe0) lo = 0xa0;
    if (b0 == 0xed) hi = 0x9f;
  } else if (b0 >= 0xf0 && b0 <= 0xf4) {
    len = 4;
    if (b0 == 0xf0) lo = 0x90;
    if (b0 == 0xf4) hi = 0x8f;
  } else {
    return 1;  // a continuation byte or a byte that never starts a sequence
  }
  for (int i = 1; i < len; ++i) {
    if (pos + i >= text.size()) return i;
    const unsigned char b = at(i);
    const bool ok = i == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xbf);
    if (!ok) return i;
  }
  return 0;
}

}  // namespace

CharClass char_class(char32_t cp) {
  static const std::vector<uint8_t> table = build_table();
  return cp <= kMaxCodePoint ? static_cast<CharClass>(table[cp]) : kOther;
}

bool is_valid_utf8(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    if (static_cast<unsigned char>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    int len = 0;
    if (ill_formed_length(text, pos, len) != 0) return false;
    pos += len;
  }
  return true;
}

std::string repair_utf8(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 16);
  size_t pos = 0;
  while (pos < text.size()) {
    int len = 0;
    size_t bad = ill_formed_length(text, pos, len);
    if (bad == 0) {
      out.append(text.substr(pos, len));
      pos += len;
    } else {
      out.append("\xef\xbf\xbd");  // U+FFFD
      pos += bad;
    }
  }
  return out;
}

std::string nfc(std::string_view text) {
  utf8proc_uint8_t* result = nullptr;
  utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                    static_cast<utf8proc_ssize_t>(text.size()), &result,
                                    static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) MOE_THROW("NFC normalisation failed: {}", utf8proc_errmsg(n));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owner(result, &std::free);
  return std::string(reinterpret_cast<const char*>(result), static_cast<size_t>(n));
}

}  // namespace moe::unicode

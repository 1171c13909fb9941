// The spelling of each configuration enum in TOML files and messages. One table per enum
// (next to the enum, as `enum_names(Enum)`), read by the parser, config_to_toml and
// name_of: a value cannot be parseable but not printable.
#pragma once
#include <span>
#include <string_view>

namespace moe {

template <class E>
struct EnumName {
  E value;
  std::string_view name;
};

// The name of `value` as written in a config file ("?" for a value outside the table).
template <class E>
constexpr std::string_view name_of(E value) {
  for (const EnumName<E>& entry : enum_names(E{}))
    if (entry.value == value) return entry.name;
  return "?";
}

// True and `out` set when `text` is one of E's names.
template <class E>
constexpr bool parse_enum(std::string_view text, E& out) {
  for (const EnumName<E>& entry : enum_names(E{}))
    if (entry.name == text) {
      out = entry.value;
      return true;
    }
  return false;
}

}  // namespace moe

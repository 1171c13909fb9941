// bfloat16 storage type: the upper 16 bits of an IEEE float, rounded to nearest even.
#pragma once
#include <cstdint>
#include <cstring>

namespace moe {

struct bf16 {
  uint16_t bits = 0;
};

inline bf16 float_to_bf16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    // NaN: keep it a (quiet) NaN even when the payload sits only in the low bits.
    return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  }
  // Round to nearest, ties to even: add 0x7fff plus the lowest kept bit.
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>((u + rounding_bias) >> 16)};
}

inline float bf16_to_float(bf16 value) {
  uint32_t u = static_cast<uint32_t>(value.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace moe

// Counter-based randomness (Philox4x32-10). A value depends only on (seed, stream name,
// element index), so initial weights are the same on any device, thread count, rank
// count or allocation order.
#pragma once
#include <array>
#include <cstdint>
#include <string_view>

namespace moe {

uint64_t fnv1a64(std::string_view text);

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

class CounterRng {
 public:
  CounterRng(uint64_t seed, std::string_view stream);
  // Four independent 32-bit words for one counter value.
  std::array<uint32_t, 4> bits(uint64_t index) const;
  // Uniform in (0, 1), never exactly 0 or 1.
  double uniform(uint64_t index) const;
  // Standard normal by Box-Muller from the words of counter `index`.
  double normal(uint64_t index) const;

 private:
  std::array<uint32_t, 2> key_;
  uint64_t counter_hi_;
};

// Fill `out[0..count)` with normal(0, std) values keyed by (seed, name, element).
template <typename T>
void fill_normal(T* out, int64_t count, uint64_t seed, std::string_view name, double stddev);

}  // namespace moe

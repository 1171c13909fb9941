// Inputs shared by the MoE routing tests.
#pragma once
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "core/rng.h"

namespace moe::test {

// T x E values whose rows are a random permutation of base + step * {0, 1, ..., E-1}, plus
// noise of at most step / 10. Neighbouring values in a row differ by >= 0.8 * step, so
// finite-difference steps never change a top-k choice.
inline std::vector<double> separated_rows(int64_t T_, int64_t E, uint64_t seed,
                                          const std::string& name, double base, double step) {
  CounterRng rng(seed, name);
  std::vector<double> out(static_cast<size_t>(T_ * E));
  std::vector<int64_t> order(static_cast<size_t>(E));
  std::vector<double> keys(static_cast<size_t>(E));
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t e = 0; e < E; ++e) keys[e] = rng.uniform(uint64_t(2 * (t * E + e)));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return keys[a] < keys[b]; });
    for (int64_t rank = 0; rank < E; ++rank) {
      const double noise = (rng.uniform(uint64_t(2 * (t * E + rank) + 1)) - 0.5) * 0.2 * step;
      out[t * E + order[rank]] = base + step * double(rank) + noise;
    }
  }
  return out;
}

template <typename To, typename From>
std::vector<To> cast_vector(const std::vector<From>& v) {
  return std::vector<To>(v.begin(), v.end());
}

}  // namespace moe::test

#include "core/rng.h"

#include <cmath>

namespace moe {

uint64_t fnv1a64(std::string_view text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = static_cast<uint64_t>(kMul0) * ctr[0];
    uint64_t p1 = static_cast<uint64_t>(kMul1) * ctr[2];
    uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    ctr = {hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0};
    key[0] += kWeyl0;
    key[1] += kWeyl1;
  }
  return ctr;
}

CounterRng::CounterRng(uint64_t seed, std::string_view stream) {
  uint64_t name_hash = fnv1a64(stream);
  key_ = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  // The stream name goes into the counter's upper words so different names never collide
  // with the same seed.
  counter_hi_ = name_hash;
}

std::array<uint32_t, 4> CounterRng::bits(uint64_t index) const {
  return philox4x32({static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                     static_cast<uint32_t>(counter_hi_), static_cast<uint32_t>(counter_hi_ >> 32)},
                    key_);
}

double CounterRng::uniform(uint64_t index) const {
  auto w = bits(index);
  uint64_t x = (static_cast<uint64_t>(w[0]) << 21) ^ w[1];  // 53 random bits
  x &= (1ull << 53) - 1;
  return (static_cast<double>(x) + 0.5) / 9007199254740992.0;
}

double CounterRng::normal(uint64_t index) const {
  auto w = bits(index);
  uint64_t a = ((static_cast<uint64_t>(w[0]) << 21) ^ w[1]) & ((1ull << 53) - 1);
  uint64_t b = ((static_cast<uint64_t>(w[2]) << 21) ^ w[3]) & ((1ull << 53) - 1);
  double u1 = (static_cast<double>(a) + 0.5) / 9007199254740992.0;
  double u2 = (static_cast<double>(b) + 0.5) / 9007199254740992.0;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

template <typename T>
void fill_normal(T* out, int64_t count, uint64_t seed, std::string_view name, double stddev) {
  CounterRng rng(seed, name);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i)
    out[i] = static_cast<T>(stddev * rng.normal(static_cast<uint64_t>(i)));
}

template void fill_normal<float>(float*, int64_t, uint64_t, std::string_view, double);
template void fill_normal<double>(double*, int64_t, uint64_t, std::string_view, double);

}  // namespace moe

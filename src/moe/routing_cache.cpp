#include "moe/routing_cache.h"

#include <algorithm>
#include <array>
#include <numeric>

#include "core/error.h"

namespace moe {
namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

constexpr uint32_t kAgeAt = 1u << 16;  // a key's counts are halved when one reaches this

}  // namespace

RoutingCache::Counts::Counts() {
  std::fill(std::begin(expert), std::end(expert), -1);
  std::fill(std::begin(count), std::end(count), 0u);
}

void RoutingCache::Counts::add(int32_t e) {
  int free = -1, least = 0;
  for (int s = 0; s < kSlots; ++s) {
    if (expert[s] == e) {
      if (++count[s] >= kAgeAt)
        for (uint32_t& c : count) c /= 2;
      return;
    }
    if (count[s] == 0 && free < 0) free = s;
    if (count[s] < count[least]) least = s;
  }
  // Space-saving: a new expert takes a free slot, or the least counted one's count + 1.
  const int s = free >= 0 ? free : least;
  count[s] = free >= 0 ? 1u : count[s] + 1u;
  expert[s] = e;
}

RoutingCache::RoutingCache(int64_t n_experts, int64_t top_k, int64_t predict_k, int64_t max_keys)
    : E_(n_experts), K_(top_k), P_(predict_k), max_keys_(max_keys), overall_E_(static_cast<size_t>(n_experts), 0) {
  MOE_CHECK(E_ > 0 && K_ > 0 && K_ <= E_, "routing cache: top_k {} of {} experts", K_, E_);
  MOE_CHECK(P_ >= K_ && P_ <= E_, "routing cache: predict_k {} must be in [top_k {}, n_experts {}]", P_, K_, E_);
  MOE_CHECK(max_keys_ >= 0, "routing cache: max_keys {} < 0", max_keys_);
}

uint64_t RoutingCache::set_key(const int32_t* experts_K) const {
  std::array<int32_t, 16> sorted{};
  const int64_t k = std::min<int64_t>(K_, static_cast<int64_t>(sorted.size()));
  std::copy(experts_K, experts_K + k, sorted.begin());
  std::sort(sorted.begin(), sorted.begin() + k);
  uint64_t key = static_cast<uint64_t>(K_);
  for (int64_t i = 0; i < k; ++i) key = mix(key ^ static_cast<uint64_t>(sorted[static_cast<size_t>(i)]));
  return key;
}

void RoutingCache::predict(const int32_t* tokens_T, const int32_t* prev_TK, int64_t T, int32_t* pred_TP) const {
  // The fallback order: every expert by how often layer l+1 chose it (ties: lower id).
  std::vector<int32_t> overall(static_cast<size_t>(E_));
  std::iota(overall.begin(), overall.end(), 0);
  std::stable_sort(overall.begin(), overall.end(),
                   [&](int32_t a, int32_t b) { return overall_E_[static_cast<size_t>(a)] > overall_E_[static_cast<size_t>(b)]; });
  std::vector<char> taken(static_cast<size_t>(E_), 0);
  for (int64_t t = 0; t < T; ++t) {
    int32_t* pred_P = pred_TP + t * P_;
    int64_t n = 0;
    auto take = [&](int32_t e) {
      if (n < P_ && e >= 0 && e < E_ && !taken[static_cast<size_t>(e)]) {
        taken[static_cast<size_t>(e)] = 1;
        pred_P[n++] = e;
      }
    };
    auto take_counts = [&](const Counts& c) {
      std::array<int, kSlots> order{};
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int a, int b) {
        return c.count[a] != c.count[b] ? c.count[a] > c.count[b] : c.expert[a] < c.expert[b];
      });
      for (int s : order)
        if (c.count[s] > 0) take(c.expert[s]);
    };
    const uint64_t set = set_key(prev_TK + t * K_);
    if (auto it = by_token_.find(mix(set ^ mix(static_cast<uint64_t>(tokens_T[t])))); it != by_token_.end())
      take_counts(it->second);
    if (auto it = by_set_.find(set); it != by_set_.end()) take_counts(it->second);
    for (int32_t e : overall) take(e);
    for (int64_t i = 0; i < n; ++i) taken[static_cast<size_t>(pred_P[i])] = 0;
  }
}

void RoutingCache::observe(const int32_t* tokens_T, const int32_t* prev_TK, const int32_t* next_TK, int64_t T) {
  for (int64_t t = 0; t < T; ++t) {
    const uint64_t set = set_key(prev_TK + t * K_);
    const uint64_t token_key = mix(set ^ mix(static_cast<uint64_t>(tokens_T[t])));
    auto it = by_token_.find(token_key);
    if (it == by_token_.end() && static_cast<int64_t>(by_token_.size()) < max_keys_)
      it = by_token_.emplace(token_key, Counts{}).first;
    Counts& by_set = by_set_[set];
    for (int64_t k = 0; k < K_; ++k) {
      const int32_t e = next_TK[t * K_ + k];
      if (e < 0 || e >= E_) continue;
      if (it != by_token_.end()) it->second.add(e);
      by_set.add(e);
      ++overall_E_[static_cast<size_t>(e)];
    }
  }
}

void RoutingCache::step(const int32_t* tokens_T, const int32_t* prev_TK, const int32_t* next_TK, int64_t T) {
  std::vector<int32_t> pred_TP(static_cast<size_t>(T * P_));
  predict(tokens_T, prev_TK, T, pred_TP.data());
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* pred_P = pred_TP.data() + t * P_;
    int64_t hit = 0;
    for (int64_t k = 0; k < K_; ++k)
      hit += std::find(pred_P, pred_P + P_, next_TK[t * K_ + k]) != pred_P + P_ ? 1 : 0;
    hits_.assignments += K_;
    hits_.hits += hit;
    hits_.tokens += 1;
    hits_.tokens_hit += hit == K_ ? 1 : 0;
  }
  observe(tokens_T, prev_TK, next_TK, T);
}

}  // namespace moe

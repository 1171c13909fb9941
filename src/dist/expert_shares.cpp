#include "dist/expert_shares.h"

#include <algorithm>

#include "core/error.h"

namespace moe::dist {

ExpertShares::ExpertShares(const ParameterStore<float>& params, int ranks, int rank)
    : params_(params), ranks_(ranks), rank_(rank) {
  MOE_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "expert shares: rank {} of {}", rank, ranks);
}

ExpertShares::Share ExpertShares::share(int id, int r) const {
  const int64_t n = per_expert(id);
  const int64_t padded = (n + ranks_ - 1) / ranks_;
  const int64_t begin = std::min(n, r * padded);
  return {begin, std::min(n, begin + padded) - begin, padded};
}

int64_t ExpertShares::per_rank(const std::vector<int>& ids, const std::vector<int64_t>& experts) const {
  int64_t n = 0;
  for (int id : ids) n += share(id, 0).padded * static_cast<int64_t>(experts.size());
  return n;
}

void ExpertShares::pack(const std::vector<int>& ids, const std::vector<int64_t>& experts,
                        const std::vector<float*>& data_of_id, int r, float* out) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t n = per_expert(ids[i]);
    const Share part = share(ids[i], r);
    for (int64_t expert : experts) {
      std::copy_n(data_of_id[i] + expert * n + part.begin, part.count, out);
      std::fill(out + part.count, out + part.padded, 0.0f);
      out += part.padded;
    }
  }
}

void ExpertShares::unpack(const std::vector<int>& ids, const std::vector<int64_t>& experts, const float* in, int r,
                          const std::vector<float*>& data_of_id) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t n = per_expert(ids[i]);
    const Share part = share(ids[i], r);
    for (int64_t expert : experts) {
      std::copy_n(in, part.count, data_of_id[i] + expert * n + part.begin);
      in += part.padded;
    }
  }
}

RangeList ExpertShares::others(const std::vector<int>& ids, const std::vector<int64_t>& experts) const {
  RangeList ranges;
  for (int id : ids) {
    const int64_t n = per_expert(id);
    const Share own = mine(id);
    for (int64_t expert : experts) {
      const int64_t slice = params_.offset(id) + expert * n;
      ranges.push_back({slice, own.begin});
      ranges.push_back({slice + own.begin + own.count, n - own.begin - own.count});
    }
  }
  return merge_ranges(std::move(ranges));
}

}  // namespace moe::dist

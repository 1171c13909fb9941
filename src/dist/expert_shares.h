// ZeRO over the expert replicas on CPU ranks (docs/EXPERT_PARALLEL.md section 4): the
// experts only one EP rank computes are cut into shares over the ranks that replicate
// them (the expert-data-parallel group). One expert's slice of an expert tensor (n
// elements) is cut into equal shares, one per rank: rank r's share is elements
// [r * padded, r * padded + count) of the slice, padded = ceil(n / ranks), the last ones
// shorter or empty. A layer's sharded experts travel packed rank-major: rank r's shares of
// every (tensor, expert) in turn, each padded to `padded`, so that one reduce-scatter or
// all-gather of the packed block leaves each rank its own shares or everyone's.
#pragma once
#include <cstdint>
#include <vector>

#include "core/range.h"
#include "model/parameters.h"

namespace moe::dist {

class ExpertShares {
 public:
  struct Share {
    int64_t begin = 0, count = 0, padded = 0;  // inside one expert's slice
  };
  ExpertShares(const ParameterStore<float>& params, int ranks, int rank);

  int ranks() const { return ranks_; }
  int rank() const { return rank_; }
  // Elements of one expert's slice of tensor id (leading dim: experts).
  int64_t per_expert(int id) const { return params_.numel(id) / params_.spec(id).shape[0]; }
  Share share(int id, int r) const;
  Share mine(int id) const { return share(id, rank_); }
  // Elements of one rank's part of the packed block of `experts` of tensors `ids`.
  int64_t per_rank(const std::vector<int>& ids, const std::vector<int64_t>& experts) const;
  // Rank r's shares of `experts` of tensors ids[i] (first element at data_of_id[i]) to
  // `out` (per_rank elements, padding zero), and back from `in`.
  void pack(const std::vector<int>& ids, const std::vector<int64_t>& experts, const std::vector<float*>& data_of_id,
            int r, float* out) const;
  void unpack(const std::vector<int>& ids, const std::vector<int64_t>& experts, const float* in, int r,
              const std::vector<float*>& data_of_id) const;
  // The other ranks' shares of `experts` of tensors `ids`, as sorted ranges of the
  // parameter block (what a rank releases).
  RangeList others(const std::vector<int>& ids, const std::vector<int64_t>& experts) const;

 private:
  const ParameterStore<float>& params_;
  int ranks_, rank_;
};

}  // namespace moe::dist

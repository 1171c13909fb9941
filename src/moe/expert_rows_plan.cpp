#include "moe/expert_rows_plan.h"

#include <limits>

#include "core/error.h"

namespace moe {

std::vector<int64_t> equal_slot_bounds(int64_t n_experts, int P) {
  MOE_CHECK(P >= 1, "expert rows plan: {} EP ranks", P);
  MOE_CHECK(n_experts % P == 0 && n_experts > 0, "expert rows plan: {} experts do not split over {} EP ranks",
            n_experts, P);
  std::vector<int64_t> bounds(static_cast<size_t>(P) + 1);
  for (int p = 0; p <= P; ++p) bounds[static_cast<size_t>(p)] = p * (n_experts / P);
  return bounds;
}

ExpertRowsPlan plan_expert_rows(const std::vector<int32_t>& kept_E, const std::vector<int32_t>& recv_counts_PL,
                                int P) {
  return plan_expert_rows(kept_E, recv_counts_PL, equal_slot_bounds(static_cast<int64_t>(kept_E.size()), P), 0);
}

ExpertRowsPlan plan_expert_rows(const std::vector<int32_t>& kept_E, const std::vector<int32_t>& recv_counts_PL,
                                const std::vector<int64_t>& first_slot_P1, int rank) {
  const int P = static_cast<int>(first_slot_P1.size()) - 1;
  const int64_t E = static_cast<int64_t>(kept_E.size());
  MOE_CHECK(P >= 1 && rank >= 0 && rank < P, "expert rows plan: rank {} of {} EP ranks", rank, P);
  MOE_CHECK(first_slot_P1.front() == 0 && first_slot_P1.back() == E,
            "expert rows plan: slot bounds {}..{} for {} experts", first_slot_P1.front(), first_slot_P1.back(), E);
  for (int p = 0; p < P; ++p)
    MOE_CHECK(first_slot_P1[static_cast<size_t>(p)] <= first_slot_P1[static_cast<size_t>(p) + 1],
              "expert rows plan: slot bounds fall at EP rank {}", p);
  const int64_t first = first_slot_P1[static_cast<size_t>(rank)];
  const int64_t L = first_slot_P1[static_cast<size_t>(rank) + 1] - first;
  MOE_CHECK(static_cast<int64_t>(recv_counts_PL.size()) == P * L,
            "expert rows plan: {} received counts for {} ranks x {} local experts", recv_counts_PL.size(), P, L);
  for (int32_t c : kept_E) MOE_CHECK(c >= 0, "expert rows plan: negative kept count {}", c);
  for (int32_t c : recv_counts_PL) MOE_CHECK(c >= 0, "expert rows plan: negative received count {}", c);

  ExpertRowsPlan plan;
  plan.send_rows_P.assign(static_cast<size_t>(P), 0);
  plan.recv_rows_P.assign(static_cast<size_t>(P), 0);
  for (int p = 0; p < P; ++p) {
    for (int64_t slot = first_slot_P1[static_cast<size_t>(p)]; slot < first_slot_P1[static_cast<size_t>(p) + 1]; ++slot)
      plan.send_rows_P[static_cast<size_t>(p)] += kept_E[static_cast<size_t>(slot)];
    for (int64_t l = 0; l < L; ++l)
      plan.recv_rows_P[static_cast<size_t>(p)] += recv_counts_PL[static_cast<size_t>(p * L + l)];
  }
  plan.local_offsets_L1.assign(static_cast<size_t>(L + 1), 0);
  int64_t total = 0;
  for (int64_t l = 0; l < L; ++l) {
    for (int p = 0; p < P; ++p) total += recv_counts_PL[static_cast<size_t>(p * L + l)];
    MOE_CHECK(total <= std::numeric_limits<int32_t>::max(), "expert rows plan: {} rows exceed int32", total);
    plan.local_offsets_L1[static_cast<size_t>(l + 1)] = static_cast<int32_t>(total);
  }
  plan.source_of_local.assign(static_cast<size_t>(total), 0);
  plan.local_of_source.assign(static_cast<size_t>(total), 0);
  // Walk the received (source-major) order; place each row at its expert-major position.
  std::vector<int64_t> next_local(plan.local_offsets_L1.begin(), plan.local_offsets_L1.end() - 1);
  int64_t received = 0;
  for (int p = 0; p < P; ++p)
    for (int64_t l = 0; l < L; ++l)
      for (int32_t i = 0; i < recv_counts_PL[static_cast<size_t>(p * L + l)]; ++i, ++received) {
        const int64_t local = next_local[static_cast<size_t>(l)]++;
        plan.source_of_local[static_cast<size_t>(local)] = static_cast<int32_t>(received);
        plan.local_of_source[static_cast<size_t>(received)] = static_cast<int32_t>(local);
      }
  return plan;
}

}  // namespace moe

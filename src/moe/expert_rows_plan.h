// Where an MoE layer's rows go under expert parallelism, for the GPU path. Experts are
// numbered by slot: EP rank p computes the contiguous slots [first_slot_P1[p],
// first_slot_P1[p + 1]) (equal blocks of L = E / P without re-placement; any counts,
// zero included, after a re-placement by load relabels the experts into slots):
//   send      this rank's kept rows, sorted by slot (the dispatch layout), so the rows for
//             peer p are one contiguous block: rows of p's slots;
//   receive   from each source rank s, its block for us, itself sorted by our local slot:
//             "source-major" order (source, local slot, row);
//   compute   the grouped GEMMs want "expert-major" order (local slot, source, row).
// The plan holds the row counts each way and the two gathers between the received order
// and the expert-major one (each the inverse of the other).
#pragma once
#include <cstdint>
#include <vector>

namespace moe {

struct ExpertRowsPlan {
  std::vector<int64_t> send_rows_P;   // rows this rank sends to each EP peer
  std::vector<int64_t> recv_rows_P;   // rows it receives from each
  std::vector<int32_t> local_offsets_L1;  // expert-major offsets of the local experts' rows (L + 1)
  // local row r (expert-major) is received row source_of_local[r] (source-major), and
  // received row i is local row local_of_source[i].
  std::vector<int32_t> source_of_local, local_of_source;
  int64_t local_rows() const { return local_offsets_L1.empty() ? 0 : local_offsets_L1.back(); }
};

// kept_E: this rank's kept rows per slot (E values); first_slot_P1: the P + 1 slot bounds
// of the EP ranks (0 first, E last, never falling); rank: ours; recv_counts_PL: rows each
// source rank keeps for each of our L local slots (source after source, P * L values).
// Throws on a negative count or sizes that do not match.
ExpertRowsPlan plan_expert_rows(const std::vector<int32_t>& kept_E, const std::vector<int32_t>& recv_counts_PL,
                                const std::vector<int64_t>& first_slot_P1, int rank);
// Equal blocks: rank p computes slots [p L, (p + 1) L), L = E / P (P must divide E).
ExpertRowsPlan plan_expert_rows(const std::vector<int32_t>& kept_E, const std::vector<int32_t>& recv_counts_PL,
                                int P);
// The slot bounds of equal blocks (P + 1 values); P must divide E.
std::vector<int64_t> equal_slot_bounds(int64_t n_experts, int P);

}  // namespace moe

// Where an MoE layer's rows go under expert parallelism with contiguous placement (EP rank
// p computes experts [p * L, (p + 1) * L), L = n_experts / P), for the GPU path:
//   send      this rank's kept rows, sorted by global expert (the dispatch layout), so the
//             rows for peer p are one contiguous block: rows of experts p * L .. p * L + L - 1;
//   receive   from each source rank s, its block for us, itself sorted by our local expert:
//             "source-major" order (source, local expert, row);
//   compute   the grouped GEMMs want "expert-major" order (local expert, source, row).
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

// kept_E: this rank's kept rows per global expert (E = P * L values); recv_counts_PL: rows
// each source rank keeps for each of our L local experts (source after source). Throws on a
// negative count or an expert count that P does not divide.
ExpertRowsPlan plan_expert_rows(const std::vector<int32_t>& kept_E, const std::vector<int32_t>& recv_counts_PL,
                                int P);

}  // namespace moe

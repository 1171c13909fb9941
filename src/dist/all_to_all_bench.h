// `moe a2a-bench`: the MoE layer's two exchanges alone (dispatch: each rank sends its
// tokens' rows to the experts' ranks; combine: the rows come back), at a config's token
// counts over its parallel.* process groups, flat and hierarchical. Reports milliseconds
// and GB/s per rank (bytes this rank sends to other ranks / time; median over iterations
// of the slowest rank's time) and checks every received row.
#pragma once
#include <ostream>

#include "config/run_config.h"

namespace moe::dist {

class Communicator;

struct AllToAllBenchResult {
  AllToAllKind kind = AllToAllKind::Flat;
  double dispatch_ms = 0, combine_ms = 0;
  double dispatch_gb_per_s = 0, combine_gb_per_s = 0;  // per rank, bytes to other ranks
  bool rows_ok = false;
  int ranks = 0, nodes = 0;          // of the EP group
  double off_rank_bytes = 0;         // per rank per dispatch, to other ranks
};

// Collective over world. Rows per rank: training.micro_batch x model.seq_len tokens x
// model.moe.top_k, model.dim bf16 each, spread evenly over the EP group
// (parallel.expert_parallel ranks; 1 or less: the whole world). Rank 0 prints the table.
std::vector<AllToAllBenchResult> run_all_to_all_bench(const RunConfig& config, Communicator& world, int warmup,
                                                      int iters, std::ostream& out);

}  // namespace moe::dist

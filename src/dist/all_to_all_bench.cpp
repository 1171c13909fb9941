#include "dist/all_to_all_bench.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/comm_util.h"
#include "dist/communicator.h"
#include "dist/hierarchical_all_to_all.h"
#include "dist/process_groups.h"

namespace moe::dist {
namespace {

// The bf16 bit pattern a row element carries from `source` to `dest`: any wrong, missing or
// misplaced element shows.
uint16_t pattern(int source, int dest, int64_t index) {
  return static_cast<uint16_t>((static_cast<uint64_t>(source) * 7919 + static_cast<uint64_t>(dest) * 104729 +
                                static_cast<uint64_t>(index) * 31) & 0x7fff);
}

// Max over ranks of host values (through device memory for nccl).
void max_over_ranks(Communicator& comm, std::vector<double>& values) {
  all_reduce_host(comm, values.data(), values.size(), DType::f64, ReduceOp::max);
}

struct Exchange {
  std::vector<int64_t> send_counts, recv_counts;  // elements per EP peer
  int64_t send_total = 0, recv_total = 0, off_rank_bytes = 0;
};

// Rows spread evenly over the P ranks: peer p gets rows / P, the first rows % P one more.
Exchange even_exchange(int64_t rows, int64_t dim, int P, int me) {
  Exchange x;
  for (int p = 0; p < P; ++p) {
    const int64_t to_p = (rows / P + (p < rows % P ? 1 : 0)) * dim;
    const int64_t from_p = (rows / P + (me < rows % P ? 1 : 0)) * dim;  // every rank sends as we do
    x.send_counts.push_back(to_p);
    x.recv_counts.push_back(from_p);
    x.send_total += to_p;
    x.recv_total += from_p;
    if (p != me) x.off_rank_bytes += to_p * 2;
  }
  return x;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

std::vector<AllToAllBenchResult> run_all_to_all_bench(const RunConfig& config, Communicator& world, int warmup,
                                                      int iters, std::ostream& out) {
  MOE_CHECK(iters > 0, "a2a-bench: --iters must be positive, got {}", iters);
  MOE_CHECK(warmup >= 0, "a2a-bench: --warmup must not be negative, got {}", warmup);
  const ModelConfig& mc = config.model;
  const int ep = config.parallel.expert_parallel > 1 ? static_cast<int>(config.parallel.expert_parallel) : world.size();
  ProcessGroups groups = make_process_groups(world, ep);
  Communicator& group = *groups.expert_parallel;
  const int P = group.size(), me = group.rank();
  const int64_t tokens = config.training.micro_batch * mc.seq_len, K = std::max<int64_t>(1, mc.moe.top_k);
  const int64_t rows = tokens * K, D = mc.dim;
  const Exchange dispatch = even_exchange(rows, D, P, me);
  // Combine sends back what dispatch brought: the same counts the other way.
  Exchange combine;
  combine.send_counts = dispatch.recv_counts;
  combine.recv_counts = dispatch.send_counts;
  combine.send_total = dispatch.recv_total;
  combine.recv_total = dispatch.send_total;
  for (int p = 0; p < P; ++p)
    if (p != me) combine.off_rank_bytes += combine.send_counts[p] * 2;

  // Send blocks packed by peer, element i of the block for peer p = pattern(me, p, i).
  std::vector<uint16_t> host_send(static_cast<size_t>(dispatch.send_total));
  int64_t at = 0;
  for (int p = 0; p < P; at += dispatch.send_counts[p], ++p)
    for (int64_t i = 0; i < dispatch.send_counts[p]; ++i) host_send[static_cast<size_t>(at + i)] = pattern(me, p, i);
  const size_t buffer_bytes = static_cast<size_t>(std::max(dispatch.send_total, dispatch.recv_total)) * 2;
  std::shared_ptr<void> send = group.allocate(buffer_bytes), recv = group.allocate(buffer_bytes),
                        back = group.allocate(buffer_bytes);
  group.copy(send.get(), host_send.data(), host_send.size() * 2);
  group.synchronize();

  if (world.rank() == 0)
    fmt::print(out,
               "a2a-bench: backend {}, {} ranks, EP groups of {} ({} node(s) of {} ranks); per rank {} tokens x top-{} = "
               "{} rows of {} bf16: {:.3f} MB per exchange, {:.3f} MB of it to other ranks; median of {} after {} "
               "warm-up, the slowest rank's time\n",
               world.backend(), world.size(), P, groups.n_nodes, groups.ranks_per_node, tokens, K, rows, D,
               dispatch.send_total * 2 / 1e6, dispatch.off_rank_bytes / 1e6, iters, warmup);

  std::vector<AllToAllBenchResult> results;
  for (const AllToAllKind kind : {AllToAllKind::Flat, AllToAllKind::Hierarchical}) {
    std::unique_ptr<AllToAll> a2a = make_all_to_all(kind, group, groups);
    std::vector<double> dispatch_s, combine_s;
    for (int it = 0; it < warmup + iters; ++it) {
      group.barrier();
      auto t0 = std::chrono::steady_clock::now();
      a2a->exchange(send.get(), dispatch.send_counts, recv.get(), dispatch.recv_counts, DType::bf16);
      group.synchronize();
      auto t1 = std::chrono::steady_clock::now();
      group.barrier();
      auto t2 = std::chrono::steady_clock::now();
      a2a->exchange(recv.get(), combine.send_counts, back.get(), combine.recv_counts, DType::bf16);
      group.synchronize();
      auto t3 = std::chrono::steady_clock::now();
      if (it >= warmup) {
        dispatch_s.push_back(std::chrono::duration<double>(t1 - t0).count());
        combine_s.push_back(std::chrono::duration<double>(t3 - t2).count());
      }
    }
    max_over_ranks(group, dispatch_s);
    max_over_ranks(group, combine_s);

    // What arrived: block from peer p holds pattern(p, me, i); after the round trip, send's bytes.
    std::vector<uint16_t> host_recv(static_cast<size_t>(dispatch.recv_total)), host_back(host_send.size());
    group.copy(host_recv.data(), recv.get(), host_recv.size() * 2);
    group.copy(host_back.data(), back.get(), host_back.size() * 2);
    group.synchronize();
    double ok = 1.0;
    int64_t from = 0;
    for (int p = 0; p < P; from += dispatch.recv_counts[p], ++p)
      for (int64_t i = 0; i < dispatch.recv_counts[p] && ok > 0; ++i)
        if (host_recv[static_cast<size_t>(from + i)] != pattern(p, me, i)) ok = 0.0;
    if (host_back != host_send) ok = 0.0;
    std::vector<double> not_ok{1.0 - ok};
    max_over_ranks(group, not_ok);

    AllToAllBenchResult r;
    r.kind = kind;
    r.dispatch_ms = median(dispatch_s) * 1e3;
    r.combine_ms = median(combine_s) * 1e3;
    r.dispatch_gb_per_s = dispatch.off_rank_bytes / 1e9 / (r.dispatch_ms / 1e3);
    r.combine_gb_per_s = combine.off_rank_bytes / 1e9 / (r.combine_ms / 1e3);
    r.rows_ok = not_ok[0] == 0.0;
    r.ranks = P;
    r.nodes = P > groups.ranks_per_node ? P / groups.ranks_per_node : 1;
    r.off_rank_bytes = static_cast<double>(dispatch.off_rank_bytes);
    if (world.rank() == 0)
      fmt::print(out, "  {:<13} dispatch {:8.3f} ms {:8.2f} GB/s per rank | combine {:8.3f} ms {:8.2f} GB/s per rank | "
                      "rows {}\n",
                 name_of(kind), r.dispatch_ms, r.dispatch_gb_per_s, r.combine_ms, r.combine_gb_per_s,
                 r.rows_ok ? "checked" : "WRONG");
    results.push_back(r);
  }
  for (const AllToAllBenchResult& r : results)
    MOE_CHECK(r.rows_ok, "a2a-bench: the {} exchange delivered wrong rows", name_of(r.kind));
  return results;
}

}  // namespace moe::dist

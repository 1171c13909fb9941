#include "dist/expert_exchange.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "dist/hierarchical_all_to_all.h"
#include "moe/token_exchange.h"

namespace moe::dist {

void BatchGroupOverComm::sum(double* values, int64_t count) {
  if (comm_.size() == 1) return;
  timed_blocking(stats_, [&] { comm_.all_reduce(values, static_cast<size_t>(count), DType::f64, ReduceOp::sum); });
}

void BatchGroupOverComm::all_gather(const int64_t* values, int64_t count, int64_t* all) {
  timed_blocking(stats_, [&] { comm_.all_gather(values, all, static_cast<size_t>(count), DType::i64); });
}

ExpertExchangeOverComm::ExpertExchangeOverComm(AllToAll& a2a, const ExpertPlacement& placement, int chunks,
                                               CommStats& stats)
    : a2a_(a2a), placement_(placement), chunks_(chunks), stats_(stats) {
  MOE_CHECK(chunks >= 1, "all-to-all chunks must be at least 1, got {}", chunks);
  me_ = a2a_.group().rank();
  peers_ = a2a_.group().size();
  MOE_CHECK(placement_.ep_size() == peers_, "expert placement over {} ranks used in an expert-parallel group of {}",
            placement_.ep_size(), peers_);
}

int64_t ExpertExchangeOverComm::plan(const int32_t* counts_E, const int32_t* offsets_E1) {
  const auto C = static_cast<int64_t>(chunks_);
  // Chunk c of n rows: [n c / C, n (c + 1) / C).
  auto slice = [&](int64_t n, int64_t c) { return std::make_pair(n * c / C, n * (c + 1) / C); };
  // Counts message to peer p: (chunk, slot of p) -> rows.
  std::vector<int64_t> send_counts(static_cast<size_t>(peers_)), recv_counts(static_cast<size_t>(peers_));
  std::vector<int64_t> send_msg;
  for (int p = 0; p < peers_; ++p) {
    const auto& held = placement_.experts_of(p);
    send_counts[static_cast<size_t>(p)] = C * static_cast<int64_t>(held.size());
    for (int64_t c = 0; c < C; ++c)
      for (int64_t e : held) {
        const auto [lo, hi] = slice(counts_E[e], c);
        send_msg.push_back(hi - lo);
      }
  }
  const auto& mine = placement_.experts_of(me_);
  const auto slots = static_cast<int64_t>(mine.size());
  std::fill(recv_counts.begin(), recv_counts.end(), C * slots);
  std::vector<int64_t> recv_msg(static_cast<size_t>(C * slots * peers_));
  timed_blocking(stats_, [&] { a2a_.exchange(send_msg.data(), send_counts, recv_msg.data(), recv_counts, DType::i64); });

  chunk_plans_.assign(static_cast<size_t>(C), ChunkPlan{});
  int64_t received = 0;
  for (int64_t c = 0; c < C; ++c) {
    ChunkPlan& plan = chunk_plans_[static_cast<size_t>(c)];
    plan.send_rows_to.assign(static_cast<size_t>(peers_), 0);
    plan.recv_rows_from.assign(static_cast<size_t>(peers_), 0);
    for (int p = 0; p < peers_; ++p)
      for (int64_t e : placement_.experts_of(p)) {
        const auto [lo, hi] = slice(counts_E[e], c);
        for (int64_t r = offsets_E1[e] + lo; r < offsets_E1[e] + hi; ++r) plan.send_rows.push_back(static_cast<int32_t>(r));
        plan.send_rows_to[static_cast<size_t>(p)] += hi - lo;
      }
    plan.recv_first = received;
    for (int r = 0; r < peers_; ++r)
      for (int64_t s = 0; s < slots; ++s) {
        const int64_t n = recv_msg[static_cast<size_t>((r * C + c) * slots + s)];
        plan.segments.push_back({mine[static_cast<size_t>(s)], received, n});
        plan.recv_rows_from[static_cast<size_t>(r)] += n;
        received += n;
      }
    plan.recv_rows = received - plan.recv_first;
  }
  return received;
}

void ExpertExchangeOverComm::run(const void* in_RD, void* recv_RD, const void* result_RD, void* out_RD,
                                 int64_t width, size_t elem_bytes, const std::function<void(int chunk)>& compute) {
  MOE_CHECK(elem_bytes == 4 || elem_bytes == 8, "expert exchange of {}-byte values", elem_bytes);
  const DType dtype = elem_bytes == 4 ? DType::f32 : DType::f64;
  const size_t row_bytes = static_cast<size_t>(width) * elem_bytes;
  const auto* in = static_cast<const char*>(in_RD);
  auto* recv = static_cast<char*>(recv_RD);
  const auto* result = static_cast<const char*>(result_RD);
  auto* out = static_cast<char*>(out_RD);
  auto elements = [&](const std::vector<int64_t>& rows) {
    std::vector<int64_t> counts(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) counts[i] = rows[i] * width;
    return counts;
  };
  auto remote_bytes = [&](const std::vector<int64_t>& rows) {
    int64_t bytes = 0;
    for (int p = 0; p < peers_; ++p)
      if (p != me_) bytes += rows[static_cast<size_t>(p)] * static_cast<int64_t>(row_bytes);
    return bytes;
  };
  // Everything an exchange in flight points at lives until the end of run().
  struct Flight {
    std::vector<char> send, back;
    std::vector<int64_t> send_counts, recv_counts, back_send_counts, back_recv_counts;
    std::unique_ptr<Work> dispatch, combine;
    CommClock::time_point dispatch_issued, combine_issued;
  };
  std::vector<Flight> flights(static_cast<size_t>(chunks_));
  auto issue = [&](auto&& start) {
    const auto t0 = CommClock::now();
    auto work = start();
    stats_.wait_s += seconds_between(t0, CommClock::now());  // a blocking implementation (hierarchical) waits here
    ++stats_.a2a_exchanges;
    return work;
  };
  auto finish = [&](Work& work, CommClock::time_point issued) {
    timed_wait(work, stats_);
    stats_.a2a_s += seconds_between(issued, CommClock::now());
  };
  auto start_dispatch = [&](int c) {
    const ChunkPlan& plan = chunk_plans_[static_cast<size_t>(c)];
    Flight& f = flights[static_cast<size_t>(c)];
    f.send.resize(plan.send_rows.size() * row_bytes);
    for (size_t i = 0; i < plan.send_rows.size(); ++i)
      std::memcpy(f.send.data() + i * row_bytes, in + static_cast<size_t>(plan.send_rows[i]) * row_bytes, row_bytes);
    f.send_counts = elements(plan.send_rows_to);
    f.recv_counts = elements(plan.recv_rows_from);
    stats_.a2a_bytes += remote_bytes(plan.send_rows_to);
    f.dispatch_issued = CommClock::now();
    f.dispatch = issue([&] {
      return a2a_.exchange_async(f.send.data(), f.send_counts, recv + static_cast<size_t>(plan.recv_first) * row_bytes,
                                 f.recv_counts, dtype);
    });
  };
  start_dispatch(0);
  for (int c = 0; c < chunks_; ++c) {
    if (c + 1 < chunks_) start_dispatch(c + 1);
    Flight& f = flights[static_cast<size_t>(c)];
    const ChunkPlan& plan = chunk_plans_[static_cast<size_t>(c)];
    finish(*f.dispatch, f.dispatch_issued);
    compute(c);
    f.back.resize(plan.send_rows.size() * row_bytes);
    f.back_send_counts = f.recv_counts;
    f.back_recv_counts = f.send_counts;
    stats_.a2a_bytes += remote_bytes(plan.recv_rows_from);
    f.combine_issued = CommClock::now();
    f.combine = issue([&] {
      return a2a_.exchange_async(result + static_cast<size_t>(plan.recv_first) * row_bytes, f.back_send_counts,
                                 f.back.data(), f.back_recv_counts, dtype);
    });
  }
  for (int c = 0; c < chunks_; ++c) {
    Flight& f = flights[static_cast<size_t>(c)];
    const ChunkPlan& plan = chunk_plans_[static_cast<size_t>(c)];
    finish(*f.combine, f.combine_issued);
    for (size_t i = 0; i < plan.send_rows.size(); ++i)
      std::memcpy(out + static_cast<size_t>(plan.send_rows[i]) * row_bytes, f.back.data() + i * row_bytes, row_bytes);
  }
}

}  // namespace moe::dist

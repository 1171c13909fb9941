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

ExpertExchangeOverComm::ExpertExchangeOverComm(AllToAll& a2a, int chunks, CommStats& stats, int ep_ranks_per_node)
    : a2a_(a2a), chunks_(chunks), stats_(stats), ep_ranks_per_node_(ep_ranks_per_node) {
  MOE_CHECK(chunks >= 1, "all-to-all chunks must be at least 1, got {}", chunks);
  me_ = a2a_.group().rank();
  peers_ = a2a_.group().size();
}

int64_t ExpertExchangeOverComm::remote_bytes(const std::vector<int64_t>& bytes_P) const {
  int64_t bytes = 0;
  for (int p = 0; p < peers_; ++p)
    if (p != me_) bytes += bytes_P[static_cast<size_t>(p)];
  return bytes;
}

int64_t ExpertExchangeOverComm::off_node_bytes(const std::vector<int64_t>& bytes_P) const {
  if (ep_ranks_per_node_ <= 0) return 0;
  int64_t bytes = 0;
  for (int p = 0; p < peers_; ++p)
    if (p / ep_ranks_per_node_ != me_ / ep_ranks_per_node_) bytes += bytes_P[static_cast<size_t>(p)];
  return bytes;
}

void ExpertExchangeOverComm::blocked(double seconds, bool dispatch) {
  stats_.wait_s += seconds;
  wait_s_ += seconds;
  if (dispatch) dispatch_wait_s_ += seconds;
}

void ExpertExchangeOverComm::all_gather(const int32_t* values, int64_t count, int32_t* all) {
  const auto t0 = CommClock::now();
  a2a_.group().all_gather(values, all, static_cast<size_t>(count), DType::i32);
  const double s = seconds_between(t0, CommClock::now());
  blocked(s, dispatching());
  stats_.a2a_s += s;
  stats_.a2a_bytes += count * int64_t{sizeof(int32_t)} * (peers_ - 1);
  ++stats_.a2a_exchanges;
}

void ExpertExchangeOverComm::exchange(const void* send, const std::vector<int64_t>& send_bytes_P, void* recv,
                                      const std::vector<int64_t>& recv_bytes_P) {
  const auto t0 = CommClock::now();
  a2a_.exchange(send, send_bytes_P, recv, recv_bytes_P, DType::u8);
  const double s = seconds_between(t0, CommClock::now());
  blocked(s, dispatching());
  stats_.a2a_s += s;
  stats_.a2a_bytes += remote_bytes(send_bytes_P);
  stats_.a2a_off_node_bytes += off_node_bytes(send_bytes_P);
  ++stats_.a2a_exchanges;
}

// An exchange_async with its byte counts kept alive; wait() counts the time blocked.
class ExpertExchangeOverComm::InFlight final : public ExchangeInFlight {
 public:
  InFlight(ExpertExchangeOverComm& owner, std::vector<int64_t> send_bytes_P, std::vector<int64_t> recv_bytes_P)
      : owner_(owner), send_bytes_P_(std::move(send_bytes_P)), recv_bytes_P_(std::move(recv_bytes_P)) {}
  void start(const void* send, void* recv) {
    issued_ = CommClock::now();
    work_ = owner_.a2a_.exchange_async(send, send_bytes_P_, recv, recv_bytes_P_, DType::u8);
    // a blocking implementation (hierarchical) waits here
    owner_.blocked(seconds_between(issued_, CommClock::now()), owner_.dispatching());
  }
  void wait() override {
    if (!work_) return;
    const auto t0 = CommClock::now();
    work_->wait();
    const auto t1 = CommClock::now();
    owner_.blocked(seconds_between(t0, t1), owner_.dispatching());
    owner_.stats_.a2a_s += seconds_between(issued_, t1);
    work_.reset();
  }
  ~InFlight() override {
    if (work_) work_->wait();  // never leave the transport writing into freed buffers
  }

 private:
  ExpertExchangeOverComm& owner_;
  std::vector<int64_t> send_bytes_P_, recv_bytes_P_;
  std::unique_ptr<Work> work_;
  CommClock::time_point issued_;
};

std::unique_ptr<ExchangeInFlight> ExpertExchangeOverComm::start_exchange(const void* send,
                                                                         const std::vector<int64_t>& send_bytes_P,
                                                                         void* recv,
                                                                         const std::vector<int64_t>& recv_bytes_P) {
  stats_.a2a_bytes += remote_bytes(send_bytes_P);
  stats_.a2a_off_node_bytes += off_node_bytes(send_bytes_P);
  ++stats_.a2a_exchanges;
  auto flight = std::make_unique<InFlight>(*this, send_bytes_P, recv_bytes_P);
  flight->start(send, recv);
  return flight;
}

void ExpertExchangeOverComm::round_trip(const void* send, const std::vector<int64_t>& send_rows_P, void* recv,
                                        const std::vector<int64_t>& recv_rows_P, const void* result, void* back,
                                        size_t row_bytes, const std::function<void(int chunk)>& compute) {
  MOE_CHECK(send != nullptr, "expert exchange: a round trip without rows to send");
  trip(send, send_rows_P, recv, recv_rows_P, result, back, row_bytes, compute);
}

void ExpertExchangeOverComm::return_trip(const std::vector<int64_t>& send_rows_P,
                                         const std::vector<int64_t>& recv_rows_P, const void* result, void* back,
                                         size_t row_bytes, const std::function<void(int chunk)>& compute) {
  trip(nullptr, send_rows_P, nullptr, recv_rows_P, result, back, row_bytes, compute);
}

void ExpertExchangeOverComm::trip(const void* send, const std::vector<int64_t>& send_rows_P, void* recv,
                                  const std::vector<int64_t>& recv_rows_P, const void* result, void* back,
                                  size_t row_bytes, const std::function<void(int chunk)>& compute) {
  const bool rows_out = send != nullptr;
  const auto P = static_cast<size_t>(peers_);
  MOE_CHECK(send_rows_P.size() == P && recv_rows_P.size() == P, "expert exchange: row counts for {} and {} peers of {}",
            send_rows_P.size(), recv_rows_P.size(), P);
  const auto bytes = static_cast<int64_t>(row_bytes);
  auto starts = [](const std::vector<int64_t>& rows_P) {
    std::vector<int64_t> start(rows_P.size() + 1, 0);
    for (size_t p = 0; p < rows_P.size(); ++p) start[p + 1] = start[p] + rows_P[p];
    return start;
  };
  const std::vector<int64_t> send_start = starts(send_rows_P), recv_start = starts(recv_rows_P);
  // Chunk c of each block, in bytes: (offset in the whole buffer, size), packed by peer.
  struct Pieces {
    std::vector<int64_t> at_P, bytes_P;
    int64_t total = 0;
  };
  auto pieces = [&](const std::vector<int64_t>& rows_P, const std::vector<int64_t>& start, int c) {
    Pieces out;
    for (size_t p = 0; p < P; ++p) {
      const auto [lo, hi] = chunk_of_block(rows_P[p], c, chunks_);
      out.at_P.push_back((start[p] + lo) * bytes);
      out.bytes_P.push_back((hi - lo) * bytes);
      out.total += (hi - lo) * bytes;
    }
    return out;
  };
  auto pack = [&](std::vector<char>& to, const void* from, const Pieces& where) {
    to.resize(static_cast<size_t>(where.total));
    int64_t at = 0;
    for (size_t p = 0; p < P; ++p) {
      if (where.bytes_P[p] > 0)  // an empty vector's data() may be null: memcpy's pointers must not be
        std::memcpy(to.data() + at, static_cast<const char*>(from) + where.at_P[p],
                    static_cast<size_t>(where.bytes_P[p]));
      at += where.bytes_P[p];
    }
  };
  auto unpack = [&](void* to, const std::vector<char>& from, const Pieces& where) {
    int64_t at = 0;
    for (size_t p = 0; p < P; ++p) {
      if (where.bytes_P[p] > 0)
        std::memcpy(static_cast<char*>(to) + where.at_P[p], from.data() + at, static_cast<size_t>(where.bytes_P[p]));
      at += where.bytes_P[p];
    }
  };
  // Everything an exchange in flight points at lives until the end of round_trip().
  struct Flight {
    Pieces out, in;
    std::vector<char> send, recv, result, back;
    std::unique_ptr<Work> dispatch, combine;
    CommClock::time_point dispatch_issued, combine_issued;
  };
  std::vector<Flight> flights(static_cast<size_t>(chunks_));
  // Waits for the rows count as the dispatch's while dispatching(); for results never.
  auto issue = [&](auto&& start, bool rows) {
    const auto t0 = CommClock::now();
    auto work = start();
    blocked(seconds_between(t0, CommClock::now()), rows && dispatching());  // a blocking implementation (hierarchical) waits here
    ++stats_.a2a_exchanges;
    return work;
  };
  auto finish = [&](Work& work, CommClock::time_point issued, bool rows) {
    const auto t0 = CommClock::now();
    work.wait();
    const auto t1 = CommClock::now();
    blocked(seconds_between(t0, t1), rows && dispatching());
    stats_.a2a_s += seconds_between(issued, t1);
  };
  auto start_dispatch = [&](int c) {
    Flight& f = flights[static_cast<size_t>(c)];
    f.out = pieces(send_rows_P, send_start, c);
    f.in = pieces(recv_rows_P, recv_start, c);
    pack(f.send, send, f.out);
    f.recv.resize(static_cast<size_t>(f.in.total));
    stats_.a2a_bytes += remote_bytes(f.out.bytes_P);
    stats_.a2a_off_node_bytes += off_node_bytes(f.out.bytes_P);
    f.dispatch_issued = CommClock::now();
    f.dispatch = issue([&] { return a2a_.exchange_async(f.send.data(), f.out.bytes_P, f.recv.data(), f.in.bytes_P, DType::u8); },
                       true);
  };
  if (rows_out) start_dispatch(0);
  for (int c = 0; c < chunks_; ++c) {
    Flight& f = flights[static_cast<size_t>(c)];
    if (rows_out) {
      if (c + 1 < chunks_) start_dispatch(c + 1);
      finish(*f.dispatch, f.dispatch_issued, true);
      unpack(recv, f.recv, f.in);
    } else {
      f.out = pieces(send_rows_P, send_start, c);
      f.in = pieces(recv_rows_P, recv_start, c);
    }
    compute(c);
    pack(f.result, result, f.in);
    f.back.resize(static_cast<size_t>(f.out.total));
    stats_.a2a_bytes += remote_bytes(f.in.bytes_P);
    stats_.a2a_off_node_bytes += off_node_bytes(f.in.bytes_P);
    f.combine_issued = CommClock::now();
    f.combine = issue([&] { return a2a_.exchange_async(f.result.data(), f.in.bytes_P, f.back.data(), f.out.bytes_P, DType::u8); },
                      false);
  }
  for (int c = 0; c < chunks_; ++c) {
    Flight& f = flights[static_cast<size_t>(c)];
    finish(*f.combine, f.combine_issued, false);
    unpack(back, f.back, f.out);
  }
}

}  // namespace moe::dist

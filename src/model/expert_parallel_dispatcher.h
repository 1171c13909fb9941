// The routed experts of one MoE layer under expert parallelism on the CPU, with the GPU
// path's semantics (docs/EXPERT_PARALLEL.md sections 2-4): each token goes once to every
// EP rank computing at least one of its kept assignments, with its K routing entries
// (slot in that rank's window or -1, combine weight); that rank lays out the rows of its
// window's slots, runs their SwiGLU experts and returns one partial combine per token;
// home adds the partials in rank order. Backward mirrors it. The planning is
// moe/token_exchange.h's reference functions, so the CPU and the GPU kernels share one
// oracle. The bytes travel through ExpertExchange (over a communicator in
// dist/expert_exchange.h; over threads in the tests).
//
// Numerics: a partial combine is combine_forward over the rank's own entries (double
// sums, k order, rounded to T once); home sums the partials in T in rank order
// (sum_token_rows, as the GPU kernel sums in fp32). The partials travel in T, so a double
// sum at home would only save the last P - 1 roundings, at the price of a second oracle.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "model/parameters.h"
#include "moe/expert_slots.h"
#include "moe/speculative_exchange.h"
#include "moe/token_exchange.h"

namespace moe {

// An exchange started by ExpertExchange::start_exchange; wait() returns once its receive
// buffer may be read (the buffers must live until then).
class ExchangeInFlight {
 public:
  virtual ~ExchangeInFlight() = default;
  virtual void wait() = 0;
};

// Expert parallelism's transport over the EP group: all-to-alls of bytes packed by peer.
// One per MoE layer.
class ExpertExchange {
 public:
  virtual ~ExpertExchange() = default;
  virtual int size() const = 0;  // EP ranks
  virtual int rank() const = 0;
  virtual int chunks() const = 0;  // parallel.a2a_chunks
  // all = every EP rank's `count` values, rank 0's first (blocking).
  virtual void all_gather(const int32_t* values, int64_t count, int32_t* all) = 0;
  // send and recv packed by peer, sizes in bytes (blocking).
  virtual void exchange(const void* send, const std::vector<int64_t>& send_bytes_P, void* recv,
                        const std::vector<int64_t>& recv_bytes_P) = 0;
  // Rows out and results back in chunks(): `send` holds a block of send_rows_P[p] rows for
  // each peer p (one after the other), `recv` gets a block from each peer. Chunk c of every
  // block (moe::chunk_of_block) is one exchange; compute(c) runs once chunk c of every
  // block has arrived and fills the same rows of `result`, which go back to `back` at the
  // rows they came from. Exchanges of other chunks may be in flight during compute(c).
  virtual void round_trip(const void* send, const std::vector<int64_t>& send_rows_P, void* recv,
                          const std::vector<int64_t>& recv_rows_P, const void* result, void* back, size_t row_bytes,
                          const std::function<void(int chunk)>& compute) = 0;
  // Non-blocking exchange(): every EP rank starts it in the same order. The default runs
  // it at once (a blocking transport, such as the tests' threads).
  virtual std::unique_ptr<ExchangeInFlight> start_exchange(const void* send, const std::vector<int64_t>& send_bytes_P,
                                                           void* recv, const std::vector<int64_t>& recv_bytes_P);
  // round_trip() for rows that have already arrived in its `recv` (a speculative
  // dispatch): compute(c) for each chunk, then chunk c's results go back. The default
  // sends each chunk's results with a blocking exchange().
  virtual void return_trip(const std::vector<int64_t>& send_rows_P, const std::vector<int64_t>& recv_rows_P,
                           const void* result, void* back, size_t row_bytes,
                           const std::function<void(int chunk)>& compute);
  // Set by the dispatcher while a forward's rows are on their way out (from the first
  // exchange of its plan until the rows for compute have arrived), so that a transport
  // can count that blocked time apart (dist::ExpertExchangeOverComm::take_dispatch_wait_s).
  void set_dispatching(bool on) { dispatching_ = on; }
  bool dispatching() const { return dispatching_; }
  // Whether this layer's token rows travel as fp8 e4m3 rows with a per-row scale
  // (core/fp8.h; parallel.a2a_compression): set by the trainer, identical on every EP
  // rank, read at each forward (the backward keeps the forward's choice).
  void set_fp8(bool on) { fp8_ = on; }
  bool fp8() const { return fp8_; }

 private:
  bool fp8_ = false;
  bool dispatching_ = false;
};

// A MoE layer's routing at home, rows laid out by slot (assign_rows on slot_TK).
template <typename T>
struct HomeRouting {
  int64_t tokens = 0;
  const int32_t* slot_TK = nullptr;     // the slot of each assignment
  const T* weight_TK = nullptr;         // combine weights
  const int32_t* row_TK = nullptr;      // row in the slot layout, -1 when dropped
  const int32_t* counts_S = nullptr;    // kept rows per slot
  const int32_t* offsets_S1 = nullptr;  // their prefix sums
};

// The expert weights of one MoE layer, [E, F, D] (w1, w3) and [E, D, F] (w2), in expert order.
struct ExpertWeightIds {
  int w1 = -1, w3 = -1, w2 = -1;
};

template <typename T>
class ExpertParallelDispatcher {
 public:
  ExpertParallelDispatcher(ParameterStore<T>& params, ExpertWeightIds ids, int64_t dim, int64_t hidden, int64_t top_k,
                           ExpertExchange& exchange, const ExpertSlots& slots);
  // y_TD = the sum over the EP ranks of their partial combines (overwritten). Returns the
  // rows this rank's window computed.
  int64_t forward(T* y_TD, const T* x_TD, const HomeRouting<T>& home);
  // dx_TD (overwritten) and dweight_TK from dy_TD = d loss / d y_TD; adds the window's
  // expert weight gradients. Uses the forward's plan.
  void backward(T* dx_TD, T* dweight_TK, const T* dy_TD);

  // Speculative dispatch (moe.speculative_dispatch, docs/ROUTING_CACHE.md). speculate(),
  // once the MoE layer before has routed: pred_slot_TQ, Q guessed slots for each of the
  // next forward's T tokens; the sizes of the blocks sent early start towards the peers.
  // send_speculative(), as soon as the forward's input x_TD is known (before the router):
  // the guessed tokens' rows start. The forward then sends only the corrections with its
  // plan and rebuilds the exact blocks, so its results are bit for bit those without.
  // Every EP rank speculates for the same forwards (they issue the same exchanges).
  void speculate(const int32_t* pred_slot_TQ, int64_t tokens, int64_t Q);
  void send_speculative(const T* x_TD);
  bool speculating() const { return spec_armed_; }
  // The last forward's speculation (zeros when it did not speculate).
  const SpeculationRows& speculation_rows() const { return spec_rows_; }

 private:
  // x_TD: the forward's input (a speculating forward sends its corrections with the plan).
  void plan_exchange(const HomeRouting<T>& home, const T* x_TD);
  // The token rows as they travel (fp8 wire rows or the values), row t at t * row_bytes().
  const uint8_t* wire_rows(const T* x_TD);
  int64_t row_bytes() const;
  void experts_forward(int chunk);
  void experts_backward(int chunk);
  // f(u, n): the received tokens [u, u + n) of chunk c, one range per source.
  template <class F>
  void for_chunk_tokens(int chunk, F&& f) const;

  ParameterStore<T>& params_;
  ExpertWeightIds ids_;
  int64_t D_, F_, K_;
  ExpertExchange& exchange_;
  const ExpertSlots& slots_;
  // Home: the plan of the last forward.
  int64_t tokens_ = 0, sent_ = 0;  // home's tokens, and the rows it sends (a token once per peer)
  std::vector<int32_t> cut_P1_, rank_TK_, pos_TP_, tokens_P_;
  std::vector<int64_t> send_rows_P_, recv_rows_P_;
  std::vector<T> send_UD_, back_UD_, dweight_back_UK_;
  // Peer: what it received and computed, saved for backward.
  std::vector<int64_t> window_experts_;
  std::vector<int64_t> recv_start_P1_;
  std::vector<int32_t> recv_slot_UK_;
  std::vector<T> recv_weight_UK_, recv_x_UD_, partial_UD_;
  ReceivedRows rows_;
  std::vector<T> x_RD_, gate_RF_, up_RF_, act_RF_, y_RD_;
  std::vector<T> recv_dy_UD_, dy_RD_, dact_RF_, dgate_RF_, dup_RF_, dx_RD_, dweight_UK_;
  // fp8 rows on the wire (ExpertExchange::fp8()): the rows out, in, the results and what
  // came back; the forward's choice, kept for the backward.
  bool fp8_ = false;
  std::vector<uint8_t> wire_send_, wire_recv_, wire_result_, wire_back_;
  // The token rows of a round trip, compressed or not: out = rows[0 .. sent) sent, in =
  // the U rows received into `received`; compute(c) fills `result` for chunk c's tokens;
  // `back` gets the sent rows' results. arrived: the rows are in `received` (or the wire
  // rows in wire_recv_) already, only the results travel.
  void round_trip_rows(const T* out, T* received, T* result, T* back, const std::function<void(int)>& compute,
                       bool arrived = false);
  // Speculation: armed by speculate(), rows out by send_speculative(), used by forward().
  bool spec_armed_ = false, spec_sent_ = false;
  int64_t spec_T_ = 0;
  std::vector<int32_t> spec_pos_TP_, spec_tokens_P_, spec_recv_P_;  // early blocks out, and their sizes in
  std::vector<int32_t> corr_pos_TP_, corr_tokens_P_, corr_recv_P_;  // correction blocks out, sizes in
  std::vector<int32_t> recv_tokens_P_;               // the exact blocks' sizes in (plan_exchange)
  std::vector<int32_t> source_U_, recv_source_U_;  // each exact row's source (speculation_sources), out and in
  std::vector<uint8_t> wire_x_, spec_send_, spec_recv_, corr_send_, corr_recv_;
  std::unique_ptr<ExchangeInFlight> spec_counts_flight_, spec_rows_flight_, corr_flight_;
  SpeculationRows spec_rows_;
};

}  // namespace moe

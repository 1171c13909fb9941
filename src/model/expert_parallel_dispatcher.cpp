#include "model/expert_parallel_dispatcher.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "core/error.h"
#include "core/fp8.h"
#include "kernels/matmul.h"
#include "kernels/swiglu.h"
#include "moe/dispatch.h"
#include "moe/token_exchange.h"

namespace moe {

namespace {

std::vector<int32_t> narrow(const std::vector<int64_t>& values) {
  return {values.begin(), values.end()};
}

template <typename Int>
std::vector<int64_t> times(const std::vector<Int>& counts, int64_t factor) {
  std::vector<int64_t> out;
  for (Int n : counts) out.push_back(int64_t{n} * factor);
  return out;
}

// The rows of every token with pos_TP >= 0, row_bytes each (rows_T[t] at t * row_bytes),
// into blocks by peer (block p starts after the tokens_P of the peers before it).
void pack_block_rows(std::vector<uint8_t>& out, const uint8_t* rows_T, const int32_t* pos_TP,
                     const std::vector<int32_t>& tokens_P, int64_t T, int64_t row_bytes) {
  const int P = static_cast<int>(tokens_P.size());
  std::vector<int64_t> start(static_cast<size_t>(P) + 1, 0);
  for (int p = 0; p < P; ++p) start[static_cast<size_t>(p) + 1] = start[static_cast<size_t>(p)] + tokens_P[static_cast<size_t>(p)];
  out.resize(static_cast<size_t>(start.back() * row_bytes));
  for (int64_t t = 0; t < T; ++t)
    for (int p = 0; p < P; ++p) {
      const int32_t pos = pos_TP[t * P + p];
      if (pos >= 0)
        std::memcpy(out.data() + (start[static_cast<size_t>(p)] + pos) * row_bytes, rows_T + t * row_bytes,
                    static_cast<size_t>(row_bytes));
    }
}

int64_t total(const std::vector<int32_t>& counts) { return std::accumulate(counts.begin(), counts.end(), int64_t{0}); }

class Finished final : public ExchangeInFlight {
 public:
  void wait() override {}
};

}  // namespace

std::unique_ptr<ExchangeInFlight> ExpertExchange::start_exchange(const void* send, const std::vector<int64_t>& send_bytes_P,
                                                                 void* recv, const std::vector<int64_t>& recv_bytes_P) {
  exchange(send, send_bytes_P, recv, recv_bytes_P);
  return std::make_unique<Finished>();
}

void ExpertExchange::return_trip(const std::vector<int64_t>& send_rows_P, const std::vector<int64_t>& recv_rows_P,
                                 const void* result, void* back, size_t row_bytes,
                                 const std::function<void(int chunk)>& compute) {
  const auto bytes = static_cast<int64_t>(row_bytes);
  const size_t P = send_rows_P.size();
  std::vector<int64_t> send_start(P + 1, 0), recv_start(P + 1, 0);
  for (size_t p = 0; p < P; ++p) {
    send_start[p + 1] = send_start[p] + send_rows_P[p];
    recv_start[p + 1] = recv_start[p] + recv_rows_P[p];
  }
  std::vector<char> out, in;
  for (int c = 0; c < chunks(); ++c) {
    compute(c);
    std::vector<int64_t> out_bytes_P, in_bytes_P;
    out.clear();
    for (size_t p = 0; p < P; ++p) {
      const auto [lo, hi] = chunk_of_block(recv_rows_P[p], c, chunks());
      const char* from = static_cast<const char*>(result) + (recv_start[p] + lo) * bytes;
      out.insert(out.end(), from, from + (hi - lo) * bytes);
      out_bytes_P.push_back((hi - lo) * bytes);
      const auto [blo, bhi] = chunk_of_block(send_rows_P[p], c, chunks());
      in_bytes_P.push_back((bhi - blo) * bytes);
    }
    in.resize(static_cast<size_t>(std::accumulate(in_bytes_P.begin(), in_bytes_P.end(), int64_t{0})));
    exchange(out.data(), out_bytes_P, in.data(), in_bytes_P);
    int64_t at = 0;
    for (size_t p = 0; p < P; ++p) {
      const auto [lo, hi] = chunk_of_block(send_rows_P[p], c, chunks());
      std::memcpy(static_cast<char*>(back) + (send_start[p] + lo) * bytes, in.data() + at, static_cast<size_t>((hi - lo) * bytes));
      at += (hi - lo) * bytes;
    }
  }
}

template <typename T>
ExpertParallelDispatcher<T>::ExpertParallelDispatcher(ParameterStore<T>& params, ExpertWeightIds ids, int64_t dim,
                                                      int64_t hidden, int64_t top_k, ExpertExchange& exchange,
                                                      const ExpertSlots& slots)
    : params_(params), ids_(ids), D_(dim), F_(hidden), K_(top_k), exchange_(exchange), slots_(slots) {}

// The exchange of one forward: home's side (route_ranks, token_blocks, pack_counts,
// pack_routing), then the receiving side's layout of what arrived: the GPU's
// plan_expert_exchange and the start of ep_experts_forward, step for step.
template <typename T>
void ExpertParallelDispatcher<T>::plan_exchange(const HomeRouting<T>& home, const T* x_TD) {
  const int P = exchange_.size(), me = exchange_.rank();
  const int64_t E = slots_.n_experts(), T_ = home.tokens, K = K_;
  MOE_CHECK(slots_.ep_size() == P, "expert parallelism: slots for {} ranks in an EP group of {}", slots_.ep_size(), P);
  tokens_ = T_;
  const std::vector<int32_t> first_P1 = narrow(slots_.first_slot_P1), window_end_P = narrow(slots_.window_end_P);
  // Which rank computes each kept assignment: the block edges, or with split experts this
  // micro-batch's cuts from every EP rank's kept rows per slot.
  if (slots_.split) {
    std::vector<int32_t> counts_PE(static_cast<size_t>(P * E));
    exchange_.all_gather(home.counts_S, E, counts_PE.data());
    cut_P1_.resize(static_cast<size_t>(P) + 1);
    boundary_cuts(cut_P1_.data(), counts_PE.data(), first_P1.data(), true, E, P);
  } else {
    cut_P1_ = edge_cuts(slots_);
  }
  rank_TK_.resize(static_cast<size_t>(T_ * K));
  route_ranks(rank_TK_.data(), home.row_TK, home.slot_TK, home.offsets_S1, cut_P1_.data(), T_, K, P);
  pos_TP_.resize(static_cast<size_t>(T_ * P));
  tokens_P_.resize(static_cast<size_t>(P));
  token_blocks(pos_TP_.data(), tokens_P_.data(), rank_TK_.data(), T_, K, P);
  // Speculating: which exact rows went early, and the corrections (their count travels
  // as one more word per peer with the counts).
  const bool spec = spec_sent_;
  const int64_t extra = spec ? 1 : 0;
  if (spec) {
    MOE_CHECK(spec_T_ == T_, "speculative dispatch: {} tokens guessed for a forward of {}", spec_T_, T_);
    source_U_.resize(static_cast<size_t>(total(tokens_P_)));
    corr_pos_TP_.resize(static_cast<size_t>(T_ * P));
    corr_tokens_P_.resize(static_cast<size_t>(P));
    speculation_sources(source_U_.data(), corr_pos_TP_.data(), corr_tokens_P_.data(), pos_TP_.data(), tokens_P_.data(),
                        spec_pos_TP_.data(), T_, P);
  }
  // Each peer learns the rows of each slot of its window we send and our block size.
  const int64_t L = slots_.window_size(me);
  std::vector<int64_t> count_send_P, count_recv_P(static_cast<size_t>(P), (L + 1 + extra) * int64_t{sizeof(int32_t)});
  int64_t count_words = 0;
  for (int p = 0; p < P; ++p) {
    count_send_P.push_back((slots_.window_size(p) + 1) * int64_t{sizeof(int32_t)});
    count_words += slots_.window_size(p) + 1;
  }
  std::vector<int32_t> counts_out(static_cast<size_t>(count_words)), counts_in(static_cast<size_t>(P * (L + 1 + extra)));
  pack_counts(counts_out.data(), home.counts_S, tokens_P_.data(), first_P1.data(), window_end_P.data(),
              cut_P1_.data(), P);
  if (spec) {
    std::vector<int32_t> with_corrections;
    int64_t at = 0;
    for (int p = 0; p < P; ++p) {
      const int64_t n = slots_.window_size(p) + 1;
      with_corrections.insert(with_corrections.end(), counts_out.begin() + at, counts_out.begin() + at + n);
      with_corrections.push_back(corr_tokens_P_[static_cast<size_t>(p)]);
      at += n;
      count_send_P[static_cast<size_t>(p)] += int64_t{sizeof(int32_t)};
    }
    counts_out = std::move(with_corrections);
  }
  exchange_.exchange(counts_out.data(), count_send_P, counts_in.data(), count_recv_P);
  std::vector<int32_t> recv_tokens_P(static_cast<size_t>(P));
  std::vector<int64_t> told_rows_L(static_cast<size_t>(L), 0);
  recv_start_P1_.assign(static_cast<size_t>(P) + 1, 0);
  if (spec) corr_recv_P_.assign(static_cast<size_t>(P), 0);
  for (int p = 0; p < P; ++p) {
    const int32_t* from = counts_in.data() + p * (L + 1 + extra);
    if (spec) corr_recv_P_[static_cast<size_t>(p)] = from[L + 1];
    for (int64_t l = 0; l < L; ++l) told_rows_L[static_cast<size_t>(l)] += from[l];
    recv_tokens_P[static_cast<size_t>(p)] = from[L];
    recv_start_P1_[static_cast<size_t>(p) + 1] = recv_start_P1_[static_cast<size_t>(p)] + from[L];
  }
  send_rows_P_ = times(tokens_P_, 1);
  recv_rows_P_ = times(recv_tokens_P, 1);
  sent_ = std::accumulate(send_rows_P_.begin(), send_rows_P_.end(), int64_t{0});
  const int64_t sent = sent_, U = recv_start_P1_.back();
  if (spec) {  // the corrections travel while the routing does
    const int64_t rb = row_bytes();
    pack_block_rows(corr_send_, wire_rows(x_TD), corr_pos_TP_.data(), corr_tokens_P_, T_, rb);
    corr_recv_.resize(static_cast<size_t>(total(corr_recv_P_) * rb));
    corr_flight_ = exchange_.start_exchange(corr_send_.data(), times(corr_tokens_P_, rb), corr_recv_.data(),
                                            times(corr_recv_P_, rb));
  }
  // The routing of the tokens: slot in the peer's window (or -1) and combine weight;
  // speculating, each row's source (speculation_sources) after its K slots.
  std::vector<int32_t> slot_send(static_cast<size_t>(sent * K));
  std::vector<T> weight_send(static_cast<size_t>(sent * K));
  pack_routing(slot_send.data(), weight_send.data(), pos_TP_.data(), tokens_P_.data(), rank_TK_.data(), home.slot_TK,
               home.weight_TK, first_P1.data(), T_, K, P);
  recv_slot_UK_.resize(static_cast<size_t>(U * K));
  recv_weight_UK_.resize(static_cast<size_t>(U * K));
  if (spec) {
    const int64_t W = K + 1;
    std::vector<int32_t> slot_source_send(static_cast<size_t>(sent * W)), slot_source_recv(static_cast<size_t>(U * W));
    for (int64_t u = 0; u < sent; ++u) {
      std::copy_n(slot_send.data() + u * K, K, slot_source_send.data() + u * W);
      slot_source_send[static_cast<size_t>(u * W + K)] = source_U_[static_cast<size_t>(u)];
    }
    exchange_.exchange(slot_source_send.data(), times(tokens_P_, W * int64_t{sizeof(int32_t)}), slot_source_recv.data(),
                       times(recv_tokens_P, W * int64_t{sizeof(int32_t)}));
    recv_source_U_.resize(static_cast<size_t>(U));
    for (int64_t u = 0; u < U; ++u) {
      std::copy_n(slot_source_recv.data() + u * W, K, recv_slot_UK_.data() + u * K);
      recv_source_U_[static_cast<size_t>(u)] = slot_source_recv[static_cast<size_t>(u * W + K)];
    }
  } else {
    exchange_.exchange(slot_send.data(), times(tokens_P_, K * int64_t{sizeof(int32_t)}), recv_slot_UK_.data(),
                       times(recv_tokens_P, K * int64_t{sizeof(int32_t)}));
  }
  exchange_.exchange(weight_send.data(), times(tokens_P_, K * int64_t{sizeof(T)}), recv_weight_UK_.data(),
                     times(recv_tokens_P, K * int64_t{sizeof(T)}));
  // No capacity here: home dropped already. The rows laid out must be the rows told.
  rows_ = lay_out_received(recv_slot_UK_.data(), recv_tokens_P, L, K, exchange_.chunks());
  MOE_CHECK(rows_.rows_L == told_rows_L, "expert parallelism: the rows received differ from the counts sent");
  window_experts_ = window_experts(slots_, me);
  recv_tokens_P_ = recv_tokens_P;
}

template <typename T>
int64_t ExpertParallelDispatcher<T>::row_bytes() const {
  return fp8_ ? fp8_row_bytes(D_) : D_ * int64_t{sizeof(T)};
}

template <typename T>
const uint8_t* ExpertParallelDispatcher<T>::wire_rows(const T* x_TD) {
  if (!fp8_) return reinterpret_cast<const uint8_t*>(x_TD);
  return wire_x_.data();  // quantised once by send_speculative
}

template <typename T>
void ExpertParallelDispatcher<T>::speculate(const int32_t* pred_slot_TQ, int64_t T_, int64_t Q) {
  MOE_CHECK(!spec_armed_, "speculative dispatch: speculate() twice before a forward");
  const int P = exchange_.size(), me = exchange_.rank();
  const std::vector<int32_t> first_P1 = narrow(slots_.first_slot_P1), window_end_P = narrow(slots_.window_end_P);
  spec_T_ = T_;
  spec_pos_TP_.resize(static_cast<size_t>(T_ * P));
  spec_tokens_P_.resize(static_cast<size_t>(P));
  speculative_blocks(spec_pos_TP_.data(), spec_tokens_P_.data(), pred_slot_TQ, T_, Q, first_P1.data(),
                     window_end_P.data(), P, me);
  spec_recv_P_.assign(static_cast<size_t>(P), 0);
  const std::vector<int64_t> one_each(static_cast<size_t>(P), int64_t{sizeof(int32_t)});
  spec_counts_flight_ = exchange_.start_exchange(spec_tokens_P_.data(), one_each, spec_recv_P_.data(), one_each);
  spec_armed_ = true;
}

template <typename T>
void ExpertParallelDispatcher<T>::send_speculative(const T* x_TD) {
  MOE_CHECK(spec_armed_ && !spec_sent_, "speculative dispatch: rows sent without a guess");
  exchange_.set_dispatching(true);
  fp8_ = exchange_.fp8();
  const int64_t rb = row_bytes();
  if (fp8_) {
    wire_x_.resize(static_cast<size_t>(spec_T_ * rb));
    for (int64_t t = 0; t < spec_T_; ++t) quantize_row_fp8(wire_x_.data() + t * rb, x_TD + t * D_, D_);
  }
  pack_block_rows(spec_send_, wire_rows(x_TD), spec_pos_TP_.data(), spec_tokens_P_, spec_T_, rb);
  spec_counts_flight_->wait();
  spec_recv_.resize(static_cast<size_t>(total(spec_recv_P_) * rb));
  spec_rows_flight_ = exchange_.start_exchange(spec_send_.data(), times(spec_tokens_P_, rb), spec_recv_.data(),
                                               times(spec_recv_P_, rb));
  spec_sent_ = true;
}

template <typename T>
template <class F>
void ExpertParallelDispatcher<T>::for_chunk_tokens(int chunk, F&& f) const {
  const int P = exchange_.size();
  for (int p = 0; p < P; ++p) {
    const auto [lo, hi] = chunk_of_block(recv_rows_P_[static_cast<size_t>(p)], chunk, exchange_.chunks());
    if (hi > lo) f(recv_start_P1_[static_cast<size_t>(p)] + lo, hi - lo);
  }
}

template <typename T>
int64_t ExpertParallelDispatcher<T>::forward(T* y_TD, const T* x_TD, const HomeRouting<T>& home) {
  MOE_CHECK(spec_armed_ == spec_sent_, "speculative dispatch: a guess whose rows were not sent");
  const bool spec = spec_sent_;
  exchange_.set_dispatching(true);
  fp8_ = exchange_.fp8();
  plan_exchange(home, x_TD);
  const int P = exchange_.size();
  const int64_t sent = sent_, U = recv_start_P1_.back(), R = static_cast<int64_t>(rows_.token_of_row_R.size());
  send_UD_.resize(static_cast<size_t>(sent * D_));
  back_UD_.resize(static_cast<size_t>(sent * D_));
  recv_x_UD_.resize(static_cast<size_t>(U * D_));
  partial_UD_.resize(static_cast<size_t>(U * D_));
  x_RD_.resize(static_cast<size_t>(R * D_));
  y_RD_.resize(static_cast<size_t>(R * D_));
  for (auto* v : {&gate_RF_, &up_RF_, &act_RF_}) v->resize(static_cast<size_t>(R * F_));
  spec_rows_ = {};
  if (spec) {
    // The exact blocks from the early rows and the corrections, bytes as they travelled.
    const int64_t rb = row_bytes();
    if (fp8_) wire_recv_.resize(static_cast<size_t>(U * rb));
    corr_flight_->wait();
    spec_rows_flight_->wait();
    spec_rows_ = merge_speculated_rows(fp8_ ? static_cast<void*>(wire_recv_.data()) : static_cast<void*>(recv_x_UD_.data()),
                                       recv_source_U_.data(), recv_tokens_P_.data(), spec_recv_.data(),
                                       spec_recv_P_.data(), corr_recv_.data(), corr_recv_P_.data(), rb, P,
                                       exchange_.rank());
    exchange_.set_dispatching(false);
    spec_armed_ = spec_sent_ = false;
    corr_flight_.reset();
    spec_rows_flight_.reset();
    spec_counts_flight_.reset();
    round_trip_rows(nullptr, recv_x_UD_.data(), partial_UD_.data(), back_UD_.data(), [&](int c) { experts_forward(c); },
                    /*arrived=*/true);
  } else {
    scatter_token_rows(send_UD_.data(), x_TD, pos_TP_.data(), tokens_P_.data(), tokens_, P, D_);
    round_trip_rows(send_UD_.data(), recv_x_UD_.data(), partial_UD_.data(), back_UD_.data(),
                    [&](int c) { experts_forward(c); });
  }
  exchange_.set_dispatching(false);
  sum_token_rows(y_TD, back_UD_.data(), pos_TP_.data(), tokens_P_.data(), tokens_, P, D_);
  return R;
}

// Chunk c: its rows through their slots' experts, then each of its tokens' partial
// combine over this rank's entries.
template <typename T>
void ExpertParallelDispatcher<T>::experts_forward(int c) {
  const int64_t L = static_cast<int64_t>(window_experts_.size()), D = D_, F = F_;
  const int32_t* offsets = rows_.offsets_CL1.data() + c * (L + 1);
  if (L > 0) {
    permute_forward<T>(x_RD_.data() + int64_t{offsets[0]} * D, recv_x_UD_.data(),
                       rows_.token_of_row_R.data() + offsets[0], offsets[L] - offsets[0], D);
  }
  const T* w1 = params_.value(ids_.w1);
  const T* w3 = params_.value(ids_.w3);
  const T* w2 = params_.value(ids_.w2);
  for (int64_t l = 0; l < L; ++l) {
    const int64_t r = offsets[l], n = offsets[l + 1] - offsets[l], e = window_experts_[static_cast<size_t>(l)];
    if (n == 0) continue;
    T* gate = gate_RF_.data() + r * F;
    T* up = up_RF_.data() + r * F;
    T* act = act_RF_.data() + r * F;
    const T* x = x_RD_.data() + r * D;
    linear_forward<T>(gate, x, w1 + e * F * D, nullptr, n, D, F);
    linear_forward<T>(up, x, w3 + e * F * D, nullptr, n, D, F);
    swiglu_forward<T>(act, gate, up, n * F);
    linear_forward<T>(y_RD_.data() + r * D, act, w2 + e * D * F, nullptr, n, F, D);
  }
  for_chunk_tokens(c, [&](int64_t u, int64_t n) {
    combine_forward<T>(partial_UD_.data() + u * D, y_RD_.data(), recv_weight_UK_.data() + u * K_,
                       rows_.row_UK.data() + u * K_, n, K_, D);
  });
}

template <typename T>
void ExpertParallelDispatcher<T>::backward(T* dx_TD, T* dweight_TK, const T* dy_TD) {
  const int P = exchange_.size();
  const int64_t U = recv_start_P1_.back(), R = static_cast<int64_t>(rows_.token_of_row_R.size());
  recv_dy_UD_.resize(static_cast<size_t>(U * D_));
  dweight_UK_.assign(static_cast<size_t>(U * K_), T(0));
  dy_RD_.resize(static_cast<size_t>(R * D_));
  dx_RD_.resize(static_cast<size_t>(R * D_));
  for (auto* v : {&dact_RF_, &dgate_RF_, &dup_RF_}) v->resize(static_cast<size_t>(R * F_));
  scatter_token_rows(send_UD_.data(), dy_TD, pos_TP_.data(), tokens_P_.data(), tokens_, P, D_);
  // The output gradient out once per token and rank; each token's input-row gradients
  // summed there (a partial) come back.
  round_trip_rows(send_UD_.data(), recv_dy_UD_.data(), partial_UD_.data(), back_UD_.data(),
                  [&](int c) { experts_backward(c); });
  // The combine weights' gradients: zero for the entries of other ranks.
  dweight_back_UK_.resize(static_cast<size_t>(sent_ * K_));
  exchange_.exchange(dweight_UK_.data(), times(recv_rows_P_, K_ * int64_t{sizeof(T)}), dweight_back_UK_.data(),
                     times(tokens_P_, K_ * int64_t{sizeof(T)}));
  sum_token_rows(dx_TD, back_UD_.data(), pos_TP_.data(), tokens_P_.data(), tokens_, P, D_);
  sum_token_rows(dweight_TK, dweight_back_UK_.data(), pos_TP_.data(), tokens_P_.data(), tokens_, P, K_);
}

// Uncompressed: the rows travel as they are. fp8: each row is quantised when packed
// (quantize_row_fp8) and dequantised when unpacked, both ways; compute(c) sees chunk c's
// dequantised rows. Gradients pass the quantisation straight through (it is not
// differentiated: the backward's own exchange quantises dy and dx the same way).
template <typename T>
void ExpertParallelDispatcher<T>::round_trip_rows(const T* out, T* received, T* result, T* back,
                                                  const std::function<void(int)>& compute, bool arrived) {
  const int64_t D = D_, U = recv_start_P1_.back();
  auto trip = [&](const void* send, void* recv, const void* res, void* home, size_t bytes,
                  const std::function<void(int)>& f) {
    if (arrived) exchange_.return_trip(send_rows_P_, recv_rows_P_, res, home, bytes, f);
    else exchange_.round_trip(send, send_rows_P_, recv, recv_rows_P_, res, home, bytes, f);
  };
  if (!fp8_) {
    trip(out, received, result, back, static_cast<size_t>(D) * sizeof(T), compute);
    return;
  }
  const int64_t row = fp8_row_bytes(D);
  wire_back_.resize(static_cast<size_t>(sent_ * row));
  wire_recv_.resize(static_cast<size_t>(U * row));
  wire_result_.resize(static_cast<size_t>(U * row));
  if (!arrived) {
    wire_send_.resize(static_cast<size_t>(sent_ * row));
    for (int64_t u = 0; u < sent_; ++u) quantize_row_fp8(wire_send_.data() + u * row, out + u * D, D);
  }
  trip(wire_send_.data(), wire_recv_.data(), wire_result_.data(), wire_back_.data(), static_cast<size_t>(row), [&](int c) {
                         for_chunk_tokens(c, [&](int64_t u0, int64_t n) {
                           for (int64_t u = u0; u < u0 + n; ++u)
                             dequantize_row_fp8(received + u * D, wire_recv_.data() + u * row, D);
                         });
                         compute(c);
                         for_chunk_tokens(c, [&](int64_t u0, int64_t n) {
                           for (int64_t u = u0; u < u0 + n; ++u)
                             quantize_row_fp8(wire_result_.data() + u * row, result + u * D, D);
                         });
                       });
  for (int64_t u = 0; u < sent_; ++u) dequantize_row_fp8(back + u * D, wire_back_.data() + u * row, D);
}

template <typename T>
void ExpertParallelDispatcher<T>::experts_backward(int c) {
  const int64_t L = static_cast<int64_t>(window_experts_.size()), D = D_, F = F_;
  const int32_t* offsets = rows_.offsets_CL1.data() + c * (L + 1);
  for_chunk_tokens(c, [&](int64_t u, int64_t n) {
    combine_backward<T>(dy_RD_.data(), dweight_UK_.data() + u * K_, recv_dy_UD_.data() + u * D, y_RD_.data(),
                        recv_weight_UK_.data() + u * K_, rows_.row_UK.data() + u * K_, n, K_, D);
  });
  const T* w1 = params_.value(ids_.w1);
  const T* w3 = params_.value(ids_.w3);
  const T* w2 = params_.value(ids_.w2);
  T* dw1 = params_.grad(ids_.w1);
  T* dw3 = params_.grad(ids_.w3);
  T* dw2 = params_.grad(ids_.w2);
  for (int64_t l = 0; l < L; ++l) {
    const int64_t r = offsets[l], n = offsets[l + 1] - offsets[l], e = window_experts_[static_cast<size_t>(l)];
    if (n == 0) continue;
    T* dact = dact_RF_.data() + r * F;
    T* dgate = dgate_RF_.data() + r * F;
    T* dup = dup_RF_.data() + r * F;
    const T* x = x_RD_.data() + r * D;
    T* dx = dx_RD_.data() + r * D;
    linear_backward<T>(dact, dw2 + e * D * F, nullptr, dy_RD_.data() + r * D, act_RF_.data() + r * F, w2 + e * D * F,
                       n, F, D);
    swiglu_backward<T>(dgate, dup, dact, gate_RF_.data() + r * F, up_RF_.data() + r * F, n * F);
    linear_backward<T>(dx, dw1 + e * F * D, nullptr, dgate, x, w1 + e * F * D, n, D, F);
    linear_backward<T>(dx, dw3 + e * F * D, nullptr, dup, x, w3 + e * F * D, n, D, F, /*accumulate_dx=*/true);
  }
  for_chunk_tokens(c, [&](int64_t u, int64_t n) {
    permute_backward<T>(partial_UD_.data() + u * D, dx_RD_.data(), rows_.row_UK.data() + u * K_, n, K_, D,
                        /*accumulate=*/false);
  });
}

template class ExpertParallelDispatcher<float>;
template class ExpertParallelDispatcher<double>;

}  // namespace moe

#include "model/expert_parallel_dispatcher.h"

#include <algorithm>
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

}  // namespace

template <typename T>
ExpertParallelDispatcher<T>::ExpertParallelDispatcher(ParameterStore<T>& params, ExpertWeightIds ids, int64_t dim,
                                                      int64_t hidden, int64_t top_k, ExpertExchange& exchange,
                                                      const ExpertSlots& slots)
    : params_(params), ids_(ids), D_(dim), F_(hidden), K_(top_k), exchange_(exchange), slots_(slots) {}

// The exchange of one forward: home's side (route_ranks, token_blocks, pack_counts,
// pack_routing), then the receiving side's layout of what arrived: the GPU's
// plan_expert_exchange and the start of ep_experts_forward, step for step.
template <typename T>
void ExpertParallelDispatcher<T>::plan_exchange(const HomeRouting<T>& home) {
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
  // Each peer learns the rows of each slot of its window we send and our block size.
  const int64_t L = slots_.window_size(me);
  std::vector<int64_t> count_send_P, count_recv_P(static_cast<size_t>(P), (L + 1) * int64_t{sizeof(int32_t)});
  int64_t count_words = 0;
  for (int p = 0; p < P; ++p) {
    count_send_P.push_back((slots_.window_size(p) + 1) * int64_t{sizeof(int32_t)});
    count_words += slots_.window_size(p) + 1;
  }
  std::vector<int32_t> counts_out(static_cast<size_t>(count_words)), counts_in(static_cast<size_t>(P * (L + 1)));
  pack_counts(counts_out.data(), home.counts_S, tokens_P_.data(), first_P1.data(), window_end_P.data(),
              cut_P1_.data(), P);
  exchange_.exchange(counts_out.data(), count_send_P, counts_in.data(), count_recv_P);
  std::vector<int32_t> recv_tokens_P(static_cast<size_t>(P));
  std::vector<int64_t> told_rows_L(static_cast<size_t>(L), 0);
  recv_start_P1_.assign(static_cast<size_t>(P) + 1, 0);
  for (int p = 0; p < P; ++p) {
    const int32_t* from = counts_in.data() + p * (L + 1);
    for (int64_t l = 0; l < L; ++l) told_rows_L[static_cast<size_t>(l)] += from[l];
    recv_tokens_P[static_cast<size_t>(p)] = from[L];
    recv_start_P1_[static_cast<size_t>(p) + 1] = recv_start_P1_[static_cast<size_t>(p)] + from[L];
  }
  send_rows_P_ = times(tokens_P_, 1);
  recv_rows_P_ = times(recv_tokens_P, 1);
  sent_ = std::accumulate(send_rows_P_.begin(), send_rows_P_.end(), int64_t{0});
  const int64_t sent = sent_, U = recv_start_P1_.back();
  // The routing of the tokens: slot in the peer's window (or -1) and combine weight.
  std::vector<int32_t> slot_send(static_cast<size_t>(sent * K));
  std::vector<T> weight_send(static_cast<size_t>(sent * K));
  pack_routing(slot_send.data(), weight_send.data(), pos_TP_.data(), tokens_P_.data(), rank_TK_.data(), home.slot_TK,
               home.weight_TK, first_P1.data(), T_, K, P);
  recv_slot_UK_.resize(static_cast<size_t>(U * K));
  recv_weight_UK_.resize(static_cast<size_t>(U * K));
  exchange_.exchange(slot_send.data(), times(tokens_P_, K * int64_t{sizeof(int32_t)}), recv_slot_UK_.data(),
                     times(recv_tokens_P, K * int64_t{sizeof(int32_t)}));
  exchange_.exchange(weight_send.data(), times(tokens_P_, K * int64_t{sizeof(T)}), recv_weight_UK_.data(),
                     times(recv_tokens_P, K * int64_t{sizeof(T)}));
  // No capacity here: home dropped already. The rows laid out must be the rows told.
  rows_ = lay_out_received(recv_slot_UK_.data(), recv_tokens_P, L, K, exchange_.chunks());
  MOE_CHECK(rows_.rows_L == told_rows_L, "expert parallelism: the rows received differ from the counts sent");
  window_experts_ = window_experts(slots_, me);
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
  plan_exchange(home);
  const int P = exchange_.size();
  const int64_t sent = sent_, U = recv_start_P1_.back(), R = static_cast<int64_t>(rows_.token_of_row_R.size());
  send_UD_.resize(static_cast<size_t>(sent * D_));
  back_UD_.resize(static_cast<size_t>(sent * D_));
  recv_x_UD_.resize(static_cast<size_t>(U * D_));
  partial_UD_.resize(static_cast<size_t>(U * D_));
  x_RD_.resize(static_cast<size_t>(R * D_));
  y_RD_.resize(static_cast<size_t>(R * D_));
  for (auto* v : {&gate_RF_, &up_RF_, &act_RF_}) v->resize(static_cast<size_t>(R * F_));
  scatter_token_rows(send_UD_.data(), x_TD, pos_TP_.data(), tokens_P_.data(), tokens_, P, D_);
  fp8_ = exchange_.fp8();
  round_trip_rows(send_UD_.data(), recv_x_UD_.data(), partial_UD_.data(), back_UD_.data(),
                  [&](int c) { experts_forward(c); });
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
                                                  const std::function<void(int)>& compute) {
  const int64_t D = D_, U = recv_start_P1_.back();
  if (!fp8_) {
    exchange_.round_trip(out, send_rows_P_, received, recv_rows_P_, result, back, static_cast<size_t>(D) * sizeof(T),
                         compute);
    return;
  }
  const int64_t row = fp8_row_bytes(D);
  wire_send_.resize(static_cast<size_t>(sent_ * row));
  wire_back_.resize(static_cast<size_t>(sent_ * row));
  wire_recv_.resize(static_cast<size_t>(U * row));
  wire_result_.resize(static_cast<size_t>(U * row));
  for (int64_t u = 0; u < sent_; ++u) quantize_row_fp8(wire_send_.data() + u * row, out + u * D, D);
  exchange_.round_trip(wire_send_.data(), send_rows_P_, wire_recv_.data(), recv_rows_P_, wire_result_.data(),
                       wire_back_.data(), static_cast<size_t>(row), [&](int c) {
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

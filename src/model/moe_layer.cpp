#include "model/moe_layer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/matmul.h"
#include "kernels/swiglu.h"
#include "moe/dispatch.h"
#include "moe/router.h"
#include "moe/temperature_control.h"

namespace moe {

template <typename T>
MoELayer<T>::MoELayer(ParameterStore<T>& params, const ModelConfig& config,
                      const std::string& prefix)
    : params_(params),
      cfg_(config.moe),
      prefix_(prefix),
      D_(config.dim),
      E_(config.moe.n_experts),
      K_(config.moe.top_k),
      F_(config.moe.expert_hidden),
      S_(config.seq_len) {
  router_w_ = params.add({prefix + ".router.weight", Shape{E_, D_}, Init::Normal, config.init_std});
  if (cfg_.router_bias) router_b_ = params.add({prefix + ".router.bias", Shape{E_}, Init::Zeros, 0, /*decay=*/false});
  const std::string experts = prefix + ".experts";
  w1_ = params.add({experts + ".w1", Shape{E_, F_, D_}, Init::Kaiming, 0, true, experts});
  w3_ = params.add({experts + ".w3", Shape{E_, F_, D_}, Init::Kaiming, 0, true, experts});
  w2_ = params.add({experts + ".w2", Shape{E_, D_, F_}, Init::Kaiming, 0, true, experts});
  shared_.reserve(static_cast<size_t>(cfg_.n_shared_experts));
  for (int64_t s = 0; s < cfg_.n_shared_experts; ++s)
    shared_.emplace_back(params, prefix + ".shared." + std::to_string(s), D_, F_,
                         FeedForwardInit{Init::Kaiming, 0, 0});
  load_E_.assign(static_cast<size_t>(E_), 0);
  routing_.kept_E.assign(static_cast<size_t>(E_), 0);
  bias_E_.assign(static_cast<size_t>(E_), 0.0f);
  bias_T_.assign(static_cast<size_t>(E_), T(0));
  temperature_state_.assign(kTemperatureStateSize, 0.0f);
  temperature_state_init(temperature_state_.data(), cfg_.temperature);
}

template <typename T>
void MoELayer<T>::plan(Arena& saved, Arena& scratch, int64_t tokens) {
  T_ = tokens;
  // In a data-parallel run capacity is per expert over the global micro-batch.
  const int64_t batch_ranks = global_batch() ? batch_->size() : 1;
  capacity_ = expert_capacity(cfg_.capacity_factor, T_ * batch_ranks, K_, E_);
  const int64_t max_rows = T_ * K_;
  logits_TE_ = saved.alloc_array<T>(T_ * E_);
  scores_TE_ = saved.alloc_array<T>(T_ * E_);
  weight_TK_ = saved.alloc_array<T>(T_ * K_);
  expert_TK_ = saved.alloc_array<int32_t>(T_ * K_);
  slot_TK_ = dispatcher_ ? saved.alloc_array<int32_t>(T_ * K_) : nullptr;
  row_TK_ = saved.alloc_array<int32_t>(T_ * K_);
  counts_E_ = saved.alloc_array<int32_t>(E_);
  offsets_E1_ = saved.alloc_array<int32_t>(E_ + 1);
  token_of_row_R_ = saved.alloc_array<int32_t>(max_rows);
  x_RD_ = saved.alloc_array<T>(max_rows * D_);
  gate_RF_ = saved.alloc_array<T>(max_rows * F_);
  up_RF_ = saved.alloc_array<T>(max_rows * F_);
  act_RF_ = saved.alloc_array<T>(max_rows * F_);
  y_RD_ = saved.alloc_array<T>(max_rows * D_);
  const size_t mark = scratch.mark();
  dy_RD_ = scratch.alloc_array<T>(max_rows * D_);
  dweight_TK_ = scratch.alloc_array<T>(T_ * K_);
  dact_RF_ = scratch.alloc_array<T>(max_rows * F_);
  dgate_RF_ = scratch.alloc_array<T>(max_rows * F_);
  dup_RF_ = scratch.alloc_array<T>(max_rows * F_);
  dx_RD_ = scratch.alloc_array<T>(max_rows * D_);
  dscores_TE_ = scratch.alloc_array<T>(T_ * E_);
  dlogits_TE_ = scratch.alloc_array<T>(T_ * E_);
  for (auto& ffn : shared_) ffn.plan(saved, scratch, T_);
  scratch.release_to(mark);
}

template <typename T>
MoEForwardStats MoELayer<T>::forward(T* y_TD, const T* x_TD) {
  MoEForwardStats stats;
  // The guessed rows leave before the router runs (x is the router's input).
  if (dispatcher_ && dispatcher_->speculating()) dispatcher_->send_speculative(x_TD);
  linear_forward<T>(logits_TE_, x_TD, params_.value(router_w_), router_b_ >= 0 ? params_.value(router_b_) : nullptr, T_, D_, E_);
  router_scores_forward<T>(scores_TE_, logits_TE_, T_, E_, temperature(), cfg_.score_func);
  router_select<T>(expert_TK_, weight_TK_, scores_TE_, selection_bias(bias_T_), T_, E_, K_, cfg_.renormalize,
                   RouteGroups{cfg_.route_groups, cfg_.route_top_groups});
  count_expert_load(load_E_.data(), expert_TK_, T_, E_, K_);
  if (global_batch()) {
    global_router_losses(stats);
  } else {
    if (cfg_.aux_loss_coef > 0)
      stats.aux_loss = aux_loss_forward<T>(scores_TE_, expert_TK_, T_, E_, K_, cfg_.score_func,
                                           cfg_.aux_loss_coef);
    if (cfg_.z_loss_coef > 0)
      stats.z_loss = z_loss_forward<T>(logits_TE_, T_, E_, temperature(), cfg_.z_loss_coef);
  }

  const int32_t* slot_TK = slots_of_assignments();
  rows_ = global_batch() && cfg_.capacity_factor > 0
              ? assign_rows_global(slot_TK)
              : assign_rows(row_TK_, counts_E_, offsets_E1_, token_of_row_R_, slot_TK, T_, E_, K_, capacity_);
  stats.dropped = T_ * K_ - rows_;
  record_routing(stats.dropped);
  if (dispatcher_) {
    stats.expert_rows = dispatcher_->forward(
        y_TD, x_TD, HomeRouting<T>{T_, slot_TK, weight_TK_, row_TK_, counts_E_, offsets_E1_});
    routing_.speculation.add(dispatcher_->speculation_rows());
  } else {
    permute_forward<T>(x_RD_, x_TD, token_of_row_R_, rows_, D_);
    experts_forward_local();
    combine_forward<T>(y_TD, y_RD_, weight_TK_, row_TK_, T_, K_, D_);
    stats.expert_rows = rows_;
  }
  for (auto& ffn : shared_) ffn.forward(y_TD, x_TD, /*accumulate=*/true);
  return stats;
}

template <typename T>
const T* MoELayer<T>::selection_bias(std::vector<T>& bias_E) const {
  if (!cfg_.bias_balancing) return nullptr;
  bias_E.resize(static_cast<size_t>(E_));
  for (int64_t e = 0; e < E_; ++e) bias_E[static_cast<size_t>(e)] = static_cast<T>(bias_E_[static_cast<size_t>(e)]);
  return bias_E.data();
}

template <typename T>
void MoELayer<T>::experts_forward_local() {
  experts_forward(offsets_E1_, counts_E_, rows_, x_RD_, gate_RF_, up_RF_, act_RF_, y_RD_);
}

template <typename T>
void MoELayer<T>::experts_forward(const int32_t* offsets_E1, const int32_t* counts_E, int64_t rows, const T* x_RD,
                                  T* gate_RF, T* up_RF, T* act_RF, T* y_RD) const {
  const T* w1 = params_.value(w1_);
  const T* w3 = params_.value(w3_);
  const T* w2 = params_.value(w2_);
  for (int64_t e = 0; e < E_; ++e) {
    const int64_t first = offsets_E1[e], count = counts_E[e];
    if (count == 0) continue;
    linear_forward<T>(gate_RF + first * F_, x_RD + first * D_, w1 + e * F_ * D_, nullptr, count, D_, F_);
    linear_forward<T>(up_RF + first * F_, x_RD + first * D_, w3 + e * F_ * D_, nullptr, count, D_, F_);
  }
  swiglu_forward<T>(act_RF, gate_RF, up_RF, rows * F_);
  for (int64_t e = 0; e < E_; ++e) {
    const int64_t first = offsets_E1[e], count = counts_E[e];
    if (count == 0) continue;
    linear_forward<T>(y_RD + first * D_, act_RF + first * F_, w2 + e * D_ * F_, nullptr, count, F_, D_);
  }
}

template <typename T>
void MoELayer<T>::forward_dropless(T* y_nD, const T* x_nD, int64_t n) const {
  MOE_CHECK(!dispatcher_, "{}: decoding runs in one process, without expert parallelism", prefix_);
  auto buffer = [](int64_t size) { return std::vector<T>(static_cast<size_t>(size)); };
  auto ids = [](int64_t size) { return std::vector<int32_t>(static_cast<size_t>(size)); };
  std::vector<T> logits_nE = buffer(n * E_), scores_nE = buffer(n * E_), weight_nK = buffer(n * K_), bias_E;
  std::vector<int32_t> expert_nK = ids(n * K_), row_nK = ids(n * K_), counts_E = ids(E_), offsets_E1 = ids(E_ + 1),
                       token_of_row_R = ids(n * K_);
  linear_forward<T>(logits_nE.data(), x_nD, params_.value(router_w_), router_b_ >= 0 ? params_.value(router_b_) : nullptr,
                    n, D_, E_);
  router_scores_forward<T>(scores_nE.data(), logits_nE.data(), n, E_, temperature(), cfg_.score_func);
  router_select<T>(expert_nK.data(), weight_nK.data(), scores_nE.data(), selection_bias(bias_E), n, E_, K_,
                   cfg_.renormalize, RouteGroups{cfg_.route_groups, cfg_.route_top_groups});
  const int64_t rows = assign_rows(row_nK.data(), counts_E.data(), offsets_E1.data(), token_of_row_R.data(),
                                   expert_nK.data(), n, E_, K_, /*capacity=*/n * K_);
  std::vector<T> x_RD = buffer(rows * D_), y_RD = buffer(rows * D_), gate_RF = buffer(rows * F_),
                 up_RF = buffer(rows * F_), act_RF = buffer(rows * F_);
  permute_forward<T>(x_RD.data(), x_nD, token_of_row_R.data(), rows, D_);
  experts_forward(offsets_E1.data(), counts_E.data(), rows, x_RD.data(), gate_RF.data(), up_RF.data(), act_RF.data(),
                  y_RD.data());
  combine_forward<T>(y_nD, y_RD.data(), weight_nK.data(), row_nK.data(), n, K_, D_);
  for (const auto& ffn : shared_) ffn.forward_inference(y_nD, x_nD, n, /*accumulate=*/true);
}

template <typename T>
void MoELayer<T>::backward(T* dx_TD, const T* dy_TD, const T* x_TD, double loss_scale) {
  if (dispatcher_) {
    dispatcher_->backward(dx_TD, dweight_TK_, dy_TD);
  } else {
    combine_backward<T>(dy_RD_, dweight_TK_, dy_TD, y_RD_, weight_TK_, row_TK_, T_, K_, D_);
    experts_backward_local();
    permute_backward<T>(dx_TD, dx_RD_, row_TK_, T_, K_, D_, /*accumulate=*/false);
  }

  // Router: combine weights -> scores (+ aux loss) -> logits (+ z loss) -> x.
  router_select_backward<T>(dscores_TE_, dweight_TK_, expert_TK_, scores_TE_, T_, E_, K_,
                            cfg_.renormalize);
  if (cfg_.aux_loss_coef > 0) {
    if (global_batch()) global_aux_backward(loss_scale);
    else
      aux_loss_backward<T>(dscores_TE_, scores_TE_, expert_TK_, T_, E_, K_, cfg_.score_func,
                           cfg_.aux_loss_coef, loss_scale);
  }
  router_scores_backward<T>(dlogits_TE_, dscores_TE_, scores_TE_, T_, E_, temperature(),
                            cfg_.score_func);
  // The global z-loss is a mean over the global micro-batch: this rank's tokens weigh 1/(N T).
  const double z_scale = global_batch() ? loss_scale / static_cast<double>(batch_->size()) : loss_scale;
  if (cfg_.z_loss_coef > 0)
    z_loss_backward<T>(dlogits_TE_, logits_TE_, T_, E_, temperature(), cfg_.z_loss_coef, z_scale);
  linear_backward<T>(dx_TD, params_.grad(router_w_), router_b_ >= 0 ? params_.grad(router_b_) : nullptr, dlogits_TE_, x_TD,
                     params_.value(router_w_), T_, D_, E_, /*accumulate_dx=*/true);
  for (auto& ffn : shared_) ffn.backward(dx_TD, dy_TD, x_TD, /*accumulate_dx=*/true);
}

template <typename T>
void MoELayer<T>::experts_backward_local() {
  const T* w1 = params_.value(w1_);
  const T* w3 = params_.value(w3_);
  const T* w2 = params_.value(w2_);
  T* dw1 = params_.grad(w1_);
  T* dw3 = params_.grad(w3_);
  T* dw2 = params_.grad(w2_);
  for (int64_t e = 0; e < E_; ++e) {
    const int64_t first = offsets_E1_[e], count = counts_E_[e];
    if (count == 0) continue;
    linear_backward<T>(dact_RF_ + first * F_, dw2 + e * D_ * F_, nullptr, dy_RD_ + first * D_,
                       act_RF_ + first * F_, w2 + e * D_ * F_, count, F_, D_);
  }
  swiglu_backward<T>(dgate_RF_, dup_RF_, dact_RF_, gate_RF_, up_RF_, rows_ * F_);
  for (int64_t e = 0; e < E_; ++e) {
    const int64_t first = offsets_E1_[e], count = counts_E_[e];
    if (count == 0) continue;
    linear_backward<T>(dx_RD_ + first * D_, dw1 + e * F_ * D_, nullptr, dgate_RF_ + first * F_,
                       x_RD_ + first * D_, w1 + e * F_ * D_, count, D_, F_);
    linear_backward<T>(dx_RD_ + first * D_, dw3 + e * F_ * D_, nullptr, dup_RF_ + first * F_,
                       x_RD_ + first * D_, w3 + e * F_ * D_, count, D_, F_, /*accumulate_dx=*/true);
  }
}

// router.cpp's guard for sigmoid score sums.
constexpr double kScoreSumEps = 1e-20;

// The aux loss coef * E * sum_e f_e P_e with f (assignment fractions) and P (mean
// probabilities) taken over the global micro-batch, and the z-loss as its mean over it:
// one sum over the ranks of E counts, E probability sums and the sum of squared
// log-sum-exps.
template <typename T>
void MoELayer<T>::global_router_losses(MoEForwardStats& stats) {
  const auto E = static_cast<size_t>(E_);
  std::vector<double> sums(2 * E + 1, 0.0);
  for (int64_t i = 0; i < T_ * K_; ++i) sums[static_cast<size_t>(expert_TK_[i])] += 1.0;
  for (int64_t t = 0; t < T_; ++t) {
    const T* s = scores_TE_ + t * E_;
    double norm = 1.0;
    if (cfg_.score_func == ScoreFunc::Sigmoid) {
      double total = kScoreSumEps;
      for (int64_t e = 0; e < E_; ++e) total += double(s[e]);
      norm = 1.0 / total;
    }
    for (size_t e = 0; e < E; ++e) sums[E + e] += double(s[e]) * norm;
  }
  if (cfg_.z_loss_coef > 0)
    sums[2 * E] = z_loss_forward<T>(logits_TE_, T_, E_, temperature(), 1.0) * static_cast<double>(T_);
  batch_->sum(sums.data(), static_cast<int64_t>(sums.size()));
  const double global_tokens = static_cast<double>(T_ * batch_->size());
  global_fraction_E_.assign(E, 0.0);
  double aux = 0;
  for (size_t e = 0; e < E; ++e) {
    global_fraction_E_[e] = sums[e] / (global_tokens * static_cast<double>(K_));
    aux += global_fraction_E_[e] * sums[E + e] / global_tokens;
  }
  if (cfg_.aux_loss_coef > 0) stats.aux_loss = cfg_.aux_loss_coef * static_cast<double>(E_) * aux;
  if (cfg_.z_loss_coef > 0) stats.z_loss = cfg_.z_loss_coef * sums[2 * E] / global_tokens;
}

// aux_loss_backward with the global fractions: dL/dp_te = coef * E * f_e / (N T).
template <typename T>
void MoELayer<T>::global_aux_backward(double loss_scale) {
  const double global_tokens = static_cast<double>(T_ * batch_->size());
  std::vector<double> g(static_cast<size_t>(E_));
  for (int64_t e = 0; e < E_; ++e)
    g[static_cast<size_t>(e)] = loss_scale * cfg_.aux_loss_coef * static_cast<double>(E_) *
                                global_fraction_E_[static_cast<size_t>(e)] / global_tokens;
  for (int64_t t = 0; t < T_; ++t) {
    const T* s = scores_TE_ + t * E_;
    T* ds = dscores_TE_ + t * E_;
    if (cfg_.score_func == ScoreFunc::Softmax) {
      for (int64_t e = 0; e < E_; ++e) ds[e] = T(double(ds[e]) + g[static_cast<size_t>(e)]);
      continue;
    }
    double sum = kScoreSumEps;
    for (int64_t e = 0; e < E_; ++e) sum += double(s[e]);
    double dot = 0;
    for (int64_t e = 0; e < E_; ++e) dot += g[static_cast<size_t>(e)] * double(s[e]) / sum;
    for (int64_t e = 0; e < E_; ++e) ds[e] = T(double(ds[e]) + (g[static_cast<size_t>(e)] - dot) / sum);
  }
}

// assign_rows with capacity over the global micro-batch: an assignment is kept iff fewer
// than `capacity_` assignments to its expert come before it in the global order (global
// sequences b * N + r, then (t, k) inside a sequence), as the single-process run decides.
// The ranks share their assignments per (sequence, expert). Slots are a relabelling of the
// experts (the same on every rank), so counting by slot keeps the same assignments.
template <typename T>
int64_t MoELayer<T>::assign_rows_global(const int32_t* slot_TK) {
  MOE_CHECK(T_ % S_ == 0, "a data-parallel MoE layer needs whole sequences: {} tokens, sequence length {}", T_, S_);
  const int64_t N = batch_->size(), me = batch_->rank(), B = T_ / S_;
  const auto E = static_cast<size_t>(E_);
  std::vector<int64_t> counts_BE(static_cast<size_t>(B) * E, 0);
  for (int64_t i = 0; i < T_ * K_; ++i) {
    const int32_t e = slot_TK[i];
    MOE_CHECK(e >= 0 && e < E_, "expert index {} at token {} is outside [0, {})", e, i / K_, E_);
    ++counts_BE[static_cast<size_t>(i / K_ / S_) * E + static_cast<size_t>(e)];
  }
  std::vector<int64_t> all_RBE(static_cast<size_t>(N) * counts_BE.size());
  batch_->all_gather(counts_BE.data(), static_cast<int64_t>(counts_BE.size()), all_RBE.data());
  // before_BE[b][e]: assignments to e in the global sequences before this rank's sequence b.
  std::vector<int64_t> before_BE(counts_BE.size()), running(E, 0);
  for (int64_t j = 0; j < N * B; ++j) {
    const int64_t b = j / N, r = j % N;
    if (r == me) std::copy(running.begin(), running.end(), before_BE.begin() + b * E_);
    const int64_t* c = all_RBE.data() + (r * B + b) * E_;
    for (size_t e = 0; e < E; ++e) running[e] += c[e];
  }
  std::fill(counts_E_, counts_E_ + E_, 0);
  std::vector<int64_t> within(E, 0);
  for (int64_t i = 0; i < T_ * K_; ++i) {
    const int64_t b = i / K_ / S_;
    if (i % (S_ * K_) == 0) std::fill(within.begin(), within.end(), 0);  // a new sequence
    const int32_t e = slot_TK[i];
    const bool kept = before_BE[static_cast<size_t>(b) * E + static_cast<size_t>(e)] + within[static_cast<size_t>(e)] < capacity_;
    ++within[static_cast<size_t>(e)];
    row_TK_[i] = kept ? counts_E_[e]++ : -1;
  }
  offsets_E1_[0] = 0;
  for (int64_t e = 0; e < E_; ++e) offsets_E1_[e + 1] = offsets_E1_[e] + counts_E_[e];
  for (int64_t i = 0; i < T_ * K_; ++i) {
    if (row_TK_[i] < 0) continue;
    row_TK_[i] += offsets_E1_[slot_TK[i]];
    token_of_row_R_[row_TK_[i]] = static_cast<int32_t>(i / K_);
  }
  return offsets_E1_[E_];
}

template <typename T>
void MoELayer<T>::set_parallel(MoEBatchGroup* batch, ExpertExchange* exchange, const ExpertSlots* slots) {
  batch_ = batch;
  slots_ = slots;
  dispatcher_.reset();
  if (exchange == nullptr) return;
  MOE_CHECK(slots != nullptr && slots->n_experts() == E_, "MoE layer {}: expert parallelism without slots for its {} experts",
            prefix_, E_);
  dispatcher_ = std::make_unique<ExpertParallelDispatcher<T>>(params_, ExpertWeightIds{w1_, w3_, w2_}, D_, F_, K_,
                                                              *exchange, *slots);
}

template <typename T>
void MoELayer<T>::speculate(const int32_t* tokens_T, const int32_t* prev_TK) {
  if (predictor_ == nullptr || !dispatcher_) return;
  const int64_t Q = predictor_->predict_k();
  guess_TQ_.resize(static_cast<size_t>(T_ * Q));
  predictor_->predict(tokens_T, prev_TK, T_, guess_TQ_.data());
  if (!slots_in_expert_order(*slots_)) {
    const std::vector<int32_t> slot_of = slot_of_expert(*slots_);
    for (int32_t& e : guess_TQ_) e = slot_of[static_cast<size_t>(e)];
  }
  dispatcher_->speculate(guess_TQ_.data(), T_, Q);
}

template <typename T>
const int32_t* MoELayer<T>::slots_of_assignments() {
  slot_of_expert_.clear();
  if (!dispatcher_ || slots_in_expert_order(*slots_)) return expert_TK_;
  MOE_CHECK(slot_TK_ != nullptr, "MoE layer {}: set_parallel after plan()", prefix_);
  slot_of_expert_ = slot_of_expert(*slots_);
  for (int64_t i = 0; i < T_ * K_; ++i) {
    const int32_t e = expert_TK_[i];
    MOE_CHECK(e >= 0 && e < E_, "expert index {} at token {} is outside [0, {})", e, i / K_, E_);
    slot_TK_[i] = slot_of_expert_[static_cast<size_t>(e)];
  }
  return slot_TK_;
}

template <typename T>
void MoELayer<T>::record_routing(int64_t dropped) {
  for (int64_t e = 0; e < E_; ++e)
    routing_.kept_E[static_cast<size_t>(e)] += counts_E_[slot_of_expert_.empty() ? e : slot_of_expert_[static_cast<size_t>(e)]];
  routing_.dropped += dropped;
  routing_.tokens += T_;
  // O(T*E), small next to the expert matmuls.
  const double entropy_sum = router_entropy_sum<T>(scores_TE_, T_, E_);
  routing_.entropy_sum += entropy_sum;
}

template <typename T>
void MoELayer<T>::reset_load() {
  std::fill(load_E_.begin(), load_E_.end(), 0);
  std::fill(routing_.kept_E.begin(), routing_.kept_E.end(), 0);
  routing_.dropped = 0;
  routing_.entropy_sum = 0;
  routing_.tokens = 0;
  routing_.speculation = {};
}

template <typename T>
void MoELayer<T>::update_balancing_bias() {
  bias_balance_update(bias_E_.data(), load_E_.data(), E_, cfg_.bias_update_rate);
}

template <typename T>
void MoELayer<T>::update_temperature(double target) {
  temperature_control_update(temperature_state_.data(), load_E_.data(), E_,
                             TemperatureControl{target, cfg_.temperature_gain, cfg_.temperature_min,
                                                cfg_.temperature_max, cfg_.temperature, cfg_.bias_balancing ? 1 : -1});
}

template class MoELayer<float>;
template class MoELayer<double>;

}  // namespace moe

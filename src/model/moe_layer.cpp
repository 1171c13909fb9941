#include "model/moe_layer.h"

#include <cmath>

#include "kernels/matmul.h"
#include "kernels/swiglu.h"
#include "moe/dispatch.h"
#include "moe/router.h"

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
      F_(config.moe.expert_hidden) {
  router_w_ = params.add({prefix + ".router.weight", Shape{E_, D_}, Init::Normal, config.init_std});
  router_b_ = params.add({prefix + ".router.bias", Shape{E_}, Init::Zeros, 0, /*decay=*/false});
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
}

template <typename T>
void MoELayer<T>::plan(Arena& saved, Arena& scratch, int64_t tokens) {
  T_ = tokens;
  capacity_ = expert_capacity(cfg_.capacity_factor, T_, K_, E_);
  const int64_t max_rows = T_ * K_;
  logits_TE_ = saved.alloc_array<T>(T_ * E_);
  scores_TE_ = saved.alloc_array<T>(T_ * E_);
  weight_TK_ = saved.alloc_array<T>(T_ * K_);
  expert_TK_ = saved.alloc_array<int32_t>(T_ * K_);
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
  linear_forward<T>(logits_TE_, x_TD, params_.value(router_w_), params_.value(router_b_), T_, D_, E_);
  router_scores_forward<T>(scores_TE_, logits_TE_, T_, E_, cfg_.temperature, cfg_.score_func);
  const T* selection_bias = nullptr;
  if (cfg_.bias_balancing) {
    for (int64_t e = 0; e < E_; ++e) bias_T_[static_cast<size_t>(e)] = static_cast<T>(bias_E_[static_cast<size_t>(e)]);
    selection_bias = bias_T_.data();
  }
  router_select<T>(expert_TK_, weight_TK_, scores_TE_, selection_bias, T_, E_, K_, cfg_.renormalize);
  count_expert_load(load_E_.data(), expert_TK_, T_, E_, K_);
  if (cfg_.aux_loss_coef > 0)
    stats.aux_loss = aux_loss_forward<T>(scores_TE_, expert_TK_, T_, E_, K_, cfg_.score_func,
                                         cfg_.aux_loss_coef);
  if (cfg_.z_loss_coef > 0)
    stats.z_loss = z_loss_forward<T>(logits_TE_, T_, E_, cfg_.temperature, cfg_.z_loss_coef);

  rows_ = assign_rows(row_TK_, counts_E_, offsets_E1_, token_of_row_R_, expert_TK_, T_, E_, K_,
                      capacity_);
  stats.dropped = T_ * K_ - rows_;
  record_routing(stats.dropped);
  permute_forward<T>(x_RD_, x_TD, token_of_row_R_, rows_, D_);
  const T* w1 = params_.value(w1_);
  const T* w3 = params_.value(w3_);
  const T* w2 = params_.value(w2_);
  for (int64_t e = 0; e < E_; ++e) {
    const int64_t first = offsets_E1_[e], count = counts_E_[e];
    if (count == 0) continue;
    linear_forward<T>(gate_RF_ + first * F_, x_RD_ + first * D_, w1 + e * F_ * D_, nullptr, count, D_, F_);
    linear_forward<T>(up_RF_ + first * F_, x_RD_ + first * D_, w3 + e * F_ * D_, nullptr, count, D_, F_);
  }
  swiglu_forward<T>(act_RF_, gate_RF_, up_RF_, rows_ * F_);
  for (int64_t e = 0; e < E_; ++e) {
    const int64_t first = offsets_E1_[e], count = counts_E_[e];
    if (count == 0) continue;
    linear_forward<T>(y_RD_ + first * D_, act_RF_ + first * F_, w2 + e * D_ * F_, nullptr, count, F_, D_);
  }
  combine_forward<T>(y_TD, y_RD_, weight_TK_, row_TK_, T_, K_, D_);
  for (auto& ffn : shared_) ffn.forward(y_TD, x_TD, /*accumulate=*/true);
  return stats;
}

template <typename T>
void MoELayer<T>::backward(T* dx_TD, const T* dy_TD, const T* x_TD, double loss_scale) {
  combine_backward<T>(dy_RD_, dweight_TK_, dy_TD, y_RD_, weight_TK_, row_TK_, T_, K_, D_);
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
  permute_backward<T>(dx_TD, dx_RD_, row_TK_, T_, K_, D_, /*accumulate=*/false);

  // Router: combine weights -> scores (+ aux loss) -> logits (+ z loss) -> x.
  router_select_backward<T>(dscores_TE_, dweight_TK_, expert_TK_, scores_TE_, T_, E_, K_,
                            cfg_.renormalize);
  if (cfg_.aux_loss_coef > 0)
    aux_loss_backward<T>(dscores_TE_, scores_TE_, expert_TK_, T_, E_, K_, cfg_.score_func,
                         cfg_.aux_loss_coef, loss_scale);
  router_scores_backward<T>(dlogits_TE_, dscores_TE_, scores_TE_, T_, E_, cfg_.temperature,
                            cfg_.score_func);
  if (cfg_.z_loss_coef > 0)
    z_loss_backward<T>(dlogits_TE_, logits_TE_, T_, E_, cfg_.temperature, cfg_.z_loss_coef, loss_scale);
  linear_backward<T>(dx_TD, params_.grad(router_w_), params_.grad(router_b_), dlogits_TE_, x_TD,
                     params_.value(router_w_), T_, D_, E_, /*accumulate_dx=*/true);
  for (auto& ffn : shared_) ffn.backward(dx_TD, dy_TD, x_TD, /*accumulate_dx=*/true);
}

template <typename T>
void MoELayer<T>::record_routing(int64_t dropped) {
  for (int64_t e = 0; e < E_; ++e) routing_.kept_E[static_cast<size_t>(e)] += counts_E_[e];
  routing_.dropped += dropped;
  routing_.tokens += T_;
  // Entropy of each token's routing distribution: softmax scores as they are, sigmoid
  // scores normalised to sum to 1. O(T*E), small next to the expert matmuls.
  double entropy_sum = 0;
  for (int64_t t = 0; t < T_; ++t) {
    const T* s_E = scores_TE_ + t * E_;
    double total = 0;
    for (int64_t e = 0; e < E_; ++e) total += static_cast<double>(s_E[e]);
    if (total <= 0) continue;
    for (int64_t e = 0; e < E_; ++e) {
      const double p = static_cast<double>(s_E[e]) / total;
      if (p > 0) entropy_sum -= p * std::log(p);
    }
  }
  routing_.entropy_sum += entropy_sum;
}

template <typename T>
void MoELayer<T>::reset_load() {
  std::fill(load_E_.begin(), load_E_.end(), 0);
  std::fill(routing_.kept_E.begin(), routing_.kept_E.end(), 0);
  routing_.dropped = 0;
  routing_.entropy_sum = 0;
  routing_.tokens = 0;
}

template <typename T>
void MoELayer<T>::update_balancing_bias() {
  bias_balance_update(bias_E_.data(), load_E_.data(), E_, cfg_.bias_update_rate);
}

template class MoELayer<float>;
template class MoELayer<double>;

}  // namespace moe

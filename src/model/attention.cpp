#include "model/attention.h"

#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/attention.h"
#include "kernels/matmul.h"
#include "kernels/rope.h"

namespace moe {

template <typename T>
AttentionLayer<T>::AttentionLayer(ParameterStore<T>& params, const ModelConfig& config,
                                  const std::string& prefix)
    : params_(params),
      D_(config.dim),
      H_(config.n_heads),
      G_(config.n_kv_heads),
      d_(config.head_dim()),
      S_(config.seq_len),
      rope_theta_(config.rope_theta) {
  const double residual_std = config.init_std / std::sqrt(2.0 * static_cast<double>(config.n_layers));
  wq_ = params.add({prefix + ".wq", Shape{H_ * d_, D_}, Init::Normal, config.init_std});
  wk_ = params.add({prefix + ".wk", Shape{G_ * d_, D_}, Init::Normal, config.init_std});
  wv_ = params.add({prefix + ".wv", Shape{G_ * d_, D_}, Init::Normal, config.init_std});
  wo_ = params.add({prefix + ".wo", Shape{D_, H_ * d_}, Init::Normal, residual_std});
}

template <typename T>
void AttentionLayer<T>::plan(Arena& saved, Arena& scratch, int64_t B) {
  B_ = B;
  const int64_t T_ = B * S_;
  q_BSHd_ = saved.alloc_array<T>(T_ * H_ * d_);
  k_BSGd_ = saved.alloc_array<T>(T_ * G_ * d_);
  v_BSGd_ = saved.alloc_array<T>(T_ * G_ * d_);
  probs_BHSS_ = saved.alloc_array<T>(B * H_ * S_ * S_);
  out_BSHd_ = saved.alloc_array<T>(T_ * H_ * d_);
  const size_t mark = scratch.mark();
  dout_BSHd_ = scratch.alloc_array<T>(T_ * H_ * d_);
  dq_BSHd_ = scratch.alloc_array<T>(T_ * H_ * d_);
  dk_BSGd_ = scratch.alloc_array<T>(T_ * G_ * d_);
  dv_BSGd_ = scratch.alloc_array<T>(T_ * G_ * d_);
  scratch.release_to(mark);
}

template <typename T>
void AttentionLayer<T>::forward(T* y_TD, const T* x_TD, const int32_t* positions_T) {
  const int64_t T_ = B_ * S_;
  linear_forward<T>(q_BSHd_, x_TD, params_.value(wq_), nullptr, T_, D_, H_ * d_);
  linear_forward<T>(k_BSGd_, x_TD, params_.value(wk_), nullptr, T_, D_, G_ * d_);
  linear_forward<T>(v_BSGd_, x_TD, params_.value(wv_), nullptr, T_, D_, G_ * d_);
  rope_forward<T>(q_BSHd_, positions_T, T_, H_, d_, rope_theta_);
  rope_forward<T>(k_BSGd_, positions_T, T_, G_, d_, rope_theta_);
  attention_forward<T>(out_BSHd_, probs_BHSS_, q_BSHd_, k_BSGd_, v_BSGd_, B_, S_, H_, G_, d_);
  linear_forward<T>(y_TD, out_BSHd_, params_.value(wo_), nullptr, T_, H_ * d_, D_);
}

template <typename T>
void AttentionLayer<T>::forward_cached(T* y_nD, const T* x_nD, int64_t n, int64_t start, T* k_SGd,
                                       T* v_SGd) const {
  std::vector<T> q_nHd(static_cast<size_t>(n * H_ * d_)), out_nHd(q_nHd.size());
  T* k_nGd = k_SGd + start * G_ * d_;
  T* v_nGd = v_SGd + start * G_ * d_;
  std::vector<int32_t> positions_n(static_cast<size_t>(n));
  std::iota(positions_n.begin(), positions_n.end(), static_cast<int32_t>(start));
  linear_forward<T>(q_nHd.data(), x_nD, params_.value(wq_), nullptr, n, D_, H_ * d_);
  linear_forward<T>(k_nGd, x_nD, params_.value(wk_), nullptr, n, D_, G_ * d_);
  linear_forward<T>(v_nGd, x_nD, params_.value(wv_), nullptr, n, D_, G_ * d_);
  rope_forward<T>(q_nHd.data(), positions_n.data(), n, H_, d_, rope_theta_);
  rope_forward<T>(k_nGd, positions_n.data(), n, G_, d_, rope_theta_);
  attention_forward_cached<T>(out_nHd.data(), q_nHd.data(), k_SGd, v_SGd, n, start, H_, G_, d_);
  linear_forward<T>(y_nD, out_nHd.data(), params_.value(wo_), nullptr, n, H_ * d_, D_);
}

template <typename T>
void AttentionLayer<T>::backward(T* dx_TD, const T* dy_TD, const T* x_TD,
                                 const int32_t* positions_T) {
  const int64_t T_ = B_ * S_;
  T *dout_BSHd = dout_BSHd_, *dq_BSHd = dq_BSHd_, *dk_BSGd = dk_BSGd_, *dv_BSGd = dv_BSGd_;
  linear_backward<T>(dout_BSHd, params_.grad(wo_), nullptr, dy_TD, out_BSHd_, params_.value(wo_),
                     T_, H_ * d_, D_);
  attention_backward<T>(dq_BSHd, dk_BSGd, dv_BSGd, dout_BSHd, q_BSHd_, k_BSGd_, v_BSGd_,
                        probs_BHSS_, B_, S_, H_, G_, d_);
  rope_backward<T>(dq_BSHd, positions_T, T_, H_, d_, rope_theta_);
  rope_backward<T>(dk_BSGd, positions_T, T_, G_, d_, rope_theta_);
  linear_backward<T>(dx_TD, params_.grad(wq_), nullptr, dq_BSHd, x_TD, params_.value(wq_), T_, D_,
                     H_ * d_);
  linear_backward<T>(dx_TD, params_.grad(wk_), nullptr, dk_BSGd, x_TD, params_.value(wk_), T_, D_,
                     G_ * d_, /*accumulate_dx=*/true);
  linear_backward<T>(dx_TD, params_.grad(wv_), nullptr, dv_BSGd, x_TD, params_.value(wv_), T_, D_,
                     G_ * d_, /*accumulate_dx=*/true);
}

template class AttentionLayer<float>;
template class AttentionLayer<double>;

}  // namespace moe

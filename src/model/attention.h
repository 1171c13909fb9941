// Causal grouped-query self-attention with RoPE: x_TD -> q, k, v projections, rotary
// positions, softmax(q k^T / sqrt(d)) v, output projection. T = B*S tokens.
#pragma once
#include <string>

#include "core/arena.h"
#include "config/model_config.h"
#include "model/parameters.h"

namespace moe {

template <typename T>
class AttentionLayer {
 public:
  AttentionLayer(ParameterStore<T>& params, const ModelConfig& config, const std::string& prefix);
  // Takes this layer's saved tensors (kept from forward to backward) from `saved`, and
  // its backward scratch from `scratch` (released again, so layers share that region).
  void plan(Arena& saved, Arena& scratch, int64_t B);
  // y_TD = attention(x_TD). Saves what backward needs.
  void forward(T* y_TD, const T* x_TD, const int32_t* positions_T);
  // Incremental decoding: y_nD = attention(x_nD) for n new tokens of one sequence at
  // positions start..start+n-1, writing their K (after RoPE) and V into rows start.. of
  // k_SGd / v_SGd and attending to rows 0..start+n-1 there. Keeps nothing for backward.
  void forward_cached(T* y_nD, const T* x_nD, int64_t n, int64_t start, T* k_SGd, T* v_SGd) const;
  // dx_TD = d attention / dx . dy_TD (overwritten); parameter gradients accumulate.
  void backward(T* dx_TD, const T* dy_TD, const T* x_TD, const int32_t* positions_T);

 private:
  ParameterStore<T>& params_;
  int64_t D_, H_, G_, d_, S_, B_ = 0;
  double rope_theta_;
  int wq_, wk_, wv_, wo_;
  // Saved: rotated q, k; v; softmax probabilities; the heads' concatenated output.
  T *q_BSHd_ = nullptr, *k_BSGd_ = nullptr, *v_BSGd_ = nullptr, *probs_BHSS_ = nullptr,
    *out_BSHd_ = nullptr;
  // Scratch for backward.
  T *dq_BSHd_ = nullptr, *dk_BSGd_ = nullptr, *dv_BSGd_ = nullptr, *dout_BSHd_ = nullptr;
};

}  // namespace moe

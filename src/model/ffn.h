// SwiGLU feed-forward: y = w2 (silu(w1 x) * (w3 x)). Used for the dense FFN of the
// first `first_dense_layers` blocks and for shared experts inside MoE layers.
#pragma once
#include <string>
#include <vector>

#include "core/arena.h"
#include "model/parameters.h"

namespace moe {

struct FeedForwardInit {
  Init init = Init::Normal;  // Normal (w2 scaled for the residual) or Kaiming
  double std = 0.02;
  double residual_std = 0.02;  // std of w2 when init is Normal
};

template <typename T>
class FeedForward {
 public:
  FeedForward(ParameterStore<T>& params, const std::string& prefix, int64_t D, int64_t F,
              FeedForwardInit init);
  void plan(Arena& saved, Arena& scratch, int64_t tokens);
  // y_TD = ffn(x_TD), or y_TD += ffn(x_TD) when accumulate.
  void forward(T* y_TD, const T* x_TD, bool accumulate);
  // The same for `tokens` rows in its own scratch, keeping nothing (decoding).
  void forward_inference(T* y_TD, const T* x_TD, int64_t tokens, bool accumulate) const;
  // dx_TD = (or +=) d ffn / dx . dy_TD; parameter gradients accumulate.
  void backward(T* dx_TD, const T* dy_TD, const T* x_TD, bool accumulate_dx);

 private:
  ParameterStore<T>& params_;
  int64_t D_, F_, T_ = 0;
  int w1_, w3_, w2_;
  T *gate_TF_ = nullptr, *up_TF_ = nullptr, *act_TF_ = nullptr;      // saved
  T *dact_TF_ = nullptr, *dgate_TF_ = nullptr, *dup_TF_ = nullptr;   // scratch
};

}  // namespace moe

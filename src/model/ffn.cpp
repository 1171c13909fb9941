#include "model/ffn.h"

#include "kernels/matmul.h"
#include "kernels/swiglu.h"

namespace moe {

template <typename T>
FeedForward<T>::FeedForward(ParameterStore<T>& params, const std::string& prefix, int64_t D,
                            int64_t F, FeedForwardInit init)
    : params_(params), D_(D), F_(F) {
  const bool kaiming = init.init == Init::Kaiming;
  w1_ = params.add({prefix + ".w1", Shape{F, D}, init.init, init.std});
  w3_ = params.add({prefix + ".w3", Shape{F, D}, init.init, init.std});
  w2_ = params.add({prefix + ".w2", Shape{D, F}, init.init, kaiming ? init.std : init.residual_std});
}

template <typename T>
void FeedForward<T>::plan(Arena& saved, Arena& scratch, int64_t tokens) {
  T_ = tokens;
  gate_TF_ = saved.alloc_array<T>(T_ * F_);
  up_TF_ = saved.alloc_array<T>(T_ * F_);
  act_TF_ = saved.alloc_array<T>(T_ * F_);
  const size_t mark = scratch.mark();
  dact_TF_ = scratch.alloc_array<T>(T_ * F_);
  dgate_TF_ = scratch.alloc_array<T>(T_ * F_);
  dup_TF_ = scratch.alloc_array<T>(T_ * F_);
  scratch.release_to(mark);
}

template <typename T>
void FeedForward<T>::forward(T* y_TD, const T* x_TD, bool accumulate) {
  linear_forward<T>(gate_TF_, x_TD, params_.value(w1_), nullptr, T_, D_, F_);
  linear_forward<T>(up_TF_, x_TD, params_.value(w3_), nullptr, T_, D_, F_);
  swiglu_forward<T>(act_TF_, gate_TF_, up_TF_, T_ * F_);
  gemm<T>(false, true, T_, D_, F_, T(1), act_TF_, F_, params_.value(w2_), F_,
          accumulate ? T(1) : T(0), y_TD, D_);
}

template <typename T>
void FeedForward<T>::forward_inference(T* y_TD, const T* x_TD, int64_t tokens, bool accumulate) const {
  std::vector<T> gate_TF(static_cast<size_t>(tokens * F_)), up_TF(gate_TF.size()), act_TF(gate_TF.size());
  linear_forward<T>(gate_TF.data(), x_TD, params_.value(w1_), nullptr, tokens, D_, F_);
  linear_forward<T>(up_TF.data(), x_TD, params_.value(w3_), nullptr, tokens, D_, F_);
  swiglu_forward<T>(act_TF.data(), gate_TF.data(), up_TF.data(), tokens * F_);
  gemm<T>(false, true, tokens, D_, F_, T(1), act_TF.data(), F_, params_.value(w2_), F_, accumulate ? T(1) : T(0),
          y_TD, D_);
}

template <typename T>
void FeedForward<T>::backward(T* dx_TD, const T* dy_TD, const T* x_TD, bool accumulate_dx) {
  linear_backward<T>(dact_TF_, params_.grad(w2_), nullptr, dy_TD, act_TF_, params_.value(w2_), T_,
                     F_, D_);
  swiglu_backward<T>(dgate_TF_, dup_TF_, dact_TF_, gate_TF_, up_TF_, T_ * F_);
  linear_backward<T>(dx_TD, params_.grad(w1_), nullptr, dgate_TF_, x_TD, params_.value(w1_), T_, D_,
                     F_, accumulate_dx);
  linear_backward<T>(dx_TD, params_.grad(w3_), nullptr, dup_TF_, x_TD, params_.value(w3_), T_, D_,
                     F_, /*accumulate_dx=*/true);
}

template class FeedForward<float>;
template class FeedForward<double>;

}  // namespace moe

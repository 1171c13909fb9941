// Softmax cross-entropy over a vocabulary: the mean, over tokens whose target is not -1
// (ignored), of -log softmax(logits)[target].
// Convention for all ops: parameter gradients accumulate (+=); activation gradients
// are overwritten unless a flag says to accumulate.
#pragma once
#include <cstdint>

namespace moe {

// Writes the log-sum-exp of every row to lse_T (ignored rows included) and returns the
// mean loss, with the per-row losses summed in fp64 in row order. Returns 0 when every
// target is ignored. Targets outside [-1, V) are an error naming the position.
template <typename T>
double cross_entropy_forward(T* lse_T, const T* logits_TV, const int32_t* targets_T, int64_t T_,
                             int64_t V);

// dlogits = dloss * (softmax(logits) - onehot(target)) / n_valid; rows with target -1 get
// zeros. Overwrites dlogits_TV, which may alias logits_TV (computed in place).
template <typename T>
void cross_entropy_backward(T* dlogits_TV, const T* logits_TV, const T* lse_T,
                            const int32_t* targets_T, int64_t T_, int64_t V, double dloss);

}  // namespace moe

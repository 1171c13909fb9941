// Token embedding lookup: out_TD[t] = table_VD[ids_T[t]].
// Convention for all ops: parameter gradients accumulate (+=); activation gradients
// are overwritten unless a flag says to accumulate.
#pragma once
#include <cstdint>

namespace moe {

// Throws moe::Error naming the id, its position and V when an id is outside [0, V).
template <typename T>
void embedding_forward(T* out_TD, const int32_t* ids_T, const T* table_VD, int64_t T_, int64_t V,
                       int64_t D);

// dtable_VD[ids_T[t]] += dout_TD[t] for every t. Rows hit by several tokens are summed
// in token order, so the result does not depend on the thread count.
template <typename T>
void embedding_backward(T* dtable_VD, const int32_t* ids_T, const T* dout_TD, int64_t T_, int64_t V,
                        int64_t D);

}  // namespace moe

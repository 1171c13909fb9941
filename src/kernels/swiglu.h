// SwiGLU activation, elementwise: act = silu(gate) * up, silu(x) = x * sigmoid(x).
// Convention for all ops: parameter gradients accumulate (+=); activation gradients
// are overwritten unless a flag says to accumulate.
#pragma once
#include <cstdint>

namespace moe {

template <typename T>
void swiglu_forward(T* act, const T* gate, const T* up, int64_t count);

// Overwrites dgate and dup.
template <typename T>
void swiglu_backward(T* dgate, T* dup, const T* dact, const T* gate, const T* up, int64_t count);

}  // namespace moe

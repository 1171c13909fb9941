// Rotary position embedding, HF / GPT-NeoX "rotate_half" layout: within each head of
// size d, element i pairs with element i + d/2 and the pair is rotated by the angle
// position * theta^(-2i/d). Works in place on x_TNd ([T, N heads, d]); positions_T
// gives each token's position. Angles, cos and sin are computed in fp64, then cast to T.
#pragma once
#include <cstdint>

namespace moe {

// x <- R(pos) x for every token and head. d must be even; positions must be >= 0.
template <typename T>
void rope_forward(T* x_TNd, const int32_t* positions_T, int64_t T_, int64_t N, int64_t d,
                  double theta);

// dx <- R(pos)^T dx, in place: the gradient of rope_forward (the rotation's transpose).
template <typename T>
void rope_backward(T* dx_TNd, const int32_t* positions_T, int64_t T_, int64_t N, int64_t d,
                   double theta);

}  // namespace moe

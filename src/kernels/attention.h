// Causal grouped-query attention core, after the projections and RoPE.
// q_BSHd is [B, S, H, d]; k_BSGd and v_BSGd are [B, S, G, d] with H % G == 0, and query
// head h reads kv head h / (H / G). Scores are scaled by 1/sqrt(d); position i attends
// to positions 0..i. The softmax probabilities are saved for the backward pass.
// Convention for all ops: parameter gradients accumulate (+=); activation gradients
// are overwritten unless a flag says to accumulate.
#pragma once
#include <cstdint>

namespace moe {

// Writes out_BSHd and probs_BHSS ([B, H, S, S], zeros above the diagonal).
template <typename T>
void attention_forward(T* out_BSHd, T* probs_BHSS, const T* q_BSHd, const T* k_BSGd,
                       const T* v_BSGd, int64_t B, int64_t S, int64_t H, int64_t G, int64_t d);

// Incremental decoding (model/kv_cache.h): n new queries q_nHd at positions start..start+n-1
// of one sequence attend to the cached keys and values k_LGd / v_LGd of positions
// 0..start+n-1 (L = start + n; the new tokens' rows already written). The same arithmetic
// as attention_forward's rows for those positions; probabilities are not kept.
template <typename T>
void attention_forward_cached(T* out_nHd, const T* q_nHd, const T* k_LGd, const T* v_LGd, int64_t n, int64_t start,
                              int64_t H, int64_t G, int64_t d);

// Overwrites dq_BSHd, dk_BSGd and dv_BSGd. The query heads that share a kv head are
// summed into dk / dv in a fixed order, so the result does not depend on the thread count.
template <typename T>
void attention_backward(T* dq_BSHd, T* dk_BSGd, T* dv_BSGd, const T* dout_BSHd, const T* q_BSHd,
                        const T* k_BSGd, const T* v_BSGd, const T* probs_BHSS, int64_t B, int64_t S,
                        int64_t H, int64_t G, int64_t d);

}  // namespace moe

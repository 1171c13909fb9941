// MoE routing on the CPU: router scores, top-k selection, the load-balancing losses
// (Switch aux loss, router z-loss) and DeepSeek-V3 bias balancing, each with its
// hand-written backward. These are the CPU reference ops that the GPU router kernels are
// tested against (see DESIGN.md, "MoE layer, forward").
//
// Conventions:
// - Shapes by suffix: T tokens, E experts, K chosen experts per token. Row-major.
// - Gradients are overwritten unless the parameter comment says ACCUMULATES.
// - Sums are accumulated in double in a fixed order (per token over experts, then over
//   fixed-size token chunks), so results are bit-identical for any OpenMP thread count.
#pragma once
#include <cstdint>

#include "config/model_config.h"

namespace moe {

// scores_TE = softmax over each row of logits_TE / temperature, or sigmoid of it.
template <typename T>
void router_scores_forward(T* scores_TE, const T* logits_TE, int64_t T_, int64_t E,
                           double temperature, ScoreFunc f);

// dlogits_TE (overwritten) from dscores_TE and the forward's scores_TE.
template <typename T>
void router_scores_backward(T* dlogits_TE, const T* dscores_TE, const T* scores_TE, int64_t T_,
                            int64_t E, double temperature, ScoreFunc f);

// Group-limited routing (DeepSeek-V3's node-limited routing): the E experts form `groups`
// equal groups of consecutive experts; a token first takes the `top_groups` groups whose
// two best selection keys sum highest (the one key for groups of one; equal sums go to
// the lower group), then its K experts from those groups only. groups <= 1: off.
struct RouteGroups {
  int64_t groups = 0, top_groups = 0;
  bool on() const { return groups > 1; }
};
// Throws unless groups divides E, 1 <= top_groups <= groups and K <= top_groups * E / groups.
void check_route_groups(const RouteGroups& g, int64_t E, int64_t K);

// Top-K experts of each token by selection score scores_TE + bias_E (bias_E may be null).
// The bias steers only the choice (DeepSeek-V3): weight_TK is the unbiased score of the
// chosen expert, divided by the sum of the K chosen unbiased scores when `renormalize`.
// Slot k = 0 holds the highest selection score; equal selection scores go to the lower
// expert index. Requires 1 <= K <= E. With `groups` on, only experts of the token's
// chosen groups are candidates (the backward is unchanged: it follows expert_TK).
template <typename T>
void router_select(int32_t* expert_TK, T* weight_TK, const T* scores_TE, const T* bias_E,
                   int64_t T_, int64_t E, int64_t K, bool renormalize, const RouteGroups& groups = {});

// dscores_TE (overwritten; zero for experts a token did not choose) from dweight_TK,
// through the renormalisation when it was on. The bias gets no gradient.
template <typename T>
void router_select_backward(T* dscores_TE, const T* dweight_TK, const int32_t* expert_TK,
                            const T* scores_TE, int64_t T_, int64_t E, int64_t K,
                            bool renormalize);

// Switch-style load-balance loss: coef * E * sum_e f_e * P_e, where f_e is the fraction of
// the T*K assignments that went to e (before capacity dropping; carries no gradient) and
// P_e the mean over tokens of the token's probability for e (softmax scores as they are,
// sigmoid scores normalised to sum 1 per token). Uniform routing gives exactly `coef`.
template <typename T>
double aux_loss_forward(const T* scores_TE, const int32_t* expert_TK, int64_t T_, int64_t E,
                        int64_t K, ScoreFunc f, double coef);

// dscores_TE ACCUMULATES dloss * d(aux loss)/d(scores).
template <typename T>
void aux_loss_backward(T* dscores_TE, const T* scores_TE, const int32_t* expert_TK, int64_t T_,
                       int64_t E, int64_t K, ScoreFunc f, double coef, double dloss);

// Router entropy summed over the T_ tokens (nats, double): each token's distribution is
// its scores as they are (softmax) or normalised to sum 1 (sigmoid; a row summing to 0
// adds nothing). A metric, not a loss: no backward. The GPU's accumulate_routing_stats
// is tested against it.
template <typename T>
double router_entropy_sum(const T* scores_TE, int64_t T_, int64_t E);

// Router z-loss (ST-MoE): coef * mean over tokens of logsumexp_e(logits_te / temperature)^2.
template <typename T>
double z_loss_forward(const T* logits_TE, int64_t T_, int64_t E, double temperature, double coef);

// dlogits_TE ACCUMULATES dloss * d(z loss)/d(logits).
template <typename T>
void z_loss_backward(T* dlogits_TE, const T* logits_TE, int64_t T_, int64_t E, double temperature,
                     double coef, double dloss);

// load_E ACCUMULATES the number of assignments per expert (before capacity dropping).
// Throws if an expert index is outside [0, E).
void count_expert_load(int64_t* load_E, const int32_t* expert_TK, int64_t T_, int64_t E,
                       int64_t K);

// Aux-loss-free balancing (DeepSeek-V3): bias_e += rate * sign(mean(load) - load_e), with
// sign(0) = 0, so overloaded experts become less attractive and idle ones more.
void bias_balance_update(float* bias_E, const int64_t* load_E, int64_t E, double rate);

}  // namespace moe

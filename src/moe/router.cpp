#include "moe/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"

namespace moe {
namespace {

// Added to the sums that normalise weights (renormalisation, sigmoid probabilities) so that
// an all-underflowed row gives 0 rather than NaN. It is below double's resolution of any
// sum that matters, so it changes neither values nor gradients in practice.
constexpr double kNormEps = 1e-20;

// Below this many element operations a loop runs on one thread: forking costs more than
// it saves (and is expensive when the cores are oversubscribed).
constexpr int64_t kMinParallelWork = 1 << 14;

// Tokens per partial sum in ordered_sum. Fixed, so the summation order never depends on
// how many threads run.
constexpr int64_t kSumChunk = 256;

// Sum of term(t) over t in [0, n): chunks of kSumChunk tokens in parallel, then the chunk
// sums in chunk order.
template <typename Term>
double ordered_sum(int64_t n, const Term& term) {
  const int64_t chunks = (n + kSumChunk - 1) / kSumChunk;
  std::vector<double> partial(static_cast<size_t>(chunks));
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = std::min(n, (c + 1) * kSumChunk);
    double sum = 0;
    for (int64_t t = c * kSumChunk; t < end; ++t) sum += term(t);
    partial[static_cast<size_t>(c)] = sum;
  }
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

void check_shape(int64_t T_, int64_t E) {
  MOE_CHECK(T_ >= 0, "token count {} is negative", T_);
  MOE_CHECK(E >= 1, "expert count {} must be at least 1", E);
}

void check_temperature(double temperature) {
  MOE_CHECK(std::isfinite(temperature) && temperature > 0, "router temperature {} must be > 0",
            temperature);
}

void check_top_k(int64_t E, int64_t K) {
  MOE_CHECK(K >= 1 && K <= E, "top-k {} must be in [1, E = {}]", K, E);
}

// Serial, so a bad index throws here instead of inside a parallel region.
void check_experts(const int32_t* expert_TK, int64_t T_, int64_t E, int64_t K) {
  for (int64_t i = 0; i < T_ * K; ++i)
    MOE_CHECK(expert_TK[i] >= 0 && expert_TK[i] < E,
              "expert index {} at token {} slot {} is outside [0, {})", expert_TK[i], i / K,
              i % K, E);
}

// Row maximum and sum of exp(z - max) of z = row / temperature, in double.
template <typename T>
void softmax_stats(const T* row, int64_t E, double inv_temp, double& max, double& sum) {
  max = -std::numeric_limits<double>::infinity();
  for (int64_t e = 0; e < E; ++e) max = std::max(max, double(row[e]) * inv_temp);
  sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += std::exp(double(row[e]) * inv_temp - max);
}

template <typename T>
double logsumexp_row(const T* row, int64_t E, double inv_temp) {
  double max, sum;
  softmax_stats(row, E, inv_temp, max, sum);
  return max + std::log(sum);
}

// Assignments per expert divided by T*K: the f_e of the aux loss.
std::vector<double> assignment_fractions(const int32_t* expert_TK, int64_t T_, int64_t E,
                                         int64_t K) {
  std::vector<int64_t> load(static_cast<size_t>(E), 0);
  count_expert_load(load.data(), expert_TK, T_, E, K);
  std::vector<double> fraction(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) fraction[e] = double(load[e]) / double(T_ * K);
  return fraction;
}

}  // namespace

template <typename T>
void router_scores_forward(T* scores_TE, const T* logits_TE, int64_t T_, int64_t E,
                           double temperature, ScoreFunc f) {
  check_shape(T_, E);
  check_temperature(temperature);
  const double inv_temp = 1.0 / temperature;
#pragma omp parallel for schedule(static) if (T_ * E >= kMinParallelWork)
  for (int64_t t = 0; t < T_; ++t) {
    const T* z = logits_TE + t * E;
    T* s = scores_TE + t * E;
    if (f == ScoreFunc::Softmax) {
      double max, sum;
      softmax_stats(z, E, inv_temp, max, sum);
      for (int64_t e = 0; e < E; ++e) s[e] = T(std::exp(double(z[e]) * inv_temp - max) / sum);
    } else {
      for (int64_t e = 0; e < E; ++e) s[e] = T(1.0 / (1.0 + std::exp(-double(z[e]) * inv_temp)));
    }
  }
}

template <typename T>
void router_scores_backward(T* dlogits_TE, const T* dscores_TE, const T* scores_TE, int64_t T_,
                            int64_t E, double temperature, ScoreFunc f) {
  check_shape(T_, E);
  check_temperature(temperature);
  const double inv_temp = 1.0 / temperature;
#pragma omp parallel for schedule(static) if (T_ * E >= kMinParallelWork)
  for (int64_t t = 0; t < T_; ++t) {
    const T* ds = dscores_TE + t * E;
    const T* s = scores_TE + t * E;
    T* dz = dlogits_TE + t * E;
    if (f == ScoreFunc::Softmax) {
      // d logit_e = s_e * (ds_e - sum_j ds_j s_j) / temperature
      double dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += double(ds[e]) * double(s[e]);
      for (int64_t e = 0; e < E; ++e)
        dz[e] = T(double(s[e]) * (double(ds[e]) - dot) * inv_temp);
    } else {
      for (int64_t e = 0; e < E; ++e)
        dz[e] = T(double(ds[e]) * double(s[e]) * (1.0 - double(s[e])) * inv_temp);
    }
  }
}

void check_route_groups(const RouteGroups& g, int64_t E, int64_t K) {
  if (!g.on()) return;
  MOE_CHECK(E % g.groups == 0, "route groups: {} experts do not form {} equal groups", E, g.groups);
  MOE_CHECK(g.top_groups >= 1 && g.top_groups <= g.groups, "route groups: top {} of {} groups", g.top_groups,
            g.groups);
  MOE_CHECK(K <= g.top_groups * (E / g.groups), "route groups: top-{} needs more experts than {} groups of {} hold",
            K, g.top_groups, E / g.groups);
}

template <typename T>
void router_select(int32_t* expert_TK, T* weight_TK, const T* scores_TE, const T* bias_E,
                   int64_t T_, int64_t E, int64_t K, bool renormalize, const RouteGroups& groups) {
  check_shape(T_, E);
  check_top_k(E, K);
  check_route_groups(groups, E, K);
  MOE_CHECK(E <= std::numeric_limits<int32_t>::max(), "expert count {} exceeds int32", E);
  const int64_t G = groups.on() ? groups.groups : 1, per_group = E / G;
#pragma omp parallel for schedule(static) if (T_ * E >= kMinParallelWork)
  for (int64_t t = 0; t < T_; ++t) {
    const T* s = scores_TE + t * E;
    // Selection key in T, as the GPU computes it. NaN sorts last so the order stays total.
    auto key = [&](int64_t e) -> T {
      const T k = bias_E ? T(s[e] + bias_E[e]) : s[e];
      return std::isnan(k) ? -std::numeric_limits<T>::infinity() : k;
    };
    // Groups: the sum of each group's two best keys (the GPU's arithmetic), then the
    // top_groups groups by (sum descending, index ascending); 64 groups at most per word.
    std::vector<bool> group_taken;
    if (groups.on()) {
      std::vector<T> group_score(static_cast<size_t>(G));
      for (int64_t g = 0; g < G; ++g) {
        T first = -std::numeric_limits<T>::infinity(), second = first;
        for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) {
          const T k = key(e);
          if (k > first) second = first, first = k;
          else if (k > second) second = k;
        }
        group_score[static_cast<size_t>(g)] = per_group == 1 ? first : T(first + second);
      }
      group_taken.assign(static_cast<size_t>(G), false);
      for (int64_t m = 0; m < groups.top_groups; ++m) {
        int64_t best = -1;
        for (int64_t g = 0; g < G; ++g)
          if (!group_taken[static_cast<size_t>(g)] &&
              (best < 0 || group_score[static_cast<size_t>(g)] > group_score[static_cast<size_t>(best)]))
            best = g;
        group_taken[static_cast<size_t>(best)] = true;
      }
    }
    auto candidate = [&](int64_t e) { return group_taken.empty() || group_taken[static_cast<size_t>(e / per_group)]; };
    // Order candidates by (key descending, index ascending); slot k takes the first expert
    // after slot k-1's in that order. O(K*E) and no scratch memory.
    int32_t* chosen = expert_TK + t * K;
    T prev_key = std::numeric_limits<T>::infinity();
    int64_t prev = -1;
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      T best_key = T(0);
      for (int64_t e = 0; e < E; ++e) {
        if (!candidate(e)) continue;
        const T ke = key(e);
        const bool after_prev = ke < prev_key || (ke == prev_key && e > prev);
        if (!after_prev) continue;
        if (best < 0 || ke > best_key) {  // strict: ties keep the lower index
          best = e;
          best_key = ke;
        }
      }
      chosen[k] = static_cast<int32_t>(best);
      prev = best;
      prev_key = best_key;
    }
    double sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += double(s[chosen[k]]);
    const double scale = renormalize ? 1.0 / (sum + kNormEps) : 1.0;
    for (int64_t k = 0; k < K; ++k) weight_TK[t * K + k] = T(double(s[chosen[k]]) * scale);
  }
}

template <typename T>
void router_select_backward(T* dscores_TE, const T* dweight_TK, const int32_t* expert_TK,
                            const T* scores_TE, int64_t T_, int64_t E, int64_t K,
                            bool renormalize) {
  check_shape(T_, E);
  check_top_k(E, K);
  check_experts(expert_TK, T_, E, K);
#pragma omp parallel for schedule(static) if (T_ * E >= kMinParallelWork)
  for (int64_t t = 0; t < T_; ++t) {
    const T* s = scores_TE + t * E;
    const T* dw = dweight_TK + t * K;
    const int32_t* chosen = expert_TK + t * K;
    T* ds = dscores_TE + t * E;
    std::fill(ds, ds + E, T(0));
    if (!renormalize) {
      for (int64_t k = 0; k < K; ++k) ds[chosen[k]] += dw[k];
      continue;
    }
    // w_k = s_k / S  =>  dL/ds_j = (dw_j - sum_k dw_k w_k) / S. Accumulating per slot also
    // gives the right answer if an expert appeared in two slots.
    double sum = kNormEps;
    for (int64_t k = 0; k < K; ++k) sum += double(s[chosen[k]]);
    double dot = 0;
    for (int64_t k = 0; k < K; ++k) dot += double(dw[k]) * double(s[chosen[k]]) / sum;
    for (int64_t k = 0; k < K; ++k) ds[chosen[k]] += T((double(dw[k]) - dot) / sum);
  }
}

template <typename T>
double aux_loss_forward(const T* scores_TE, const int32_t* expert_TK, int64_t T_, int64_t E,
                        int64_t K, ScoreFunc f, double coef) {
  check_shape(T_, E);
  check_top_k(E, K);
  if (T_ == 0) return 0.0;
  const std::vector<double> fraction = assignment_fractions(expert_TK, T_, E, K);
  // sum_e f_e P_e = (1/T) sum_t sum_e f_e p_te, summed per token then in fixed chunks.
  const double total = ordered_sum(T_, [&](int64_t t) {
    const T* s = scores_TE + t * E;
    double norm = 1.0;
    if (f == ScoreFunc::Sigmoid) {
      double sum = kNormEps;
      for (int64_t e = 0; e < E; ++e) sum += double(s[e]);
      norm = 1.0 / sum;
    }
    double term = 0;
    for (int64_t e = 0; e < E; ++e) term += fraction[e] * double(s[e]) * norm;
    return term;
  });
  return coef * double(E) * total / double(T_);
}

template <typename T>
double router_entropy_sum(const T* scores_TE, int64_t T_, int64_t E) {
  check_shape(T_, E);
  double entropy_sum = 0;
  for (int64_t t = 0; t < T_; ++t) {
    const T* s_E = scores_TE + t * E;
    double total = 0;
    for (int64_t e = 0; e < E; ++e) total += static_cast<double>(s_E[e]);
    if (total <= 0) continue;
    for (int64_t e = 0; e < E; ++e) {
      const double p = static_cast<double>(s_E[e]) / total;
      if (p > 0) entropy_sum -= p * std::log(p);
    }
  }
  return entropy_sum;
}

template <typename T>
void aux_loss_backward(T* dscores_TE, const T* scores_TE, const int32_t* expert_TK, int64_t T_,
                       int64_t E, int64_t K, ScoreFunc f, double coef, double dloss) {
  check_shape(T_, E);
  check_top_k(E, K);
  if (T_ == 0) return;
  const std::vector<double> fraction = assignment_fractions(expert_TK, T_, E, K);
  // g_e = dL/dp_te, the same for every token.
  std::vector<double> g(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) g[e] = dloss * coef * double(E) * fraction[e] / double(T_);
#pragma omp parallel for schedule(static) if (T_ * E >= kMinParallelWork)
  for (int64_t t = 0; t < T_; ++t) {
    const T* s = scores_TE + t * E;
    T* ds = dscores_TE + t * E;
    if (f == ScoreFunc::Softmax) {
      for (int64_t e = 0; e < E; ++e) ds[e] = T(double(ds[e]) + g[e]);
      continue;
    }
    // p_e = s_e / S  =>  dL/ds_e = (g_e - sum_j g_j p_j) / S
    double sum = kNormEps;
    for (int64_t e = 0; e < E; ++e) sum += double(s[e]);
    double dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += g[e] * double(s[e]) / sum;
    for (int64_t e = 0; e < E; ++e) ds[e] = T(double(ds[e]) + (g[e] - dot) / sum);
  }
}

template <typename T>
double z_loss_forward(const T* logits_TE, int64_t T_, int64_t E, double temperature, double coef) {
  check_shape(T_, E);
  check_temperature(temperature);
  if (T_ == 0) return 0.0;
  const double inv_temp = 1.0 / temperature;
  const double total = ordered_sum(T_, [&](int64_t t) {
    const double lse = logsumexp_row(logits_TE + t * E, E, inv_temp);
    return lse * lse;
  });
  return coef * total / double(T_);
}

template <typename T>
void z_loss_backward(T* dlogits_TE, const T* logits_TE, int64_t T_, int64_t E, double temperature,
                     double coef, double dloss) {
  check_shape(T_, E);
  check_temperature(temperature);
  if (T_ == 0) return;
  const double inv_temp = 1.0 / temperature;
  // d/dz_te of coef/T * lse_t^2 = coef/T * 2 lse_t * softmax_te / temperature
  const double scale = dloss * coef * 2.0 / double(T_) * inv_temp;
#pragma omp parallel for schedule(static) if (T_ * E >= kMinParallelWork)
  for (int64_t t = 0; t < T_; ++t) {
    const T* z = logits_TE + t * E;
    T* dz = dlogits_TE + t * E;
    double max, sum;
    softmax_stats(z, E, inv_temp, max, sum);
    const double lse = max + std::log(sum);
    for (int64_t e = 0; e < E; ++e) {
      const double p = std::exp(double(z[e]) * inv_temp - max) / sum;
      dz[e] = T(double(dz[e]) + scale * lse * p);
    }
  }
}

void count_expert_load(int64_t* load_E, const int32_t* expert_TK, int64_t T_, int64_t E,
                       int64_t K) {
  check_shape(T_, E);
  MOE_CHECK(K >= 1, "top-k {} must be at least 1", K);
  check_experts(expert_TK, T_, E, K);
  for (int64_t i = 0; i < T_ * K; ++i) ++load_E[expert_TK[i]];
}

void bias_balance_update(float* bias_E, const int64_t* load_E, int64_t E, double rate) {
  MOE_CHECK(E >= 1, "expert count {} must be at least 1", E);
  MOE_CHECK(std::isfinite(rate) && rate >= 0, "bias update rate {} must be >= 0", rate);
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) total += load_E[e];
  // sign(mean - load_e) = sign(total - E * load_e), exact in integers.
  for (int64_t e = 0; e < E; ++e) {
    const int64_t diff = total - E * load_E[e];
    const int sign = (diff > 0) - (diff < 0);
    bias_E[e] = float(double(bias_E[e]) + rate * sign);
  }
}

#define MOE_INSTANTIATE(T)                                                                     \
  template void router_scores_forward<T>(T*, const T*, int64_t, int64_t, double, ScoreFunc);   \
  template void router_scores_backward<T>(T*, const T*, const T*, int64_t, int64_t, double,    \
                                          ScoreFunc);                                          \
  template void router_select<T>(int32_t*, T*, const T*, const T*, int64_t, int64_t, int64_t,  \
                                 bool, const RouteGroups&);                                    \
  template void router_select_backward<T>(T*, const T*, const int32_t*, const T*, int64_t,     \
                                          int64_t, int64_t, bool);                             \
  template double aux_loss_forward<T>(const T*, const int32_t*, int64_t, int64_t, int64_t,     \
                                      ScoreFunc, double);                                      \
  template double router_entropy_sum<T>(const T*, int64_t, int64_t);                           \
  template void aux_loss_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t,  \
                                     ScoreFunc, double, double);                               \
  template double z_loss_forward<T>(const T*, int64_t, int64_t, double, double);               \
  template void z_loss_backward<T>(T*, const T*, int64_t, int64_t, double, double, double);
MOE_INSTANTIATE(float)
MOE_INSTANTIATE(double)
#undef MOE_INSTANTIATE

}  // namespace moe

#include "kernels/fp8_blockwise.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/fp8.h"

namespace moe::fp8 {
namespace {

struct Group {
  int64_t first, rows;
};

// The row groups: the experts' (from offsets_E1), or one group of all R rows.
std::vector<Group> groups_of(const int32_t* offsets_E1, int64_t E, int64_t R) {
  if (offsets_E1 == nullptr) return {{0, R}};
  std::vector<Group> groups;
  for (int64_t e = 0; e < E; ++e) {
    MOE_CHECK(offsets_E1[e] <= offsets_E1[e + 1] && offsets_E1[e] >= 0, "fp8 quantisation: offsets not ascending");
    groups.push_back({offsets_E1[e], offsets_E1[e + 1] - offsets_E1[e]});
  }
  MOE_CHECK(offsets_E1[E] <= R, "fp8 quantisation: offsets reach row {} of {}", offsets_E1[E], R);
  return groups;
}

void check_k(int64_t K) {
  MOE_CHECK(K > 0 && K % kBlock == 0, "fp8 blockwise quantisation: K = {} is not a multiple of {}", K, kBlock);
}

}  // namespace

void quantize_rows_blockwise(uint8_t* codes_RK, float* scales, const bf16* x, int64_t ld_x,
                             const int32_t* offsets_E1, int64_t E, int64_t R, int64_t K) {
  check_k(K);
  const int64_t KB = K / kBlock;
  for (const Group& g : groups_of(offsets_E1, E, R))
    for (int64_t r = g.first; r < g.first + g.rows; ++r)
      for (int64_t kb = 0; kb < KB; ++kb) {
        const bf16* in = x + r * ld_x + kb * kBlock;
        float amax = 0.0f;
        for (int64_t k = 0; k < kBlock; ++k) amax = std::fmax(amax, std::fabs(bf16_to_float(in[k])));
        const float scale = block_scale(amax), inverse = block_scale_inverse(scale);
        scales[activation_scale_index(g.first, g.rows, r, kb, KB)] = scale;
        for (int64_t k = 0; k < kBlock; ++k)
          codes_RK[r * K + kb * kBlock + k] = float_to_fp8_e4m3(bf16_to_float(in[k]) * inverse);
      }
}

void dequantize_rows_blockwise(float* x_RK, const uint8_t* codes_RK, const float* scales, const int32_t* offsets_E1,
                               int64_t E, int64_t R, int64_t K) {
  check_k(K);
  const int64_t KB = K / kBlock;
  for (const Group& g : groups_of(offsets_E1, E, R))
    for (int64_t r = g.first; r < g.first + g.rows; ++r)
      for (int64_t k = 0; k < K; ++k)
        x_RK[r * K + k] =
            fp8_e4m3_to_float(codes_RK[r * K + k]) * scales[activation_scale_index(g.first, g.rows, r, k / kBlock, KB)];
}

WeightBlocksPlaces resolve_weight_places(int64_t N, int64_t K, WeightBlocksPlace place, WeightBlocksPlace place_t) {
  const int64_t NB = blocks(N), KB = blocks(K);
  const WeightBlocksPlaces p{place.resolved(N, K, KB, NB), place_t.resolved(K, N, NB, KB)};
  auto fits = [](const WeightBlocksPlace& q, int64_t rows, int64_t cols, int64_t scale_rows, int64_t scale_cols) {
    return q.codes_ld >= cols && q.expert_codes >= (rows - 1) * q.codes_ld + cols && q.scales_ld >= scale_cols &&
           q.expert_scales >= (scale_rows - 1) * q.scales_ld + scale_cols;
  };
  MOE_CHECK(fits(p.stored, N, K, KB, NB) && fits(p.transposed, K, N, NB, KB),
            "fp8 weight quantisation: a place with rows or experts that overlap (codes ld {} / {}, scales ld {} / {})",
            p.stored.codes_ld, p.transposed.codes_ld, p.stored.scales_ld, p.transposed.scales_ld);
  return p;
}

void quantize_weight_blocks(uint8_t* codes_ENK, float* scales, uint8_t* codes_t_EKN, float* scales_t,
                            const bf16* w_ENK, int64_t E, int64_t N, int64_t K, WeightBlocksPlace place,
                            WeightBlocksPlace place_t) {
  MOE_CHECK(E >= 0 && N > 0 && K > 0, "fp8 weight quantisation: bad shape [{}, {}, {}]", E, N, K);
  MOE_CHECK((codes_ENK == nullptr) == (scales == nullptr) && (codes_t_EKN == nullptr) == (scales_t == nullptr) &&
                (codes_ENK != nullptr || codes_t_EKN != nullptr),
            "fp8 weight quantisation: codes go with their scales, and at least one of the two copies");
  const WeightBlocksPlaces p = resolve_weight_places(N, K, place, place_t);
  const int64_t NB = blocks(N), KB = blocks(K);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t nb = 0; nb < NB; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb) {
        const int64_t n_end = std::min(N, (nb + 1) * kBlock), k_end = std::min(K, (kb + 1) * kBlock);
        float amax = 0.0f;
        for (int64_t n = nb * kBlock; n < n_end; ++n)
          for (int64_t k = kb * kBlock; k < k_end; ++k)
            amax = std::fmax(amax, std::fabs(bf16_to_float(w_ENK[(e * N + n) * K + k])));
        const float scale = block_scale(amax), inverse = block_scale_inverse(scale);
        if (scales != nullptr) scales[p.stored.scale(e, kb, nb)] = scale;
        if (scales_t != nullptr) scales_t[p.transposed.scale(e, nb, kb)] = scale;
        for (int64_t n = nb * kBlock; n < n_end; ++n)
          for (int64_t k = kb * kBlock; k < k_end; ++k) {
            const uint8_t code = float_to_fp8_e4m3(bf16_to_float(w_ENK[(e * N + n) * K + k]) * inverse);
            if (codes_ENK != nullptr) codes_ENK[p.stored.code(e, n, k)] = code;
            if (codes_t_EKN != nullptr) codes_t_EKN[p.transposed.code(e, k, n)] = code;
          }
      }
}

void dequantize_weight_blocks(float* w_ENK, const uint8_t* codes_ENK, const float* scales, int64_t E, int64_t N,
                              int64_t K) {
  const int64_t NB = blocks(N), KB = blocks(K);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        w_ENK[(e * N + n) * K + k] = fp8_e4m3_to_float(codes_ENK[(e * N + n) * K + k]) *
                                     scales[weight_scale_index(e, n / kBlock, k / kBlock, NB, KB)];
}

std::vector<int64_t> padded_token_offsets(const int32_t* offsets_E1, int64_t E) {
  MOE_CHECK(offsets_E1 != nullptr && E >= 1, "fp8 token columns: offsets of {} experts", E);
  std::vector<int64_t> P_E1 = {0};
  for (const Group& g : groups_of(offsets_E1, E, offsets_E1[E])) P_E1.push_back(P_E1.back() + blocks(g.rows) * kBlock);
  return P_E1;
}

void quantize_token_columns(uint8_t* codes_t_WP, int64_t ld_t, float* scales_t, const bf16* x, int64_t ld_x,
                            const int32_t* offsets_E1, int64_t E, int64_t W, ColumnScales kind) {
  MOE_CHECK(W > 0 && ld_x >= W, "fp8 token columns: {} features in rows of {}", W, ld_x);
  const std::vector<int64_t> P_E1 = padded_token_offsets(offsets_E1, E);
  MOE_CHECK(ld_t >= P_E1.back(), "fp8 token columns: rows of {} codes for {} padded tokens", ld_t, P_E1.back());
  const int64_t P = ld_t;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t first = offsets_E1[e], rows = offsets_E1[e + 1] - first, P_e = P_E1[static_cast<size_t>(e)];
    for (int64_t tb = 0; tb < blocks(rows); ++tb) {
      const int64_t t_end = std::min(rows, (tb + 1) * kBlock);
      // The amax of a feature's 128 tokens, or of the 128 features' (the edge block: the
      // features there are) under Block.
      const auto amax_of = [&](int64_t f_begin, int64_t f_end) {
        float amax = 0.0f;
        for (int64_t f = f_begin; f < f_end; ++f)
          for (int64_t t = tb * kBlock; t < t_end; ++t)
            amax = std::fmax(amax, std::fabs(bf16_to_float(x[(first + t) * ld_x + f])));
        return amax;
      };
      float block_amax = 0.0f;
      for (int64_t f = 0; f < W; ++f) {
        if (kind == ColumnScales::Block && f % kBlock == 0) block_amax = amax_of(f, std::min(W, f + kBlock));
        const float amax = kind == ColumnScales::Block ? block_amax : amax_of(f, f + 1);
        const float scale = block_scale(amax), inverse = block_scale_inverse(scale);
        scales_t[token_column_scale_at(kind, P_e, tb, f, W)] = scale;
        uint8_t* column = codes_t_WP + f * P + P_e;
        for (int64_t t = tb * kBlock; t < (tb + 1) * kBlock; ++t)
          column[t] = t < t_end ? float_to_fp8_e4m3(bf16_to_float(x[(first + t) * ld_x + f]) * inverse) : 0;
      }
    }
  }
}

void weight_gradient_token_columns(float* dw_ENK, const uint8_t* a_t_NP, const float* a_scales,
                                   const uint8_t* b_t_KP, const float* b_scales, int64_t ld_t,
                                   const std::vector<int64_t>& P_E1, int64_t N, int64_t K, bool accumulate,
                                   ColumnScales b_kind) {
  MOE_CHECK(P_E1.size() >= 2 && N > 0 && K > 0 && ld_t >= P_E1.back(), "fp8 weight gradient: {} offsets, [{}, {}]",
            P_E1.size(), N, K);
  const int64_t E = static_cast<int64_t>(P_E1.size()) - 1, P = ld_t;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t P_e = P_E1[static_cast<size_t>(e)], TB = (P_E1[static_cast<size_t>(e + 1)] - P_e) / kBlock;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        float sum = accumulate ? dw_ENK[(e * N + n) * K + k] : 0.0f;
        for (int64_t tb = 0; tb < TB; ++tb) {
          float block = 0.0f;
          for (int64_t t = P_e + tb * kBlock; t < P_e + (tb + 1) * kBlock; ++t)
            block += fp8_e4m3_to_float(a_t_NP[n * P + t]) * fp8_e4m3_to_float(b_t_KP[k * P + t]);
          sum += a_scales[token_column_scale_index(P_e, tb, n, N)] *
                 b_scales[token_column_scale_at(b_kind, P_e, tb, k, K)] * block;
        }
        dw_ENK[(e * N + n) * K + k] = sum;
      }
  }
}

}  // namespace moe::fp8

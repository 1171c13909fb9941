// The CPU AdamW: the fp32 update is the textbook one with its bias corrections folded into the
// step size and eps (Kingma & Ba's efficient form; decoupled decay, none on parameters
// registered without it), bit for bit; with optimizer.state_dtype = MomentDtype::Bf16 the moments
// are rounded to bf16 when read and after each update, and stay close to fp32 ones; with fp8
// they are what a plain block quantiser (written here from e4m3's value table, not from
// adamw_math's bit arithmetic) stores.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "core/rng.h"
#include "kernels/adamw_math.h"
#include "optim/adamw.h"

namespace moe {
namespace {

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

void make_params(ParameterStore<float>& params) {
  params.add({"w", Shape{37, 11}, Init::Normal, 0.5});
  ParamSpec norm{"norm", Shape{11}, Init::Ones};
  norm.weight_decay = false;
  params.add(norm);
  params.add({"b", Shape{5}, Init::Normal, 0.1});
  params.allocate(4);
}

void fill_grads(ParameterStore<float>& params, int64_t step, double scale) {
  CounterRng rng(9, "grads");
  for (int id = 0; id < params.size(); ++id)
    for (int64_t i = 0; i < params.numel(id); ++i)
      params.grad(id)[i] = static_cast<float>(scale * rng.normal(static_cast<uint64_t>(step * 100000 + id * 1000 + i)));
}

float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

// e4m3's finite non-negative values in ascending order (index = code), from the format's
// definition: subnormals m 2^-9, normals (8 + m) 2^(e - 10), 0x7f (NaN) left out.
std::vector<double> e4m3_values() {
  std::vector<double> out;
  for (int m = 0; m < 8; ++m) out.push_back(std::ldexp(m, -9));
  for (int e = 1; e < 16; ++e)
    for (int m = 0; m < 8 && !(e == 15 && m == 7); ++m) out.push_back(std::ldexp(8 + m, e - 10));
  return out;
}

// A block of fp8 moments as the format says: the smallest power of two 2^k (k >= -126) with
// amax / 2^k <= 448; each value / 2^k between its two neighbours in e4m3's table. m: the
// nearer one (a tie: the even code). `root` (x holds v, quantised as sqrt(v) and stored
// squared): the upper one when its fraction of that step, to 20 bits (nearest even; exact
// above 2^-6), times 2^12 exceeds the element's random bits (adamw_math::moment_random: the
// one thing taken from the code under test); a positive value at least the smallest code.
void plain_block_quantise(float* x, int n, bool root, int64_t index, uint32_t step) {
  static const std::vector<double> table = e4m3_values();
  std::vector<double> y(static_cast<size_t>(n));
  double amax = 0;
  for (int i = 0; i < n; ++i) {
    y[static_cast<size_t>(i)] = root ? std::sqrt(x[i]) : x[i];  // float sqrt, as the code's
    amax = std::max(amax, std::fabs(y[static_cast<size_t>(i)]));
  }
  int k = -126;
  while (amax / std::ldexp(1.0, k) > 448) ++k;
  for (int i = 0; i < n; ++i) {
    const double value = y[static_cast<size_t>(i)], a = std::fabs(value) / std::ldexp(1.0, k);
    size_t c = 0;
    while (c + 1 < table.size() && table[c + 1] <= a) ++c;
    if (c + 1 < table.size() && !root) {
      const double mid = (table[c] + table[c + 1]) / 2;
      if (a > mid || (a == mid && c % 2 == 1)) ++c;
    } else if (c + 1 < table.size()) {
      double fraction = std::nearbyint((a - table[c]) / (table[c + 1] - table[c]) * 1048576.0);
      if (fraction == 1048576.0) ++c, fraction = 0;
      if (fraction * 4096.0 > adamw_math::moment_random(index + i, step)) ++c;
    }
    if (root && c == 0 && value > 0) c = 1;
    const double q = std::ldexp(table[c], k) * (value < 0 ? -1 : 1);
    x[i] = root ? static_cast<float>(q * q) : static_cast<float>(q);
  }
}

// The update written out plainly, optionally with bf16 moments.
struct Reference {
  OptimizerConfig config;
  std::vector<std::vector<float>> m, v;
  int64_t steps = 0;

  void step(ParameterStore<float>& params, double lr, MomentDtype moments) {
    const bool bf16 = moments == MomentDtype::Bf16;
    ++steps;
    if (m.empty())
      for (int id = 0; id < params.size(); ++id) {
        m.emplace_back(params.numel(id), 0.0f);
        v.emplace_back(params.numel(id), 0.0f);
      }
    // The bias corrections folded into the step size and eps (Kingma & Ba's efficient form).
    const float sqrt_bias2 = static_cast<float>(std::sqrt(1.0 - std::pow(config.beta2, static_cast<double>(steps))));
    const float step_size =
        static_cast<float>(lr / (1.0 - std::pow(config.beta1, static_cast<double>(steps)))) * sqrt_bias2;
    const float b1 = static_cast<float>(config.beta1), b2 = static_cast<float>(config.beta2);
    const float eps = static_cast<float>(config.eps) * sqrt_bias2;
    for (int id = 0; id < params.size(); ++id) {
      const float decay = params.spec(id).weight_decay ? static_cast<float>(1.0 - lr * config.weight_decay) : 1.0f;
      for (int64_t i = 0; i < params.numel(id); ++i) {
        float& mi = m[id][i];
        float& vi = v[id][i];
        const float g = params.grad(id)[i];
        mi = b1 * mi + (1.0f - b1) * g;
        vi = b2 * vi + (1.0f - b2) * g * g;
        if (bf16) mi = round_bf16(mi), vi = round_bf16(vi);
        float& p = params.value(id)[i];
        p = p * decay - step_size * mi / (std::sqrt(vi) + eps);
      }
      // fp8: the update used the fp32 moments; stored are their blocks of 16 quantised.
      for (int64_t b = 0; moments == MomentDtype::Fp8 && b < params.numel(id); b += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, params.numel(id) - b));
        const auto step = static_cast<uint32_t>(steps);
        plain_block_quantise(m[id].data() + b, n, false, params.offset(id) + b, step);
        plain_block_quantise(v[id].data() + b, n, true, params.offset(id) + b, step);
      }
    }
  }
};

void expect_same(const ParameterStore<float>& a, const ParameterStore<float>& b) {
  for (int id = 0; id < a.size(); ++id)
    for (int64_t i = 0; i < a.numel(id); ++i)
      ASSERT_EQ(bits(a.value(id)[i]), bits(b.value(id)[i])) << a.spec(id).name << "[" << i << "]";
}

void run_against_reference(MomentDtype state_dtype) {
  OptimizerConfig config;
  config.state_dtype = state_dtype;
  ParameterStore<float> params, ref_params;
  make_params(params);
  make_params(ref_params);
  AdamW adamw(config, params);
  Reference ref{config, {}, {}, 0};
  for (int64_t step = 1; step <= 4; ++step) {
    fill_grads(params, step, 1e-2);
    fill_grads(ref_params, step, 1e-2);
    adamw.step(1e-2 * static_cast<double>(step));
    ref.step(ref_params, 1e-2 * static_cast<double>(step), state_dtype);
  }
  expect_same(params, ref_params);
  size_t packed = 0;
  for (int id = 0; id < params.size(); ++id)
    for (int64_t i = 0; i < params.numel(id); ++i, ++packed) {
      ASSERT_EQ(bits(adamw.first_moment()[packed]), bits(ref.m[id][i]));
      ASSERT_EQ(bits(adamw.second_moment()[packed]), bits(ref.v[id][i]));
    }
  // The norm has no weight decay: with zero gradients its values would not move.
  EXPECT_EQ(adamw.steps_taken(), 4);
}

// Three steps of AdamW with `moments` and of fp32 AdamW on the same gradients; returns
// {m, v, m32, v32} (packed).
std::array<std::vector<float>, 4> moments_beside_fp32(MomentDtype moments) {
  OptimizerConfig config;
  config.state_dtype = moments;
  ParameterStore<float> params, fp32_params;
  make_params(params);
  make_params(fp32_params);
  AdamW adamw(config, params), fp32_adamw(OptimizerConfig{}, fp32_params);
  for (int64_t step = 1; step <= 3; ++step) {
    fill_grads(params, step, 1e-2);
    fill_grads(fp32_params, step, 1e-2);
    adamw.step(1e-2);
    fp32_adamw.step(1e-2);
  }
  return {adamw.first_moment(), adamw.second_moment(), fp32_adamw.first_moment(), fp32_adamw.second_moment()};
}

TEST(AdamW, Fp32MatchesTheTextbookUpdate) { run_against_reference(MomentDtype::Fp32); }

TEST(AdamW, Fp8MomentsAreAPlainBlockQuantisersValues) { run_against_reference(MomentDtype::Fp8); }

// adamw_math's block quantiser against the plain one on blocks of wide ranges, ragged ends
// and zeros; what it stores comes back unchanged when quantised again at another step
// (checkpoints reload bit for bit), and a positive v never becomes 0 where m may.
TEST(AdamW, Fp8MomentBlocksQuantiseLikeTheFormatAndAgainToThemselves) {
  CounterRng rng(21, "fp8 moments");
  uint64_t draw = 0;
  int floored = 0, flushed = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const int n = trial % 7 == 0 ? 1 + trial % 16 : 16;
    const int64_t index = 16 * (trial * 7919 % 100003);
    const auto step = static_cast<uint32_t>(1 + trial % 5);
    std::vector<float> m(static_cast<size_t>(n)), v(m.size());
    for (int i = 0; i < n; ++i) {
      const auto magnitude = [&] { return std::ldexp(1.0, -static_cast<int>(rng.uniform(draw++) * 40.0) - 4); };
      m[static_cast<size_t>(i)] = static_cast<float>(rng.uniform(draw++) < 0.5 ? -magnitude() : magnitude());
      v[static_cast<size_t>(i)] = static_cast<float>(magnitude() * magnitude());
      if (trial % 11 == 0 && i > 0 && i % 3 == 0) m[static_cast<size_t>(i)] = v[static_cast<size_t>(i)] = 0.0f;
    }
    std::vector<float> fast_m = m, fast_v = v, plain_m = m, plain_v = v;
    adamw_math::quantize_moment_block(fast_m.data(), fast_v.data(), n, index, step);
    plain_block_quantise(plain_m.data(), n, false, index, step);
    plain_block_quantise(plain_v.data(), n, true, index, step);
    std::vector<float> again_m = fast_m, again_v = fast_v;
    adamw_math::quantize_moment_block(again_m.data(), again_v.data(), n, index, step + 1);
    for (size_t i = 0; i < m.size(); ++i) {
      ASSERT_EQ(bits(fast_m[i]), bits(plain_m[i])) << trial << " m " << i;
      ASSERT_EQ(bits(fast_v[i]), bits(plain_v[i])) << trial << " v " << i;
      ASSERT_EQ(bits(again_m[i]), bits(fast_m[i])) << trial << " m " << i;
      ASSERT_EQ(bits(again_v[i]), bits(fast_v[i])) << trial << " v " << i;
      if (v[i] > 0) ASSERT_GT(fast_v[i], 0.0f);
      floored += v[i] > 0 && v[i] < fast_v[i] / 2;
      flushed += m[i] != 0 && fast_m[i] == 0;
    }
  }
  EXPECT_GT(floored, 100);  // the draws span 2^40: both rules are exercised
  EXPECT_GT(flushed, 100);
}

// sqrt(v)'s stochastic rounding is unbiased: one value quantised at many steps averages to
// itself (to nearest, a value 30% of the way up its grid step would always round down); m
// rounds to nearest.
TEST(AdamW, Fp8MomentRoundingIsUnbiasedForVAndNearestForM) {
  const float root = (1.0f + 0.3f / 8.0f) * 0.25f;  // 30% past 0.25 on e4m3's grid there (steps of 2^-5)
  double sum = 0;
  const int steps = 20000;
  for (int t = 0; t < steps; ++t) {
    // 0.5, each block's amax: the scale 2^-9, 0.25 at 128 with steps of 16.
    float m[2] = {root, 0.5f}, v[2] = {root * root, 0.25f};
    adamw_math::quantize_moment_block(m, v, 2, 8 * t + t % 8, static_cast<uint32_t>(t));
    ASSERT_EQ(m[0], 0.25f);
    const float stored = std::sqrt(v[0]);
    ASSERT_TRUE(stored == 0.25f || stored == 0.25f + 1.0f / 32.0f) << stored;
    sum += stored;
  }
  EXPECT_NEAR(sum / steps, root, 4e-4);  // 4 sigma of 20,000 draws; nearest would be 0.009 off
}

// sqrt(v)'s random bits: element first + j's are the lane's hash times multiplier j, and
// over many lanes and steps each of the 8 is uniform (its top 4 bits' 16 bins within 5
// sigma of even).
TEST(AdamW, Fp8MomentRandomBitsAreUniformForEveryLaneElement) {
  for (int j = 0; j < 8; ++j) {
    int bins[16] = {};
    const int draws = 16000;
    for (int d = 0; d < draws; ++d) {
      const int64_t first = 8 * int64_t{d / 4};
      const auto step = static_cast<uint32_t>(d % 4);
      const uint32_t bits = adamw_math::moment_random(first + j, step);
      ASSERT_EQ(bits, adamw_math::moment_random_lane(first, step) * adamw_math::moment_random_multiplier(j));
      ++bins[bits >> 28];
    }
    for (int b = 0; b < 16; ++b) EXPECT_NEAR(bins[b], draws / 16, 5 * std::sqrt(draws / 16.0)) << "element " << j;
  }
}

// A block whose gradients span 10^5: the small element's v (5e-12 against 0.05) would be
// below its block's smallest code as v (2^-17.8 of the largest), while its m is not: stored
// as 0, the next step's update would be m / eps (~0.9 here). Stored as sqrt(v) it keeps a
// code (and the floor keeps any positive one), so every update stays within ~lr; the
// values are the plain quantiser's.
TEST(AdamW, Fp8MomentsKeepTheUpdateBoundedWhereVWouldUnderflow) {
  OptimizerConfig config;
  config.state_dtype = MomentDtype::Fp8;
  config.weight_decay = 0;
  ParameterStore<float> params, ref_params;
  for (auto* store : {&params, &ref_params}) {
    store->add({"w", Shape{16}, Init::Zeros});
    store->allocate(1);
  }
  AdamW adamw(config, params);
  Reference ref{config, {}, {}, 0};
  const double lr = 1e-2;
  for (int64_t step = 1; step <= 3; ++step) {
    for (auto* store : {&params, &ref_params})
      for (int64_t i = 0; i < 16; ++i) store->grad(0)[i] = step > 1 ? 0.0f : i == 0 ? 1.0f : i == 1 ? 1e-5f : 0.5f;
    std::vector<float> before(params.value(0), params.value(0) + 16);
    adamw.step(lr);
    ref.step(ref_params, lr, MomentDtype::Fp8);
    for (int64_t i = 0; i < 16; ++i) {
      EXPECT_LE(std::fabs(params.value(0)[i] - before[static_cast<size_t>(i)]), 3 * lr) << "step " << step << " [" << i << "]";
      EXPECT_EQ(bits(params.value(0)[i]), bits(ref_params.value(0)[i])) << "step " << step << " [" << i << "]";
    }
  }
  EXPECT_GT(adamw.second_moment()[1], 0.0f);
}

// sqrt(v)'s floor: every positive v, of every fp32 exponent down to the smallest subnormal,
// codes to at least the smallest code, whatever the block's largest v beside it (every
// exponent up to FLT_MAX), for many random bits; a zero v codes 0. Without the floor a v of
// 2^-60 beside 1 would code 0 at most bits (an encoder that takes the floor on the scaled
// root's bits, bench/probes/adamw_fp8_encoder.patch, must keep it for every finite block).
TEST(AdamW, Fp8RootCodesFloorEveryPositiveVBesideAnyFiniteRoot) {
  int64_t checked = 0;
  for (int big = -149; big <= 127; big += 3) {
    float v[adamw_math::kMomentBlock];
    v[0] = big == 127 ? std::numeric_limits<float>::max() : std::ldexp(1.0f, big);
    v[1] = 0.0f;
    for (int small = -149; small <= big; small += 7) {
      for (int i = 2; i < adamw_math::kMomentBlock; ++i)  // small's exponent, other mantissas
        v[i] = std::min(v[0], std::ldexp(1.0f + static_cast<float>(i) / 16.0f, small));
      for (uint32_t step = 1; step <= 4; ++step) {
        uint8_t codes[adamw_math::kMomentBlock];
        const int64_t index = 16 * (512 * (big + 149) + (small + 149));  // a block of its own
        adamw_math::moment_block_codes(v, adamw_math::kMomentBlock, true, index, step, codes);
        EXPECT_EQ(codes[1], 0) << "v 0 beside 2^" << big;
        for (int i = 2; i < adamw_math::kMomentBlock; ++i) {
          ASSERT_GE(codes[i], 1) << "v " << v[i] << " beside " << v[0] << " at step " << step;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 10000);
}

// The GPU's whole-block encoder for sqrt(v) (root_code_factor, root_code_in_normals,
// root_code_normal) gives root_code's code wherever its range admits a root: roots of
// every binade around each scale's normals, random mantissas and bits, at every scale byte
// the factor covers; and the range turns away what the plain path must code (2^-6 and
// below, above 448, -0, scales past 133), so neither side of it can drift.
TEST(AdamW, Fp8RootCodesOfTheGpusEncoderAreRootCodes) {
  CounterRng rng(77, "root codes");
  uint64_t draw = 0;
  int64_t admitted = 0, refused = 0;
  for (int x = 1; x <= 140; ++x) {
    const auto scale_byte = static_cast<uint8_t>(x);
    const float factor = adamw_math::root_code_factor(scale_byte);
    for (int binade = -12; binade <= 9; ++binade)
      for (int k = 0; k < 64; ++k) {
        const double mantissa = k == 0 ? 1.0 : k == 1 ? 1.75 : 1.0 + rng.uniform(draw++);
        const float root = static_cast<float>(std::ldexp(mantissa, binade + x - 127));  // y = root / scale
        if (root == 0.0f || std::isinf(root)) continue;
        const auto r = static_cast<uint32_t>(rng.uniform(draw++) * 4294967296.0);
        const uint32_t t = bits(adamw_math::mul(root, factor));
        const double exact_y = std::ldexp(static_cast<double>(root), 127 - x);  // root may be subnormal
        const bool normal = exact_y > 0x1p-6 && exact_y <= 448.0 && x <= 133;
        ASSERT_EQ(adamw_math::root_code_in_normals(t), normal) << "root " << root << " scale byte " << x;
        if (!normal) {
          ++refused;
          continue;
        }
        ASSERT_EQ(adamw_math::root_code_normal(t, ~r), adamw_math::root_code(root, scale_byte, r))
            << "root " << root << " scale byte " << x << " bits " << r;
        ++admitted;
      }
  }
  EXPECT_FALSE(adamw_math::root_code_in_normals(bits(-0.0f)));
  EXPECT_GT(admitted, 50000);
  EXPECT_GT(refused, 20000);
}

// Near fp32 AdamW: the moments stay within fp8's precision of the fp32 ones (m normwise).
TEST(AdamW, Fp8MomentsStayNearFp32Ones) {
  const auto [ms, vs, m32s, v32s] = moments_beside_fp32(MomentDtype::Fp8);
  double m_err = 0, m_norm = 0, v_err = 0, v_norm = 0;
  for (size_t i = 0; i < ms.size(); ++i) {
    const double m = ms[i], m32 = m32s[i], v = vs[i], v32 = v32s[i];
    m_err += (m - m32) * (m - m32), m_norm += m32 * m32;
    v_err += (v - v32) * (v - v32), v_norm += v32 * v32;
  }
  // e4m3 keeps 3 mantissa bits (2^-4 relative at most per rounding), three steps.
  EXPECT_LT(std::sqrt(m_err), 0.15 * std::sqrt(m_norm));
  EXPECT_LT(std::sqrt(v_err), 0.15 * std::sqrt(v_norm));
  EXPECT_GT(std::sqrt(m_err), 1e-4 * std::sqrt(m_norm));  // and they are quantised
}

TEST(AdamW, Bf16MomentsAreRoundedAfterEachUpdate) {
  run_against_reference(MomentDtype::Bf16);
  const auto [ms, vs, m32s, v32s] = moments_beside_fp32(MomentDtype::Bf16);
  size_t differ = 0;
  double m_err = 0, m_norm = 0;
  for (size_t i = 0; i < ms.size(); ++i) {
    const float m = ms[i], v = vs[i], m32 = m32s[i], v32 = v32s[i];
    ASSERT_EQ(bits(m), bits(round_bf16(m)));
    ASSERT_EQ(bits(v), bits(round_bf16(v)));
    differ += bits(m) != bits(m32);
    m_err += (static_cast<double>(m) - m32) * (static_cast<double>(m) - m32);
    m_norm += static_cast<double>(m32) * m32;
    // v sums positive terms: three roundings of at most 2^-8 (bf16's unit roundoff) each.
    EXPECT_NEAR(v, v32, 1.2e-2 * v32) << i;
  }
  // m may cancel, so normwise.
  EXPECT_LT(std::sqrt(m_err), 1e-2 * std::sqrt(m_norm));
  EXPECT_GT(differ, ms.size() / 2);
}

// Moments from an fp32 checkpoint are rounded (bf16) or quantised per block (fp8) when
// read: the same step as from the stored values (what the GPU holds after uploading them).
void expect_moments_stored_when_read(MomentDtype moments) {
  OptimizerConfig config;
  config.state_dtype = moments;
  ParameterStore<float> a, b;
  make_params(a);
  make_params(b);
  AdamW from_fp32(config, a), from_rounded(config, b);
  CounterRng rng(2, "moments");
  for (size_t i = 0; i < from_fp32.first_moment().size(); ++i) {
    const float m = static_cast<float>(1e-3 * rng.normal(2 * i)), v = static_cast<float>(1e-6 * std::abs(rng.normal(2 * i + 1)));
    from_fp32.first_moment()[i] = m;
    from_fp32.second_moment()[i] = v;
    from_rounded.first_moment()[i] = moments == MomentDtype::Bf16 ? round_bf16(m) : m;
    from_rounded.second_moment()[i] = moments == MomentDtype::Bf16 ? round_bf16(v) : v;
  }
  if (moments == MomentDtype::Fp8)  // each parameter's blocks of 16, as the store keeps them (step 0's bits)
    for (int id = 0; id < b.size(); ++id)
      for (int64_t k = 0; k < b.numel(id); k += adamw_math::kMomentBlock) {
        const int n = static_cast<int>(std::min<int64_t>(adamw_math::kMomentBlock, b.numel(id) - k));
        const int64_t at = from_rounded.moment_offset(id) + k;
        plain_block_quantise(from_rounded.first_moment().data() + at, n, false, b.offset(id) + k, 0);
        plain_block_quantise(from_rounded.second_moment().data() + at, n, true, b.offset(id) + k, 0);
      }
  from_fp32.set_steps_taken(10);
  from_rounded.set_steps_taken(10);
  fill_grads(a, 1, 1e-3);
  fill_grads(b, 1, 1e-3);
  from_fp32.step(1e-3);
  from_rounded.step(1e-3);
  expect_same(a, b);
  EXPECT_EQ(from_fp32.first_moment(), from_rounded.first_moment());
}

TEST(AdamW, Bf16MomentsAreRoundedWhenRead) { expect_moments_stored_when_read(MomentDtype::Bf16); }
TEST(AdamW, Fp8MomentsAreQuantisedWhenRead) { expect_moments_stored_when_read(MomentDtype::Fp8); }

// The moments are allocated on first use (GPU and sharded ranks never step this object):
// before any step they read as zeros of the packed size, and a step after that read is
// the same as one without it.
TEST(AdamW, MomentsReadBeforeAnyStepAreZeros) {
  OptimizerConfig config;
  ParameterStore<float> a, b;
  make_params(a);
  make_params(b);
  AdamW read_first(config, a), untouched(config, b);
  int64_t total = 0;
  for (int id = 0; id < a.size(); ++id) total += a.numel(id);
  ASSERT_EQ(static_cast<int64_t>(read_first.first_moment().size()), total);
  ASSERT_EQ(static_cast<int64_t>(read_first.second_moment().size()), total);
  for (float m : read_first.first_moment()) ASSERT_EQ(m, 0.0f);
  for (float v : read_first.second_moment()) ASSERT_EQ(v, 0.0f);
  fill_grads(a, 1, 1e-3);
  fill_grads(b, 1, 1e-3);
  read_first.step(1e-3);
  untouched.step(1e-3);
  expect_same(a, b);
  EXPECT_EQ(read_first.first_moment(), untouched.first_moment());
}

}  // namespace
}  // namespace moe

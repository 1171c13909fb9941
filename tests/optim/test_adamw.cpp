// The CPU AdamW: the fp32 update is the textbook one (decoupled decay, none on parameters
// registered without it), bit for bit; with optimizer.state_dtype = MomentDtype::Bf16 the moments
// are rounded to bf16 when read and after each update, and stay close to fp32 ones.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "core/rng.h"
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

// The update written out plainly, optionally with bf16 moments.
struct Reference {
  OptimizerConfig config;
  std::vector<std::vector<float>> m, v;
  int64_t steps = 0;

  void step(ParameterStore<float>& params, double lr, bool bf16) {
    ++steps;
    if (m.empty())
      for (int id = 0; id < params.size(); ++id) {
        m.emplace_back(params.numel(id), 0.0f);
        v.emplace_back(params.numel(id), 0.0f);
      }
    const float step_size = static_cast<float>(lr / (1.0 - std::pow(config.beta1, static_cast<double>(steps))));
    const float sqrt_bias2 = static_cast<float>(std::sqrt(1.0 - std::pow(config.beta2, static_cast<double>(steps))));
    const float b1 = static_cast<float>(config.beta1), b2 = static_cast<float>(config.beta2);
    const float eps = static_cast<float>(config.eps);
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
        p = p * decay - step_size * mi / (std::sqrt(vi) / sqrt_bias2 + eps);
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
    ref.step(ref_params, 1e-2 * static_cast<double>(step), state_dtype == MomentDtype::Bf16);
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

TEST(AdamW, Fp32MatchesTheTextbookUpdate) { run_against_reference(MomentDtype::Fp32); }

TEST(AdamW, Bf16MomentsAreRoundedAfterEachUpdate) {
  run_against_reference(MomentDtype::Bf16);
  OptimizerConfig config;
  config.state_dtype = MomentDtype::Bf16;
  ParameterStore<float> params, fp32_params;
  make_params(params);
  make_params(fp32_params);
  AdamW adamw(config, params), fp32_adamw(OptimizerConfig{}, fp32_params);
  EXPECT_TRUE(adamw.bf16_moments());
  EXPECT_FALSE(fp32_adamw.bf16_moments());
  for (int64_t step = 1; step <= 3; ++step) {
    fill_grads(params, step, 1e-2);
    fill_grads(fp32_params, step, 1e-2);
    adamw.step(1e-2);
    fp32_adamw.step(1e-2);
  }
  size_t differ = 0;
  double m_err = 0, m_norm = 0;
  for (size_t i = 0; i < adamw.first_moment().size(); ++i) {
    const float m = adamw.first_moment()[i], v = adamw.second_moment()[i];
    const float m32 = fp32_adamw.first_moment()[i], v32 = fp32_adamw.second_moment()[i];
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
  EXPECT_GT(differ, adamw.first_moment().size() / 2);
}

// Moments from an fp32 checkpoint are rounded when read: the same step as from the
// rounded values (what the GPU holds after uploading them).
TEST(AdamW, Bf16MomentsAreRoundedWhenRead) {
  OptimizerConfig config;
  config.state_dtype = MomentDtype::Bf16;
  ParameterStore<float> a, b;
  make_params(a);
  make_params(b);
  AdamW from_fp32(config, a), from_rounded(config, b);
  CounterRng rng(2, "moments");
  for (size_t i = 0; i < from_fp32.first_moment().size(); ++i) {
    const float m = static_cast<float>(1e-3 * rng.normal(2 * i)), v = static_cast<float>(1e-6 * std::abs(rng.normal(2 * i + 1)));
    from_fp32.first_moment()[i] = m;
    from_fp32.second_moment()[i] = v;
    from_rounded.first_moment()[i] = round_bf16(m);
    from_rounded.second_moment()[i] = round_bf16(v);
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

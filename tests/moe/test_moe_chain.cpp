// The routing ops chained as the MoE layer uses them:
//   logits = x Wr^T + offset -> scores -> top-k -> capacity -> permute -> one fixed linear
//   "expert" per expert -> combine; loss = <out, probe> + aux loss + z-loss.
// Gradients w.r.t. x and the logits against finite differences, float against double, and
// bit-identical results for 1 and 2 threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/threads.h"
#include "gradcheck.h"
#include "kernels/matmul.h"
#include "moe/dispatch.h"
#include "moe/moe_fixtures.h"
#include "moe/router.h"

namespace moe {
namespace {

using test::cast_vector;
using test::expect_gradient_close;
using test::random_vector;

struct ChainConfig {
  int64_t T_, E, K, D;
  ScoreFunc score_func = ScoreFunc::Softmax;
  double temperature = 1.0;
  bool renormalize = true;
  double capacity_factor = 1.0;
  double aux_coef = 0.1, z_coef = 0.05;
};

// Inputs in double; each run casts them to its T.
struct ChainInputs {
  std::vector<double> x_TD, router_ED, offset_TE, experts_EDD, probe_TD;
};

// Offsets put the logits of a row about 0.5 apart (the router matmul moves them far less),
// so no finite-difference step or float rounding changes the routing. The last expert's
// offset is so low that it never receives a token.
ChainInputs make_inputs(const ChainConfig& c, uint64_t seed) {
  ChainInputs in;
  in.x_TD = random_vector(c.T_ * c.D, seed, "x");
  in.router_ED = random_vector(c.E * c.D, seed, "router", 0.02);
  in.offset_TE = test::separated_rows(c.T_, c.E, seed, "offset", -1.0, 0.5);
  for (int64_t t = 0; t < c.T_; ++t) in.offset_TE[t * c.E + c.E - 1] -= 10.0;
  in.experts_EDD = random_vector(c.E * c.D * c.D, seed, "experts", 0.5);
  in.probe_TD = random_vector(c.T_ * c.D, seed, "probe");
  return in;
}

template <typename T>
struct ChainRun {
  std::vector<T> logits, scores, weight, x_RD, y_RD, out;
  std::vector<int32_t> expert, row, counts, offsets, token_of_row;
  int64_t R = 0;
  double aux = 0, z = 0, loss = 0;
  std::vector<T> dx, dlogits;  // filled by backward
};

template <typename T>
ChainRun<T> chain_forward(const ChainConfig& c, const ChainInputs& in64) {
  const auto x = cast_vector<T>(in64.x_TD), router = cast_vector<T>(in64.router_ED);
  const auto offset = cast_vector<T>(in64.offset_TE), experts = cast_vector<T>(in64.experts_EDD);
  const auto probe = cast_vector<T>(in64.probe_TD);
  const int64_t T_ = c.T_, E = c.E, K = c.K, D = c.D;
  ChainRun<T> run;
  run.logits.resize(T_ * E);
  linear_forward(run.logits.data(), x.data(), router.data(), (const T*)nullptr, T_, D, E);
  for (int64_t i = 0; i < T_ * E; ++i) run.logits[i] += offset[i];
  run.scores.resize(T_ * E);
  router_scores_forward(run.scores.data(), run.logits.data(), T_, E, c.temperature, c.score_func);
  run.expert.resize(T_ * K);
  run.weight.resize(T_ * K);
  router_select(run.expert.data(), run.weight.data(), run.scores.data(), (const T*)nullptr, T_, E,
                K, c.renormalize);
  run.row.resize(T_ * K);
  run.counts.resize(E);
  run.offsets.resize(E + 1);
  run.token_of_row.resize(T_ * K);
  run.R = assign_rows(run.row.data(), run.counts.data(), run.offsets.data(),
                      run.token_of_row.data(), run.expert.data(), T_, E, K,
                      expert_capacity(c.capacity_factor, T_, K, E));
  run.x_RD.resize(run.R * D);
  permute_forward(run.x_RD.data(), x.data(), run.token_of_row.data(), run.R, D);
  run.y_RD.resize(run.R * D);
  for (int64_t e = 0; e < E; ++e) {  // an expert with no rows is a 0-row matmul
    const int64_t first = run.offsets[e], rows = run.offsets[e + 1] - first;
    linear_forward(run.y_RD.data() + first * D, run.x_RD.data() + first * D,
                   experts.data() + e * D * D, (const T*)nullptr, rows, D, D);
  }
  run.out.resize(T_ * D);
  combine_forward(run.out.data(), run.y_RD.data(), run.weight.data(), run.row.data(), T_, K, D);
  run.aux = aux_loss_forward(run.scores.data(), run.expert.data(), T_, E, K, c.score_func,
                             c.aux_coef);
  run.z = z_loss_forward(run.logits.data(), T_, E, c.temperature, c.z_coef);
  double loss = run.aux + run.z;
  for (int64_t i = 0; i < T_ * D; ++i) loss += double(run.out[i]) * double(probe[i]);
  run.loss = loss;
  return run;
}

template <typename T>
void chain_backward(ChainRun<T>& run, const ChainConfig& c, const ChainInputs& in64) {
  const auto x = cast_vector<T>(in64.x_TD), router = cast_vector<T>(in64.router_ED);
  const auto experts = cast_vector<T>(in64.experts_EDD), dout = cast_vector<T>(in64.probe_TD);
  const int64_t T_ = c.T_, E = c.E, K = c.K, D = c.D;
  std::vector<T> dy_RD(run.R * D), dweight(T_ * K);
  combine_backward(dy_RD.data(), dweight.data(), dout.data(), run.y_RD.data(), run.weight.data(),
                   run.row.data(), T_, K, D);
  std::vector<T> dx_RD(run.R * D);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t first = run.offsets[e], rows = run.offsets[e + 1] - first;
    linear_backward(dx_RD.data() + first * D, (T*)nullptr, (T*)nullptr, dy_RD.data() + first * D,
                    run.x_RD.data() + first * D, experts.data() + e * D * D, rows, D, D);
  }
  run.dx.assign(T_ * D, T(0));
  permute_backward(run.dx.data(), dx_RD.data(), run.row.data(), T_, K, D, false);
  std::vector<T> dscores(T_ * E);
  router_select_backward(dscores.data(), dweight.data(), run.expert.data(), run.scores.data(), T_,
                         E, K, c.renormalize);
  aux_loss_backward(dscores.data(), run.scores.data(), run.expert.data(), T_, E, K, c.score_func,
                    c.aux_coef, 1.0);
  run.dlogits.resize(T_ * E);
  router_scores_backward(run.dlogits.data(), dscores.data(), run.scores.data(), T_, E,
                         c.temperature, c.score_func);
  z_loss_backward(run.dlogits.data(), run.logits.data(), T_, E, c.temperature, c.z_coef, 1.0);
  linear_backward(run.dx.data(), (T*)nullptr, (T*)nullptr, run.dlogits.data(), x.data(),
                  router.data(), T_, D, E, /*accumulate_dx=*/true);
}

TEST(RouterChain, GradientsWithDroppedTokensAndAnIdleExpert) {
  const ChainConfig base{.T_ = 8, .E = 4, .K = 2, .D = 3};
  ChainConfig sigmoid = base;
  sigmoid.score_func = ScoreFunc::Sigmoid;
  sigmoid.temperature = 0.7;
  ChainConfig plain = base;
  plain.renormalize = false;
  plain.temperature = 0.3;
  for (const ChainConfig& c : {base, sigmoid, plain}) {
    SCOPED_TRACE(std::string(c.score_func == ScoreFunc::Softmax ? "softmax" : "sigmoid") +
                 " renormalize " + (c.renormalize ? "on" : "off"));
    ChainInputs in = make_inputs(c, 91);
    ChainRun<double> run = chain_forward<double>(c, in);
    // 16 assignments over 3 live experts with capacity 4: some must drop.
    ASSERT_EQ(run.counts[c.E - 1], 0) << "the last expert should be idle";
    ASSERT_LT(run.R, c.T_ * c.K) << "the capacity should drop assignments";
    chain_backward(run, c, in);
    auto loss = [&] { return chain_forward<double>(c, in).loss; };
    const auto routing = run.expert;
    expect_gradient_close("dx", in.x_TD, run.dx, loss);
    expect_gradient_close("dlogits", in.offset_TE, run.dlogits, loss);
    EXPECT_EQ(chain_forward<double>(c, in).expert, routing) << "fixture routing moved";
  }
}

template <typename A, typename B>
double max_relative_difference(const std::vector<A>& a, const std::vector<B>& b) {
  EXPECT_EQ(a.size(), b.size());
  double scale = 1e-30, worst = 0;
  for (size_t i = 0; i < a.size(); ++i) scale = std::max(scale, std::abs(double(b[i])));
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(double(a[i]) - double(b[i])));
  return worst / scale;
}

TEST(RouterChain, FloatAgreesWithDouble) {
  ChainConfig c{.T_ = 64, .E = 8, .K = 2, .D = 16};
  for (ScoreFunc f : {ScoreFunc::Softmax, ScoreFunc::Sigmoid}) {
    c.score_func = f;
    const ChainInputs in = make_inputs(c, 101);
    ChainRun<float> lo = chain_forward<float>(c, in);
    ChainRun<double> hi = chain_forward<double>(c, in);
    chain_backward(lo, c, in);
    chain_backward(hi, c, in);
    EXPECT_EQ(lo.expert, hi.expert);
    EXPECT_EQ(lo.row, hi.row);
    EXPECT_NEAR(lo.loss, hi.loss, 1e-5 * std::max(1.0, std::abs(hi.loss)));
    EXPECT_LT(max_relative_difference(lo.scores, hi.scores), 1e-6);
    EXPECT_LT(max_relative_difference(lo.weight, hi.weight), 1e-6);
    EXPECT_LT(max_relative_difference(lo.out, hi.out), 1e-5);
    EXPECT_LT(max_relative_difference(lo.dx, hi.dx), 1e-5);
    EXPECT_LT(max_relative_difference(lo.dlogits, hi.dlogits), 1e-5);
  }
}

template <typename T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

TEST(RouterThreads, BitIdenticalForOneAndTwoThreads) {
  // Large enough that every parallel loop and the chunked loss sums split across threads.
  ChainConfig c{.T_ = 2048, .E = 16, .K = 4, .D = 32};
  c.score_func = ScoreFunc::Sigmoid;
  c.temperature = 0.8;
  const ChainInputs in = make_inputs(c, 111);
  const int saved = num_threads();
  set_num_threads(1);
  ChainRun<float> one = chain_forward<float>(c, in);
  chain_backward(one, c, in);
  set_num_threads(2);
  ChainRun<float> two = chain_forward<float>(c, in);
  chain_backward(two, c, in);
  set_num_threads(saved);
  EXPECT_LT(one.R, c.T_ * c.K);  // capacity drops here too
  EXPECT_EQ(one.row, two.row);
  EXPECT_EQ(std::memcmp(&one.loss, &two.loss, sizeof(double)), 0) << one.loss << " vs " << two.loss;
  EXPECT_EQ(std::memcmp(&one.aux, &two.aux, sizeof(double)), 0) << one.aux << " vs " << two.aux;
  EXPECT_EQ(std::memcmp(&one.z, &two.z, sizeof(double)), 0) << one.z << " vs " << two.z;
  EXPECT_TRUE(bitwise_equal(one.scores, two.scores));
  EXPECT_TRUE(bitwise_equal(one.weight, two.weight));
  EXPECT_TRUE(bitwise_equal(one.out, two.out));
  EXPECT_TRUE(bitwise_equal(one.dx, two.dx));
  EXPECT_TRUE(bitwise_equal(one.dlogits, two.dlogits));
}

}  // namespace
}  // namespace moe

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/threads.h"
#include "gradcheck.h"
#include "kernels/attention.h"

namespace moe {
namespace {

using test::random_vector;

struct Shape {
  int64_t B, S, H, G, d;
  int64_t q_size() const { return B * S * H * d; }
  int64_t kv_size() const { return B * S * G * d; }
  int64_t probs_size() const { return B * H * S * S; }
};

// Written independently of the kernel: full score matrix with an explicit mask.
void naive_attention(std::vector<double>& out, const std::vector<double>& q,
                     const std::vector<double>& k, const std::vector<double>& v, const Shape& s) {
  out.assign(s.q_size(), 0.0);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t g = h * s.G / s.H;
      for (int64_t i = 0; i < s.S; ++i) {
        std::vector<double> w(s.S, 0.0);
        double total = 0;
        for (int64_t j = 0; j < s.S; ++j) {
          if (j > i) continue;  // causal mask
          double score = 0;
          for (int64_t c = 0; c < s.d; ++c)
            score +=
                q[((b * s.S + i) * s.H + h) * s.d + c] * k[((b * s.S + j) * s.G + g) * s.d + c];
          w[j] = std::exp(score / std::sqrt(static_cast<double>(s.d)));
          total += w[j];
        }
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t c = 0; c < s.d; ++c)
            out[((b * s.S + i) * s.H + h) * s.d + c] +=
                w[j] / total * v[((b * s.S + j) * s.G + g) * s.d + c];
      }
    }
}

TEST(Attention, ForwardMatchesNaiveReference) {
  const Shape s{2, 5, 4, 2, 6};
  const std::vector<double> q = random_vector(s.q_size(), 1, "q");
  const std::vector<double> k = random_vector(s.kv_size(), 1, "k");
  const std::vector<double> v = random_vector(s.kv_size(), 1, "v");
  std::vector<double> out(s.q_size()), probs(s.probs_size(), -1.0), ref;
  attention_forward(out.data(), probs.data(), q.data(), k.data(), v.data(), s.B, s.S, s.H, s.G,
                    s.d);
  naive_attention(ref, q, k, v, s);
  for (int64_t i = 0; i < s.q_size(); ++i) EXPECT_NEAR(out[i], ref[i], 1e-13) << i;
  for (int64_t row = 0; row < s.B * s.H * s.S; ++row) {
    const int64_t i = row % s.S;
    double sum = 0;
    for (int64_t j = 0; j < s.S; ++j) {
      const double p = probs[row * s.S + j];
      if (j > i) {
        EXPECT_EQ(p, 0.0) << "row " << row << " col " << j;
      }
      sum += p;
    }
    EXPECT_NEAR(sum, 1.0, 1e-14) << "row " << row;
  }
}

void check_gradients(const Shape& s) {
  std::vector<double> q = random_vector(s.q_size(), 2, "q");
  std::vector<double> k = random_vector(s.kv_size(), 2, "k");
  std::vector<double> v = random_vector(s.kv_size(), 2, "v");
  const std::vector<double> probe = random_vector(s.q_size(), 2, "probe");
  std::vector<double> out(s.q_size()), probs(s.probs_size());
  auto loss = [&] {
    attention_forward(out.data(), probs.data(), q.data(), k.data(), v.data(), s.B, s.S, s.H, s.G,
                      s.d);
    return test::dot(out, probe);
  };
  loss();
  // Poisoned: backward must overwrite.
  std::vector<double> dq(s.q_size(), NAN), dk(s.kv_size(), NAN), dv(s.kv_size(), NAN);
  attention_backward(dq.data(), dk.data(), dv.data(), probe.data(), q.data(), k.data(), v.data(),
                     probs.data(), s.B, s.S, s.H, s.G, s.d);
  test::expect_gradient_close("dq", q, dq, loss);
  test::expect_gradient_close("dk", k, dk, loss);
  test::expect_gradient_close("dv", v, dv, loss);
}

TEST(Attention, GradientMatchesFiniteDifferencesGrouped) { check_gradients({2, 5, 4, 2, 6}); }
TEST(Attention, GradientMatchesFiniteDifferencesMultiQuery) { check_gradients({1, 4, 3, 1, 5}); }
TEST(Attention, GradientMatchesFiniteDifferencesMultiHead) { check_gradients({2, 3, 2, 2, 4}); }

TEST(Attention, FutureKeysAndValuesDoNotChangeEarlierOutputs) {
  const Shape s{2, 6, 4, 2, 4};
  const std::vector<double> q = random_vector(s.q_size(), 3, "q");
  std::vector<double> k = random_vector(s.kv_size(), 3, "k");
  std::vector<double> v = random_vector(s.kv_size(), 3, "v");
  std::vector<double> out0(s.q_size()), out1(s.q_size()), probs(s.probs_size());
  attention_forward(out0.data(), probs.data(), q.data(), k.data(), v.data(), s.B, s.S, s.H, s.G,
                    s.d);
  const int64_t j = 3;  // change position j of batch 1, every kv head
  for (int64_t g = 0; g < s.G; ++g)
    for (int64_t c = 0; c < s.d; ++c) {
      k[((1 * s.S + j) * s.G + g) * s.d + c] += 1.5;
      v[((1 * s.S + j) * s.G + g) * s.d + c] -= 2.0;
    }
  attention_forward(out1.data(), probs.data(), q.data(), k.data(), v.data(), s.B, s.S, s.H, s.G,
                    s.d);
  const int64_t row = s.H * s.d;  // one position's outputs
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t i = 0; i < s.S; ++i) {
      const bool must_change = b == 1 && i >= j;
      bool changed = false;
      for (int64_t c = 0; c < row; ++c) {
        const int64_t at = (b * s.S + i) * row + c;
        changed |= out0[at] != out1[at];
      }
      EXPECT_EQ(changed, must_change) << "batch " << b << " position " << i;
    }
}

TEST(Attention, FloatMatchesDouble) {
  const Shape s{2, 9, 4, 2, 8};
  const std::vector<double> q = random_vector(s.q_size(), 4, "q");
  const std::vector<double> k = random_vector(s.kv_size(), 4, "k");
  const std::vector<double> v = random_vector(s.kv_size(), 4, "v");
  const std::vector<double> dout = random_vector(s.q_size(), 4, "dout");
  std::vector<double> out(s.q_size()), probs(s.probs_size()), dq(s.q_size()), dk(s.kv_size()),
      dv(s.kv_size());
  attention_forward(out.data(), probs.data(), q.data(), k.data(), v.data(), s.B, s.S, s.H, s.G,
                    s.d);
  attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                     probs.data(), s.B, s.S, s.H, s.G, s.d);

  const std::vector<float> qf(q.begin(), q.end()), kf(k.begin(), k.end()), vf(v.begin(), v.end()),
      doutf(dout.begin(), dout.end());
  std::vector<float> outf(s.q_size()), probsf(s.probs_size()), dqf(s.q_size()), dkf(s.kv_size()),
      dvf(s.kv_size());
  attention_forward(outf.data(), probsf.data(), qf.data(), kf.data(), vf.data(), s.B, s.S, s.H, s.G,
                    s.d);
  attention_backward(dqf.data(), dkf.data(), dvf.data(), doutf.data(), qf.data(), kf.data(),
                     vf.data(), probsf.data(), s.B, s.S, s.H, s.G, s.d);
  auto expect_near = [](const char* what, const std::vector<float>& f,
                        const std::vector<double>& d) {
    for (size_t i = 0; i < d.size(); ++i)
      EXPECT_NEAR(f[i], d[i], 1e-5 * std::max(1.0, std::abs(d[i]))) << what << " " << i;
  };
  expect_near("out", outf, out);
  expect_near("probs", probsf, probs);
  expect_near("dq", dqf, dq);
  expect_near("dk", dkf, dk);
  expect_near("dv", dvf, dv);
}

TEST(Attention, BackwardIndependentOfThreadCount) {
  const Shape s{2, 64, 4, 2, 16};
  auto to_float = [](const std::vector<double>& x) {
    return std::vector<float>(x.begin(), x.end());
  };
  const std::vector<float> q = to_float(random_vector(s.q_size(), 5, "q"));
  const std::vector<float> k = to_float(random_vector(s.kv_size(), 5, "k"));
  const std::vector<float> v = to_float(random_vector(s.kv_size(), 5, "v"));
  const std::vector<float> dout = to_float(random_vector(s.q_size(), 5, "dout"));
  struct Result {
    std::vector<float> out, probs, dq, dk, dv;
  };
  auto run = [&](int threads) {
    set_num_threads(threads);
    Result r{std::vector<float>(s.q_size()), std::vector<float>(s.probs_size()),
             std::vector<float>(s.q_size()), std::vector<float>(s.kv_size()),
             std::vector<float>(s.kv_size())};
    attention_forward(r.out.data(), r.probs.data(), q.data(), k.data(), v.data(), s.B, s.S, s.H,
                      s.G, s.d);
    attention_backward(r.dq.data(), r.dk.data(), r.dv.data(), dout.data(), q.data(), k.data(),
                       v.data(), r.probs.data(), s.B, s.S, s.H, s.G, s.d);
    return r;
  };
  const int saved = num_threads();
  const Result one = run(1), two = run(2);
  set_num_threads(saved);
  EXPECT_EQ(one.out, two.out);
  EXPECT_EQ(one.probs, two.probs);
  EXPECT_EQ(one.dq, two.dq);
  EXPECT_EQ(one.dk, two.dk);
  EXPECT_EQ(one.dv, two.dv);
}

TEST(Attention, RejectsHeadsNotDivisibleByKvHeads) {
  std::vector<double> buf(1000);
  EXPECT_THROW(
      attention_forward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), 1, 2, 3, 2, 4),
      Error);
}

}  // namespace
}  // namespace moe

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "gradcheck.h"
#include "kernels/embedding.h"

namespace moe {
namespace {

using test::random_vector;

TEST(Embedding, ForwardCopiesTheRowOfEachId) {
  const int64_t V = 4, D = 3;
  std::vector<double> table(V * D);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<double>(i);
  const std::vector<int32_t> ids = {2, 0, 2, 3};
  std::vector<double> out(ids.size() * D, -1);
  embedding_forward(out.data(), ids.data(), table.data(), 4, V, D);
  EXPECT_EQ(out, (std::vector<double>{6, 7, 8, 0, 1, 2, 6, 7, 8, 9, 10, 11}));
}

TEST(Embedding, GradientMatchesFiniteDifferences) {
  // Ragged sizes, repeated ids (rows summed over several tokens), one unused row.
  const int64_t T_ = 5, V = 6, D = 7;
  const std::vector<int32_t> ids = {3, 0, 3, 5, 3};
  std::vector<double> table = random_vector(V * D, 1, "table");
  const std::vector<double> probe = random_vector(T_ * D, 1, "probe");
  std::vector<double> out(T_ * D), dtable(V * D, 0.0);
  embedding_backward(dtable.data(), ids.data(), probe.data(), T_, V, D);
  auto loss = [&] {
    embedding_forward(out.data(), ids.data(), table.data(), T_, V, D);
    return test::dot(out, probe);
  };
  test::expect_gradient_close("dtable", table, dtable, loss);
  for (int64_t c = 0; c < D; ++c) EXPECT_EQ(dtable[1 * D + c], 0.0) << "row 1 is never used";
}

TEST(Embedding, BackwardAccumulates) {
  const int64_t T_ = 3, V = 2, D = 5;
  const std::vector<int32_t> ids = {1, 0, 1};
  const std::vector<double> dout = random_vector(T_ * D, 2, "dout");
  const std::vector<double> start = random_vector(V * D, 2, "start");
  std::vector<double> dtable = start;
  embedding_backward(dtable.data(), ids.data(), dout.data(), T_, V, D);
  for (int64_t c = 0; c < D; ++c) {
    EXPECT_DOUBLE_EQ(dtable[c], start[c] + dout[1 * D + c]);
    EXPECT_DOUBLE_EQ(dtable[D + c], start[D + c] + dout[c] + dout[2 * D + c]);
  }
}

TEST(Embedding, OutOfRangeIdThrowsNamingIdPositionAndVocab) {
  const int64_t V = 4, D = 2;
  std::vector<double> table(V * D, 1.0), out(3 * D), dtable(V * D);
  for (int32_t bad : {4, 9, -1}) {
    const std::vector<int32_t> ids = {0, 1, bad};
    try {
      embedding_forward(out.data(), ids.data(), table.data(), 3, V, D);
      ADD_FAILURE() << "no error for id " << bad;
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("token id " + std::to_string(bad) + " at position 2"), std::string::npos)
          << what;
      EXPECT_NE(what.find("[0, 4)"), std::string::npos) << what;
    }
    EXPECT_THROW(embedding_backward(dtable.data(), ids.data(), out.data(), 3, V, D), Error);
  }
}

TEST(Embedding, FloatMatchesDouble) {
  const int64_t T_ = 9, V = 5, D = 70;  // D spans several column blocks in backward
  std::vector<int32_t> ids(T_);
  for (int64_t t = 0; t < T_; ++t) ids[t] = static_cast<int32_t>((t * 3) % V);
  const std::vector<double> dout = random_vector(T_ * D, 3, "dout");
  std::vector<double> dtable(V * D, 0.0);
  std::vector<float> dout_f(dout.begin(), dout.end()), dtable_f(V * D, 0.0f);
  embedding_backward(dtable.data(), ids.data(), dout.data(), T_, V, D);
  embedding_backward(dtable_f.data(), ids.data(), dout_f.data(), T_, V, D);
  for (size_t i = 0; i < dtable.size(); ++i)
    EXPECT_NEAR(dtable_f[i], dtable[i], 1e-5 * std::max(1.0, std::abs(dtable[i]))) << i;
}

}  // namespace
}  // namespace moe

// The gate temperature controller's rule (moe/temperature_control.h): the update from one
// step's loads, the smoothing, the bounds, the return to the configured temperature, and
// the refusals of bad settings.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "moe/temperature_control.h"

namespace moe {
namespace {

struct State {
  std::vector<float> v = std::vector<float>(kTemperatureStateSize);
  explicit State(double t) { temperature_state_init(v.data(), t); }
  float t() const { return v[0]; }
  float smoothed() const { return v[1]; }
};

// 4 experts, loads 40/20/20/20: max/mean - 1 = 40 / 25 - 1 = 0.6.
const std::vector<int64_t> kSkewed{40, 20, 20, 20};

TEST(TemperatureControl, FirstStepTakesTheImbalanceAndMovesByTheRule) {
  const TemperatureControl down{0.1, 0.5, 0.25, 4.0, 1.0, -1};
  State s(1.0);
  EXPECT_LT(s.smoothed(), 0);  // nothing seen yet
  temperature_control_update(s.v.data(), kSkewed.data(), 4, down);
  EXPECT_FLOAT_EQ(s.smoothed(), 0.6f);
  EXPECT_FLOAT_EQ(s.t(), static_cast<float>(std::exp(-0.5 * (0.6 - 0.1))));
  TemperatureControl up = down;
  up.direction = 1;
  State r(1.0);
  temperature_control_update(r.v.data(), kSkewed.data(), 4, up);
  EXPECT_FLOAT_EQ(r.t(), static_cast<float>(std::exp(0.5 * (0.6 - 0.1))));
}

TEST(TemperatureControl, SmoothsTheImbalanceOverSteps) {
  const TemperatureControl c{0.1, 0.5, 0.25, 4.0, 1.0, -1};
  State s(1.0);
  temperature_control_update(s.v.data(), kSkewed.data(), 4, c);
  const double t1 = s.t();
  const std::vector<int64_t> even{25, 25, 25, 25};
  temperature_control_update(s.v.data(), even.data(), 4, c);
  const double m2 = kImbalanceSmoothing * 0.6 + (1 - kImbalanceSmoothing) * 0.0;  // 0.54: still above the target
  EXPECT_FLOAT_EQ(s.smoothed(), static_cast<float>(m2));
  EXPECT_FLOAT_EQ(s.t(), static_cast<float>(t1 * std::exp(-0.5 * (m2 - 0.1))));
}

TEST(TemperatureControl, StaysWithinItsBounds) {
  const TemperatureControl c{0.0, 10.0, 0.5, 2.0, 1.0, -1};
  State s(1.0);
  for (int i = 0; i < 5; ++i) temperature_control_update(s.v.data(), kSkewed.data(), 4, c);
  EXPECT_EQ(s.t(), 0.5f);
  TemperatureControl up = c;
  up.direction = 1;
  State r(1.0);
  for (int i = 0; i < 5; ++i) temperature_control_update(r.v.data(), kSkewed.data(), 4, up);
  EXPECT_EQ(r.t(), 2.0f);
}

// Balanced (below the target), the temperature returns to the configured one from either
// side, at most to it.
TEST(TemperatureControl, ReturnsToTheConfiguredTemperatureWhenBalanced) {
  const TemperatureControl c{0.5, 0.5, 0.25, 4.0, 1.0, -1};
  const std::vector<int64_t> even{25, 25, 25, 25};
  for (double start : {0.8, 1.2}) {
    State s(start);
    temperature_control_update(s.v.data(), even.data(), 4, c);  // imbalance 0: error -0.5
    const double factor = std::exp(0.5 * 0.5);
    EXPECT_FLOAT_EQ(s.t(), static_cast<float>(start < 1 ? std::min(1.0, start * factor) : std::max(1.0, start / factor)));
    for (int i = 0; i < 10; ++i) temperature_control_update(s.v.data(), even.data(), 4, c);
    EXPECT_EQ(s.t(), 1.0f) << "from " << start;
  }
}

TEST(TemperatureControl, EmptyStepLeavesTheStateAlone) {
  const TemperatureControl c{0.1, 0.5, 0.25, 4.0, 1.0, -1};
  State s(0.7);
  const std::vector<int64_t> none{0, 0, 0, 0};
  temperature_control_update(s.v.data(), none.data(), 4, c);
  EXPECT_EQ(s.t(), 0.7f);
  EXPECT_LT(s.smoothed(), 0);
}

TEST(TemperatureControl, RefusesBadSettings) {
  State s(1.0);
  EXPECT_ANY_THROW(temperature_control_update(s.v.data(), kSkewed.data(), 4, {0.1, 0.0, 0.25, 4.0, 1.0, -1}));
  EXPECT_ANY_THROW(temperature_control_update(s.v.data(), kSkewed.data(), 4, {0.1, 0.5, 4.0, 0.25, 1.0, -1}));
  EXPECT_ANY_THROW(temperature_control_update(s.v.data(), kSkewed.data(), 4, {0.1, 0.5, 0.25, 4.0, 1.0, 0}));
  EXPECT_ANY_THROW(temperature_control_update(s.v.data(), kSkewed.data(), 0, {0.1, 0.5, 0.25, 4.0, 1.0, -1}));
}

}  // namespace
}  // namespace moe

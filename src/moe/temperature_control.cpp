#include "moe/temperature_control.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace moe {

void temperature_state_init(float* state_2, double temperature) {
  state_2[0] = static_cast<float>(temperature);
  state_2[1] = -1.0f;
}

void temperature_control_update(float* state_2, const int64_t* load_E, int64_t E, const TemperatureControl& c) {
  MOE_CHECK(E >= 1, "expert count {} must be at least 1", E);
  MOE_CHECK(c.min > 0 && c.min <= c.max && c.gain > 0 && c.target >= 0 && (c.direction == 1 || c.direction == -1),
            "temperature control: bounds [{}, {}], gain {}, target {} are invalid", c.min, c.max, c.gain, c.target);
  int64_t total = 0, most = 0;
  for (int64_t e = 0; e < E; ++e) {
    total += load_E[e];
    most = std::max(most, load_E[e]);
  }
  if (total == 0) return;
  const double imbalance = static_cast<double>(most) * static_cast<double>(E) / static_cast<double>(total) - 1.0;
  const double previous = state_2[1];
  const double smoothed =
      previous < 0 ? imbalance : kImbalanceSmoothing * previous + (1.0 - kImbalanceSmoothing) * imbalance;
  double t = state_2[0];
  const double error = smoothed - c.target;
  if (error > 0) {
    t *= std::exp(c.direction * c.gain * error);
  } else {
    const double factor = std::exp(c.gain * -error);
    t = t > c.base ? std::max(c.base, t / factor) : std::min(c.base, t * factor);
  }
  state_2[0] = static_cast<float>(std::clamp(t, c.min, c.max));
  state_2[1] = static_cast<float>(smoothed);
}

}  // namespace moe

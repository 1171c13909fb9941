// Gate temperature auto-tuning (moe.temperature_control): the rule that moves one MoE
// layer's router temperature after a step from the expert loads that step measured. The
// rule, its bounds and what it does (and does not) achieve are in docs/ROUTING.md.
#pragma once
#include <cstdint>

namespace moe {

// The controller's settings: the imbalance target (metrics.alert_imbalance), the gain
// (moe.temperature_gain), the bounds (moe.temperature_min/max) and the configured
// temperature (moe.temperature), which the layer returns to while it is balanced.
struct TemperatureControl {
  double target = 0.15;
  double gain = 0.05;
  double min = 0.25;
  double max = 4.0;
  double base = 1.0;
  // Which way a high imbalance moves the temperature: +1 (up, flatter scores) when a
  // selection bias is added after the score function (moe.bias_balancing), -1 (down,
  // a stronger aux-loss gradient) otherwise. Measured: docs/ROUTING.md.
  int direction = -1;
};

// One layer's controller state, kept in fp32 so a checkpoint holds it exactly: the
// temperature and the smoothed imbalance (negative before the first step).
inline constexpr int64_t kTemperatureStateSize = 2;  // [temperature, smoothed imbalance]

// The smoothing of the measured imbalance (an EMA with this weight on the old value).
inline constexpr double kImbalanceSmoothing = 0.9;

// The initial state: the configured temperature, no imbalance seen yet.
void temperature_state_init(float* state_2, double temperature);

// One update from the step's assignments per expert (before dropping; summed over the
// data-parallel ranks, so every rank computes the same state):
//   m <- imbalance (first step) or 0.9 m + 0.1 imbalance, imbalance = max/mean - 1
//   m > target: t <- t * exp(direction * gain * (m - target))
//   m <= target: t moves back towards base by the factor exp(gain * (target - m)),
//                without passing it
//   t <- clamp(t, min, max).
// No assignments (an empty step) leave the state as it is.
void temperature_control_update(float* state_2, const int64_t* load_E, int64_t E, const TemperatureControl& c);

}  // namespace moe

// AdamW with decoupled weight decay (none on parameters registered without decay:
// norms and biases). fp32 moments, one contiguous state block per moment.
#pragma once
#include <vector>

#include "model/parameters.h"
#include "train/config.h"

namespace moe {

class AdamW {
 public:
  AdamW(const OptimizerConfig& config, ParameterStore<float>& params);
  // One update of every parameter with learning rate `lr`.
  void step(double lr);
  int64_t steps_taken() const { return steps_; }
  void set_steps_taken(int64_t steps) { steps_ = steps; }  // resuming from a checkpoint
  std::vector<float>& first_moment() { return m_; }
  std::vector<float>& second_moment() { return v_; }

 private:
  OptimizerConfig config_;
  ParameterStore<float>& params_;
  std::vector<int64_t> offsets_;  // into m_ / v_, per parameter id
  std::vector<float> m_, v_;
  int64_t steps_ = 0;
};

}  // namespace moe

// AdamW with decoupled weight decay (none on parameters registered without decay:
// norms and biases). One contiguous state block per moment, held as fp32; with
// optimizer.state_dtype = "bf16" the moments are rounded to bf16 (nearest even) when read
// and after each update, exactly as the GPU stores them (kernels/adamw_math.h holds the
// per-element arithmetic both use).
#pragma once
#include <vector>

#include "config/optimizer_config.h"
#include "model/parameters.h"

namespace moe {

class AdamW {
 public:
  AdamW(const OptimizerConfig& config, ParameterStore<float>& params);
  // One update of every parameter with learning rate `lr`.
  void step(double lr);
  int64_t steps_taken() const { return steps_; }
  void set_steps_taken(int64_t steps) { steps_ = steps; }  // resuming from a checkpoint
  // Packed: parameter after parameter in id order, no padding (the checkpoint layout).
  // Allocated (zeros) on first use: GPU and sharded CPU ranks keep their state elsewhere
  // and only fill these for checkpoints.
  std::vector<float>& first_moment() {
    ensure_moments();
    return m_;
  }
  std::vector<float>& second_moment() {
    ensure_moments();
    return v_;
  }
  // Where parameter `id`'s moments start in first_moment() / second_moment().
  int64_t moment_offset(int id) const { return offsets_[static_cast<size_t>(id)]; }
  bool bf16_moments() const { return bf16_moments_; }

 private:
  void ensure_moments();

  OptimizerConfig config_;
  ParameterStore<float>& params_;
  std::vector<int64_t> offsets_;  // into m_ / v_, per parameter id
  int64_t total_ = 0;  // moment elements
  std::vector<float> m_, v_;
  bool bf16_moments_ = false;
  int64_t steps_ = 0;
};

}  // namespace moe

// AdamW with decoupled weight decay (none on parameters registered without decay:
// norms and biases). One contiguous state block per moment, held as fp32; with
// optimizer.state_dtype = "bf16" the moments are rounded to bf16 (nearest even) when read
// and after each update, with "fp8" quantised per block of 16 after each update, exactly
// as the GPU stores them (kernels/adamw_math.h holds the arithmetic both use).
#pragma once
#include <vector>

#include "config/optimizer_config.h"
#include "kernels/adamw_math.h"
#include "model/parameters.h"

namespace moe {

// AdamW over n consecutive elements of one parameter, block element `index` (its offset in
// the ParameterStore's block) onwards, with the moments stored as `moments` says (the CPU
// optimizers' loop: this class and the sharded ones in dist/). fp32 and bf16 moments element
// by element; fp8 moments (index a multiple of adamw_math::kMomentBlock) block by block: the
// update reads the stored values (quantising the block first: moments from elsewhere read
// as the GPU's upload stores them) and computes in fp32, then each block's new m and v are
// stored quantised (stochastic rounding keyed by index and step).
void adamw_update_range(float* p, const float* g, float* m, float* v, int64_t n, int64_t index,
                        const adamw_math::AdamWScalars& s, float decay, MomentDtype moments);

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

 private:
  void ensure_moments();

  OptimizerConfig config_;
  ParameterStore<float>& params_;
  std::vector<int64_t> offsets_;  // into m_ / v_, per parameter id
  int64_t total_ = 0;  // moment elements
  std::vector<float> m_, v_;
  int64_t steps_ = 0;
};

}  // namespace moe

// The GPU model's parameters and optimizer state, in the CPU ParameterStore's layout
// (same offsets, alignment padding included):
// - the fp32 master weights as a bf16 "hi" block, which the matmuls read directly, plus
//   an int16 "lo" block that makes them exact (adamw_math::split_master): fp32 master
//   semantics without a separate bf16 copy;
// - fp32 gradients;
// - the AdamW moments in fp32 or bf16 (optimizer.state_dtype);
// - fp32 copies of the few parameters the forward pass reads in fp32 (router biases).
// Bytes per parameter: 2 + 2 + 4 + 2 x 4 = 16 with fp32 moments, 12 with bf16 ones.
//
// One optimizer step is a handful of launches over the whole block and no host sync:
// the global gradient norm in the CPU's summation order, the clip factor and the AdamW
// update all read and write their scalars in device memory (a CUDA graph can hold them).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "config/optimizer_config.h"
#include "core/bf16.h"
#include "kernels/gpu_ops.h"
#include "model/parameters.h"

namespace moe {

// The hyper-parameters of one AdamW step (`step` counts from 1).
struct AdamWStep {
  double lr = 0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;
  int64_t step = 1;
};

class GpuParameterStore {
 public:
  // Copies the values of `params` to the device; the moments start at zero. The
  // parameters in `fp32_copy_ids` are also kept as fp32 (fp32_values()).
  GpuParameterStore(const ParameterStore<float>& params, MomentDtype moments, const std::vector<int>& fp32_copy_ids,
                    cuda::Stream stream);
  ~GpuParameterStore();
  GpuParameterStore(const GpuParameterStore&) = delete;
  GpuParameterStore& operator=(const GpuParameterStore&) = delete;

  // bf16 weights (the hi halves) and fp32 gradients, indexed like the CPU store.
  const bf16* weights() const;
  float* grads();
  // The master weights' two halves, writable (expert parallelism copies experts' weights
  // between ranks); fp32_values copies are not affected.
  bf16* weights_hi();
  int16_t* weights_lo();
  // The AdamW moments' blocks (which = 0: first, 1: second), in the block layout, of
  // moment_bytes() per element (expert parallelism copies experts' moments between ranks).
  void* moment_block(int which);
  size_t moment_bytes() const;
  // The fp32 values of a parameter registered in fp32_copy_ids.
  const float* fp32_values(int id) const;
  MomentDtype moment_dtype() const;
  int64_t storage_numel() const;

  void zero_grads();
  // The AdamW steps only `update` (sorted disjoint [offset, count) ranges of the block),
  // and grad_norm() is then the norm over `norm` only. ZeRO-1: this rank's pieces, and its
  // part of the global norm; expert parallelism: the shared parameters and this rank's
  // experts, the norm over the whole block. The parameters with fp32 copies must lie
  // whole inside `update`.
  void set_step_ranges(const std::vector<std::pair<int64_t, int64_t>>& update,
                       const std::vector<std::pair<int64_t, int64_t>>& norm);
  // The extents of the parameters kept in fp32 too (their padding to 16 elements
  // included), sorted: a sharded optimizer must step them whole on every rank.
  std::vector<std::pair<int64_t, int64_t>> fp32_copy_ranges() const;
  // The global gradient norm (the CPU's clip_gradients norm, bit for bit); waits for it.
  double grad_norm();
  // AdamW with the gradients scaled by grad_scale first; waits for the update.
  void adamw_step(const AdamWStep& hyper, float grad_scale);
  // Gradient norm, clipping to max_norm (0: none) and AdamW, all on the device with no
  // host synchronisation. A non-finite norm leaves weights and moments untouched.
  void clip_and_adamw_step(const AdamWStep& hyper, double max_norm);
  // The norm of the last grad_norm() or clip_and_adamw_step() (waits for its copy), and
  // whether that step was skipped for a non-finite norm.
  double last_grad_norm();
  bool last_step_skipped();

  // Host copies, in the CPU store's layout (tests and checkpoints). The moments are
  // packed parameter after parameter (the CPU AdamW's layout) and always fp32; bf16
  // moments are rounded to nearest even on upload.
  void download_grads(ParameterStore<float>& params) const;
  void upload_grads(ParameterStore<float>& params);
  void download_params(ParameterStore<float>& params) const;
  void download_state(ParameterStore<float>& params, std::vector<float>& m, std::vector<float>& v) const;
  void upload_state(const ParameterStore<float>& params, const std::vector<float>& m, const std::vector<float>& v);

  // Device bytes held: the blocks above plus the optimizer's tables and partial sums.
  size_t device_bytes() const;
  static size_t bytes_per_parameter(MomentDtype moments);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace moe

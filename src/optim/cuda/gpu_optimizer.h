// The optimizer of the GPU path over a GpuParameterStore: the global gradient norm in the
// CPU's order (optim/grad_clip.cpp, bit for bit), clipping, the multi-tensor AdamW with
// fp32 or bf16 moments, and per-expert norms and clipping; the step and norm ranges of
// ZeRO-1 and expert parallelism. Its kernels are optim/gpu_ops.h's (grad_norm,
// multi_tensor_adamw, expert_clip_factors, scale_expert_slices); every call is ordered on
// the store's stream.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "core/cuda/phase_clock.h"
#include "core/range.h"
#include "kernels/gpu_ops.h"
#include "model/cuda/gpu_parameters.h"
#include "model/parameters.h"

namespace moe {

// The hyper-parameters of one AdamW step (`step` counts from 1).
struct AdamWStep {
  double lr = 0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;
  int64_t step = 1;
};

class GpuOptimizer {
 public:
  // Over `store`, laid out as `params` (decay flags, fp32 copies, expert groups: the CPU
  // store the device block was made from). `stream`: the store's (a cudaStream_t).
  GpuOptimizer(GpuParameterStore& store, const ParameterStore<float>& params, void* stream);
  ~GpuOptimizer();
  GpuOptimizer(const GpuOptimizer&) = delete;
  GpuOptimizer& operator=(const GpuOptimizer&) = delete;

  // Marks the optimizer's phase on `clock` (null: none).
  void set_phase_clock(gpu::PhaseClock* clock) { clock_ = clock; }
  // The AdamW steps only `update` (sorted disjoint [offset, count) ranges of the block),
  // and grad_norm() is then the norm over `norm` only. ZeRO-1: this rank's pieces, and its
  // part of the global norm; expert parallelism: the shared parameters and this rank's
  // experts, the norm over the whole block. The parameters with fp32 copies must lie
  // whole inside `update`.
  void set_step_ranges(const RangeList& update,
                       const RangeList& norm);
  // The global gradient norm (the CPU's clip_gradients norm, bit for bit); waits for it.
  double grad_norm();
  // AdamW with the gradients scaled by grad_scale first (global clipping); the bf16
  // weights are the masters' hi halves, so they are current after it. Waits for it.
  void adamw_step(const AdamWStep& hyper, float grad_scale);
  // Gradient norm, clipping to max_norm (0: none) and AdamW, all on the device with no
  // host synchronisation. A non-finite norm leaves weights and moments untouched.
  void clip_and_adamw_step(const AdamWStep& hyper, double max_norm);
  // The norm of the last grad_norm() or clip_and_adamw_step() (waits for its copy), and
  // whether that step was skipped for a non-finite norm.
  double last_grad_norm();
  bool last_step_skipped();
  // Per-expert clipping, the first half of optim/grad_clip.cpp's clip_gradients: every
  // expert slot's gradient norm over its slices of the expert tensors (the CPU's sums, bit
  // for bit), expert group (MoE layer) after group, slot by slot; with max_norm > 0 each
  // slot whose norm exceeds it has its gradients scaled by float(max_norm / (norm + 1e-6)).
  // Returns the norms before clipping, in slot order (GpuTransformer::to_expert_order
  // turns them into expert order); waits for them.
  // ZeRO-1 (after shard_expert_clip): this rank's parts of the slices give partial sums of
  // squares, `sum_over_ranks` adds them up in place over the ranks (collective), and the
  // factors scale this rank's update ranges.
  std::vector<double> clip_expert_grads(double max_norm,
                                        const std::function<void(std::vector<double>& squares)>& sum_over_ranks = {});
  // ZeRO-1: per-expert clipping over sharded gradients. `norm`: the block ranges this rank
  // adds to the norms (over the ranks each element once), `update`: the ranges it scales
  // (the ones it steps). Sorted, disjoint [offset, count) ranges.
  void shard_expert_clip(const RangeList& norm,
                         const RangeList& update);
  // Device bytes of the optimizer's tables and partial sums.
  size_t device_bytes() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
  gpu::PhaseClock* clock_ = nullptr;
};

}  // namespace moe

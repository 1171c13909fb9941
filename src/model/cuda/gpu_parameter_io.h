// Host copies of a GpuParameterStore's state (model/cuda/gpu_parameters.h), in the CPU
// store's layout: tests, checkpoints, the host model's refresh, expert re-placement.
// Only the resident ranges are copied (the host's other elements are left as they are).
// bf16 gradients are widened on download and rounded to nearest even on upload. The
// moments are packed parameter after parameter (the CPU AdamW's layout) and always fp32 on
// the host; bf16 and fp8 moments are converted on the way. Each call returns once its
// copies are done.
#pragma once
#include <vector>

#include "core/range.h"
#include "model/cuda/gpu_parameters.h"
#include "model/parameters.h"

namespace moe {

// download_grads writes zeros where nothing is resident (no gradient was computed there)
// and, with shared gradients (ZeRO-2), outside the held ones.
void download_grads(const GpuParameterStore& store, ParameterStore<float>& params);
void upload_grads(GpuParameterStore& store, ParameterStore<float>& params);
// The master weights (hi and lo halves joined); `only`: just this range (resident; null:
// every resident range).
void download_params(const GpuParameterStore& store, ParameterStore<float>& params, const Range* only = nullptr);
void download_state(const GpuParameterStore& store, ParameterStore<float>& params, std::vector<float>& m,
                    std::vector<float>& v, const Range* only = nullptr);
// upload_state with m and v empty: the weights only.
void upload_state(GpuParameterStore& store, const ParameterStore<float>& params, const std::vector<float>& m,
                  const std::vector<float>& v);
// Block range r (inside optimizer_ranges(store), gpu_parameter_zero.h) as fp32 on the
// host, values[0, r.count): the master weights, the moments into m and v (null: not
// copied); and back (bf16 moments rounded to nearest even; the fp32 copies of its
// parameters refreshed). Checkpoints of a rank's own pieces.
void download_range(const GpuParameterStore& store, Range r, float* values, float* m, float* v);
void upload_range(GpuParameterStore& store, Range r, const float* values, const float* m, const float* v);

}  // namespace moe

// Host side shared by our launches of DeepGEMM's Hopper kernels (fp8_deepgemm.cu,
// bf16_deepgemm.cu): TMA maps through the driver (opened at run time), the experts' group
// arrays the grouped layouts read on the device, and the zeroing of experts a grouped
// weight gradient leaves unwritten. Kept free of DeepGEMM's headers.
#pragma once
#include <cuda.h>

#include <cstdint>

#include "kernels/gpu_ops.h"

namespace moe::cuda::deepgemm {

// A 2-D map over [outer, inner] (inner contiguous, pitch_bytes a row) in boxes of
// box_outer x box_inner elements; `what` names the GEMM in the error.
CUtensorMap map_2d(CUtensorMapDataType type, const void* base, uint64_t inner, uint64_t outer, uint64_t pitch_bytes,
                   uint32_t box_inner, uint32_t box_outer, CUtensorMapSwizzle swizzle, const char* what);

// The m-grouped "psum" layout's group ends (`groups`, the count the kernel was compiled
// for): expert e's end offsets_E1[e + 1], then empty groups ending at the last end rounded
// up to block_m (the scheduler starts a group at the previous end rounded up and counts its
// tiles in unsigned arithmetic: an end below that start would wrap).
void write_group_ends(int32_t* ends_G, int64_t groups, const int32_t* offsets_E1, int64_t E, int64_t block_m,
                      Stream stream);

// The k-grouped layout's group sizes: expert e's padded rows offsets_E1[e + 1] -
// offsets_E1[e], then zeros up to `groups`.
void write_group_sizes(int32_t* sizes_G, int64_t groups, const int32_t* offsets_E1, int64_t E, Stream stream);

// Zero the slab [per_expert] of every expert without rows (a k-grouped weight gradient
// does not write those; written gradients must read zero there).
void zero_empty_experts(bf16* slabs, int64_t per_expert, const int32_t* offsets_E1, int64_t E, Stream stream);

}  // namespace moe::cuda::deepgemm

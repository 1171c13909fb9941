// PaddedExpertGemmBf16 (kernels/gpu_ops.h): the experts' bf16 GEMMs through DeepGEMM's
// Hopper bf16 kernel (instantiated in bf16_deepgemm_{forward,data,weight}.cu) over rows
// padded per expert to 128. The kernel is persistent over a compiled SM count: the grid is
// exactly kDeepGemmSms CTAs. docs/KERNEL_ROADMAP.md, "bf16 expert GEMMs on DeepGEMM".
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <initializer_list>

#include "core/error_base.h"
#include "core/gpu.h"
#include "kernels/cuda/bf16_deepgemm_kernels.h"
#include "kernels/cuda/deepgemm_host.h"
#include "kernels/gpu_ops.h"

namespace moe::cuda {

namespace {

using namespace bf16_deepgemm;

constexpr CUtensorMapDataType kBf16 = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
constexpr CUtensorMapSwizzle kSwizzle = CU_TENSOR_MAP_SWIZZLE_128B;
constexpr uint32_t kRowAlign = 128;  // the padded dispatch's: each expert's rows start at a multiple of it
static_assert(kRowAlign % kBlockM == 0 && kRowAlign % kBlockK == 0, "an expert's rows fill whole tiles");

// The row maps: [rows, width] at a row pitch of ld elements, in boxes of box_rows x 64
// (the 128-byte swizzle's width).
CUtensorMap rows_map(const bf16* base, int64_t rows, int64_t width, int64_t ld, uint32_t box_rows, const char* what) {
  return deepgemm::map_2d(kBf16, base, static_cast<uint64_t>(width), static_cast<uint64_t>(rows),
                          static_cast<uint64_t>(ld) * 2, 64, box_rows, kSwizzle, what);
}

void check(const char* what, std::initializer_list<int64_t> sizes, std::initializer_list<const void*> pointers) {
  for (int64_t n : sizes)
    MOE_CHECKF(n > 0 && n % 64 == 0, "%s: size or leading dimension %lld is not a positive multiple of 64", what,
               static_cast<long long>(n));
  for (const void* p : pointers)
    MOE_CHECKF(reinterpret_cast<uintptr_t>(p) % 16 == 0, "%s: operands must be 16-byte aligned (TMA)", what);
}

template <class K, class... Maps>
void launch(K k, size_t shared, Stream stream, uint32_t cluster, int32_t* layout, int64_t M, int64_t N, int64_t K_,
            const Maps&... maps) {
  MOE_CHECKF(M <= INT32_MAX && N <= INT32_MAX && K_ <= INT32_MAX, "DeepGEMM bf16 GEMM: %lld x %lld x %lld is too large",
             static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K_));
  // Per call (a cheap driver call): the attribute is the current device's (thread ranks drive several).
  MOE_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster;
  attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(kDeepGemmSms));
  config.blockDim = dim3(kTmaThreads + kMathThreads);
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  MOE_CUDA_CHECK(cudaLaunchKernelEx(&config, k, layout, static_cast<uint32_t>(M), static_cast<uint32_t>(N),
                                    static_cast<uint32_t>(K_), maps...));
}

// B of the data gradients: the experts' [K, N] weights one after another, MN-major (N
// contiguous), in boxes of K's 64 rows x 64 columns.
CUtensorMap mn_major_weights(const bf16* w, int64_t E, int64_t K, int64_t N, const char* what) {
  return deepgemm::map_2d(kBf16, w, static_cast<uint64_t>(N), static_cast<uint64_t>(E * K), static_cast<uint64_t>(N) * 2,
                          64, kBlockK, kSwizzle, what);
}

// Our SwiGLU kernels' shapes: R rows, F in whole 128-column tiles.
void check_swiglu(const char* what, int64_t R, int64_t F) {
  MOE_CHECKF(R > 0 && R % 4 == 0 && R <= INT32_MAX / 2, "%s: %lld rows (a positive multiple of 4)", what,
             static_cast<long long>(R));
  MOE_CHECKF(F > 0 && F % PaddedExpertGemmBf16::kSwigluColumns == 0, "%s: F = %lld is not a positive multiple of %lld",
             what, static_cast<long long>(F), static_cast<long long>(PaddedExpertGemmBf16::kSwigluColumns));
}

// 2-CTA clusters share B's tile between consecutive row tiles; both must have a tile with
// the same B, which an even count of N tiles per expert guarantees.
bool pairs(int64_t N) { return (N + kBlockN - 1) / kBlockN % 2 == 0; }

// The m-grouped kernels' group ends (each expert's padded row end, in `ends`) written on
// `stream`; null when no expert is set, so there is nothing to launch.
int32_t* group_ends(gpu::DeviceArray<int32_t>& ends, int64_t E, const int32_t* offsets_E1, Stream stream) {
  if (E == 0) return nullptr;
  deepgemm::write_group_ends(ends.data(), compiled_groups(E), offsets_E1, E, kBlockM, stream);
  return ends.data();
}

}  // namespace

struct PaddedExpertGemmBf16::State {
  int64_t max_experts = 0, n_experts = 0;
  // One array of group ends (or sizes) per operation, so that operations on different
  // streams never overwrite each other's.
  gpu::DeviceArray<int32_t> forward_ends, data_ends, weight_sizes;
};

PaddedExpertGemmBf16::PaddedExpertGemmBf16(int64_t max_experts) : state_(new State) {
  State& s = *state_;
  MOE_CHECKF(max_experts >= 1 && max_experts <= kMaxExperts, "PaddedExpertGemmBf16: %lld experts (1 to %lld)",
             static_cast<long long>(max_experts), static_cast<long long>(kMaxExperts));
  MOE_CHECKF(deepgemm_available(), "PaddedExpertGemmBf16: needs an sm_90 GPU with %lld multiprocessors",
             static_cast<long long>(kDeepGemmSms));
  s.max_experts = s.n_experts = max_experts;
  s.forward_ends = gpu::DeviceArray<int32_t>(kMaxExperts);
  s.data_ends = gpu::DeviceArray<int32_t>(kMaxExperts);
  s.weight_sizes = gpu::DeviceArray<int32_t>(kMaxExperts);
}

PaddedExpertGemmBf16::~PaddedExpertGemmBf16() { delete state_; }

void PaddedExpertGemmBf16::set_experts(int64_t n_experts) {
  MOE_CHECKF(n_experts >= 0 && n_experts <= state_->max_experts, "PaddedExpertGemmBf16: %lld experts, room for %lld",
             static_cast<long long>(n_experts), static_cast<long long>(state_->max_experts));
  state_->n_experts = n_experts;
}

void PaddedExpertGemmBf16::forward(int sets, bf16* const* out, int64_t ld_out, const bf16* x, int64_t ld_x,
                                   const bf16* const* w, const int32_t* offsets_E1, int64_t R, int64_t N, int64_t K,
                                   Stream stream) {
  constexpr const char* what = "PaddedExpertGemmBf16::forward";
  MOE_CHECKF(sets >= 1 && sets <= kMaxSets, "%s: %d sets", what, sets);
  MOE_CHECKF(R > 0 && R % 4 == 0, "%s: %lld rows (a positive multiple of 4)", what, static_cast<long long>(R));
  for (int s = 0; s < sets; ++s) check(what, {N, K, ld_out, ld_x}, {out[s], x, w[s]});
  const int64_t E = state_->n_experts;
  int32_t* ends = group_ends(state_->forward_ends, E, offsets_E1, stream);
  if (ends == nullptr) return;
  const Kernel k = forward_kernel(E, pairs(N));
  const CUtensorMap map_x = rows_map(x, R, K, ld_x, kBlockM, what);
  for (int s = 0; s < sets; ++s) {
    // B: the experts' [N, K] weights one after another, K-major.
    const CUtensorMap map_w = deepgemm::map_2d(kBf16, w[s], static_cast<uint64_t>(K), static_cast<uint64_t>(E * N),
                                               static_cast<uint64_t>(K) * 2, kBlockK, kBlockN, kSwizzle, what);
    launch(k, shared_bytes(), stream, pairs(N) ? 2 : 1, ends, R, N, K, map_x, map_w, rows_map(out[s], R, N, ld_out, kBlockM, what));
  }
}

void PaddedExpertGemmBf16::forward_swiglu(bf16* gate_up, bf16* act, const bf16* x, int64_t ld_x, const bf16* w,
                                          const int32_t* offsets_E1, int64_t R, int64_t F, int64_t K, Stream stream) {
  constexpr const char* what = "PaddedExpertGemmBf16::forward_swiglu";
  check_swiglu(what, R, F);
  check(what, {F, K, ld_x}, {gate_up, act, x, w});
  const int64_t E = state_->n_experts;
  int32_t* ends = group_ends(state_->forward_ends, E, offsets_E1, stream);
  if (ends == nullptr) return;
  // B: the experts' [2F, K] weights one after another, K-major, in boxes of gate's (and
  // up's) 128 rows.
  const CUtensorMap map_w = deepgemm::map_2d(kBf16, w, static_cast<uint64_t>(K), static_cast<uint64_t>(E * 2 * F),
                                             static_cast<uint64_t>(K) * 2, kBlockK, kBlockN / 2, kSwizzle, what);
  const bool pair = pairs(2 * F);
  launch(gate_up_swiglu_kernel_for(E, pair), swiglu_shared_bytes(), stream, pair ? 2 : 1, ends, R, 2 * F, K, rows_map(x, R, K, ld_x, kBlockM, what),
         map_w, rows_map(gate_up, R, 2 * F, 2 * F, kBlockM, what), rows_map(act, R, F, F, kBlockM, what));
}

void PaddedExpertGemmBf16::backward_data(bf16* out, int64_t ld_out, const bf16* dy, int64_t ld_dy, const bf16* w,
                                         const int32_t* offsets_E1, int64_t R, int64_t N, int64_t K, float beta,
                                         Stream stream) {
  constexpr const char* what = "PaddedExpertGemmBf16::backward_data";
  check(what, {N, K, ld_out, ld_dy}, {out, dy, w});
  MOE_CHECKF(R > 0 && R % 4 == 0, "%s: %lld rows (a positive multiple of 4)", what, static_cast<long long>(R));
  MOE_CHECKF(beta == 0.0f || beta == 1.0f, "%s: beta %g (0: written, 1: added)", what, static_cast<double>(beta));
  const int64_t E = state_->n_experts;
  int32_t* ends = group_ends(state_->data_ends, E, offsets_E1, stream);
  if (ends == nullptr) return;
  launch(data_kernel(E, pairs(N), beta != 0.0f), shared_bytes(), stream, pairs(N) ? 2 : 1, ends, R, N, K,
         rows_map(dy, R, K, ld_dy, kBlockM, what), mn_major_weights(w, E, K, N, what),
         rows_map(out, R, N, ld_out, kBlockM, what));
}

void PaddedExpertGemmBf16::backward_data_swiglu(bf16* dgate_up, bf16* act, const bf16* dy, int64_t ld_dy,
                                                const bf16* w2, const bf16* gate_up, const int32_t* offsets_E1,
                                                int64_t R, int64_t F, int64_t K, Stream stream) {
  constexpr const char* what = "PaddedExpertGemmBf16::backward_data_swiglu";
  check_swiglu(what, R, F);
  check(what, {F, K, ld_dy}, {dgate_up, dy, w2, gate_up});
  MOE_CHECKF(reinterpret_cast<uintptr_t>(act) % 16 == 0, "%s: act must be 16-byte aligned", what);
  const int64_t E = state_->n_experts;
  int32_t* ends = group_ends(state_->data_ends, E, offsets_E1, stream);
  if (ends == nullptr) return;
  // The staged tile's first rows the math warps take themselves, so that the SwiGLU warps'
  // share fits inside the next tile's mainloop (~K long): 16 at K >= 2048, 32 at K <= 1024,
  // the fastest measured on an H100 (mixtral-mini's of 0-48 rows, olmoe-mini's of 0-32;
  // BENCHMARKS.md, 2026-12-06); other counts are not run by the tests.
  const auto math_rows = static_cast<uint32_t>(std::clamp<int64_t>(32768 / K / 8 * 8, 16, 32));
  launch(data_swiglu_backward_kernel_for(E, pairs(F)), swiglu_shared_bytes(), stream, pairs(F) ? 2 : 1, ends, R, F, K,
         rows_map(dy, R, K, ld_dy, kBlockM, what), mn_major_weights(w2, E, K, F, what), gate_up, dgate_up, act,
         math_rows);
}

void PaddedExpertGemmBf16::backward_weight(int sets, bf16* const* dw, const bf16* const* a, int64_t ld_a,
                                           const bf16* b, int64_t ld_b, const int32_t* offsets_E1, int64_t R,
                                           int64_t M, int64_t N, Stream stream) {
  constexpr const char* what = "PaddedExpertGemmBf16::backward_weight";
  MOE_CHECKF(sets >= 1 && sets <= kMaxSets, "%s: %d sets", what, sets);
  MOE_CHECKF(R > 0 && R % 4 == 0, "%s: %lld rows (a positive multiple of 4)", what, static_cast<long long>(R));
  // Group g's D rows are [g * M, (g + 1) * M): a partial row tile would spill into the next.
  MOE_CHECKF(M % kBlockM == 0, "%s: M = %lld is not a multiple of %u", what, static_cast<long long>(M), kBlockM);
  for (int s = 0; s < sets; ++s) check(what, {M, N, ld_a, ld_b}, {dw[s], a[s], b});
  const int64_t E = state_->n_experts;
  if (E == 0) return;
  int32_t* sizes = state_->weight_sizes.data();
  deepgemm::write_group_sizes(sizes, compiled_groups(E), offsets_E1, E, stream);
  const CUtensorMap map_b = rows_map(b, R, N, ld_b, kBlockK, what);
  // A cluster's two CTAs take consecutive row tiles of one column of D (the scheduler's
  // swizzle groups row tiles by 8 or 16): an even count of row tiles keeps every pair inside
  // one group and one swizzle group.
  const bool pair = M / kBlockM % 2 == 0;
  for (int s = 0; s < sets; ++s) {
    const CUtensorMap map_d = rows_map(dw[s], E * M, N, N, kBlockM, what);
    // shape_k: the rows in all; each group's own K comes from its size.
    launch(weight_kernel(E, pair), shared_bytes(), stream, pair ? 2 : 1, sizes, M, N, R,
           rows_map(a[s], R, M, ld_a, kBlockK, what), map_b, map_d);
    deepgemm::zero_empty_experts(dw[s], M * N, offsets_E1, E, stream);
  }
}

}  // namespace moe::cuda

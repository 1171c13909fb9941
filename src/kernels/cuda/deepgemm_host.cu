// Host side shared by the DeepGEMM launches (deepgemm_host.h).
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "core/error_base.h"
#include "core/gpu.h"
#include "kernels/cuda/deepgemm_host.h"

namespace moe::cuda {

namespace {

// The driver's cuTensorMapEncodeTiled through the runtime (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* address = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    MOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &address, 12000, cudaEnableDefault,
                                                    &found));
    MOE_CHECKF(found == cudaDriverEntryPointSuccess && address != nullptr, "CUDA driver: no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(address);
  }();
  return fn;
}

__global__ void group_ends_kernel(int32_t* ends_G, int64_t groups, const int32_t* offsets_E1, int64_t E,
                                  int64_t block_m) {
  const int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (g >= groups) return;
  ends_G[g] = g < E ? offsets_E1[g + 1] : static_cast<int32_t>((offsets_E1[E] + block_m - 1) / block_m * block_m);
}

__global__ void group_sizes_kernel(int32_t* sizes_G, int64_t groups, const int32_t* offsets_E1, int64_t E) {
  const int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (g >= groups) return;
  sizes_G[g] = g < E ? offsets_E1[g + 1] - offsets_E1[g] : 0;
}

// Block (x, e): a strided share of expert e's slab, zeroed when the expert has no rows.
__global__ void zero_empty_kernel(bf16* slabs, int64_t per_expert, const int32_t* offsets_E1) {
  const int64_t e = blockIdx.y;
  if (offsets_E1[e + 1] != offsets_E1[e]) return;
  bf16* slab = slabs + e * per_expert;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < per_expert;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    slab[i] = bf16{};
}

}  // namespace

bool deepgemm_available() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0 && gpu::multiprocessor_count() == static_cast<int>(kDeepGemmSms);
}

namespace deepgemm {

CUtensorMap map_2d(CUtensorMapDataType type, const void* base, uint64_t inner, uint64_t outer, uint64_t pitch_bytes,
                   uint32_t box_inner, uint32_t box_outer, CUtensorMapSwizzle swizzle, const char* what) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {pitch_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(&map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOE_CHECKF(r == CUDA_SUCCESS, "%s: cuTensorMapEncodeTiled failed (CUresult %d)", what, static_cast<int>(r));
  return map;
}

void write_group_ends(int32_t* ends_G, int64_t groups, const int32_t* offsets_E1, int64_t E, int64_t block_m,
                      Stream stream) {
  group_ends_kernel<<<static_cast<unsigned>((groups + 255) / 256), 256, 0, stream>>>(ends_G, groups, offsets_E1, E,
                                                                                     block_m);
  MOE_CUDA_CHECK(cudaGetLastError());
}

void write_group_sizes(int32_t* sizes_G, int64_t groups, const int32_t* offsets_E1, int64_t E, Stream stream) {
  group_sizes_kernel<<<static_cast<unsigned>((groups + 255) / 256), 256, 0, stream>>>(sizes_G, groups, offsets_E1, E);
  MOE_CUDA_CHECK(cudaGetLastError());
}

void zero_empty_experts(bf16* slabs, int64_t per_expert, const int32_t* offsets_E1, int64_t E, Stream stream) {
  if (E == 0 || per_expert == 0) return;
  MOE_CHECKF(E <= 65535, "zero_empty_experts: %lld experts", static_cast<long long>(E));
  const dim3 grid(128, static_cast<unsigned>(E));
  zero_empty_kernel<<<grid, 256, 0, stream>>>(slabs, per_expert, offsets_E1);
  MOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace deepgemm

}  // namespace moe::cuda

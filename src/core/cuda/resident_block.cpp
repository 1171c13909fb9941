#include "core/cuda/resident_block.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <utility>

#include "core/error.h"
#include "core/gpu.h"
#include "core/resident_chunks.h"

namespace moe::gpu {
namespace {

// The driver's virtual memory functions, looked up through the runtime (no link against
// libcuda, whose stub the build machine may lack).
struct DriverVmm {
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 reserve = nullptr;
  PFN_cuMemAddressFree_v10020 free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
};

template <typename F>
void look_up(F& fn, const char* name) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  MOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &address, 12000, cudaEnableDefault, &found));
  MOE_CHECK(found == cudaDriverEntryPointSuccess && address != nullptr, "CUDA driver: no {}", name);
  fn = reinterpret_cast<F>(address);
}

const DriverVmm& vmm() {
  static const DriverVmm fns = [] {
    DriverVmm d;
    look_up(d.granularity, "cuMemGetAllocationGranularity");
    look_up(d.reserve, "cuMemAddressReserve");
    look_up(d.free, "cuMemAddressFree");
    look_up(d.create, "cuMemCreate");
    look_up(d.release, "cuMemRelease");
    look_up(d.map, "cuMemMap");
    look_up(d.unmap, "cuMemUnmap");
    look_up(d.set_access, "cuMemSetAccess");
    return d;
  }();
  return fns;
}

void check(CUresult result, const char* what) {
  MOE_CHECK(result == CUDA_SUCCESS, "CUDA driver: {} failed (CUresult {})", what, static_cast<int>(result));
}

CUmemAllocationProp device_prop(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

}  // namespace

ResidentBlock::ResidentBlock(size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  MOE_CUDA_CHECK(cudaFree(nullptr));  // the runtime's context exists before the driver calls
  MOE_CUDA_CHECK(cudaGetDevice(&device_));
  const CUmemAllocationProp prop = device_prop(device_);
  size_t granularity = 0;
  check(vmm().granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity");
  chunk_ = static_cast<size_t>(resident_chunk_bytes(static_cast<int64_t>(bytes), static_cast<int64_t>(granularity)));
  const size_t chunks = (bytes + chunk_ - 1) / chunk_;
  reserved_ = chunks * chunk_;
  CUdeviceptr base = 0;
  check(vmm().reserve(&base, reserved_, granularity, 0, 0), "cuMemAddressReserve");
  base_ = reinterpret_cast<void*>(base);
  handles_.assign(chunks, 0);
}

ResidentBlock::~ResidentBlock() { release(); }

void ResidentBlock::release() {
  if (!base_) return;
  cudaDeviceSynchronize();  // no kernel may still use the memory
  for (size_t c = 0; c < handles_.size(); ++c)
    if (handles_[c]) {
      vmm().unmap(reinterpret_cast<CUdeviceptr>(base_) + c * chunk_, chunk_);
      vmm().release(handles_[c]);
    } else if (!shared_.empty() && shared_[c]) {
      vmm().unmap(reinterpret_cast<CUdeviceptr>(base_) + c * chunk_, chunk_);
    }
  for (unsigned long long pool : pools_) vmm().release(pool);
  vmm().free(reinterpret_cast<CUdeviceptr>(base_), reserved_);
  base_ = nullptr;
  handles_.clear();
  shared_.clear();
  pools_.clear();
  pool_bytes_ = 0;
}

void ResidentBlock::map_chunk(size_t chunk, unsigned long long handle, size_t offset) {
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const CUdeviceptr at = reinterpret_cast<CUdeviceptr>(base_) + chunk * chunk_;
  check(vmm().map(at, chunk_, offset, handle, 0), "cuMemMap");
  check(vmm().set_access(at, chunk_, &access, 1), "cuMemSetAccess");
}

void ResidentBlock::share_chunks(const std::vector<RangeList>& group_ranges, const std::vector<int>& pool_of_group) {
  MOE_CHECK(shared_.empty(), "resident block: chunks are shared already");
  MOE_CHECK(group_ranges.size() == pool_of_group.size(), "resident block: {} groups, {} pool indices",
            group_ranges.size(), pool_of_group.size());
  for (size_t g = 0; g < group_ranges.size(); ++g)
    for (const Range& range : group_ranges[g])
      MOE_CHECK(range.count <= 0 || (range.offset >= 0 && static_cast<size_t>(range.end()) <= bytes_),
                "resident block: bytes [{}, {}) outside its {}", range.offset, range.end(), bytes_);
  // Each group's chunks without memory, in order; a chunk goes to the first group naming it
  // (core/resident_chunks.h, which the memory planner counts with too).
  std::vector<char> taken(handles_.size(), 0);
  for (size_t c = 0; c < handles_.size(); ++c) taken[c] = handles_[c] != 0;
  const std::vector<std::vector<int64_t>> chunks_of =
      assign_shared_chunks(group_ranges, static_cast<int64_t>(chunk_), taken);
  // A pool is a list of chunk-sized allocations (cuMemMap maps whole allocations only):
  // group g's i-th chunk goes onto its pool's i-th.
  const std::vector<int64_t> pool_chunks = pool_chunk_counts(chunks_of, pool_of_group);
  const int n_pools = static_cast<int>(pool_chunks.size());
  shared_.assign(handles_.size(), 0);
  for (const std::vector<int64_t>& chunks : chunks_of)
    for (int64_t c : chunks) shared_[static_cast<size_t>(c)] = 1;
  const CUmemAllocationProp prop = device_prop(device_);
  std::vector<std::vector<unsigned long long>> pools(static_cast<size_t>(n_pools));
  for (int p = 0; p < n_pools; ++p)
    for (int64_t i = 0; i < pool_chunks[static_cast<size_t>(p)]; ++i) {
      CUmemGenericAllocationHandle handle = 0;
      const CUresult created = vmm().create(&handle, chunk_, &prop, 0);
      if (created == CUDA_ERROR_OUT_OF_MEMORY) {
        shared_.clear();
        for (unsigned long long made : pools_) vmm().release(made);
        pools_.clear();
        pool_bytes_ = 0;
        throw OutOfMemory("CUDA out of memory making " + std::to_string(chunk_) + " bytes of shared chunks");
      }
      check(created, "cuMemCreate");
      pools[static_cast<size_t>(p)].push_back(handle);
      pools_.push_back(handle);
      pool_bytes_ += chunk_;
    }
  for (size_t g = 0; g < group_ranges.size(); ++g)
    for (size_t i = 0; i < chunks_of[g].size(); ++i) {
      const auto chunk = static_cast<size_t>(chunks_of[g][i]);
      map_chunk(chunk, pools[static_cast<size_t>(pool_of_group[g])][i], 0);
      MOE_CUDA_CHECK(cudaMemset(static_cast<char*>(base_) + chunk * chunk_, 0, chunk_));
    }
}

ResidentBlock::ResidentBlock(ResidentBlock&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      reserved_(std::exchange(other.reserved_, 0)),
      chunk_(std::exchange(other.chunk_, 0)),
      device_(other.device_),
      handles_(std::move(other.handles_)),
      shared_(std::move(other.shared_)),
      pools_(std::move(other.pools_)),
      pool_bytes_(std::exchange(other.pool_bytes_, 0)) {}

ResidentBlock& ResidentBlock::operator=(ResidentBlock&& other) noexcept {
  if (this != &other) {
    release();
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    reserved_ = std::exchange(other.reserved_, 0);
    chunk_ = std::exchange(other.chunk_, 0);
    device_ = other.device_;
    handles_ = std::move(other.handles_);
    shared_ = std::move(other.shared_);
    pools_ = std::move(other.pools_);
    pool_bytes_ = std::exchange(other.pool_bytes_, 0);
  }
  return *this;
}

void ResidentBlock::set_resident(const RangeList& byte_ranges, bool zero_new) {
  MOE_CHECK(shared_.empty(), "resident block: the resident chunks cannot change once chunks are shared");
  for (const Range& range : byte_ranges)
    MOE_CHECK(range.count <= 0 || (range.offset >= 0 && static_cast<size_t>(range.end()) <= bytes_),
              "resident block: bytes [{}, {}) outside its {}", range.offset, range.end(), bytes_);
  std::vector<char> wanted(handles_.size(), 0);
  mark_covering_chunks(byte_ranges, static_cast<int64_t>(chunk_), wanted);
  // Map the missing chunks first, so that running out of memory leaves the block as it was.
  const CUmemAllocationProp prop = device_prop(device_);
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  std::vector<size_t> added;
  for (size_t c = 0; c < handles_.size(); ++c) {
    if (!wanted[c] || handles_[c]) continue;
    CUmemGenericAllocationHandle handle = 0;
    const CUresult created = vmm().create(&handle, chunk_, &prop, 0);
    if (created == CUDA_ERROR_OUT_OF_MEMORY) {
      for (size_t undo : added) {
        vmm().unmap(reinterpret_cast<CUdeviceptr>(base_) + undo * chunk_, chunk_);
        vmm().release(handles_[undo]);
        handles_[undo] = 0;
      }
      throw OutOfMemory("CUDA out of memory making " + std::to_string(chunk_) + " bytes resident");
    }
    check(created, "cuMemCreate");
    const CUdeviceptr at = reinterpret_cast<CUdeviceptr>(base_) + c * chunk_;
    check(vmm().map(at, chunk_, 0, handle, 0), "cuMemMap");
    check(vmm().set_access(at, chunk_, &access, 1), "cuMemSetAccess");
    handles_[c] = handle;
    added.push_back(c);
  }
  bool releasing = false;
  for (size_t c = 0; c < handles_.size(); ++c) releasing |= handles_[c] && !wanted[c];
  if (releasing) {
    MOE_CUDA_CHECK(cudaDeviceSynchronize());  // no kernel may still use what goes
    for (size_t c = 0; c < handles_.size(); ++c)
      if (handles_[c] && !wanted[c]) {
        check(vmm().unmap(reinterpret_cast<CUdeviceptr>(base_) + c * chunk_, chunk_), "cuMemUnmap");
        check(vmm().release(handles_[c]), "cuMemRelease");
        handles_[c] = 0;
      }
  }
  if (zero_new)
    for (size_t c : added) MOE_CUDA_CHECK(cudaMemset(static_cast<char*>(base_) + c * chunk_, 0, chunk_));
}

size_t ResidentBlock::resident_bytes() const {
  return chunk_ * static_cast<size_t>(std::count_if(handles_.begin(), handles_.end(), [](auto h) { return h != 0; })) +
         pool_bytes_;
}

RangeList ResidentBlock::resident_ranges() const {
  RangeList ranges;
  for (size_t c = 0; c < handles_.size(); ++c)
    if (handles_[c] || (!shared_.empty() && shared_[c])) {
      const int64_t at = static_cast<int64_t>(c * chunk_);
      append_merged(ranges, at, std::min<int64_t>(static_cast<int64_t>(chunk_), static_cast<int64_t>(bytes_) - at));
    }
  return ranges;
}

}  // namespace moe::gpu

// A device block of which only some ranges hold memory. The whole extent is reserved as
// virtual addresses, so every offset stays the one of the full block (kernels, ranges and
// host layouts need no translation), and physical memory backs only the chunks that cover
// the resident ranges (CUDA virtual memory management: cuMemAddressReserve, cuMemCreate,
// cuMemMap). What lets an expert-parallel rank keep state for its own experts only.
// Touching a byte outside the resident chunks is an illegal address.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/range.h"

namespace moe::gpu {

class ResidentBlock {
 public:
  ResidentBlock() = default;
  // Reserves `bytes` of addresses on the current device; nothing resident yet.
  explicit ResidentBlock(size_t bytes);
  ~ResidentBlock();
  ResidentBlock(ResidentBlock&& other) noexcept;
  ResidentBlock& operator=(ResidentBlock&& other) noexcept;
  ResidentBlock(const ResidentBlock&) = delete;
  ResidentBlock& operator=(const ResidentBlock&) = delete;

  void* data() const { return base_; }
  size_t bytes() const { return bytes_; }
  // Makes exactly the chunks that cover `byte_ranges` resident: the missing ones are
  // mapped (contents undefined; zeroed when `zero_new`), the others released (contents
  // lost). Chunks that stay keep their contents. Throws gpu::OutOfMemory when the device
  // has no room (what was resident before stays).
  void set_resident(const RangeList& byte_ranges, bool zero_new = false);
  // Physical bytes held, and the mapping granularity (a chunk is a multiple of it).
  size_t resident_bytes() const;
  size_t chunk_bytes() const { return chunk_; }
  // The resident chunks as byte ranges, sorted and merged (shared ones included).
  RangeList resident_ranges() const;

  // Chunks that are never live at the same time share memory: for each group g, the
  // chunks covering group_ranges[g] that hold no memory yet are mapped, in order, onto
  // pool pool_of_group[g] (a physical allocation as large as its largest group's chunks),
  // zeroed. Writing one group's shared chunks changes the other groups' of its pool
  // (ZeRO-2: the gradients of stages whose sums have left). Once; set_resident is then
  // refused.
  void share_chunks(const std::vector<RangeList>& group_ranges, const std::vector<int>& pool_of_group);

 private:
  void release();
  void map_chunk(size_t chunk, unsigned long long handle, size_t offset);

  void* base_ = nullptr;
  size_t bytes_ = 0, reserved_ = 0, chunk_ = 0;
  int device_ = 0;
  std::vector<unsigned long long> handles_;  // per chunk; 0: not resident
  std::vector<char> shared_;                 // per chunk: mapped onto a pool (handles_ 0)
  std::vector<unsigned long long> pools_;    // share_chunks' physical allocations
  size_t pool_bytes_ = 0;
};

}  // namespace moe::gpu

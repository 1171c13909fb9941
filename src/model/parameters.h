// ParameterStore: every trainable tensor of a model, laid out in one arena for values
// and one for gradients. Layers register their parameters (name, shape, how to
// initialise, whether weight decay applies), then the store allocates and initialises
// them. Names follow "layers.3.moe.experts.w1" so checkpoints and the RNG can key on them.
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "core/range.h"
#include "core/zeroed_allocator.h"

namespace moe {

enum class Init {
  Normal,   // normal(0, std)
  Kaiming,  // normal(0, sqrt(2 / fan_in)), fan_in = last dimension
  Ones,
  Zeros,
};

struct ParamSpec {
  std::string name;
  Shape shape;
  Init init = Init::Normal;
  double std = 0.02;          // for Init::Normal
  bool weight_decay = true;   // false for norms and biases
  // Expert weights have the expert index as their leading dimension; parameters with
  // the same expert_group (e.g. "layers.1.moe.experts") form one expert's parameters
  // for per-expert gradient clipping.
  std::string expert_group;
};

template <typename T>
class ParameterStore {
 public:
  // Returns an id for value()/grad(). Only before allocate().
  int add(ParamSpec spec);
  // Allocates values and gradients and fills the values from (seed, name, element).
  void allocate(uint64_t seed);

  T* value(int id) { return values_ptr(id); }
  T* grad(int id) { return grads_ptr(id); }
  const T* value(int id) const { return const_cast<ParameterStore*>(this)->values_ptr(id); }
  Tensor value_tensor(int id) const;
  Tensor grad_tensor(int id) const;

  int size() const { return static_cast<int>(specs_.size()); }
  const ParamSpec& spec(int id) const { return specs_[static_cast<size_t>(id)]; }
  int64_t numel(int id) const { return specs_[static_cast<size_t>(id)].shape.numel(); }
  int64_t total_numel() const;
  // Element offset of a parameter inside the one contiguous block, and the block's size
  // (with alignment padding): device copies use the same layout.
  int64_t offset(int id) const { return offsets_[static_cast<size_t>(id)]; }
  int64_t storage_numel() const { return static_cast<int64_t>(values_.size()); }
  // The offsets allocate() gives (each tensor on a 16-element boundary) and, last, the
  // block's size: size() + 1 entries, known before allocating (the memory planner's
  // layout, train/memory_plan.h).
  std::vector<int64_t> planned_offsets() const;
  const T* values_data() const { return values_.data(); }
  T* values_data() { return values_.data(); }
  T* grads_data() { return grads_.data(); }
  const T* grads_data() const { return grads_.data(); }
  int find(const std::string& name) const;  // -1 when absent
  // Zeroes the resident gradients.
  void zero_grads();
  // Keeps memory for `ranges` of the block only (sorted, disjoint element ranges; offsets
  // stay those of the whole block): the values and gradients elsewhere are released to the
  // OS (whole pages; they read as zero until written) and zero_grads leaves them alone.
  // Expert parallelism: the rank's own experts and the non-expert parameters.
  void set_resident(RangeList ranges);
  // The resident ranges (the whole block until set_resident).
  RangeList resident() const;
  // ZeRO-2/3: zeroes the values / gradients at `ranges` (sorted, disjoint) and gives their
  // whole pages back to the OS; they read as zero and cost nothing until written again.
  // Unlike set_resident nothing is recorded: the next write takes the memory back.
  void release_values(const RangeList& ranges);
  void release_grads(const RangeList& ranges);
  // Zeroes the gradients at `ranges` only (ZeRO-2: a rank's own pieces; the rest stays released).
  void zero_grads(const RangeList& ranges);

 private:
  // An id outside the store (-1: a parameter the config leaves out) is a bug, not a pointer.
  T* values_ptr(int id) {
    MOE_CHECK(id >= 0 && id < size(), "parameter id {} outside the store's {}", id, size());
    return values_.data() + offsets_[static_cast<size_t>(id)];
  }
  T* grads_ptr(int id) {
    MOE_CHECK(id >= 0 && id < size(), "parameter id {} outside the store's {}", id, size());
    return grads_.data() + offsets_[static_cast<size_t>(id)];
  }

  std::vector<ParamSpec> specs_;
  std::unordered_map<std::string, int> ids_;  // name -> id: registering N parameters is O(N), not O(N^2)
  std::vector<int64_t> offsets_;
  // One contiguous block each (ZeRO-1 and the multi-tensor optimizer want that). The
  // gradient block's pages are committed when first written: the GPU trainer never
  // writes them unless a test or checkpoint asks (core/zeroed_allocator.h).
  std::vector<T, ZeroedAllocator<T>> values_;
  std::vector<T, ZeroedAllocator<T>> grads_;
  RangeList resident_;  // empty: all of it
  bool allocated_ = false;
};

}  // namespace moe

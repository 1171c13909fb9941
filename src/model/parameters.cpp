#include "model/parameters.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>

#include "core/rng.h"

namespace moe {

template <typename T>
int ParameterStore<T>::add(ParamSpec spec) {
  MOE_CHECK(!allocated_, "parameter '{}' registered after allocation", spec.name);
  MOE_CHECK(spec.shape.ndim >= 1, "parameter '{}' has no shape", spec.name);
  const int id = static_cast<int>(specs_.size());
  MOE_CHECK(ids_.emplace(spec.name, id).second, "parameter '{}' registered twice", spec.name);
  specs_.push_back(std::move(spec));
  return id;
}

template <typename T>
std::vector<int64_t> ParameterStore<T>::planned_offsets() const {
  // Offsets rounded to 16 elements so each tensor starts on a 64-byte line.
  std::vector<int64_t> offsets;
  offsets.reserve(specs_.size() + 1);
  int64_t total = 0;
  for (const auto& spec : specs_) {
    offsets.push_back(total);
    total += (spec.shape.numel() + 15) / 16 * 16;
  }
  offsets.push_back(total);
  return offsets;
}

template <typename T>
void ParameterStore<T>::allocate(uint64_t seed) {
  MOE_CHECK(!allocated_, "parameters allocated twice");
  offsets_ = planned_offsets();
  const int64_t total = offsets_.back();
  offsets_.pop_back();
  values_.resize(static_cast<size_t>(total));  // zeros (padding included), touched only where written
  grads_.resize(static_cast<size_t>(total));
  allocated_ = true;
  for (int id = 0; id < size(); ++id) {
    const ParamSpec& spec = specs_[static_cast<size_t>(id)];
    T* out = values_ptr(id);
    const int64_t n = spec.shape.numel();
    switch (spec.init) {
      case Init::Normal:
        fill_normal(out, n, seed, spec.name, spec.std);
        break;
      case Init::Kaiming: {
        const int64_t fan_in = spec.shape[spec.shape.ndim - 1];
        fill_normal(out, n, seed, spec.name, std::sqrt(2.0 / static_cast<double>(fan_in)));
        break;
      }
      case Init::Ones:
        for (int64_t i = 0; i < n; ++i) out[i] = T(1);
        break;
      case Init::Zeros:
        break;
    }
  }
}

template <typename T>
Tensor ParameterStore<T>::value_tensor(int id) const {
  auto* self = const_cast<ParameterStore*>(this);
  return Tensor(self->values_ptr(id), dtype_of<T>(), spec(id).shape);
}

template <typename T>
Tensor ParameterStore<T>::grad_tensor(int id) const {
  auto* self = const_cast<ParameterStore*>(this);
  return Tensor(self->grads_ptr(id), dtype_of<T>(), spec(id).shape);
}

template <typename T>
int64_t ParameterStore<T>::total_numel() const {
  int64_t n = 0;
  for (const auto& spec : specs_) n += spec.shape.numel();
  return n;
}

template <typename T>
int ParameterStore<T>::find(const std::string& name) const {
  const auto it = ids_.find(name);
  return it == ids_.end() ? -1 : it->second;
}

template <typename T>
void ParameterStore<T>::zero_grads() {
  if (resident_.empty()) {
    std::memset(grads_.data(), 0, grads_.size() * sizeof(T));
    return;
  }
  for (const Range& r : resident_) std::memset(grads_.data() + r.offset, 0, static_cast<size_t>(r.count) * sizeof(T));
}

namespace {

// Returns the whole pages inside [begin, end) to the OS: private anonymous memory reads as
// zero afterwards and costs nothing until written.
void release_pages(void* begin, void* end) {
  static const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t from = (reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page;
  const uintptr_t to = reinterpret_cast<uintptr_t>(end) / page * page;
  if (to > from) madvise(reinterpret_cast<void*>(from), to - from, MADV_DONTNEED);
}

}  // namespace

template <typename T>
void ParameterStore<T>::set_resident(RangeList ranges) {
  MOE_CHECK(allocated_, "parameters: set_resident before allocate()");
  const auto n = static_cast<int64_t>(values_.size());
  for (size_t i = 0; i < ranges.size(); ++i)
    MOE_CHECK(ranges[i].offset >= 0 && ranges[i].end() <= n && (i == 0 || ranges[i].offset >= ranges[i - 1].end()),
              "parameters: resident range [{}, {}) not sorted, disjoint and inside the block of {}", ranges[i].offset,
              ranges[i].end(), n);
  for (const Range& r : subtract_ranges({{0, n}}, ranges))
    for (T* block : {values_.data(), grads_.data()}) release_pages(block + r.offset, block + r.end());
  resident_ = ranges.size() == 1 && ranges[0] == Range{0, n} ? RangeList{} : std::move(ranges);
}

template <typename T>
void ParameterStore<T>::zero_grads(const RangeList& ranges) {
  for (const Range& r : ranges) {
    MOE_CHECK(r.offset >= 0 && r.end() <= storage_numel(), "parameters: range [{}, {}) outside the block of {}",
              r.offset, r.end(), storage_numel());
    std::memset(grads_.data() + r.offset, 0, static_cast<size_t>(r.count) * sizeof(T));
  }
}

namespace {

// Zeroes [begin, begin + count): the whole pages inside go back to the OS, the partial
// pages at the ends (shared with elements that stay) are zeroed by hand.
template <typename T>
void zero_and_release(T* begin, int64_t count) {
  static const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto first = reinterpret_cast<uintptr_t>(begin), last = reinterpret_cast<uintptr_t>(begin + count);
  const uintptr_t from = (first + page - 1) / page * page, to = last / page * page;
  if (to <= from) {
    std::memset(begin, 0, static_cast<size_t>(count) * sizeof(T));
    return;
  }
  std::memset(begin, 0, from - first);
  madvise(reinterpret_cast<void*>(from), to - from, MADV_DONTNEED);
  std::memset(reinterpret_cast<void*>(to), 0, last - to);
}

}  // namespace

template <typename T>
void ParameterStore<T>::release_values(const RangeList& ranges) {
  for (const Range& r : ranges) {
    MOE_CHECK(r.offset >= 0 && r.end() <= storage_numel(), "parameters: range [{}, {}) outside the block of {}",
              r.offset, r.end(), storage_numel());
    zero_and_release(values_.data() + r.offset, r.count);
  }
}

template <typename T>
void ParameterStore<T>::release_grads(const RangeList& ranges) {
  for (const Range& r : ranges) {
    MOE_CHECK(r.offset >= 0 && r.end() <= storage_numel(), "parameters: range [{}, {}) outside the block of {}",
              r.offset, r.end(), storage_numel());
    zero_and_release(grads_.data() + r.offset, r.count);
  }
}

template <typename T>
RangeList ParameterStore<T>::resident() const {
  return resident_.empty() ? RangeList{{0, static_cast<int64_t>(values_.size())}} : resident_;
}

template class ParameterStore<float>;
template class ParameterStore<double>;

}  // namespace moe

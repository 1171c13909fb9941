#include "core/arena.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace moe {
namespace {
std::atomic<size_t> capacity_cap{0};
}  // namespace

void Arena::set_capacity_cap_for_testing(size_t bytes) { capacity_cap = bytes; }

void Arena::FreeDeleter::operator()(char* p) const { std::free(p); }

Arena Arena::measuring(std::string name) {
  Arena arena;
  arena.name_ = std::move(name);
  return arena;
}

Arena::Arena(std::string name, size_t capacity_bytes) : name_(std::move(name)) {
  capacity_ = (capacity_bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (capacity_ == 0) capacity_ = kAlignment;
  const size_t cap = capacity_cap;
  char* p = cap > 0 && capacity_ > cap ? nullptr : static_cast<char*>(std::aligned_alloc(kAlignment, capacity_));
  if (p == nullptr)
    throw OutOfMemory(fmt::format("arena '{}': cannot allocate {:.1f} MB", name_, static_cast<double>(capacity_) / 1e6));
  std::memset(p, 0, capacity_);
  storage_.reset(p);
  base_ = p;
}

Tensor Arena::alloc(DType dtype, Shape shape) {
  size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  size_t aligned = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (is_measuring()) {
    used_ += aligned;
    high_water_ = std::max(high_water_, used_);
    return Tensor(nullptr, dtype, shape);
  }
  MOE_CHECK(used_ + aligned <= capacity_,
            "arena '{}' is full: {} of {} bytes used, {} more asked (the plan missed a buffer)",
            name_, used_, capacity_, aligned);
  Tensor t(base_ + used_, dtype, shape);
  used_ += aligned;
  high_water_ = std::max(high_water_, used_);
  return t;
}

void Arena::release_to(size_t mark) {
  MOE_CHECK(mark <= used_, "arena '{}': release to {} beyond {}", name_, mark, used_);
  used_ = mark;
}

}  // namespace moe

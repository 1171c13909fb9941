// Arena: one block of memory, carved into tensors by a bump pointer. Planned before
// the step: a layer's `plan` runs once against a measuring arena to learn the size,
// then again against the real one to take its views. Nothing grows during training.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "core/tensor.h"

namespace moe {

class Arena {
 public:
  static constexpr size_t kAlignment = 64;

  // A measuring arena: hands out null views and records how many bytes a plan needs.
  static Arena measuring(std::string name);
  // A real arena of `capacity_bytes`, zero-filled. Throws moe::OutOfMemory when the block
  // cannot be allocated (the batch controller then halves the micro-batch).
  Arena(std::string name, size_t capacity_bytes);
  // Tests: real arenas over `bytes` fail as if out of memory (0: no cap). Process-wide.
  static void set_capacity_cap_for_testing(size_t bytes);
  Arena(Arena&&) noexcept = default;
  Arena& operator=(Arena&&) noexcept = default;

  Tensor alloc(DType dtype, Shape shape);
  template <typename T> T* alloc_array(int64_t count) {
    return alloc(dtype_of<T>(), Shape{count}).template ptr<T>();
  }

  bool is_measuring() const { return base_ == nullptr; }
  size_t used() const { return used_; }
  size_t capacity() const { return capacity_; }
  size_t high_water() const { return high_water_; }
  const std::string& name() const { return name_; }
  // Everything allocated after `mark` is released; views taken after it become invalid.
  size_t mark() const { return used_; }
  void release_to(size_t mark);

 private:
  Arena() = default;
  struct FreeDeleter {
    void operator()(char* p) const;
  };
  std::string name_;
  std::unique_ptr<char, FreeDeleter> storage_;
  char* base_ = nullptr;
  size_t capacity_ = 0;
  size_t used_ = 0;
  size_t high_water_ = 0;
};

}  // namespace moe

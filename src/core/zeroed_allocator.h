// ZeroedAllocator: a std::vector allocator for large blocks of trivial values that start
// at zero. Memory comes from calloc (for large sizes fresh, already-zero pages from the
// OS) and value-initialising an element writes nothing, so `resize(n)` on an empty vector
// touches no page: a block that is never used costs no resident memory. The GPU trainer
// keeps host gradient blocks it only reads for checkpoints and tests; with plain
// zero-filled vectors every rank of a multi-GPU launch committed them at start-up.
#pragma once
#include <cstddef>
#include <cstdlib>
#include <new>
#include <type_traits>
#include <utility>

namespace moe {

template <typename T>
struct ZeroedAllocator {
  static_assert(std::is_trivial_v<T>, "ZeroedAllocator relies on all-zero bytes being the value zero");
  using value_type = T;

  ZeroedAllocator() noexcept = default;
  template <typename U>
  ZeroedAllocator(const ZeroedAllocator<U>&) noexcept {}  // NOLINT(google-explicit-constructor): rebinding

  T* allocate(size_t n) {
    void* memory = std::calloc(n, sizeof(T));
    if (memory == nullptr && n > 0) throw std::bad_alloc();
    return static_cast<T*>(memory);
  }
  void deallocate(T* memory, size_t) noexcept { std::free(memory); }

  // Value-initialisation (resize, the count constructor): calloc's bytes are already zero.
  template <typename U>
  void construct(U*) noexcept {}
  template <typename U, typename... Args>
  void construct(U* at, Args&&... args) {
    ::new (static_cast<void*>(at)) U(std::forward<Args>(args)...);
  }

  template <typename U>
  bool operator==(const ZeroedAllocator<U>&) const noexcept {
    return true;
  }
};

}  // namespace moe

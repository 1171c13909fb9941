// Tensor: a non-owning view (pointer, dtype, shape up to 4-D, device). Memory comes
// from arenas; a Tensor never frees anything.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/bf16.h"
#include "core/error.h"

namespace moe {

enum class DType : uint8_t { F32, F64, BF16, I32, I64, U16 };
enum class Device : uint8_t { CPU, CUDA };

inline size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U16: return 2;
  }
  return 0;
}

const char* dtype_name(DType dtype);
const char* device_name(Device device);

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<bf16>() { return DType::BF16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<uint16_t>() { return DType::U16; }

constexpr int kMaxDims = 4;

struct Shape {
  std::array<int64_t, kMaxDims> dims{};
  int ndim = 0;

  Shape() = default;
  Shape(std::initializer_list<int64_t> sizes);
  int64_t numel() const;
  int64_t operator[](int i) const { return dims[static_cast<size_t>(i)]; }
  bool operator==(const Shape& other) const;
  std::string str() const;  // "[2, 3, 4]"
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(void* data, DType dtype, Shape shape, Device device = Device::CPU)
      : data_(data), dtype_(dtype), shape_(shape), device_(device) {}

  void* data() const { return data_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return shape_.ndim; }
  int64_t size(int dim) const;
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool empty() const { return data_ == nullptr; }

  // Typed pointer; throws if T does not match the stored dtype.
  template <typename T> T* ptr() const {
    MOE_CHECK(dtype_ == dtype_of<T>(), "tensor holds {}, asked for {}", dtype_name(dtype_),
              dtype_name(dtype_of<T>()));
    return static_cast<T*>(data_);
  }
  // Same memory, new shape with the same number of elements.
  Tensor reshape(Shape shape) const;
  // Index i along the first dimension: a view with one dimension fewer.
  Tensor select(int64_t index) const;
  // Rows [begin, end) along the first dimension.
  Tensor slice(int64_t begin, int64_t end) const;
  std::string str() const;  // "f32[2, 3] cpu"

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::F32;
  Shape shape_;
  Device device_ = Device::CPU;
};

}  // namespace moe

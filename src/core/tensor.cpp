#include "core/tensor.h"

namespace moe {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U16: return "u16";
  }
  return "?";
}

const char* device_name(Device device) { return device == Device::CPU ? "cpu" : "cuda"; }

Shape::Shape(std::initializer_list<int64_t> sizes) {
  MOE_CHECK(sizes.size() <= kMaxDims, "a shape has at most {} dims, got {}", kMaxDims,
            sizes.size());
  for (int64_t s : sizes) {
    MOE_CHECK(s >= 0, "negative dimension {}", s);
    dims[static_cast<size_t>(ndim++)] = s;
  }
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= dims[static_cast<size_t>(i)];
  return n;
}

bool Shape::operator==(const Shape& other) const {
  if (ndim != other.ndim) return false;
  for (int i = 0; i < ndim; ++i)
    if (dims[static_cast<size_t>(i)] != other.dims[static_cast<size_t>(i)]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(dims[static_cast<size_t>(i)]);
  return s + "]";
}

int64_t Tensor::size(int dim) const {
  MOE_CHECK(dim >= 0 && dim < shape_.ndim, "dim {} out of range for {}", dim, str());
  return shape_[dim];
}

Tensor Tensor::reshape(Shape shape) const {
  MOE_CHECK(shape.numel() == numel(), "cannot reshape {} to {}", shape_.str(), shape.str());
  return Tensor(data_, dtype_, shape, device_);
}

Tensor Tensor::select(int64_t index) const {
  MOE_CHECK(shape_.ndim >= 1 && index >= 0 && index < shape_[0], "select {} out of {}", index,
            str());
  Shape inner;
  for (int i = 1; i < shape_.ndim; ++i) inner.dims[static_cast<size_t>(inner.ndim++)] = shape_[i];
  size_t stride = static_cast<size_t>(inner.numel()) * dtype_size(dtype_);
  return Tensor(static_cast<char*>(data_) + static_cast<size_t>(index) * stride, dtype_, inner,
                device_);
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  MOE_CHECK(shape_.ndim >= 1 && 0 <= begin && begin <= end && end <= shape_[0],
            "slice [{}, {}) out of {}", begin, end, str());
  Shape out = shape_;
  out.dims[0] = end - begin;
  size_t row_bytes = static_cast<size_t>(shape_.numel() / (shape_[0] ? shape_[0] : 1)) *
                     dtype_size(dtype_);
  return Tensor(static_cast<char*>(data_) + static_cast<size_t>(begin) * row_bytes, dtype_, out,
                device_);
}

std::string Tensor::str() const {
  return fmt::format("{}{} {}", dtype_name(dtype_), shape_.str(), device_name(device_));
}

}  // namespace moe

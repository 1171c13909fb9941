#include "model/parameters.h"

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
void ParameterStore<T>::allocate(uint64_t seed) {
  MOE_CHECK(!allocated_, "parameters allocated twice");
  // Offsets rounded to 16 elements so each tensor starts on a 64-byte line.
  int64_t total = 0;
  offsets_.clear();
  for (const auto& spec : specs_) {
    offsets_.push_back(total);
    total += (spec.shape.numel() + 15) / 16 * 16;
  }
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
  std::memset(grads_.data(), 0, grads_.size() * sizeof(T));
}

template class ParameterStore<float>;
template class ParameterStore<double>;

}  // namespace moe

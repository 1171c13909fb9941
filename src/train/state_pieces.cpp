#include "train/state_pieces.h"

namespace moe {

std::vector<int64_t> tensor_shape(const Shape& shape) {
  return std::vector<int64_t>(shape.dims.begin(), shape.dims.begin() + shape.ndim);
}

namespace {

// f(tensor name, shape, values, count): each MoE layer's router state (balancing bias, and
// the controlled temperature when on), whole on every rank.
template <class F>
void for_router_tensors(Transformer<float>& model, F&& f) {
  for (auto* layer : model.moe_layers()) {
    auto& bias = layer->balance_bias_E();
    const auto n = static_cast<int64_t>(bias.size());
    f("balance_bias/" + layer->prefix(), std::vector<int64_t>{n}, bias.data(), n);
    if (layer->temperature_control()) {
      auto& temperature = layer->temperature_state();
      const auto count = static_cast<int64_t>(temperature.size());
      f("router_temperature/" + layer->prefix(), std::vector<int64_t>{count}, temperature.data(), count);
    }
  }
}

// f(tensor name, shape, values, count): each tensor of the host state, in checkpoint order.
template <class F>
void for_host_tensors(Transformer<float>& model, AdamW& optimizer, F&& f) {
  auto& params = model.params();
  float* m = optimizer.first_moment().data();
  float* v = optimizer.second_moment().data();
  for (int id = 0; id < params.size(); ++id) {
    const std::string& name = params.spec(id).name;
    const std::vector<int64_t> shape = tensor_shape(params.spec(id).shape);
    const int64_t n = params.numel(id), at = optimizer.moment_offset(id);
    f("param/" + name, shape, params.value(id), n);
    f("adam_m/" + name, shape, m + at, n);
    f("adam_v/" + name, shape, v + at, n);
  }
  for_router_tensors(model, f);
}

}  // namespace

std::vector<StatePiece> host_state_pieces(Transformer<float>& model, AdamW& optimizer, int replicas, int replica) {
  std::vector<StatePiece> pieces;
  for_host_tensors(model, optimizer, [&](std::string name, std::vector<int64_t> shape, float* data, int64_t n) {
    pieces.push_back({std::move(name), std::move(shape), 0, n, data, replicas, replica});
  });
  return pieces;
}

std::vector<StateTarget> host_state_targets(Transformer<float>& model, AdamW& optimizer) {
  std::vector<StateTarget> targets;
  for_host_tensors(model, optimizer, [&](std::string name, std::vector<int64_t> shape, float* data, int64_t n) {
    targets.push_back({std::move(name), std::move(shape), 0, n, data});
  });
  return targets;
}

void append_router_state_pieces(Transformer<float>& model, int replicas, int replica, std::vector<StatePiece>& pieces) {
  for_router_tensors(model, [&](std::string name, std::vector<int64_t> shape, float* data, int64_t n) {
    pieces.push_back({std::move(name), std::move(shape), 0, n, data, replicas, replica});
  });
}

void append_router_state_targets(Transformer<float>& model, std::vector<StateTarget>& targets) {
  for_router_tensors(model, [&](std::string name, std::vector<int64_t> shape, float* data, int64_t n) {
    targets.push_back({std::move(name), std::move(shape), 0, n, data});
  });
}

}  // namespace moe

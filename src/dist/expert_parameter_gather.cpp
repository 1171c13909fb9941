#include "dist/expert_parameter_gather.h"

#include <utility>

#include "core/error.h"

namespace moe::dist {

ExpertParameterGather::ExpertParameterGather(ParameterStore<float>& params, std::vector<ExpertOptimizer::Layer> layers,
                                             const ExpertOptimizer& experts, Communicator& expert_data_parallel,
                                             CommStats& stats)
    : params_(params), experts_(experts), edp_(expert_data_parallel), stats_(stats) {
  MOE_CHECK(experts.shares().ranks() == edp_.size(), "expert ZeRO-3: shares over {} ranks, a group of {}",
            experts.shares().ranks(), edp_.size());
  for (auto& layer : layers) {
    layers_.push_back({});
    layers_.back().layer = std::move(layer);
    layers_.back().state = State::Present;  // every rank starts from the same initial values
  }
  release_all();
}

ExpertParameterGather::~ExpertParameterGather() {
  for (LayerState& layer : layers_)
    if (layer.work) layer.work->wait();
}

int ExpertParameterGather::layer_at(int stage) const {
  for (size_t l = 0; l < layers_.size(); ++l)
    if (layers_[l].layer.stage == stage) return static_cast<int>(l);
  return -1;
}

std::vector<float*> ExpertParameterGather::values_of(const LayerState& layer) {
  std::vector<float*> values;
  for (int id : layer.layer.ids) values.push_back(params_.value(id));
  return values;
}

void ExpertParameterGather::issue(int l) {
  LayerState& layer = layers_[static_cast<size_t>(l)];
  if (layer.state != State::Released) return;
  const ExpertShares& shares = experts_.shares();
  layer.experts = experts_.sharded_experts(static_cast<size_t>(l));
  const int64_t per_rank = shares.per_rank(layer.layer.ids, layer.experts);
  layer.packed.resize(static_cast<size_t>(per_rank * edp_.size()));
  float* mine = layer.packed.data() + edp_.rank() * per_rank;
  shares.pack(layer.layer.ids, layer.experts, values_of(layer), edp_.rank(), mine);
  layer.work = edp_.all_gather_async(mine, layer.packed.data(), static_cast<size_t>(per_rank), DType::f32);
  layer.state = State::InFlight;
}

void ExpertParameterGather::wait(int l) {
  LayerState& layer = layers_[static_cast<size_t>(l)];
  if (layer.state != State::InFlight) return;
  timed_wait(*layer.work, stats_);
  layer.work.reset();
  const ExpertShares& shares = experts_.shares();
  const int64_t per_rank = shares.per_rank(layer.layer.ids, layer.experts);
  const std::vector<float*> values = values_of(layer);
  for (int r = 0; r < edp_.size(); ++r)
    if (r != edp_.rank()) shares.unpack(layer.layer.ids, layer.experts, layer.packed.data() + r * per_rank, r, values);
  std::vector<float>().swap(layer.packed);
  layer.state = State::Present;
}

void ExpertParameterGather::release(int l) {
  wait(l);
  LayerState& layer = layers_[static_cast<size_t>(l)];
  // The current sharded experts: after a re-placement they differ from those gathered.
  params_.release_values(experts_.shares().others(layer.layer.ids, experts_.sharded_experts(static_cast<size_t>(l))));
  layer.state = State::Released;
}

void ExpertParameterGather::needed(int stage, bool backward) {
  const int l = layer_at(stage);
  if (l >= 0) {
    issue(l);
    wait(l);
  }
  // Prefetch: the pass's next stage's layer gathers while this stage computes.
  const int next = layer_at(backward ? stage + 1 : stage - 1);
  if (next >= 0) issue(next);
}

void ExpertParameterGather::done(int stage, bool) {
  const int l = layer_at(stage);
  if (l >= 0) release(l);
  // MPI moves non-blocking collectives along inside MPI calls: test the prefetch.
  for (LayerState& layer : layers_)
    if (layer.work) layer.work->done();
}

void ExpertParameterGather::release_all() {
  for (size_t l = 0; l < layers_.size(); ++l) release(static_cast<int>(l));
}

void ExpertParameterGather::gather_all() {
  for (size_t l = 0; l < layers_.size(); ++l) issue(static_cast<int>(l));
  for (size_t l = 0; l < layers_.size(); ++l) wait(static_cast<int>(l));
}

}  // namespace moe::dist

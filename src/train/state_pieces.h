// The trained state as slices of the checkpoint's global tensors: what each rank saves
// and restores, whatever the layout of its live state (ZeRO pieces, expert-parallel
// experts, replicas). Global tensors: param/NAME, adam_m/NAME, adam_v/NAME (the
// single-process layouts of the parameters and their AdamW moments) and
// balance_bias/LAYER; a slice is a flat element range [begin, begin + count).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/transformer.h"
#include "optim/adamw.h"

namespace moe {

// Saved: this rank's current values of a slice. `replicas` ranks hold the same bits of it
// and this is copy `replica` (0-based); only that copy's share is written (replica_share in
// checkpoint_manifest.h), so every element is written once.
struct StatePiece {
  std::string tensor;
  std::vector<int64_t> shape;  // the global tensor's
  int64_t begin = 0, count = 0;
  const float* data = nullptr;  // count values, valid until the next step
  int replicas = 1, replica = 0;
};

// Restored: a slice of a global tensor (of `shape`) into `data`.
struct StateTarget {
  std::string tensor;
  std::vector<int64_t> shape;
  int64_t begin = 0, count = 0;
  float* data = nullptr;
};

// What a backend saves: its pieces and the optimizer's step count.
struct SavedState {
  std::vector<StatePiece> pieces;
  int64_t adam_steps = 0;
  // Set: the pieces' data lie in buffers this keeps alive, which the backend does not touch
  // while it is shared (the checkpoint keeps it instead of copying). Null: valid until the
  // next step only.
  std::shared_ptr<const void> owner;
};

std::vector<int64_t> tensor_shape(const Shape& shape);

// The whole host state (parameters, moments, balancing biases) as pieces held by
// `replicas` ranks, this one copy `replica`; and as targets.
std::vector<StatePiece> host_state_pieces(Transformer<float>& model, AdamW& optimizer, int replicas, int replica);
std::vector<StateTarget> host_state_targets(Transformer<float>& model, AdamW& optimizer);
// The MoE layers' router state alone (balance_bias/LAYER, router_temperature/LAYER), whole
// on every rank: what every backend saves beside its own parameter pieces (the data point
// into the layers: valid until the next step).
void append_router_state_pieces(Transformer<float>& model, int replicas, int replica, std::vector<StatePiece>& pieces);
void append_router_state_targets(Transformer<float>& model, std::vector<StateTarget>& targets);

}  // namespace moe

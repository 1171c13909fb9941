// Expert placement on the GPU: which slot of each MoE layer's expert tensors holds which
// expert, and which EP rank computes which slots. A re-placement by load (expert
// parallelism's dynamic balancing) relabels experts into slots so that every rank's
// experts stay one contiguous block, whatever their number: the router's choices go
// through a slot table, and the weights, gradients and moments move to their new slots.
// Under expert parallelism a rank holds memory for its window's slots only: a re-placement
// gathers its new window aside (staying experts from their old slots, arriving ones sent
// point to point by their old holders), makes it resident, fills it, and releases what it
// no longer holds.
// Host copies (checkpoints, exports, tests) stay in expert order. Slot order changes no result over one rank: each
// expert sees the same rows in the same order. With split experts (GpuModelOptions)
// each rank's window also takes the next block's first slot, shared with that rank.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <vector>

#include "core/error.h"
#include "model/cuda/gpu_parameter_io.h"
#include "model/cuda/gpu_transformer_state.h"
#include "moe/expert_slots.h"
#include "moe/token_exchange.h"

namespace moe {

void GpuTransformer::State::set_slots(Layer& layer, ExpertSlots slots) {
  auto upload = [](Buffer<int32_t>& to, const std::vector<int64_t>& values, int64_t scale) {
    std::vector<int32_t> narrow;
    for (int64_t v : values) narrow.push_back(static_cast<int32_t>(v * scale));
    to = Buffer<int32_t>(narrow.size());
    to.upload(narrow.data(), narrow.size());
  };
  upload(layer.first_slot, slots.first_slot_P1, 1);
  upload(layer.window_end, slots.window_end_P, 1);
  upload(layer.edge_cut, slots.first_slot_P1, kSlotParts);
  const std::vector<int32_t> slot_of = slot_of_expert(slots);
  layer.slot_of_expert = Buffer<int32_t>(slot_of.size());
  layer.slot_of_expert.upload(slot_of.data(), slot_of.size());
  layer.placed = !slots_in_expert_order(slots);
  layer.slots = std::move(slots);
}

void GpuTransformer::place_experts(const std::vector<std::vector<std::vector<int64_t>>>& experts_of_rank_by_layer) {
  State& s = *state_;
  const int64_t E = s.config.moe.n_experts;
  const int P = s.ep ? s.ep->size() : 1;
  std::vector<Layer*> moe_layers;
  for (Layer& layer : s.layers)
    if (layer.is_moe) moe_layers.push_back(&layer);
  MOE_CHECK(experts_of_rank_by_layer.size() == moe_layers.size(), "expert placement: {} layers given, the model has {}",
            experts_of_rank_by_layer.size(), moe_layers.size());
  MOE_CHECK(s.max_local_experts > 0, "expert placement before plan()");
  // Check everything before anything moves.
  std::vector<ExpertSlots> next;
  for (size_t l = 0; l < moe_layers.size(); ++l) {
    const auto& ranks = experts_of_rank_by_layer[l];
    MOE_CHECK(static_cast<int>(ranks.size()) == P, "expert placement of MoE layer {}: {} ranks given for {}", l,
              ranks.size(), P);
    next.push_back(expert_slots_from_blocks(ranks, s.split_experts));  // each expert at most once
    MOE_CHECK(next.back().n_experts() == E, "expert placement of MoE layer {}: {} experts placed of {}", l,
              next.back().n_experts(), E);
    for (int p = 0; p < P; ++p)
      MOE_CHECK(next.back().window_size(p) <= s.max_local_experts,
                "expert placement of MoE layer {}: {} experts on EP rank {}{}, room for {}", l, next.back().window_size(p),
                p, s.split_experts ? " (with the next rank's first, split)" : "", s.max_local_experts);
  }
  for (size_t l = 0; l < moe_layers.size(); ++l) {
    Layer& layer = *moe_layers[l];
    const std::vector<int32_t> slot_now = slot_of_expert(layer.slots);
    std::vector<int64_t> source_of_slot(static_cast<size_t>(E));
    for (int64_t slot = 0; slot < E; ++slot)
      source_of_slot[static_cast<size_t>(slot)] = slot_now[static_cast<size_t>(next[l].expert_of_slot[static_cast<size_t>(slot)])];
    // Under expert parallelism a rank holds its window's experts only: each expert it
    // takes on comes from its old holder.
    if (s.ep)
      s.move_experts_between_ranks(layer, next[l], source_of_slot);
    else if (next[l].expert_of_slot != layer.slots.expert_of_slot)
      s.move_expert_slots(layer, source_of_slot);
    // The load counted so far follows its experts.
    std::vector<int64_t> load(static_cast<size_t>(E)), moved(static_cast<size_t>(E));
    layer.load.download(load.data(), load.size());
    for (int64_t slot = 0; slot < E; ++slot)
      moved[static_cast<size_t>(slot)] = load[static_cast<size_t>(source_of_slot[static_cast<size_t>(slot)])];
    layer.load.upload(moved.data(), moved.size());
    s.set_slots(layer, std::move(next[l]));
    // What this rank no longer holds goes (layers not yet re-placed keep their windows).
    if (s.ep) s.store->set_resident_ranges(resident_ranges(expert_layout(), s.ep_rank(), s.store->storage_numel()));
  }
  // A captured graph may have been captured without the slot lookups.
  s.drop_graphs();
  MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));
}

ExpertLayout GpuTransformer::expert_layout() const {
  const State& s = *state_;
  ExpertLayout layout;
  for (size_t layer_index : s.expert_group_layer) {
    const Layer& layer = s.layers[layer_index];
    layout.push_back({layer.slots, {}});
    for (const Param* p : {&layer.w1, &layer.w3, &layer.w2}) layout.back().tensors.push_back({p->offset, p->numel});
  }
  return layout;
}

void GpuTransformer::State::move_experts_between_ranks(const Layer& layer, const ExpertSlots& next,
                                                        const std::vector<int64_t>& source_of_slot) {
  const int64_t E = config.moe.n_experts;
  const int me = ep_rank();
  const ExpertSlots& now = layer.slots;
  const int64_t first = next.window_first(me), window = next.window_size(me);
  const int64_t old_first = now.window_first(me), old_end = old_first + now.window_size(me);
  struct Block {
    char* base;
    size_t bytes;  // per element
    bool travels;  // gradients stay with the rank (re-placement is between steps)
  };
  const std::vector<Block> blocks = {{reinterpret_cast<char*>(store->weights_hi()), sizeof(bf16), true},
                                     {reinterpret_cast<char*>(store->weights_lo()), sizeof(int16_t), true},
                                     {reinterpret_cast<char*>(store->grads()), sizeof(float), false},
                                     {static_cast<char*>(store->moment_block(0)), store->moment_bytes(), true},
                                     {static_cast<char*>(store->moment_block(1)), store->moment_bytes(), true}};
  const std::array<const Param*, 3> tensors = {&layer.w1, &layer.w3, &layer.w2};
  // The new window's state, gathered aside: [tensor][block], window slots of an expert each.
  std::vector<std::vector<Buffer<char>>> aside(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t per_expert = tensors[t]->numel / E;
    for (const Block& block : blocks) {
      aside[t].emplace_back(static_cast<size_t>(std::max<int64_t>(window, 1) * per_expert) * block.bytes);
      MOE_CUDA_CHECK(cudaMemsetAsync(aside[t].back().data(), 0, aside[t].back().size(), stream));
    }
  }
  // Experts that stay on this rank: from their old slots.
  for (int64_t j = first; j < first + window; ++j) {
    const int64_t source = source_of_slot[static_cast<size_t>(j)];
    if (source < old_first || source >= old_end) continue;
    for (size_t t = 0; t < tensors.size(); ++t) {
      const int64_t per_expert = tensors[t]->numel / E;
      for (size_t b = 0; b < blocks.size(); ++b) {
        const size_t slice = static_cast<size_t>(per_expert) * blocks[b].bytes;
        MOE_CUDA_CHECK(cudaMemcpyAsync(aside[t][b].data() + static_cast<size_t>(j - first) * slice,
                                       blocks[b].base + static_cast<size_t>(tensors[t]->offset + source * per_expert) *
                                                            blocks[b].bytes,
                                       slice, cudaMemcpyDeviceToDevice, stream));
      }
    }
  }
  // Experts that arrive come point to point from their old block's rank: per tensor and
  // block one all-to-all of the slices each rank hands over, packed by peer in old slot
  // order (the same lists on every rank, so sender and receiver agree on the layout).
  const int P = ep->size();
  const std::vector<std::vector<int>> old_holders = slot_holders(now), new_holders = slot_holders(next);
  const std::vector<int32_t> new_slot_of = slot_of_expert(next);
  std::vector<std::vector<int64_t>> sends(static_cast<size_t>(P)), takes(static_cast<size_t>(P));  // old slots
  for (int64_t slot = 0; slot < E; ++slot) {
    const int64_t j = new_slot_of[static_cast<size_t>(now.expert_of_slot[static_cast<size_t>(slot)])];
    const std::vector<int>& had = old_holders[static_cast<size_t>(slot)];
    const int root = block_rank(now, slot);
    for (int q : new_holders[static_cast<size_t>(j)]) {
      if (std::binary_search(had.begin(), had.end(), q)) continue;
      if (root == me) sends[static_cast<size_t>(q)].push_back(slot);
      if (q == me) takes[static_cast<size_t>(root)].push_back(slot);
    }
  }
  int64_t n_send = 0, n_take = 0;
  for (int q = 0; q < P; ++q) {
    n_send += static_cast<int64_t>(sends[static_cast<size_t>(q)].size());
    n_take += static_cast<int64_t>(takes[static_cast<size_t>(q)].size());
  }
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t per_expert = tensors[t]->numel / E;
    for (size_t b = 0; b < blocks.size(); ++b) {
      if (!blocks[b].travels) continue;
      const size_t slice = static_cast<size_t>(per_expert) * blocks[b].bytes;
      const auto at_slot = [&](int64_t slot) {
        return blocks[b].base + static_cast<size_t>(tensors[t]->offset + slot * per_expert) * blocks[b].bytes;
      };
      Buffer<char> send(static_cast<size_t>(std::max<int64_t>(n_send, 1)) * slice);
      Buffer<char> recv(static_cast<size_t>(std::max<int64_t>(n_take, 1)) * slice);
      std::vector<int64_t> send_counts, recv_counts;
      size_t packed = 0;
      for (int q = 0; q < P; ++q) {
        for (int64_t slot : sends[static_cast<size_t>(q)])
          MOE_CUDA_CHECK(cudaMemcpyAsync(send.data() + slice * packed++, at_slot(slot), slice, cudaMemcpyDeviceToDevice,
                                         stream));
        send_counts.push_back(static_cast<int64_t>(sends[static_cast<size_t>(q)].size() * slice / blocks[b].bytes));
        recv_counts.push_back(static_cast<int64_t>(takes[static_cast<size_t>(q)].size() * slice / blocks[b].bytes));
      }
      ep->exchange(send.data(), send_counts, recv.data(), recv_counts, blocks[b].bytes);
      size_t unpacked = 0;
      for (int p = 0; p < P; ++p)
        for (int64_t slot : takes[static_cast<size_t>(p)]) {
          const int64_t j = new_slot_of[static_cast<size_t>(now.expert_of_slot[static_cast<size_t>(slot)])];
          MOE_CUDA_CHECK(cudaMemcpyAsync(aside[t][b].data() + static_cast<size_t>(j - first) * slice,
                                         recv.data() + slice * unpacked++, slice, cudaMemcpyDeviceToDevice, stream));
        }
      MOE_CUDA_CHECK(cudaStreamSynchronize(stream));  // before send and recv go
    }
  }
  // The new window resident (beside the old one for now), then filled from aside.
  RangeList both = store->resident_ranges();
  for (const Param* p : tensors) {
    const int64_t per_expert = p->numel / E;
    both.push_back({p->offset + first * per_expert, window * per_expert});
  }
  store->set_resident_ranges(merge_ranges(std::move(both)));
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t per_expert = tensors[t]->numel / E;
    for (size_t b = 0; b < blocks.size(); ++b)
      MOE_CUDA_CHECK(cudaMemcpyAsync(blocks[b].base + static_cast<size_t>(tensors[t]->offset + first * per_expert) * blocks[b].bytes,
                                     aside[t][b].data(), static_cast<size_t>(window * per_expert) * blocks[b].bytes,
                                     cudaMemcpyDeviceToDevice, stream));
  }
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));  // before the aside buffers go
}

// Each permutation cycle through one expert-sized staging buffer per block: a few copies
// per expert, and memory for one expert's slice only.
void GpuTransformer::State::move_expert_slots(const Layer& layer, const std::vector<int64_t>& source_of_slot) {
  const int64_t E = config.moe.n_experts;
  struct Block {
    char* base;
    size_t bytes;  // per element
  };
  // The gradients: fp32, or bf16 (training.expert_grad_dtype = bf16: the expert tensors').
  bf16* grads16 = store->grads_bf16();
  const std::vector<Block> blocks = {{reinterpret_cast<char*>(store->weights_hi()), sizeof(bf16)},
                                     {reinterpret_cast<char*>(store->weights_lo()), sizeof(int16_t)},
                                     grads16 ? Block{reinterpret_cast<char*>(grads16), sizeof(bf16)}
                                             : Block{reinterpret_cast<char*>(store->grads()), sizeof(float)},
                                     {static_cast<char*>(store->moment_block(0)), store->moment_bytes()},
                                     {static_cast<char*>(store->moment_block(1)), store->moment_bytes()}};
  int64_t largest = 0;
  for (const Param* p : {&layer.w1, &layer.w3, &layer.w2}) largest = std::max(largest, p->numel / E);
  Buffer<char> staging(static_cast<size_t>(largest) * sizeof(float));
  std::vector<char> done(static_cast<size_t>(E));
  for (const Param* p : {&layer.w1, &layer.w3, &layer.w2}) {
    const int64_t per_expert = p->numel / E;
    for (const Block& block : blocks) {
      const size_t slice = static_cast<size_t>(per_expert) * block.bytes;
      // A slot's slice (the hi halves' through hi_offset: interleaved gate|up keeps each
      // expert's slice whole, elsewhere).
      const bool hi = &block == &blocks.front();
      auto at = [&](int64_t slot) {
        const int64_t element = p->offset + slot * per_expert;
        return block.base + static_cast<size_t>(hi ? store->hi_offset(element) : element) * block.bytes;
      };
      auto copy = [&](void* to, const void* from) {
        MOE_CUDA_CHECK(cudaMemcpyAsync(to, from, slice, cudaMemcpyDeviceToDevice, stream));
      };
      std::fill(done.begin(), done.end(), 0);
      for (int64_t start = 0; start < E; ++start) {
        if (done[static_cast<size_t>(start)] || source_of_slot[static_cast<size_t>(start)] == start) continue;
        // start <- source <- source's source ... back to start (from the staged copy).
        copy(staging.data(), at(start));
        int64_t slot = start;
        while (true) {
          done[static_cast<size_t>(slot)] = 1;
          const int64_t source = source_of_slot[static_cast<size_t>(slot)];
          if (source == start) {
            copy(at(slot), staging.data());
            break;
          }
          copy(at(slot), at(source));
          slot = source;
        }
      }
    }
  }
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));  // before the staging buffer goes
}

void GpuTransformer::State::reorder_experts(const std::function<float*(const Param&)>& tensor_of,
                                            bool to_expert_order) const {
  const int64_t E = config.moe.n_experts;
  std::vector<float> copy;
  for (const Layer& layer : layers) {
    if (!layer.placed) continue;
    for (const Param* p : {&layer.w1, &layer.w3, &layer.w2}) {
      const int64_t per_expert = p->numel / E;
      float* tensor = tensor_of(*p);
      copy.assign(tensor, tensor + p->numel);
      for (int64_t slot = 0; slot < E; ++slot) {
        const int64_t expert = layer.slots.expert_of_slot[static_cast<size_t>(slot)];
        const int64_t from = to_expert_order ? slot : expert, to = to_expert_order ? expert : slot;
        std::copy_n(copy.begin() + from * per_expert, per_expert, tensor + to * per_expert);
      }
    }
  }
}

void GpuTransformer::State::gather_other_experts(ParameterStore<float>& params, std::vector<float>* m,
                                                 std::vector<float>* v) {
  if (!ep) return;
  const int64_t E = config.moe.n_experts;
  const RangeList resident = store->resident_ranges();
  std::vector<std::pair<char*, size_t>> blocks = {{reinterpret_cast<char*>(store->weights_hi()), sizeof(bf16)},
                                                  {reinterpret_cast<char*>(store->weights_lo()), sizeof(int16_t)}};
  if (m)
    for (int which : {0, 1}) blocks.emplace_back(static_cast<char*>(store->moment_block(which)), store->moment_bytes());
  for (const Layer& layer : layers) {
    if (!layer.is_moe) continue;
    for (const Param* p : {&layer.w1, &layer.w3, &layer.w2}) {
      const int64_t per_expert = p->numel / E;
      for (int rank = 0; rank < ep->size(); ++rank) {
        const int64_t first = layer.slots.first_slot_P1[static_cast<size_t>(rank)];
        const Range block{p->offset + first * per_expert,
                          (layer.slots.first_slot_P1[static_cast<size_t>(rank) + 1] - first) * per_expert};
        if (block.count == 0) continue;
        // The holder sends from its memory; the others receive into memory resident
        // meanwhile (a hinge slot they also hold gets the same values it has).
        const bool mine = rank == ep_rank();
        if (!mine) {
          RangeList with = resident;
          with.push_back(block);
          store->set_resident_ranges(merge_ranges(std::move(with)));
        }
        for (const auto& [base, bytes] : blocks)
          ep->broadcast(base + block.offset * static_cast<int64_t>(bytes), static_cast<size_t>(block.count) * bytes, rank);
        if (mine) continue;
        if (m)
          moe::download_state(*store, params, *m, *v, &block);
        else
          moe::download_params(*store, params, &block);
        store->set_resident_ranges(resident);
      }
    }
  }
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void GpuTransformer::share_expert_values(ParameterStore<float>& params) {
  State& s = *state_;
  if (!s.ep) return;
  const int64_t E = s.config.moe.n_experts;
  constexpr int64_t kStagingFloats = int64_t{1} << 24;
  gpu::DeviceArray<float> staging;
  for (const Layer& layer : s.layers) {
    if (!layer.is_moe) continue;
    MOE_CHECK(!layer.placed, "sharing expert values: not after a re-placement (the host copies are in slot order)");
    for (const Param* p : {&layer.w1, &layer.w3, &layer.w2}) {
      const int64_t per_expert = p->numel / E;
      for (int rank = 0; rank < s.ep->size(); ++rank) {
        const int64_t first = layer.slots.first_slot_P1[static_cast<size_t>(rank)];
        const Range block{p->offset + first * per_expert,
                          (layer.slots.first_slot_P1[static_cast<size_t>(rank) + 1] - first) * per_expert};
        const bool mine = rank == s.ep_rank();
        for (int64_t done = 0; done < block.count; done += kStagingFloats) {
          const int64_t n = std::min(kStagingFloats, block.count - done);
          if (static_cast<int64_t>(staging.size()) < n) staging = gpu::DeviceArray<float>(static_cast<size_t>(n));
          float* host = params.values_data() + block.offset + done;
          const size_t bytes = static_cast<size_t>(n) * sizeof(float);
          if (mine) MOE_CUDA_CHECK(cudaMemcpyAsync(staging.data(), host, bytes, cudaMemcpyHostToDevice, s.stream));
          s.ep->broadcast(staging.data(), bytes, rank);
          if (!mine) MOE_CUDA_CHECK(cudaMemcpyAsync(host, staging.data(), bytes, cudaMemcpyDeviceToHost, s.stream));
          MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));  // the staging buffer is reused next
        }
      }
    }
  }
}

}  // namespace moe

#include "dist/hierarchical_all_to_all.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "core/error.h"
#include "dist/comm_util.h"

namespace moe::dist {
namespace {

class FlatAllToAll final : public AllToAll {
 public:
  explicit FlatAllToAll(Communicator& group) : group_(group) {}
  std::string name() const override { return "flat"; }
  Communicator& group() override { return group_; }
  void set_stream(void* stream) override { group_.set_stream(stream); }
  void exchange(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                const std::vector<int64_t>& recv_counts, DType dtype) override {
    group_.all_to_all_v(send, send_counts, recv, recv_counts, dtype);
  }
  std::unique_ptr<Work> exchange_async(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                       const std::vector<int64_t>& recv_counts, DType dtype) override {
    return group_.all_to_all_v_async(send, send_counts, recv, recv_counts, dtype);
  }

 private:
  Communicator& group_;
};

// EP rank e = node_index * L + local, with N nodes of L EP ranks each (group order).
class HierarchicalAllToAll final : public AllToAll {
 public:
  HierarchicalAllToAll(Communicator& group, int node) : group_(group) {
    const int size = group.size();
    std::vector<int32_t> nodes(static_cast<size_t>(size));
    const int32_t my_node = node;
    all_gather_host(group, &my_node, nodes.data(), 1, DType::i32);  // device memory under nccl
    // Ranks of a node must be consecutive in the group, the same number on every node.
    int per_node = 1;
    while (per_node < size && nodes[per_node] == nodes[0]) ++per_node;
    bool grouped = size % per_node == 0;
    for (int r = 0; r < size && grouped; ++r) {
      const int block_start = r / per_node * per_node;
      grouped = nodes[r] == nodes[block_start];
      for (int earlier = 0; earlier < block_start && grouped; earlier += per_node) grouped = nodes[earlier] != nodes[r];
    }
    MOE_CHECK(grouped,
              "hierarchical all-to-all needs the EP group's ranks grouped by node in equal numbers (group rank 0 is "
              "on node {} with {} consecutive ranks; the group has {})",
              nodes[0], per_node, size);
    local_size_ = per_node;
    n_nodes_ = size / per_node;
    local_ = group.rank() % per_node;
    node_index_ = group.rank() / per_node;
    // The split calls are collective over group: every rank makes both.
    intra_ = group.split(node_index_, local_);
    inter_ = group.split(local_, node_index_);
  }

  std::string name() const override { return "hierarchical"; }
  Communicator& group() override { return group_; }
  void set_stream(void* stream) override {
    group_.set_stream(stream);
    intra_->set_stream(stream);
    inter_->set_stream(stream);
  }

  std::unique_ptr<Work> exchange_async(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                       const std::vector<int64_t>& recv_counts, DType dtype) override {
    exchange(send, send_counts, recv, recv_counts, dtype);
    return completed_work();
  }

  void exchange(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                const std::vector<int64_t>& recv_counts, DType dtype) override {
    const int L = local_size_, N = n_nodes_;
    checked_count_sum(send_counts, L * N, "send_counts");
    checked_count_sum(recv_counts, L * N, "recv_counts");
    if (N == 1 || L == 1) {
      // One node, or one EP rank per node: the flat exchange already crosses nodes once.
      group_.all_to_all_v(send, send_counts, recv, recv_counts, dtype);
      return;
    }
    const size_t elem = dtype_bytes(dtype);
    const std::vector<int64_t> send_offsets = block_offsets(send_counts);

    // Stage 0: local peer l' learns how much this rank sends to each (m, l').
    std::vector<int64_t> counts_out(static_cast<size_t>(L * N)), counts_in(static_cast<size_t>(L * N));
    for (int lp = 0; lp < L; ++lp)
      for (int m = 0; m < N; ++m) counts_out[lp * N + m] = send_counts[m * L + lp];
    exchange_counts(counts_out, counts_in);
    // counts_in[l * N + m]: elements from (this node, l) bound for (m, this local index).

    // Stage 1 (inside the node): to local peer l', blocks for (m, l') in node order.
    std::vector<int64_t> stage1_send(static_cast<size_t>(L), 0), stage1_recv(static_cast<size_t>(L), 0);
    int64_t stage1_send_total = 0, stage1_recv_total = 0;
    for (int lp = 0; lp < L; ++lp)
      for (int m = 0; m < N; ++m) {
        stage1_send[lp] += send_counts[m * L + lp];
        stage1_recv[lp] += counts_in[lp * N + m];
      }
    for (int l = 0; l < L; ++l) stage1_send_total += stage1_send[l], stage1_recv_total += stage1_recv[l];
    // Scratch of the backend's memory kind (device memory for nccl); packing copies are
    // ordered with the collectives on the communicator's side.
    char* packed = scratch(packed_, static_cast<size_t>(std::max(stage1_send_total, stage1_recv_total)) * elem);
    char* gathered = scratch(gathered_, static_cast<size_t>(stage1_recv_total) * elem);
    char* out = packed;
    for (int lp = 0; lp < L; ++lp)
      for (int m = 0; m < N; ++m) {
        const size_t bytes = static_cast<size_t>(send_counts[m * L + lp]) * elem;
        intra_->copy(out, static_cast<const char*>(send) + send_offsets[m * L + lp] * elem, bytes);
        out += bytes;
      }
    intra_->all_to_all_v(packed, stage1_send, gathered, stage1_recv, dtype);

    // Stage 2 (across nodes, same local index): to node m, the blocks from local sources
    // l = 0..L-1 in order, which lands in recv exactly in flat order (source n * L + l).
    std::vector<int64_t> gathered_offsets(static_cast<size_t>(L * N));
    int64_t offset = 0;
    for (int l = 0; l < L; ++l)
      for (int m = 0; m < N; ++m) gathered_offsets[l * N + m] = offset, offset += counts_in[l * N + m];
    std::vector<int64_t> stage2_send(static_cast<size_t>(N), 0), stage2_recv(static_cast<size_t>(N), 0);
    for (int m = 0; m < N; ++m)
      for (int l = 0; l < L; ++l) {
        stage2_send[m] += counts_in[l * N + m];
        stage2_recv[m] += recv_counts[m * L + l];
      }
    out = packed;
    for (int m = 0; m < N; ++m)
      for (int l = 0; l < L; ++l) {
        const size_t bytes = static_cast<size_t>(counts_in[l * N + m]) * elem;
        intra_->copy(out, gathered + gathered_offsets[l * N + m] * elem, bytes);
        out += bytes;
      }
    inter_->all_to_all_v(packed, stage2_send, recv, stage2_recv, dtype);
  }

 private:
  // One count per (local peer, node) each way inside the node; through device memory when
  // the backend's collectives need it.
  void exchange_counts(const std::vector<int64_t>& counts_out, std::vector<int64_t>& counts_in) {
    const std::vector<int64_t> n_each(static_cast<size_t>(local_size_), n_nodes_);
    if (!intra_->device_memory()) {
      intra_->all_to_all_v(counts_out.data(), n_each, counts_in.data(), n_each, DType::i64);
      return;
    }
    const size_t bytes = counts_out.size() * sizeof(int64_t);
    char* staged_out = scratch(staged_counts_, 2 * bytes);
    intra_->copy(staged_out, counts_out.data(), bytes);
    intra_->all_to_all_v(staged_out, n_each, staged_out + bytes, n_each, DType::i64);
    intra_->copy(counts_in.data(), staged_out + bytes, bytes);
    intra_->synchronize();
  }

  // Scratch kept between exchanges (grown when too small): the next exchange's copies are
  // ordered after this one's collectives, so reuse is safe.
  struct Scratch {
    std::shared_ptr<void> memory;
    size_t bytes = 0;
  };
  char* scratch(Scratch& s, size_t bytes) {
    if (s.bytes < bytes || !s.memory) {
      s.memory = intra_->allocate(bytes);
      s.bytes = bytes;
    }
    return static_cast<char*>(s.memory.get());
  }

  Communicator& group_;
  std::unique_ptr<Communicator> intra_, inter_;
  Scratch packed_, gathered_, staged_counts_;
  int local_size_ = 1, n_nodes_ = 1, local_ = 0, node_index_ = 0;
};

}  // namespace

std::unique_ptr<AllToAll> make_all_to_all(AllToAllKind kind, Communicator& ep_group, int node) {
  if (kind == AllToAllKind::Hierarchical) return std::make_unique<HierarchicalAllToAll>(ep_group, node);
  return std::make_unique<FlatAllToAll>(ep_group);
}

std::unique_ptr<AllToAll> make_all_to_all(AllToAllKind kind, Communicator& ep_group,
                                          const ProcessGroups& groups) {
  return make_all_to_all(kind, ep_group, groups.node);
}

void all_to_all_v_hierarchical(ProcessGroups& groups, Communicator& ep_group, const void* send,
                               const std::vector<int64_t>& send_counts, void* recv,
                               const std::vector<int64_t>& recv_counts, DType dtype) {
  HierarchicalAllToAll(ep_group, groups.node).exchange(send, send_counts, recv, recv_counts, dtype);
}

}  // namespace moe::dist

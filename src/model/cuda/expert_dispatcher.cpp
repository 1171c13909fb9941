#include "model/cuda/expert_dispatcher.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/fp8.h"
#include "kernels/gpu_ops.h"
#include "model/cuda/gpu_phases.h"
#include "model/gpu_buffer_sizes.h"
#include "moe/gpu_ops.h"

namespace moe::gpu_model {
namespace {

// Every expert on this rank: the rows are this rank's own, permuted by slot.
class GpuLocalDispatcher final : public ExpertDispatcher {
 public:
  GpuLocalDispatcher(cudaStream_t stream, std::function<void(int)> mark) : stream_(stream), mark_(std::move(mark)) {}
  int64_t plan(const DispatchShape& shape) override {
    shape_ = shape;
    return shape.max_rows;
  }
  void plan_layer(MoEBuffers&) const override {}
  void dispatch(const Layer&, MoEBuffers& m, const bf16* x_TD, const int32_t*) override {
    const int64_t T = shape_.tokens, K = shape_.top_k, E = shape_.n_experts, D = shape_.dim;
    mark_(kDispatch);
    cuda::permute_forward(m.x_rows->data(), x_TD, m.token_of_row.data(), m.offsets.data(), T * K, E, D, stream_);
  }
  const int32_t* expert_offsets(const MoEBuffers& m) const override { return m.offsets.data(); }
  int64_t expert_rows(const MoEBuffers&) const override { return shape_.max_rows; }
  void combine(MoEBuffers& m, bf16* out_TD) override {
    mark_(kCombine);
    cuda::combine_forward(out_TD, m.y_rows.data(), m.weight.data(), m.row.data(), shape_.tokens, shape_.top_k,
                          shape_.dim, stream_);
  }
  void combine_backward(MoEBuffers& m, const bf16* dout_TD, bf16* dy_rows, float* dweight_TK) override {
    mark_(kCombine);
    cuda::combine_backward(dy_rows, dweight_TK, dout_TD, m.y_rows.data(), m.weight.data(), m.row.data(),
                           shape_.tokens, shape_.top_k, shape_.dim, stream_);
  }
  void dispatch_backward(MoEBuffers& m, const bf16* dx_rows, bf16* dx_TD, float*) override {
    mark_(kDispatch);
    cuda::permute_backward(dx_TD, dx_rows, m.row.data(), shape_.tokens, shape_.top_k, shape_.dim, false, stream_);
  }

 private:
  cudaStream_t stream_;
  std::function<void(int)> mark_;
  DispatchShape shape_;
};

// Each token goes once to every rank computing one of its kept assignments, with its
// routing; the rows are laid out by local slot there (source by source, each source's in
// token order: the order of one GPU's rows), the experts run, and each token's weighted
// sum over its experts there comes back; the output is the sum of those in rank order.
class GpuExpertParallelDispatcher final : public ExpertDispatcher {
 public:
  GpuExpertParallelDispatcher(std::shared_ptr<GpuExpertExchange> exchange, cudaStream_t stream,
                           std::function<void(int)> mark)
      : ep_(std::move(exchange)), stream_(stream), mark_(std::move(mark)) {
    MOE_CHECK(ep_ != nullptr, "expert-parallel dispatcher without an exchange");
  }
  ~GpuExpertParallelDispatcher() override { free_host(); }

  int64_t plan(const DispatchShape& shape) override {
    shape_ = shape;
    const int64_t T = shape.tokens, K = shape.top_k, E = shape.n_experts, D = shape.dim, P = ep_->size();
    const int64_t L = shape.max_local_experts;
    // Every rank may send this one each of its tokens once; P ranks send it at most P
    // times its own rows (at most `capacity` per source and expert under a capacity).
    max_tokens_ = P * T;
    max_local_rows_ = expert_parallel_local_rows(P, T, K, L, shape.capacity);  // model/gpu_buffer_sizes.h
    const int64_t U = max_tokens_;
    auto bf = [](int64_t n) { return Buffer<bf16>(static_cast<size_t>(n)); };
    auto f32 = [](int64_t n) { return Buffer<float>(static_cast<size_t>(n)); };
    auto i32 = [](int64_t n) { return Buffer<int32_t>(static_cast<size_t>(n)); };
    free_host();
    send_ = bf(U * D);
    recv_ = bf(U * D);
    // fp8 rows (set before the model is built, fixed for its life): U rows each way.
    const int64_t wire = ep_->fp8_capable() ? U * fp8_row_bytes(D) : 0;
    wire_send_ = Buffer<uint8_t>(static_cast<size_t>(wire));
    wire_recv_ = Buffer<uint8_t>(static_cast<size_t>(wire));
    slot_send_ = i32(U * K);
    slot_recv_ = i32(U * K);
    rank_scratch_ = i32(cuda::assign_rows_scratch(U, K, L));
    local_counts_ = i32(L);
    counts_send_ = i32(E + 2 * P);
    rank_TK_ = i32(T * K);
    cut_ = i32(P + 1);
    all_counts_send_ = shape.split_experts ? i32(P * E) : Buffer<int32_t>();
    all_counts_ = shape.split_experts ? i32(P * E) : Buffer<int32_t>();
    counts_recv_ = i32(P * (L + 1));
    weight_send_ = f32(U * K);
    dweight_local_ = f32(U * K);
    dweight_home_ = f32(U * K);
    MOE_CUDA_CHECK(cudaMallocHost(&host_counts_, static_cast<size_t>(E + 2 * P + P * (L + 1)) * sizeof(int32_t)));
    return max_local_rows_;
  }

  void plan_layer(MoEBuffers& m) const override {
    const int64_t T = shape_.tokens, K = shape_.top_k, P = ep_->size(), U = max_tokens_;
    m.token_pos = Buffer<int32_t>(static_cast<size_t>(T * P));
    m.tokens_P = Buffer<int32_t>(static_cast<size_t>(P));
    m.recv_row = Buffer<int32_t>(static_cast<size_t>(U * K));
    m.recv_weight = Buffer<float>(static_cast<size_t>(U * K));
    m.local_offsets = Buffer<int32_t>(static_cast<size_t>(shape_.max_local_experts + 1));
    m.local_token = Buffer<int32_t>(static_cast<size_t>(max_local_rows_));
  }

  void dispatch(const Layer& layer, MoEBuffers& m, const bf16* x_TD, const int32_t* slot_TK) override {
    const int64_t T = shape_.tokens, D = shape_.dim, K = shape_.top_k;
    const int P = ep_->size();
    const int64_t L = local_experts(layer);
    m.moe_index = layer.moe_index;
    m.fp8_rows = ep_->fp8(layer.moe_index);
    ep_->set_layer(m.moe_index);
    plan_exchange(layer, m, slot_TK);
    const int64_t U = m.recv_tokens, R = m.local_rows;
    mark_(kDispatch);
    scatter_home_rows(m, x_TD);
    cuda::pack_routing(slot_send_.data(), weight_send_.data(), m.token_pos.data(), m.tokens_P.data(), rank_TK_.data(),
                       slot_TK, m.weight.data(), layer.first_slot.data(), T, K, P, stream_);
    exchange_rows(m, nullptr, m.send_tokens_P, nullptr, m.recv_tokens_P);  // unpacked by permute_forward below
    exchange_tokens(slot_send_.data(), m.send_tokens_P, slot_recv_.data(), m.recv_tokens_P, K, sizeof(int32_t));
    exchange_tokens(weight_send_.data(), m.send_tokens_P, m.recv_weight.data(), m.recv_tokens_P, K, sizeof(float));
    mark_(kDispatch);
    if (L > 0) {
      // No capacity here: the home rank dropped already.
      cuda::assign_rows(m.recv_row.data(), local_counts_.data(), m.local_offsets.data(), m.local_token.data(), nullptr,
                        rank_scratch_.data(), slot_recv_.data(), U, L, K, std::max<int64_t>(1, U * K), stream_);
    } else {
      m.local_offsets.fill_bytes(0);
      if (U > 0)
        MOE_CUDA_CHECK(cudaMemsetAsync(m.recv_row.data(), 0xff, static_cast<size_t>(U * K) * sizeof(int32_t), stream_));
    }
    if (m.fp8_rows)
      cuda::permute_forward_fp8(m.x_rows->data(), wire_recv_.data(), m.local_token.data(), m.local_offsets.data(), R,
                                L, D, stream_);
    else
      cuda::permute_forward(m.x_rows->data(), recv_.data(), m.local_token.data(), m.local_offsets.data(), R, L, D,
                            stream_);
  }
  const int32_t* expert_offsets(const MoEBuffers& m) const override { return m.local_offsets.data(); }
  int64_t expert_rows(const MoEBuffers& m) const override { return m.local_rows; }

  void combine(MoEBuffers& m, bf16* out_TD) override {
    const int64_t D = shape_.dim, K = shape_.top_k;
    mark_(kCombine);
    if (fused_fp8(m)) {
      cuda::combine_forward_fp8(wire_send_.data(), m.y_rows.data(), m.recv_weight.data(), m.recv_row.data(),
                                m.recv_tokens, K, D, stream_);
      exchange_rows(m, nullptr, m.recv_tokens_P, nullptr, m.send_tokens_P);
    } else {
      cuda::combine_forward(send_.data(), m.y_rows.data(), m.recv_weight.data(), m.recv_row.data(), m.recv_tokens, K,
                            D, stream_);
      exchange_rows(m, send_.data(), m.recv_tokens_P, nullptr, m.send_tokens_P);
    }
    mark_(kCombine);
    ep_->set_layer(-1);
    sum_home_rows(m, out_TD);
  }

  // The output gradient once per token to each rank that computed some of its experts;
  // there, the local rows' gradients and the combine weights' (zero for other ranks' slots).
  void combine_backward(MoEBuffers& m, const bf16* dout_TD, bf16* dy_rows, float*) override {
    const int64_t D = shape_.dim, K = shape_.top_k;
    mark_(kCombine);
    scatter_home_rows(m, dout_TD);
    ep_->set_layer(m.moe_index);
    exchange_rows(m, nullptr, m.send_tokens_P, recv_.data(), m.recv_tokens_P);
    mark_(kCombine);
    cuda::combine_backward(dy_rows, dweight_local_.data(), recv_.data(), m.y_rows.data(), m.recv_weight.data(),
                           m.recv_row.data(), m.recv_tokens, K, D, stream_);
  }

  // Each received token's input-row gradients summed there and sent home with its combine
  // weights' gradients; at home, dx and dweight as the sums over the ranks.
  void dispatch_backward(MoEBuffers& m, const bf16* dx_rows, bf16* dx_TD, float* dweight_TK) override {
    const int64_t T = shape_.tokens, D = shape_.dim, K = shape_.top_k;
    const int P = ep_->size();
    mark_(kDispatch);
    if (fused_fp8(m)) {
      cuda::permute_backward_fp8(wire_send_.data(), dx_rows, m.recv_row.data(), m.recv_tokens, K, D, stream_);
      exchange_rows(m, nullptr, m.recv_tokens_P, nullptr, m.send_tokens_P);
    } else {
      cuda::permute_backward(send_.data(), dx_rows, m.recv_row.data(), m.recv_tokens, K, D, false, stream_);
      exchange_rows(m, send_.data(), m.recv_tokens_P, nullptr, m.send_tokens_P);
    }
    exchange_tokens(dweight_local_.data(), m.recv_tokens_P, dweight_home_.data(), m.send_tokens_P, K, sizeof(float));
    mark_(kDispatch);
    ep_->set_layer(-1);
    sum_home_rows(m, dx_TD);
    cuda::sum_token_values(dweight_TK, dweight_home_.data(), m.token_pos.data(), m.tokens_P.data(), T, K, P, stream_);
  }

 private:
  int64_t local_experts(const Layer& layer) const {
    return layer.slots.window_size(ep_->rank());
  }
  void free_host() {
    if (host_counts_) cudaFreeHost(host_counts_);
    host_counts_ = nullptr;
  }
  // `per_token` elements of elem_bytes per token of the blocks, out and back.
  void exchange_tokens(const void* send, const std::vector<int64_t>& send_tokens_P, void* recv,
                       const std::vector<int64_t>& recv_tokens_P, int64_t per_token, size_t elem_bytes) {
    std::vector<int64_t> send_counts(send_tokens_P.size()), recv_counts(recv_tokens_P.size());
    for (size_t p = 0; p < send_tokens_P.size(); ++p) send_counts[p] = send_tokens_P[p] * per_token;
    for (size_t p = 0; p < recv_tokens_P.size(); ++p) recv_counts[p] = recv_tokens_P[p] * per_token;
    mark_(kAllToAll);
    ep_->exchange(send, send_counts, recv, recv_counts, elem_bytes);
  }
  // Token rows of D bf16 out and back: as they are, or (m.fp8_rows, the layer's forward
  // choice kept for its backward) as fp8 rows. The row kernels pack and unpack them
  // (send or recv null here: the rows already in, or left in, the wire buffers) except
  // for combine_backward's received rows (dequantised into recv) and rows wider than
  // kMaxFusedFp8Dim (quantised from send).
  bool fused_fp8(const MoEBuffers& m) const { return m.fp8_rows && shape_.dim <= cuda::kMaxFusedFp8Dim; }
  void exchange_rows(const MoEBuffers& m, const bf16* send, const std::vector<int64_t>& send_tokens_P, bf16* recv,
                     const std::vector<int64_t>& recv_tokens_P) {
    const int64_t D = shape_.dim;
    if (!m.fp8_rows) {
      exchange_tokens(send ? send : send_.data(), send_tokens_P, recv ? recv : recv_.data(), recv_tokens_P, D,
                      sizeof(bf16));
      return;
    }
    MOE_CHECK(wire_send_.size() > 0 || max_tokens_ == 0, "expert exchange: fp8 rows without their buffers");
    int64_t sent = 0, received = 0;
    for (int64_t n : send_tokens_P) sent += n;
    for (int64_t n : recv_tokens_P) received += n;
    if (send) cuda::quantize_rows_fp8(wire_send_.data(), send, sent, D, stream_);
    exchange_tokens(wire_send_.data(), send_tokens_P, wire_recv_.data(), recv_tokens_P, fp8_row_bytes(D) / 4,
                    sizeof(int32_t));  // 4-byte words: the rows are padded to them
    if (recv) cuda::dequantize_rows_fp8(recv, wire_recv_.data(), received, D, stream_);
  }
  // Home side: x_TD's rows into the blocks for each rank (send_, or fp8 rows in wire_send_).
  void scatter_home_rows(const MoEBuffers& m, const bf16* x_TD) {
    const int64_t T = shape_.tokens, D = shape_.dim;
    const int P = ep_->size();
    if (m.fp8_rows)
      cuda::scatter_token_rows_fp8(wire_send_.data(), x_TD, m.token_pos.data(), m.tokens_P.data(), T, P, D, stream_);
    else
      cuda::scatter_token_rows(send_.data(), x_TD, m.token_pos.data(), m.tokens_P.data(), T, P, D, stream_);
  }
  // Home side: each token's rows from the ranks (recv_, or fp8 rows in wire_recv_) summed into out_TD.
  void sum_home_rows(const MoEBuffers& m, bf16* out_TD) {
    const int64_t T = shape_.tokens, D = shape_.dim;
    const int P = ep_->size();
    if (m.fp8_rows)
      cuda::sum_token_rows_fp8(out_TD, wire_recv_.data(), m.token_pos.data(), m.tokens_P.data(), T, P, D, stream_);
    else
      cuda::sum_token_rows(out_TD, recv_.data(), m.token_pos.data(), m.tokens_P.data(), T, P, D, stream_);
  }
  // The token blocks for each rank, the counts exchanged (kept rows per slot and block
  // sizes), and the one host wait per MoE layer and forward for them: the exchange sizes
  // are host arguments (NCCL's), which is also why expert parallelism refuses CUDA graphs.
  void plan_exchange(const Layer& layer, MoEBuffers& m, const int32_t* slot_TK) {
    const int P = ep_->size();
    const int64_t T = shape_.tokens, K = shape_.top_k, E = shape_.n_experts, L = local_experts(layer);
    // Which rank computes each kept assignment: by the block edges, or with split experts by
    // this micro-batch's cuts from every rank's kept rows per slot.
    const int32_t* cut = layer.edge_cut.data();
    if (shape_.split_experts) {
      for (int p = 0; p < P; ++p)
        MOE_CUDA_CHECK(cudaMemcpyAsync(all_counts_send_.data() + p * E, m.counts.data(),
                                       static_cast<size_t>(E) * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream_));
      mark_(kAllToAll);
      const std::vector<int64_t> per_rank(static_cast<size_t>(P), E);
      ep_->exchange(all_counts_send_.data(), per_rank, all_counts_.data(), per_rank, sizeof(int32_t));
      mark_(kDispatch);
      cuda::boundary_cuts(cut_.data(), all_counts_.data(), layer.first_slot.data(), true, E, P, stream_);
      cut = cut_.data();
    }
    cuda::route_ranks(rank_TK_.data(), m.row.data(), slot_TK, m.offsets.data(), cut, T, K, P, stream_);
    cuda::token_blocks(m.token_pos.data(), m.tokens_P.data(), rank_TK_.data(), T, K, P, stream_);
    // Each peer gets the rows of each slot of its window and the size of its block; we get
    // every source's for ours.
    cuda::pack_counts(counts_send_.data(), m.counts.data(), m.tokens_P.data(), layer.first_slot.data(),
                      layer.window_end.data(), cut, P, stream_);
    std::vector<int64_t> send_counts(static_cast<size_t>(P)), recv_counts(static_cast<size_t>(P), L + 1);
    int64_t send_total = 0;
    for (int p = 0; p < P; ++p) {
      send_counts[static_cast<size_t>(p)] =
          layer.slots.window_end_P[static_cast<size_t>(p)] - layer.slots.first_slot_P1[static_cast<size_t>(p)] + 1;
      send_total += send_counts[static_cast<size_t>(p)];
    }
    mark_(kAllToAll);
    ep_->exchange(counts_send_.data(), send_counts, counts_recv_.data(), recv_counts, sizeof(int32_t));
    int32_t* sent = host_counts_;
    int32_t* received = host_counts_ + E + 2 * P;
    MOE_CUDA_CHECK(cudaMemcpyAsync(sent, counts_send_.data(), static_cast<size_t>(send_total) * sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, stream_));
    MOE_CUDA_CHECK(cudaMemcpyAsync(received, counts_recv_.data(), static_cast<size_t>(P * (L + 1)) * sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, stream_));
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    mark_(kHost);
    m.send_tokens_P.assign(static_cast<size_t>(P), 0);
    m.recv_tokens_P.assign(static_cast<size_t>(P), 0);
    m.recv_tokens = m.local_rows = 0;
    int64_t part = 0;  // peer p's part of what we sent
    for (int p = 0; p < P; ++p) {
      part += send_counts[static_cast<size_t>(p)];
      m.send_tokens_P[static_cast<size_t>(p)] = sent[part - 1];
      const int32_t* from = received + p * (L + 1);
      for (int64_t l = 0; l < L; ++l) m.local_rows += from[l];
      m.recv_tokens_P[static_cast<size_t>(p)] = from[L];
      m.recv_tokens += from[L];
    }
    MOE_CHECK(m.local_rows <= max_local_rows_, "expert parallelism: {} rows for the local experts, room for {}",
              m.local_rows, max_local_rows_);
    MOE_CHECK(m.recv_tokens <= max_tokens_, "expert parallelism: {} tokens received, room for {}", m.recv_tokens,
              max_tokens_);
  }

  std::shared_ptr<GpuExpertExchange> ep_;
  cudaStream_t stream_;
  std::function<void(int)> mark_;
  DispatchShape shape_;
  int64_t max_tokens_ = 0, max_local_rows_ = 0;
  // Scratch of the exchange, sized for P * T tokens (every rank's whole micro-batch): the
  // token rows sent and received, the routing sent and received, the combine weights'
  // gradients on both sides, the counts sent and received (brought back through the
  // pinned host_counts_: E + 2P sent, then P * (L + 1) received).
  Buffer<bf16> send_, recv_;
  Buffer<uint8_t> wire_send_, wire_recv_;  // fp8 rows (parallel.a2a_compression)
  Buffer<int32_t> slot_send_, slot_recv_, rank_scratch_, local_counts_, counts_send_, counts_recv_;
  Buffer<int32_t> rank_TK_, cut_, all_counts_send_, all_counts_;  // route_ranks, boundary_cuts
  Buffer<float> weight_send_, dweight_local_, dweight_home_;
  int32_t* host_counts_ = nullptr;
};

}  // namespace

std::unique_ptr<ExpertDispatcher> make_local_dispatcher(cudaStream_t stream, std::function<void(int)> mark) {
  return std::make_unique<GpuLocalDispatcher>(stream, std::move(mark));
}

std::unique_ptr<ExpertDispatcher> make_expert_parallel_dispatcher(std::shared_ptr<GpuExpertExchange> exchange,
                                                                  cudaStream_t stream, std::function<void(int)> mark) {
  return std::make_unique<GpuExpertParallelDispatcher>(std::move(exchange), stream, std::move(mark));
}

}  // namespace moe::gpu_model

#include "model/cuda/expert_dispatcher.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "core/cuda/span_timer.h"
#include "core/error.h"
#include "core/fp8.h"
#include "kernels/gpu_ops.h"
#include "model/cuda/gpu_phases.h"
#include "model/gpu_buffer_sizes.h"
#include "moe/expert_slots.h"
#include "moe/gpu_ops.h"
#include "moe/speculative_exchange.h"

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
    mark_(kDispatch);
    cuda::permute_forward_by_token(m.x_rows->data(), x_TD, m.row.data(), shape_.tokens, shape_.top_k, shape_.dim,
                                   stream_);
  }
  const int32_t* expert_offsets(const MoEBuffers& m) const override { return m.offsets.data(); }
  int64_t expert_rows(const MoEBuffers&) const override { return shape_.max_rows; }
  void combine(MoEBuffers& m, bf16* out_TD) override {
    mark_(kCombine);
    cuda::combine_forward(out_TD, m.y_rows.data(), m.weight.data(), m.row.data(), shape_.tokens, shape_.top_k,
                          shape_.dim, stream_);
  }
  cuda::ResidualBranch combine_rows(const MoEBuffers& m) const override {
    return {m.y_rows.data(), m.weight.data(), m.row.data(), shape_.top_k};
  }
  void combine_backward(MoEBuffers& m, const bf16* dout_TD, bf16* dy_rows, float* dweight_TK) override {
    mark_(kCombine);
    cuda::combine_backward(dy_rows, dweight_TK, dout_TD, m.y_rows.data(), m.weight.data(), m.row.data(),
                           shape_.tokens, shape_.top_k, shape_.dim, stream_);
  }
  bool dispatch_fp8(const Layer&, MoEBuffers& m, const bf16* x_TD, const int32_t*, uint8_t* codes_RD, float* scales,
                    int64_t experts) override {
    mark_(kDispatch);
    cuda::permute_forward_by_token_fp8(m.x_rows->data(), row_codes(m, codes_RD, scales, experts), x_TD, m.row.data(),
                                       shape_.tokens, shape_.top_k, shape_.dim, stream_);
    return true;
  }
  bool combine_backward_fp8(MoEBuffers& m, const bf16* dout_TD, bf16* dy_rows, float* dweight_TK, uint8_t* codes_RD,
                            float* scales, int64_t experts) override {
    mark_(kCombine);
    cuda::combine_backward_fp8(dy_rows, row_codes(m, codes_RD, scales, experts), dweight_TK, dout_TD,
                               m.y_rows.data(), m.weight.data(), m.row.data(), shape_.tokens, shape_.top_k,
                               shape_.dim, stream_);
    return true;
  }
  void dispatch_backward(MoEBuffers& m, const bf16* dx_rows, bf16* dx_TD, float*) override {
    mark_(kDispatch);
    cuda::permute_backward(dx_TD, dx_rows, m.row.data(), shape_.tokens, shape_.top_k, shape_.dim, false, stream_);
  }

 private:
  // Padded rows: the codes' scales as one group of all the rows (PaddedExpertGemmFp8's).
  cuda::RowCodes row_codes(const MoEBuffers& m, uint8_t* codes_RD, float* scales, int64_t experts) const {
    if (shape_.row_align > 1) return {codes_RD, scales, nullptr, 1, expert_rows(m)};
    return {codes_RD, scales, expert_offsets(m), experts, expert_rows(m)};
  }

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
  ~GpuExpertParallelDispatcher() override {
    free_host();
    for (cudaEvent_t e : {x_ready_, early_done_, sizes_ready_})
      if (e) cudaEventDestroy(e);
    if (side_) cudaStreamDestroy(side_);
  }

  int64_t plan(const DispatchShape& shape) override {
    MOE_CHECK(shape.row_align == 1, "expert-parallel dispatch: rows aligned to {}: not supported", shape.row_align);
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
    plan_speculation(shape);
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
    const size_t wait_span = dispatch_waits_.begin(m.moe_index, stream_);
    const bool spec = spec_armed_;
    if (spec) send_early_rows(m, x_TD);
    plan_exchange(layer, m, slot_TK, spec);
    const int64_t U = m.recv_tokens, R = m.local_rows;
    mark_(kDispatch);
    if (spec)
      send_corrections(m, x_TD);
    else
      scatter_home_rows(m, x_TD);
    cuda::pack_routing(slot_send_.data(), weight_send_.data(), m.token_pos.data(), m.tokens_P.data(), rank_TK_.data(),
                       slot_TK, m.weight.data(), layer.first_slot.data(), T, K, P, stream_);
    if (spec)  // each exact row's source: its early row or its correction
      exchange_tokens(source_send_.data(), m.send_tokens_P, source_recv_.data(), m.recv_tokens_P, 1, sizeof(int32_t));
    else
      exchange_rows(m, nullptr, m.send_tokens_P, nullptr, m.recv_tokens_P);  // unpacked by permute_forward below
    exchange_tokens(slot_send_.data(), m.send_tokens_P, slot_recv_.data(), m.recv_tokens_P, K, sizeof(int32_t));
    exchange_tokens(weight_send_.data(), m.send_tokens_P, m.recv_weight.data(), m.recv_tokens_P, K, sizeof(float));
    mark_(kDispatch);
    if (spec) merge_early_rows(m);
    dispatch_waits_.end(wait_span, stream_);
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

  void keep_routed_experts(bool on) override {
    MOE_CHECK(!on || experts_host_.size() > 0, "speculative dispatch: the dispatcher was planned without it");
    keep_experts_ = on;
  }
  const int32_t* routed_experts_host() const override { return experts_host_.data(); }

  void speculate(const Layer& next, const int32_t* pred_slot_TQ, int64_t Q) override {
    MOE_CHECK(spec_pos_dev_.size() > 0, "speculative dispatch: the dispatcher was planned without it");
    MOE_CHECK(!spec_armed_, "speculative dispatch: two guesses before a dispatch");
    const int P = ep_->size();
    const int64_t T = shape_.tokens;
    std::vector<int32_t> first_P1(next.slots.first_slot_P1.begin(), next.slots.first_slot_P1.end());
    std::vector<int32_t> window_end_P(next.slots.window_end_P.begin(), next.slots.window_end_P.end());
    speculative_blocks(spec_pos_host_, spec_tokens_host_, pred_slot_TQ, T, Q, first_P1.data(), window_end_P.data(), P,
                       ep_->rank());
    MOE_CUDA_CHECK(cudaMemcpyAsync(spec_pos_dev_.data(), spec_pos_host_, static_cast<size_t>(T * P) * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, stream_));
    MOE_CUDA_CHECK(cudaMemcpyAsync(spec_sizes_dev_.data(), spec_tokens_host_, static_cast<size_t>(P) * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, stream_));
    // The early blocks' sizes travel now; the next dispatch reads them through an event.
    mark_(kAllToAll);
    const std::vector<int64_t> one_each(static_cast<size_t>(P), 1);
    ep_->exchange(spec_sizes_dev_.data(), one_each, spec_sizes_dev_.data() + P, one_each, sizeof(int32_t));
    MOE_CUDA_CHECK(cudaMemcpyAsync(spec_recv_host_, spec_sizes_dev_.data() + P, static_cast<size_t>(P) * sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, stream_));
    MOE_CUDA_CHECK(cudaEventRecord(sizes_ready_, stream_));
    spec_armed_ = true;
    x_recorded_ = false;
    spec_layer_ = next.moe_index;
  }
  void input_ready() override {
    if (!spec_armed_) return;
    MOE_CUDA_CHECK(cudaEventRecord(x_ready_, stream_));
    x_recorded_ = true;
  }

  std::vector<DispatchStats> take_stats(int moe_layers) override {
    std::vector<DispatchStats> stats(static_cast<size_t>(std::max(moe_layers, 0)));
    const std::vector<double> waits = dispatch_waits_.take_seconds(moe_layers);
    for (size_t l = 0; l < stats.size(); ++l) stats[l].wait_s = waits[l];
    for (size_t l = 0; l < spec_rows_L_.size() && l < stats.size(); ++l) stats[l].speculation = spec_rows_L_[l];
    spec_rows_L_.clear();
    return stats;
  }

 private:
  // moe.speculative_dispatch: the early rows' buffers (at most (P - 1) T rows go, P T
  // come, of the wider row format), the plan's extras and the host's side of them.
  void plan_speculation(const DispatchShape& shape) {
    spec_armed_ = keep_experts_ = false;
    if (!shape.speculative) return;
    const int64_t T = shape.tokens, D = shape.dim, K = shape.top_k, P = ep_->size(), U = max_tokens_;
    const int64_t rb = std::max<int64_t>(D * int64_t{sizeof(bf16)}, ep_->fp8_capable() ? fp8_row_bytes(D) : 0);
    auto bytes = [](int64_t n) { return Buffer<uint8_t>(static_cast<size_t>(n)); };
    auto i32 = [](int64_t n) { return Buffer<int32_t>(static_cast<size_t>(n)); };
    spec_send_ = bytes(U * rb);
    spec_recv_ = bytes(U * rb);
    corr_recv_ = bytes(U * rb);
    spec_pos_dev_ = i32(T * P);
    spec_sizes_dev_ = i32(2 * P);
    corr_pos_TP_ = i32(T * P);
    corr_tokens_dev_ = i32(2 * P);
    source_send_ = i32(U);
    source_recv_ = i32(U);
    starts_dev_ = i32(3 * (P + 1));
    spec_host_ = gpu::PinnedHostArray<int32_t>(static_cast<size_t>(T * P + 4 * P + 3 * (P + 1)));
    spec_pos_host_ = spec_host_.data();
    spec_tokens_host_ = spec_pos_host_ + T * P;
    spec_recv_host_ = spec_tokens_host_ + P;
    corr_host_ = spec_recv_host_ + P;  // sent, then received
    starts_host_ = corr_host_ + 2 * P;
    experts_host_ = gpu::PinnedHostArray<int32_t>(static_cast<size_t>(T * K));
    if (!side_) {
      MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
      for (cudaEvent_t* e : {&x_ready_, &early_done_, &sizes_ready_})
        MOE_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    }
  }
  // Token rows of D bf16 (or fp8 rows, sent as 4-byte words: they are padded to them) out
  // and back, counts in rows; no phase mark (the early rows go on the side stream).
  void exchange_wire(bool fp8_rows, const void* send, const std::vector<int64_t>& send_rows_P, void* recv,
                     const std::vector<int64_t>& recv_rows_P) {
    const int64_t D = shape_.dim;
    std::vector<int64_t> send_counts(send_rows_P), recv_counts(recv_rows_P);
    const int64_t per_row = fp8_rows ? fp8_row_bytes(D) / 4 : D;  // fp8: 4-byte words
    for (int64_t& n : send_counts) n *= per_row;
    for (int64_t& n : recv_counts) n *= per_row;
    ep_->exchange(send, send_counts, recv, recv_counts, fp8_rows ? sizeof(int32_t) : sizeof(bf16));
  }
  // Before the plan: the guessed tokens' rows go on the side stream once the input is
  // written, while the model's stream runs the router; the plan waits for them.
  void send_early_rows(const MoEBuffers& m, const bf16* x_TD) {
    const int P = ep_->size();
    const int64_t T = shape_.tokens, D = shape_.dim;
    MOE_CHECK(spec_layer_ == m.moe_index, "speculative dispatch: guesses for MoE layer {}, dispatch of layer {}",
              spec_layer_, m.moe_index);
    MOE_CHECK(x_recorded_, "speculative dispatch: input_ready() was not called before the dispatch");
    MOE_CUDA_CHECK(cudaEventSynchronize(sizes_ready_));
    spec_send_P_.assign(spec_tokens_host_, spec_tokens_host_ + P);
    spec_recv_P_.assign(spec_recv_host_, spec_recv_host_ + P);
    MOE_CUDA_CHECK(cudaStreamWaitEvent(side_, x_ready_, 0));
    if (m.fp8_rows)
      cuda::scatter_token_rows_fp8(spec_send_.data(), x_TD, spec_pos_dev_.data(), spec_sizes_dev_.data(), T, P, D,
                                   side_);
    else
      cuda::scatter_token_rows(reinterpret_cast<bf16*>(spec_send_.data()), x_TD, spec_pos_dev_.data(),
                               spec_sizes_dev_.data(), T, P, D, side_);
    ep_->set_stream(side_);
    exchange_wire(m.fp8_rows, spec_send_.data(), spec_send_P_, spec_recv_.data(), spec_recv_P_);
    ep_->set_stream(stream_);
    MOE_CUDA_CHECK(cudaEventRecord(early_done_, side_));
  }
  // After the plan's read (corr_host_): the rows chosen but not guessed.
  void count_speculation(const MoEBuffers& m) {
    const int P = ep_->size();
    corr_send_P_.assign(corr_host_, corr_host_ + P);
    corr_recv_P_.assign(corr_host_ + P, corr_host_ + 2 * P);
    if (spec_rows_L_.size() <= static_cast<size_t>(m.moe_index)) spec_rows_L_.resize(static_cast<size_t>(m.moe_index) + 1);
    for (int p = 0; p < P; ++p) {
      const int64_t corrected = corr_recv_P_[static_cast<size_t>(p)];
      const int64_t used = m.recv_tokens_P[static_cast<size_t>(p)] - corrected;
      MOE_CHECK(used >= 0 && used <= spec_recv_P_[static_cast<size_t>(p)],
                "speculative dispatch: rank {} sends {} rows, {} of them corrections, after {} early", p,
                m.recv_tokens_P[static_cast<size_t>(p)], corrected, spec_recv_P_[static_cast<size_t>(p)]);
      if (p == ep_->rank()) continue;
      spec_rows_L_[static_cast<size_t>(m.moe_index)].add(
          SpeculationRows{used, spec_recv_P_[static_cast<size_t>(p)] - used, corrected});
    }
  }
  void send_corrections(const MoEBuffers& m, const bf16* x_TD) {
    const int P = ep_->size();
    const int64_t T = shape_.tokens, D = shape_.dim;
    void* send = m.fp8_rows ? static_cast<void*>(wire_send_.data()) : static_cast<void*>(send_.data());
    if (m.fp8_rows)
      cuda::scatter_token_rows_fp8(wire_send_.data(), x_TD, corr_pos_TP_.data(), corr_tokens_dev_.data(), T, P, D,
                                   stream_);
    else
      cuda::scatter_token_rows(send_.data(), x_TD, corr_pos_TP_.data(), corr_tokens_dev_.data(), T, P, D, stream_);
    mark_(kAllToAll);
    exchange_wire(m.fp8_rows, send, corr_send_P_, corr_recv_.data(), corr_recv_P_);
  }
  // The exact blocks (recv_, or wire_recv_ for fp8 rows) from the early rows and the
  // corrections, as each row's source says.
  void merge_early_rows(const MoEBuffers& m) {
    const int P = ep_->size();
    const int64_t D = shape_.dim;
    starts_host_[0] = starts_host_[P + 1] = starts_host_[2 * (P + 1)] = 0;
    for (int p = 0; p < P; ++p) {
      starts_host_[p + 1] = starts_host_[p] + static_cast<int32_t>(m.recv_tokens_P[static_cast<size_t>(p)]);
      starts_host_[P + 2 + p] = starts_host_[P + 1 + p] + static_cast<int32_t>(spec_recv_P_[static_cast<size_t>(p)]);
      starts_host_[2 * P + 3 + p] = starts_host_[2 * P + 2 + p] + static_cast<int32_t>(corr_recv_P_[static_cast<size_t>(p)]);
    }
    MOE_CUDA_CHECK(cudaMemcpyAsync(starts_dev_.data(), starts_host_, static_cast<size_t>(3 * (P + 1)) * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, stream_));  // the early rows are in: plan_exchange waited
    void* rows = m.fp8_rows ? static_cast<void*>(wire_recv_.data()) : static_cast<void*>(recv_.data());
    const int64_t rb = m.fp8_rows ? fp8_row_bytes(D) : D * int64_t{sizeof(bf16)};
    cuda::merge_speculated_rows(rows, source_recv_.data(), m.recv_tokens, starts_dev_.data(), spec_recv_.data(),
                                corr_recv_.data(), rb, P, stream_);
    spec_armed_ = x_recorded_ = false;
  }
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
      mark_(kAllToAll);
      exchange_wire(false, send ? send : send_.data(), send_tokens_P, recv ? recv : recv_.data(), recv_tokens_P);
      return;
    }
    MOE_CHECK(wire_send_.size() > 0 || max_tokens_ == 0, "expert exchange: fp8 rows without their buffers");
    int64_t sent = 0, received = 0;
    for (int64_t n : send_tokens_P) sent += n;
    for (int64_t n : recv_tokens_P) received += n;
    if (send) cuda::quantize_rows_fp8(wire_send_.data(), send, sent, D, stream_);
    mark_(kAllToAll);
    exchange_wire(true, wire_send_.data(), send_tokens_P, wire_recv_.data(), recv_tokens_P);
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
  void plan_exchange(const Layer& layer, MoEBuffers& m, const int32_t* slot_TK, bool spec) {
    const int P = ep_->size();
    const int64_t T = shape_.tokens, K = shape_.top_k, E = shape_.n_experts, L = local_experts(layer);
    // Which rank computes each kept assignment: by the block edges, or with split experts by
    // this micro-batch's cuts from every rank's kept rows per slot.
    const int32_t* cut = layer.edge_cut.data();
    // The plan's exchanges follow the early rows on the model's stream: they share the
    // all-to-all's scratch (the hierarchical exchange packs into buffers of its own on the
    // caller's stream), and over NCCL they would queue behind them anyway.
    if (spec) MOE_CUDA_CHECK(cudaStreamWaitEvent(stream_, early_done_, 0));
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
    if (spec) {
      // Which exact rows went early; the corrections' counts travel beside the counts.
      mark_(kDispatch);
      cuda::speculation_sources(source_send_.data(), corr_pos_TP_.data(), corr_tokens_dev_.data(), m.token_pos.data(),
                                m.tokens_P.data(), spec_pos_dev_.data(), T, P, stream_);
      mark_(kAllToAll);
      const std::vector<int64_t> one_each(static_cast<size_t>(P), 1);
      ep_->exchange(corr_tokens_dev_.data(), one_each, corr_tokens_dev_.data() + P, one_each, sizeof(int32_t));
      MOE_CUDA_CHECK(cudaMemcpyAsync(corr_host_, corr_tokens_dev_.data(),
                                     static_cast<size_t>(2 * P) * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    }
    if (keep_experts_)
      MOE_CUDA_CHECK(cudaMemcpyAsync(experts_host_.data(), m.expert.data(), static_cast<size_t>(T * K) * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, stream_));
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
    if (spec) count_speculation(m);
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
  gpu::SpanTimer dispatch_waits_;  // each forward dispatch, keyed by MoE layer (DispatchStats::wait_s)
  // moe.speculative_dispatch (plan_speculation): the early rows out and in, the
  // corrections in, the guessed blocks (spec_pos_dev_, and the sizes sent | received),
  // the corrections' blocks and counts (sent | received), each exact row's source out and
  // in, the merge's block starts; their pinned host sides; the side stream and its events.
  Buffer<uint8_t> spec_send_, spec_recv_, corr_recv_;
  Buffer<int32_t> spec_pos_dev_, spec_sizes_dev_, corr_pos_TP_, corr_tokens_dev_, source_send_, source_recv_,
      starts_dev_;
  gpu::PinnedHostArray<int32_t> spec_host_, experts_host_;
  int32_t *spec_pos_host_ = nullptr, *spec_tokens_host_ = nullptr, *spec_recv_host_ = nullptr,
          *corr_host_ = nullptr, *starts_host_ = nullptr;
  std::vector<int64_t> spec_send_P_, spec_recv_P_, corr_send_P_, corr_recv_P_;
  std::vector<SpeculationRows> spec_rows_L_;
  cudaStream_t side_ = nullptr;
  cudaEvent_t x_ready_ = nullptr, early_done_ = nullptr, sizes_ready_ = nullptr;
  bool spec_armed_ = false, x_recorded_ = false, keep_experts_ = false;
  int spec_layer_ = -1;
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

// The GPU model's MoE layer: router, dispatch to the experts' grouped GEMMs, combine, and
// their backward; tokens per expert, the aux-loss-free balancing bias and the
// expert-parallel exchange. The rest of the model is in gpu_transformer.cpp; the optimizer
// (per-expert clipping included) is optim/cuda/gpu_optimizer.h.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "core/error.h"
#include "model/cuda/gpu_transformer_state.h"
#include "moe/dispatch.h"

namespace moe {

void GpuTransformer::State::moe_forward(Layer& layer, size_t layer_index, bool count_load) {
  const MoEConfig& mc = config.moe;
  const int64_t T = tokens, D = config.dim, E = mc.n_experts, K = mc.top_k, F = mc.expert_hidden;
  MoEBuffers& m = layer.act->moe;
  mark(kRouter);
  // Router: fp32 logits from the bf16 matmul, + bias, scores, top-k.
  blas.gemm(false, true, T, E, D, 1.0f, layer.act->n2.data(), D, w(layer.router_w), D, 0.0f, m.logits.data(), true, E,
            stream);
  cuda::add_bias_rows(m.logits.data(), w32(layer.router_b), T, E, stream);
  const float* selection_bias = mc.bias_balancing ? layer.balance_bias.data() : nullptr;
  cuda::router_topk(m.scores.data(), m.expert.data(), m.weight.data(), m.logits.data(), selection_bias, T, E, K,
                    static_cast<float>(mc.temperature), mc.score_func, mc.renormalize, stream, mc.route_groups,
                    mc.route_top_groups);
  cuda::expert_counts(m.assign_counts.data(), m.expert.data(), T, E, K, stream);
  cuda::router_loss_terms(m.aux_term.data(), m.z_term.data(), m.scores.data(), m.logits.data(), m.assign_counts.data(),
                          T, E, K, static_cast<float>(mc.temperature), mc.score_func, stream);
  float* layer_sums = sums.data() + 1 + 2 * layer_index;
  cuda::ordered_sum(layer_sums, m.aux_term.data(), T, static_cast<float>(mc.aux_loss_coef * E / T), stream);
  cuda::ordered_sum(layer_sums + 1, m.z_term.data(), T, static_cast<float>(mc.z_loss_coef / T), stream);
  const int64_t capacity = expert_capacity(mc.capacity_factor, T, K, E);
  mark(kDispatch);
  // The rows are laid out by slot: the routed experts themselves until a re-placement.
  const int32_t* routed_slot = m.expert.data();
  if (layer.placed) {
    cuda::lookup(m.slot.data(), layer.slot_of_expert.data(), m.expert.data(), T * K, stream);
    routed_slot = m.slot.data();
  }
  cuda::assign_rows(m.row.data(), m.counts.data(), m.offsets.data(), m.token_of_row.data(),
                    count_load ? layer.load.data() : nullptr,
                    m.rank.data(), routed_slot, T, E, K, capacity, stream);
  if (count_load)  // kept rows per expert, router entropy: read with expert_load()
    cuda::accumulate_routing_stats(layer.routing.data(), routing_scratch.data(), m.scores.data(), m.counts.data(),
                                   layer.placed ? layer.slot_of_expert.data() : nullptr, T, E, stream);
  expert_gemm->set_experts(local_experts(layer));
  MOE_CUDA_CHECK(cudaMemcpyAsync(kept_rows.data() + layer_index, m.offsets.data() + E, sizeof(int32_t),
                                 cudaMemcpyDeviceToDevice, stream));
  if (ep) {
    ep_experts_forward(layer, routed_slot);  // ffn_out from the ranks' partial combines
  } else {
    expert_rows_forward(layer, /*gate_up=*/true);
    bf16* y[1] = {m.y_rows.data()};
    const bf16* w2[1] = {local_w(layer, layer.w2)};
    expert_gemm->forward(1, y, D, m.act_rows->data(), F, w2, m.offsets.data(), D, F, stream);
    mark(kCombine);
    cuda::combine_forward(layer.act->ffn_out.data(), m.y_rows.data(), m.weight.data(), m.row.data(), T, K, D, stream);
  }
  mark(kExperts);
  for (size_t i = 0; i < layer.shared.size(); ++i)
    ffn_forward(layer.act->ffn_out.data(), layer.act->n2.data(), w(layer.shared[i][0]), w(layer.shared[i][1]),
                w(layer.shared[i][2]), m.shared[i], T, F, true);
}

void GpuTransformer::State::expert_rows_forward(Layer& layer, bool gate_up) {
  const int64_t T = tokens, D = config.dim, E = config.moe.n_experts, K = config.moe.top_k;
  MoEBuffers& m = layer.act->moe;
  mark(kDispatch);
  cuda::permute_forward(m.x_rows->data(), layer.act->n2.data(), m.token_of_row.data(), m.offsets.data(), T * K, E, D,
                        stream);
  experts_gate_up_forward(layer, gate_up);
}

void GpuTransformer::State::experts_gate_up_forward(Layer& layer, bool gate_up) {
  const int64_t D = config.dim, F = config.moe.expert_hidden;
  MoEBuffers& m = layer.act->moe;
  // The experts: grouped GEMMs over the device-side row offsets (no host sync).
  mark(kExperts);
  if (gate_up) {
    bf16* gate_up_sets[2] = {m.gate_up_rows->data(), m.gate_up_rows->data() + F};
    const bf16* w13[2] = {local_w(layer, layer.w1), local_w(layer, layer.w3)};
    expert_gemm->forward(2, gate_up_sets, 2 * F, m.x_rows->data(), D, w13, expert_offsets(m), F, D, stream);
  }
  cuda::swiglu_forward(m.act_rows->data(), m.gate_up_rows->data(), expert_rows(m), F, stream);
}

void GpuTransformer::State::exchange_tokens(const void* send, const std::vector<int64_t>& send_tokens_P, void* recv,
                                            const std::vector<int64_t>& recv_tokens_P, int64_t per_token,
                                            size_t elem_bytes) {
  std::vector<int64_t> send_counts(send_tokens_P.size()), recv_counts(recv_tokens_P.size());
  for (size_t p = 0; p < send_tokens_P.size(); ++p) send_counts[p] = send_tokens_P[p] * per_token;
  for (size_t p = 0; p < recv_tokens_P.size(); ++p) recv_counts[p] = recv_tokens_P[p] * per_token;
  mark(kAllToAll);
  ep->exchange(send, send_counts, recv, recv_counts, elem_bytes);
}

void GpuTransformer::State::plan_expert_exchange(Layer& layer, const int32_t* slot_TK) {
  MoEBuffers& m = layer.act->moe;
  const int P = ep->size();
  const int64_t T = tokens, K = config.moe.top_k, E = config.moe.n_experts, L = local_experts(layer);
  // Which rank computes each kept assignment: by the block edges, or with split experts by
  // this micro-batch's cuts from every rank's kept rows per slot.
  const int32_t* cut = layer.edge_cut.data();
  if (split_experts) {
    for (int p = 0; p < P; ++p)
      MOE_CUDA_CHECK(cudaMemcpyAsync(ep_all_counts_send.data() + p * E, m.counts.data(),
                                     static_cast<size_t>(E) * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream));
    mark(kAllToAll);
    const std::vector<int64_t> per_rank(static_cast<size_t>(P), E);
    ep->exchange(ep_all_counts_send.data(), per_rank, ep_all_counts.data(), per_rank, sizeof(int32_t));
    mark(kDispatch);
    cuda::boundary_cuts(ep_cut.data(), ep_all_counts.data(), layer.first_slot.data(), true, E, P, stream);
    cut = ep_cut.data();
  }
  cuda::route_ranks(ep_rank_TK.data(), m.row.data(), slot_TK, m.offsets.data(), cut, T, K, P, stream);
  cuda::token_blocks(m.token_pos.data(), m.tokens_P.data(), ep_rank_TK.data(), T, K, P, stream);
  // Each peer gets the rows of each slot of its window and the size of its block; we get
  // every source's for ours.
  cuda::pack_counts(ep_counts_send.data(), m.counts.data(), m.tokens_P.data(), layer.first_slot.data(),
                    layer.window_end.data(), cut, P, stream);
  std::vector<int64_t> send_counts(static_cast<size_t>(P)), recv_counts(static_cast<size_t>(P), L + 1);
  int64_t send_total = 0;
  for (int p = 0; p < P; ++p) {
    send_counts[static_cast<size_t>(p)] =
        layer.window_end_P[static_cast<size_t>(p)] - layer.first_slot_P1[static_cast<size_t>(p)] + 1;
    send_total += send_counts[static_cast<size_t>(p)];
  }
  mark(kAllToAll);
  ep->exchange(ep_counts_send.data(), send_counts, ep_counts_recv.data(), recv_counts, sizeof(int32_t));
  int32_t* sent = ep_host_counts;
  int32_t* received = ep_host_counts + E + 2 * P;
  MOE_CUDA_CHECK(cudaMemcpyAsync(sent, ep_counts_send.data(), static_cast<size_t>(send_total) * sizeof(int32_t),
                                 cudaMemcpyDeviceToHost, stream));
  MOE_CUDA_CHECK(cudaMemcpyAsync(received, ep_counts_recv.data(), static_cast<size_t>(P * (L + 1)) * sizeof(int32_t),
                                 cudaMemcpyDeviceToHost, stream));
  // The one host wait per MoE layer and forward: the exchange sizes are host arguments.
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  mark(kHost);
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
  MOE_CHECK(m.local_rows <= max_local_rows, "expert parallelism: {} rows for the local experts, room for {}",
            m.local_rows, max_local_rows);
  MOE_CHECK(m.recv_tokens <= max_exchange_tokens, "expert parallelism: {} tokens received, room for {}",
            m.recv_tokens, max_exchange_tokens);
}

// Each token goes once to every rank computing one of its kept assignments, with its
// routing; the rows are laid out by local slot there (source by source, each source's in
// token order: the order of one GPU's rows), the experts run, and each token's weighted
// sum over its experts there comes back; ffn_out is the sum of those in rank order.
void GpuTransformer::State::ep_experts_forward(Layer& layer, const int32_t* slot_TK) {
  const int64_t T = tokens, D = config.dim, K = config.moe.top_k, F = config.moe.expert_hidden;
  const int64_t L = local_experts(layer);
  const int P = ep->size();
  MoEBuffers& m = layer.act->moe;
  plan_expert_exchange(layer, slot_TK);
  const int64_t U = m.recv_tokens, R = m.local_rows;
  mark(kDispatch);
  cuda::scatter_token_rows(ep_send.data(), layer.act->n2.data(), m.token_pos.data(), m.tokens_P.data(), T, P, D,
                           stream);
  cuda::pack_routing(ep_slot_send.data(), ep_weight_send.data(), m.token_pos.data(), m.tokens_P.data(),
                     ep_rank_TK.data(), slot_TK, m.weight.data(), layer.first_slot.data(), T, K, P, stream);
  exchange_tokens(ep_send.data(), m.send_tokens_P, ep_recv.data(), m.recv_tokens_P, D, sizeof(bf16));
  exchange_tokens(ep_slot_send.data(), m.send_tokens_P, ep_slot_recv.data(), m.recv_tokens_P, K, sizeof(int32_t));
  exchange_tokens(ep_weight_send.data(), m.send_tokens_P, m.recv_weight.data(), m.recv_tokens_P, K, sizeof(float));
  mark(kDispatch);
  if (L > 0) {
    // No capacity here: the home rank dropped already.
    cuda::assign_rows(m.recv_row.data(), ep_local_counts.data(), m.local_offsets.data(), m.local_token.data(), nullptr,
                      ep_rank_scratch.data(), ep_slot_recv.data(), U, L, K, std::max<int64_t>(1, U * K), stream);
  } else {
    m.local_offsets.fill_bytes(0);
    if (U > 0) MOE_CUDA_CHECK(cudaMemsetAsync(m.recv_row.data(), 0xff, static_cast<size_t>(U * K) * sizeof(int32_t), stream));
  }
  cuda::permute_forward(m.x_rows->data(), ep_recv.data(), m.local_token.data(), m.local_offsets.data(), R, L, D,
                        stream);
  experts_gate_up_forward(layer, /*gate_up=*/true);
  bf16* y[1] = {m.y_rows.data()};
  const bf16* w2[1] = {local_w(layer, layer.w2)};
  expert_gemm->forward(1, y, D, m.act_rows->data(), F, w2, m.local_offsets.data(), D, F, stream);
  mark(kCombine);
  cuda::combine_forward(ep_send.data(), m.y_rows.data(), m.recv_weight.data(), m.recv_row.data(), U, K, D, stream);
  exchange_tokens(ep_send.data(), m.recv_tokens_P, ep_recv.data(), m.send_tokens_P, D, sizeof(bf16));
  mark(kCombine);
  cuda::sum_token_rows(layer.act->ffn_out.data(), ep_recv.data(), m.token_pos.data(), m.tokens_P.data(), T, P, D,
                       stream);
}

// The output gradient once per token to each rank that computed some of its experts;
// there, the local rows' gradients and the combine weights' (zero for other ranks' slots).
void GpuTransformer::State::ep_combine_backward(Layer& layer, const bf16* dy) {
  const int64_t T = tokens, D = config.dim, K = config.moe.top_k;
  const int P = ep->size();
  MoEBuffers& m = layer.act->moe;
  mark(kCombine);
  cuda::scatter_token_rows(ep_send.data(), dy, m.token_pos.data(), m.tokens_P.data(), T, P, D, stream);
  exchange_tokens(ep_send.data(), m.send_tokens_P, ep_recv.data(), m.recv_tokens_P, D, sizeof(bf16));
  mark(kCombine);
  cuda::combine_backward(drows.data(), ep_dweight_local.data(), ep_recv.data(), m.y_rows.data(), m.recv_weight.data(),
                         m.recv_row.data(), m.recv_tokens, K, D, stream);
}

// Each received token's input-row gradients summed there and sent home with its combine
// weights' gradients; at home, dnorm and dweight as the sums over the ranks.
void GpuTransformer::State::ep_dispatch_backward(Layer& layer) {
  const int64_t T = tokens, D = config.dim, K = config.moe.top_k;
  const int P = ep->size();
  MoEBuffers& m = layer.act->moe;
  mark(kDispatch);
  cuda::permute_backward(ep_send.data(), dx_rows.data(), m.recv_row.data(), m.recv_tokens, K, D, false, stream);
  exchange_tokens(ep_send.data(), m.recv_tokens_P, ep_recv.data(), m.send_tokens_P, D, sizeof(bf16));
  exchange_tokens(ep_dweight_local.data(), m.recv_tokens_P, ep_dweight_home.data(), m.send_tokens_P, K,
                  sizeof(float));
  mark(kDispatch);
  cuda::sum_token_rows(dnorm.data(), ep_recv.data(), m.token_pos.data(), m.tokens_P.data(), T, P, D, stream);
  cuda::sum_token_values(dweight.data(), ep_dweight_home.data(), m.token_pos.data(), m.tokens_P.data(), T, K, P,
                         stream);
}

void GpuTransformer::State::moe_backward(Layer& layer, double loss_scale) {
  const MoEConfig& mc = config.moe;
  const int64_t T = tokens, D = config.dim, E = mc.n_experts, K = mc.top_k, F = mc.expert_hidden;
  MoEBuffers& m = layer.act->moe;
  const bf16* dy = dres.data();  // gradient of the FFN output
  // A layer recomputed whole has just refilled the shared rows; otherwise refill them here.
  expert_gemm->set_experts(local_experts(layer));
  if (recompute_experts != ExpertRecompute::None && !layer.recompute)
    expert_rows_forward(layer, /*gate_up=*/recompute_experts == ExpertRecompute::All);
  // Under expert parallelism the output gradients go to the experts' ranks first.
  if (ep) {
    ep_combine_backward(layer, dy);
  } else {
    mark(kCombine);
    cuda::combine_backward(drows.data(), dweight.data(), dy, m.y_rows.data(), m.weight.data(), m.row.data(), T, K, D,
                           stream);
  }
  const bf16* dy_rows = drows.data();
  const int64_t R = expert_rows(m);
  const int32_t* offsets = expert_offsets(m);
  mark(kExperts);
  // Down projection: d act = d y @ W2_e; dW2_e += d y^T @ act.
  expert_gemm->backward_data(dact_rows.data(), F, dy_rows, D, local_w(layer, layer.w2), offsets, F, D, 0.0f, stream);
  float* dw2[1] = {local_g(layer, layer.w2)};
  const bf16* dy_sets[1] = {dy_rows};
  expert_gemm->backward_weight(1, dw2, dy_sets, D, m.act_rows->data(), F, offsets, D, F, stream);
  cuda::swiglu_backward(dgate_up_rows.data(), dact_rows.data(), m.gate_up_rows->data(), R, F, stream);
  // Gate and up: dx = d gate @ W1_e + d up @ W3_e; dW1_e, dW3_e += (d gate, d up)^T @ x.
  expert_gemm->backward_data(dx_rows.data(), D, dgate_up_rows.data(), 2 * F, local_w(layer, layer.w1), offsets, D, F,
                             0.0f, stream);
  expert_gemm->backward_data(dx_rows.data(), D, dgate_up_rows.data() + F, 2 * F, local_w(layer, layer.w3), offsets, D,
                             F, 1.0f, stream);
  float* dw13[2] = {local_g(layer, layer.w1), local_g(layer, layer.w3)};
  const bf16* dgate_up[2] = {dgate_up_rows.data(), dgate_up_rows.data() + F};
  expert_gemm->backward_weight(2, dw13, dgate_up, 2 * F, m.x_rows->data(), D, offsets, F, D, stream);
  // The input rows' gradients back to their tokens (through their home ranks).
  if (ep) {
    ep_dispatch_backward(layer);
  } else {
    mark(kDispatch);
    cuda::permute_backward(dnorm.data(), dx_rows.data(), m.row.data(), T, K, D, false, stream);
  }
  mark(kRouter);
  // Router: combine weights -> logits (aux and z losses included) -> n2 and the router weights.
  cuda::router_backward(dlogits.data(), dweight.data(), m.scores.data(), m.logits.data(), m.expert.data(),
                        m.assign_counts.data(), T, E, K, static_cast<float>(mc.temperature), mc.score_func,
                        mc.renormalize, static_cast<float>(loss_scale * mc.aux_loss_coef),
                        static_cast<float>(loss_scale * mc.z_loss_coef), stream);
  cuda::add_column_sums(g(layer.router_b), dlogits.data(), T, E, stream);
  cuda::cast_to_bf16(dlogits_bf16.data(), dlogits.data(), T * E, stream);
  linear_backward(dnorm.data(), g(layer.router_w), dlogits_bf16.data(), layer.act->n2.data(), w(layer.router_w), T, D, E,
                  true);
  mark(kExperts);
  for (size_t i = 0; i < layer.shared.size(); ++i)
    ffn_backward(dnorm.data(), dy, layer.act->n2.data(), layer.shared[i], m.shared[i], T, F, true);
}

void GpuTransformer::gather_expert_weights(bool with_moments) {
  State& s = *state_;
  if (!s.ep) return;
  const int64_t E = s.config.moe.n_experts;
  // The blocks in the parameter layout, with their bytes per element.
  std::vector<std::pair<char*, size_t>> blocks = {{reinterpret_cast<char*>(s.store->weights_hi()), sizeof(bf16)},
                                                  {reinterpret_cast<char*>(s.store->weights_lo()), sizeof(int16_t)}};
  if (with_moments)
    for (int which : {0, 1})
      blocks.emplace_back(static_cast<char*>(s.store->moment_block(which)), s.store->moment_bytes());
  for (Layer& layer : s.layers) {
    if (!layer.is_moe) continue;
    for (const Param* p : {&layer.w1, &layer.w3, &layer.w2}) {
      const int64_t per_expert = p->numel / E;
      for (int rank = 0; rank < s.ep->size(); ++rank) {
        const int64_t first = layer.first_slot_P1[static_cast<size_t>(rank)];
        const int64_t at = p->offset + first * per_expert,
                      n = (layer.first_slot_P1[static_cast<size_t>(rank) + 1] - first) * per_expert;
        if (n == 0) continue;
        for (const auto& [block, bytes] : blocks)
          s.ep->broadcast(block + at * static_cast<int64_t>(bytes), static_cast<size_t>(n) * bytes, rank);
      }
    }
  }
  MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));
}

GpuRoutingStats GpuTransformer::routing_stats() {
  State& s = *state_;
  const int64_t E = s.config.moe.n_experts;
  std::vector<std::vector<int64_t>> load_slot;
  std::vector<std::vector<double>> routing;
  // Every layer's counters in one go: async copies, then the one synchronisation.
  for (Layer& layer : s.layers)
    if (layer.is_moe) {
      load_slot.emplace_back(static_cast<size_t>(E));
      routing.emplace_back(static_cast<size_t>(E + 2));
      MOE_CUDA_CHECK(cudaMemcpyAsync(load_slot.back().data(), layer.load.data(), E * sizeof(int64_t),
                                     cudaMemcpyDeviceToHost, s.stream));
      MOE_CUDA_CHECK(cudaMemcpyAsync(routing.back().data(), layer.routing.data(), (E + 2) * sizeof(double),
                                     cudaMemcpyDeviceToHost, s.stream));
    }
  MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  GpuRoutingStats stats;
  size_t i = 0;
  for (Layer& layer : s.layers)
    if (layer.is_moe) {
      std::vector<int64_t> load(static_cast<size_t>(E)), kept(static_cast<size_t>(E));
      for (size_t slot = 0; slot < load.size(); ++slot)
        load[static_cast<size_t>(layer.expert_of_slot[slot])] = load_slot[i][slot];
      for (size_t e = 0; e < kept.size(); ++e) kept[e] = std::llround(routing[i][e]);
      stats.load.push_back(std::move(load));
      stats.kept.push_back(std::move(kept));
      stats.entropy_sum.push_back(routing[i][static_cast<size_t>(E)]);
      stats.tokens.push_back(std::llround(routing[i][static_cast<size_t>(E + 1)]));
      ++i;
    }
  return stats;
}

std::vector<std::vector<int64_t>> GpuTransformer::expert_load() { return routing_stats().load; }

void GpuTransformer::reset_load() {
  for (Layer& layer : state_->layers)
    if (layer.is_moe) {
      layer.load.fill_bytes(0);
      layer.routing.fill_bytes(0);
    }
}

Buffer<float>& GpuTransformer::State::balance_bias_of(size_t moe_layer) {
  size_t index = 0;
  for (Layer& layer : layers)
    if (layer.is_moe && index++ == moe_layer) return layer.balance_bias;
  MOE_THROW("balance bias: no MoE layer {} (the model has {})", moe_layer, index);
}

void GpuTransformer::set_balance_bias(size_t moe_layer, const std::vector<float>& bias_E) {
  Buffer<float>& bias = state_->balance_bias_of(moe_layer);
  MOE_CHECK(bias_E.size() == bias.size(), "balance bias of MoE layer {}: {} values for {} experts", moe_layer,
            bias_E.size(), bias.size());
  bias.upload(bias_E.data(), bias_E.size());
}

std::vector<float> GpuTransformer::balance_bias(size_t moe_layer) const {
  const Buffer<float>& bias = state_->balance_bias_of(moe_layer);
  std::vector<float> values(bias.size());
  bias.download(values.data(), values.size());
  return values;
}

}  // namespace moe

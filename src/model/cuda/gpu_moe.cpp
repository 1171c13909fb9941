// The GPU model's MoE layer: router, dispatch to the experts' grouped GEMMs, combine, and
// their backward; tokens per expert, the aux-loss-free balancing bias and per-expert
// gradient clipping. The rest of the model is in gpu_transformer.cpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
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
                    static_cast<float>(mc.temperature), mc.score_func, mc.renormalize, stream);
  cuda::expert_counts(m.assign_counts.data(), m.expert.data(), T, E, K, stream);
  cuda::router_loss_terms(m.aux_term.data(), m.z_term.data(), m.scores.data(), m.logits.data(), m.assign_counts.data(),
                          T, E, K, static_cast<float>(mc.temperature), mc.score_func, stream);
  float* layer_sums = sums.data() + 1 + 2 * layer_index;
  cuda::ordered_sum(layer_sums, m.aux_term.data(), T, static_cast<float>(mc.aux_loss_coef * E / T), stream);
  cuda::ordered_sum(layer_sums + 1, m.z_term.data(), T, static_cast<float>(mc.z_loss_coef / T), stream);
  const int64_t capacity = expert_capacity(mc.capacity_factor, T, K, E);
  mark(kDispatch);
  cuda::assign_rows(m.row.data(), m.counts.data(), m.offsets.data(), m.token_of_row.data(),
                    count_load ? layer.load.data() : nullptr,
                    m.rank.data(), m.expert.data(), T, E, K, capacity, stream);
  MOE_CUDA_CHECK(cudaMemcpyAsync(kept_rows.data() + layer_index, m.offsets.data() + E, sizeof(int32_t),
                                 cudaMemcpyDeviceToDevice, stream));
  expert_rows_forward(layer, /*gate_up=*/true);
  bf16* y[1] = {m.y_rows.data()};
  const bf16* w2[1] = {w(layer.w2)};
  expert_gemm->forward(1, y, D, m.act_rows->data(), F, w2, m.offsets.data(), D, F, stream);
  mark(kCombine);
  cuda::combine_forward(layer.act->ffn_out.data(), m.y_rows.data(), m.weight.data(), m.row.data(), T, K, D, stream);
  mark(kExperts);
  for (size_t i = 0; i < layer.shared.size(); ++i)
    ffn_forward(layer.act->ffn_out.data(), layer.act->n2.data(), w(layer.shared[i][0]), w(layer.shared[i][1]),
                w(layer.shared[i][2]), m.shared[i], T, F, true);
}

void GpuTransformer::State::expert_rows_forward(Layer& layer, bool gate_up) {
  const int64_t T = tokens, D = config.dim, E = config.moe.n_experts, K = config.moe.top_k, F = config.moe.expert_hidden;
  MoEBuffers& m = layer.act->moe;
  mark(kDispatch);
  cuda::permute_forward(m.x_rows->data(), layer.act->n2.data(), m.token_of_row.data(), m.offsets.data(), T * K, E, D,
                        stream);
  // The experts: grouped GEMMs over the device-side row offsets (no host sync).
  mark(kExperts);
  if (gate_up) {
    bf16* gate_up_sets[2] = {m.gate_up_rows->data(), m.gate_up_rows->data() + F};
    const bf16* w13[2] = {w(layer.w1), w(layer.w3)};
    expert_gemm->forward(2, gate_up_sets, 2 * F, m.x_rows->data(), D, w13, m.offsets.data(), F, D, stream);
  }
  cuda::swiglu_forward(m.act_rows->data(), m.gate_up_rows->data(), max_rows, F, stream);
}

void GpuTransformer::State::moe_backward(Layer& layer, double loss_scale) {
  const MoEConfig& mc = config.moe;
  const int64_t T = tokens, D = config.dim, E = mc.n_experts, K = mc.top_k, F = mc.expert_hidden;
  MoEBuffers& m = layer.act->moe;
  const bf16* dy = dres.data();  // gradient of the FFN output
  // A layer recomputed whole has just refilled the shared rows; otherwise refill them here.
  if (recompute_experts != ExpertRecompute::None && !layer.recompute)
    expert_rows_forward(layer, /*gate_up=*/recompute_experts == ExpertRecompute::All);
  mark(kCombine);
  cuda::combine_backward(drows.data(), dweight.data(), dy, m.y_rows.data(), m.weight.data(), m.row.data(), T, K, D,
                         stream);
  mark(kExperts);
  // Down projection: d act = d y @ W2_e; dW2_e += d y^T @ act.
  expert_gemm->backward_data(dact_rows.data(), F, drows.data(), D, w(layer.w2), m.offsets.data(), F, D, 0.0f, stream);
  float* dw2[1] = {g(layer.w2)};
  const bf16* dy_rows[1] = {drows.data()};
  expert_gemm->backward_weight(1, dw2, dy_rows, D, m.act_rows->data(), F, m.offsets.data(), D, F, stream);
  cuda::swiglu_backward(dgate_up_rows.data(), dact_rows.data(), m.gate_up_rows->data(), max_rows, F, stream);
  // Gate and up: dx = d gate @ W1_e + d up @ W3_e; dW1_e, dW3_e += (d gate, d up)^T @ x.
  expert_gemm->backward_data(dx_rows.data(), D, dgate_up_rows.data(), 2 * F, w(layer.w1), m.offsets.data(), D, F,
                             0.0f, stream);
  expert_gemm->backward_data(dx_rows.data(), D, dgate_up_rows.data() + F, 2 * F, w(layer.w3), m.offsets.data(), D, F,
                             1.0f, stream);
  float* dw13[2] = {g(layer.w1), g(layer.w3)};
  const bf16* dgate_up[2] = {dgate_up_rows.data(), dgate_up_rows.data() + F};
  expert_gemm->backward_weight(2, dw13, dgate_up, 2 * F, m.x_rows->data(), D, m.offsets.data(), F, D, stream);
  mark(kDispatch);
  cuda::permute_backward(dnorm.data(), dx_rows.data(), m.row.data(), T, K, D, false, stream);
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

std::vector<std::vector<int64_t>> GpuTransformer::expert_load() {
  std::vector<std::vector<int64_t>> loads;
  for (Layer& layer : state_->layers)
    if (layer.is_moe) {
      std::vector<int64_t> load(layer.load.size());
      layer.load.download(load.data(), load.size());
      loads.push_back(std::move(load));
    }
  return loads;
}

void GpuTransformer::reset_load() {
  for (Layer& layer : state_->layers)
    if (layer.is_moe) layer.load.fill_bytes(0);
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

// Groups of parameters sharing an expert_group (train/grad_clip.cpp), in registration
// order (the layers' order); each group's tensors cut at the leading expert dimension.
void GpuTransformer::State::build_expert_slices(const ParameterStore<float>& params) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int id = 0; id < params.size(); ++id) {
    const std::string& group = params.spec(id).expert_group;
    if (group.empty()) continue;
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == group; });
    if (it != groups.end()) it->second.push_back(id);
    else groups.emplace_back(group, std::vector<int>{id});
  }
  for (const auto& [group, ids] : groups) {
    const int64_t n_experts = params.spec(ids.front()).shape[0];
    for (int64_t e = 0; e < n_experts; ++e) {
      first_slice_X1.push_back(static_cast<int32_t>(expert_slices.size()));
      for (int id : ids) {
        const int64_t per_expert = params.numel(id) / n_experts;
        cuda::OptimizerSegment slice;
        slice.offset = params.offset(id) + e * per_expert;
        slice.numel = per_expert;
        slice.first_chunk = expert_slice_chunks;
        expert_slice_chunks += (per_expert + adamw_math::kNormChunk - 1) / adamw_math::kNormChunk;
        expert_slices.push_back(slice);
        expert_of_slice.push_back(static_cast<int32_t>(first_slice_X1.size() - 1));
      }
    }
  }
  first_slice_X1.push_back(static_cast<int32_t>(expert_slices.size()));
}

std::vector<double> GpuTransformer::clip_expert_grads(double max_norm) {
  State& s = *state_;
  const size_t n_experts = s.first_slice_X1.size() - 1, n_slices = s.expert_slices.size();
  if (n_slices == 0) return {};
  if (s.d_expert_slices.size() == 0) {
    s.d_expert_slices = Buffer<cuda::OptimizerSegment>(n_slices);
    s.d_expert_slices.upload(s.expert_slices.data(), n_slices);
    s.d_expert_of_slice = Buffer<int32_t>(n_slices);
    s.d_expert_of_slice.upload(s.expert_of_slice.data(), n_slices);
    s.d_first_slice_X1 = Buffer<int32_t>(n_experts + 1);
    s.d_first_slice_X1.upload(s.first_slice_X1.data(), n_experts + 1);
    s.slice_chunk_sq = Buffer<double>(static_cast<size_t>(s.expert_slice_chunks));
    s.slice_sq = Buffer<double>(n_slices);
    s.expert_norm = Buffer<double>(n_experts);
    s.expert_factor = Buffer<float>(n_experts);
    s.slice_scalars = Buffer<adamw_math::AdamWScalars>(1);
  }
  float* grads = s.store->grads();
  s.mark(kOptimizer);
  cuda::grad_norm(s.slice_scalars.data(), s.slice_chunk_sq.data(), s.slice_sq.data(), grads, s.d_expert_slices.data(),
                  static_cast<int64_t>(n_slices), s.expert_slice_chunks, 0.0, s.stream);
  cuda::expert_clip_factors(s.expert_norm.data(), s.expert_factor.data(), s.slice_sq.data(), s.d_first_slice_X1.data(),
                            static_cast<int64_t>(n_experts), max_norm, s.stream);
  if (max_norm > 0)
    cuda::scale_expert_slices(grads, s.d_expert_slices.data(), s.d_expert_of_slice.data(),
                              static_cast<int64_t>(n_slices), s.expert_factor.data(), s.stream);
  std::vector<double> norms(n_experts);
  MOE_CUDA_CHECK(cudaMemcpyAsync(norms.data(), s.expert_norm.data(), n_experts * sizeof(double),
                                 cudaMemcpyDeviceToHost, s.stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  s.mark(kHost);
  return norms;
}

}  // namespace moe

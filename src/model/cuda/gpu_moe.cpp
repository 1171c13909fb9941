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
#include "moe/expert_slots.h"
#include "moe/gpu_ops.h"

namespace moe {

void GpuTransformer::State::moe_forward(Layer& layer, size_t layer_index, bool count_load) {
  const MoEConfig& mc = config.moe;
  const int64_t T = tokens, D = config.dim, E = mc.n_experts, K = mc.top_k, F = mc.expert_hidden;
  MoEBuffers& m = layer.act->moe;
  dispatcher->input_ready();  // a speculating dispatch's early rows may leave from here
  const bool guess_next = speculating && !recomputing && next_predictor(layer_index, nullptr) != nullptr;
  mark(kRouter);
  // Router: fp32 logits from the bf16 matmul, + bias, scores, top-k.
  blas.gemm(false, true, T, E, D, 1.0f, layer.act->n2.data(), D, w(layer.router_w), D, 0.0f, m.logits.data(), true, E,
            stream);
  if (layer.router_b.id >= 0) cuda::add_bias_rows(m.logits.data(), w32(layer.router_b), T, E, stream);
  const float* selection_bias = mc.bias_balancing ? layer.balance_bias.data() : nullptr;
  cuda::router_topk(m.scores.data(), m.expert.data(), m.weight.data(), m.logits.data(), selection_bias, T, E, K,
                    static_cast<float>(mc.temperature), mc.score_func, mc.renormalize, stream, mc.route_groups,
                    mc.route_top_groups, layer.router_temperature.data());
  if (layer.route_choices.size() > 0)
    MOE_CUDA_CHECK(cudaMemcpyAsync(layer.route_choices.data(), m.expert.data(), T * K * sizeof(int32_t),
                                   cudaMemcpyDeviceToDevice, stream));
  cuda::expert_counts(m.assign_counts.data(), m.expert.data(), T, E, K, stream);
  cuda::router_loss_terms(m.aux_term.data(), m.z_term.data(), m.scores.data(), m.logits.data(), m.assign_counts.data(),
                          T, E, K, static_cast<float>(mc.temperature), mc.score_func, stream,
                          layer.router_temperature.data());
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
  // Padded rows: offsets[E] counts the padding too; the kept rows come from the counts.
  cuda::assign_rows(m.row.data(), m.counts.data(), m.offsets.data(), m.token_of_row.data(),
                    count_load ? layer.load.data() : nullptr, m.rank.data(), routed_slot, T, E, K, capacity, stream,
                    expert_row_align(), padded_rows ? kept_rows.data() + layer_index : nullptr);
  if (count_load)  // kept rows per expert, router entropy: read with routing_stats()
    cuda::accumulate_routing_stats(layer.routing.data(), routing_scratch.data(), m.scores.data(), m.counts.data(),
                                   layer.placed ? layer.slot_of_expert.data() : nullptr, T, E, stream);
  set_experts(local_experts(layer));
  if (!padded_rows)
    MOE_CUDA_CHECK(cudaMemcpyAsync(kept_rows.data() + layer_index, m.offsets.data() + E, sizeof(int32_t),
                                   cudaMemcpyDeviceToDevice, stream));
  // The rows this rank's experts compute (under expert parallelism: every rank's tokens
  // routed here), the experts, and each token's weighted sum of its experts' outputs.
  dispatcher->keep_routed_experts(guess_next);
  const bool x_quantised = dispatch_rows(layer, routed_slot, /*codes=*/true);
  dispatcher->keep_routed_experts(false);
  const bool act_quantised = experts_gate_up_forward(layer, /*gate_up=*/true, /*for_down=*/true, x_quantised);
  bf16* y[1] = {m.y_rows.data()};
  const int w2[1] = {Fp8ExpertWeights::kW2};
  expert_forward(layer, m, 1, y, D, m.act_rows->data(), F, w2, D, F, act_quantised);
  cuda::ResidualBranch& branch = layer.act->ffn_branch;
  if (combine_in_norm) {  // the next norm sums the rows: no [T, D] output written and read back
    branch = dispatcher->combine_rows(m);
    MOE_CHECK(branch.gathered(), "the MoE layer's combine left to the next norm, but its dispatcher has no rows");
  } else {
    dispatcher->combine(m, layer.act->ffn_out.data());
    branch = layer.act->ffn_out.data();
  }
  mark(kExperts);
  for (size_t i = 0; i < layer.shared.size(); ++i)
    ffn_forward(layer.act->ffn_out.data(), layer.act->n2.data(), w(layer.shared[i][0]), w(layer.shared[i][1]),
                w(layer.shared[i][2]), m.shared[i], T, F, true);
  // The host guesses while this layer's experts run on the device.
  if (guess_next) speculate_after(layer_index);
}

const RoutingCache* GpuTransformer::State::next_predictor(size_t layer_index, size_t* next_layer) const {
  const Layer& layer = layers[layer_index];
  if (!layer.is_moe || static_cast<size_t>(layer.moe_index) >= route_predictors.size()) return nullptr;
  for (size_t n = layer_index + 1; n < layers.size(); ++n)
    if (layers[n].is_moe) {
      if (next_layer) *next_layer = n;
      return route_predictors[static_cast<size_t>(layer.moe_index)];
    }
  return nullptr;
}

void GpuTransformer::State::speculate_after(size_t layer_index) {
  size_t n = 0;
  const RoutingCache* predictor = next_predictor(layer_index, &n);
  MOE_CHECK(predictor != nullptr && host_inputs != nullptr, "speculative dispatch without a guesser or the tokens");
  const Layer& next = layers[n];
  const int64_t Q = predictor->predict_k();
  std::vector<int32_t> guess_TQ(static_cast<size_t>(tokens * Q));
  predictor->predict(host_inputs, dispatcher->routed_experts_host(), tokens, guess_TQ.data());
  if (!slots_in_expert_order(next.slots)) {
    const std::vector<int32_t> slot_of = slot_of_expert(next.slots);
    for (int32_t& e : guess_TQ) e = slot_of[static_cast<size_t>(e)];
  }
  dispatcher->speculate(next, guess_TQ.data(), Q);
}

void GpuTransformer::Routing::set_predictors(std::vector<const RoutingCache*> predictors) {
  MOE_CHECK(predictors.empty() || s_.ep != nullptr,
            "moe.speculative_dispatch starts the expert-parallel exchange early: the GPU model has no expert parallelism");
  s_.route_predictors = std::move(predictors);
}

void GpuTransformer::Routing::set_speculating(bool on) { s_.speculating = on && !s_.route_predictors.empty(); }

void GpuTransformer::State::expert_rows_forward(Layer& layer, bool gate_up, bool swiglu) {
  MoEBuffers& m = layer.act->moe;
  const bool x_quantised = dispatch_rows(layer, layer.placed ? m.slot.data() : m.expert.data(), gate_up);
  if (swiglu) {
    experts_gate_up_forward(layer, gate_up, /*for_down=*/false, x_quantised);
  } else if (gate_up) {
    mark(kExperts);
    experts_gate_up_gemm(layer, x_quantised);
  }
}

bool GpuTransformer::State::dispatch_rows(Layer& layer, const int32_t* slot_TK, bool codes) {
  MoEBuffers& m = layer.act->moe;
  const bf16* x_TD = layer.act->n2.data();
  const int64_t E = local_experts(layer);
  if (fp8 && codes && E > 0) {
    // Before anything is written: the local dispatcher's rows are the plan's bound (the
    // expert-parallel one declines below and its rows are checked as they arrive).
    MOE_CHECK(expert_rows(m) * config.dim <= static_cast<int64_t>(fp8_rows.size()),
              "fp8 experts: scratch for {} x {} rows", expert_rows(m), config.dim);
    if (dispatcher->dispatch_fp8(layer, m, x_TD, slot_TK, fp8_rows.data(), fp8_row_scales.data(), E)) {
      zero_expert_padding(layer, m.x_rows->data(), fp8_rows.data(), fp8_row_scales.data());
      return true;
    }
  }
  dispatcher->dispatch(layer, m, x_TD, slot_TK);
  zero_expert_padding(layer, m.x_rows->data(), nullptr, nullptr);
  return false;
}

void GpuTransformer::State::zero_expert_padding(const Layer& layer, bf16* rows, uint8_t* codes, float* scales) {
  if (!padded_rows) return;
  const MoEBuffers& m = layer.act->moe;
  const int64_t E = local_experts(layer);
  if (E == 0) return;
  const cuda::RowCodes row_codes{codes, scales, nullptr, 1, expert_rows(m)};
  cuda::zero_padding_rows(rows, row_codes, expert_offsets(m), m.counts.data(), E, config.dim, expert_row_align(),
                          stream);
}

void GpuTransformer::State::experts_gate_up_gemm(Layer& layer, bool x_quantised) {
  const int64_t D = config.dim, F = config.moe.expert_hidden;
  MoEBuffers& m = layer.act->moe;
  bf16* gate_up_sets[2] = {m.gate_up_rows->data(), m.gate_up_rows->data() + F};
  // Padded fp8 rows (the weight cache's joined copy) or interleaved bf16 weights: w1 and w3
  // as one operand, one GEMM over N = 2F.
  if (fp8_padded_rows || gate_up_interleaved) {
    const int gate_up[1] = {Fp8ExpertWeights::kGateUp};
    expert_forward(layer, m, 1, gate_up_sets, 2 * F, m.x_rows->data(), D, gate_up, 2 * F, D, x_quantised);
    return;
  }
  const int w13[2] = {Fp8ExpertWeights::kW1, Fp8ExpertWeights::kW3};
  expert_forward(layer, m, 2, gate_up_sets, 2 * F, m.x_rows->data(), D, w13, F, D, x_quantised);
}

void GpuTransformer::State::experts_gate_up_backward_data(Layer& layer, const MoEBuffers& m,
                                                          const bf16* dgate_up, bool quantised) {
  const int64_t D = config.dim, F = config.moe.expert_hidden;
  // The same: d gate | d up one [R, 2F] operand, w1 and w3 one, one GEMM over K = 2F.
  if (fp8_padded_rows || gate_up_interleaved) {
    expert_backward_data(layer, m, dx_rows.data(), D, dgate_up, 2 * F, Fp8ExpertWeights::kGateUp, D, 2 * F, 0.0f,
                         quantised ? 0 : -1);
    return;
  }
  expert_backward_data(layer, m, dx_rows.data(), D, dgate_up, 2 * F, Fp8ExpertWeights::kW1, D, F, 0.0f,
                       quantised ? 0 : -1);
  expert_backward_data(layer, m, dx_rows.data(), D, dgate_up ? dgate_up + F : nullptr, 2 * F,
                       Fp8ExpertWeights::kW3, D, F, 1.0f, quantised ? 1 : -1);
}

bool GpuTransformer::State::experts_gate_up_forward(Layer& layer, bool gate_up, bool for_down, bool x_quantised) {
  const int64_t F = config.moe.expert_hidden;
  MoEBuffers& m = layer.act->moe;
  // The experts: grouped GEMMs over the device-side row offsets (no host sync).
  mark(kExperts);
  const int64_t E = local_experts(layer), R = expert_rows(m);
  if (gate_up && swiglu_in_gemm) {  // bf16 only: swiglu_in_gemm needs gate|up interleaved
    experts_gate_up_swiglu(layer);
    return false;
  }
  if (gate_up) experts_gate_up_gemm(layer, x_quantised);
  // fp8 weight gradients: the backward's SwiGLU makes act's operand from gate|up itself.
  if (fp8_weight_gradients && !for_down && E > 0) return false;
  if (!fp8 || !for_down || E == 0) {
    MOE_CHECK(R * F <= static_cast<int64_t>(m.act_rows->size()), "experts: act rows for {} x {}", R, F);
    cuda::swiglu_forward(m.act_rows->data(), m.gate_up_rows->data(), R, F, stream);
    return false;
  }
  // fp8: act's codes and scales for the down projection straight from SwiGLU (the bits
  // quantising the bf16 act gives). The bf16 act is the weight gradient's input; with
  // recompute_experts the backward refills it (or this layer's recomputed forward writes
  // it), so a first forward's is not written; with fp8 weight gradients nothing reads it.
  MOE_CHECK(R * F <= static_cast<int64_t>(fp8_rows.size()), "fp8 experts: scratch for {} x {} rows", R, F);
  bf16* act = (layer.recompute_expert_rows && !recomputing) || fp8_weight_gradients
                  ? nullptr
                  : m.act_rows->data();
  // Padded rows: the codes as one group of all R rows (PaddedExpertGemmFp8's scales).
  cuda::swiglu_forward_fp8(act, fp8_rows.data(), fp8_row_scales.data(), m.gate_up_rows->data(),
                           fp8_padded_rows ? nullptr : expert_offsets(m), fp8_padded_rows ? 1 : E, R, F, stream);
  return true;
}

void GpuTransformer::State::moe_backward(Layer& layer, double loss_scale) {
  const MoEConfig& mc = config.moe;
  const int64_t T = tokens, D = config.dim, E = mc.n_experts, K = mc.top_k, F = mc.expert_hidden;
  MoEBuffers& m = layer.act->moe;
  const bf16* dy = dres.data();  // gradient of the FFN output
  // A layer recomputed whole has just refilled the shared rows; otherwise refill them here.
  // In bf16 SwiGLU's backward below refills act too (one read of gate|up instead of two).
  set_experts(local_experts(layer));
  const bool act_from_backward = layer.recompute_expert_rows && !layer.recompute && !fp8;
  if (layer.recompute_expert_rows && !layer.recompute)
    expert_rows_forward(layer, /*gate_up=*/recompute_experts == ExpertRecompute::All,
                        /*swiglu=*/!act_from_backward);
  // Under expert parallelism the output gradients go to the experts' ranks first. fp8: the
  // down projection's data gradient reads dy's codes from set 0 of fp8_rows, written here
  // where the dispatcher can.
  const bool dy_quantised =
      fp8 && local_experts(layer) > 0 &&
      dispatcher->combine_backward_fp8(m, dy, drows.data(), dweight.data(), fp8_rows.data(), fp8_row_scales.data(),
                                       local_experts(layer));
  if (!dy_quantised) dispatcher->combine_backward(m, dy, drows.data(), dweight.data());
  zero_expert_padding(layer, drows.data(), dy_quantised ? fp8_rows.data() : nullptr,
                      dy_quantised ? fp8_row_scales.data() : nullptr);
  const bf16* dy_rows = drows.data();
  const int64_t R = expert_rows(m);
  const int32_t* offsets = expert_offsets(m);
  mark(kExperts);
  const int w2[1] = {Fp8ExpertWeights::kW2}, w13[2] = {Fp8ExpertWeights::kW1, Fp8ExpertWeights::kW3};
  // Down projection: d act = d y @ W2_e; dW2_e += d y^T @ act. swiglu_in_gemm: d act stays
  // in the GEMM, which writes SwiGLU's backward (d gate|up, and act where it refills it).
  const bool swiglu_backward_in_gemm = swiglu_in_gemm && local_experts(layer) > 0;
  if (act_from_backward)  // SwiGLU's backward (either form) refills act
    MOE_CHECK(R * F <= static_cast<int64_t>(m.act_rows->size()), "experts: act rows for {} x {}", R, F);
  if (swiglu_backward_in_gemm) {
    experts_down_swiglu_backward(layer, m, dy_rows, act_from_backward ? m.act_rows->data() : nullptr);
  } else {
    expert_backward_data(layer, m, dact_rows.data(), F, dy_rows, D, Fp8ExpertWeights::kW2, F, D, 0.0f,
                         dy_quantised ? 0 : -1);
  }
  if (fp8_weight_gradients && local_experts(layer) > 0) {
    experts_backward_fp8_weights(layer, m, dy_rows);
  } else {
    // fp8: SwiGLU's backward writes d gate's and d up's codes and scales itself (the bits
    // quantising its bf16 output gives), sets 0 and 1 of the row scratch.
    const bool fused_fp8 = fp8 && local_experts(layer) > 0;
    if (fused_fp8) {
      MOE_CHECK(2 * R * F <= static_cast<int64_t>(fp8_rows.size()), "fp8 experts: scratch for 2 x {} x {} rows", R, F);
      cuda::swiglu_backward_fp8(dgate_up_rows.data(), fp8_rows.data(), fp8_row_scales.data(), dact_rows.data(),
                                m.gate_up_rows->data(), fp8_padded_rows ? nullptr : offsets,
                                fp8_padded_rows ? 1 : local_experts(layer), R, F, stream);
    } else if (!swiglu_backward_in_gemm) {
      cuda::swiglu_backward(dgate_up_rows.data(), dact_rows.data(), m.gate_up_rows->data(), R, F, stream,
                            act_from_backward ? m.act_rows->data() : nullptr);
    }
    // The down projection's weight gradient after SwiGLU's backward, which may refill act.
    const bf16* dy_sets[1] = {dy_rows};
    expert_backward_weight(layer, m, 1, w2, dy_sets, D, m.act_rows->data(), F, D, F);
    // Gate and up: dx = d gate @ W1_e + d up @ W3_e; dW1_e, dW3_e += (d gate, d up)^T @ x.
    experts_gate_up_backward_data(layer, m, dgate_up_rows.data(), fused_fp8);
    const bf16* dgate_up[2] = {dgate_up_rows.data(), dgate_up_rows.data() + F};
    expert_backward_weight(layer, m, 2, w13, dgate_up, 2 * F, m.x_rows->data(), D, F, D);
  }
  // The input rows' gradients back to their tokens (through their home ranks).
  dispatcher->dispatch_backward(m, dx_rows.data(), dnorm.data(), dweight.data());
  mark(kRouter);
  // Router: combine weights -> logits (aux and z losses included) -> n2 and the router weights.
  cuda::router_backward(dlogits.data(), dweight.data(), m.scores.data(), m.logits.data(), m.expert.data(),
                        m.assign_counts.data(), T, E, K, static_cast<float>(mc.temperature), mc.score_func,
                        mc.renormalize, static_cast<float>(loss_scale * mc.aux_loss_coef),
                        static_cast<float>(loss_scale * mc.z_loss_coef), stream, layer.router_temperature.data());
  if (layer.router_b.id >= 0) cuda::add_column_sums(g(layer.router_b), dlogits.data(), T, E, column_partial.data(), stream);
  cuda::cast_to_bf16(dlogits_bf16.data(), dlogits.data(), T * E, stream);
  linear_backward(dnorm.data(), g(layer.router_w), dlogits_bf16.data(), layer.act->n2.data(), w(layer.router_w), T, D, E,
                  true);
  mark(kExperts);
  for (size_t i = 0; i < layer.shared.size(); ++i)
    ffn_backward(dnorm.data(), dy, layer.act->n2.data(), layer.shared[i], m.shared[i], T, F, true);
}

void GpuTransformer::begin_gradients() {
  State& s = *state_;
  // What the weight-gradient GEMMs write: the dense projections whole (linear_backward; the
  // LM head's, the embedding's when tied: the head's GEMM comes first in the backward, the
  // embedding's scatter adds after it) and each MoE layer's local slots of its expert
  // tensors (the window set_experts gives them). Norms, biases and an untied embedding
  // accumulate: they stay zeroed.
  RangeList written;
  const auto whole = [&](const Param& p) {
    if (p.id >= 0) written.push_back({p.offset, p.numel});
  };
  whole(s.head);
  for (const Layer& layer : s.layers) {
    written.push_back({layer.wq.offset, layer.wq.numel + layer.wk.numel + layer.wv.numel});  // one q|k|v GEMM
    whole(layer.wo);
    if (!layer.is_moe) {
      for (const Param& p : layer.dense) whole(p);
      continue;
    }
    whole(layer.router_w);
    for (const auto& shared : layer.shared)
      for (const Param& p : shared) whole(p);
    if (s.local_experts(layer) == 0) continue;
    for (const Param* p : {&layer.w1, &layer.w3, &layer.w2}) {
      const int64_t per_expert = p->numel / s.config.moe.n_experts;
      written.push_back({p->offset + s.first_slot(layer) * per_expert, s.local_experts(layer) * per_expert});
    }
  }
  s.store->zero_grads(merge_ranges(std::move(written)));
  s.overwrite_grads = true;
}

GpuTransformer::Routing& GpuTransformer::routing() { return *routing_; }

GpuRoutingStats GpuTransformer::Routing::stats() {
  State& s = s_;
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
        load[static_cast<size_t>(layer.slots.expert_of_slot[slot])] = load_slot[i][slot];
      for (size_t e = 0; e < kept.size(); ++e) kept[e] = std::llround(routing[i][e]);
      stats.load.push_back(std::move(load));
      stats.kept.push_back(std::move(kept));
      stats.entropy_sum.push_back(routing[i][static_cast<size_t>(E)]);
      stats.tokens.push_back(std::llround(routing[i][static_cast<size_t>(E + 1)]));
      ++i;
    }
  for (const auto& d : s.dispatcher->take_stats(static_cast<int>(i))) {
    stats.speculation.push_back(d.speculation);
    stats.dispatch_wait_s.push_back(d.wait_s);
  }
  return stats;
}


void GpuTransformer::Routing::reset_stats() {
  int moe_layers = 0;
  for (Layer& layer : s_.layers)
    if (layer.is_moe) {
      layer.load.fill_bytes(0);
      layer.routing.fill_bytes(0);
      ++moe_layers;
    }
  if (s_.dispatcher) s_.dispatcher->take_stats(moe_layers);  // the validation's since the last step
}

Layer& GpuTransformer::State::layer_of(size_t moe_layer) {
  size_t index = 0;
  for (Layer& layer : layers)
    if (layer.is_moe && index++ == moe_layer) return layer;
  MOE_THROW("no MoE layer {} (the model has {})", moe_layer, index);
}

Buffer<float>& GpuTransformer::State::balance_bias_of(size_t moe_layer) { return layer_of(moe_layer).balance_bias; }

void GpuTransformer::Routing::set_balance_bias(size_t moe_layer, const std::vector<float>& bias_E) {
  Buffer<float>& bias = s_.balance_bias_of(moe_layer);
  MOE_CHECK(bias_E.size() == bias.size(), "balance bias of MoE layer {}: {} values for {} experts", moe_layer,
            bias_E.size(), bias.size());
  bias.upload(bias_E.data(), bias_E.size());
}

void GpuTransformer::Routing::set_temperature(size_t moe_layer, float temperature) {
  MOE_CHECK(std::isfinite(temperature) && temperature > 0, "router temperature of MoE layer {}: {} must be > 0",
            moe_layer, temperature);
  s_.layer_of(moe_layer).router_temperature.upload(&temperature, 1);
}

float GpuTransformer::Routing::temperature(size_t moe_layer) const {
  float temperature = 0;
  s_.layer_of(moe_layer).router_temperature.download(&temperature, 1);
  return temperature;
}

std::vector<float> GpuTransformer::Routing::balance_bias(size_t moe_layer) const {
  const Buffer<float>& bias = s_.balance_bias_of(moe_layer);
  std::vector<float> values(bias.size());
  bias.download(values.data(), values.size());
  return values;
}

std::vector<std::vector<int32_t>> GpuTransformer::Routing::expert_choices() {
  State& s = s_;
  const int64_t TK = s.tokens * s.config.moe.top_k;
  std::vector<std::vector<int32_t>> choices;
  for (Layer& layer : s.layers)
    if (layer.is_moe) {
      choices.emplace_back(static_cast<size_t>(TK));
      MOE_CHECK(layer.route_choices.size() == static_cast<size_t>(TK), "expert choices: moe.route_cache is off");
      MOE_CUDA_CHECK(cudaMemcpyAsync(choices.back().data(), layer.route_choices.data(), TK * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, s.stream));
    }
  MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  return choices;
}

}  // namespace moe

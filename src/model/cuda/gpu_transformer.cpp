#include "model/cuda/gpu_transformer.h"
#include "model/cuda/gpu_parameter_io.h"
#include "model/cuda/gpu_transformer_state.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <memory>
#include <cmath>
#include <string>
#include <utility>

#include "core/error.h"
#include "core/gpu.h"
#include "core/nvtx_range.h"
#include "kernels/fp8_blockwise.h"
#include "kernels/fp8_gpu_ops.h"
#include "kernels/gpu_ops.h"
#include "model/gpu_buffer_sizes.h"
#include "model/gpu_state_layout.h"
#include "moe/gpu_ops.h"
#include "moe/dispatch.h"

namespace moe {


namespace {

Param lookup(const ParameterStore<float>& params, const std::string& name) {
  const int id = params.find(name);
  MOE_CHECK(id >= 0, "GPU model: parameter '{}' missing", name);
  return Param{id, params.offset(id), params.numel(id)};
}

// Where each parameter's moments start in the CPU AdamW's packed layout.
std::vector<int64_t> packed_offsets(const ParameterStore<float>& params) {
  std::vector<int64_t> offsets(static_cast<size_t>(params.size()) + 1, 0);
  for (int id = 0; id < params.size(); ++id)
    offsets[static_cast<size_t>(id) + 1] = offsets[static_cast<size_t>(id)] + params.numel(id);
  return offsets;
}

}  // namespace

GpuModelOptions GpuModelOptions::from_config(const TrainingConfig& training, MomentDtype moments) {
  GpuModelOptions options;
  options.moments = moments;
  options.bf16_expert_grads = training.expert_grad_dtype == GradDtype::Bf16;
  options.recompute_layers = training.recompute_layers;
  options.recompute_experts = training.recompute_experts;
  options.recompute_experts_layers = training.recompute_experts_layers;
  options.attention_dq = moe::attention_dq(training.deterministic, training.deterministic_attention);
  options.attention_query_chunks = training.attention_query_chunks;
  options.fp8_experts = training.precision == TrainingPrecision::Fp8;
  options.fp8_projections = training.precision == TrainingPrecision::Fp8;
  options.fp8_weight_cache = training.fp8_weight_cache;
  options.fp8_weight_gradients = training.fp8_weight_gradients;
  options.fp8_weight_gradient_scales = training.fp8_weight_gradient_scales;
  const bool padded = expert_row_align(training) > 1;
  options.fp8_deepgemm = padded && training.precision == TrainingPrecision::Fp8;
  options.bf16_deepgemm = padded && training.precision == TrainingPrecision::Bf16;
  options.interleave_gate_up = interleaves_gate_up(training);
  options.swiglu_in_gemm = training.swiglu_in_gemm;  // applies where the store interleaves gate|up
  return options;
}

GpuTransformer::GpuTransformer(const ModelConfig& config, const ParameterStore<float>& params,
                               const GpuModelOptions& options)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  MOE_CHECK(gpu::device_count() > 0, "no CUDA device found");
  MOE_CHECK(options.max_local_experts >= 0, "expert placement: at most {} experts per rank", options.max_local_experts);
  s.config = config;
  s.recompute_layers = options.recompute_layers;
  s.recompute_experts = options.recompute_experts;
  s.recompute_experts_layers = options.recompute_experts_layers;
  s.local_experts_cap = options.max_local_experts;
  s.split_experts = options.split_experts;  // before the layers' slot bounds below
  s.fp8 = options.fp8_experts;
  const bool deepgemm = options.fp8_deepgemm && (s.fp8 || options.fp8_projections);
  MOE_CHECK(!deepgemm || cuda::deepgemm_available(),
            "training.fp8_gemm_backend = deepgemm needs an sm_90 GPU with {} multiprocessors (an H100 or H200 SXM)",
            cuda::kDeepGemmSms);
  const bool bf16_deepgemm = options.bf16_deepgemm && !s.fp8;
  MOE_CHECK(!bf16_deepgemm || cuda::deepgemm_available(),
            "training.bf16_gemm_backend = deepgemm needs an sm_90 GPU with {} multiprocessors (an H100 or H200 SXM)",
            cuda::kDeepGemmSms);
  MOE_CHECK(!bf16_deepgemm || (config.dim % 128 == 0 && config.moe.expert_hidden % 128 == 0),
            "training.bf16_gemm_backend = deepgemm needs model.dim ({}) and moe.expert_hidden ({}) to be multiples of "
            "128",
            config.dim, config.moe.expert_hidden);
  s.projections = std::make_unique<ProjectionGemms>(s.blas, options.fp8_projections,
                                                    options.fp8_projections && deepgemm);
  s.fp8_weight_cache = options.fp8_weight_cache;
  s.fp8_weight_gradients = s.fp8 && options.fp8_weight_gradients;
  s.fp8_padded_rows = s.fp8 && deepgemm;
  s.padded_rows = s.fp8_padded_rows || bf16_deepgemm;
  MOE_CHECK(!s.padded_rows || options.expert_exchange == nullptr,
            "training.{}_gemm_backend = deepgemm pads the rows of a local dispatch: not with expert parallelism",
            s.fp8 ? "fp8" : "bf16");
  s.fp8_column_b_scales = options.fp8_weight_gradient_scales == Fp8ColumnScales::Block128x128
                              ? fp8::ColumnScales::Block
                              : fp8::ColumnScales::PerFeature;
  MOE_CHECK(!s.fp8 || (config.dim % 128 == 0 && config.moe.expert_hidden % 128 == 0),
            "training.precision = fp8 needs model.dim ({}) and moe.expert_hidden ({}) to be multiples of 128",
            config.dim, config.moe.expert_hidden);
  s.ep = options.expert_exchange;
  const int64_t E = config.moe.n_experts, P = s.ep ? s.ep->size() : 1;
  MOE_CHECK(!s.ep || (E > 0 && E % P == 0),
            "expert parallelism over {} GPUs needs moe.n_experts ({}) to be a multiple of it", P, E);
  s.embedding = lookup(params, "embedding");
  s.final_norm = lookup(params, "final_norm");
  s.head = lookup(params, config.tie_embeddings ? "embedding" : "lm_head");
  s.layers.resize(static_cast<size_t>(config.n_layers));
  for (int64_t l = 0; l < config.n_layers; ++l) {
    Layer& layer = s.layers[static_cast<size_t>(l)];
    const std::string p = "layers." + std::to_string(l);
    layer.norm1 = lookup(params, p + ".attn_norm");
    layer.norm2 = lookup(params, p + ".ffn_norm");
    layer.wq = lookup(params, p + ".attn.wq");
    layer.wk = lookup(params, p + ".attn.wk");
    layer.wv = lookup(params, p + ".attn.wv");
    // One fused q|k|v projection (gpu_attention.cpp) reads [wq; wk; wv] as one matrix.
    MOE_CHECK(layer.wk.offset == layer.wq.offset + layer.wq.numel &&
                  layer.wv.offset == layer.wk.offset + layer.wk.numel,
              "GPU model: {}.attn.wq, wk and wv must lie back to back in the parameter store", p);
    layer.wo = lookup(params, p + ".attn.wo");
    layer.is_moe = l >= config.first_dense_layers;
    layer.moe_index = layer.is_moe ? static_cast<int>(l - config.first_dense_layers) : -1;
    if (layer.is_moe) {
      layer.router_w = lookup(params, p + ".moe.router.weight");
      if (config.moe.router_bias) layer.router_b = lookup(params, p + ".moe.router.bias");  // else id -1
      layer.w1 = lookup(params, p + ".moe.experts.w1");
      layer.w3 = lookup(params, p + ".moe.experts.w3");
      layer.w2 = lookup(params, p + ".moe.experts.w2");
      for (int64_t e = 0; e < config.moe.n_shared_experts; ++e) {
        const std::string sp = p + ".moe.shared." + std::to_string(e);
        layer.shared.push_back({lookup(params, sp + ".w1"), lookup(params, sp + ".w3"), lookup(params, sp + ".w2")});
      }
      layer.load = Buffer<int64_t>(static_cast<size_t>(config.moe.n_experts));
      layer.load.fill_bytes(0);
      layer.routing = Buffer<double>(static_cast<size_t>(config.moe.n_experts + 2));
      layer.routing.fill_bytes(0);
      layer.balance_bias = Buffer<float>(static_cast<size_t>(config.moe.n_experts));
      layer.balance_bias.fill_bytes(0);
      layer.router_temperature = Buffer<float>(1);
      const auto temperature = static_cast<float>(config.moe.temperature);
      layer.router_temperature.upload(&temperature, 1);
      s.set_slots(layer, equal_expert_slots(E, static_cast<int>(P), s.split_experts));
    } else {
      layer.dense = {lookup(params, p + ".ffn.w1"), lookup(params, p + ".ffn.w3"), lookup(params, p + ".ffn.w2")};
    }
  }
  // The expert groups (optim/cuda/gpu_optimizer.h's per-expert slices) are the MoE
  // layers', in order.
  for (size_t l = 0; l < s.layers.size(); ++l)
    if (s.layers[l].is_moe) s.expert_group_layer.push_back(l);
  // The router biases are added to the fp32 logits, so the forward pass reads them in fp32.
  const std::vector<int> fp32_ids = fp32_copy_ids(params);
  // Our own stream (blocking: ordered with the legacy-stream copies of DeviceArray), so
  // that the step can be captured as a CUDA graph.
  MOE_CUDA_CHECK(cudaStreamCreate(&s.stream));
  // Expert parallelism: memory for this rank's experts only (its window's slots).
  const RangeList resident = s.ep ? resident_ranges(expert_layout(), s.ep_rank(), params.storage_numel()) : RangeList{};
  MOE_CHECK(!options.bf16_expert_grads || !s.ep, "bf16 expert gradients: not with expert parallelism");
  s.store = std::make_unique<GpuParameterStore>(params, options.moments, fp32_ids, s.stream, resident,
                                                options.bf16_expert_grads);
  if (options.interleave_gate_up && bf16_deepgemm) s.interleave_gate_up();
  s.swiglu_in_gemm = options.swiglu_in_gemm && s.gate_up_interleaved && swiglu_in_gemm_fits(config.moe.expert_hidden);
  s.attention.set_dq(options.attention_dq);
  s.attention.set_query_chunks(options.attention_query_chunks);
  if (s.ep) s.ep->set_stream(s.stream);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  routing_.reset(new Routing(s));
}

void GpuTransformer::State::interleave_gate_up() {
  if (ep) return;
  std::vector<std::pair<Range, Range>> w1_w3;
  for (const Layer& layer : layers)
    if (layer.is_moe) w1_w3.push_back({{layer.w1.offset, layer.w1.numel}, {layer.w3.offset, layer.w3.numel}});
  std::vector<HiInterleave> pairs = gate_up_pairs(w1_w3, config.moe.n_experts);  // the memory planner's too
  if (pairs.empty()) return;
  store->interleave_hi(std::move(pairs));
  gate_up_interleaved = true;
}

GpuTransformer::~GpuTransformer() = default;

void GpuTransformer::plan(int64_t batch) {
  State& s = *state_;
  const ModelConfig& c = s.config;
  const int64_t S = c.seq_len, D = c.dim, V = c.vocab_size, H = c.n_heads, G = c.n_kv_heads, d = c.head_dim();
  const int64_t T = batch * S, E = c.moe.n_experts, K = c.moe.top_k, F = c.moe.expert_hidden;
  s.batch = batch;
  s.tokens = T;
  // Expert parallelism over P ranks (the dispatcher sizes the exchange). A rank computes
  // E / P experts, or up to the re-placement's maximum (model/gpu_buffer_sizes.h, which
  // the memory planner reads too).
  const ExpertRowBounds bounds = expert_row_bounds(c.moe, T, s.ep ? s.ep->size() : 1, s.split_experts,
                                                   s.local_experts_cap, s.expert_row_align());
  const int64_t capacity = bounds.capacity;
  s.max_rows = bounds.max_rows;
  const int64_t R = s.max_rows;
  if (s.ep) {
    MOE_CHECK(s.recompute_experts == ExpertRecompute::None,
              "expert parallelism on the GPU needs training.recompute_experts = none");
  }
  const int64_t max_local = bounds.max_local_experts;
  // The dispatcher's scratch first: it says how many rows the local experts may get.
  s.dispatcher.reset();
  const auto mark = [&s](int phase) { s.mark(phase); };
  s.dispatcher = s.ep ? make_expert_parallel_dispatcher(s.ep, s.stream, mark) : make_local_dispatcher(s.stream, mark);
  s.max_local_rows = s.dispatcher->plan(
      DispatchShape{T, D, K, E, R, capacity, s.ep ? max_local : E, s.ep && s.split_experts,
                    s.ep && c.moe.speculative_dispatch, s.expert_row_align()});
  const int64_t RL = s.max_local_rows;
  if (E > 0 && (!s.expert_gemm || s.max_local_experts != max_local)) {
    MOE_CHECK(D % 8 == 0 && F % 8 == 0, "the GPU experts need dim ({}) and moe.expert_hidden ({}) to be multiples of 8",
              D, F);
    s.expert_gemm = std::make_unique<cuda::ExpertGemm>(max_local);
    s.expert_gemm->set_sm_limit(s.compute_sm_limit);
    if (s.fp8) {
      s.expert_gemm_fp8 = std::make_unique<cuda::ExpertGemmFp8>(max_local);
      s.expert_gemm_fp8->set_sm_limit(s.compute_sm_limit);
    }
    if (s.fp8_padded_rows) s.padded_expert_gemm_fp8 = std::make_unique<cuda::PaddedExpertGemmFp8>(max_local);
    if (s.padded_rows && !s.fp8) s.padded_expert_gemm_bf16 = std::make_unique<cuda::PaddedExpertGemmBf16>(max_local);
    if (s.fp8_weight_gradients) {
      s.expert_weight_gemm_fp8 = std::make_unique<cuda::ExpertWeightGemmFp8>(max_local);
      s.expert_weight_gemm_fp8->set_sm_limit(s.compute_sm_limit);
    }
  }
  s.max_local_experts = max_local;
  s.combine_in_norm = combine_in_next_norm(s.ep != nullptr, c.moe.n_shared_experts);
  auto bf = [](int64_t n) { return Buffer<bf16>(static_cast<size_t>(n)); };
  auto f32 = [](int64_t n) { return Buffer<float>(static_cast<size_t>(n)); };
  auto i32 = [](int64_t n) { return Buffer<int32_t>(static_cast<size_t>(n)); };
  const size_t n_shared_experts = static_cast<size_t>(c.moe.n_shared_experts);
  // An expert rows buffer of its own, or the one shared by the MoE layers (recompute_experts).
  SharedRows shared_x_rows, shared_gate_up_rows, shared_act_rows;
  auto rows_buffer = [&](SharedRows& shared_one, int64_t n, bool shared) {
    if (!shared) return std::make_shared<Buffer<bf16>>(bf(n));
    if (!shared_one) shared_one = std::make_shared<Buffer<bf16>>(bf(n));
    return shared_one;
  };
  // Dense and/or MoE buffers of one block's activations; `shared_x_act`: the expert rows
  // are the MoE layers' shared ones (recompute_experts).
  auto allocate = [&](Activations& a, bool dense, bool moe, bool shared_x_act) {
    a.n1 = bf(T * D);
    a.h = bf(T * D);
    a.n2 = bf(T * D);
    if (dense || (moe && !s.combine_in_norm)) a.ffn_out = bf(T * D);
    a.rstd1 = f32(T);
    a.rstd2 = f32(T);
    a.attn = {bf(T * c.qkv_width()), bf(T * H * d), f32(batch * H * S)};
    if (dense) a.dense_buffers = {bf(T * 2 * c.dense_hidden), bf(T * c.dense_hidden)};
    if (!moe) return;
    MoEBuffers& m = a.moe;
    m.logits = f32(T * E);
    m.scores = f32(T * E);
    m.weight = f32(T * K);
    m.aux_term = f32(T);
    m.z_term = f32(T);
    m.expert = i32(T * K);
    m.row = i32(T * K);
    m.counts = i32(E);
    m.assign_counts = i32(E);
    m.offsets = i32(E + 1);
    m.token_of_row = i32(std::max(T * K, R));  // padded rows (padded_rows): R may exceed T * K
    m.rank = i32(cuda::assign_rows_scratch(T, K, E));
    m.slot = i32(T * K);
    m.x_rows = rows_buffer(shared_x_rows, RL * D, shared_x_act);
    m.gate_up_rows =
        rows_buffer(shared_gate_up_rows, RL * 2 * F, shared_x_act && s.recompute_experts == ExpertRecompute::All);
    // fp8 weight gradients: the backward takes act from gate|up itself (swiglu_backward_fp8_columns)
    // and the forward writes only act's codes, so no act buffer.
    m.act_rows = s.fp8_weight_gradients ? std::make_shared<Buffer<bf16>>()
                                        : rows_buffer(shared_act_rows, RL * F, shared_x_act);
    m.y_rows = bf(std::max(R, RL) * D);  // under expert parallelism: the local rows
    s.dispatcher->plan_layer(m);
    m.shared.clear();
    for (size_t e = 0; e < n_shared_experts; ++e) m.shared.push_back({bf(T * 2 * F), bf(T * F)});
  };
  // Old buffers go first, so that a re-plan (a halved micro-batch) does not hold both.
  for (Layer& layer : s.layers) {
    layer.x = Buffer<bf16>();
    layer.act.reset();
  }
  const int64_t n_layers = static_cast<int64_t>(s.layers.size());
  const int64_t recomputed = s.recompute_layers < 0 ? n_layers : std::min(s.recompute_layers, n_layers);
  bool shared_dense = false, shared_moe = false;
  for (int64_t l = 0; l < n_layers; ++l) {
    Layer& layer = s.layers[static_cast<size_t>(l)];
    layer.recompute = l < recomputed;
    if (layer.recompute) (layer.is_moe ? shared_moe : shared_dense) = true;
    layer.recompute_expert_rows =
        layer.is_moe && shares_expert_rows(s.recompute_experts != ExpertRecompute::None, s.recompute_experts_layers,
                                           layer.moe_index);
  }
  // The layers recomputed whole share one set, whose expert rows are the shared ones under
  // recompute_experts.
  std::shared_ptr<Activations> shared;
  if (shared_dense || shared_moe) {
    shared = std::make_shared<Activations>();
    allocate(*shared, shared_dense, shared_moe, s.recompute_experts != ExpertRecompute::None);
  }
  for (Layer& layer : s.layers) {
    layer.x = bf(T * D);
    layer.route_choices = layer.is_moe && c.moe.route_cache ? i32(T * K) : Buffer<int32_t>();
    if (layer.recompute) {
      layer.act = shared;
    } else {
      layer.act = std::make_shared<Activations>();
      allocate(*layer.act, !layer.is_moe, layer.is_moe, layer.recompute_expert_rows);
    }
  }
  s.drop_graphs();  // buffers moved
  const int64_t ffn_width = std::max(F, c.dense_hidden);
  s.inputs = i32(T);
  s.targets = i32(T);
  s.positions = i32(T);
  s.final_x = bf(T * D);
  s.final_n = bf(T * D);
  // ~256 MB of fp32 logits per chunk, in row blocks of 128 for the GEMM's tiles.
  s.head_chunk_rows = lm_head_chunk_rows(T, V);
  s.head_logits_chunk = f32(s.head_chunk_rows * V);
  s.final_rstd = f32(T);
  s.loss = f32(T);
  s.sums = f32(1 + 2 * static_cast<int64_t>(s.layers.size()));
  s.kept_rows = i32(static_cast<int64_t>(s.layers.size()));
  s.routing_scratch = Buffer<double>(static_cast<size_t>(cuda::routing_stats_scratch(T)));
  s.dres = bf(T * D);
  s.dnorm = bf(T * D);
  s.dqkv = bf(T * c.qkv_width());
  s.dattn = bf(T * H * d);
  // dlogits_head, the MoE backward's row gradients and cuDNN's workspace in one allocation
  // (State::shared_scratch): the largest of the three, not their sum.
  const SharedScratchSizes scratch = shared_scratch_sizes(T, V, D, F, std::max(R, RL), RL, !s.swiglu_in_gemm);
  const size_t attention_bytes = s.attention.workspace_bytes(batch, S, H, G, d, attention_scale(d),
                                                             c.qkv_width(), c.qkv_width());
  s.attention.use_workspace(nullptr, 0);  // the old scratch goes before the new one comes
  s.shared_scratch = Buffer<char>();
  s.shared_scratch = Buffer<char>(std::max({static_cast<size_t>(scratch.bytes()), attention_bytes, size_t{256}}));
  char* base = s.shared_scratch.data();
  auto span = [&](int64_t offset, int64_t count) {
    return std::span<bf16>(reinterpret_cast<bf16*>(base + offset), static_cast<size_t>(count));
  };
  s.dlogits_head = span(0, scratch.dlogits_head);
  s.drows = span(0, scratch.drows);
  s.dact_rows = span(scratch.dact_at, scratch.dact);
  s.dgate_up_rows = span(scratch.dgate_up_at, scratch.dgate_up);
  s.dx_rows = span(scratch.dx_at, scratch.dx);
  s.attention.use_workspace(base, s.shared_scratch.size());
  if (s.fp8 && E > 0) {
    // One or two operands' rows; the layers' quantised weights, or scratch for two of the local
    // experts' weight tensors (gate and up) at a time.
    const int64_t width = fp8_expert_row_width(D, F);
    s.fp8_rows = Buffer<uint8_t>(static_cast<size_t>(RL * width));
    s.fp8_row_scales = f32(RL * width / 128);
    if (s.fp8_weight_cache) {
      s.allocate_fp8_expert_weights(max_local);
    } else {
      s.fp8_weights = Buffer<uint8_t>(static_cast<size_t>(2 * max_local * D * F));
      s.fp8_weight_scales = f32(2 * max_local * fp8::blocks(D) * fp8::blocks(F));
    }
    if (s.fp8_weight_gradients) {
      const Fp8TokenColumnSizes columns = fp8_token_column_sizes(RL, max_local, D, F);  // what moe plan counts
      s.fp8_ld_t = columns.ld_t;
      s.fp8_columns = Buffer<uint8_t>(static_cast<size_t>(columns.codes));
      s.fp8_column_scales = f32(columns.scales);
      s.fp8_padded_offsets = Buffer<int64_t>(static_cast<size_t>(max_local + 1));
    }
  }
  s.projections->plan(c, T);
  s.dlogits_bf16 = bf(T * E);
  s.dffn_act = bf(T * ffn_width);
  s.dffn_gate_up = bf(T * 2 * ffn_width);
  s.dweight = f32(T * K);
  s.dlogits = f32(T * E);
  s.column_partial = f32(cuda::column_sums_partial_count(T, E));  // the router bias gradient's
  s.norm_partial = f32(cuda::rmsnorm_backward_partial_rows(T) * D);
  s.embedding_scratch = Buffer<char>(cuda::embedding_backward_scratch_bytes(T));
  std::vector<int32_t> positions(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i) positions[static_cast<size_t>(i)] = static_cast<int32_t>(i % S);
  s.positions.upload(positions.data(), positions.size());
  s.rope_cos_sin = f32(S * d);
  cuda::rope_table(s.rope_cos_sin.data(), S, d, static_cast<float>(c.rope_theta), s.stream);
}


void GpuTransformer::State::ffn_forward(bf16* y, const bf16* x, const bf16* w1, const bf16* w3, const bf16* w2,
                                        FfnBuffers& buffers, int64_t rows, int64_t F, bool accumulate) {
  const int64_t D = config.dim;
  // gate and up side by side in one [rows, 2F] buffer, as the SwiGLU kernel reads them.
  projection(buffers.gate_up.data(), x, w1, rows, D, F, false, 2 * F);
  projection(buffers.gate_up.data() + F, x, w3, rows, D, F, false, 2 * F);
  cuda::swiglu_forward(buffers.act.data(), buffers.gate_up.data(), rows, F, stream);
  projection(y, buffers.act.data(), w2, rows, F, D, accumulate);
}

void GpuTransformer::State::ffn_backward(bf16* dx, const bf16* dy, const bf16* x, const std::array<Param, 3>& p,
                                         FfnBuffers& buffers, int64_t rows, int64_t F, bool accumulate_dx) {
  const int64_t D = config.dim;
  projection_backward(dffn_act.data(), g(p[2]), dy, buffers.act.data(), w(p[2]), rows, F, D, false);
  cuda::swiglu_backward(dffn_gate_up.data(), dffn_act.data(), buffers.gate_up.data(), rows, F, stream);
  projection_backward(dx, g(p[0]), dffn_gate_up.data(), x, w(p[0]), rows, D, F, accumulate_dx, 2 * F);
  projection_backward(dx, g(p[1]), dffn_gate_up.data() + F, x, w(p[1]), rows, D, F, true, 2 * F);
}

void GpuTransformer::State::check_and_upload_inputs(const int32_t* inputs_BS, const int32_t* targets_BS) {
  MOE_CHECK(batch > 0, "GPU forward before plan()");
  const int64_t T = tokens, V = config.vocab_size;
  for (int64_t i = 0; i < T; ++i) {
    MOE_CHECK(inputs_BS[i] >= 0 && inputs_BS[i] < V, "token id {} at position {} is outside [0, {})", inputs_BS[i], i, V);
    MOE_CHECK(targets_BS[i] >= -1 && targets_BS[i] < V, "target {} at position {} is outside [-1, {})", targets_BS[i],
              i, V);
  }
  // Synchronous copies: the previous step's kernels are done reading these buffers.
  inputs.upload(inputs_BS, static_cast<size_t>(T));
  host_inputs = inputs_BS;  // read by a speculating forward's guesses while it is enqueued
  targets.upload(targets_BS, static_cast<size_t>(T));
  n_valid = 0;
  for (int64_t i = 0; i < T; ++i) n_valid += targets_BS[i] >= 0;
}

void GpuTransformer::State::layer_forward(size_t l, const bf16* prev_h, const cuda::ResidualBranch& prev_branch,
                                          bool from_saved_input) {
  const ModelConfig& c = config;
  const int64_t T = tokens, D = c.dim;
  const float eps = static_cast<float>(c.norm_eps);
  Layer& layer = layers[l];
  Activations& a = *layer.act;
  mark(kNorms);
  // x_l = h_{l-1} + ffn_out_{l-1}, fused with the norm (unless from the saved input), which
  // sums the experts' rows itself where the last layer left it its combine. fp8: the norm
  // also writes n1's codes for the q|k|v projection's GEMM.
  bf16* residual_out = from_saved_input ? nullptr : layer.x.data();
  const bf16* x_in = from_saved_input ? layer.x.data() : prev_h;
  const cuda::ResidualBranch branch = from_saved_input ? cuda::ResidualBranch{} : prev_branch;
  const cuda::RowCodes n1_codes = projections->forward_row_codes(T, D, qkv_width(), qkv_width());
  if (n1_codes.codes_RK)
    cuda::rmsnorm_forward_fp8(a.n1.data(), n1_codes, a.rstd1.data(), residual_out, x_in, branch, w(layer.norm1), T, D,
                              eps, stream);
  else
    cuda::rmsnorm_forward(a.n1.data(), a.rstd1.data(), residual_out, x_in, branch, w(layer.norm1), T, D, eps, stream);
  mark(kAttention);
  // The attention output goes through dnorm (free here, also during the backward).
  attention_forward(layer, dnorm.data(), n1_codes.codes_RK != nullptr);
  mark(kNorms);
  cuda::rmsnorm_forward(a.n2.data(), a.rstd2.data(), a.h.data(), layer.x.data(), dnorm.data(), w(layer.norm2), T, D,
                        eps, stream);
  if (layer.is_moe) {
    // A recomputed forward must not count its tokens per expert twice.
    moe_forward(layer, l, /*count_load=*/!recomputing);
  } else {
    mark(kDenseFfn);
    ffn_forward(a.ffn_out.data(), a.n2.data(), w(layer.dense[0]), w(layer.dense[1]), w(layer.dense[2]),
                a.dense_buffers, T, c.dense_hidden, false);
    a.ffn_branch = a.ffn_out.data();
  }
}

void GpuTransformer::State::enqueue_forward() {
  const ModelConfig& c = config;
  const int64_t T = tokens, D = c.dim, V = c.vocab_size;
  const float eps = static_cast<float>(c.norm_eps);
  const bf16* prev_h = nullptr;
  cuda::ResidualBranch prev_branch;
  const int n_layers = static_cast<int>(layers.size());
  const auto before_stage = [&](int stage) {
    if (forward_stage_hook && !capturing) forward_stage_hook(stage);
  };
  for (size_t l = 0; l < layers.size(); ++l) {
    if (l == 0) {
      before_stage(n_layers + 1);
      mark(kEmbedding);
      cuda::embedding_forward(layers[0].x.data(), inputs.data(), w(embedding), T, V, D, stream);
    }
    before_stage(n_layers - static_cast<int>(l));
    const NvtxRange range("layer " + std::to_string(l) + " forward");
    layer_forward(l, prev_h, prev_branch, /*from_saved_input=*/l == 0);
    prev_h = layers[l].act->h.data();
    prev_branch = layers[l].act->ffn_branch;
  }
  before_stage(0);
  mark(kNorms);
  cuda::rmsnorm_forward(final_n.data(), final_rstd.data(), final_x.data(), prev_h, prev_branch, w(final_norm), T, D,
                        eps, stream);
  mark(kHeadLoss);
  const float inv_valid = 1.0f / static_cast<float>(std::max<int64_t>(1, n_valid));
  for (int64_t first = 0; first < T; first += head_chunk_rows) {
    const int64_t rows = std::min(head_chunk_rows, T - first);
    blas.gemm(false, true, rows, V, D, 1.0f, final_n.data() + first * D, D, w(head), D, 0.0f, head_logits_chunk.data(),
              /*c_is_fp32=*/true, V, stream);
    cuda::cross_entropy_fused(loss.data() + first, dlogits_head.data() + first * V, head_logits_chunk.data(),
                              targets.data() + first, rows, V, inv_valid, stream);
  }
  cuda::ordered_sum(sums.data(), loss.data(), T, inv_valid, stream);
}

ForwardResult GpuTransformer::State::read_forward_results() {
  const int64_t T = tokens;
  // The one host synchronisation of the forward: the losses and the kept rows per layer.
  std::vector<float> host_sums(sums.size());
  std::vector<int32_t> kept(kept_rows.size());
  MOE_CUDA_CHECK(cudaMemcpyAsync(host_sums.data(), sums.data(), host_sums.size() * sizeof(float),
                                 cudaMemcpyDeviceToHost, stream));
  MOE_CUDA_CHECK(cudaMemcpyAsync(kept.data(), kept_rows.data(), kept.size() * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                 stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  mark(kHost);
  ForwardResult result;
  result.ce_loss = host_sums[0];
  for (size_t l = 0; l < layers.size(); ++l) {
    if (!layers[l].is_moe) continue;
    if (config.moe.aux_loss_coef > 0) result.aux_loss += host_sums[1 + 2 * l];
    if (config.moe.z_loss_coef > 0) result.z_loss += host_sums[2 + 2 * l];
    result.dropped += T * config.moe.top_k - kept[l];
  }
  return result;
}

ForwardResult GpuTransformer::forward(const int32_t* inputs_BS, const int32_t* targets_BS) {
  State& s = *state_;
  s.check_and_upload_inputs(inputs_BS, targets_BS);
  s.enqueue_forward();
  return s.read_forward_results();
}

void GpuTransformer::State::layer_backward(size_t l, double loss_scale) {
  const ModelConfig& c = config;
  const int64_t T = tokens, D = c.dim;
  Layer& layer = layers[l];
  if (layer.recompute) {
    const NvtxRange range("recompute");
    recomputing = true;
    layer_forward(l, nullptr, {}, /*from_saved_input=*/true);
    recomputing = false;
  }
  Activations& a = *layer.act;
  // dres = d(block output) = d(h + ffn_out): the FFN branch, then the norm adds d h.
  if (layer.is_moe) {
    moe_backward(layer, loss_scale);
  } else {
    mark(kDenseFfn);
    ffn_backward(dnorm.data(), dres.data(), a.n2.data(), layer.dense, a.dense_buffers, T, c.dense_hidden, false);
  }
  mark(kNorms);
  cuda::rmsnorm_backward(dres.data(), g(layer.norm2), dnorm.data(), dres.data(), a.h.data(), w(layer.norm2),
                         a.rstd2.data(), T, D, norm_partial.data(), stream);
  mark(kAttention);
  attention_backward(layer, dnorm.data(), dres.data());
  mark(kNorms);
  cuda::rmsnorm_backward(dres.data(), g(layer.norm1), dnorm.data(), dres.data(), layer.x.data(), w(layer.norm1),
                         a.rstd1.data(), T, D, norm_partial.data(), stream);
}

void GpuTransformer::State::enqueue_backward(double loss_scale, const std::function<void(int)>& on_stage) {
  const ModelConfig& c = config;
  const int64_t T = tokens, D = c.dim, V = c.vocab_size;
  // The forward left the gradient of the mean loss in dlogits_head; loss_scale is dloss.
  mark(kHeadLoss);
  linear_backward(dnorm.data(), g(head), dlogits_head.data(), final_n.data(), w(head), T, D, V, false, -1,
                  static_cast<float>(loss_scale));
  mark(kNorms);
  cuda::rmsnorm_backward(dres.data(), g(final_norm), dnorm.data(), nullptr, final_x.data(), w(final_norm),
                         final_rstd.data(), T, D, norm_partial.data(), stream);
  const int n_layers = static_cast<int>(layers.size());
  if (on_stage) on_stage(0);
  for (int l = n_layers; l-- > 0;) {
    {
      const NvtxRange range("layer " + std::to_string(l) + " backward");
      layer_backward(static_cast<size_t>(l), loss_scale);
    }
    if (on_stage) on_stage(n_layers - l);
  }
  mark(kEmbedding);
  cuda::embedding_backward(g(embedding), inputs.data(), dres.data(), T, V, D, embedding_scratch.data(),
                           embedding_scratch.size(), stream);
  if (on_stage) on_stage(n_layers + 1);
  overwrite_grads = false;  // the next micro-batch adds to the gradients
}

void GpuTransformer::backward(double loss_scale, const std::function<void(int stage)>& on_stage) {
  State& s = *state_;
  s.enqueue_backward(loss_scale, on_stage);
  MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  s.mark(kHost);
}

ForwardResult GpuTransformer::forward_backward(const int32_t* inputs_BS, const int32_t* targets_BS,
                                               double loss_scale) {
  State& s = *state_;
  s.check_and_upload_inputs(inputs_BS, targets_BS);
  if (!s.graphs) {
    s.enqueue_forward();
    s.enqueue_backward(loss_scale);
    return s.read_forward_results();
  }
  if (!s.graph_warm) {
    // The first step after plan() runs eagerly: cuDNN, cuBLASLt and CUTLASS set up their
    // plans and workspaces there, which must not happen inside a capture.
    s.enqueue_forward();
    s.enqueue_backward(loss_scale);
    s.graph_warm = true;
    return s.read_forward_results();
  }
  // fp8: the experts' quantised weights are made outside the graph, on the same stream.
  s.refresh_fp8_expert_weights();
  // The step's first micro-batch writes the expert gradients (beta 0): a graph of its own.
  State::Graph& graph = s.graph[s.overwrite_grads ? 1 : 0];
  if (!graph.exec || graph.n_valid != s.n_valid || graph.loss_scale != loss_scale) {
    // (Re)capture: the number of valid targets and the loss scale are kernel arguments.
    if (graph.exec) MOE_CUDA_CHECK(cudaGraphExecDestroy(graph.exec));
    graph.exec = nullptr;
    cudaGraph_t captured = nullptr;
    MOE_CUDA_CHECK(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeRelaxed));
    s.capturing = true;  // no host hooks: the graph replays without them
    s.enqueue_forward();
    s.enqueue_backward(loss_scale);
    s.capturing = false;
    MOE_CUDA_CHECK(cudaStreamEndCapture(s.stream, &captured));
    MOE_CUDA_CHECK(cudaGraphInstantiate(&graph.exec, captured, 0));
    MOE_CUDA_CHECK(cudaGraphDestroy(captured));
    graph.n_valid = s.n_valid;
    graph.loss_scale = loss_scale;
  } else {
    s.overwrite_grads = false;  // what enqueue_backward does when capturing
  }
  MOE_CUDA_CHECK(cudaGraphLaunch(graph.exec, s.stream));
  return s.read_forward_results();
}

void GpuTransformer::enable_graphs(bool enabled) {
  MOE_CHECK(!(enabled && state_->ep), "CUDA graphs cannot hold the GPU's expert parallelism (it waits for row counts)");
  state_->graphs = enabled;
}

void GpuTransformer::set_forward_stage_hook(std::function<void(int stage)> hook) {
  state_->forward_stage_hook = std::move(hook);
}

void GpuTransformer::reserve_sms(int sms) {
  State& s = *state_;
  MOE_CHECK(sms <= 0 || !s.padded_rows,
            "training.{}_gemm_backend = deepgemm runs on every multiprocessor: it cannot leave {} to communication",
            s.fp8 ? "fp8" : "bf16", sms);
  s.compute_sm_limit = sms > 0 ? std::max(1, gpu::multiprocessor_count() - sms) : 0;
  s.blas.set_sm_limit(s.compute_sm_limit);
  if (s.expert_gemm) s.expert_gemm->set_sm_limit(s.compute_sm_limit);
  if (s.expert_gemm_fp8) s.expert_gemm_fp8->set_sm_limit(s.compute_sm_limit);
  if (s.expert_weight_gemm_fp8) s.expert_weight_gemm_fp8->set_sm_limit(s.compute_sm_limit);
  s.projections->set_sm_limit(s.compute_sm_limit);
}


GpuParameterStore& GpuTransformer::parameters() { return *state_->store; }
bool GpuTransformer::swiglu_in_gemm() const { return state_->swiglu_in_gemm; }

void* GpuTransformer::stream() const { return state_->stream; }

// Host copies are in expert order: re-placed layers' tensors are put back from slot order.
void GpuTransformer::download_grads(ParameterStore<float>& params) const {
  moe::download_grads(*state_->store, params);
  state_->reorder_experts([&](const Param& p) { return params.grad(p.id); }, /*to_expert_order=*/true);
}

void GpuTransformer::download_params(ParameterStore<float>& params) {
  State& s = *state_;
  moe::download_params(*s.store, params);
  s.gather_other_experts(params, nullptr, nullptr);
  s.reorder_experts([&](const Param& p) { return params.value(p.id); }, /*to_expert_order=*/true);
}

void GpuTransformer::download_state(ParameterStore<float>& params, std::vector<float>& m, std::vector<float>& v) {
  State& s = *state_;
  moe::download_state(*s.store, params, m, v);
  s.gather_other_experts(params, &m, &v);
  s.reorder_experts([&](const Param& p) { return params.value(p.id); }, /*to_expert_order=*/true);
  const std::vector<int64_t> packed = packed_offsets(params);
  for (std::vector<float>* moment : {&m, &v})
    s.reorder_experts([&](const Param& p) { return moment->data() + packed[static_cast<size_t>(p.id)]; },
                      /*to_expert_order=*/true);
}

void GpuTransformer::upload_state(const ParameterStore<float>& params, const std::vector<float>& m,
                                  const std::vector<float>& v) {
  State& s = *state_;
  const bool placed = std::any_of(s.layers.begin(), s.layers.end(), [](const Layer& layer) { return layer.placed; });
  if (!placed) {
    moe::upload_state(*s.store, params, m, v);
    return;
  }
  // Given in expert order: into the current placement's slots on the host first, so that
  // each rank uploads only the slots it holds.
  ParameterStore<float> slotted = params;
  std::vector<float> m_slotted = m, v_slotted = v;
  s.reorder_experts([&](const Param& p) { return slotted.value(p.id); }, /*to_expert_order=*/false);
  const std::vector<int64_t> packed = packed_offsets(params);
  for (std::vector<float>* moment : {&m_slotted, &v_slotted})
    s.reorder_experts([&](const Param& p) { return moment->data() + packed[static_cast<size_t>(p.id)]; },
                      /*to_expert_order=*/false);
  moe::upload_state(*s.store, slotted, m_slotted, v_slotted);
}

void GpuTransformer::set_phase_clock(gpu::PhaseClock* clock) { state_->clock = clock; }

}  // namespace moe

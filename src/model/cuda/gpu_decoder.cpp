#include "model/cuda/gpu_decoder.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <map>

#include "core/error.h"
#include "core/gpu.h"
#include "model/cuda/decode_kernels.h"
#include "moe/dispatch.h"
#include "moe/router.h"

namespace moe {

struct GpuDecoder::State {
  const Transformer<float>& model;
  const ModelConfig& c;
  cuda::Stream stream = nullptr;
  std::map<std::string, gpu::DeviceArray<float>> weights;  // every parameter, fp32
  std::vector<gpu::DeviceArray<float>> keys, values;      // per layer [S, G, d]
  gpu::DeviceArray<int32_t> ids, rows;
  gpu::DeviceArray<float> x, h, normed, q, attn, logits_E, y, gate, up, act, xe, ye, row_weight, logits_V;
  std::vector<float> host_logits_V;
  int64_t length = 0;
  std::string name;

  State(const Transformer<float>& m) : model(m), c(m.config()) {}
  ~State() {
    if (stream) cudaStreamDestroy(stream);
  }
  const float* w(const std::string& param) const {
    auto it = weights.find(param);
    MOE_CHECK(it != weights.end(), "GPU decoder: no parameter '{}'", param);
    return it->second.data();
  }
  const float* maybe(const std::string& param) const {
    auto it = weights.find(param);
    return it == weights.end() ? nullptr : it->second.data();
  }
  // out (+)= SwiGLU FFN of in over n rows: w1, w3 [F, D], w2 [D, F].
  void ffn(float* out, const float* in, int64_t n, int64_t F, const float* w1, const float* w3, const float* w2,
           bool accumulate) {
    const int64_t D = c.dim;
    cuda::decode_linear(gate.data(), in, w1, nullptr, n, D, F, false, stream);
    cuda::decode_linear(up.data(), in, w3, nullptr, n, D, F, false, stream);
    cuda::decode_silu_mul(act.data(), gate.data(), up.data(), n * F, stream);
    cuda::decode_linear(out, act.data(), w2, nullptr, n, F, D, accumulate, stream);
  }
  void moe(int64_t layer, size_t moe_index, float* out, const float* in, int64_t n);
};

GpuDecoder::GpuDecoder(const Transformer<float>& model) : s_(std::make_unique<State>(model)) {
  State& s = *s_;
  const ModelConfig& c = s.c;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
  const auto& params = model.params();
  for (int id = 0; id < params.size(); ++id) {
    gpu::DeviceArray<float> a(static_cast<size_t>(params.numel(id)));
    a.upload(params.value(id), static_cast<size_t>(params.numel(id)));
    s.weights.emplace(params.spec(id).name, std::move(a));
  }
  const int64_t S = c.seq_len, D = c.dim, G = c.n_kv_heads, d = c.head_dim(), H = c.n_heads;
  const int64_t E = c.moe.n_experts, K = c.moe.top_k;
  const int64_t F = std::max({c.moe.expert_hidden, c.dense_hidden, int64_t{1}});
  for (int64_t l = 0; l < c.n_layers; ++l) {
    s.keys.emplace_back(static_cast<size_t>(S * G * d));
    s.values.emplace_back(static_cast<size_t>(S * G * d));
  }
  auto f = [](int64_t count) { return gpu::DeviceArray<float>(static_cast<size_t>(std::max<int64_t>(count, 1))); };
  s.ids = gpu::DeviceArray<int32_t>(static_cast<size_t>(S));
  s.rows = gpu::DeviceArray<int32_t>(static_cast<size_t>(S * K));
  s.x = f(S * D), s.h = f(S * D), s.normed = f(S * D), s.y = f(S * D);
  s.q = f(S * H * d), s.attn = f(S * H * d);
  s.logits_E = f(S * E), s.row_weight = f(S * K);
  s.gate = f(S * F), s.up = f(S * F), s.act = f(S * F);
  s.xe = f(S * D), s.ye = f(S * D);
  s.logits_V = f(c.vocab_size);
  s.host_logits_V.resize(static_cast<size_t>(c.vocab_size));
  int device = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp props{};
  MOE_CUDA_CHECK(cudaGetDeviceProperties(&props, device));
  s.name = fmt::format("{} (GPU {})", props.name, device);
}

GpuDecoder::~GpuDecoder() = default;
int64_t GpuDecoder::context() const { return s_->c.seq_len; }
int64_t GpuDecoder::length() const { return s_->length; }
int64_t GpuDecoder::vocab_size() const { return s_->c.vocab_size; }
void GpuDecoder::reset() { s_->length = 0; }
std::string GpuDecoder::device() const { return s_->name; }

// The experts of MoE layer `layer` for n tokens: routing on the host (the CPU's router
// functions on the device's logits), each expert's tokens gathered, run, and added back
// with their weights; then the shared experts.
void GpuDecoder::State::moe(int64_t layer, size_t moe_index, float* out, const float* in, int64_t n) {
  const MoEConfig& m = c.moe;
  const int64_t D = c.dim, E = m.n_experts, K = m.top_k, F = m.expert_hidden;
  const std::string p = fmt::format("layers.{}.moe", layer);
  cuda::decode_linear(logits_E.data(), in, w(p + ".router.weight"), maybe(p + ".router.bias"), n, D, E, false, stream);
  std::vector<float> logits(static_cast<size_t>(n * E)), scores(logits.size()), weight(static_cast<size_t>(n * K));
  std::vector<int32_t> expert(static_cast<size_t>(n * K));
  MOE_CUDA_CHECK(cudaMemcpyAsync(logits.data(), logits_E.data(), logits.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                 stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  // The layer's own temperature (moe.temperature_control tunes it per layer).
  router_scores_forward<float>(scores.data(), logits.data(), n, E, model.moe_layers()[moe_index]->temperature(),
                               m.score_func);
  const float* bias = m.bias_balancing ? model.moe_layers()[moe_index]->balance_bias_E().data() : nullptr;
  router_select<float>(expert.data(), weight.data(), scores.data(), bias, n, E, K, m.renormalize,
                       RouteGroups{m.route_groups, m.route_top_groups});
  // Rows grouped by expert, tokens in order within each (dropless: capacity n K), as the
  // CPU's forward_dropless lays them out; each row's combine weight beside it.
  std::vector<int32_t> row_nK(expert.size()), counts(static_cast<size_t>(E)), offsets(static_cast<size_t>(E + 1)),
      row_token(expert.size());
  const int64_t R = assign_rows(row_nK.data(), counts.data(), offsets.data(), row_token.data(), expert.data(), n, E, K,
                                /*capacity=*/n * K);
  std::vector<float> row_weight_host(static_cast<size_t>(R));
  for (size_t tk = 0; tk < row_nK.size(); ++tk) row_weight_host[static_cast<size_t>(row_nK[tk])] = weight[tk];
  MOE_CUDA_CHECK(cudaMemcpyAsync(rows.data(), row_token.data(), static_cast<size_t>(R) * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, stream));
  MOE_CUDA_CHECK(cudaMemcpyAsync(row_weight.data(), row_weight_host.data(), row_weight_host.size() * sizeof(float),
                                 cudaMemcpyHostToDevice, stream));
  MOE_CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<size_t>(n * D) * sizeof(float), stream));
  const float *w1 = w(p + ".experts.w1"), *w3 = w(p + ".experts.w3"), *w2 = w(p + ".experts.w2");
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = offsets[static_cast<size_t>(e)], rows_e = offsets[static_cast<size_t>(e + 1)] - begin;
    if (rows_e == 0) continue;
    cuda::decode_gather_rows(xe.data(), in, rows.data() + begin, rows_e, D, stream);
    ffn(ye.data(), xe.data(), rows_e, F, w1 + e * F * D, w3 + e * F * D, w2 + e * D * F, false);
    cuda::decode_scatter_add(out, ye.data(), rows.data() + begin, row_weight.data() + begin, rows_e, D, stream);
  }
  for (int64_t sh = 0; sh < m.n_shared_experts; ++sh) {
    const std::string q = fmt::format("{}.shared.{}", p, sh);
    ffn(out, in, n, F, w(q + ".w1"), w(q + ".w3"), w(q + ".w2"), true);
  }
  // The host vectors above must outlive the copies from them.
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

std::span<const float> GpuDecoder::forward_step(std::span<const int32_t> tokens) {
  State& s = *s_;
  const ModelConfig& c = s.c;
  const auto n = static_cast<int64_t>(tokens.size());
  MOE_CHECK(n > 0 && s.length + n <= c.seq_len, "decoding {} tokens after {} of a {}-position cache", n, s.length,
            c.seq_len);
  for (int64_t i = 0; i < n; ++i)
    MOE_CHECK(tokens[static_cast<size_t>(i)] >= 0 && tokens[static_cast<size_t>(i)] < c.vocab_size,
              "token id {} outside the vocabulary of {}", tokens[static_cast<size_t>(i)], c.vocab_size);
  const int64_t D = c.dim, H = c.n_heads, G = c.n_kv_heads, d = c.head_dim(), start = s.length;
  const auto eps = static_cast<float>(c.norm_eps);
  MOE_CUDA_CHECK(cudaMemcpyAsync(s.ids.data(), tokens.data(), static_cast<size_t>(n) * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, s.stream));
  cuda::decode_embedding(s.x.data(), s.ids.data(), s.w("embedding"), n, D, s.stream);
  size_t moe_index = 0;
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string p = fmt::format("layers.{}", l);
    float* k_cache = s.keys[static_cast<size_t>(l)].data();
    float* v_cache = s.values[static_cast<size_t>(l)].data();
    cuda::decode_rmsnorm(s.normed.data(), s.x.data(), s.w(p + ".attn_norm"), n, D, eps, s.stream);
    cuda::decode_linear(s.q.data(), s.normed.data(), s.w(p + ".attn.wq"), nullptr, n, D, H * d, false, s.stream);
    cuda::decode_linear(k_cache + start * G * d, s.normed.data(), s.w(p + ".attn.wk"), nullptr, n, D, G * d, false,
                        s.stream);
    cuda::decode_linear(v_cache + start * G * d, s.normed.data(), s.w(p + ".attn.wv"), nullptr, n, D, G * d, false,
                        s.stream);
    cuda::decode_rope(s.q.data(), n, H, d, start, c.rope_theta, s.stream);
    cuda::decode_rope(k_cache + start * G * d, n, G, d, start, c.rope_theta, s.stream);
    cuda::decode_attention(s.attn.data(), s.q.data(), k_cache, v_cache, n, start, H, G, d, s.stream);
    cuda::decode_linear(s.h.data(), s.attn.data(), s.w(p + ".attn.wo"), nullptr, n, H * d, D, false, s.stream);
    cuda::decode_add(s.h.data(), s.x.data(), n * D, s.stream);
    cuda::decode_rmsnorm(s.normed.data(), s.h.data(), s.w(p + ".ffn_norm"), n, D, eps, s.stream);
    if (l >= c.first_dense_layers) {
      s.moe(l, moe_index++, s.x.data(), s.normed.data(), n);
    } else {
      s.ffn(s.x.data(), s.normed.data(), n, c.dense_hidden, s.w(p + ".ffn.w1"), s.w(p + ".ffn.w3"), s.w(p + ".ffn.w2"),
            false);
    }
    cuda::decode_add(s.x.data(), s.h.data(), n * D, s.stream);
  }
  s.length += n;
  cuda::decode_rmsnorm(s.normed.data(), s.x.data() + (n - 1) * D, s.w("final_norm"), 1, D, eps, s.stream);
  const float* head = c.tie_embeddings ? s.w("embedding") : s.w("lm_head");
  cuda::decode_linear(s.logits_V.data(), s.normed.data(), head, nullptr, 1, D, c.vocab_size, false, s.stream);
  MOE_CUDA_CHECK(cudaMemcpyAsync(s.host_logits_V.data(), s.logits_V.data(), s.host_logits_V.size() * sizeof(float),
                                 cudaMemcpyDeviceToHost, s.stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  return s.host_logits_V;
}

}  // namespace moe

#include "train/mixtral_names.h"

#include <fmt/format.h>

namespace moe {

std::optional<MixtralTensor> mixtral_tensor(const std::string& ours, const ModelConfig& m) {
  const int64_t D = m.dim, V = m.vocab_size, hd = m.head_dim(), H = m.n_heads, G = m.n_kv_heads;
  if (ours == "embedding") return MixtralTensor{"model.embed_tokens.weight", {V, D}};
  if (ours == "final_norm") return MixtralTensor{"model.norm.weight", {D}};
  if (ours == "lm_head") return MixtralTensor{"lm_head.weight", {V, D}};
  const size_t dot = ours.find('.', 7);
  if (!ours.starts_with("layers.") || dot == std::string::npos) return std::nullopt;
  const std::string theirs = "model.layers." + ours.substr(7, dot - 7) + ".";
  const std::string rest = ours.substr(dot + 1);
  if (rest == "attn_norm") return MixtralTensor{theirs + "input_layernorm.weight", {D}};
  if (rest == "ffn_norm") return MixtralTensor{theirs + "post_attention_layernorm.weight", {D}};
  if (rest == "attn.wq") return MixtralTensor{theirs + "self_attn.q_proj.weight", {H * hd, D}};
  if (rest == "attn.wk") return MixtralTensor{theirs + "self_attn.k_proj.weight", {G * hd, D}};
  if (rest == "attn.wv") return MixtralTensor{theirs + "self_attn.v_proj.weight", {G * hd, D}};
  if (rest == "attn.wo") return MixtralTensor{theirs + "self_attn.o_proj.weight", {D, H * hd}};
  if (rest == "moe.router.weight") return MixtralTensor{theirs + "block_sparse_moe.gate.weight", {m.moe.n_experts, D}};
  return std::nullopt;
}

MixtralTensor mixtral_expert_tensor(int64_t layer, int64_t e, const std::string& w, const ModelConfig& m) {
  const int64_t D = m.dim, F = m.moe.expert_hidden;
  return {fmt::format("model.layers.{}.block_sparse_moe.experts.{}.{}.weight", layer, e, w),
          w == "w2" ? std::vector<int64_t>{D, F} : std::vector<int64_t>{F, D}};
}

}  // namespace moe

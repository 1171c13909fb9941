// The Hugging Face Mixtral names and shapes of our parameters: one table for both
// directions of the mapping (`moe export`, train/export.h, writes it; `--init-from-hf`,
// train/hf_import.h, reads it).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/model_config.h"

namespace moe {

struct MixtralTensor {
  std::string name;
  std::vector<int64_t> shape;
};

// The Mixtral tensor that holds our parameter `ours` whole: "embedding", "final_norm",
// "lm_head", "layers.L.{attn_norm, attn.wq, attn.wk, attn.wv, attn.wo, ffn_norm}" and
// "layers.L.moe.router.weight" (the gate, which holds W / moe.temperature). nullopt for
// the experts (one Mixtral tensor per expert: mixtral_expert_tensor) and for what Mixtral
// has no tensor of (the router bias, shared experts, dense FFNs).
std::optional<MixtralTensor> mixtral_tensor(const std::string& ours, const ModelConfig& m);
// Expert e's slab of our "layers.L.moe.experts.<w>" ([E, F, D] for w1 and w3, [E, D, F]
// for w2): "model.layers.L.block_sparse_moe.experts.e.<w>.weight".
MixtralTensor mixtral_expert_tensor(int64_t layer, int64_t e, const std::string& w, const ModelConfig& m);

}  // namespace moe

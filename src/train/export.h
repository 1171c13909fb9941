// `moe export --format hf`: a checkpoint as a Hugging Face Mixtral folder (config.json,
// generation_config.json, model.safetensors, or model-0000i-of-0000n.safetensors and
// model.safetensors.index.json past a size, and the run's tokenizer as tokenizer.json,
// tokenizer_config.json and special_tokens_map.json, with the EOS id in the configs). Mixtral is the public architecture closest
// to ours: pre-norm blocks of RMSNorm, GQA attention with rotate_half RoPE, and a sparse
// MoE of SwiGLU experts behind a softmax top-k router with renormalised weights.
//
// Tensor mapping (ours -> Mixtral):
//   embedding                      -> model.embed_tokens.weight
//   layers.L.attn_norm             -> model.layers.L.input_layernorm.weight
//   layers.L.attn.{wq,wk,wv,wo}    -> model.layers.L.self_attn.{q,k,v,o}_proj.weight
//   layers.L.ffn_norm              -> model.layers.L.post_attention_layernorm.weight
//   layers.L.moe.router.weight     -> model.layers.L.block_sparse_moe.gate.weight (/ moe.temperature)
//   layers.L.moe.experts.w{1,3,2}[e] -> model.layers.L.block_sparse_moe.experts.e.w{1,3,2}.weight
//   final_norm                     -> model.norm.weight
//   lm_head                        -> lm_head.weight (absent with tie_word_embeddings)
// What Mixtral cannot express is refused: dense first layers, shared experts, sigmoid
// scores, unnormalised top-k weights. A router bias or balancing bias that is not zero
// changes routing; it is refused unless allow_inexact, which drops it with a warning
// (configs meant for export set moe.router_bias = false: then there is none).
// moe.temperature is folded into the gate weights; capacity dropping has no Mixtral
// counterpart (Mixtral is dropless), which only warns.
#pragma once
#include <cstdint>
#include <iosfwd>
#include <string>

namespace moe {

struct ExportOptions {
  std::string checkpoint;                  // a checkpoint directory (train/checkpoint.h)
  std::string output;                      // created; must not exist or be empty
  std::string format = "hf";               // only "hf"
  uint64_t max_shard_bytes = 5000000000;   // past this, shards plus an index (HF's default "5GB")
  bool allow_inexact = false;              // drop a non-zero router/balancing bias with a warning
};

// Writes the folder (into a temporary sibling, renamed when complete). Bad options are a
// ConfigError; a checkpoint Mixtral cannot represent is a ConfigError naming the reason.
void export_checkpoint(const ExportOptions& options, std::ostream& out);

}  // namespace moe

#include "train/export.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <optional>
#include <nlohmann/json.hpp>
#include <ostream>

#include "core/error.h"
#include "data/bpe.h"
#include "data/tokenizer.h"
#include "train/checkpoint.h"
#include "train/mixtral_names.h"
#include "core/atomic_file.h"
#include "train/safetensors.h"

namespace moe {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// A tensor of the export, read from the checkpoint only when its output shard is written.
struct HfTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::function<std::vector<float>()> load;
  size_t bytes() const {
    size_t n = sizeof(float);
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    return n;
  }
};

float max_abs(const std::vector<float>& values) {
  float m = 0;
  for (float v : values) m = std::max(m, std::fabs(v));
  return m;
}

std::vector<int64_t> shape_of(const LoadedCheckpoint& ckpt, const std::string& name) {
  const ManifestTensor* t = ckpt.find(name);
  if (!t) MOE_THROW("{}: the checkpoint has no tensor '{}'", ckpt.path.string(), name);
  return t->shape;
}

// Refuses what Mixtral cannot express at all.
void check_representable(const LoadedCheckpoint& ckpt) {
  const ModelConfig& m = ckpt.config.model;
  auto refuse = [&](const std::string& why) {
    MOE_CONFIG_ERROR("{}: cannot export as Mixtral: {}", ckpt.path.string(), why);
  };
  if (m.first_dense_layers > 0)
    refuse(fmt::format("model.first_dense_layers = {} (Mixtral has a MoE FFN in every block)", m.first_dense_layers));
  if (m.moe.n_shared_experts > 0)
    refuse(fmt::format("moe.n_shared_experts = {} (Mixtral has no shared experts)", m.moe.n_shared_experts));
  if (m.moe.score_func != ScoreFunc::Softmax) refuse("moe.score_func = sigmoid (Mixtral's router is a softmax)");
  if (!m.moe.renormalize)
    refuse("moe.renormalize = false (Mixtral always renormalises the top-k weights)");
}

// The tokenizer files of the export: the run's tokenizer.json (kept in the checkpoint; a
// byte-tokenizer run's is made here for checkpoints older than that), and what
// transformers' AutoTokenizer reads beside it. `eos` ends documents; `bos` is the
// tokenizer's own begin token, if any (our runs add none).
struct HfTokenizer {
  std::string json_text;  // empty: the export ships no tokenizer
  std::optional<AddedToken> eos, bos;
  int32_t eos_id = -1, bos_id = -1;
};

// Without a tokenizer.json (a SentencePiece model, a tiktoken rank file, a checkpoint
// older than that file): the ids from the run's tokenizer spec if it still loads.
HfTokenizer ids_from_spec(const RunConfig& config) {
  HfTokenizer t;
  try {
    const std::unique_ptr<Tokenizer> tokenizer = make_tokenizer(config.data.tokenizer);
    t.eos_id = tokenizer->eos_id();
    t.bos_id = tokenizer->bos_id();
  } catch (const Error&) {  // "bpe:N" (trained, not a file) or a file gone since: left unset
  }
  return t;
}

HfTokenizer export_tokenizer(const LoadedCheckpoint& ckpt, std::ostream& out) {
  HfTokenizer t;
  t.json_text = ckpt.tokenizer_json;
  if (t.json_text.empty() && parse_tokenizer_spec(ckpt.config.data.tokenizer).kind == TokenizerKind::Byte)
    t.json_text = ByteTokenizer().hf_tokenizer_json();
  if (t.json_text.empty()) {
    fmt::print(out, "warning: export: {} keeps no tokenizer.json (data.tokenizer \"{}\"); the export has no tokenizer "
               "files\n", ckpt.path.string(), ckpt.config.data.tokenizer);
    return ids_from_spec(ckpt.config);
  }
  // The special tokens as the run's tokenizer reads them (the file's hash was checked).
  const std::vector<AddedToken> added = parse_hf_tokenizer(t.json_text, (ckpt.path / "tokenizer.json").string()).added;
  t.eos_id = find_end_of_text(added);
  t.bos_id = find_begin_of_text(added);
  for (const AddedToken& a : added) {
    if (a.id == t.eos_id) t.eos = a;
    if (a.id == t.bos_id) t.bos = a;
  }
  return t;
}

void write_tokenizer_files(const HfTokenizer& t, const RunConfig& config, const fs::path& dir) {
  if (t.json_text.empty()) return;
  write_file_atomic(dir / "tokenizer.json", t.json_text);
  const json eos = t.eos ? json(t.eos->content) : json();
  const json bos = t.bos ? json(t.bos->content) : json();
  // add_bos_token false: our runs separate documents by EOS alone (data/loader.h).
  const json tokenizer_config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                                 {"model_max_length", config.model.seq_len},
                                 {"bos_token", bos},
                                 {"eos_token", eos},
                                 {"unk_token", nullptr},
                                 {"pad_token", nullptr},
                                 {"add_bos_token", false},
                                 {"add_eos_token", false},
                                 {"clean_up_tokenization_spaces", false}};
  write_file_atomic(dir / "tokenizer_config.json", tokenizer_config.dump(2) + "\n");
  json special = json::object();
  if (t.eos) special["eos_token"] = t.eos->content;
  if (t.bos) special["bos_token"] = t.bos->content;
  write_file_atomic(dir / "special_tokens_map.json", special.dump(2) + "\n");
}

json mixtral_config(const RunConfig& config, const HfTokenizer& tokenizer) {
  const ModelConfig& m = config.model;
  const json eos = tokenizer.eos_id >= 0 ? json(tokenizer.eos_id) : json();
  const json bos = tokenizer.bos_id >= 0 ? json(tokenizer.bos_id) : json();
  return {
      {"architectures", {"MixtralForCausalLM"}},
      {"model_type", "mixtral"},
      {"vocab_size", m.vocab_size},
      {"hidden_size", m.dim},
      {"intermediate_size", m.moe.expert_hidden},
      {"num_hidden_layers", m.n_layers},
      {"num_attention_heads", m.n_heads},
      {"num_key_value_heads", m.n_kv_heads},
      {"head_dim", m.head_dim()},
      {"hidden_act", "silu"},
      {"max_position_embeddings", m.seq_len},
      {"initializer_range", m.init_std},
      {"rms_norm_eps", m.norm_eps},
      {"use_cache", true},
      {"pad_token_id", nullptr},
      {"bos_token_id", bos},
      {"eos_token_id", eos},
      {"tie_word_embeddings", m.tie_embeddings},
      {"rope_theta", m.rope_theta},
      {"sliding_window", nullptr},
      {"attention_dropout", 0.0},
      {"num_experts_per_tok", m.moe.top_k},
      {"num_local_experts", m.moe.n_experts},
      {"output_router_logits", false},
      {"router_aux_loss_coef", m.moe.aux_loss_coef},
      {"router_jitter_noise", 0.0},
      {"torch_dtype", "float32"},
  };
}

// Our tensors under Mixtral's names and layouts, in the order HF writes them.
std::vector<HfTensor> mixtral_tensors(const LoadedCheckpoint& ckpt, bool allow_inexact, std::ostream& out) {
  const ModelConfig& m = ckpt.config.model;
  const int64_t E = m.moe.n_experts, F = m.moe.expert_hidden, D = m.dim;
  std::vector<HfTensor> tensors;
  auto copy = [&](const std::string& ours) {  // a parameter Mixtral holds whole, as it is
    const std::string name = "param/" + ours;
    tensors.push_back({mixtral_tensor(ours, m)->name, shape_of(ckpt, name), [&ckpt, name] { return read_tensor(ckpt, name); }});
  };
  auto inexact = [&](const std::string& what) {
    if (!allow_inexact)
      MOE_CONFIG_ERROR("{}: cannot export as Mixtral exactly: {} (pass --allow-inexact to drop it)",
                       ckpt.path.string(), what);
    fmt::print(out, "warning: export: {}; dropped, routing will differ\n", what);
  };
  copy("embedding");
  for (int64_t l = 0; l < m.n_layers; ++l) {
    const std::string ours = fmt::format("layers.{}", l);
    for (const char* part : {".attn_norm", ".attn.wq", ".attn.wk", ".attn.wv", ".attn.wo", ".ffn_norm"})
      copy(ours + part);

    const std::string moe = ours + ".moe";
    const bool has_bias = ckpt.find("param/" + moe + ".router.bias") != nullptr;  // moe.router_bias
    const float bias = has_bias ? max_abs(read_tensor(ckpt, "param/" + moe + ".router.bias")) : 0.0f;
    if (bias != 0) inexact(fmt::format("{}.router.bias is not zero (max |b| = {:.3g}); Mixtral's gate has no bias", moe, bias));
    if (ckpt.find("balance_bias/" + moe)) {
      const float balance = max_abs(read_tensor(ckpt, "balance_bias/" + moe));
      if (balance != 0)
        inexact(fmt::format("{} has a balancing selection bias (max |b| = {:.3g}); Mixtral selects by score alone",
                            moe, balance));
    }
    // logits / temperature == (W / temperature) x: fold it into the gate, the layer's own
    // temperature when moe.temperature_control tuned it.
    double temperature = m.moe.temperature;
    if (m.moe.temperature_control && ckpt.find("router_temperature/" + moe))
      temperature = read_tensor(ckpt, "router_temperature/" + moe)[0];
    MixtralTensor gate = *mixtral_tensor(moe + ".router.weight", m);
    tensors.push_back({std::move(gate.name), std::move(gate.shape), [&ckpt, moe, temperature] {
                         std::vector<float> gate = read_tensor(ckpt, "param/" + moe + ".router.weight");
                         if (temperature != 1.0)
                           for (float& w : gate) w = static_cast<float>(w / temperature);
                         return gate;
                       }});
    // Expert e's rows of w1, w3 [E, F, D] and w2 [E, D, F], read one expert at a time.
    const int64_t slab = F * D;
    for (int64_t e = 0; e < E; ++e)
      for (const char* w : {"w1", "w2", "w3"}) {
        const std::string name = "param/" + moe + ".experts." + w;
        MixtralTensor expert = mixtral_expert_tensor(l, e, w, m);
        tensors.push_back({std::move(expert.name), std::move(expert.shape),
                           [&ckpt, name, e, slab] { return read_tensor(ckpt, name, e * slab, slab); }});
      }
  }
  copy("final_norm");
  if (!m.tie_embeddings) copy("lm_head");
  if (m.moe.capacity_factor > 0)
    fmt::print(out, "warning: export: moe.capacity_factor = {} drops tokens in training; Mixtral is dropless\n",
               m.moe.capacity_factor);
  return tensors;
}

void write_shards(const std::vector<HfTensor>& tensors, const fs::path& dir, uint64_t max_shard_bytes) {
  // Greedy, in order: a new shard starts when the next tensor would pass the limit.
  std::vector<std::vector<const HfTensor*>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (const HfTensor& t : tensors) {
    if (in_shard > 0 && in_shard + t.bytes() > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(&t);
    in_shard += t.bytes();
    total += t.bytes();
  }
  json weight_map = json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file = shards.size() == 1
                                 ? "model.safetensors"
                                 : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
    SafeTensorsWriter writer;
    writer.set_metadata("format", "pt");  // what transformers expects of a PyTorch checkpoint
    std::vector<std::vector<float>> values;  // this output shard's tensors only
    values.reserve(shards[i].size());
    for (const HfTensor* t : shards[i]) {
      values.push_back(t->load());
      MOE_CHECK(values.back().size() * sizeof(float) == t->bytes(), "export: '{}' read {} values", t->name,
                values.back().size());
      writer.add_f32(t->name, t->shape, values.back().data());
      weight_map[t->name] = file;
    }
    writer.write(dir / file);
  }
  if (shards.size() > 1) {
    const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file_atomic(dir / "model.safetensors.index.json", index.dump(2) + "\n");
  }
}

}  // namespace

void export_checkpoint(const ExportOptions& options, std::ostream& out) {
  if (options.format != "hf") MOE_CONFIG_ERROR("--format must be hf, got \"{}\"", options.format);
  if (options.max_shard_bytes == 0) MOE_CONFIG_ERROR("--max-shard-bytes must be positive");
  std::error_code ec;
  if (!fs::is_directory(options.checkpoint, ec))
    MOE_CONFIG_ERROR("--checkpoint {}: not a directory", options.checkpoint);
  // Work on the absolute path without a trailing separator: "out/" names the folder "out"
  // (its empty file name would put the temporary folder inside the destination).
  fs::path output = fs::absolute(fs::path(options.output), ec).lexically_normal();
  if (!output.has_filename() && output.has_relative_path()) output = output.parent_path();
  if (options.output.empty() || !output.has_relative_path())
    MOE_CONFIG_ERROR("--output must name a directory to create, got \"{}\"", options.output);
  if (fs::exists(output, ec) && !(fs::is_directory(output, ec) && fs::is_empty(output, ec)))
    MOE_CONFIG_ERROR("--output {}: exists and is not an empty directory", options.output);

  const LoadedCheckpoint ckpt = read_checkpoint(options.checkpoint);
  check_representable(ckpt);
  const std::vector<HfTensor> tensors = mixtral_tensors(ckpt, options.allow_inexact, out);
  const HfTokenizer tokenizer = export_tokenizer(ckpt, out);

  // Build the folder beside its destination, then rename it into place; on failure remove
  // it, and the missing parent folders created for it, so a failed export leaves nothing.
  const fs::path parent = output.parent_path();
  fs::path first_created;  // the outermost parent folder that did not exist
  for (fs::path p = parent; !fs::exists(p, ec) && p.has_relative_path(); p = p.parent_path()) first_created = p;
  const fs::path temp = parent / fmt::format(".{}.tmp.{}", output.filename().string(), ::getpid());
  try {
    if (!fs::create_directories(parent, ec) && ec)
      MOE_CONFIG_ERROR("--output {}: cannot create {}: {}", options.output, parent.string(), ec.message());
    fs::remove_all(temp);
    fs::create_directories(temp);
    write_file_atomic(temp / "config.json", mixtral_config(ckpt.config, tokenizer).dump(2) + "\n");
    json generation = {{"bos_token_id", tokenizer.bos_id >= 0 ? json(tokenizer.bos_id) : json()},
                       {"eos_token_id", tokenizer.eos_id >= 0 ? json(tokenizer.eos_id) : json()}};
    write_file_atomic(temp / "generation_config.json", generation.dump(2) + "\n");
    write_tokenizer_files(tokenizer, ckpt.config, temp);
    write_shards(tensors, temp, options.max_shard_bytes);
    fs::rename(temp, output);  // replaces an empty folder there
  } catch (...) {
    fs::remove_all(temp, ec);
    if (!first_created.empty()) fs::remove_all(first_created, ec);
    throw;
  }
  fsync_directory(parent);
  uint64_t total = 0;
  for (const HfTensor& t : tensors) total += t.bytes();
  fmt::print(out, "export: {} (step {}) -> {} as MixtralForCausalLM: {} tensors, {:.1f} MB\n", ckpt.path.string(),
             ckpt.step, options.output, tensors.size(), static_cast<double>(total) / 1e6);
}

}  // namespace moe

#include "train/hf_import.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "core/atomic_file.h"
#include "core/bf16.h"
#include "core/error.h"
#include "train/mixtral_names.h"
#include "train/safetensors.h"

namespace moe {
namespace fs = std::filesystem;
using json = nlohmann::json;

struct HfWeights::File {
  std::string path;
  int fd = -1;
  SafeTensorsHeader header;
  ~File() {
    if (fd >= 0) ::close(fd);
  }
};

namespace {

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const int exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ffu;
  float value;
  if (exponent == 0) value = std::ldexp(static_cast<float>(mantissa), -24);  // zero, subnormal
  else if (exponent == 31) value = mantissa ? NAN : INFINITY;
  else value = std::ldexp(static_cast<float>(mantissa | 0x400u), exponent - 25);
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits |= sign;
  std::memcpy(&value, &bits, sizeof bits);
  return value;
}

// A config.json number (or null) under `key`, or the first of `fallbacks` present.
const json* find_key(const json& config, std::initializer_list<const char*> keys) {
  for (const char* key : keys)
    if (config.contains(key) && !config[key].is_null()) return &config[key];
  return nullptr;
}

}  // namespace

namespace {

json read_hf_config(const std::string& dir) {
  auto refuse = [&](const std::string& why) { MOE_CONFIG_ERROR("--init-from-hf {}: {}", dir, why); };
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) refuse("not a directory");
  if (!fs::is_regular_file(fs::path(dir) / "config.json", ec)) refuse("no config.json (not a Hugging Face model folder)");
  json config = json::parse(read_file_bytes(fs::path(dir) / "config.json"), nullptr, false);
  if (config.is_discarded() || !config.is_object()) refuse("config.json is not a JSON object");
  const std::string type = config.value("model_type", std::string());
  if (type != "mixtral")
    refuse(fmt::format("model_type \"{}\": only Mixtral folders can be read (the family `moe export` writes)", type));
  return config;
}

}  // namespace

void check_hf_model_folder(const std::string& dir) { read_hf_config(dir); }

HfWeights::HfWeights(const std::string& dir, const ModelConfig& model) : dir_(dir), model_(model) {
  auto refuse = [&](const std::string& why) { MOE_CONFIG_ERROR("--init-from-hf {}: {}", dir, why); };
  std::error_code ec;
  const json config = read_hf_config(dir);

  // What our model cannot be: refused whatever config.json says.
  if (model.first_dense_layers > 0) refuse("model.first_dense_layers > 0: Mixtral has a MoE FFN in every block");
  if (model.moe.n_shared_experts > 0) refuse("moe.n_shared_experts > 0: Mixtral has no shared experts");
  if (model.moe.score_func != ScoreFunc::Softmax) refuse("moe.score_func = sigmoid: Mixtral's router is a softmax");
  if (!model.moe.renormalize) refuse("moe.renormalize = false: Mixtral renormalises the top-k weights");

  auto integer = [&](std::initializer_list<const char*> keys, int64_t ours, const std::string& our_key) {
    const json* v = find_key(config, keys);
    if (!v || !v->is_number_integer()) refuse(fmt::format("config.json has no integer {}", *keys.begin()));
    if (v->get<int64_t>() != ours)
      refuse(fmt::format("config.json {} is {}, {} is {}", *keys.begin(), v->get<int64_t>(), our_key, ours));
  };
  integer({"hidden_size"}, model.dim, "model.dim");
  integer({"num_hidden_layers"}, model.n_layers, "model.n_layers");
  integer({"num_attention_heads"}, model.n_heads, "model.n_heads");
  integer({"num_key_value_heads"}, model.n_kv_heads, "model.n_kv_heads");
  integer({"intermediate_size"}, model.moe.expert_hidden, "moe.expert_hidden");
  integer({"num_local_experts"}, model.moe.n_experts, "moe.n_experts");
  integer({"num_experts_per_tok"}, model.moe.top_k, "moe.top_k");
  integer({"vocab_size"}, model.vocab_size, "model.vocab_size");
  if (const json* head_dim = find_key(config, {"head_dim"}); head_dim && *head_dim != model.head_dim())
    refuse(fmt::format("config.json head_dim is {}, model.dim / model.n_heads is {}", head_dim->dump(), model.head_dim()));
  auto real = [&](std::initializer_list<const char*> keys, const json* in, double ours, const std::string& our_key) {
    const json* v = nullptr;
    for (const char* key : keys)
      if (!v && in && in->is_object() && in->contains(key) && (*in)[key].is_number()) v = &(*in)[key];
    if (!v) return false;
    if (std::fabs(v->get<double>() - ours) > 1e-9 * std::fabs(ours))
      refuse(fmt::format("config.json {} is {}, {} is {}", *keys.begin(), v->dump(), our_key, ours));
    return true;
  };
  if (!real({"rms_norm_eps"}, &config, model.norm_eps, "model.norm_eps")) refuse("config.json has no rms_norm_eps");
  // transformers 5 writes rope_parameters.rope_theta; older files rope_theta.
  if (!real({"rope_theta"}, &config, model.rope_theta, "model.rope_theta") &&
      !real({"rope_theta"}, config.contains("rope_parameters") ? &config["rope_parameters"] : nullptr,
            model.rope_theta, "model.rope_theta"))
    refuse("config.json has no rope_theta");
  if (config.value("tie_word_embeddings", false) != model.tie_embeddings)
    refuse(fmt::format("config.json tie_word_embeddings is {}, model.tie_embeddings is {}",
                       config.value("tie_word_embeddings", false), model.tie_embeddings));
  if (const json* act = find_key(config, {"hidden_act"}); act && *act != "silu")
    refuse(fmt::format("config.json hidden_act is {}: our experts are SwiGLU (silu)", act->dump()));
  if (const json* window = find_key(config, {"sliding_window"});
      window && window->is_number_integer() && window->get<int64_t>() < model.seq_len)
    refuse(fmt::format("config.json sliding_window {} is below model.seq_len {}: our attention is full causal",
                       window->get<int64_t>(), model.seq_len));

  // The safetensors files: the index's, or model.safetensors.
  std::set<std::string> names;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::is_regular_file(index, ec)) {
    const json root = json::parse(read_file_bytes(index), nullptr, false);
    if (root.is_discarded() || !root.contains("weight_map") || !root["weight_map"].is_object())
      refuse("model.safetensors.index.json has no weight_map");
    for (const auto& [tensor, file] : root["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos)
        refuse(fmt::format("model.safetensors.index.json: bad file for '{}'", tensor));
      names.insert(file.get<std::string>());
    }
  } else {
    names.insert("model.safetensors");
  }
  for (const std::string& name : names) {
    auto file = std::make_unique<File>();
    file->path = (fs::path(dir) / name).string();
    file->fd = ::open(file->path.c_str(), O_RDONLY | O_CLOEXEC);
    if (file->fd < 0) refuse(fmt::format("cannot open {}: {}", name, std::strerror(errno)));
    file->header = read_safetensors_header(file->fd, file->path);
    for (size_t i = 0; i < file->header.tensors.size(); ++i) tensors_[file->header.tensors[i].name] = {file.get(), i};
    files_.push_back(std::move(file));
  }
}

HfWeights::~HfWeights() = default;

const HfWeights::Located& HfWeights::locate(const std::string& hf_name) const {
  const auto it = tensors_.find(hf_name);
  if (it == tensors_.end()) MOE_CONFIG_ERROR("--init-from-hf {}: no tensor '{}'", dir_, hf_name);
  return it->second;
}

void HfWeights::read_hf(const std::string& hf_name, int64_t begin, int64_t count, float* out) const {
  const Located& at = locate(hf_name);
  const SafeTensorInfo& info = at.file->header.tensors[at.tensor];
  if (begin < 0 || count < 0 || begin + count > info.numel())
    MOE_CONFIG_ERROR("--init-from-hf {}: '{}' has {} elements, {} needed", dir_, hf_name, info.numel(), begin + count);
  const uint64_t offset = at.file->header.data_start + info.begin;
  if (info.dtype == "F32") {
    read_exactly(at.file->fd, out, static_cast<uint64_t>(count) * 4, offset + static_cast<uint64_t>(begin) * 4,
                 at.file->path);
    return;
  }
  if (info.dtype != "BF16" && info.dtype != "F16")
    MOE_CONFIG_ERROR("--init-from-hf {}: '{}' is {}; F32, BF16 and F16 are read", dir_, hf_name, info.dtype);
  std::vector<uint16_t> raw(static_cast<size_t>(count));
  read_exactly(at.file->fd, raw.data(), static_cast<uint64_t>(count) * 2, offset + static_cast<uint64_t>(begin) * 2,
               at.file->path);
  const bool bf = info.dtype == "BF16";
  for (int64_t i = 0; i < count; ++i)
    out[i] = bf ? bf16_to_float(bf16{raw[static_cast<size_t>(i)]}) : half_to_float(raw[static_cast<size_t>(i)]);
}

void HfWeights::read(const std::string& name, int64_t begin, int64_t count, float* out) const {
  auto hf_shape_check = [&](const std::string& hf_name, std::vector<int64_t> shape) {
    const Located& at = locate(hf_name);
    const SafeTensorInfo& info = at.file->header.tensors[at.tensor];
    if (info.shape != shape)
      MOE_CONFIG_ERROR("--init-from-hf {}: '{}' has shape [{}], this model needs [{}]", dir_, hf_name,
                       fmt::join(info.shape, ", "), fmt::join(shape, ", "));
  };
  if (name.ends_with(".moe.router.bias")) {  // Mixtral's gate has none: ours starts at zero
    std::fill(out, out + count, 0.0f);
    return;
  }
  if (const std::optional<MixtralTensor> t = mixtral_tensor(name, model_)) {
    hf_shape_check(t->name, t->shape);
    read_hf(t->name, begin, count, out);
    // export folds 1/temperature into the gate: logits / t == (t W_gate x) / t.
    if (name.ends_with(".moe.router.weight"))
      for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(out[i] * model_.moe.temperature);
    return;
  }
  const size_t experts = name.find(".moe.experts.w");
  if (name.starts_with("layers.") && experts != std::string::npos && name.size() == experts + 15) {
    // Ours [E, F, D] (w2 [E, D, F]) is the experts' tensors one after another.
    const int64_t layer = std::stoll(name.substr(7, experts - 7));
    const std::string w = name.substr(name.size() - 2);
    const int64_t slab = model_.moe.expert_hidden * model_.dim;
    for (int64_t at = begin; at < begin + count;) {
      const int64_t e = at / slab, within = at % slab, n = std::min(slab - within, begin + count - at);
      const MixtralTensor t = mixtral_expert_tensor(layer, e, w, model_);
      hf_shape_check(t.name, t.shape);
      read_hf(t.name, within, n, out + (at - begin));
      at += n;
    }
    return;
  }
  MOE_CONFIG_ERROR("--init-from-hf {}: our parameter '{}' has no Mixtral counterpart", dir_, name);
}

}  // namespace moe

#include "train/checkpoint_model.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <filesystem>
#include <ostream>

#include "core/error.h"
#ifdef MOE_HAVE_CUDA
#include "core/gpu.h"
#include "model/cuda/gpu_decoder.h"
#endif
#include "train/checkpoint.h"
#include "train/state_pieces.h"

namespace moe {

CheckpointModel load_checkpoint_model(const std::string& path, const std::vector<std::string>& overrides,
                                      std::ostream& warnings) {
  if (!std::filesystem::is_directory(path)) MOE_CONFIG_ERROR("--checkpoint {}: no such checkpoint directory", path);
  if (!std::filesystem::is_regular_file(std::filesystem::path(path) / "config.toml"))
    MOE_CONFIG_ERROR("--checkpoint {}: no config.toml (not a checkpoint directory)", path);
  const LoadedCheckpoint checkpoint = read_checkpoint(path);
  CheckpointModel loaded{checkpoint.config, checkpoint.step, nullptr, checkpoint.tokenizer_json};
  if (!overrides.empty()) {
    loaded.config = parse_config(checkpoint.config_toml, (checkpoint.path / "config.toml").string(), overrides);
    check_resume_compatible(checkpoint, loaded.config, warnings);
  }
  ModelConfig& model = loaded.config.model;
  if (model.vocab_size == 0)  // a config saved before the tokenizer resolved it: the embedding knows
    if (const ManifestTensor* embedding = checkpoint.find("param/embedding"); embedding && !embedding->shape.empty())
      model.vocab_size = embedding->shape[0];
  loaded.model = std::make_unique<Transformer<float>>(model, loaded.config.training.seed);
  std::vector<StateTarget> targets;
  ParameterStore<float>& params = loaded.model->params();
  for (int id = 0; id < params.size(); ++id)
    targets.push_back({"param/" + params.spec(id).name, tensor_shape(params.spec(id).shape), 0, params.numel(id),
                       params.value(id)});
  for (MoELayer<float>* layer : loaded.model->moe_layers()) {
    std::vector<float>& bias = layer->balance_bias_E();
    const std::string name = "balance_bias/" + layer->prefix();
    if (checkpoint.find(name))
      targets.push_back({name, {static_cast<int64_t>(bias.size())}, 0, static_cast<int64_t>(bias.size()), bias.data()});
    // The controller's temperatures (moe.temperature_control): decoding routes with them.
    std::vector<float>& temperature = layer->temperature_state();
    if (layer->temperature_control() && checkpoint.find("router_temperature/" + layer->prefix()))
      targets.push_back({"router_temperature/" + layer->prefix(), {static_cast<int64_t>(temperature.size())}, 0,
                         static_cast<int64_t>(temperature.size()), temperature.data()});
  }
  read_slices(checkpoint, targets);
  return loaded;
}

std::unique_ptr<Decoder> make_decoder(const Transformer<float>& model, const std::string& device) {
  if (device != "cpu" && device != "gpu" && device != "auto")
    MOE_CONFIG_ERROR("--device must be cpu, gpu or auto, got \"{}\"", device);
#ifdef MOE_HAVE_CUDA
  const bool gpu = device != "cpu" && gpu::device_count() > 0;
  if (device == "gpu" && !gpu) MOE_CONFIG_ERROR("--device gpu, but no CUDA device is visible");
  if (gpu) return std::make_unique<GpuDecoder>(model);
#else
  if (device == "gpu") MOE_CONFIG_ERROR("--device gpu, but this build has no CUDA backend (nvcc was not found at build time)");
#endif
  return std::make_unique<CpuDecoder>(model);
}

}  // namespace moe

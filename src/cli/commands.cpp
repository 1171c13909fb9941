#include "cli/commands.h"

#include <fmt/format.h>

#include <iostream>

#include "core/threads.h"
#include "train/config.h"
#include "train/text_data.h"
#include "train/trainer.h"

namespace moe {
namespace {

RunConfig resolve_config(const std::string& path, std::vector<std::string> overrides) {
  if (path.empty()) return parse_config("", "defaults", overrides);
  return load_config(path, overrides);
}

}  // namespace

int run_train(const TrainOptions& options) {
  std::vector<std::string> overrides = options.overrides;
  if (options.device) overrides.push_back("training.device=" + *options.device);
  if (options.threads) overrides.push_back("training.threads=" + std::to_string(*options.threads));
  RunConfig config = resolve_config(options.config_path, overrides);
  if (config.training.device == "cuda")
    MOE_CONFIG_ERROR("training.device: this build has no CUDA backend yet; use auto or cpu");
  const int threads = set_num_threads(static_cast<int>(config.training.threads));
  TextData data = load_text_data(config, threads);
  fmt::print("data: {} | tokenizer {} (vocab {}) | train {} docs, {} tokens | validation {} docs, {} tokens\n",
             config.data.dir, data.tokenizer_name, config.model.vocab_size, data.train_docs,
             data.train_tokens, data.val_docs, data.val_tokens);
  Trainer trainer(config, std::move(data.train), std::move(data.validation));
  trainer.run(std::cout);
  return 0;
}

int run_config(const ConfigOptions& options) {
  RunConfig config = resolve_config(options.config_path, options.overrides);
  std::cout << config_to_toml(config);
  return 0;
}

}  // namespace moe

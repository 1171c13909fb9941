// The subcommands of the `moe` binary, callable from tests without a process.
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace moe {

struct TrainOptions {
  std::string config_path;
  std::optional<std::string> device;
  std::optional<int64_t> threads;
  std::vector<std::string> overrides;  // "section.key=value"
};

struct ConfigOptions {
  std::string config_path;  // empty: built-in defaults
  std::vector<std::string> overrides;
};

int run_train(const TrainOptions& options);
int run_config(const ConfigOptions& options);

}  // namespace moe

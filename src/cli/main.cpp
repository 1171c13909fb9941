// The `moe` binary. Exit codes: 0 success, 1 runtime failure, 2 usage or config error.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <iostream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"

namespace {

constexpr const char* kOverrideHelp =
    "Any config key can be overridden as --section.key=value (sections: model, moe, training, "
    "optimizer, lr, data, metrics, checkpoint; every key is listed in docs/CONFIG.md), e.g. "
    "--training.steps=50 --moe.temperature=0.3 --data.dir=/path/to/text.";

// Splits CLI11's leftover arguments into "section.key=value" overrides; anything else is
// a usage error.
std::vector<std::string> parse_overrides(const std::vector<std::string>& extras) {
  std::vector<std::string> overrides;
  for (const std::string& arg : extras) {
    const bool looks_like_override = arg.rfind("--", 0) == 0 && arg.find('=') != std::string::npos &&
                                     arg.find('.') < arg.find('=');
    if (!looks_like_override)
      MOE_CONFIG_ERROR("unknown argument '{}' (config overrides look like --section.key=value)", arg);
    overrides.push_back(arg.substr(2));
  }
  return overrides;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moe: Mixture-of-Experts LLM pretraining engine"};
  app.require_subcommand(1);
  app.footer("Run `moe <command> --help` for the options of a command.");

  moe::TrainOptions train;
  CLI::App* train_cmd = app.add_subcommand("train", "Train a model from a TOML config");
  train_cmd->add_option("-c,--config", train.config_path, "Run config (TOML)")
      ->required()
      ->check(CLI::ExistingFile);
  train_cmd->add_option("--device", train.device, "auto | cpu | cuda (overrides training.device)");
  train_cmd->add_option("--threads", train.threads, "CPU threads (overrides training.threads; 0 = all)");
  train_cmd->allow_extras();
  train_cmd->footer(kOverrideHelp);

  moe::ConfigOptions show;
  CLI::App* config_cmd =
      app.add_subcommand("config", "Print the resolved config (defaults, file, overrides) as TOML");
  config_cmd->add_option("-c,--config", show.config_path, "Run config (TOML); defaults when omitted")
      ->check(CLI::ExistingFile);
  config_cmd->allow_extras();
  config_cmd->footer(kOverrideHelp);

  auto is_command = [&](const std::string& name) {
    for (const CLI::App* sub : app.get_subcommands({}))
      if (sub->get_name() == name) return true;
    return false;
  };
  if (argc > 1 && argv[1][0] != '-' && !is_command(argv[1])) {
    std::string known;
    for (const CLI::App* sub : app.get_subcommands({})) known += (known.empty() ? "" : ", ") + sub->get_name();
    std::cerr << "moe: unknown command '" << argv[1] << "' (commands: " << known << ")\n";
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "moe: " << e.what() << "\n";
    return 2;
  }

  try {
    if (*train_cmd) {
      train.overrides = parse_overrides(train_cmd->remaining());
      return moe::run_train(train);
    }
    if (*config_cmd) {
      show.overrides = parse_overrides(config_cmd->remaining());
      return moe::run_config(show);
    }
  } catch (const moe::ConfigError& e) {
    std::cerr << "moe: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "moe: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

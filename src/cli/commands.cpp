#include "cli/commands.h"

#include <fmt/format.h>

#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <memory>

#include "core/threads.h"
#include "dist/all_to_all_bench.h"
#include "dist/communicator.h"
#include "obs/dashboard.h"
#include "obs/report.h"
#include "train/checkpoint.h"
#include "train/config.h"
#ifdef MOE_HAVE_CUDA
#include "train/cuda/gpu_bench.h"
#endif
#include "train/signals.h"
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
  const int threads = set_num_threads(static_cast<int>(config.training.threads));
  TextData data = load_text_data(config, threads);
  fmt::print("data: {} | tokenizer {} (vocab {}) | train {} docs, {} tokens | validation {} docs, {} tokens\n",
             config.data.dir, data.tokenizer_name, config.model.vocab_size, data.train_docs,
             data.train_tokens, data.val_docs, data.val_tokens);
  Trainer trainer(config, std::move(data.train), std::move(data.validation));
  trainer.observer_options.progress_bar = isatty(STDOUT_FILENO) == 1;
  std::unique_ptr<Dashboard> dashboard;
  if (options.dashboard_port) {
    dashboard = std::make_unique<Dashboard>(*options.dashboard_port);
    trainer.observer_options.feed = &dashboard->feed();
    fmt::print("dashboard: {}\n", dashboard->url());
    std::fflush(stdout);
  }
  if (options.resume) {
    // auto: the newest complete checkpoint, or a fresh start when there is none yet.
    std::optional<std::filesystem::path> path;
    if (*options.resume != "auto") path = *options.resume;
    else if (!config.checkpoint.dir.empty()) path = latest_checkpoint(config.checkpoint.dir);
    if (path && !std::filesystem::exists(*path))
      MOE_CONFIG_ERROR("--resume {}: no such checkpoint directory", path->string());
    if (path) trainer.resume(path->string(), std::cout);
    else fmt::print("resume: no checkpoint in checkpoint.dir \"{}\", starting at step 0\n", config.checkpoint.dir);
  }
  install_stop_signal_handlers();  // from here a SIGTERM/SIGINT finishes the step and saves
  trainer.run(std::cout);
  return 0;
}

int run_export(const ExportOptions& options) {
  export_checkpoint(options, std::cout);
  return 0;
}

int run_report(const ReportOptions& options) {
  fmt::print("report: {}\n", write_report(options.run_dir, options.output));
  return 0;
}

int run_bench(const BenchOptions& options) {
  RunConfig config = resolve_config(options.config_path, options.overrides);
#ifdef MOE_HAVE_CUDA
  run_gpu_bench(config, options.warmup_steps, options.timed_steps, std::cout, options.ep_loopback);
  if (options.kernels) run_kernel_bench(config, std::cout);
  return 0;
#else
  MOE_CONFIG_ERROR("moe bench times the GPU path, and this build has no CUDA backend");
#endif
}

int run_all_to_all_bench(const AllToAllBenchOptions& options) {
  RunConfig config = resolve_config(options.config_path, options.overrides);
  std::unique_ptr<dist::Communicator> world = dist::make_world_communicator(resolve_parallel_backend(config));
  dist::run_all_to_all_bench(config, *world, options.warmup, options.iters, std::cout);
  return 0;
}

int run_config(const ConfigOptions& options) {
  RunConfig config = resolve_config(options.config_path, options.overrides);
  std::cout << config_to_toml(config);
  return 0;
}

}  // namespace moe

#include "cli/commands.h"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "core/atomic_file.h"
#include "core/build_info.h"
#include "core/threads.h"
#include "dist/all_reduce_bench.h"
#include "dist/all_to_all_bench.h"
#include "dist/communicator.h"
#include "obs/dashboard.h"
#include "obs/report.h"
#include "train/backends/backend_factory.h"
#include "train/checkpoint.h"
#include "train/hardware_description.h"
#include "train/hf_import.h"
#ifdef MOE_HAVE_CUDA
#include "dist/cuda/thread_communicator.h"
#include "train/cuda/gpu_bench.h"
#endif
#include "train/signals.h"
#include "train/text_data.h"
#include "train/trainer.h"

namespace moe {
namespace {

// The config as this process runs it: defaults, file and overrides, with what the machine
// decides resolved (training.fp8_gemm_backend and bf16_gemm_backend = auto), so the run's saved config says it.
RunConfig resolve_config(const std::string& path, std::vector<std::string> overrides) {
  RunConfig config = path.empty() ? parse_config("", "defaults", overrides) : load_config(path, overrides);
  resolve_gemm_backends(config);
  return config;
}

}  // namespace

namespace {

void print_data(const RunConfig& config, const TextData& data) {
  fmt::print("data: {} | tokenizer {} (vocab {}) | train {} docs, {} tokens | validation {} docs, {} tokens\n",
             data.description, data.tokenizer_name, config.model.vocab_size, data.train_docs, data.train_tokens,
             data.val_docs, data.val_tokens);
}

std::optional<std::filesystem::path> resume_path(const TrainOptions& options, const RunConfig& config) {
  if (!options.resume) return std::nullopt;
  // auto: the newest complete checkpoint, or a fresh start when there is none yet.
  std::optional<std::filesystem::path> path;
  if (*options.resume != "auto") path = *options.resume;
  else if (!config.checkpoint.dir.empty()) path = latest_checkpoint(config.checkpoint.dir);
  if (path && !std::filesystem::exists(*path))
    MOE_CONFIG_ERROR("--resume {}: no such checkpoint directory", path->string());
  if (!path) fmt::print("resume: no checkpoint in checkpoint.dir \"{}\", starting at step 0\n", config.checkpoint.dir);
  return path;
}

// --thread-ranks N: N trainers in N threads on this GPU, one rank each
// (dist::make_thread_communicators); rank 0 prints and writes. Each loads its own data.
int run_thread_ranks(const TrainOptions& options, const RunConfig& config, int threads) {
#ifdef MOE_HAVE_CUDA
  if (options.dashboard_port) MOE_CONFIG_ERROR("--thread-ranks runs without the dashboard");
  if (config.training.device != TrainingDevice::Cuda)
    MOE_CONFIG_ERROR("--thread-ranks rehearses GPU ranks on one GPU: it needs training.device = cuda (got {})",
                     name_of(config.training.device));
  const int n = *options.thread_ranks;
  const std::optional<std::filesystem::path> resume = resume_path(options, config);
  fmt::print("thread ranks: {} ranks as threads on this one GPU (a rehearsal: the numbers of {} GPUs, not their speed)\n",
             n, n);
  const int per_node = options.thread_ranks_per_node.value_or(0);
  if (per_node > 0 && n % per_node != 0)
    MOE_CONFIG_ERROR("--thread-ranks-per-node {} does not divide --thread-ranks {}", per_node, n);
  std::vector<std::unique_ptr<dist::Communicator>> worlds = dist::make_thread_communicators(n, per_node);
  install_stop_signal_handlers();  // every rank sees the stop request: they finish the step and save together
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r)
    ranks.emplace_back([&, r] {
      try {
        std::ostringstream quiet;
        std::ostream& out = r == 0 ? std::cout : quiet;
        RunConfig rank_config = config;  // the data sets the tokenizer's vocabulary in it
        TextData data = load_text_data(rank_config, std::max(1, threads / n));
        if (r == 0) print_data(rank_config, data);
        Trainer trainer(rank_config, std::move(data.train), std::move(data.validation),
                        std::move(worlds[static_cast<size_t>(r)]));
        trainer.tokenizer_json = std::move(data.tokenizer_json);
        if (options.init_from_hf) trainer.init_from_hf(*options.init_from_hf, out);
        if (resume) trainer.resume(resume->string(), out, options.discard_newer_checkpoints);
        else if (options.resume) trainer.continue_run();
        trainer.run(out);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (std::thread& rank : ranks) rank.join();
  // The first rank's own failure (the others then time out waiting for it), rethrown as it
  // was: a ConfigError (a refused run folder, say) still exits with code 2.
  auto message = [](const std::exception_ptr& error) -> std::string {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      return e.what();
    } catch (...) {
      return "unknown error";
    }
  };
  for (const std::exception_ptr& error : errors)
    if (error && message(error).find("waited 120 s") == std::string::npos) std::rethrow_exception(error);
  for (const std::exception_ptr& error : errors)
    if (error) std::rethrow_exception(error);
  return 0;
#else
  (void)options, (void)config, (void)threads;
  MOE_CONFIG_ERROR("--thread-ranks rehearses GPU ranks, and this build has no CUDA backend");
#endif
}

}  // namespace

int run_eval(const EvalOptions& options) {
  if (!std::filesystem::is_directory(options.checkpoint))
    MOE_CONFIG_ERROR("--checkpoint {}: no such checkpoint directory", options.checkpoint);
  // The run's own config, in this one process: no output folders, every expert here.
  const std::filesystem::path config_file = std::filesystem::path(options.checkpoint) / "config.toml";
  if (!std::filesystem::is_regular_file(config_file))
    MOE_CONFIG_ERROR("--checkpoint {}: no config.toml (not a checkpoint directory)", options.checkpoint);
  std::vector<std::string> overrides = {"checkpoint.dir=",        "metrics.dir=",
                                        "parallel.backend=auto",  "parallel.expert_parallel=1",
                                        "parallel.split_experts=false", "parallel.rebalance_interval=0"};
  overrides.insert(overrides.end(), options.overrides.begin(), options.overrides.end());
  if (options.device) overrides.push_back("training.device=" + *options.device);
  RunConfig config = parse_config(read_file_bytes(config_file), config_file.string(), overrides);
  resolve_gemm_backends(config);
  if (options.batches && *options.batches < 1) MOE_CONFIG_ERROR("--batches must be >= 1, got {}", *options.batches);
  const int threads = set_num_threads(threads_in_effect(config.training.threads, "training.threads", std::cout));
  TextData data = load_text_data(config, threads);
  print_data(config, data);
  // Sequence i of the split covers its stream tokens [i S, i S + S] (data/loader.h).
  const int64_t S = config.model.seq_len, B = config.training.micro_batch;
  const int64_t sequences = (data.val_tokens + data.val_docs - 1) / S;
  if (!options.batches && sequences < B)
    MOE_CONFIG_ERROR("the held-out split holds {} sequences of {} tokens, fewer than one micro-batch of {}: lower "
                     "training.micro_batch or give --batches",
                     sequences, S, B);
  const int64_t batches = options.batches.value_or(sequences / B);
  Trainer trainer(config, std::move(data.train), std::move(data.validation));
  const int64_t step = trainer.load_weights(options.checkpoint, std::cout);
  const bool bar = isatty(STDERR_FILENO) == 1;
  const double loss = trainer.evaluate(batches, [&](int64_t done, int64_t total) {
    if (bar) fmt::print(stderr, "\reval: {}/{} micro-batches{}", done, total, done == total ? "\n" : "");
  });
  fmt::print("eval: {} (step {}) | {} x {} sequences of {} tokens{} | loss {:.4f} | perplexity {:.3f}\n",
             options.checkpoint, step, batches, B, S,
             batches * B > sequences ? fmt::format(" (the split holds {}: it repeats)", sequences) : "", loss,
             std::exp(loss));
  return 0;
}

int run_train(const TrainOptions& options) {
  std::vector<std::string> overrides = options.overrides;
  if (options.device) overrides.push_back("training.device=" + *options.device);
  if (options.threads) overrides.push_back("training.threads=" + std::to_string(*options.threads));
  if (options.discard_newer_checkpoints && !options.resume)
    MOE_CONFIG_ERROR("--discard-newer-checkpoints goes with --resume");
  if (options.init_from_hf && options.resume)
    MOE_CONFIG_ERROR("--init-from-hf starts a new run; --resume continues one: give one of them");
  if (options.init_from_hf) check_hf_model_folder(*options.init_from_hf);
  RunConfig config = resolve_config(options.config_path, overrides);
  const int threads = set_num_threads(threads_in_effect(config.training.threads, "training.threads", std::cout));
  if (options.thread_ranks) return run_thread_ranks(options, config, threads);
  if (options.thread_ranks_per_node) MOE_CONFIG_ERROR("--thread-ranks-per-node goes with --thread-ranks");
  TextData data = load_text_data(config, threads);
  print_data(config, data);
  Trainer trainer(config, std::move(data.train), std::move(data.validation));
  trainer.tokenizer_json = std::move(data.tokenizer_json);
  trainer.observer_options.progress_bar = isatty(STDOUT_FILENO) == 1;
  std::unique_ptr<Dashboard> dashboard;
  if (options.dashboard_port) {
    dashboard = std::make_unique<Dashboard>(*options.dashboard_port);
    trainer.observer_options.feed = &dashboard->feed();
    fmt::print("dashboard: {}\n", dashboard->url());
    std::fflush(stdout);
  }
  if (options.init_from_hf) trainer.init_from_hf(*options.init_from_hf, std::cout);
  if (options.resume) {
    if (const auto path = resume_path(options, config))
      trainer.resume(path->string(), std::cout, options.discard_newer_checkpoints);
    else trainer.continue_run();  // nothing saved yet: start over, in the same run
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
  const auto has_section = [&](const char* name) {
    return std::find(options.kernel_sections.begin(), options.kernel_sections.end(), name) !=
           options.kernel_sections.end();
  };
  if (options.sustain_ms > 0 && (has_section("swiglu") || has_section("wgrad")))
    MOE_CONFIG_ERROR("moe bench --sustain-ms times the gemms and fp8 sections only, not swiglu or wgrad");
#ifdef MOE_HAVE_CUDA
  if (!options.json.empty() && (config.training.cuda_graphs || options.ep_loopback))
    MOE_CONFIG_ERROR("moe bench --json needs the phase split: without training.cuda_graphs and --ep-loopback");
  const GpuBenchResult result =
      options.no_steps ? GpuBenchResult{}
                       : run_gpu_bench(config,
                                       GpuBenchOptions{options.warmup_steps, options.timed_steps, options.ep_loopback,
                                                       options.sm_clocks},
                                       std::cout);
  if (!options.json.empty()) {
    ComputeProfile profile;
    profile.source = fmt::format("moe bench {}; {}", options.config_path, build_info());
    profile.peak_tflops = 989;  // the MFU formula's dense bf16 peak (H100/H200)
    profile.hbm_tb_s = 4.8;     // H200 HBM3e
    profile.config = config;
    profile.phase_ms = result.phase_ms;
    write_file_atomic(options.json, compute_profile_json(profile));
    fmt::print("compute profile written to {}\n", options.json);
  }
  if (options.kernels) {
    KernelBenchOptions kernels{.sustain_ms = static_cast<double>(options.sustain_ms)};
    if (!options.kernel_sections.empty()) {
      kernels.gemms = has_section("gemms");
      kernels.swiglu = has_section("swiglu");
      kernels.wgrad = has_section("wgrad");
      kernels.fp8 = has_section("fp8");
    }
    run_kernel_bench(config, std::cout, kernels);
  }
  return 0;
#else
  MOE_CONFIG_ERROR("moe bench times the GPU path, and this build has no CUDA backend");
#endif
}

int run_all_to_all_bench(const AllToAllBenchOptions& options) {
  RunConfig config = resolve_config(options.config_path, options.overrides);
  std::unique_ptr<dist::Communicator> world = dist::make_world_communicator(resolve_comm_backend(config));
  const auto results = dist::run_all_to_all_bench(config, *world, options.warmup, options.iters, std::cout);
  if (!options.json.empty() && world->rank() == 0) {
    write_file_atomic(options.json, all_to_all_bench_json(results, world->backend()));
    fmt::print("a2a-bench results written to {}\n", options.json);
  }
  return 0;
}

int run_all_reduce_bench(const AllReduceBenchOptions& options) {
  RunConfig config = resolve_config(options.config_path, options.overrides);
  std::unique_ptr<dist::Communicator> world = dist::make_world_communicator(resolve_comm_backend(config));
  const dist::AllReduceSweep sweep =
      dist::run_all_reduce_bench(*world, options.min_bytes, options.max_bytes, options.warmup, options.iters, std::cout);
  if (!options.json.empty() && world->rank() == 0) {
    write_file_atomic(options.json, all_reduce_bench_json(sweep, world->backend()));
    fmt::print("allreduce-bench results written to {}\n", options.json);
  }
  return 0;
}

int run_config(const ConfigOptions& options) {
  RunConfig config = resolve_config(options.config_path, options.overrides);
  std::cout << config_to_toml(config);
  return 0;
}

}  // namespace moe

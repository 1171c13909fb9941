// The `moe` binary. Exit codes: 0 success, 1 runtime failure, 2 usage or config error.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/generate_command.h"
#include "cli/launch_command.h"
#include "cli/plan_command.h"
#include "cli/tokenize_commands.h"
#include "core/build_info.h"
#include "core/error.h"
#include "core/log.h"
#include "dist/mpi_communicator.h"

namespace {

constexpr const char* kOverrideHelp =
    "Any config key can be overridden as --section.key=value or --section.key value (sections: model, moe, training, "
    "optimizer, lr, data, metrics, checkpoint, parallel; every key is listed in docs/CONFIG.md), e.g. "
    "--training.steps=50 --moe.temperature=0.3 --data.dir=/path/to/text.";

// Splits CLI11's leftover arguments into "section.key=value" overrides, given as
// --section.key=value or --section.key value; anything else is a usage error.
std::vector<std::string> parse_overrides(const std::vector<std::string>& extras) {
  std::vector<std::string> overrides;
  for (size_t i = 0; i < extras.size(); ++i) {
    const std::string& arg = extras[i];
    const size_t eq = arg.find('=');
    const bool option = arg.rfind("--", 0) == 0 && arg.find('.') < eq;
    if (option && eq != std::string::npos) {
      overrides.push_back(arg.substr(2));
    } else if (option && i + 1 < extras.size() && extras[i + 1].rfind("--", 0) != 0) {
      overrides.push_back(arg.substr(2) + "=" + extras[++i]);
    } else {
      MOE_CONFIG_ERROR("unknown argument '{}' (config overrides look like --section.key=value or --section.key value)",
                       arg);
    }
  }
  return overrides;
}

}  // namespace

int main(int argc, char** argv) {
  // spdlog's lines in the console's one format, through std::cout (docs/METRICS.md).
  moe::log_to(std::cout);
  CLI::App app{"moe: Mixture-of-Experts LLM pretraining engine"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::function<std::string()>(moe::build_info),
                       "Print the commit, build type and GPU library versions, and exit");
  app.footer("Run `moe <command> --help` for the options of a command.");

  moe::TrainOptions train;
  CLI::App* train_cmd = app.add_subcommand("train", "Train a model from a TOML config");
  train_cmd->add_option("-c,--config", train.config_path, "Run config (TOML)")
      ->required()
      ->check(CLI::ExistingFile);
  train_cmd->add_option("--device", train.device, "auto | cpu | cuda (overrides training.device)");
  train_cmd->add_option("--threads", train.threads, "CPU threads, 0 (all cores) ..= 1024; above the cores: the core count (overrides training.threads)");
  train_cmd->add_option("--dashboard", train.dashboard_port,
                        "Serve a live dashboard on this port of 127.0.0.1 while training (0: a free port)")
      ->check(CLI::Range(0, 65535));
  train_cmd->add_option("--resume", train.resume,
                        "auto (the newest checkpoint in checkpoint.dir, if any) or a checkpoint directory");
  train_cmd->add_flag("--discard-newer-checkpoints", train.discard_newer_checkpoints,
                      "With --resume of an older checkpoint: delete checkpoint.dir's later ones (another timeline) "
                      "before step 1, instead of refusing");
  train_cmd->add_option("--init-from-hf", train.init_from_hf,
                        "Start from the weights of a Hugging Face Mixtral folder (continued pretraining; the config "
                        "must have its shape)");
  train_cmd->add_option("--thread-ranks", train.thread_ranks,
                        "Run this many ranks as threads sharing this one GPU: a rehearsal of a multi-GPU launch "
                        "(data and expert parallelism give the same numbers; no speed-up)")
      ->check(CLI::Range(2, 16));
  train_cmd->add_option("--thread-ranks-per-node", train.thread_ranks_per_node,
                        "With --thread-ranks: simulated nodes of this many consecutive ranks (hierarchical all-to-all)")
      ->check(CLI::Range(1, 16));
  train_cmd->allow_extras();
  train_cmd->footer(kOverrideHelp);

  moe::EvalOptions eval;
  CLI::App* eval_cmd = app.add_subcommand(
      "eval", "Loss and perplexity of a checkpoint on the held-out split of its run's data (or of --data.dir=...)");
  eval_cmd->add_option("--checkpoint", eval.checkpoint, "Checkpoint directory (checkpoint.dir/step_N)")->required();
  eval_cmd->add_option("--device", eval.device, "auto | cpu | cuda (overrides training.device)");
  eval_cmd->add_option("--batches", eval.batches,
                       "Micro-batches of training.micro_batch sequences (default: the whole held-out split; "
                       "training.val_batches gives the trainer's validation number)");
  eval_cmd->allow_extras();
  eval_cmd->footer(kOverrideHelp);

  moe::GenerateCommandOptions generate;
  CLI::App* generate_cmd = app.add_subcommand(
      "generate", "Sample text from a checkpoint with a KV cache, decoded with its run's tokenizer (docs/GENERATION.md)");
  generate_cmd->add_option("--checkpoint", generate.checkpoint, "Checkpoint directory (checkpoint.dir/step_N)")
      ->required();
  generate_cmd->add_option("--prompt", generate.prompt, "Text to continue");
  generate_cmd->add_option("--prompt-file", generate.prompt_file, "File holding the text to continue");
  generate_cmd->add_option("--max-tokens", generate.max_tokens, "New tokens at most (fewer at the end-of-text token)")
      ->default_val(generate.max_tokens);
  generate_cmd->add_option("--temperature", generate.temperature, "Softmax temperature; 0: greedy")
      ->default_val(generate.temperature);
  generate_cmd->add_option("--top-k", generate.top_k, "Sample from the k most likely tokens only; 0: all")
      ->default_val(generate.top_k);
  generate_cmd->add_option("--top-p", generate.top_p,
                           "Then from the smallest most-likely-first set holding this much probability, in (0, 1]")
      ->default_val(generate.top_p);
  generate_cmd->add_option("--seed", generate.seed, "Random seed: the same seed gives the same text")
      ->default_val(generate.seed);
  generate_cmd->add_option("--device", generate.device, "cpu | gpu | auto")->default_val(generate.device);
  generate_cmd->allow_extras();
  generate_cmd->footer(kOverrideHelp);

  moe::ConfigOptions show;
  CLI::App* config_cmd =
      app.add_subcommand("config", "Print the resolved config (defaults, file, overrides) as TOML");
  config_cmd->add_option("-c,--config", show.config_path, "Run config (TOML); defaults when omitted")
      ->check(CLI::ExistingFile);
  config_cmd->allow_extras();
  config_cmd->footer(kOverrideHelp);

  moe::BenchOptions bench;
  CLI::App* bench_cmd =
      app.add_subcommand("bench", "Time training steps on the GPU: tokens/s, MFU, memory, time by phase");
  bench_cmd->add_option("-c,--config", bench.config_path, "Run config (TOML), e.g. configs/bench/mixtral-mini.toml")
      ->required()
      ->check(CLI::ExistingFile);
  bench_cmd->add_option("--warmup", bench.warmup_steps, "Untimed steps first")->check(CLI::NonNegativeNumber);
  bench_cmd->add_option("--steps", bench.timed_steps, "Timed steps (the median is reported)")->check(CLI::PositiveNumber);
  CLI::Option* kernels_flag =
      bench_cmd->add_flag("--kernels", bench.kernels, "Also time the expert GEMMs one by one against the dense ceiling");
  bench_cmd
      ->add_option("--sustain-ms", bench.sustain_ms,
                   "With --kernels: run each expert GEMM back to back for this long instead (its rate under the "
                   "board's power limit, with the clock and power)")
      ->check(CLI::Range(0, 600000))
      ->needs(kernels_flag);
  CLI::Option* no_steps_flag =
      bench_cmd->add_flag("--no-steps", bench.no_steps, "With --kernels: time the kernels only, no training steps first")
          ->needs(kernels_flag);
  bench_cmd
      ->add_option("--kernel-sections", bench.kernel_sections,
                   "With --kernels: only these parts, comma-separated: gemms (the six expert GEMMs), swiglu (our "
                   "fused SwiGLU kernels against GEMM + pass), wgrad (the gate|up weight gradient's output variants), "
                   "fp8 (the fp8 section)")
      ->delimiter(',')
      ->check(CLI::IsMember({"gemms", "swiglu", "wgrad", "fp8"}))
      ->needs(kernels_flag);
  bench_cmd
      ->add_option("--json", bench.json,
                   "Also write the phase times as a compute profile JSON (moe plan --simulate --compute)")
      ->excludes(no_steps_flag);
  bench_cmd->add_flag("--ep-loopback", bench.ep_loopback,
                      "Run the expert-parallel path over this one GPU (exchanges as device copies): its own cost");
  bench_cmd->add_flag("--sm-clocks", bench.sm_clocks,
                      "Also each phase's mean SM clock, from the SMs' cycle counters (a small kernel at each phase "
                      "boundary)")
      ->excludes(no_steps_flag);
  bench_cmd->allow_extras();
  bench_cmd->footer(kOverrideHelp);

  moe::AllToAllBenchOptions a2a;
  CLI::App* a2a_cmd = app.add_subcommand(
      "a2a-bench", "Time the MoE dispatch and combine exchanges alone over the launch's ranks, flat and hierarchical");
  a2a_cmd->add_option("-c,--config", a2a.config_path, "Run config (TOML): token counts, parallel.* groups and backend")
      ->check(CLI::ExistingFile);
  a2a_cmd->add_option("--warmup", a2a.warmup, "Untimed exchanges first")->check(CLI::NonNegativeNumber);
  a2a_cmd->add_option("--iters", a2a.iters, "Timed exchanges (the median is reported)")->check(CLI::PositiveNumber);
  a2a_cmd->add_option("--json", a2a.json, "Rank 0 also writes the results to this JSON file (moe plan --simulate --collectives)");
  a2a_cmd->allow_extras();
  a2a_cmd->footer(kOverrideHelp);

  moe::AllReduceBenchOptions ar;
  CLI::App* ar_cmd = app.add_subcommand(
      "allreduce-bench", "Time fp32 all-reduces over the launch's ranks, sizes doubling from --min-bytes to --max-bytes");
  ar_cmd->add_option("-c,--config", ar.config_path, "Run config (TOML): parallel.backend")->check(CLI::ExistingFile);
  ar_cmd->add_option("--min-bytes", ar.min_bytes, "Smallest buffer (a multiple of 4)")->check(CLI::PositiveNumber);
  ar_cmd->add_option("--max-bytes", ar.max_bytes, "Largest buffer (a multiple of 4)")->check(CLI::PositiveNumber);
  ar_cmd->add_option("--warmup", ar.warmup, "Untimed all-reduces per size first")->check(CLI::NonNegativeNumber);
  ar_cmd->add_option("--iters", ar.iters, "Timed all-reduces per size (the median is reported)")
      ->check(CLI::PositiveNumber);
  ar_cmd->add_option("--json", ar.json, "Rank 0 also writes the sweep to this JSON file (moe plan --simulate --collectives)");
  ar_cmd->allow_extras();
  ar_cmd->footer(kOverrideHelp);

  moe::PlanOptions plan;
  CLI::App* plan_cmd = app.add_subcommand(
      "plan", "Estimate the per-GPU memory of a training layout and list the layouts that fit (docs/MEMORY_PLAN.md)");
  plan_cmd->add_option("-c,--config", plan.config_path, "Run config (TOML)")->required()->check(CLI::ExistingFile);
  plan_cmd->add_option("--gpus", plan.gpus, "GPUs (ranks) of the launch (default: parallel.expert_parallel)")
      ->check(CLI::PositiveNumber);
  plan_cmd->add_option("--gpus-per-node", plan.gpus_per_node, "GPUs per node (default: 8, or --gpus when fewer)")
      ->check(CLI::PositiveNumber);
  plan_cmd->add_option("--gpu-memory-gb", plan.gpu_memory_gb, "Memory of one GPU in GB (default 141: an H200)")
      ->check(CLI::PositiveNumber);
  plan_cmd->add_option("--layouts", plan.max_layouts, "Fitting layouts to print, best first")
      ->check(CLI::PositiveNumber);
  plan_cmd->add_flag("--simulate", plan.simulate,
                     "Predict the step time by phase, flat and hierarchical all-to-all (docs/SIMULATOR.md)");
  plan_cmd->add_option("--hardware", plan.hardware, "With --simulate: hardware description (configs/hardware/*.toml)")
      ->check(CLI::ExistingFile);
  plan_cmd->add_option("--compute", plan.compute, "With --simulate: measured compute profile (moe bench --json)")
      ->check(CLI::ExistingFile);
  plan_cmd->add_option("--collectives", plan.collectives,
                       "With --simulate: measured collectives inside one node (moe a2a-bench --json, moe allreduce-bench "
                       "--json; repeat for both)")
      ->check(CLI::ExistingFile);
  plan_cmd->add_option("--micro-batches", plan.micro_batches,
                       "With --simulate: micro-batches per GPU per step (default: from training.global_batch_tokens)")
      ->check(CLI::PositiveNumber);
  CLI::Option* rank_imbalance =
      plan_cmd
          ->add_option("--expert-imbalance", plan.expert_imbalance,
                       "With --simulate: the busiest EP rank's expert rows over the mean, less 1 (default 0)")
          ->check(CLI::NonNegativeNumber);
  plan_cmd
      ->add_option("--expert-load-imbalance", plan.expert_load_imbalance,
                   "With --simulate: the logged per-expert imbalance (max over experts of assignments / mean, less "
                   "1); the busiest rank holds the busiest expert and an even share of the rest")
      ->check(CLI::NonNegativeNumber)
      ->excludes(rank_imbalance);
  plan_cmd
      ->add_option("--expert-loads", plan.expert_loads,
                   "With --simulate: a run's metrics.jsonl; the busiest EP rank's rows from its logged "
                   "tokens_per_expert (consecutive experts per rank), mean over steps and layers")
      ->check(CLI::ExistingFile)
      ->excludes(rank_imbalance)
      ->excludes("--expert-load-imbalance");
  plan_cmd->add_flag("--json", plan.json, "With --simulate: one JSON object instead of the table");
  plan_cmd->allow_extras();
  plan_cmd->footer(kOverrideHelp);

  moe::ReportOptions report;
  CLI::App* report_cmd =
      app.add_subcommand("report", "Write a run's dashboard as one self-contained HTML file from its metrics.jsonl");
  report_cmd->add_option("run_dir", report.run_dir, "The run's metrics.dir (holds metrics.jsonl)")->required();
  report_cmd->add_option("-o,--output", report.output, "HTML file to write (default RUN_DIR/report.html)");

  moe::ExportOptions export_options;
  CLI::App* export_cmd = app.add_subcommand("export", "Export a checkpoint as a Hugging Face model folder");
  export_cmd->add_option("--format", export_options.format, "hf (a Mixtral config.json + safetensors)")
      ->default_val("hf");
  export_cmd->add_option("--checkpoint", export_options.checkpoint, "Checkpoint directory (checkpoint.dir/step_N)")
      ->required();
  export_cmd->add_option("--output", export_options.output, "Folder to create")->required();
  export_cmd->add_option("--max-shard-bytes", export_options.max_shard_bytes,
                         "Split model.safetensors into shards with an index past this size")
      ->default_val(export_options.max_shard_bytes);
  export_cmd->add_flag("--allow-inexact", export_options.allow_inexact,
                       "Drop a non-zero router or balancing bias (which Mixtral cannot hold) with a warning");

  moe::TokenizerTrainOptions tok_train;
  CLI::App* tokenizer_cmd = app.add_subcommand("tokenizer", "Tokenizer tools");
  tokenizer_cmd->require_subcommand(1);
  CLI::App* tok_train_cmd = tokenizer_cmd->add_subcommand("train", "Train a byte-level BPE tokenizer (writes a HF tokenizer.json)");
  tok_train_cmd->add_option("--vocab-size", tok_train.vocab_size, "Vocabulary size, special tokens and 256 bytes included")->required();
  tok_train_cmd->add_option("--input", tok_train.input.paths, "Text files, directories or .jsonl files")->required();
  tok_train_cmd->add_option("--output", tok_train.output, "tokenizer.json to write")->required();
  tok_train_cmd->add_option("--pattern", tok_train.pattern, "Pre-tokeniser: gpt2 | llama3 | qwen2")->default_val("llama3");
  tok_train_cmd->add_option("--special", tok_train.specials,
                            "Special tokens (repeat the option); the first ends documents (docs/TOKENIZER.md)")
      ->default_val("<|endoftext|>");
  tok_train_cmd->add_option("--extension", tok_train.input.extension, "In directories, only files ending with this");
  tok_train_cmd->add_option("--text-field", tok_train.input.text_field, "JSONL field holding the text")->default_val("text");
  tok_train_cmd->add_option("--threads", tok_train.threads, "Threads, 0 (all cores) ..= 1024")->default_val(0);

  moe::TokenizerBenchOptions tok_bench;
  CLI::App* tok_bench_cmd = tokenizer_cmd->add_subcommand("bench", "Measure encode throughput on text in memory");
  tok_bench_cmd->add_option("--tokenizer", tok_bench.tokenizer, "tokenizer.json, byte, tiktoken:<pattern>:<file> or sentencepiece:<file.model>")->required();
  tok_bench_cmd->add_option("--input", tok_bench.input.paths, "Text files, directories or .jsonl files")->required();
  tok_bench_cmd->add_option("--extension", tok_bench.input.extension, "In directories, only files ending with this");
  tok_bench_cmd->add_option("--threads", tok_bench.threads, "Threads")->default_val(1);
  tok_bench_cmd->add_option("--repeats", tok_bench.repeats, "Timed passes (the median is reported)")->default_val(3);
  tok_bench_cmd->add_option("--min-pass-mb", tok_bench.min_pass_mb,
                            "Repeat the documents whole in each pass until it holds >= this many MB (0: once)")
      ->default_val(tok_bench.min_pass_mb);

  moe::TokenizeCommandOptions tokenize;
  CLI::App* tokenize_cmd = app.add_subcommand("tokenize", "Encode text into binary token shards for training");
  tokenize_cmd->add_option("--tokenizer", tokenize.tokenizer, "tokenizer.json (or hf:<path>), byte, tiktoken:<gpt2|llama3|qwen2>:<file>, sentencepiece:<path> or a .model path")->required();
  tokenize_cmd->add_option("--input", tokenize.tokenize.input.paths, "Text files, directories or .jsonl files")->required();
  tokenize_cmd->add_option("--output", tokenize.tokenize.output_dir, "Folder for train_*.bin (and val_*.bin)")->required();
  tokenize_cmd->add_option("--text-field", tokenize.tokenize.input.text_field, "JSONL field holding the text")->default_val("text");
  tokenize_cmd->add_option("--extension", tokenize.tokenize.input.extension, "In directories, only files ending with this");
  tokenize_cmd->add_option("--threads", tokenize.tokenize.threads, "Threads, 0 (all cores) ..= 1024")->default_val(0);
  tokenize_cmd->add_option("--shard-tokens", tokenize.tokenize.shard_tokens, "Start a new shard after this many tokens")
      ->default_val(tokenize.tokenize.shard_tokens);
  tokenize_cmd->add_option("--val-fraction", tokenize.tokenize.val_fraction,
                           "Share of documents (by name hash, as data.val_fraction) written to val_*.bin")->default_val(0.0);
  bool no_progress = false;
  tokenize_cmd->add_flag("--no-progress", no_progress, "No progress line on stderr");

  moe::LaunchOptions launch;
  CLI::App* launch_cmd = moe::add_launch_command(app, launch);

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
  } catch (const CLI::CallForVersion& e) {
    std::cout << e.what() << "\n";
    return 0;
  } catch (const CLI::ParseError& e) {
    std::cerr << "moe: " << e.what() << "\n";
    return 2;
  }

  try {
    if (*train_cmd) {
      train.overrides = parse_overrides(train_cmd->remaining());
      return moe::run_train(train);
    }
    if (*eval_cmd) {
      eval.overrides = parse_overrides(eval_cmd->remaining());
      return moe::run_eval(eval);
    }
    if (*generate_cmd) {
      generate.overrides = parse_overrides(generate_cmd->remaining());
      return moe::run_generate(generate, std::cout, std::cerr);
    }
    if (*launch_cmd) return moe::run_launch(launch);
    if (*plan_cmd) {
      plan.overrides = parse_overrides(plan_cmd->remaining());
      return moe::run_plan(plan, std::cout);
    }
    if (*report_cmd) return moe::run_report(report);
    if (*export_cmd) return moe::run_export(export_options);
    if (*tok_train_cmd) return moe::run_tokenizer_train(tok_train);
    if (*tok_bench_cmd) return moe::run_tokenizer_bench(tok_bench);
    if (*tokenize_cmd) {
      tokenize.tokenize.progress = !no_progress;
      return moe::run_tokenize(tokenize);
    }
    if (*config_cmd) {
      show.overrides = parse_overrides(config_cmd->remaining());
      return moe::run_config(show);
    }
    if (*ar_cmd) {
      ar.overrides = parse_overrides(ar_cmd->remaining());
      return moe::run_all_reduce_bench(ar);
    }
    if (*a2a_cmd) {
      a2a.overrides = parse_overrides(a2a_cmd->remaining());
      return moe::run_all_to_all_bench(a2a);
    }
    if (*bench_cmd) {
      bench.overrides = parse_overrides(bench_cmd->remaining());
      return moe::run_bench(bench);
    }
  } catch (const moe::ConfigError& e) {
    std::cerr << "moe: error: " << e.what() << "\n";
    moe::dist::abort_mpi_world_if_running(2);  // the other ranks may wait in a collective
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "moe: error: " << e.what() << "\n";
    moe::dist::abort_mpi_world_if_running(1);
    return 1;
  }
  return 0;
}

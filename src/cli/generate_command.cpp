#include "cli/generate_command.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <chrono>
#include <filesystem>
#include <vector>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/threads.h"
#include "model/generator.h"
#include "train/checkpoint_model.h"
#include "train/text_data.h"

namespace moe {
namespace {

// The prompt text from --prompt or --prompt-file (exactly one, not empty).
std::string read_prompt(const GenerateCommandOptions& options) {
  if (options.prompt && options.prompt_file) MOE_CONFIG_ERROR("give --prompt or --prompt-file, not both");
  if (!options.prompt && !options.prompt_file) MOE_CONFIG_ERROR("give the text to continue as --prompt or --prompt-file");
  std::string text;
  if (options.prompt) {
    text = *options.prompt;
  } else {
    if (!std::filesystem::is_regular_file(*options.prompt_file))
      MOE_CONFIG_ERROR("--prompt-file {}: no such file", *options.prompt_file);
    text = read_file_bytes(*options.prompt_file);
  }
  if (text.empty()) MOE_CONFIG_ERROR("{} is empty: there is nothing to continue", options.prompt ? "--prompt" : "--prompt-file");
  return text;
}

}  // namespace

int run_generate(const GenerateCommandOptions& options, std::ostream& out, std::ostream& log) {
  // Everything that needs no checkpoint is checked before loading one.
  const std::string prompt = read_prompt(options);
  if (options.max_tokens < 1) MOE_CONFIG_ERROR("--max-tokens must be >= 1, got {}", options.max_tokens);
  GenerateOptions generate_options;
  generate_options.max_tokens = options.max_tokens;
  generate_options.sampling = SamplingOptions{options.temperature, options.top_k, options.top_p};
  generate_options.seed = options.seed;
  check_sampling_options(generate_options.sampling);
  if (options.device != "cpu" && options.device != "gpu" && options.device != "auto")
    MOE_CONFIG_ERROR("--device must be cpu, gpu or auto, got \"{}\"", options.device);

  CheckpointModel loaded = load_checkpoint_model(options.checkpoint, options.overrides, log);
  const RunConfig& config = loaded.config;
  const int threads = set_num_threads(threads_in_effect(config.training.threads, "training.threads", log));
  // The checkpoint's own tokenizer.json; older checkpoints: found again from the run's data.
  std::string how = "kept in the checkpoint";
  const std::unique_ptr<Tokenizer> tokenizer = loaded.tokenizer_json.empty()
                                                   ? load_run_tokenizer(config.data, threads, how)
                                                   : tokenizer_from_hf_json(loaded.tokenizer_json, config.data.tokenizer);
  if (tokenizer->vocab_size() > config.model.vocab_size)
    MOE_CONFIG_ERROR("--checkpoint {}: the {} tokenizer's vocabulary of {} is larger than the model's {}",
                     options.checkpoint, tokenizer->name(), tokenizer->vocab_size(), config.model.vocab_size);
  const std::vector<int32_t> prompt_ids = tokenizer->encode(prompt);
  const int64_t context = config.model.seq_len;
  if (static_cast<int64_t>(prompt_ids.size()) > context)
    MOE_CONFIG_ERROR("the prompt is {} tokens, longer than the model's context of {} (model.seq_len)",
                     prompt_ids.size(), context);
  generate_options.eos = tokenizer->eos_id();
  std::unique_ptr<Decoder> decoder = make_decoder(*loaded.model, options.device);
  const SamplingOptions& s = generate_options.sampling;
  fmt::print(log, "generate: {} (step {}) | tokenizer {}{} | prompt {} tokens, context {} | {} | {} | seed {}\n",
             options.checkpoint, loaded.step, tokenizer->name(), how.empty() ? "" : " (" + how + ")", prompt_ids.size(),
             context, decoder->device(),
             s.temperature == 0 ? std::string("greedy")
                                : fmt::format("temperature {}, top-k {}, top-p {}", s.temperature, s.top_k, s.top_p),
             options.seed);
  log.flush();

  out << prompt;
  out.flush();
  const auto start = std::chrono::steady_clock::now();
  const GenerateResult result = generate(*decoder, prompt_ids, generate_options, [&](int32_t token) {
    out << tokenizer->decode(std::span<const int32_t>(&token, 1));
    out.flush();
  });
  out << "\n";
  out.flush();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fmt::print(log, "generate: {} tokens in {:.2f} s ({:.1f} tokens/s){}{}\n", result.tokens.size(), seconds,
             seconds > 0 ? static_cast<double>(result.tokens.size()) / seconds : 0.0,
             result.stopped_at_eos ? ", stopped at the end-of-text token" : "",
             result.slides > 0 ? fmt::format(", the context window slid {} time{}", result.slides,
                                             result.slides == 1 ? "" : "s")
                               : "");
  return 0;
}

}  // namespace moe

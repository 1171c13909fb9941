#include "cli/tokenize_commands.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "data/bpe_train.h"

namespace moe {

int run_tokenizer_train(const TokenizerTrainOptions& options) {
  auto pattern = pattern_from_name(options.pattern);
  if (!pattern) MOE_CONFIG_ERROR("--pattern must be one of gpt2, llama3, qwen2, got '{}'", options.pattern);
  if (options.vocab_size <= 0 || options.vocab_size > (int64_t{1} << 31) - 1)
    MOE_CONFIG_ERROR("--vocab-size must be in [1, 2^31), got {}", options.vocab_size);
  if (options.specials.empty()) MOE_CONFIG_ERROR("--special: at least one special token (the EOS) is needed");
  const auto start = std::chrono::steady_clock::now();
  std::vector<Document> docs = read_all_inputs(options.input);
  std::vector<std::string_view> texts;
  int64_t bytes = 0;
  for (const Document& d : docs) texts.push_back(d.text), bytes += static_cast<int64_t>(d.text.size());
  BpeTrainOptions train;
  train.vocab_size = options.vocab_size;
  train.pattern = *pattern;
  train.specials = options.specials;
  train.threads = options.threads;
  BpeModel model = train_bpe(texts, train);
  save_hf_tokenizer(model, options.output);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fmt::print("tokenizer: {} docs, {:.1f} MB, pattern {} | vocab {} ({} merges) | {:.1f} s -> {}\n", docs.size(),
             static_cast<double>(bytes) / 1e6, options.pattern, model.vocab.size(), model.merges.size(), seconds,
             options.output);
  return 0;
}

int run_tokenize(const TokenizeCommandOptions& options) {
  std::unique_ptr<Tokenizer> tokenizer = make_tokenizer(options.tokenizer);
  TokenizeStats stats = tokenize_to_shards(*tokenizer, options.tokenize);
  fmt::print("tokenize: {} docs, {:.1f} MB -> {} tokens in {} shards ({} ids) | {:.1f} s, {:.1f} MB/s -> {}\n",
             stats.docs, static_cast<double>(stats.bytes) / 1e6, stats.tokens, stats.shards,
             tokenizer->vocab_size() <= 65536 ? "uint16" : "uint32", stats.seconds,
             static_cast<double>(stats.bytes) / 1e6 / std::max(stats.seconds, 1e-9), options.tokenize.output_dir);
  return 0;
}

int run_tokenizer_bench(const TokenizerBenchOptions& options) {
  if (options.threads <= 0 || options.repeats <= 0) MOE_CONFIG_ERROR("--threads and --repeats must be positive");
  std::unique_ptr<Tokenizer> tokenizer = make_tokenizer(options.tokenizer);
  std::vector<Document> docs = read_all_inputs(options.input);
  int64_t bytes = 0;
  for (const Document& d : docs) bytes += static_cast<int64_t>(d.text.size());
  int64_t tokens = tokenize_documents(docs, *tokenizer, options.threads).n_tokens();  // warm-up
  std::vector<double> seconds;
  for (int r = 0; r < options.repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    tokens = tokenize_documents(docs, *tokenizer, options.threads).n_tokens();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  fmt::print("bench: threads={} docs={} bytes={} tokens={} seconds={:.4f} mb_per_s={:.2f}\n", options.threads,
             docs.size(), bytes, tokens, median, static_cast<double>(bytes) / 1e6 / median);
  return 0;
}

}  // namespace moe

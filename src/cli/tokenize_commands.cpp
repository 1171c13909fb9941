#include "cli/tokenize_commands.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>

#include "core/error.h"
#include "core/threads.h"
#include "data/bpe_train.h"

namespace moe {

int run_tokenizer_train(const TokenizerTrainOptions& options) {
  auto pattern = pattern_from_name(options.pattern);
  if (!pattern) MOE_CONFIG_ERROR("--pattern must be one of gpt2, llama3, qwen2, got '{}'", options.pattern);
  if (options.vocab_size <= 0 || options.vocab_size > (int64_t{1} << 31) - 1)
    MOE_CONFIG_ERROR("--vocab-size must be in [1, 2^31), got {}", options.vocab_size);
  check_specials(options.specials);
  const auto start = std::chrono::steady_clock::now();
  std::vector<Document> docs = read_all_inputs(options.input);
  std::vector<std::string_view> texts;
  int64_t bytes = 0;
  for (const Document& d : docs) texts.push_back(d.text), bytes += static_cast<int64_t>(d.text.size());
  BpeTrainOptions train;
  train.vocab_size = options.vocab_size;
  train.pattern = *pattern;
  train.specials = options.specials;
  train.threads = threads_in_effect(options.threads, "--threads", std::cerr);
  BpeModel model = train_bpe(texts, train);
  save_hf_tokenizer(model, options.output);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fmt::print("tokenizer: {} docs, {:.1f} MB, pattern {} | vocab {} ({} merges) | {:.1f} s -> {}\n", docs.size(),
             static_cast<double>(bytes) / 1e6, options.pattern, model.vocab.size(), model.merges.size(), seconds,
             options.output);
  return 0;
}

int run_tokenize(const TokenizeCommandOptions& options) {
  TokenizeOptions tokenize = options.tokenize;
  tokenize.threads = threads_in_effect(tokenize.threads, "--threads", std::cerr);
  std::unique_ptr<Tokenizer> tokenizer = make_tokenizer(options.tokenizer);
  TokenizeStats stats = tokenize_to_shards(*tokenizer, tokenize);
  fmt::print("tokenize: {} docs, {:.1f} MB -> {} tokens in {} shards ({} ids) | {:.1f} s, {:.1f} MB/s -> {}\n",
             stats.docs, static_cast<double>(stats.bytes) / 1e6, stats.tokens, stats.shards,
             tokenizer->vocab_size() <= 65536 ? "uint16" : "uint32", stats.seconds,
             static_cast<double>(stats.bytes) / 1e6 / std::max(stats.seconds, 1e-9), options.tokenize.output_dir);
  return 0;
}

int run_tokenizer_bench(const TokenizerBenchOptions& options) {
  if (options.threads <= 0 || options.repeats <= 0) MOE_CONFIG_ERROR("--threads and --repeats must be positive");
  check_thread_count(options.threads, "--threads");  // a bench measures what it is asked: not lowered to the cores
  if (!(options.min_pass_mb >= 0 && options.min_pass_mb <= 1e6))
    MOE_CONFIG_ERROR("--min-pass-mb must be in [0, 1e6], got {}", options.min_pass_mb);
  std::unique_ptr<Tokenizer> tokenizer = make_tokenizer(options.tokenizer);
  std::vector<Document> docs = read_all_inputs(options.input);
  int64_t corpus_bytes = 0;
  for (const Document& d : docs) corpus_bytes += static_cast<int64_t>(d.text.size());
  const double want = std::ceil(options.min_pass_mb * 1e6 / static_cast<double>(std::max<int64_t>(corpus_bytes, 1)));
  const auto copies = static_cast<int64_t>(std::max(1.0, want));
  std::vector<std::string_view> texts;
  texts.reserve(docs.size() * static_cast<size_t>(copies));
  for (int64_t c = 0; c < copies; ++c)
    for (const Document& d : docs) texts.push_back(d.text);
  const int64_t bytes = corpus_bytes * copies;  // per pass

  ParallelEncoder encoder(*tokenizer, options.threads);
  TokenizedDocuments out;
  auto now = [] { return std::chrono::steady_clock::now(); };
  double pass_seconds = 0;
  for (int warm = 0; warm < 2; ++warm) {  // the second pass finds the per-thread caches filled
    const auto start = now();
    encoder.encode(texts, out);
    pass_seconds = std::chrono::duration<double>(now() - start).count();
  }
  const int64_t tokens = out.n_tokens();
  const double fill = std::ceil(options.min_seconds / std::max(pass_seconds, 1e-6));
  const auto passes = static_cast<int>(std::clamp(fill, 1.0, 1e6));
  encoder.reset_profile();
  std::vector<double> seconds;  // per pass, one entry per sample
  for (int r = 0; r < options.repeats; ++r) {
    const auto start = now();
    for (int p = 0; p < passes; ++p) encoder.encode(texts, out);
    seconds.push_back(std::chrono::duration<double>(now() - start).count() / passes);
    MOE_CHECK(out.n_tokens() == tokens, "token count changed between passes: {} vs {}", out.n_tokens(), tokens);
  }
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  const double mb = static_cast<double>(bytes) / 1e6;
  // Per timed pass: serial preparation, parallel encoding (and the share of it threads were
  // idle: late start, the schedule's tail), serial offsets, parallel copy; and the encoding
  // speed of one busy thread (if it falls as threads are added, the threads slow each other
  // down: shared cache, memory, clock; if idle_pct or the serial parts grow, it is Amdahl);
  // piece-cache misses per MB (each thread's cache only learns from the text it encodes).
  const ParallelEncoder::Profile& p = encoder.profile();
  const double n = static_cast<double>(std::max<int64_t>(p.passes, 1)), ms = 1e3 / n;
  const double idle = 1.0 - p.busy_seconds / std::max(p.encode_seconds * options.threads, 1e-12);
  fmt::print("bench: threads={} docs={} copies={} corpus_bytes={} bytes={} tokens={} chunks={} passes_per_sample={} "
             "samples={} seconds={:.5f} mb_per_s={:.2f} mb_per_s_min={:.2f} mb_per_s_max={:.2f} prep_ms={:.3f} "
             "encode_ms={:.3f} idle_pct={:.2f} offsets_ms={:.3f} copy_ms={:.3f} busy_thread_mb_per_s={:.2f} "
             "cache_misses_per_mb={:.1f}\n",
             options.threads, texts.size(), copies, corpus_bytes, bytes, tokens, encoder.last_chunks(), passes,
             options.repeats, median, mb / median, mb / seconds.back(), mb / seconds.front(), p.prep_seconds * ms,
             p.encode_seconds * ms, 100 * idle, p.offsets_seconds * ms, p.copy_seconds * ms,
             mb * n / std::max(p.busy_seconds, 1e-12), static_cast<double>(p.cache_misses) / n / mb);
  return 0;
}

}  // namespace moe

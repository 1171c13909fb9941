// `moe tokenizer train` and `moe tokenize`, callable from tests without a process.
#pragma once
#include <string>
#include <vector>

#include "data/tokenize_files.h"

namespace moe {

struct TokenizerTrainOptions {
  InputOptions input;
  std::string output;             // tokenizer.json
  int64_t vocab_size = 0;
  std::string pattern = "llama3"; // gpt2 | llama3 | qwen2
  std::vector<std::string> specials = {"<|endoftext|>"};
  int threads = 0;
};

struct TokenizeCommandOptions {
  std::string tokenizer;  // "byte", a tokenizer.json, or tiktoken:<pattern>:<file>
  TokenizeOptions tokenize;
};

struct TokenizerBenchOptions {
  std::string tokenizer;
  InputOptions input;
  int threads = 1;
  int repeats = 3;            // timed samples; the median is reported
  double min_seconds = 1.0;   // each sample repeats whole passes over the corpus until this long
  double min_pass_mb = 64;    // a pass encodes the documents this many whole times: >= this many MB (0: once)
};

int run_tokenizer_train(const TokenizerTrainOptions& options);
// Encode throughput on text already in memory, through the encoder `moe tokenize` uses
// (ParallelEncoder). A pass encodes the documents repeated whole `copies` times, the fewest
// that make >= min_pass_mb MB (the same text, not copied), so that a pass on many threads
// is long against its fixed costs (fork/join, the schedule's tail, the prefix sum); two
// warm-up passes, then `repeats` samples of as many passes as fill min_seconds; reports the
// median sample and where the time of the timed passes went (ParallelEncoder::Profile).
// Prints one machine-readable line (bench/tokenizer_bench.py reads it).
int run_tokenizer_bench(const TokenizerBenchOptions& options);
int run_tokenize(const TokenizeCommandOptions& options);

}  // namespace moe

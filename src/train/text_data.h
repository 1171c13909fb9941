// The text corpus as the trainer's batch sources: read data.dir, tokenize, split (or map
// the train_/val_ shards of data.shards), and wrap the packed loaders; or blend the
// sources of data.sources (text folders, shard folders, Megatron datasets) by weight. data.tokenizer
// "bpe:N" trains a BPE tokenizer on the training split, cached under data_cache/. Sets
// model.vocab_size from the tokenizer when it is 0.
#pragma once
#include <memory>
#include <string>

#include "data/batch_source.h"
#include "config/run_config.h"
#include "data/tokenizer.h"

namespace moe {

struct TextData {
  std::unique_ptr<BatchSource> train;       // shuffled by training.seed
  std::unique_ptr<BatchSource> validation;  // fixed order, reset before each validation
  std::string tokenizer_name;
  std::string tokenizer_json;  // Tokenizer::hf_tokenizer_json: what checkpoints keep
  std::string description;  // where the data came from: data.dir, data.shards or data.sources
  int64_t train_docs = 0, train_tokens = 0, val_docs = 0, val_tokens = 0;
};

TextData load_text_data(RunConfig& config, int threads);

// The tokenizer a run's data.tokenizer names, as load_text_data makes it: "bpe:N" is the one
// cached under data_cache/ for data.dir's training split (trained again, identically, when
// the cache is missing: the corpus must still be there). `how` says which, for the log.
std::unique_ptr<Tokenizer> load_run_tokenizer(const DataConfig& data, int threads, std::string& how);

}  // namespace moe

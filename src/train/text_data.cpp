#include "train/text_data.h"

#include "data/corpus.h"
#include "data/loader.h"
#include "data/bpe_train.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "core/error.h"

namespace moe {
namespace {

// Owns its documents and the packed loader reading them.
class PackedTextSource final : public BatchSource {
 public:
  PackedTextSource(std::unique_ptr<DocumentSource> docs, int32_t eos, int64_t seq_len, uint64_t seed, bool shuffle)
      : docs_(std::move(docs)), loader_(*docs_, eos, seq_len, seed, shuffle) {}
  void next_batch(int64_t batch, int32_t* inputs_BS, int32_t* targets_BS) override {
    loader_.next_batch(batch, inputs_BS, targets_BS);
  }
  void reset() override { loader_.reset(); }
  std::vector<int64_t> state() const override { return {loader_.state().epoch, loader_.state().position}; }
  void restore(const std::vector<int64_t>& state) override {
    MOE_CHECK(state.size() == 2, "a text loader position is (epoch, position), got {} values", state.size());
    loader_.restore(LoaderState{state[0], state[1]});
  }

 private:
  std::unique_ptr<DocumentSource> docs_;  // in memory, or memory-mapped shards
  PackedLoader loader_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_run_tokenizer(const DataConfig& data, int threads, std::string& how) {
  const TokenizerSpec spec = parse_tokenizer_spec(data.tokenizer);
  if (spec.kind != TokenizerKind::TrainBpe) {
    how = "";
    return make_tokenizer(data);
  }
  const CorpusSplit split = read_corpus(data);
  return load_or_train_bpe(split.train, spec.bpe_vocab, "data_cache", threads, how);
}

TextData load_text_data(RunConfig& config, int threads) {
  const DataConfig& dc = config.data;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<DocumentSource> train, validation;
  TextData data;
  const TokenizerSpec spec = parse_tokenizer_spec(dc.tokenizer);
  if (!dc.shards.empty()) {
    if (spec.kind == TokenizerKind::TrainBpe)
      MOE_CONFIG_ERROR("data.shards needs data.tokenizer to name the tokenizer the shards were written with "
                       "(byte, a tokenizer.json or tiktoken:...), got \"{}\"", dc.tokenizer);
    tokenizer = make_tokenizer(dc);
    auto train_set = std::make_unique<ShardSet>(ShardSet::list(dc.shards, "train"));
    auto val_set = std::make_unique<ShardSet>(ShardSet::list(dc.shards, "val"));
    for (const ShardSet* set : {train_set.get(), val_set.get()})
      if (set->vocab_size() != tokenizer->vocab_size())
        MOE_CONFIG_ERROR("data.shards: the shards in '{}' were written for a vocabulary of {}, data.tokenizer {} has {}",
                         dc.shards, set->vocab_size(), dc.tokenizer, tokenizer->vocab_size());
    data.train_tokens = train_set->n_tokens();
    data.val_tokens = val_set->n_tokens();
    train = std::move(train_set);
    validation = std::move(val_set);
    data.tokenizer_name = tokenizer->name();
  } else {
    CorpusSplit split = read_corpus(dc);
    if (spec.kind == TokenizerKind::TrainBpe) {
      std::string how;
      tokenizer = load_or_train_bpe(split.train, spec.bpe_vocab, "data_cache", threads, how);
      data.tokenizer_name = tokenizer->name() + " (" + how + ")";
    } else {
      tokenizer = make_tokenizer(dc);
      data.tokenizer_name = tokenizer->name();
    }
    auto train_docs = std::make_unique<TokenizedDocuments>(tokenize_documents(split.train, *tokenizer, threads));
    auto val_docs = std::make_unique<TokenizedDocuments>(tokenize_documents(split.validation, *tokenizer, threads));
    data.train_tokens = train_docs->n_tokens();
    data.val_tokens = val_docs->n_tokens();
    train = std::move(train_docs);
    validation = std::move(val_docs);
  }
  if (config.model.vocab_size == 0) config.model.vocab_size = tokenizer->vocab_size();
  if (config.model.vocab_size < tokenizer->vocab_size())
    MOE_CONFIG_ERROR("model.vocab_size {} is smaller than the {} tokenizer's vocabulary {}",
                     config.model.vocab_size, tokenizer->name(), tokenizer->vocab_size());
  data.train_docs = train->n_docs();
  data.val_docs = validation->n_docs();
  const int64_t S = config.model.seq_len;
  data.train = std::make_unique<PackedTextSource>(std::move(train), tokenizer->eos_id(), S, config.training.seed,
                                                  /*shuffle=*/true);
  data.validation = std::make_unique<PackedTextSource>(std::move(validation), tokenizer->eos_id(), S,
                                                       config.training.seed, /*shuffle=*/false);
  return data;
}

}  // namespace moe

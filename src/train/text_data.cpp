#include "train/text_data.h"

#include "data/corpus.h"
#include "data/loader.h"
#include "data/tokenizer.h"
#include "core/error.h"

namespace moe {
namespace {

// Owns its documents and the packed loader reading them.
class PackedTextSource final : public BatchSource {
 public:
  PackedTextSource(TokenizedDocuments docs, int32_t eos, int64_t seq_len, uint64_t seed, bool shuffle)
      : docs_(std::move(docs)), loader_(docs_, eos, seq_len, seed, shuffle) {}
  void next_batch(int64_t batch, int32_t* inputs_BS, int32_t* targets_BS) override {
    loader_.next_batch(batch, inputs_BS, targets_BS);
  }
  void reset() override { loader_.reset(); }

 private:
  TokenizedDocuments docs_;
  PackedLoader loader_;
};

}  // namespace

TextData load_text_data(RunConfig& config, int threads) {
  std::unique_ptr<Tokenizer> tokenizer = make_tokenizer(config.data);
  if (config.model.vocab_size == 0) config.model.vocab_size = tokenizer->vocab_size();
  if (config.model.vocab_size < tokenizer->vocab_size())
    MOE_CONFIG_ERROR("model.vocab_size {} is smaller than the {} tokenizer's vocabulary {}",
                     config.model.vocab_size, tokenizer->name(), tokenizer->vocab_size());
  TokenizedCorpus corpus = load_corpus(config.data, *tokenizer, threads);
  TextData data;
  data.tokenizer_name = tokenizer->name();
  data.train_docs = corpus.train.n_docs();
  data.train_tokens = corpus.train.n_tokens();
  data.val_docs = corpus.validation.n_docs();
  data.val_tokens = corpus.validation.n_tokens();
  const int64_t S = config.model.seq_len;
  data.train = std::make_unique<PackedTextSource>(std::move(corpus.train), tokenizer->eos_id(), S,
                                                  config.training.seed, /*shuffle=*/true);
  data.validation = std::make_unique<PackedTextSource>(std::move(corpus.validation),
                                                       tokenizer->eos_id(), S, config.training.seed,
                                                       /*shuffle=*/false);
  return data;
}

}  // namespace moe

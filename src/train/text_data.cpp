#include "train/text_data.h"

#include <filesystem>

#include "core/error.h"
#include "core/rng.h"
#include "data/blended_source.h"
#include "data/bpe_train.h"
#include "data/corpus.h"
#include "data/loader.h"
#include "data/megatron_dataset.h"
#include "data/shard.h"
#include "data/tokenizer.h"

namespace moe {
namespace {

// Owns its documents and the packed loader reading them.
class PackedTextSource final : public BatchSource {
 public:
  PackedTextSource(std::shared_ptr<const DocumentSource> docs, int32_t eos, int64_t seq_len, uint64_t seed, bool shuffle)
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
  std::shared_ptr<const DocumentSource> docs_;  // in memory, memory-mapped shards or a Megatron dataset
  PackedLoader loader_;
};

// One source's two splits, before they are packed.
struct SplitDocs {
  std::shared_ptr<const DocumentSource> train, validation;
  int64_t train_tokens = 0, val_tokens = 0;
  std::shared_ptr<const MegatronDataset> megatron;  // its ids are checked against the model's vocabulary
};

enum class SourceKind { Text, Shards, Megatron };

bool holds_shards(const std::string& dir) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("train_") && name.ends_with(".bin")) return true;
  }
  return false;
}

// What a data.sources path names: a Megatron dataset prefix (PREFIX.idx exists), a folder
// of `moe tokenize` shards (train_*.bin), or a folder of text and JSONL documents.
SourceKind classify(const std::string& path) {
  if (!megatron_prefix(path).empty()) return SourceKind::Megatron;
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec))
    MOE_CONFIG_ERROR("data.sources: '{}' is neither a directory nor a Megatron dataset ('{}.idx' does not exist)",
                     path, path);
  return holds_shards(path) ? SourceKind::Shards : SourceKind::Text;
}

SplitDocs tokenized(const CorpusSplit& split, const Tokenizer& tokenizer, int threads, const std::string& name) {
  SplitDocs docs;
  auto train = std::make_shared<TokenizedDocuments>(
      tokenize_documents(split.train, tokenizer, threads, "tokenize " + name + " (train)"));
  auto val = std::make_shared<TokenizedDocuments>(
      tokenize_documents(split.validation, tokenizer, threads, "tokenize " + name + " (validation)"));
  docs.train_tokens = train->n_tokens();
  docs.val_tokens = val->n_tokens();
  docs.train = std::move(train);
  docs.validation = std::move(val);
  return docs;
}

SplitDocs shard_docs(const std::string& dir, const Tokenizer& tokenizer, const DataConfig& dc, const char* key) {
  auto train_set = std::make_shared<ShardSet>(ShardSet::list(dir, "train"));
  auto val_set = std::make_shared<ShardSet>(ShardSet::list(dir, "val"));
  for (const ShardSet* set : {train_set.get(), val_set.get()})
    if (set->vocab_size() != tokenizer.vocab_size())
      MOE_CONFIG_ERROR("{}: the shards in '{}' were written for a vocabulary of {}, data.tokenizer {} has {}", key, dir,
                       set->vocab_size(), dc.tokenizer, tokenizer.vocab_size());
  SplitDocs docs;
  docs.train_tokens = train_set->n_tokens();
  docs.val_tokens = val_set->n_tokens();
  docs.train = std::move(train_set);
  docs.validation = std::move(val_set);
  return docs;
}

// A Megatron dataset has no held-out split: documents are held out by a hash of
// "<file name>:<document>", as data.dir holds out files (data.val_fraction).
SplitDocs megatron_docs(const std::string& path, const DataConfig& dc) {
  auto dataset = std::make_shared<MegatronDataset>(path);
  const std::string name = std::filesystem::path(dataset->prefix()).filename().string();
  std::vector<int64_t> train, val;
  for (int64_t d = 0; d < dataset->n_docs(); ++d)
    (is_validation_document(name + ":" + std::to_string(d), dc.val_fraction) ? val : train).push_back(d);
  if (train.empty() || val.empty())
    MOE_CONFIG_ERROR("data.sources: the {} split of the Megatron dataset '{}' is empty ({} documents, "
                     "data.val_fraction = {})", train.empty() ? "train" : "validation", dataset->prefix(),
                     dataset->n_docs(), dc.val_fraction);
  SplitDocs docs;
  auto train_docs = std::make_shared<DocumentSubset>(dataset, std::move(train));
  auto val_docs = std::make_shared<DocumentSubset>(dataset, std::move(val));
  docs.train_tokens = train_docs->n_tokens();
  docs.val_tokens = val_docs->n_tokens();
  docs.train = std::move(train_docs);
  docs.validation = std::move(val_docs);
  docs.megatron = std::move(dataset);
  return docs;
}

// data.sources: every source's splits, with the tokenizer (bpe:N is trained on the text
// sources' training documents; token ids on disk need a tokenizer that is named).
std::vector<SplitDocs> load_sources(const DataConfig& dc, const std::vector<DataSourceSpec>& specs, int threads,
                                    std::unique_ptr<Tokenizer>& tokenizer, std::string& tokenizer_name) {
  std::vector<SourceKind> kinds;
  for (const DataSourceSpec& s : specs) kinds.push_back(classify(s.path));
  const bool train_bpe = parse_tokenizer_spec(dc.tokenizer).kind == TokenizerKind::TrainBpe;
  std::vector<CorpusSplit> texts(specs.size());
  for (size_t k = 0; k < specs.size(); ++k) {
    if (kinds[k] != SourceKind::Text) {
      if (train_bpe)
        MOE_CONFIG_ERROR("data.sources: '{}' holds token ids, so data.tokenizer must name the tokenizer they were "
                         "written with (byte, a tokenizer.json or tiktoken:...), got \"{}\"", specs[k].path,
                         dc.tokenizer);
      continue;
    }
    DataConfig one = dc;
    one.dir = specs[k].path;
    texts[k] = read_corpus(one);
  }
  if (train_bpe) {
    std::vector<Document> all;
    for (const CorpusSplit& t : texts) all.insert(all.end(), t.train.begin(), t.train.end());
    std::string how;
    tokenizer = load_or_train_bpe(all, parse_tokenizer_spec(dc.tokenizer).bpe_vocab, "data_cache", threads, how);
    tokenizer_name = tokenizer->name() + " (" + how + ")";
  } else {
    tokenizer = make_tokenizer(dc);
    tokenizer_name = tokenizer->name();
  }
  std::vector<SplitDocs> sources;
  for (size_t k = 0; k < specs.size(); ++k) {
    if (kinds[k] == SourceKind::Text) sources.push_back(tokenized(texts[k], *tokenizer, threads, specs[k].path));
    else if (kinds[k] == SourceKind::Shards) sources.push_back(shard_docs(specs[k].path, *tokenizer, dc, "data.sources"));
    else sources.push_back(megatron_docs(specs[k].path, dc));
    texts[k] = {};  // tokenized: the text is no longer needed
  }
  return sources;
}

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
  std::vector<SplitDocs> sources;
  std::vector<double> weights;
  TextData data;
  const TokenizerSpec spec = parse_tokenizer_spec(dc.tokenizer);
  if (!dc.sources.empty()) {
    const std::vector<DataSourceSpec> specs = parse_data_sources(dc.sources, nullptr);
    sources = load_sources(dc, specs, threads, tokenizer, data.tokenizer_name);
    for (const DataSourceSpec& s : specs) weights.push_back(s.weight);
    data.description = dc.sources;
  } else if (!dc.shards.empty()) {
    if (spec.kind == TokenizerKind::TrainBpe)
      MOE_CONFIG_ERROR("data.shards needs data.tokenizer to name the tokenizer the shards were written with "
                       "(byte, a tokenizer.json, tiktoken:... or a SentencePiece model), got \"{}\"", dc.tokenizer);
    tokenizer = make_tokenizer(dc);
    sources.push_back(shard_docs(dc.shards, *tokenizer, dc, "data.shards"));
    data.tokenizer_name = tokenizer->name();
    data.description = dc.shards;
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
    sources.push_back(tokenized(split, *tokenizer, threads, dc.dir));
    data.description = dc.dir;
  }
  data.tokenizer_json = tokenizer->hf_tokenizer_json();
  if (config.model.vocab_size == 0) config.model.vocab_size = tokenizer->vocab_size();
  if (config.model.vocab_size < tokenizer->vocab_size())
    MOE_CONFIG_ERROR("model.vocab_size {} is smaller than the {} tokenizer's vocabulary {}",
                     config.model.vocab_size, tokenizer->name(), tokenizer->vocab_size());
  const int64_t S = config.model.seq_len;
  std::vector<std::unique_ptr<BatchSource>> train, validation;
  for (size_t k = 0; k < sources.size(); ++k) {
    SplitDocs& s = sources[k];
    if (s.megatron) s.megatron->check_vocabulary(config.model.vocab_size, "model.vocab_size");
    data.train_docs += s.train->n_docs();
    data.val_docs += s.validation->n_docs();
    data.train_tokens += s.train_tokens;
    data.val_tokens += s.val_tokens;
    // One source reads in the order of training.seed alone; blended sources each in their own.
    const uint64_t seed = sources.size() == 1 ? config.training.seed
                                              : config.training.seed ^ fnv1a64("data.sources." + std::to_string(k));
    train.push_back(std::make_unique<PackedTextSource>(s.train, tokenizer->eos_id(), S, seed, /*shuffle=*/true));
    validation.push_back(
        std::make_unique<PackedTextSource>(s.validation, tokenizer->eos_id(), S, seed, /*shuffle=*/false));
  }
  if (sources.size() == 1) {
    data.train = std::move(train[0]);
    data.validation = std::move(validation[0]);
  } else {
    data.train = std::make_unique<BlendedSource>(std::move(train), weights, config.training.seed, S);
    data.validation = std::make_unique<BlendedSource>(std::move(validation), weights, config.training.seed, S);
  }
  return data;
}

}  // namespace moe

// A text corpus on disk -> documents -> token ids. Documents are the files under
// data.dir whose names end with data.extension, in relative-path order so every run
// and every rank sees the same list; a .jsonl file is one document per line (its
// data.text_field, named "<path>:<line>"). Each document goes to the train or validation
// split by a hash of its relative path, so adding files never moves existing ones.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace moe {

struct DataConfig;

struct Document {
  std::string relative_path;  // '/'-separated, below data.dir
  std::string text;
};

struct CorpusSplit {
  std::vector<Document> train;
  std::vector<Document> validation;
};

// What the packed loader reads: documents of token ids, in memory or memory-mapped shards.
class DocumentSource {
 public:
  virtual ~DocumentSource() = default;
  virtual int64_t n_docs() const = 0;
  virtual int64_t doc_size(int64_t d) const = 0;
  // Copies tokens [offset, offset + count) of document d to out.
  virtual void copy(int64_t d, int64_t offset, int64_t count, int32_t* out) const = 0;
};

// Documents as one flat token array: document d is tokens[doc_offsets[d], doc_offsets[d+1]).
struct TokenizedDocuments final : DocumentSource {
  std::vector<int32_t> tokens;
  std::vector<int64_t> doc_offsets{0};  // n_docs + 1 entries, starting at 0

  int64_t n_docs() const override { return static_cast<int64_t>(doc_offsets.size()) - 1; }
  int64_t doc_size(int64_t d) const override { return doc_offsets[d + 1] - doc_offsets[d]; }
  void copy(int64_t d, int64_t offset, int64_t count, int32_t* out) const override {
    std::copy_n(tokens.data() + doc_offsets[d] + offset, count, out);
  }
  int64_t n_tokens() const { return static_cast<int64_t>(tokens.size()); }
  std::span<const int32_t> doc(int64_t d) const {
    return {tokens.data() + doc_offsets[d], static_cast<size_t>(doc_offsets[d + 1] - doc_offsets[d])};
  }
};

// A subset of another source's documents, in the given order (a train or held-out split).
class DocumentSubset final : public DocumentSource {
 public:
  DocumentSubset(std::shared_ptr<const DocumentSource> base, std::vector<int64_t> ids);
  int64_t n_docs() const override { return static_cast<int64_t>(ids_.size()); }
  int64_t doc_size(int64_t d) const override { return base_->doc_size(ids_[d]); }
  void copy(int64_t d, int64_t offset, int64_t count, int32_t* out) const override {
    base_->copy(ids_[d], offset, count, out);
  }
  int64_t n_tokens() const { return n_tokens_; }

 private:
  std::shared_ptr<const DocumentSource> base_;
  std::vector<int64_t> ids_;
  int64_t n_tokens_ = 0;
};

struct TokenizedCorpus {
  TokenizedDocuments train;
  TokenizedDocuments validation;
};

// True iff the document goes to validation: fnv1a64(path) % 1'000'000 < val_fraction * 1'000'000.
bool is_validation_document(std::string_view relative_path, double val_fraction);

// Reads data.dir recursively (at most data.max_bytes bytes in path order, the last document
// cut short if needed; 0 reads all) and splits it. Throws ConfigError naming the directory
// when it is missing, not a directory, has no matching files, or a split comes out empty.
CorpusSplit read_corpus(const DataConfig& config);

// Encodes every document, in parallel over documents (threads <= 0: OpenMP's current
// count). The result does not depend on the thread count. A non-empty `progress_label`
// prints progress on stderr when the work takes longer than 2 s (data/progress_line.h),
// between batches of about `batch_bytes` of text (0: 8 MB per thread, as `moe tokenize`).
TokenizedDocuments tokenize_documents(std::span<const Document> docs, const Tokenizer& tokenizer,
                                      int threads = 0, std::string_view progress_label = {},
                                      int64_t batch_bytes = 0);

// read_corpus + tokenize_documents for both splits.
TokenizedCorpus load_corpus(const DataConfig& config, const Tokenizer& tokenizer, int threads = 0);

}  // namespace moe

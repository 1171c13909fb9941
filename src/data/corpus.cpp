#include "data/corpus.h"

#include "data/file_util.h"
#include "data/jsonl.h"
#include "data/progress_line.h"
#include "data/tokenize_files.h"

#include <omp.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "core/error.h"
#include "core/rng.h"
#include "config/data_config.h"

namespace fs = std::filesystem;

namespace moe {
namespace {

struct FileEntry {
  std::string relative_path;
  fs::path path;
};

std::vector<FileEntry> list_files(const DataConfig& config) {
  std::error_code ec;
  fs::path root(config.dir);
  if (!fs::exists(root, ec)) MOE_CONFIG_ERROR("data.dir: '{}' does not exist", config.dir);
  if (!fs::is_directory(root, ec)) MOE_CONFIG_ERROR("data.dir: '{}' is not a directory", config.dir);

  std::vector<FileEntry> files;
  for (auto& [relative, path] : list_files_under(config.dir, config.extension, "data.dir"))
    files.push_back({std::move(relative), fs::path(std::move(path))});
  if (files.empty())
    MOE_CONFIG_ERROR("data.dir: no files ending in '{}' under '{}' (data.extension)", config.extension, config.dir);
  return files;
}

}  // namespace

bool is_validation_document(std::string_view relative_path, double val_fraction) {
  auto threshold = static_cast<uint64_t>(val_fraction * 1'000'000.0);
  return fnv1a64(relative_path) % 1'000'000 < threshold;
}

CorpusSplit read_corpus(const DataConfig& config) {
  std::vector<FileEntry> files = list_files(config);
  const int64_t budget = config.max_bytes > 0 ? config.max_bytes : std::numeric_limits<int64_t>::max();
  CorpusSplit split;
  int64_t total = 0, n_docs = 0;
  auto add = [&](Document doc) {
    if (static_cast<int64_t>(doc.text.size()) > budget - total) doc.text.resize(static_cast<size_t>(budget - total));
    total += static_cast<int64_t>(doc.text.size());
    ++n_docs;
    auto& target = is_validation_document(doc.relative_path, config.val_fraction) ? split.validation : split.train;
    target.push_back(std::move(doc));
  };
  for (const FileEntry& file : files) {
    if (total >= budget) break;
    if (!is_jsonl_path(file.relative_path)) {
      add({file.relative_path, read_file_prefix(file.path.string(), budget - total, "data.dir: document")});
      continue;
    }
    // JSON Lines: each line's data.text_field is a document named "<path>:<line>", as
    // `moe tokenize` names it, so both split a corpus alike.
    std::ifstream in(file.path, std::ios::binary);
    if (!in) MOE_CONFIG_ERROR("data.dir: document '{}' cannot be opened: {}", file.path.string(), std::strerror(errno));
    std::string line;
    for (int64_t line_no = 1; total < budget && std::getline(in, line); ++line_no) {
      if (is_blank_jsonl_line(line)) continue;
      add({file.relative_path + ":" + std::to_string(line_no),
           jsonl_document(line, config.text_field, file.path.string(), line_no, "data.text_field")});
    }
    if (in.bad()) MOE_CONFIG_ERROR("data.dir: document '{}' cannot be read: {}", file.path.string(), std::strerror(errno));
  }
  for (auto [name, docs] : {std::pair{"train", &split.train}, std::pair{"validation", &split.validation}}) {
    if (docs->empty())
      MOE_CONFIG_ERROR("data.dir: the {} split of '{}' is empty ({} documents read, data.val_fraction = {}, "
                       "data.max_bytes = {}); use more documents or change data.val_fraction",
                       name, config.dir, n_docs, config.val_fraction, config.max_bytes);
  }
  return split;
}

TokenizedDocuments tokenize_documents(std::span<const Document> docs, const Tokenizer& tokenizer, int threads,
                                      std::string_view progress_label, int64_t batch_bytes) {
  // Large documents are cut at boundaries that cannot change the ids and encoded in
  // parallel (data/tokenize_files.h); the result does not depend on the thread count.
  ParallelEncoder encoder(tokenizer, threads);
  if (progress_label.empty()) return encoder.encode(docs);
  // In batches of documents, so progress can be shown between them: each document is
  // encoded whole either way, so the ids are those of one pass.
  int64_t total_bytes = 0;
  for (const Document& d : docs) total_bytes += static_cast<int64_t>(d.text.size());
  ProgressLine progress(std::string(progress_label), total_bytes);
  if (batch_bytes <= 0) batch_bytes = (int64_t{8} << 20) * (threads > 0 ? threads : omp_get_max_threads());
  TokenizedDocuments out, batch;
  int64_t bytes_done = 0;
  for (size_t begin = 0; begin < docs.size();) {
    size_t end = begin;
    for (int64_t bytes = 0; end < docs.size() && (end == begin || bytes < batch_bytes); ++end)
      bytes += static_cast<int64_t>(docs[end].text.size());
    encoder.encode(docs.subspan(begin, end - begin), batch);
    const int64_t base = out.n_tokens();
    out.tokens.insert(out.tokens.end(), batch.tokens.begin(), batch.tokens.end());
    for (int64_t d = 1; d <= batch.n_docs(); ++d) out.doc_offsets.push_back(base + batch.doc_offsets[d]);
    for (size_t d = begin; d < end; ++d) bytes_done += static_cast<int64_t>(docs[d].text.size());
    begin = end;
    progress.update(bytes_done, static_cast<int64_t>(begin));
  }
  progress.finish(bytes_done, static_cast<int64_t>(docs.size()));
  return out;
}

DocumentSubset::DocumentSubset(std::shared_ptr<const DocumentSource> base, std::vector<int64_t> ids)
    : base_(std::move(base)), ids_(std::move(ids)) {
  for (int64_t d : ids_) n_tokens_ += base_->doc_size(d);
}

TokenizedCorpus load_corpus(const DataConfig& config, const Tokenizer& tokenizer, int threads) {
  CorpusSplit split = read_corpus(config);
  return {tokenize_documents(split.train, tokenizer, threads),
          tokenize_documents(split.validation, tokenizer, threads)};
}

}  // namespace moe

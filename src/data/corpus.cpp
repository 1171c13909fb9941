#include "data/corpus.h"

#include "data/file_util.h"
#include "data/tokenize_files.h"

#include <omp.h>

#include <algorithm>
#include <filesystem>
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
  for (const FileEntry& file : files) {
    if (total >= budget) break;
    Document doc{file.relative_path, read_file_prefix(file.path.string(), budget - total, "data.dir: document")};
    total += static_cast<int64_t>(doc.text.size());
    ++n_docs;
    auto& target = is_validation_document(doc.relative_path, config.val_fraction) ? split.validation : split.train;
    target.push_back(std::move(doc));
  }
  for (auto [name, docs] : {std::pair{"train", &split.train}, std::pair{"validation", &split.validation}}) {
    if (docs->empty())
      MOE_CONFIG_ERROR("data.dir: the {} split of '{}' is empty ({} documents read, data.val_fraction = {}, "
                       "data.max_bytes = {}); use more documents or change data.val_fraction",
                       name, config.dir, n_docs, config.val_fraction, config.max_bytes);
  }
  return split;
}

TokenizedDocuments tokenize_documents(std::span<const Document> docs, const Tokenizer& tokenizer, int threads) {
  // Large documents are cut at boundaries that cannot change the ids and encoded in
  // parallel (data/tokenize_files.h); the result does not depend on the thread count.
  return ParallelEncoder(tokenizer, threads).encode(docs);
}

TokenizedCorpus load_corpus(const DataConfig& config, const Tokenizer& tokenizer, int threads) {
  CorpusSplit split = read_corpus(config);
  return {tokenize_documents(split.train, tokenizer, threads),
          tokenize_documents(split.validation, tokenizer, threads)};
}

}  // namespace moe

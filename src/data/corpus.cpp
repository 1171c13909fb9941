#include "data/corpus.h"

#include "data/tokenize_files.h"

#include <omp.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>

#include "core/error.h"
#include "core/rng.h"
#include "train/config.h"

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
  // Symlinked directories are not followed, so a link cycle cannot loop forever.
  fs::recursive_directory_iterator it(root, fs::directory_options::skip_permission_denied, ec), end;
  if (ec) MOE_CONFIG_ERROR("data.dir: cannot list '{}': {}", config.dir, ec.message());
  for (; it != end; it.increment(ec)) {
    if (ec) MOE_CONFIG_ERROR("data.dir: cannot list '{}': {}", config.dir, ec.message());
    const fs::path& path = it->path();
    std::string name = path.filename().string();
    if (!name.ends_with(config.extension) || !it->is_regular_file(ec)) continue;
    files.push_back({path.lexically_relative(root).generic_string(), path});
  }
  if (files.empty())
    MOE_CONFIG_ERROR("data.dir: no files ending in '{}' under '{}' (data.extension)", config.extension, config.dir);
  std::sort(files.begin(), files.end(),
            [](const FileEntry& a, const FileEntry& b) { return a.relative_path < b.relative_path; });
  return files;
}

std::string read_file(const fs::path& path, int64_t limit) {
  std::ifstream in(path, std::ios::binary);
  if (!in) MOE_THROW("cannot open '{}'", path.string());
  std::string text;
  char buffer[1 << 16];
  while (static_cast<int64_t>(text.size()) < limit) {
    in.read(buffer, static_cast<std::streamsize>(std::min<int64_t>(sizeof(buffer), limit - text.size())));
    text.append(buffer, static_cast<size_t>(in.gcount()));
    if (in.gcount() == 0) break;
  }
  if (in.bad()) MOE_THROW("cannot read '{}'", path.string());
  return text;
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
    Document doc{file.relative_path, read_file(file.path, budget - total)};
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

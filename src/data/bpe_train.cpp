#include "data/bpe_train.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fmt/format.h>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "core/rng.h"
#include "data/file_util.h"
#include "data/unicode.h"

namespace moe {
namespace {

uint64_t key(int32_t a, int32_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b); }

// Distinct pieces of all documents with their counts, sorted so later steps are deterministic.
std::vector<std::pair<std::string, int64_t>> count_pieces(std::span<const std::string_view> docs, PretokPattern pattern,
                                                          int threads) {
  std::vector<std::unordered_map<std::string, int64_t>> partial(static_cast<size_t>(threads));
#pragma omp parallel num_threads(threads)
  {
    auto& counts = partial[static_cast<size_t>(omp_get_thread_num())];
    std::vector<uint32_t> ends;
#pragma omp for schedule(dynamic, 1)
    for (int64_t d = 0; d < static_cast<int64_t>(docs.size()); ++d) {
      std::string repaired;
      std::string_view text = docs[d];
      if (!unicode::is_valid_utf8(text)) repaired = unicode::repair_utf8(text), text = repaired;
      ends.clear();
      pretokenize(text, pattern, ends);
      uint32_t begin = 0;
      for (uint32_t end : ends) ++counts[std::string(text.substr(begin, end - begin))], begin = end;
    }
  }
  for (size_t t = 1; t < partial.size(); ++t)
    for (auto& [piece, n] : partial[t]) partial[0][piece] += n;
  std::vector<std::pair<std::string, int64_t>> out(partial[0].begin(), partial[0].end());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

void check_specials(const std::vector<std::string>& specials) {
  if (specials.empty()) MOE_CONFIG_ERROR("--special: at least one special token (the end-of-text token) is needed");
  std::vector<AddedToken> added;  // with the ids train_bpe gives them
  for (size_t i = 0; i < specials.size(); ++i) {
    if (specials[i].empty()) MOE_CONFIG_ERROR("--special: a special token cannot be empty");
    for (size_t j = 0; j < i; ++j)
      if (specials[j] == specials[i]) MOE_CONFIG_ERROR("--special: '{}' is given twice", specials[i]);
    added.push_back({specials[i], static_cast<int32_t>(i), true});
  }
  if (const int32_t eot = find_end_of_text(added); eot > 0)
    MOE_CONFIG_ERROR("--special: the first special token ('{}') ends documents, but readers of the tokenizer take "
                     "'{}' (a usual end-of-text name) instead; give '{}' first",
                     specials[0], specials[static_cast<size_t>(eot)], specials[static_cast<size_t>(eot)]);
}

BpeModel train_bpe(std::span<const std::string_view> docs, const BpeTrainOptions& options) {
  const int threads = options.threads > 0 ? options.threads : omp_get_max_threads();
  const int64_t n_fixed = static_cast<int64_t>(options.specials.size()) + 256;
  if (options.vocab_size < n_fixed)
    MOE_CONFIG_ERROR("--vocab-size {} is too small: the {} special tokens and 256 bytes need {}", options.vocab_size,
                     options.specials.size(), n_fixed);
  check_specials(options.specials);
  BpeModel model;
  model.pattern = options.pattern;
  model.byte_level_regex = options.pattern == PretokPattern::Gpt2;
  for (const std::string& s : options.specials)
    model.added.push_back({s, static_cast<int32_t>(model.vocab.size())}), model.vocab.push_back(s);
  const auto byte0 = static_cast<int32_t>(model.vocab.size());
  for (int b = 0; b < 256; ++b) model.vocab.emplace_back(1, static_cast<char>(b));
  std::unordered_map<std::string, int32_t> ids;
  for (int b = 0; b < 256; ++b) ids.emplace(model.vocab[byte0 + b], byte0 + b);

  auto pieces = count_pieces(docs, options.pattern, threads);
  std::vector<std::vector<int32_t>> words(pieces.size());
  std::vector<int64_t> freq(pieces.size());
  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<int32_t>> where;  // pair -> words that held it (may repeat)
  for (size_t w = 0; w < pieces.size(); ++w) {
    freq[w] = pieces[w].second;
    for (char c : pieces[w].first) words[w].push_back(byte0 + static_cast<unsigned char>(c));
    for (size_t i = 0; i + 1 < words[w].size(); ++i) {
      const uint64_t p = key(words[w][i], words[w][i + 1]);
      pair_count[p] += freq[w];
      auto& list = where[p];
      if (list.empty() || list.back() != static_cast<int32_t>(w)) list.push_back(static_cast<int32_t>(w));
    }
  }
  pieces.clear();

  // Max-heap on (count, then smaller pair key); entries go stale and are re-checked on pop.
  using Entry = std::pair<int64_t, uint64_t>;
  auto lower = [](const Entry& a, const Entry& b) { return a.first != b.first ? a.first < b.first : a.second > b.second; };
  std::priority_queue<Entry, std::vector<Entry>, decltype(lower)> heap(lower);
  for (auto [p, n] : pair_count) heap.emplace(n, p);

  std::vector<int64_t> stamp(words.size(), -1);
  std::vector<int32_t> merged;
  while (static_cast<int64_t>(model.vocab.size()) < options.vocab_size && !heap.empty()) {
    auto [count, p] = heap.top();
    heap.pop();
    auto it = pair_count.find(p);
    const int64_t current = it == pair_count.end() ? 0 : it->second;
    if (current != count) {
      if (current > 0) heap.emplace(current, p);
      continue;
    }
    if (count <= 0) break;
    const auto a = static_cast<int32_t>(p >> 32), b = static_cast<int32_t>(p & 0xffffffffu);
    std::string token = model.vocab[a] + model.vocab[b];
    auto [id_it, inserted] = ids.emplace(token, static_cast<int32_t>(model.vocab.size()));
    if (inserted) model.vocab.push_back(token);
    const int32_t id = id_it->second;
    model.merges.emplace_back(a, b);

    std::unordered_set<uint64_t> grown;
    const int64_t merge_no = static_cast<int64_t>(model.merges.size());
    std::vector<int32_t> list = std::move(where[p]);
    where.erase(p);
    for (int32_t w : list) {
      if (stamp[w] == merge_no) continue;
      stamp[w] = merge_no;
      std::vector<int32_t>& sym = words[w];
      bool has = false;
      for (size_t i = 0; i + 1 < sym.size() && !has; ++i) has = sym[i] == a && sym[i + 1] == b;
      if (!has) continue;
      for (size_t i = 0; i + 1 < sym.size(); ++i) pair_count[key(sym[i], sym[i + 1])] -= freq[w];
      merged.clear();
      for (size_t i = 0; i < sym.size(); ++i) {
        if (i + 1 < sym.size() && sym[i] == a && sym[i + 1] == b) merged.push_back(id), ++i;
        else merged.push_back(sym[i]);
      }
      sym.swap(merged);
      for (size_t i = 0; i + 1 < sym.size(); ++i) {
        const uint64_t q = key(sym[i], sym[i + 1]);
        pair_count[q] += freq[w];
        if (sym[i] == id || sym[i + 1] == id) {
          grown.insert(q);
          auto& l = where[q];
          if (l.empty() || l.back() != w) l.push_back(w);
        }
      }
    }
    pair_count.erase(p);
    std::vector<uint64_t> grown_sorted(grown.begin(), grown.end());
    std::sort(grown_sorted.begin(), grown_sorted.end());
    for (uint64_t q : grown_sorted) heap.emplace(pair_count[q], q);
  }
  return model;
}

std::unique_ptr<BpeTokenizer> load_or_train_bpe(std::span<const Document> docs, int64_t vocab_size,
                                                const std::string& cache_dir, int threads, std::string& how) {
  // The cache key covers everything the result depends on: the documents, vocab, pattern.
  std::string key_text = fmt::format("v1 llama3 {} {}", vocab_size, docs.size());
  uint64_t hash = fnv1a64(key_text);
  for (const Document& d : docs) hash = hash * 0x100000001b3ULL ^ fnv1a64(d.relative_path) ^ (fnv1a64(d.text) << 1);
  const std::string path = (std::filesystem::path(cache_dir) / fmt::format("bpe-{}-{:016x}.json", vocab_size, hash)).string();
  std::error_code ec;
  if (std::filesystem::exists(path, ec)) {
    how = "cached " + path;
    return std::make_unique<BpeTokenizer>(load_hf_tokenizer(path), "bpe:" + std::to_string(vocab_size));
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string_view> texts;
  for (const Document& d : docs) texts.push_back(d.text);
  BpeTrainOptions options;
  options.vocab_size = vocab_size;
  options.pattern = PretokPattern::Llama3;
  options.threads = threads;
  BpeModel model = train_bpe(texts, options);
  std::filesystem::create_directories(cache_dir, ec);
  if (ec) MOE_THROW("cannot create the tokenizer cache folder '{}': {}", cache_dir, ec.message());
  save_hf_tokenizer(model, path);
  how = fmt::format("trained in {:.1f} s, saved to {}",
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), path);
  return std::make_unique<BpeTokenizer>(std::move(model), "bpe:" + std::to_string(vocab_size));
}

}  // namespace moe

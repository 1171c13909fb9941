#include "train/checkpoint_shards.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/threads.h"
#include "train/checkpoint_hash.h"

namespace moe {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
constexpr const char* kFormat = "moe-train-checkpoint";
using Clock = std::chrono::steady_clock;
constexpr int kIoThreads = 8;  // threads writing a shard and reading pieces, at most (and at most the cores)
constexpr size_t kOpenShards = 64;  // shard files read_slices holds open at once

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}
}  // namespace

std::string shard_file_name(int rank) { return fmt::format("rank_{:05d}.safetensors", rank); }
std::string report_file_name(int rank) { return fmt::format("rank_{:05d}.json", rank); }

int64_t write_shard(const fs::path& temp_dir, const CheckpointSnapshot& snap, double* seconds) {
  const auto start = Clock::now();
  // Every piece's hash, and whether the parameters are finite, on every core first (both
  // read every byte; a non-finite weight is refused before anything is written).
  const auto n = static_cast<int64_t>(snap.tensors.size());
  std::vector<std::string> hashes(static_cast<size_t>(n));
  std::vector<char> finite(static_cast<size_t>(n), 1);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) {
    const auto& t = snap.tensors[static_cast<size_t>(i)];
    hashes[static_cast<size_t>(i)] = content_hash(t.data, static_cast<size_t>(t.count) * sizeof(float));
    if (t.name.starts_with("param/"))
      finite[static_cast<size_t>(i)] = std::all_of(t.data, t.data + t.count, [](float x) { return std::isfinite(x); });
  }
  for (int64_t i = 0; i < n; ++i)
    if (!finite[static_cast<size_t>(i)])
      MOE_THROW("parameter '{}' is not finite; refusing to checkpoint it", snap.tensors[static_cast<size_t>(i)].name.substr(6));
  SafeTensorsWriter writer;
  for (const auto& t : snap.tensors)
    writer.add_f32(stored_piece_name(t.name, t.begin, kCheckpointVersion), {t.count}, t.data);
  writer.set_metadata("format", kFormat);
  writer.set_metadata("version", std::to_string(kCheckpointVersion));
  writer.set_metadata("rank", std::to_string(snap.rank));
  writer.set_metadata("world_size", std::to_string(snap.world_size));
  writer.set_metadata("step", std::to_string(snap.progress.step));
  writer.set_metadata("save_id", snap.save_id);
  const std::string file = shard_file_name(snap.rank);
  // The file's hash, from memory (the bytes write() writes), beside the write.
  const std::string header = writer.header_bytes();
  std::string whole_hash;
  std::thread hashing([&] {
    StreamHash whole;
    whole.update(header.data(), header.size());
    for (const auto& t : snap.tensors) whole.update(t.data, static_cast<size_t>(t.count) * sizeof(float));
    whole_hash = whole.hex();
  });
  try {
    writer.write(temp_dir / file, std::min(kIoThreads, available_cores()));
  } catch (...) {
    hashing.join();
    throw;
  }
  hashing.join();
  json pieces = json::array();
  for (int64_t i = 0; i < n; ++i) {
    const auto& t = snap.tensors[static_cast<size_t>(i)];
    pieces.push_back({{"tensor", t.name}, {"shape", t.shape}, {"begin", t.begin},
                      {"count", t.count}, {"hash", hashes[static_cast<size_t>(i)]}});
  }
  const auto size = static_cast<int64_t>(header.size() + writer.data_bytes());
  const json report = {{"rank", snap.rank},         {"world_size", snap.world_size},
                       {"step", snap.progress.step}, {"save_id", snap.save_id},
                       {"file", file},               {"bytes", size},
                       {"hash", whole_hash},         {"header_hash", content_hash(header.data(), header.size())},
                       {"pieces", std::move(pieces)}};
  write_file_atomic(temp_dir / report_file_name(snap.rank), report.dump());
  if (seconds) *seconds = seconds_since(start);
  return size;
}

void collect_reports(const fs::path& temp_dir, const CheckpointSnapshot& snap, double timeout_s,
                     CheckpointManifest& manifest) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  std::map<std::string, size_t> index;  // tensor name -> manifest.tensors
  for (int r = 0; r < snap.world_size; ++r) {
    const fs::path path = temp_dir / report_file_name(r);
    std::error_code ec;
    while (!fs::exists(path, ec)) {
      if (Clock::now() > deadline)
        MOE_THROW("{}: rank {} did not report its shard {} within {:.0f} s; the checkpoint of step {} is not marked "
                  "complete",
                  temp_dir.string(), r, shard_file_name(r), timeout_s, snap.progress.step);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const json report = json::parse(read_file_bytes(path), nullptr, false);
    if (report.is_discarded() || !report.is_object() || report.value("save_id", "") != snap.save_id ||
        report.value("rank", -1) != r || report.value("step", int64_t{-1}) != snap.progress.step ||
        report.value("world_size", 0) != snap.world_size)
      MOE_THROW("{}: not this save's report (save {}, rank {}, step {})", path.string(), snap.save_id, r,
                snap.progress.step);
    const auto shard = static_cast<int>(manifest.shards.size());
    manifest.shards.push_back({r, report.at("file").get<std::string>(), report.at("bytes").get<uint64_t>(),
                               report.at("hash").get<std::string>(), report.at("header_hash").get<std::string>()});
    for (const json& p : report.at("pieces")) {
      const std::string name = p.at("tensor").get<std::string>();
      const auto shape = p.at("shape").get<std::vector<int64_t>>();
      auto [it, added] = index.emplace(name, manifest.tensors.size());
      if (added) manifest.tensors.push_back({name, "F32", shape, {}});
      ManifestTensor& tensor = manifest.tensors[it->second];
      if (tensor.shape != shape)
        MOE_THROW("{}: tensor '{}' has shape {} in rank {}'s shard, {} in an earlier one", temp_dir.string(), name,
                  shape_text(shape), r, shape_text(tensor.shape));
      tensor.pieces.push_back({shard, p.at("begin").get<int64_t>(), p.at("count").get<int64_t>(),
                               p.at("hash").get<std::string>()});
    }
  }
  check_tensor_coverage(manifest.tensors, manifest.shards, temp_dir.string());
  for (int r = 0; r < snap.world_size; ++r) fs::remove(temp_dir / report_file_name(r));
}

CheckpointShardReader::CheckpointShardReader(const fs::path& dir, const CheckpointManifest& manifest, int shard) : manifest_(manifest) {
  const ManifestShard& entry = manifest.shards.at(static_cast<size_t>(shard));
  source_ = (dir / entry.file).string();
  fd_ = ::open(source_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0 && errno == ENOENT) MOE_THROW("{}: missing (the manifest lists it as rank {}'s shard)", source_, entry.rank);
  if (fd_ < 0) MOE_THROW("{}: cannot open for reading: {}", source_, std::strerror(errno));
  try {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) MOE_THROW("{}: cannot stat: {}", source_, std::strerror(errno));
    if (static_cast<uint64_t>(st.st_size) != entry.bytes)
      MOE_THROW("{}: {} bytes, the manifest says {} (truncated?)", source_, st.st_size, entry.bytes);
    std::string head;
    header_ = read_safetensors_header(fd_, source_, &head);
    const auto meta = [&](const char* key) {
      const auto it = header_.metadata.find(key);
      return it == header_.metadata.end() ? std::string("(none)") : it->second;
    };
    if (meta("format") != kFormat)
      MOE_THROW("{}: not a moe-train checkpoint shard (metadata 'format' is not {})", source_, kFormat);
    if (meta("step") != std::to_string(manifest.step))
      MOE_THROW("{}: a foreign shard: it holds step {}, the manifest step {}", source_, meta("step"), manifest.step);
    if (manifest.version >= 2) {
      if (meta("save_id") != manifest.save_id || meta("rank") != std::to_string(entry.rank))
        MOE_THROW("{}: a foreign shard: rank {} of save {}, the manifest lists rank {} of save {}", source_,
                  meta("rank"), meta("save_id"), entry.rank, manifest.save_id);
      if (content_hash(head.data(), head.size(), hash_algorithm_from_name(manifest.hash_algorithm)) != entry.header_hash)
        MOE_THROW("{}: header does not match its hash in the manifest (corrupted)", source_);
    }
  } catch (...) {
    ::close(fd_);
    throw;
  }
  for (size_t i = 0; i < header_.tensors.size(); ++i) index_[header_.tensors[i].name] = i;
}

CheckpointShardReader::~CheckpointShardReader() {
  if (fd_ >= 0) ::close(fd_);
}

void CheckpointShardReader::read_piece(const std::string& tensor, const ManifestPiece& piece, float* out) const {
  const std::string name = stored_piece_name(tensor, piece.begin, manifest_.version);
  const auto it = index_.find(name);
  if (it == index_.end()) MOE_THROW("{}: no tensor '{}' (the manifest places it here)", source_, name);
  const SafeTensorInfo& info = header_.tensors[it->second];
  if (info.dtype != "F32" || info.numel() != piece.count)
    MOE_THROW("{}: tensor '{}' is {} x {}, the manifest says F32 x {}", source_, name, info.dtype, info.numel(),
              piece.count);
  const uint64_t bytes = static_cast<uint64_t>(piece.count) * sizeof(float);
  read_exactly(fd_, out, bytes, header_.data_start + info.begin, source_);
  if (!piece.hash.empty() &&
      content_hash(out, bytes, hash_algorithm_from_name(manifest_.hash_algorithm)) != piece.hash)
    MOE_THROW("{}: tensor '{}' does not match its hash in the manifest (corrupted)", source_, name);
}

void CheckpointShardReader::verify_whole_file() const {
  const ManifestShard* entry = nullptr;
  for (const ManifestShard& s : manifest_.shards)
    if (source_.ends_with("/" + s.file)) entry = &s;
  MOE_CHECK(entry != nullptr, "{}: not in the manifest", source_);
  uint64_t size = 0;
  if (file_hash(source_, hash_algorithm_from_name(manifest_.hash_algorithm), &size) != entry->hash)
    MOE_THROW("{}: contents do not match the hash in the manifest (corrupted)", source_);
}

namespace {

// A stored piece into every target that overlaps it: straight into one that holds it
// whole, else through `buffer`. Pieces are disjoint, so two threads never write one element.
void read_piece_into(const CheckpointShardReader& reader, const std::string& tensor, const ManifestPiece& piece,
                     const std::vector<const StateTarget*>& targets, std::vector<float>& buffer) {
  const int64_t piece_end = piece.begin + piece.count;
  const float* values = nullptr;
  for (const StateTarget* target : targets)
    if (target->begin <= piece.begin && piece_end <= target->begin + target->count) {
      float* into = target->data + (piece.begin - target->begin);
      reader.read_piece(tensor, piece, into);
      values = into;
      break;
    }
  if (!values) {
    buffer.resize(static_cast<size_t>(piece.count));
    reader.read_piece(tensor, piece, buffer.data());
    values = buffer.data();
  }
  for (const StateTarget* target : targets) {
    const int64_t lo = std::max(piece.begin, target->begin);
    const int64_t hi = std::min(piece_end, target->begin + target->count);
    float* to = target->data + (lo - target->begin);
    const float* from = values + (lo - piece.begin);
    if (hi > lo && to != from) std::memmove(to, from, static_cast<size_t>(hi - lo) * sizeof(float));
  }
}

}  // namespace

SliceReadStats read_slices(const LoadedCheckpoint& ckpt, const std::vector<StateTarget>& targets) {
  const auto start = Clock::now();
  // Each stored piece that some target overlaps, once, with those targets; by shard.
  using Key = std::tuple<int, std::string, int64_t>;  // shard, tensor, begin
  std::map<Key, std::pair<const ManifestPiece*, std::vector<const StateTarget*>>> uses;
  for (const StateTarget& target : targets) {
    const ManifestTensor* t = ckpt.find(target.tensor);
    if (!t) MOE_THROW("{}: the checkpoint has no tensor '{}'", ckpt.path.string(), target.tensor);
    if (t->shape != target.shape)
      MOE_THROW("{}: tensor '{}' has shape {} in the checkpoint, this run's model {}", ckpt.path.string(),
                target.tensor, shape_text(t->shape), shape_text(target.shape));
    MOE_CHECK(target.begin >= 0 && target.count >= 0 && target.begin + target.count <= t->numel(),
              "checkpoint read: elements [{}, {}) of '{}' lie outside its {}", target.begin,
              target.begin + target.count, target.tensor, t->numel());
    const int64_t end = target.begin + target.count;
    auto it = std::upper_bound(t->pieces.begin(), t->pieces.end(), target.begin,
                               [](int64_t at, const ManifestPiece& p) { return at < p.begin + p.count; });
    for (; it != t->pieces.end() && it->begin < end; ++it) {
      auto& use = uses[Key{it->shard, t->name, it->begin}];
      use.first = &*it;
      use.second.push_back(&target);
    }
  }
  // The pieces of up to kOpenShards shards at a time (a reader holds a descriptor: one
  // process resuming a 1,024-rank checkpoint must stay under the descriptor limit), each
  // batch read on several threads, largest piece first: one thread's pread, hashing and
  // first touch of fresh target pages reads about 1.2 GB/s, far below the page cache.
  using Entry = std::pair<const Key, std::pair<const ManifestPiece*, std::vector<const StateTarget*>>>;
  int64_t bytes = 0;
  std::exception_ptr error;
  std::mutex error_mutex;
  for (auto next = uses.begin(); next != uses.end();) {
    std::map<int, std::unique_ptr<CheckpointShardReader>> readers;
    std::vector<const Entry*> work;
    for (; next != uses.end(); ++next) {  // `uses` is ordered by shard first
      const int shard = std::get<0>(next->first);
      if (!readers.count(shard)) {
        if (readers.size() == kOpenShards) break;
        readers.emplace(shard, std::make_unique<CheckpointShardReader>(ckpt.path, ckpt.manifest, shard));
      }
      work.push_back(&*next);
    }
    std::stable_sort(work.begin(), work.end(),
                     [](const Entry* x, const Entry* y) { return x->second.first->count > y->second.first->count; });
    const int threads = std::max(1, std::min<int>({kIoThreads, available_cores(), static_cast<int>(work.size())}));
#pragma omp parallel num_threads(threads)
    {
      std::vector<float> buffer;
#pragma omp for schedule(dynamic, 1) reduction(+ : bytes)
      for (size_t i = 0; i < work.size(); ++i) {
        try {
          const auto& [key, use] = *work[i];
          read_piece_into(*readers.at(std::get<0>(key)), std::get<1>(key), *use.first, use.second, buffer);
          bytes += use.first->count * static_cast<int64_t>(sizeof(float));
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (!error) error = std::current_exception();
        }
      }
    }
    if (error) break;
  }
  if (error) std::rethrow_exception(error);
  SliceReadStats stats;
  stats.bytes = bytes;
  stats.seconds = seconds_since(start);
  return stats;
}

std::vector<float> read_tensor(const LoadedCheckpoint& ckpt, const std::string& tensor, int64_t begin, int64_t count) {
  const ManifestTensor* t = ckpt.find(tensor);
  if (!t) MOE_THROW("{}: the checkpoint has no tensor '{}'", ckpt.path.string(), tensor);
  if (count < 0) count = t->numel() - begin;
  std::vector<float> values(static_cast<size_t>(count));
  read_slices(ckpt, {{tensor, t->shape, begin, count, values.data()}});
  return values;
}

}  // namespace moe

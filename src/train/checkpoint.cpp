#include "train/checkpoint.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <random>
#include <set>
#include <sstream>
#include <utility>

#include "core/error.h"
#include "core/atomic_file.h"
#include "train/checkpoint_hash.h"
#include "train/checkpoint_shards.h"

namespace moe {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kManifest = "manifest.json";
constexpr const char* kConfigFile = "config.toml";
constexpr const char* kTokenizerFile = "tokenizer.json";
constexpr const char* kMarker = "COMPLETE";

std::string step_dir_name(int64_t step) { return fmt::format("step_{:08d}", step); }

// The step of a "step_NNNNNNNN" directory name, or nullopt.
std::optional<int64_t> parse_step_dir(const std::string& name) {
  if (!name.starts_with("step_") || name.size() == 5) return std::nullopt;
  int64_t step = 0;
  const char* begin = name.data() + 5;
  const char* end = name.data() + name.size();
  auto [p, ec] = std::from_chars(begin, end, step);
  if (ec != std::errc() || p != end || step < 0) return std::nullopt;
  return step;
}

// Version 1: the progress in the shard's string metadata; parsed strictly.
const std::string& metadata(const CheckpointShardReader& shard, const std::string& key) {
  const auto it = shard.header().metadata.find(key);
  if (it == shard.header().metadata.end()) MOE_THROW("{}: metadata key '{}' is missing", shard.source(), key);
  return it->second;
}

int64_t metadata_int(const CheckpointShardReader& shard, const std::string& key) {
  const std::string& text = metadata(shard, key);
  int64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size())
    MOE_THROW("{}: metadata '{}' is not an integer: \"{}\"", shard.source(), key, text);
  return v;
}

double metadata_double(const CheckpointShardReader& shard, const std::string& key) {
  const std::string& text = metadata(shard, key);
  double v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size() || !std::isfinite(v))
    MOE_THROW("{}: metadata '{}' is not a finite number: \"{}\"", shard.source(), key, text);
  return v;
}

std::vector<int64_t> split_ints(const CheckpointShardReader& shard, const std::string& key) {
  const std::string& text = metadata(shard, key);
  std::vector<int64_t> values;
  size_t start = 0;
  while (start < text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    int64_t v = 0;
    auto [p, ec] = std::from_chars(text.data() + start, text.data() + comma, v);
    if (ec != std::errc() || p != text.data() + comma)
      MOE_THROW("{}: metadata '{}' is not a list of integers: \"{}\"", shard.source(), key, text);
    values.push_back(v);
    start = comma + 1;
  }
  return values;
}

// Keys that decide which tensors exist and their shapes; the rest may change on resume.
const std::set<std::string> kShapeKeys = {
    "model.vocab_size", "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads",
    "model.first_dense_layers", "model.dense_hidden", "model.tie_embeddings", "moe.n_experts",
    "moe.expert_hidden", "moe.n_shared_experts"};

// "section.key" -> value text, from config_to_toml's "[section]" and "key = value" lines.
std::map<std::string, std::string> config_values(const std::string& toml_text) {
  std::map<std::string, std::string> values;
  std::istringstream lines(toml_text);
  std::string line, section;
  while (std::getline(lines, line)) {
    if (line.starts_with("[") && line.ends_with("]")) section = line.substr(1, line.size() - 2);
    else if (auto eq = line.find(" = "); eq != std::string::npos && !line.starts_with("#"))
      values[section + "." + line.substr(0, eq)] = line.substr(eq + 3);
  }
  return values;
}

bool is_complete(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / kMarker, ec);
}

// Complete checkpoint directories in `dir`, oldest first.
std::vector<std::pair<int64_t, fs::path>> complete_checkpoints(const fs::path& dir) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return found;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    auto step = parse_step_dir(entry.path().filename().string());
    if (step && entry.is_directory(ec) && is_complete(entry.path())) found.emplace_back(*step, entry.path());
  }
  std::sort(found.begin(), found.end());
  return found;
}

void prune(const fs::path& dir, int64_t keep_last, const fs::path& keep) {
  // The newest keep_last stay, and always the one just written, whatever steps the others have.
  auto complete = complete_checkpoints(dir);
  std::erase_if(complete, [&](const auto& checkpoint) { return checkpoint.second == keep; });
  const int64_t excess = static_cast<int64_t>(complete.size()) + 1 - keep_last;
  for (int64_t i = 0; i < excess; ++i) fs::remove_all(complete[static_cast<size_t>(i)].second);
  // Temporary and unmarked directories are leftovers of an interrupted save; a temporary
  // one of a later step may be another rank's save in progress (async saves) and stays.
  std::error_code ec;
  const int64_t written = parse_step_dir(keep.filename().string()).value_or(INT64_MAX);
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const auto temp_step = name.starts_with(".tmp.step_") ? parse_step_dir(name.substr(5, 13)) : std::nullopt;
    const bool stale_temp = name.starts_with(".tmp.step_") && (!temp_step || *temp_step <= written);
    const bool unmarked = parse_step_dir(name) && !is_complete(entry.path());
    if ((stale_temp || unmarked) && entry.path() != keep) fs::remove_all(entry.path(), ec);
  }
}

}  // namespace

namespace {

// A random id for a save of one process; several ranks share rank 0's (Trainer).
std::string new_save_id() {
  std::random_device random;
  const uint64_t id = (uint64_t{random()} << 32 | random()) ^
                      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return fmt::format("{:016x}", id);
}

}  // namespace

CheckpointSnapshot capture_state(const RunConfig& config, const SavedState& state, const BatchSource& train_data,
                                 const TrainProgress& progress) {
  CheckpointSnapshot snap;
  snap.config_toml = config_to_toml(config);
  snap.progress = progress;
  snap.adam_steps = state.adam_steps;
  snap.source_state = train_data.state();
  snap.save_id = new_save_id();
  for (const StatePiece& piece : state.pieces) {
    const auto [begin, count] = replica_share(piece.tensor, piece.begin, piece.count, piece.replicas, piece.replica);
    if (count == 0) continue;
    snap.tensors.push_back({piece.tensor, piece.shape, piece.data + (begin - piece.begin), count, begin});
  }
  if (state.owner) {
    snap.owners.push_back(state.owner);
    return snap;
  }
  // No owner: the pieces are valid until the next step, so the snapshot copies them, on
  // every core (a 57 GB state copies at several times one core's bandwidth).
  auto copies = std::make_shared<std::vector<std::vector<float>>>(snap.tensors.size());
  const auto n = static_cast<int64_t>(snap.tensors.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < n; ++t) {
    CheckpointSnapshot::Entry& entry = snap.tensors[static_cast<size_t>(t)];
    std::vector<float>& copy = (*copies)[static_cast<size_t>(t)];
    copy.assign(entry.data, entry.data + entry.count);
    entry.data = copy.data();
  }
  snap.owners.push_back(std::move(copies));
  return snap;
}

CheckpointSnapshot capture_checkpoint(const RunConfig& config, Transformer<float>& model, AdamW& optimizer,
                                      const BatchSource& train_data, const TrainProgress& progress) {
  SavedState state{host_state_pieces(model, optimizer, 1, 0), optimizer.steps_taken()};
  return capture_state(config, state, train_data, progress);
}

CheckpointWrite write_checkpoint(const fs::path& dir, const CheckpointSnapshot& snap, int64_t keep_last,
                                 double report_timeout_s) {
  const auto start = std::chrono::steady_clock::now();
  MOE_CHECK(!snap.save_id.empty() && snap.save_id.find('/') == std::string::npos, "checkpoint: bad save id '{}'",
            snap.save_id);
  const int64_t step = snap.progress.step;
  fs::create_directories(dir);
  const fs::path final_dir = dir / step_dir_name(step);
  const fs::path temp_dir = dir / fmt::format(".tmp.{}.{}", step_dir_name(step), snap.save_id);
  fs::create_directories(temp_dir);  // by whichever rank comes first
  CheckpointWrite written;
  written.step = step;
  written.path = final_dir;
  written.shard_bytes = write_shard(temp_dir, snap, &written.shard_seconds);
  written.bytes = written.shard_bytes;
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  if (snap.rank != 0) {
    written.seconds = elapsed();
    return written;
  }

  CheckpointManifest manifest;
  manifest.step = step;
  manifest.hash_algorithm = hash_algorithm_name(kCheckpointHash);
  manifest.run_id = snap.run_id;
  manifest.config_file = kConfigFile;
  manifest.config_hash = content_hash(snap.config_toml.data(), snap.config_toml.size());
  if (!snap.tokenizer_json.empty()) {
    manifest.tokenizer_file = kTokenizerFile;
    manifest.tokenizer_hash = content_hash(snap.tokenizer_json.data(), snap.tokenizer_json.size());
  }
  manifest.world_size = snap.world_size;
  manifest.expert_parallel = snap.expert_parallel;
  manifest.zero = snap.zero;
  manifest.save_id = snap.save_id;
  manifest.adam_steps = snap.adam_steps;
  manifest.lr_scale = snap.progress.lr_scale;
  manifest.skipped_steps = snap.progress.skipped_steps;
  manifest.nan_reloads = snap.progress.nan_reloads;
  manifest.source_state = snap.source_state;
  manifest.expert_placement = snap.expert_placement;
  manifest.expert_merge = snap.expert_merge;
  collect_reports(temp_dir, snap, report_timeout_s, manifest);
  write_file_atomic(temp_dir / kConfigFile, snap.config_toml);
  if (!snap.tokenizer_json.empty()) write_file_atomic(temp_dir / kTokenizerFile, snap.tokenizer_json);
  const std::string manifest_text = manifest_to_json(manifest);
  write_file_atomic(temp_dir / kManifest, manifest_text);

  if (fs::exists(final_dir)) fs::remove_all(final_dir);  // an older timeline's or an unmarked one
  fs::rename(temp_dir, final_dir);
  fsync_directory(dir);
  const std::string marker = std::string(hash_algorithm_name(kCheckpointHash)) + ":" +
                             content_hash(manifest_text.data(), manifest_text.size()) + "\n";
  write_file_atomic(final_dir / kMarker, marker);
  prune(dir, keep_last, final_dir);
  written.bytes = static_cast<int64_t>(snap.config_toml.size() + snap.tokenizer_json.size() + manifest_text.size() +
                                      marker.size());
  for (const ManifestShard& shard : manifest.shards) written.bytes += static_cast<int64_t>(shard.bytes);
  written.seconds = elapsed();
  return written;
}

fs::path checkpoint_path(const fs::path& dir, int64_t step) { return dir / step_dir_name(step); }

std::optional<fs::path> latest_checkpoint(const fs::path& dir) {
  auto complete = complete_checkpoints(dir);
  if (complete.empty()) return std::nullopt;
  return complete.back().second;
}

std::vector<CheckpointListing> list_checkpoints(const fs::path& dir) {
  std::vector<CheckpointListing> listing;
  for (const auto& [step, path] : complete_checkpoints(dir)) {
    std::string run_id;
    try {
      const json manifest = json::parse(read_file_bytes(path / kManifest), nullptr, false);
      if (manifest.is_object() && manifest.contains("run_id") && manifest["run_id"].is_string())
        run_id = manifest["run_id"];
    } catch (const std::exception&) {
      // unreadable: read_checkpoint says why if it is ever resumed
    }
    listing.push_back({step, path, run_id});
  }
  return listing;
}

const ManifestTensor* LoadedCheckpoint::find(const std::string& tensor) const {
  for (const ManifestTensor& t : manifest.tensors)
    if (t.name == tensor) return &t;
  return nullptr;
}

namespace {

// Version 1: the one shard's tensors, each one piece, and the progress from its metadata,
// after checking the whole file's hash.
void read_version_1(LoadedCheckpoint& loaded) {
  CheckpointManifest& m = loaded.manifest;
  const CheckpointShardReader shard(loaded.path, m, 0);
  shard.verify_whole_file();
  for (const SafeTensorInfo& info : shard.header().tensors) {
    ManifestTensor tensor{info.name, info.dtype, info.shape, {}};
    if (info.numel() > 0) tensor.pieces.push_back({0, 0, info.numel(), ""});
    m.tensors.push_back(std::move(tensor));
  }
  m.adam_steps = metadata_int(shard, "adam_steps");
  m.lr_scale = metadata_double(shard, "lr_scale");
  m.skipped_steps = metadata_int(shard, "skipped_steps");
  m.nan_reloads = metadata_int(shard, "nan_reloads");
  m.source_state = split_ints(shard, "source_state");
  if (const auto it = shard.header().metadata.find("expert_placement"); it != shard.header().metadata.end())
    m.expert_placement = it->second;
}

LoadedCheckpoint read_checkpoint_unchecked(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) MOE_THROW("{}: not a checkpoint directory", path.string());
  if (!fs::exists(path / kManifest, ec))
    MOE_THROW("{}: not a moe-train checkpoint (no {})", path.string(), kManifest);
  if (!is_complete(path))
    MOE_THROW("{}: checkpoint is incomplete (no {} marker): its save was interrupted", path.string(), kMarker);
  const std::string manifest_text = read_file_bytes(path / kManifest);
  std::string marker = read_file_bytes(path / kMarker);
  while (!marker.empty() && (marker.back() == '\n' || marker.back() == '\r')) marker.pop_back();
  // "ALGORITHM:HEX"; a bare HEX is FNV-1a (checkpoints written before XXH3).
  HashAlgorithm algorithm = HashAlgorithm::Fnv1a64;
  if (const size_t colon = marker.find(':'); colon != std::string::npos) {
    try {
      algorithm = hash_algorithm_from_name(marker.substr(0, colon));
    } catch (const Error& e) {
      MOE_THROW("{}: {}", (path / kMarker).string(), e.what());
    }
    marker.erase(0, colon + 1);
  }
  if (marker != content_hash(manifest_text.data(), manifest_text.size(), algorithm))
    MOE_THROW("{}: manifest does not match the hash in {} (corrupted)", (path / kManifest).string(), kMarker);

  LoadedCheckpoint loaded;
  loaded.path = path;
  loaded.manifest = parse_checkpoint_manifest(manifest_text, (path / kManifest).string());
  CheckpointManifest& m = loaded.manifest;
  if (m.hash_algorithm != hash_algorithm_name(algorithm))
    MOE_THROW("{}: hash_algorithm {} differs from the {} marker's {}", (path / kManifest).string(), m.hash_algorithm,
              kMarker, hash_algorithm_name(algorithm));
  loaded.step = m.step;
  loaded.config_toml = read_file_bytes(path / m.config_file);
  if (m.config_hash != content_hash(loaded.config_toml.data(), loaded.config_toml.size(), algorithm))
    MOE_THROW("{}: config does not match its hash in the manifest (corrupted)", (path / m.config_file).string());
  try {
    loaded.config = parse_config(loaded.config_toml, (path / m.config_file).string());
  } catch (const ConfigError& e) {
    throw Error(e.what());  // a stored config that does not parse is a broken checkpoint, not user input
  }
  if (!m.tokenizer_file.empty()) {
    loaded.tokenizer_json = read_file_bytes(path / m.tokenizer_file);
    if (m.tokenizer_hash != content_hash(loaded.tokenizer_json.data(), loaded.tokenizer_json.size(), algorithm))
      MOE_THROW("{}: does not match its hash in the manifest (corrupted)", (path / m.tokenizer_file).string());
  }
  if (m.version == 1) {
    read_version_1(loaded);
  } else {
    // Every shard present, of its size, of this save, its header intact (the pieces are
    // checked as they are read).
    for (size_t s = 0; s < m.shards.size(); ++s) CheckpointShardReader(path, m, static_cast<int>(s));
  }
  loaded.run_id = m.run_id;
  loaded.expert_placement = m.expert_placement;
  loaded.expert_merge = m.expert_merge;
  return loaded;
}

}  // namespace

LoadedCheckpoint read_checkpoint(const fs::path& path) {
  try {
    return read_checkpoint_unchecked(path);
  } catch (const json::exception& e) {
    // A manifest field of the wrong JSON type.
    MOE_THROW("{}: malformed checkpoint manifest: {}", (path / kManifest).string(), e.what());
  }
}

TrainProgress checkpoint_progress(const LoadedCheckpoint& ckpt) {
  TrainProgress progress;
  progress.step = ckpt.step;
  progress.lr_scale = ckpt.manifest.lr_scale;
  progress.skipped_steps = ckpt.manifest.skipped_steps;
  progress.nan_reloads = ckpt.manifest.nan_reloads;
  return progress;
}

TrainProgress restore_checkpoint(const LoadedCheckpoint& ckpt, Transformer<float>& model, AdamW& optimizer,
                                 BatchSource& train_data) {
  read_slices(ckpt, host_state_targets(model, optimizer));
  optimizer.set_steps_taken(ckpt.manifest.adam_steps);
  train_data.restore(ckpt.manifest.source_state);
  return checkpoint_progress(ckpt);
}

void check_resume_compatible(const LoadedCheckpoint& saved, const RunConfig& current, std::ostream& out) {
  const auto before = config_values(saved.config_toml);
  for (const auto& [name, now] : config_values(config_to_toml(current))) {
    auto it = before.find(name);
    const std::string was = it == before.end() ? "(absent)" : it->second;
    if (was == now) continue;
    const std::string section = name.substr(0, name.find('.'));
    if (kShapeKeys.count(name))
      MOE_CONFIG_ERROR("{}: cannot resume: {} is {} in the checkpoint but {} in this run's config (the model "
                       "shape must match)", saved.path.string(), name, was, now);
    // Keys that only steer this session, not the state being continued.
    if (name == "training.stop_at" || name == "training.threads" || section == "checkpoint" || section == "metrics")
      continue;
    fmt::print(out, "warning: resume: {} was {} in the checkpoint, now {}\n", name, was, now);
  }
}

Checkpointer::~Checkpointer() {
  if (worker_.joinable()) worker_.join();
}

std::optional<CheckpointWrite> Checkpointer::wait() {
  if (worker_.joinable()) worker_.join();
  finished_ = false;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  return std::exchange(written_, std::nullopt);
}

std::optional<CheckpointWrite> Checkpointer::take_finished() {
  if (!finished_) return std::nullopt;
  return wait();
}

std::optional<CheckpointWrite> Checkpointer::save(CheckpointSnapshot snapshot) {
  MOE_CHECK(!wait(), "a finished background save was not reported before the next one");
  if (!config_.async) return write_checkpoint(config_.dir, snapshot, config_.keep_last);
  worker_ = std::thread([this, snap = std::move(snapshot)] {
    try {
      written_ = write_checkpoint(config_.dir, snap, config_.keep_last);
    } catch (...) {
      error_ = std::current_exception();
    }
    finished_ = true;
  });
  return std::nullopt;
}

}  // namespace moe

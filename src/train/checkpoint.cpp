#include "train/checkpoint.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <map>
#include <set>
#include <cmath>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>
#include <utility>

#include "core/error.h"
#include "core/atomic_file.h"
#include "train/checkpoint_hash.h"

namespace moe {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kFormat = "moe-train-checkpoint";
constexpr int kVersion = 1;
constexpr const char* kManifest = "manifest.json";
constexpr const char* kConfigFile = "config.toml";
constexpr const char* kMarker = "COMPLETE";

std::string step_dir_name(int64_t step) { return fmt::format("step_{:08d}", step); }
std::string shard_name(int rank) { return fmt::format("rank_{:05d}.safetensors", rank); }

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

std::vector<int64_t> dims_of(const Shape& shape) {
  return std::vector<int64_t>(shape.dims.begin(), shape.dims.begin() + shape.ndim);
}

// Integers and doubles in the shard's string metadata; parsed strictly on the way back.
int64_t metadata_int(const SafeTensorsFile& shard, const std::string& key) {
  const std::string& text = shard.metadata(key);
  int64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size())
    MOE_THROW("{}: metadata '{}' is not an integer: \"{}\"", shard.source(), key, text);
  return v;
}

double metadata_double(const SafeTensorsFile& shard, const std::string& key) {
  const std::string& text = shard.metadata(key);
  double v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size() || !std::isfinite(v))
    MOE_THROW("{}: metadata '{}' is not a finite number: \"{}\"", shard.source(), key, text);
  return v;
}

std::string join_ints(const std::vector<int64_t>& values) {
  std::string out;
  for (int64_t v : values) out += (out.empty() ? "" : ",") + std::to_string(v);
  return out;
}

std::vector<int64_t> split_ints(const SafeTensorsFile& shard, const std::string& key) {
  const std::string& text = shard.metadata(key);
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
  // Temporary and unmarked directories are leftovers of an interrupted save.
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool stale_temp = name.starts_with(".tmp.step_");
    const bool unmarked = parse_step_dir(name) && !is_complete(entry.path());
    if ((stale_temp || unmarked) && entry.path() != keep) fs::remove_all(entry.path(), ec);
  }
}

}  // namespace

CheckpointSnapshot capture_checkpoint(const RunConfig& config, Transformer<float>& model, AdamW& optimizer,
                                      const BatchSource& train_data, const TrainProgress& progress) {
  CheckpointSnapshot snap;
  snap.config_toml = config_to_toml(config);
  snap.progress = progress;
  snap.adam_steps = optimizer.steps_taken();
  snap.source_state = train_data.state();
  auto& params = model.params();
  const auto& m = optimizer.first_moment();
  const auto& v = optimizer.second_moment();
  int64_t offset = 0;  // AdamW keeps one moment block with the parameters back to back
  for (int id = 0; id < params.size(); ++id) {
    const int64_t n = params.numel(id);
    const std::vector<int64_t> shape = dims_of(params.spec(id).shape);
    const float* p = params.value(id);
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(p[i])) MOE_THROW("parameter '{}' is not finite; refusing to checkpoint it", params.spec(id).name);
    snap.tensors.push_back({"param/" + params.spec(id).name, shape, std::vector<float>(p, p + n)});
    snap.tensors.push_back({"adam_m/" + params.spec(id).name, shape,
                            std::vector<float>(m.begin() + offset, m.begin() + offset + n)});
    snap.tensors.push_back({"adam_v/" + params.spec(id).name, shape,
                            std::vector<float>(v.begin() + offset, v.begin() + offset + n)});
    offset += n;
  }
  MOE_CHECK(offset == static_cast<int64_t>(m.size()), "optimizer state holds {} values, parameters {}", m.size(),
            offset);
  for (auto* layer : model.moe_layers()) {
    const auto& bias = layer->balance_bias_E();
    snap.tensors.push_back({"balance_bias/" + layer->prefix(), {static_cast<int64_t>(bias.size())}, bias});
  }
  return snap;
}

CheckpointWrite write_checkpoint(const fs::path& dir, const CheckpointSnapshot& snap, int64_t keep_last) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t step = snap.progress.step;
  fs::create_directories(dir);
  const fs::path final_dir = dir / step_dir_name(step);
  const fs::path temp_dir = dir / fmt::format(".tmp.{}.{}", step_dir_name(step), ::getpid());
  fs::remove_all(temp_dir);
  fs::create_directories(temp_dir);

  SafeTensorsWriter shard;
  for (const auto& t : snap.tensors) shard.add_f32(t.name, t.shape, t.data.data());
  shard.set_metadata("format", kFormat);
  shard.set_metadata("version", std::to_string(kVersion));
  shard.set_metadata("rank", "0");
  shard.set_metadata("world_size", "1");
  shard.set_metadata("step", std::to_string(step));
  shard.set_metadata("adam_steps", std::to_string(snap.adam_steps));
  shard.set_metadata("lr_scale", fmt::format("{}", snap.progress.lr_scale));  // shortest exact text
  shard.set_metadata("skipped_steps", std::to_string(snap.progress.skipped_steps));
  shard.set_metadata("nan_reloads", std::to_string(snap.progress.nan_reloads));
  shard.set_metadata("source_state", join_ints(snap.source_state));
  if (!snap.expert_placement.empty()) shard.set_metadata("expert_placement", snap.expert_placement);
  shard.write(temp_dir / shard_name(0));
  write_file_atomic(temp_dir / kConfigFile, snap.config_toml);

  // The manifest hashes what was written, read back from disk block by block.
  uint64_t shard_size = 0;
  const std::string shard_hash = file_hash(temp_dir / shard_name(0), kCheckpointHash, &shard_size);
  json manifest = {{"format", kFormat},
                   {"version", kVersion},
                   {"step", step},
                   {"world_size", 1},
                   {"hash_algorithm", hash_algorithm_name(kCheckpointHash)},
                   {"run_id", snap.run_id},
                   {"config", {{"file", kConfigFile},
                               {"hash", content_hash(snap.config_toml.data(), snap.config_toml.size())}}},
                   {"shards", json::array({{{"rank", 0},
                                            {"file", shard_name(0)},
                                            {"bytes", shard_size},
                                            {"hash", shard_hash}}})}};
  const std::string manifest_text = manifest.dump(2) + "\n";
  write_file_atomic(temp_dir / kManifest, manifest_text);

  if (fs::exists(final_dir)) fs::remove_all(final_dir);  // an older timeline's or an unmarked one
  fs::rename(temp_dir, final_dir);
  fsync_directory(dir);
  const std::string marker =
      std::string(hash_algorithm_name(kCheckpointHash)) + ":" + content_hash(manifest_text.data(), manifest_text.size()) + "\n";
  write_file_atomic(final_dir / kMarker, marker);
  prune(dir, keep_last, final_dir);
  CheckpointWrite written;
  written.step = step;
  written.path = final_dir;
  written.bytes = static_cast<int64_t>(shard_size + snap.config_toml.size() + manifest_text.size() +
                                       marker.size());
  written.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
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

namespace {
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
  const json manifest = json::parse(manifest_text, nullptr, false);
  if (manifest.is_discarded() || !manifest.is_object() || manifest.value("format", "") != kFormat)
    MOE_THROW("{}: not a moe-train checkpoint manifest", (path / kManifest).string());
  if (manifest.contains("hash_algorithm") && !manifest.at("hash_algorithm").is_string())
    MOE_THROW("{}: hash_algorithm must be a string", (path / kManifest).string());
  if (manifest.value("hash_algorithm", "fnv1a64") != hash_algorithm_name(algorithm))
    MOE_THROW("{}: hash_algorithm {} differs from the {} marker's {}", (path / kManifest).string(),
              manifest.value("hash_algorithm", "fnv1a64"), kMarker, hash_algorithm_name(algorithm));
  if (manifest.value("version", 0) != kVersion)
    MOE_THROW("{}: checkpoint format version {} is not supported (this build reads {})",
              (path / kManifest).string(), manifest.value("version", 0), kVersion);
  const int64_t world_size = manifest.value("world_size", int64_t{0});
  if (world_size != 1)
    MOE_THROW("{}: checkpoint has {} rank shards; resharding to a different world size is not implemented yet",
              path.string(), world_size);

  LoadedCheckpoint loaded;
  loaded.path = path;
  loaded.step = manifest.value("step", int64_t{-1});
  const json config_entry = manifest.contains("config") ? manifest.at("config") : json();
  loaded.config_toml = read_file_bytes(path / kConfigFile);
  if (!config_entry.is_object() ||
      config_entry.value("hash", "") != content_hash(loaded.config_toml.data(), loaded.config_toml.size(), algorithm))
    MOE_THROW("{}: config does not match its hash in the manifest (corrupted)", (path / kConfigFile).string());
  try {
    loaded.config = parse_config(loaded.config_toml, (path / kConfigFile).string());
  } catch (const ConfigError& e) {
    throw Error(e.what());  // a stored config that does not parse is a broken checkpoint, not user input
  }

  const json shards = manifest.contains("shards") ? manifest.at("shards") : json();
  if (!shards.is_array() || shards.size() != 1 || !shards[0].is_object() ||
      shards[0].value("file", "").find('/') != std::string::npos || shards[0].value("file", "").empty())
    MOE_THROW("{}: manifest must list exactly one shard file", (path / kManifest).string());
  const fs::path shard_path = path / shards[0].value("file", "");
  std::string bytes = read_file_bytes(shard_path);
  if (shards[0].value("bytes", uint64_t{0}) != bytes.size())
    MOE_THROW("{}: {} bytes, the manifest says {} (truncated?)", shard_path.string(), bytes.size(),
              shards[0].value("bytes", uint64_t{0}));
  if (shards[0].value("hash", "") != content_hash(bytes.data(), bytes.size(), algorithm))
    MOE_THROW("{}: contents do not match the hash in the manifest (corrupted)", shard_path.string());
  loaded.shard = SafeTensorsFile::from_bytes(std::move(bytes), shard_path.string());
  auto fmt_it = loaded.shard.header().metadata.find("format");
  if (fmt_it == loaded.shard.header().metadata.end() || fmt_it->second != kFormat)
    MOE_THROW("{}: not a moe-train checkpoint shard (metadata 'format' is not {})", shard_path.string(), kFormat);
  if (metadata_int(loaded.shard, "step") != loaded.step)
    MOE_THROW("{}: shard step {} differs from the manifest's {}", shard_path.string(),
              metadata_int(loaded.shard, "step"), loaded.step);
  if (manifest.contains("run_id")) loaded.run_id = manifest.at("run_id").get<std::string>();
  const auto placement = loaded.shard.header().metadata.find("expert_placement");
  if (placement != loaded.shard.header().metadata.end()) loaded.expert_placement = placement->second;
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

TrainProgress restore_checkpoint(const LoadedCheckpoint& ckpt, Transformer<float>& model, AdamW& optimizer,
                                 BatchSource& train_data) {
  const SafeTensorsFile& shard = ckpt.shard;
  auto& params = model.params();
  auto& m = optimizer.first_moment();
  auto& v = optimizer.second_moment();
  int64_t offset = 0;
  for (int id = 0; id < params.size(); ++id) {
    const std::string& name = params.spec(id).name;
    const int64_t n = params.numel(id);
    const std::vector<int64_t> shape = dims_of(params.spec(id).shape);
    for (const std::string prefix : {"param/", "adam_m/", "adam_v/"})
      if (shard.info(prefix + name).shape != shape)
        MOE_THROW("{}: tensor '{}{}' has another shape than the model's {}", shard.source(), prefix, name,
                  params.spec(id).shape.str());
    shard.read_f32("param/" + name, params.value(id), n);
    shard.read_f32("adam_m/" + name, m.data() + offset, n);
    shard.read_f32("adam_v/" + name, v.data() + offset, n);
    offset += n;
  }
  for (auto* layer : model.moe_layers()) {
    auto& bias = layer->balance_bias_E();
    shard.read_f32("balance_bias/" + layer->prefix(), bias.data(), static_cast<int64_t>(bias.size()));
  }
  optimizer.set_steps_taken(metadata_int(shard, "adam_steps"));
  train_data.restore(split_ints(shard, "source_state"));
  TrainProgress progress;
  progress.step = ckpt.step;
  progress.lr_scale = metadata_double(shard, "lr_scale");
  progress.skipped_steps = metadata_int(shard, "skipped_steps");
  progress.nan_reloads = metadata_int(shard, "nan_reloads");
  return progress;
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

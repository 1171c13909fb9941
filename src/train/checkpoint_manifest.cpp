#include "train/checkpoint_manifest.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"

namespace moe {
namespace {

using json = nlohmann::json;
constexpr const char* kFormat = "moe-train-checkpoint";

[[noreturn]] void bad(const std::string& source, const std::string& what) {
  throw Error(fmt::format("{}: {}", source, what));
}

// Typed fields: a missing or mistyped one is one line naming it.
const json& field(const json& object, const char* key, const std::string& where, const std::string& source) {
  const auto it = object.find(key);
  if (it == object.end()) bad(source, fmt::format("{} lacks \"{}\"", where, key));
  return *it;
}

int64_t int_field(const json& object, const char* key, const std::string& where, const std::string& source,
                  int64_t min = 0) {
  const json& value = field(object, key, where, source);
  if (!value.is_number_integer() || (value.is_number_unsigned() && value.get<uint64_t>() > INT64_MAX) ||
      value.get<int64_t>() < min)
    bad(source, fmt::format("{}: \"{}\" must be an integer >= {}", where, key, min));
  return value.get<int64_t>();
}

std::string string_field(const json& object, const char* key, const std::string& where, const std::string& source) {
  const json& value = field(object, key, where, source);
  if (!value.is_string()) bad(source, fmt::format("{}: \"{}\" must be a string", where, key));
  return value.get<std::string>();
}

const json& array_field(const json& object, const char* key, const std::string& where, const std::string& source) {
  const json& value = field(object, key, where, source);
  if (!value.is_array()) bad(source, fmt::format("{}: \"{}\" must be an array", where, key));
  return value;
}

bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

std::vector<ManifestShard> parse_shards(const json& root, int version, const std::string& source) {
  const json& list = array_field(root, "shards", "manifest", source);
  if (list.empty()) bad(source, "manifest lists no shard files");
  if (version == 1 && list.size() != 1) bad(source, "a version 1 manifest must list exactly one shard file");
  std::vector<ManifestShard> shards;
  std::set<std::string> files;
  std::set<int64_t> ranks;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string where = fmt::format("shards[{}]", i);
    if (!list[i].is_object()) bad(source, where + " is not an object");
    ManifestShard shard;
    const int64_t rank = int_field(list[i], "rank", where, source);
    if (rank > std::numeric_limits<int>::max()) bad(source, where + ": rank too large");
    shard.rank = static_cast<int>(rank);
    shard.file = string_field(list[i], "file", where, source);
    if (!plain_file_name(shard.file)) bad(source, fmt::format("{}: \"{}\" is not a file name", where, shard.file));
    shard.bytes = static_cast<uint64_t>(int_field(list[i], "bytes", where, source));
    shard.hash = string_field(list[i], "hash", where, source);
    if (version >= 2) shard.header_hash = string_field(list[i], "header_hash", where, source);
    if (!files.insert(shard.file).second) bad(source, fmt::format("shard file {} is listed twice", shard.file));
    if (!ranks.insert(shard.rank).second) bad(source, fmt::format("rank {} has two shard files", shard.rank));
    shards.push_back(std::move(shard));
  }
  return shards;
}

std::vector<ManifestTensor> parse_tensors(const json& root, size_t n_shards, const std::string& source) {
  const json& list = array_field(root, "tensors", "manifest", source);
  std::vector<ManifestTensor> tensors;
  std::set<std::string> names;
  for (size_t i = 0; i < list.size(); ++i) {
    std::string where = fmt::format("tensors[{}]", i);
    if (!list[i].is_object()) bad(source, where + " is not an object");
    ManifestTensor tensor;
    tensor.name = string_field(list[i], "name", where, source);
    where = fmt::format("tensor '{}'", tensor.name);
    if (tensor.name.empty() || !names.insert(tensor.name).second) bad(source, where + " is empty or listed twice");
    tensor.dtype = string_field(list[i], "dtype", where, source);
    if (tensor.dtype != "F32") bad(source, fmt::format("{}: dtype {} (checkpoints hold F32)", where, tensor.dtype));
    int64_t numel = 1;
    for (const json& dim : array_field(list[i], "shape", where, source)) {
      if (!dim.is_number_integer() || dim.get<int64_t>() < 0 || (dim.is_number_unsigned() && dim.get<uint64_t>() > INT64_MAX))
        bad(source, where + ": shape entries must be non-negative integers");
      if (__builtin_mul_overflow(numel, dim.get<int64_t>(), &numel) || numel > (int64_t{1} << 50))
        bad(source, where + ": shape overflows");
      tensor.shape.push_back(dim.get<int64_t>());
    }
    for (const json& p : array_field(list[i], "pieces", where, source)) {
      if (!p.is_object()) bad(source, where + ": a piece is not an object");
      ManifestPiece piece;
      const int64_t shard = int_field(p, "shard", where + " piece", source);
      if (static_cast<uint64_t>(shard) >= n_shards)
        bad(source, fmt::format("{}: a piece names shard {} of {}", where, shard, n_shards));
      piece.shard = static_cast<int>(shard);
      piece.begin = int_field(p, "begin", where + " piece", source);
      piece.count = int_field(p, "count", where + " piece", source, 1);
      piece.hash = string_field(p, "hash", where + " piece", source);
      tensor.pieces.push_back(std::move(piece));
    }
    tensors.push_back(std::move(tensor));
  }
  return tensors;
}

}  // namespace

int64_t ManifestTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string stored_piece_name(const std::string& tensor, int64_t begin, int version) {
  return version == 1 ? tensor : fmt::format("{}@{}", tensor, begin);
}

void check_tensor_coverage(std::vector<ManifestTensor>& tensors, const std::vector<ManifestShard>& shards,
                           const std::string& source) {
  auto file = [&](int shard) {
    return shard >= 0 && static_cast<size_t>(shard) < shards.size() ? shards[static_cast<size_t>(shard)].file
                                                                   : fmt::format("shard {}", shard);
  };
  for (ManifestTensor& t : tensors) {
    std::sort(t.pieces.begin(), t.pieces.end(),
              [](const ManifestPiece& a, const ManifestPiece& b) { return a.begin < b.begin; });
    int64_t next = 0;
    for (size_t i = 0; i < t.pieces.size(); ++i) {
      const ManifestPiece& p = t.pieces[i];
      if (p.shard < 0 || static_cast<size_t>(p.shard) >= shards.size())
        bad(source, fmt::format("tensor '{}': a piece names {}, not one of the {} shards", t.name, file(p.shard),
                                shards.size()));
      if (p.count <= 0 || p.begin < 0) bad(source, fmt::format("tensor '{}': an empty or negative piece", t.name));
      if (p.begin < next)
        bad(source, fmt::format("tensor '{}': elements [{}, {}) are stored twice ({} and {})", t.name, p.begin,
                                std::min(next, p.begin + p.count), file(t.pieces[i - 1].shard), file(p.shard)));
      if (p.begin > next)
        bad(source, fmt::format("tensor '{}': elements [{}, {}) are in no shard", t.name, next, p.begin));
      if (__builtin_add_overflow(p.begin, p.count, &next)) bad(source, fmt::format("tensor '{}': piece overflows", t.name));
    }
    if (next > t.numel())
      bad(source, fmt::format("tensor '{}': pieces reach element {}, past its {} elements", t.name, next, t.numel()));
    if (next < t.numel())
      bad(source, fmt::format("tensor '{}': elements [{}, {}) are in no shard", t.name, next, t.numel()));
  }
}

CheckpointManifest parse_checkpoint_manifest(std::string_view text, const std::string& source) {
  const json root = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object() || !root.contains("format") || root["format"] != kFormat)
    bad(source, "not a moe-train checkpoint manifest");
  CheckpointManifest m;
  const json& version = field(root, "version", "manifest", source);
  if (!version.is_number_integer() || (version.get<int64_t>() != 1 && version.get<int64_t>() != kCheckpointVersion))
    bad(source, fmt::format("checkpoint format version {} is not supported (this build reads 1 and {})",
                            version.dump(), kCheckpointVersion));
  m.version = static_cast<int>(version.get<int64_t>());
  m.step = int_field(root, "step", "manifest", source);
  // Checkpoints written before XXH3 name no algorithm: FNV-1a.
  m.hash_algorithm = root.contains("hash_algorithm") ? string_field(root, "hash_algorithm", "manifest", source) : "fnv1a64";
  if (root.contains("run_id")) m.run_id = string_field(root, "run_id", "manifest", source);
  const json& config = field(root, "config", "manifest", source);
  if (!config.is_object()) bad(source, "manifest: \"config\" must be an object");
  m.config_file = string_field(config, "file", "config", source);
  if (!plain_file_name(m.config_file)) bad(source, fmt::format("config: \"{}\" is not a file name", m.config_file));
  m.config_hash = string_field(config, "hash", "config", source);
  if (root.contains("tokenizer")) {
    const json& tokenizer = field(root, "tokenizer", "manifest", source);
    if (!tokenizer.is_object()) bad(source, "manifest: \"tokenizer\" must be an object");
    m.tokenizer_file = string_field(tokenizer, "file", "tokenizer", source);
    if (!plain_file_name(m.tokenizer_file))
      bad(source, fmt::format("tokenizer: \"{}\" is not a file name", m.tokenizer_file));
    m.tokenizer_hash = string_field(tokenizer, "hash", "tokenizer", source);
  }
  m.world_size = int_field(root, "world_size", "manifest", source, 1);
  m.shards = parse_shards(root, m.version, source);
  if (m.version == 1) return m;  // the rest is in the shard (read_checkpoint)

  const json& layout = field(root, "layout", "manifest", source);
  if (!layout.is_object()) bad(source, "manifest: \"layout\" must be an object");
  m.expert_parallel = int_field(layout, "expert_parallel", "layout", source, 1);
  m.zero = int_field(layout, "zero", "layout", source);
  m.save_id = string_field(layout, "save_id", "layout", source);
  if (static_cast<size_t>(m.world_size) != m.shards.size())
    bad(source, fmt::format("world_size {} but {} shard files", m.world_size, m.shards.size()));
  const json& state = field(root, "state", "manifest", source);
  if (!state.is_object()) bad(source, "manifest: \"state\" must be an object");
  m.adam_steps = int_field(state, "adam_steps", "state", source);
  m.skipped_steps = int_field(state, "skipped_steps", "state", source);
  m.nan_reloads = int_field(state, "nan_reloads", "state", source);
  const json& lr_scale = field(state, "lr_scale", "state", source);
  if (!lr_scale.is_number() || !std::isfinite(lr_scale.get<double>()))
    bad(source, "state: \"lr_scale\" must be a finite number");
  m.lr_scale = lr_scale.get<double>();
  for (const json& v : array_field(state, "source_state", "state", source)) {
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX))
      bad(source, "state: \"source_state\" must hold integers");
    m.source_state.push_back(v.get<int64_t>());
  }
  if (state.contains("expert_placement")) m.expert_placement = string_field(state, "expert_placement", "state", source);
  if (state.contains("expert_merge")) m.expert_merge = string_field(state, "expert_merge", "state", source);
  m.tensors = parse_tensors(root, m.shards.size(), source);
  check_tensor_coverage(m.tensors, m.shards, source);
  return m;
}

std::string manifest_to_json(const CheckpointManifest& m) {
  json shards = json::array();
  for (const ManifestShard& s : m.shards)
    shards.push_back({{"rank", s.rank}, {"file", s.file}, {"bytes", s.bytes}, {"hash", s.hash}, {"header_hash", s.header_hash}});
  json tensors = json::array();
  for (const ManifestTensor& t : m.tensors) {
    json pieces = json::array();
    for (const ManifestPiece& p : t.pieces)
      pieces.push_back({{"shard", p.shard}, {"begin", p.begin}, {"count", p.count}, {"hash", p.hash}});
    tensors.push_back({{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}, {"pieces", std::move(pieces)}});
  }
  json state = {{"adam_steps", m.adam_steps},
                {"lr_scale", m.lr_scale},  // JSON numbers round-trip doubles exactly
                {"skipped_steps", m.skipped_steps},
                {"nan_reloads", m.nan_reloads},
                {"source_state", m.source_state}};
  if (!m.expert_placement.empty()) state["expert_placement"] = m.expert_placement;
  if (!m.expert_merge.empty()) state["expert_merge"] = m.expert_merge;
  json root = {{"format", kFormat},
                     {"version", m.version},
                     {"step", m.step},
                     {"world_size", m.world_size},
                     {"hash_algorithm", m.hash_algorithm},
                     {"run_id", m.run_id},
                     {"config", {{"file", m.config_file}, {"hash", m.config_hash}}},
                     {"layout", {{"expert_parallel", m.expert_parallel}, {"zero", m.zero}, {"save_id", m.save_id}}},
                     {"state", std::move(state)},
                     {"shards", std::move(shards)},
                     {"tensors", std::move(tensors)}};
  if (!m.tokenizer_file.empty()) root["tokenizer"] = {{"file", m.tokenizer_file}, {"hash", m.tokenizer_hash}};
  return root.dump(1) + "\n";
}

Range replica_share(const std::string& tensor, int64_t begin, int64_t count, int replicas, int replica) {
  if (replicas <= 1) return {begin, count};
  if (count < kWholePieceElements) {
    // FNV-1a of the name and begin: the same choice on every copy, spread over the copies.
    uint64_t h = 1469598103934665603ull;
    for (char c : tensor + "@" + std::to_string(begin)) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    return static_cast<int>(h % static_cast<uint64_t>(replicas)) == replica ? Range{begin, count} : Range{begin, 0};
  }
  const int64_t lo = count * replica / replicas, hi = count * (replica + 1) / replicas;
  return {begin + lo, hi - lo};
}

}  // namespace moe

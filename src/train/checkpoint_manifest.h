// The manifest of a checkpoint (manifest.json): the global layout of the saved state and
// the progress beside it. Every saved tensor is a named global tensor (param/NAME,
// adam_m/NAME, adam_v/NAME, balance_bias/LAYER) of a dtype and shape; its flat elements
// are stored as pieces [begin, begin + count), each in one rank's shard file
// (rank_NNNNN.safetensors, as the 1-D tensor "NAME@BEGIN") with its own hash. Together the
// pieces cover every element of every tensor exactly once (check_tensor_coverage).
// docs/CHECKPOINTS.md describes every field. Parsing trusts nothing (fuzzed:
// fuzz/fuzz_checkpoint_manifest.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/range.h"

namespace moe {

// Version 1: one shard holding every tensor whole, the progress in its metadata (read
// only). Version 2: shards of pieces, the layout and the progress in the manifest.
constexpr int kCheckpointVersion = 2;

struct ManifestPiece {
  int shard = 0;  // index into CheckpointManifest::shards
  int64_t begin = 0, count = 0;
  std::string hash;  // of the piece's bytes; empty in version 1 (the shard's hash covers it)
};

struct ManifestTensor {
  std::string name;
  std::string dtype = "F32";
  std::vector<int64_t> shape;
  std::vector<ManifestPiece> pieces;  // ascending begin once checked
  int64_t numel() const;
};

struct ManifestShard {
  int rank = 0;
  std::string file;         // a file name in the checkpoint directory
  uint64_t bytes = 0;
  std::string hash;         // of the whole file
  std::string header_hash;  // of its safetensors header (length prefix included); empty in version 1
};

struct CheckpointManifest {
  int version = kCheckpointVersion;
  int64_t step = 0;
  std::string hash_algorithm = "xxh3_64";
  std::string run_id;
  std::string config_file = "config.toml", config_hash;
  // The run's tokenizer as a Hugging Face tokenizer.json (Tokenizer::hf_tokenizer_json);
  // empty file: none saved (a tokenizer without that form, or an older checkpoint).
  std::string tokenizer_file, tokenizer_hash;
  // The layout that wrote it: ranks, expert-parallel size, ZeRO level; save_id names this
  // save in every shard's metadata (a shard of another save is foreign).
  int64_t world_size = 1, expert_parallel = 1, zero = 0;
  std::string save_id;
  std::vector<ManifestShard> shards;
  std::vector<ManifestTensor> tensors;  // version 1: filled from the shard's header by read_checkpoint
  // Progress (version 1: from the shard's metadata).
  int64_t adam_steps = 0;
  double lr_scale = 1.0;
  int64_t skipped_steps = 0, nan_reloads = 0;
  std::vector<int64_t> source_state;
  std::string expert_placement;  // ModelBackend::placement_state; empty: none
  std::string expert_merge;      // the trainer's expert-merging state (JSON); empty: none
};

// Parses and checks a manifest's text (structure, types, file names, shapes, coverage for
// version 2). Throws moe::Error with one line naming `source` and what is wrong.
CheckpointManifest parse_checkpoint_manifest(std::string_view text, const std::string& source);
// The JSON text of a version-2 manifest (what parse_checkpoint_manifest reads back).
std::string manifest_to_json(const CheckpointManifest& manifest);

// Every tensor's pieces, in ascending order, cover [0, numel) exactly once and name
// existing shards. Sorts the pieces; throws one line naming `source`, the tensor, the
// elements and the shard files at fault.
void check_tensor_coverage(std::vector<ManifestTensor>& tensors, const std::vector<ManifestShard>& shards,
                           const std::string& source);

// The name under which a piece is stored in its shard.
std::string stored_piece_name(const std::string& tensor, int64_t begin, int version);

// The part of elements [begin, begin + count) that copy `replica` of `replicas` identical
// copies writes: an even split into contiguous parts, so that the ranks write in parallel;
// pieces under kWholePieceElements go whole to one copy (picked from the name and begin,
// so every copy picks the same). {begin, 0}: nothing.
constexpr int64_t kWholePieceElements = 4096;
Range replica_share(const std::string& tensor, int64_t begin, int64_t count, int replicas, int replica);

}  // namespace moe

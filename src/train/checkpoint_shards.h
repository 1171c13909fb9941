// The shard files of a checkpoint (train/checkpoint.h): one rank writing its shard and
// report, rank 0 collecting the reports into the manifest's layout, and the checks and
// reads of shards on resume. Internal to checkpoint.cpp (and its tests).
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "train/checkpoint.h"
#include "train/checkpoint_manifest.h"
#include "train/safetensors.h"

namespace moe {

std::string shard_file_name(int rank);   // rank_NNNNN.safetensors
std::string report_file_name(int rank);  // rank_NNNNN.json

// Writes the snapshot's entries as this rank's shard in `temp_dir` (fsynced), then its
// report (written last: its presence means the shard is complete). Returns the shard's
// size; `seconds` gets the time taken.
int64_t write_shard(const std::filesystem::path& temp_dir, const CheckpointSnapshot& snapshot, double* seconds);

// Rank 0: waits until every rank of the snapshot's world has reported (throws after
// timeout_s naming the missing shard files), then fills the manifest's shards and tensors
// from the reports and checks their coverage. The reports are removed.
void collect_reports(const std::filesystem::path& temp_dir, const CheckpointSnapshot& snapshot, double timeout_s,
                     CheckpointManifest& manifest);

// A shard file opened for reading: its header checked against the manifest's entry
// (size, header hash, format, rank, step, save id).
class CheckpointShardReader {
 public:
  CheckpointShardReader(const std::filesystem::path& dir, const CheckpointManifest& manifest, int shard);
  ~CheckpointShardReader();
  CheckpointShardReader(const CheckpointShardReader&) = delete;
  CheckpointShardReader& operator=(const CheckpointShardReader&) = delete;
  const SafeTensorsHeader& header() const { return header_; }
  const std::string& source() const { return source_; }
  // The piece's bytes into out[0..count), after checking its dtype, size and hash.
  void read_piece(const std::string& tensor, const ManifestPiece& piece, float* out) const;
  // Version 1: the whole file's hash, streamed.
  void verify_whole_file() const;

 private:
  const CheckpointManifest& manifest_;
  std::string source_;
  int fd_ = -1;
  SafeTensorsHeader header_;
  std::map<std::string, size_t> index_;
};

}  // namespace moe

// Checkpoints: everything needed to continue a run bit for bit, saved by every rank in
// parallel and resumed on any number of ranks (resharding).
//
// Layout of checkpoint.dir:
//   step_00000120/                 one directory per saved step
//     manifest.json                written by rank 0 last: format, version 2, step, world size,
//                                  layout (EP size, ZeRO level, save id), progress (AdamW steps,
//                                  lr scale, data position, expert placement), the run's id, the
//                                  hash algorithm (xxh3_64), per shard file its rank, size and
//                                  hashes, and per global tensor its dtype, shape and pieces
//                                  (train/checkpoint_manifest.h)
//     config.toml                  the run config (config_to_toml), hash in the manifest
//     rank_00000.safetensors       one shard per rank, written by that rank: its pieces, each
//     rank_00001.safetensors ...   a flat element range of a global tensor ("NAME@BEGIN")
//     COMPLETE                     written last; holds "xxh3_64:" and the manifest's hash
//                                  (a bare hash: FNV-1a, checkpoints written before XXH3)
//   .tmp.step_00000130.<save id>/  a checkpoint being written (never picked by resume)
//
// Saving: each rank describes its state as pieces of the global tensors (ModelBackend::
// save_state: no gather); each copy of a replicated slice writes an even share of it. Every
// rank writes its shard and a report (rank_NNNNN.json: its file, size, hashes and pieces)
// into the save's temporary directory; rank 0 waits for every report, checks that the
// pieces cover every tensor exactly once, writes the manifest, renames the directory into
// place and marks it COMPLETE. A crash at any point leaves at worst an ignored directory.
// Every byte read is covered by a hash (pieces and shard headers in the manifest, the
// manifest in COMPLETE), so truncation, bit flips and shards of other saves are refused.
// Resuming: each rank reads only the slices it needs (ModelBackend::restore_targets), from
// whichever shards hold them, piece by piece (pread; no whole-checkpoint buffer). Version 1
// checkpoints (one shard, every tensor whole) still load. docs/CHECKPOINTS.md.
#pragma once
#include <atomic>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "model/transformer.h"
#include "optim/adamw.h"
#include "data/batch_source.h"
#include "config/run_config.h"
#include "train/checkpoint_manifest.h"
#include "train/safetensors.h"
#include "train/state_pieces.h"

namespace moe {

// Trainer state beyond the tensors, saved with them.
struct TrainProgress {
  int64_t step = 0;           // optimizer steps completed = index of the next step
  double lr_scale = 1.0;      // multiplies the schedule; lowered by NaN recovery
  int64_t skipped_steps = 0;  // non-finite steps skipped so far
  int64_t nan_reloads = 0;    // reloads after nan_max_skips skips in a row

  bool operator==(const TrainProgress&) const = default;
};

// A host copy of what this rank writes (its shares of its pieces) and, on rank 0, what
// the manifest records; taking it is all that stalls training in async mode.
struct CheckpointSnapshot {
  // Elements [begin, begin + count) of the global tensor `name` of `shape`, at `data`
  // (memory one of `owners` keeps alive).
  struct Entry {
    std::string name;
    std::vector<int64_t> shape;
    const float* data = nullptr;
    int64_t count = 0;
    int64_t begin = 0;
  };
  std::string config_toml;
  std::string tokenizer_json;  // rank 0 writes it as tokenizer.json when not empty
  TrainProgress progress;
  int64_t adam_steps = 0;
  std::vector<int64_t> source_state;
  std::vector<Entry> tensors;
  // What the entries' data lie in: the backend's buffers (SavedState::owner, not copied)
  // or capture_state's copies.
  std::vector<std::shared_ptr<const void>> owners;
  // The experts' placement over the EP ranks and the re-placement's state
  // (ModelBackend::placement_state); empty: none.
  std::string expert_placement;
  std::string expert_merge;  // moe.merge_interval's state (the protected experts) as JSON; empty: none
  std::string run_id;  // the run this checkpoint belongs to (src/train/run_dirs.h); empty: none
  // The writing layout: this rank of world_size, expert-parallel size, ZeRO level, and the
  // id all ranks of this save share (names the temporary directory, stamps the shards).
  int rank = 0, world_size = 1;
  int64_t expert_parallel = 1, zero = 0;
  std::string save_id;
};

// This rank's shares of `state`'s pieces, with the progress: copied (on every core) unless
// the state has an owner, whose buffers the snapshot then keeps instead (an async save
// blocks training only for the backend's download). The write refuses non-finite
// parameters (write_shard checks them while hashing).
CheckpointSnapshot capture_state(const RunConfig& config, const SavedState& state, const BatchSource& train_data,
                                 const TrainProgress& progress);
// One process's whole host state (world size 1).
CheckpointSnapshot capture_checkpoint(const RunConfig& config, Transformer<float>& model, AdamW& optimizer,
                                      const BatchSource& train_data, const TrainProgress& progress);

// What one save wrote.
struct CheckpointWrite {
  int64_t step = 0;
  std::filesystem::path path;  // dir/step_NNNNNNNN
  int64_t bytes = 0;           // of the files written (rank 0: all ranks' shards and the manifest)
  double seconds = 0;          // writing, fsyncing and renaming them (rank 0: until COMPLETE, and pruning)
  int64_t shard_bytes = 0;     // this rank's shard
  double shard_seconds = 0;    // writing and fsyncing it
};

// Writes `snapshot`'s shard into the save's temporary directory with its report; rank 0
// then waits up to report_timeout_s for every rank's report, writes the manifest, renames
// the directory to <dir>/step_NNNNNNNN, marks it COMPLETE and keeps only the newest
// `keep_last` complete checkpoints (removing stale temporary directories). A missing report
// throws naming the rank's file and leaves no COMPLETE.
CheckpointWrite write_checkpoint(const std::filesystem::path& dir, const CheckpointSnapshot& snapshot,
                                 int64_t keep_last, double report_timeout_s = 3600);

// dir/step_NNNNNNNN: where the checkpoint of `step` goes.
std::filesystem::path checkpoint_path(const std::filesystem::path& dir, int64_t step);

// The newest complete checkpoint in `dir`, if any (a missing dir has none).
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& dir);

// The complete checkpoints in `dir`, oldest first, with the run each belongs to (read from
// its manifest without verifying the shard; "" for a checkpoint written before run ids).
struct CheckpointListing {
  int64_t step = 0;
  std::filesystem::path path;
  std::string run_id;
};
std::vector<CheckpointListing> list_checkpoints(const std::filesystem::path& dir);

// A checkpoint's manifest, config and shard headers read from disk and verified (marker,
// hashes, format, coverage, every shard file present, of its size and of this save); the
// tensors are read on demand (read_slices).
struct LoadedCheckpoint {
  std::filesystem::path path;
  int64_t step = 0;
  std::string config_toml;
  RunConfig config;
  std::string tokenizer_json;  // the run's tokenizer.json; empty: none saved
  CheckpointManifest manifest;   // layout, shards, tensors, progress
  std::string expert_placement;  // empty when none was recorded
  std::string expert_merge;      // moe.merge_interval's state; empty when none was recorded
  std::string run_id;            // empty in checkpoints written before run ids
  const ManifestTensor* find(const std::string& tensor) const;  // null when absent
};
// Throws moe::Error with one line naming the file and what is wrong.
LoadedCheckpoint read_checkpoint(const std::filesystem::path& path);

// What read_slices read.
struct SliceReadStats {
  int64_t bytes = 0;
  double seconds = 0;
};
// Fills every target from the shards holding its elements: each overlapping piece read once
// (pread), its hash checked, the overlap copied. A tensor the checkpoint lacks or of another
// shape is refused with one line; so is a piece that does not match its hash, naming the file.
SliceReadStats read_slices(const LoadedCheckpoint& checkpoint, const std::vector<StateTarget>& targets);
// Elements [begin, begin + count) of one tensor (count < 0: to its end).
std::vector<float> read_tensor(const LoadedCheckpoint& checkpoint, const std::string& tensor, int64_t begin = 0,
                               int64_t count = -1);

// Throws ConfigError if `current` cannot continue `saved` (a key that shapes the tensors
// differs: dims, layers, heads, experts, tying); writes a warning line to `out` for every
// other key that differs (session keys such as training.stop_at and [checkpoint] excepted).
void check_resume_compatible(const LoadedCheckpoint& saved, const RunConfig& current, std::ostream& out);

// The progress a checkpoint continues (step, lr scale, skips, reloads).
TrainProgress checkpoint_progress(const LoadedCheckpoint& checkpoint);
// One process: loads parameters, moments, balancing biases and the data position into the
// host state; returns the progress.
TrainProgress restore_checkpoint(const LoadedCheckpoint& checkpoint, Transformer<float>& model, AdamW& optimizer,
                                 BatchSource& train_data);

// Saves synchronously or, with checkpoint.async, on a background thread (one at a time).
class Checkpointer {
 public:
  explicit Checkpointer(CheckpointConfig config) : config_(std::move(config)) {}
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  bool enabled() const { return !config_.dir.empty(); }
  bool async() const { return config_.async; }
  // Waits for a previous async save, then saves and returns what it wrote; with
  // checkpoint.async returns nothing after queueing (take_finished or wait reports it).
  std::optional<CheckpointWrite> save(CheckpointSnapshot snapshot);
  // An async save that has finished (without waiting; rethrows its error).
  std::optional<CheckpointWrite> take_finished();
  // Waits for an async save in flight and returns what it wrote; rethrows its error.
  std::optional<CheckpointWrite> wait();

 private:
  CheckpointConfig config_;
  std::thread worker_;
  std::atomic<bool> finished_{false};  // the worker is done with its save
  std::optional<CheckpointWrite> written_;
  std::exception_ptr error_;
};

}  // namespace moe

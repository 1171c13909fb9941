// Checkpoints: everything needed to continue a run bit for bit.
//
// Layout of checkpoint.dir:
//   step_00000120/                 one directory per saved step
//     manifest.json                format, version, step, world size, the run's id,
//                                  hash_algorithm (xxh3_64), and per shard: file, size, hash
//     config.toml                  the run config (config_to_toml), hash in the manifest
//     rank_00000.safetensors       one shard per data-parallel rank: that rank's parameters,
//                                  AdamW moments, balancing biases, loader state
//     COMPLETE                     written last; holds "xxh3_64:" and the manifest's hash
//                                  (a bare hash: FNV-1a, checkpoints written before XXH3)
//   .tmp.step_00000130.<pid>/      a checkpoint being written (never picked by resume)
//
// A checkpoint is written into the temporary directory (each file fsynced), renamed into
// place, then marked COMPLETE; resume only considers directories with a valid marker, so a
// crash at any point leaves at worst an ignored directory. Every byte is covered by a hash
// (shards and config in the manifest, the manifest in COMPLETE), so truncation and bit flips
// are refused. One shard holds every tensor (world_size 1): a multi-rank run gathers its
// state and rank 0 writes it (Trainer::save_checkpoint), so any number of ranks can read it;
// the manifest names each shard's rank should sharded writing come later.
#pragma once
#include <atomic>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <iosfwd>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "model/transformer.h"
#include "optim/adamw.h"
#include "data/batch_source.h"
#include "config/run_config.h"
#include "train/safetensors.h"

namespace moe {

// Trainer state beyond the tensors, saved with them.
struct TrainProgress {
  int64_t step = 0;           // optimizer steps completed = index of the next step
  double lr_scale = 1.0;      // multiplies the schedule; lowered by NaN recovery
  int64_t skipped_steps = 0;  // non-finite steps skipped so far
  int64_t nan_reloads = 0;    // reloads after nan_max_skips skips in a row

  bool operator==(const TrainProgress&) const = default;
};

// A host copy of everything a checkpoint holds; taking it is all that stalls training
// in async mode.
struct CheckpointSnapshot {
  struct Entry {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> data;
  };
  std::string config_toml;
  TrainProgress progress;
  int64_t adam_steps = 0;
  std::vector<int64_t> source_state;
  std::vector<Entry> tensors;
  // The experts' placement over the EP ranks and the re-placement's state
  // (ModelBackend::placement_state; shard metadata "expert_placement"); empty: none.
  std::string expert_placement;
  std::string run_id;  // the run this checkpoint belongs to (src/train/run_dirs.h); empty: none
};

CheckpointSnapshot capture_checkpoint(const RunConfig& config, Transformer<float>& model, AdamW& optimizer,
                                      const BatchSource& train_data, const TrainProgress& progress);

// What one save wrote.
struct CheckpointWrite {
  int64_t step = 0;
  std::filesystem::path path;  // dir/step_NNNNNNNN
  int64_t bytes = 0;           // of the files written
  double seconds = 0;          // writing, fsyncing and renaming them (and pruning)
};

// Writes `snapshot` as <dir>/step_NNNNNNNN (see the layout above), then keeps only the
// newest `keep_last` complete checkpoints and removes stale temporary directories.
CheckpointWrite write_checkpoint(const std::filesystem::path& dir, const CheckpointSnapshot& snapshot,
                                 int64_t keep_last);

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

// A checkpoint read from disk and verified (marker, hashes, format, header).
struct LoadedCheckpoint {
  std::filesystem::path path;
  int64_t step = 0;
  std::string config_toml;
  RunConfig config;
  SafeTensorsFile shard;
  std::string expert_placement;  // empty when none was recorded
  std::string run_id;            // empty in checkpoints written before run ids
};
// Throws moe::Error with one line naming the file and what is wrong.
LoadedCheckpoint read_checkpoint(const std::filesystem::path& path);

// Throws ConfigError if `current` cannot continue `saved` (a key that shapes the tensors
// differs: dims, layers, heads, experts, tying); writes a warning line to `out` for every
// other key that differs (session keys such as training.stop_at and [checkpoint] excepted).
void check_resume_compatible(const LoadedCheckpoint& saved, const RunConfig& current, std::ostream& out);

// Loads parameters, moments, balancing biases and the data position; returns the progress.
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

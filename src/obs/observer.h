// Where a run's measurements go: the console, metrics.dir/metrics.jsonl, a TensorBoard
// event file in metrics.dir, the phase trace (metrics.trace), threshold alerts, and the
// live dashboard's feed. The
// trainer calls start, validation and step, then finish; nothing else prints metrics.
#pragma once
#include <iosfwd>
#include <memory>
#include <string>

#include "obs/alerts.h"
#include "obs/console.h"
#include "obs/feed.h"
#include "obs/jsonl.h"
#include "obs/metrics.h"
#include "obs/tensorboard.h"
#include "obs/trace.h"
#include "config/metrics_config.h"

namespace moe {

struct ObserverOptions {
  bool progress_bar = false;     // stdout is a terminal
  MetricsFeed* feed = nullptr;   // the dashboard's, when one is served
};

// The end of a run, as the summary line reports it. seconds: the training loop's wall
// time, of which validation_seconds validating and checkpoint_seconds held up by saves.
struct RunEnd {
  int64_t steps = 0, tokens = 0, skipped_steps = 0;
  double seconds = 0, val_loss_start = 0, val_loss_end = 0, train_loss_end = 0;
  double validation_seconds = 0, checkpoint_seconds = 0;
};

// A checkpoint save. Reported when training goes on after it (written unless
// `background`), and a background write once more when it is done (`written`).
struct CheckpointSave {
  int64_t step = 0;
  std::string path;
  double paused_seconds = 0;  // training held up: state gathered and copied, and written unless in the background
  bool background = false;    // checkpoint.async: the files are written while training goes on
  bool written = false;       // bytes and write_seconds are known
  int64_t bytes = 0;
  double write_seconds = 0;
  int64_t shard_bytes = 0;     // this rank's shard (each rank writes its own in parallel)
  double shard_seconds = 0;    // writing and fsyncing it
  double waited_seconds = 0;   // of paused_seconds: waiting for the previous background save to finish
};

// The console line of a checkpoint save (Observer::checkpoint prints it).
std::string describe(const CheckpointSave& save);

class Observer {
 public:
  Observer(const MetricsConfig& config, std::ostream& out, ObserverOptions options);
  // Opens the files in metrics.dir, continuing them after step info.first_step (0 for a
  // new run: they start over; see truncate_metrics_after and TensorBoardWriter), prints
  // the MFU formula's inputs and writes the "run" record.
  void start(const RunInfo& info);
  // A validation after `step` that took `seconds`.
  void validation(int64_t step, double loss, double seconds);
  // A checkpoint line, and its "checkpoint" record once written; the pause enters the ETA.
  void checkpoint(const CheckpointSave& save);
  void step(const StepMetrics& m);
  // Any other console line (keeps the progress bar below it).
  void note(const std::string& text) { console_.line(text); }
  // Writes the "summary" record and fsyncs the files; the progress bar is removed.
  void finish(const RunEnd& end);

 private:
  void record(const nlohmann::json& r);

  ConsoleSink console_;
  AlertMonitor alerts_;
  ObserverOptions options_;
  std::string dir_;  // metrics.dir; "" writes no files
  bool tensorboard_on_;
  bool trace_on_;
  std::unique_ptr<JsonlWriter> jsonl_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::unique_ptr<TraceWriter> trace_;  // closes its file when the run ends, also by an exception
};

// The TensorBoard scalars of one step: tag -> value.
std::vector<std::pair<std::string, float>> tensorboard_scalars(const StepMetrics& m);

}  // namespace moe

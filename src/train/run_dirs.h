// A run's output folders belong to that run alone. A run has an id, made when it starts,
// kept in metrics.dir/run.json and in every checkpoint's manifest, and taken over by a
// run that resumes one of its checkpoints. Before step 1, rank 0 checks the folders
// (Trainer::run):
//   - both must be directories this process can write into (created if need be);
//   - a new run refuses a metrics.dir holding a run's files (metrics.jsonl, run.json,
//     config.toml, events.out.tfevents.*) and a checkpoint.dir holding checkpoints, unless
//     they are its own; the one-line error says how to go on (--resume auto, or another
//     folder);
//   - a resumed run refuses the files and checkpoints of another run's id (those written
//     before run ids carry none and count as its own).
// Then metrics.dir gets run.json and the resolved config (config.toml). The metrics files
// themselves go on after the resumed step (Observer::start).
#pragma once
#include <string>

#include "config/run_config.h"

namespace moe {

// 16 random hex digits.
std::string new_run_id();

// The id in metrics_dir/run.json; "" when there is none (or no metrics_dir).
std::string metrics_run_id(const std::string& metrics_dir);

// Throws ConfigError (one line naming the folder, what it holds and how to go on) when
// metrics.dir or checkpoint.dir cannot take run `run_id`. `resumed`: the run continues
// (from a checkpoint of that id, or from step 0 after --resume found no checkpoint).
void check_run_dirs(const RunConfig& config, const std::string& run_id, bool resumed);

// metrics.dir/run.json (left alone when it already names this run) and
// metrics.dir/config.toml (the resolved config of this session). No-op without metrics.dir.
void write_run_files(const RunConfig& config, const std::string& run_id);

}  // namespace moe

#include "train/run_dirs.h"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "core/error.h"
#include "train/checkpoint.h"
#include "core/atomic_file.h"

namespace moe {
namespace fs = std::filesystem;

namespace {

constexpr const char* kRunFile = "run.json";
constexpr const char* kRunFormat = "moe-train-run";

// The files a run writes into metrics.dir that are present there.
std::vector<std::string> run_files_in(const fs::path& dir) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name == "metrics.jsonl" || name == kRunFile || name == "config.toml" ||
        name.find("tfevents") != std::string::npos)
      found.push_back(name);
  }
  std::sort(found.begin(), found.end());
  return found;
}

std::string joined(const std::vector<std::string>& names) {
  std::string text;
  for (const std::string& name : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

void check_metrics_dir(const std::string& dir, const std::string& run_id, bool resumed) {
  if (dir.empty()) return;
  const std::vector<std::string> files = run_files_in(dir);
  if (files.empty()) return;
  const std::string owner = metrics_run_id(dir);
  if (owner == run_id) return;
  if (resumed) {
    if (owner.empty()) return;  // written before run ids: taken as this run's
    MOE_CONFIG_ERROR("metrics.dir \"{}\" holds the metrics of run {}, but the checkpoint being resumed belongs to "
                     "run {}: choose another metrics.dir (or that run's)",
                     dir, owner, run_id);
  }
  MOE_CONFIG_ERROR("metrics.dir \"{}\" holds another run's files ({}{}): continue that run with --resume auto, or "
                   "choose another metrics.dir",
                   dir, owner.empty() ? "" : "run " + owner + ": ", joined(files));
}

void check_checkpoint_dir(const std::string& dir, const std::string& run_id, bool resumed) {
  if (dir.empty()) return;
  std::vector<std::string> others;
  std::string other_id;
  for (const CheckpointListing& c : list_checkpoints(dir)) {
    if (c.run_id == run_id || (resumed && c.run_id.empty())) continue;
    others.push_back(c.path.filename().string());
    if (!c.run_id.empty()) other_id = c.run_id;
  }
  if (others.empty()) return;
  const std::string which = others.size() == 1 ? others[0] : others.front() + " ... " + others.back();
  if (resumed)
    MOE_CONFIG_ERROR("checkpoint.dir \"{}\" holds checkpoints of another run ({}{}) than the one being resumed (run "
                     "{}): choose another checkpoint.dir",
                     dir, other_id.empty() ? "" : "run " + other_id + ": ", which, run_id);
  MOE_CONFIG_ERROR("checkpoint.dir \"{}\" holds checkpoints of another run ({}{}): continue that run with --resume "
                   "auto, or choose another checkpoint.dir",
                   dir, other_id.empty() ? "" : "run " + other_id + ": ", which);
}

// A folder this process can write into, created if need be: found before step 1, not at
// the first save (with the default checkpoint.interval, after the whole run).
void check_usable_dir(const std::string& dir, const char* key) {
  if (dir.empty()) return;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    MOE_CONFIG_ERROR("{} \"{}\" is a file, not a directory", key, dir);
  fs::create_directories(dir, ec);
  if (ec) MOE_CONFIG_ERROR("{} \"{}\": cannot create it: {}", key, dir, ec.message());
  const fs::path probe = fs::path(dir) / fmt::format(".moe-write-test.{}", ::getpid());
  FILE* file = std::fopen(probe.c_str(), "w");
  if (!file) MOE_CONFIG_ERROR("{} \"{}\": cannot write there: {}", key, dir, std::strerror(errno));
  std::fclose(file);
  fs::remove(probe, ec);
}

}  // namespace

std::string new_run_id() {
  std::random_device device;
  const auto now = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  std::mt19937_64 mix((static_cast<uint64_t>(device()) << 32) ^ device() ^ now);
  return fmt::format("{:016x}", mix());
}

std::string metrics_run_id(const std::string& metrics_dir) {
  if (metrics_dir.empty()) return "";
  std::error_code ec;
  const fs::path path = fs::path(metrics_dir) / kRunFile;
  if (!fs::is_regular_file(path, ec)) return "";
  const nlohmann::json run = nlohmann::json::parse(read_file_bytes(path), nullptr, false);
  if (!run.is_object() || !run.contains("run_id") || !run["run_id"].is_string())
    MOE_CONFIG_ERROR("{}: not a moe-train run file (no \"run_id\"); move it away or choose another metrics.dir",
                     path.string());
  return run["run_id"];
}

void check_run_dirs(const RunConfig& config, const std::string& run_id, bool resumed) {
  check_usable_dir(config.metrics.dir, "metrics.dir");
  check_usable_dir(config.checkpoint.dir, "checkpoint.dir");
  check_metrics_dir(config.metrics.dir, run_id, resumed);
  check_checkpoint_dir(config.checkpoint.dir, run_id, resumed);
}

void write_run_files(const RunConfig& config, const std::string& run_id) {
  const std::string& dir = config.metrics.dir;
  if (dir.empty()) return;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) MOE_CONFIG_ERROR("metrics.dir \"{}\": cannot create: {}", dir, ec.message());
  if (metrics_run_id(dir) != run_id) {
    const nlohmann::json run = {
        {"format", kRunFormat},
        {"run_id", run_id},
        {"created", std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count()}};
    write_file_atomic(fs::path(dir) / kRunFile, run.dump(2) + "\n");
  }
  write_file_atomic(fs::path(dir) / "config.toml", config_to_toml(config));
}

}  // namespace moe

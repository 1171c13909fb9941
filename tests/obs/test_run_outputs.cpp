// A short training run's metrics on disk: the JSONL records and the TensorBoard event
// file, read back with the PyPI tensorboard package's event reader.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/threads.h"
#include "obs/jsonl.h"
#include "obs/observer.h"
#include "obs/tensorboard.h"
#include "obs_helpers.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

TEST(TensorBoard, Crc32cAndFraming) {
  // The CRC-32C check values of "123456789" (RFC 3720, B.4) and "abc".
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("abc", 3), 0x364B3FB7u);
  // TFRecord's mask, ((crc >> 15) | (crc << 17)) + 0xa282ead8, worked by hand:
  // 0xE3069283 rotated right by 15 is 0x2507C60D; plus 0xA282EAD8 is 0xC78AB0E5.
  EXPECT_EQ(masked_crc32c("123456789", 9), 0xC78AB0E5u);
  // The whole record of "abc": length 3 (u64 LE), masked CRC of those 8 bytes, the data,
  // masked CRC of the data. Bytes from the PyPI tensorboard package's own masked_crc32c.
  const std::string record = frame_record("abc");
  EXPECT_EQ(record, std::string("\x03\x00\x00\x00\x00\x00\x00\x00\xb0\x99\x49\x0e"
                                "abc\x6e\x57\xf1\x21", 19));
  // Event{wall_time=1.0 (field 1, fixed64), file_version=3 "brain.Event:2"}.
  const std::string event = encode_file_version_event(1.0);
  EXPECT_EQ(event.substr(0, 9), std::string("\x09\x00\x00\x00\x00\x00\x00\xf0\x3f", 9));
  EXPECT_EQ(event.substr(9), std::string("\x1a\x0d") + "brain.Event:2");
}

std::vector<nlohmann::json> records_of(const std::vector<nlohmann::json>& all, const std::string& type) {
  std::vector<nlohmann::json> out;
  for (const auto& r : all)
    if (r["type"] == type) out.push_back(r);
  return out;
}

TEST(RunOutputs, JsonlAndTensorBoardHoldEveryStep) {
  set_num_threads(1);
  const fs::path dir = test::scratch_dir("run");
  RunConfig config = test::tiny_config(6);
  config.training.val_interval = 3;
  config.metrics.dir = (dir / "run").string();
  config.model.moe.capacity_factor = 1.0;  // some assignments are dropped
  config.model.moe.bias_balancing = true;
  auto trainer = test::tiny_trainer(config);
  std::vector<StepStats> seen;
  trainer->on_step = [&](const StepStats& s) { seen.push_back(s); };
  std::ostringstream out;
  trainer->run(out);
  EXPECT_NE(out.str().find("mfu: flops/token = 6 x "), std::string::npos) << out.str();

  const auto all = read_jsonl((dir / "run" / "metrics.jsonl").string());
  ASSERT_EQ(all.front()["type"], "run");
  EXPECT_EQ(all.front()["moe_layers"], nlohmann::json({0, 1}));
  EXPECT_EQ(all.front()["n_experts"], 4);
  const auto steps = records_of(all, "step");
  ASSERT_EQ(steps.size(), 6u);
  EXPECT_EQ(records_of(all, "val").size(), 3u);  // start, step 3, step 6
  ASSERT_EQ(records_of(all, "summary").size(), 1u);
  EXPECT_EQ(all.back()["type"], "summary");

  // A CPU run: no peak figure, so no MFU (not one against a GPU's peak).
  EXPECT_EQ(all.front()["mfu_inputs"]["peak_flops"], 0.0);
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto& s = steps[i];
    SCOPED_TRACE("step " + std::to_string(i + 1));
    EXPECT_EQ(s["step"], static_cast<int64_t>(i + 1));
    EXPECT_DOUBLE_EQ(s["loss"].get<double>(), seen[i].loss);
    EXPECT_DOUBLE_EQ(s["grad_norm"].get<double>(), seen[i].grad_norm);
    EXPECT_DOUBLE_EQ(s["max_expert_grad_norm"].get<double>(), seen[i].max_expert_grad_norm);
    EXPECT_DOUBLE_EQ(s["lr"].get<double>(), seen[i].lr);
    EXPECT_EQ(s["mfu"].get<double>(), 0.0);
    EXPECT_GT(s["tokens_per_s"].get<double>(), 0.0);
    const auto& t = s["time_s"];
    EXPECT_GT(t["step"].get<double>(), 0);
    EXPECT_LE(t["compute"].get<double>() + t["data_wait"].get<double>() + t["optimizer"].get<double>(),
              t["step"].get<double>() * (1 + 1e-9));
    EXPECT_EQ(t["comm_wait"], 0.0);  // one process: no communication
    EXPECT_EQ(s["grad_sync_ms"], 0.0);
    EXPECT_GT(s["memory"]["rss_bytes"].get<int64_t>(), 0);
    EXPECT_GT(s["memory"]["arena_bytes"].get<int64_t>(), 0);
    ASSERT_EQ(s["layers"].size(), 2u);
    std::vector<int64_t> rank_load(4, 0);
    int64_t dropped = 0;
    for (const auto& layer : s["layers"]) {
      // Every routed assignment is processed or dropped: 256 tokens x top-2.
      int64_t kept = 0;
      for (int64_t e = 0; e < 4; ++e) {
        kept += layer["tokens_per_expert"][e].get<int64_t>();
        rank_load[e] += layer["tokens_per_expert"][e].get<int64_t>();
      }
      EXPECT_EQ(kept + layer["dropped"].get<int64_t>(), 256 * 2);
      // Capacity 1.0: at most ceil(128 * 2 / 4) per micro-batch, 2 micro-batches.
      for (int64_t e = 0; e < 4; ++e) EXPECT_LE(layer["tokens_per_expert"][e].get<int64_t>(), 128);
      dropped += layer["dropped"].get<int64_t>();
      EXPECT_GT(layer["router_entropy"].get<double>(), 0);
      EXPECT_LE(layer["router_entropy"].get<double>(), std::log(4.0) + 1e-9);
      EXPECT_EQ(layer["bias"].size(), 4u);
    }
    EXPECT_EQ(dropped, seen[i].dropped);
    EXPECT_EQ(s["ranks"][0]["experts"], nlohmann::json({0, 1, 2, 3}));
    EXPECT_EQ(s["ranks"][0]["load"], nlohmann::json(rank_load));
  }

  // TensorBoard: read back with tensorboard's own reader (which checks every CRC).
  std::vector<fs::path> event_files;
  for (const auto& entry : fs::directory_iterator(dir / "run"))
    if (entry.path().filename().string().find("tfevents") != std::string::npos) event_files.push_back(entry.path());
  ASSERT_EQ(event_files.size(), 1u);
  const std::string script = (fs::path(__FILE__).parent_path() / "read_events.py").string();
  const auto r = test::run_command(test::python() + " " + script + " " + event_files[0].string());
  ASSERT_EQ(r.exit_code, 0) << "the tensorboard oracle failed (scripts/setup.sh installs it):\n" << r.output;
  const auto tb = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  EXPECT_EQ(tb["file_version"], "brain.Event:2");
  EXPECT_EQ(tb["events"], 1 + 6 + 3);  // file_version, steps, validations
  std::map<std::pair<std::string, int64_t>, double> scalars;
  for (const auto& s : tb["scalars"]) scalars[{s[0].get<std::string>(), s[1].get<int64_t>()}] = s[2].get<double>();
  for (const auto& s : steps) {
    const int64_t step = s["step"];
    auto expect = [&](const std::string& tag, double value) {
      auto it = scalars.find({tag, step});
      ASSERT_NE(it, scalars.end()) << tag << " at step " << step;
      EXPECT_EQ(it->second, static_cast<double>(static_cast<float>(value))) << tag << " at step " << step;
    };
    expect("train/loss", s["loss"]);
    expect("train/lr", s["lr"]);
    expect("train/grad_norm", s["grad_norm"]);
    expect("perf/tokens_per_s", s["tokens_per_s"]);
    expect("perf/mfu", s["mfu"]);
    expect("comm/wait_fraction", s["comm_wait_fraction"]);
    expect("moe/layer1/imbalance", s["layers"][1]["imbalance"]);
    expect("moe/layer0/router_entropy", s["layers"][0]["router_entropy"]);
  }
  const auto vals = records_of(all, "val");
  EXPECT_EQ(scalars.at({"val/loss", 3}), static_cast<double>(static_cast<float>(vals[1]["val_loss"].get<double>())));
  fs::remove_all(dir);
}

TEST(RunOutputs, ReadJsonlNamesTheBadLine) {
  const fs::path dir = test::scratch_dir("jsonl");
  const auto path = (dir / "m.jsonl").string();
  std::ofstream(path) << "{\"type\":\"run\"}\n{\"type\":\"step\",\"step\":1}\n{\"type\":\"step\",\"st";
  int truncated = 0;
  EXPECT_EQ(read_jsonl(path, &truncated).size(), 2u);  // a half-written last line is skipped
  EXPECT_EQ(truncated, 1);
  std::ofstream(path) << "{\"type\":\"run\"}\nnot json\n";
  try {
    read_jsonl(path);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path + ":2: not a metrics record"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

namespace fs = std::filesystem;

// A resumed run (first_step > 0) appends to metrics.jsonl instead of starting it over.
TEST(RunOutputs, ResumedRunAppendsToTheJsonl) {
  const auto dir = test::scratch_dir("resume");
  MetricsConfig config;
  config.dir = dir.string();
  config.tensorboard = false;
  auto run = [&](int64_t first_step, int64_t last_step) {
    std::ostringstream out;
    Observer observer(config, out, {});
    RunInfo info;
    info.steps = 4;
    info.first_step = first_step;
    observer.start(info);
    for (int64_t s = first_step + 1; s <= last_step; ++s) {
      StepMetrics m;
      m.step = s;
      m.steps = 4;
      observer.step(m);
    }
    observer.finish({});
  };
  run(0, 3);
  run(0, 2);  // a fresh run starts the file over
  auto records = read_jsonl((dir / "metrics.jsonl").string());
  EXPECT_EQ(records.size(), 1u + 2u + 1u);
  run(2, 4);  // resumed after step 2
  records = read_jsonl((dir / "metrics.jsonl").string());
  ASSERT_EQ(records.size(), (1u + 2u + 1u) + (1u + 2u + 1u));
  EXPECT_EQ(records[4]["type"], "run");
  EXPECT_EQ(records[4]["first_step"], 2);
  EXPECT_EQ(records[5]["step"], 3);
  std::filesystem::remove_all(dir);
}

// A run that goes on after step k (from its checkpoint) first drops what it will write
// again: every step and validation is recorded once, in the JSONL file and in the one
// TensorBoard event file left, with the resumed timeline's values.
TEST(RunOutputs, AResumedRunRecordsEveryStepOnce) {
  const auto dir = test::scratch_dir("resumed");
  MetricsConfig config;
  config.dir = dir.string();
  // Steps first..last with losses offset + step, validations at first and every 3 steps
  // (val_loss 10 + offset + step), checkpoints every 2 steps.
  auto session = [&](int64_t first, int64_t last, double offset) {
    std::ostringstream out;
    Observer observer(config, out, {});
    RunInfo info;
    info.steps = 6;
    info.first_step = first;
    observer.start(info);
    observer.validation(first, 10 + offset + first, 0.5);
    for (int64_t s = first + 1; s <= last; ++s) {
      StepMetrics m;
      m.step = s;
      m.steps = 6;
      m.loss = offset + s;
      observer.step(m);
      if (s % 3 == 0) observer.validation(s, 10 + offset + s, 0.5);
      if (s % 2 == 0) observer.checkpoint({s, "ckpt", 0.25, false, true, 1000, 0.5});
    }
    RunEnd end;
    end.steps = last;
    observer.finish(end);
  };
  session(0, 6, 0);    // the first timeline
  session(3, 6, 100);  // resumed from its checkpoint of step 3; other values tell the timelines apart
  const auto all = read_jsonl((dir / "metrics.jsonl").string());
  std::map<std::string, std::vector<std::pair<int64_t, double>>> seen;  // type -> (step, value)
  for (const auto& r : all) {
    const std::string type = r["type"];
    if (type == "step") seen[type].push_back({r["step"], r["loss"]});
    if (type == "val") seen[type].push_back({r["step"], r["val_loss"]});
    if (type == "checkpoint") seen[type].push_back({r["step"], 0});
    if (type == "run") seen[type].push_back({r["first_step"], 0});
    if (type == "summary") seen[type].push_back({r["steps"], 0});
  }
  using Points = std::vector<std::pair<int64_t, double>>;
  EXPECT_EQ(seen["step"], (Points{{1, 1}, {2, 2}, {3, 3}, {4, 104}, {5, 105}, {6, 106}}));
  EXPECT_EQ(seen["val"], (Points{{0, 10}, {3, 113}, {6, 116}}));
  EXPECT_EQ(seen["checkpoint"], (Points{{2, 0}, {4, 0}, {6, 0}}));
  EXPECT_EQ(seen["run"], (Points{{0, 0}, {3, 0}}));
  EXPECT_EQ(seen["summary"], (Points{{6, 0}}));  // the first timeline's went with its steps 4..6

  std::vector<fs::path> event_files;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().filename().string().find("tfevents") != std::string::npos) event_files.push_back(entry.path());
  ASSERT_EQ(event_files.size(), 1u);
  const std::string script = (fs::path(__FILE__).parent_path() / "read_events.py").string();
  const auto r = test::run_command(test::python() + " " + script + " " + event_files[0].string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto tb = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  std::map<std::string, Points> scalars;
  for (const auto& s : tb["scalars"])
    if (s[0] == "train/loss" || s[0] == "val/loss") scalars[s[0]].push_back({s[1], s[2]});
  for (auto& [tag, points] : scalars) std::sort(points.begin(), points.end());
  EXPECT_EQ(scalars["train/loss"], (Points{{1, 1}, {2, 2}, {3, 3}, {4, 104}, {5, 105}, {6, 106}}));
  EXPECT_EQ(scalars["val/loss"], (Points{{0, 10}, {3, 113}, {6, 116}}));
  // file_version, SessionLog START, 3 steps + 1 validation carried over, then 3 steps and
  // 2 validations.
  EXPECT_EQ(tb["events"], 2 + 4 + 5);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moe

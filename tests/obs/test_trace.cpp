// metrics.trace: the Chrome Trace Event file of a run's phases (obs/trace.h), written by a
// short CPU run and read back as JSON: every step's phases, their durations adding up to
// the step's time, and a file that still parses when the run never closed it.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/threads.h"
#include "obs/trace.h"
#include "obs_helpers.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

TEST(TraceWriter, WritesCompleteEventsOnNamedTracksAndClosesOnce) {
  const fs::path dir = test::scratch_dir("trace");
  const fs::path path = dir / "sub" / "trace.json";
  {
    TraceWriter trace(path.string(), 3);
    trace.step(1, {{"forward", "host", 0.5, 0.25}, {"attention", "gpu", 0.5, 1e-7}});
    // Flushed per step, not closed: a crash here leaves an unterminated array, which
    // Perfetto and chrome://tracing accept; closing it by hand must give valid JSON.
    const std::string cut = test::read_file(path);
    EXPECT_EQ(cut.find("]}"), std::string::npos);
    EXPECT_TRUE(nlohmann::json::accept(cut + "\n]}")) << cut;
    trace.step(2, {{"forward", "host", 1.0, -1.0}});
    trace.close();
    trace.close();
  }  // the destructor must not write after close()
  const nlohmann::json file = nlohmann::json::parse(test::read_file(path));
  std::map<int, std::string> threads;
  std::vector<nlohmann::json> spans;
  for (const auto& e : file["traceEvents"]) {
    EXPECT_EQ(e["pid"], 3);
    if (e["ph"] == "M" && e["name"] == "thread_name") threads[e["tid"].get<int>()] = e["args"]["name"];
    if (e["ph"] == "X") spans.push_back(e);
  }
  EXPECT_EQ(threads, (std::map<int, std::string>{{1, "host"}, {2, "gpu"}}));
  ASSERT_EQ(spans.size(), 3u);
  EXPECT_EQ(spans[0]["name"], "forward");
  EXPECT_DOUBLE_EQ(spans[0]["ts"].get<double>(), 500000.0);  // microseconds
  EXPECT_DOUBLE_EQ(spans[0]["dur"].get<double>(), 250000.0);
  EXPECT_EQ(spans[0]["tid"], 1);
  EXPECT_EQ(spans[0]["args"]["step"], 1);
  EXPECT_EQ(spans[1]["tid"], 2);
  EXPECT_DOUBLE_EQ(spans[1]["dur"].get<double>(), 0.1);
  EXPECT_EQ(spans[2]["args"]["step"], 2);
  EXPECT_DOUBLE_EQ(spans[2]["dur"].get<double>(), 0.0);  // never negative
  EXPECT_EQ(trace_file_name(0), "trace.json");
  EXPECT_EQ(trace_file_name(40), "trace.from_step_40.json");
}

TEST(TraceWriter, UnwritablePathIsAnErrorNamingIt) {
  const fs::path dir = test::scratch_dir("trace");
  std::ofstream(dir / "file") << "x";
  try {
    TraceWriter trace((dir / "file" / "trace.json").string(), 0);
    ADD_FAILURE() << "wrote under a file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("trace.json"), std::string::npos) << e.what();
  }
}

TEST(RunTrace, EveryStepsPhasesAddUpToItsTime) {
  set_num_threads(1);
  const fs::path dir = test::scratch_dir("trace");
  RunConfig config = test::tiny_config(5);
  config.metrics.dir = (dir / "run").string();
  config.metrics.trace = true;
  auto trainer = test::tiny_trainer(config);
  std::vector<StepStats> seen;
  trainer->on_step = [&](const StepStats& s) { seen.push_back(s); };
  std::ostringstream out;
  trainer->run(out);
  ASSERT_EQ(seen.size(), 5u);

  const nlohmann::json file = nlohmann::json::parse(test::read_file(dir / "run" / "trace.json"));
  std::map<int64_t, std::vector<nlohmann::json>> by_step;
  for (const auto& e : file["traceEvents"])
    if (e["ph"] == "X") by_step[e["args"]["step"].get<int64_t>()].push_back(e);
  ASSERT_EQ(by_step.size(), 5u);
  double previous_step_end = 0;
  for (int64_t step = 1; step <= 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto& events = by_step[step];
    // Zeroing the gradients, two micro-batches of data, forward and backward, then the
    // optimizer, each beginning where the previous one ended; the CPU has no "gpu" track.
    std::vector<std::string> names;
    double sum_us = 0;
    const double step_start = events.front()["ts"].get<double>();
    EXPECT_GE(step_start, previous_step_end) << "steps overlap";
    double end = step_start;
    for (const auto& e : events) {
      names.push_back(e["name"]);
      EXPECT_EQ(e["tid"], 1);
      EXPECT_EQ(e["pid"], 0);
      const double ts = e["ts"].get<double>(), dur = e["dur"].get<double>();
      EXPECT_GE(dur, 0);
      EXPECT_NEAR(ts, end, 2e-3) << e["name"] << " does not start where the previous phase ended";  // ns rounding
      end = ts + dur;
      sum_us += dur;
    }
    previous_step_end = end;
    EXPECT_EQ(names, (std::vector<std::string>{"zero grads", "data", "forward", "backward", "data", "forward",
                                               "backward", "optimizer"}));
    const double step_us = seen[static_cast<size_t>(step - 1)].time.step * 1e6;
    EXPECT_NEAR(sum_us, step_us, 1e-2) << "the phases tile the step";
  }
}

}  // namespace
}  // namespace moe

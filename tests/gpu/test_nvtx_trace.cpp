// Profiling on the GPU: the NVTX ranges an Nsight Systems timeline shows (core/nvtx_range.h),
// recorded by a tool linked into this test binary (NVTX's static injection, the way nsys
// attaches to a process), and metrics.trace's GPU track. The range tests need no GPU.
#include <cstdint>

// This file defines the tool's entry point (below); NVTX looks for it when it first runs.
#define NVTX_STATIC_INJECTION_IMPL
extern "C" int (*InitializeInjectionNvtx2_fnptr)(const void* (*)(uint32_t));
#include <nvtx3/nvToolsExt.h>

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/cuda/phase_clock.h"
#include "core/nvtx_range.h"
#include "gpu_test_util.h"
#include "train/synthetic.h"
#include "train/trainer.h"

namespace {

// What the tool saw while recording: "push NAME", "pop NAME", "start NAME", "end NAME".
std::mutex g_mutex;
bool g_recording = false;
std::vector<std::string> g_events;
std::vector<std::string> g_pushed;              // the push/pop stack
std::map<nvtxRangeId_t, std::string> g_started;  // open start/end ranges
nvtxRangeId_t g_next_id = 1;

void record(std::string event) {
  if (g_recording) g_events.push_back(std::move(event));
}

int NVTX_API push_a(const char* name) {
  std::lock_guard lock(g_mutex);
  g_pushed.emplace_back(name);
  record("push " + g_pushed.back());
  return static_cast<int>(g_pushed.size()) - 1;
}
int NVTX_API pop() {
  std::lock_guard lock(g_mutex);
  if (g_pushed.empty()) {
    record("pop without push");
    return -1;
  }
  record("pop " + g_pushed.back());
  g_pushed.pop_back();
  return static_cast<int>(g_pushed.size());
}
nvtxRangeId_t NVTX_API start_a(const char* name) {
  std::lock_guard lock(g_mutex);
  record(std::string("start ") + name);
  g_started[g_next_id] = name;
  return g_next_id++;
}
void NVTX_API end(nvtxRangeId_t id) {
  std::lock_guard lock(g_mutex);
  auto it = g_started.find(id);
  record(it == g_started.end() ? "end of no range" : "end " + it->second);
  if (it != g_started.end()) g_started.erase(it);
}

int NVTX_API initialize_injection(NvtxGetExportTableFunc_t get_export_table) {
  const auto* callbacks = static_cast<const NvtxExportTableCallbacks*>(get_export_table(NVTX_ETID_CALLBACKS));
  NvtxFunctionTable table = nullptr;
  unsigned int size = 0;
  if (!callbacks || !callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &table, &size)) return 0;
  *table[NVTX_CBID_CORE_RangePushA] = reinterpret_cast<NvtxFunctionPointer>(&push_a);
  *table[NVTX_CBID_CORE_RangePop] = reinterpret_cast<NvtxFunctionPointer>(&pop);
  *table[NVTX_CBID_CORE_RangeStartA] = reinterpret_cast<NvtxFunctionPointer>(&start_a);
  *table[NVTX_CBID_CORE_RangeEnd] = reinterpret_cast<NvtxFunctionPointer>(&end);
  return 1;
}

// Records the ranges of its lifetime; the events come out in order.
struct Recording {
  Recording() {
    std::lock_guard lock(g_mutex);
    g_events.clear();
    g_recording = true;
  }
  std::vector<std::string> stop() {
    std::lock_guard lock(g_mutex);
    g_recording = false;
    return g_events;
  }
};

}  // namespace

NvtxInitializeInjectionNvtxFunc_t InitializeInjectionNvtx2_fnptr = &initialize_injection;

namespace moe {
namespace {

namespace fs = std::filesystem;

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(Nvtx, ScopesNestAndPhasesFollowEachOther) {
  Recording recording;
  {
    const NvtxRange step("step 1");
    NvtxPhases phases;
    {
      const NvtxRange layer(std::string("layer 0 forward"));
      phases.begin("attention");
      phases.begin("router");
    }  // the layer's range ends while its last phase goes on
    phases.begin("optimizer");
  }
  EXPECT_EQ(recording.stop(),
            (std::vector<std::string>{"push step 1", "push layer 0 forward", "start attention", "end attention",
                                      "start router", "pop layer 0 forward", "end router", "start optimizer",
                                      "end optimizer", "pop step 1"}));
}

TEST(Nvtx, EveryPhaseClockMarkIsARangeEvenWhenTheClockIsOff) {
  Recording recording;
  {
    gpu::PhaseClock clock({"attention", "experts"});  // off: no CUDA events, so no GPU needed
    clock.mark(0, nullptr);
    clock.mark(1, nullptr);
    clock.mark(1, nullptr);
  }
  EXPECT_EQ(recording.stop(), (std::vector<std::string>{"start attention", "end attention", "start experts",
                                                         "end experts", "start experts", "end experts"}));
}

// A GPU run under the tool: the trainer's scopes hold the GPU model's layer ranges, and
// its phases are ranges too; metrics.trace has every step's phases on "host" and "gpu".
TEST(GpuProfiling, NvtxRangesAndTraceCoverEveryStep) {
  MOE_REQUIRE_GPU();
  const fs::path dir = fs::temp_directory_path() / ("moe_gpu_trace_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  RunConfig config = test::tiny_gpu_run(3);
  config.metrics.dir = dir.string();
  config.metrics.tensorboard = false;
  config.metrics.trace = true;
  const auto& m = config.model;
  Trainer trainer(config, std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 1),
                  std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 2));
  std::vector<StepStats> seen;
  trainer.on_step = [&](const StepStats& s) { seen.push_back(s); };
  std::ostringstream log;
  Recording recording;
  trainer.run(log);
  const std::vector<std::string> events = recording.stop();
  ASSERT_EQ(seen.size(), 3u);

  // Push/pop nesting as the trainer and the model scope it.
  std::vector<std::string> stack;
  std::map<std::string, int> pushes;
  std::set<std::string> phases;
  for (const std::string& e : events) {
    if (e.rfind("push ", 0) == 0) {
      const std::string name = e.substr(5);
      if (name.rfind("layer ", 0) == 0) {
        ASSERT_FALSE(stack.empty()) << e;
        if (name.find("forward") != std::string::npos)
          EXPECT_TRUE(stack.back() == "forward" || stack.back() == "validation") << e << " in " << stack.back();
        else
          EXPECT_EQ(stack.back(), "backward") << e;
      }
      stack.push_back(name);
      ++pushes[name];
    } else if (e.rfind("pop ", 0) == 0) {
      ASSERT_FALSE(stack.empty());
      EXPECT_EQ(e.substr(4), stack.back());
      stack.pop_back();
    } else if (e.rfind("start ", 0) == 0) {
      phases.insert(e.substr(6));
    }
    EXPECT_EQ(e.find(" no range"), std::string::npos);
    EXPECT_EQ(e.find("without"), std::string::npos);
  }
  EXPECT_TRUE(stack.empty());
  for (int s = 1; s <= 3; ++s) EXPECT_EQ(pushes["step " + std::to_string(s)], 1);
  EXPECT_EQ(pushes["forward"], 6);  // 2 micro-batches a step
  EXPECT_EQ(pushes["backward"], 6);
  EXPECT_EQ(pushes["optimizer"], 3);
  EXPECT_EQ(pushes["validation"], 2);  // before the first step and after the last
  EXPECT_EQ(pushes["layer 1 backward"], 6);
  EXPECT_GT(pushes["layer 0 forward"], 6);  // and the validations' forwards
  for (const char* phase : {"attention", "router", "experts", "optimizer", "LM head+loss"})
    EXPECT_TRUE(phases.count(phase)) << phase;

  const nlohmann::json file = nlohmann::json::parse(read_text(dir / "trace.json"));
  std::map<int64_t, double> gpu_ms;
  std::map<int64_t, std::set<std::string>> host_names;
  std::map<int, std::string> tracks;
  for (const auto& e : file["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") tracks[e["tid"].get<int>()] = e["args"]["name"];
    if (e["ph"] != "X") continue;
    EXPECT_GE(e["dur"].get<double>(), 0.0);
    const int64_t step = e["args"]["step"];
    if (e["cat"] == "gpu") gpu_ms[step] += e["dur"].get<double>() * 1e-3;
    if (e["cat"] == "host") host_names[step].insert(e["name"].get<std::string>());
  }
  EXPECT_EQ(tracks, (std::map<int, std::string>{{1, "host"}, {2, "gpu"}}));
  for (int64_t s = 1; s <= 3; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    EXPECT_EQ(host_names[s], (std::set<std::string>{"zero grads", "data", "forward", "backward", "optimizer"}));
    double phase_sum = 0;
    for (const auto& [phase, ms] : seen[static_cast<size_t>(s - 1)].phase_ms) phase_sum += ms;
    EXPECT_NEAR(gpu_ms[s], phase_sum, 1e-3);
    EXPECT_GT(gpu_ms[s], 0.0);
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moe

// Metrics arithmetic, alerts, the console sink and the dashboard feed.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <sstream>

#include "core/log.h"
#include "obs/alerts.h"
#include "obs/console.h"
#include "obs/feed.h"
#include "obs/metrics.h"

namespace moe {
namespace {

TEST(Metrics, ImbalanceAndCoefficientOfVariation) {
  // mean 4, max 10: 10/4 - 1 = 1.5; std = sqrt((9+9+0+36)/4) = sqrt(13.5).
  const std::vector<int64_t> load = {1, 1, 4, 10};
  EXPECT_DOUBLE_EQ(load_imbalance(load), 1.5);
  EXPECT_DOUBLE_EQ(load_cv(load), std::sqrt(13.5) / 4.0);
  EXPECT_EQ(load_imbalance({5, 5, 5}), 0.0);
  EXPECT_EQ(load_cv({5, 5, 5}), 0.0);
  EXPECT_EQ(load_imbalance({0, 0}), 0.0);
  EXPECT_EQ(load_cv({}), 0.0);
  LayerRouting layer;
  layer.assignments = 40;
  layer.dropped = 10;
  EXPECT_DOUBLE_EQ(layer.dropped_fraction(), 0.25);
}

TEST(Metrics, MfuFollowsTheDesignFormula) {
  MfuInputs in{1'000'000, 4, 128, 256, 989e12};
  const double flops = 6.0 * 1e6 + 12.0 * 4 * 128 * 256;
  EXPECT_DOUBLE_EQ(in.flops_per_token(), flops);
  EXPECT_DOUBLE_EQ(in.mfu(10000), 10000 * flops / 989e12);
  const std::string text = in.describe();
  for (const char* part : {"6 x 1000000", "12 x 4 layers x 128 dim x 256 seq", "peak 989 TFLOP/s"})
    EXPECT_NE(text.find(part), std::string::npos) << text;
  // No peak (the CPU): no MFU, and the line says so.
  in.peak_flops = 0;
  EXPECT_EQ(in.mfu(10000), 0.0);
  EXPECT_NE(in.describe().find("not reported: no peak figure"), std::string::npos) << in.describe();
  EXPECT_EQ(in.describe().find("989"), std::string::npos) << in.describe();
}

TEST(Metrics, StepJsonHasEveryField) {
  StepMetrics m;
  m.step = 3;
  m.steps = 10;
  m.time = {2.0, 1.0, 0.5, 0.25, 0.25};
  LayerRouting l;
  l.layer = 1;
  l.tokens_E = {3, 1};
  l.assignments = 4;
  l.bias_E = {0.5, -0.5};
  m.layers = {l};
  m.ranks = {{0, {0, 1}, {3, 1}}};
  const nlohmann::json j = to_json(m);
  for (const char* key : {"step", "loss", "aux_loss", "z_loss", "lr", "grad_norm", "max_expert_grad_norm", "tokens_per_s",
                          "mfu", "time_s", "comm_wait_fraction", "grad_sync_ms", "memory", "layers", "ranks",
                          "max_imbalance"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_DOUBLE_EQ(j["comm_wait_fraction"].get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(j["time_s"]["data_wait"].get<double>(), 0.25);
  EXPECT_EQ(j["layers"][0]["tokens_per_expert"], nlohmann::json({3, 1}));
  EXPECT_DOUBLE_EQ(j["layers"][0]["imbalance"].get<double>(), 0.5);
  EXPECT_EQ(j["layers"][0]["bias"], nlohmann::json({0.5, -0.5}));
  EXPECT_EQ(j["ranks"][0]["load"], nlohmann::json({3, 1}));
  EXPECT_FALSE(j.contains("phase_ms"));  // only with metrics.phase_times
  m.phase_ms = {{"attention", 1.5}, {"experts", 4.25}};
  EXPECT_DOUBLE_EQ(to_json(m)["phase_ms"]["experts"].get<double>(), 4.25);
  EXPECT_FALSE(j.contains("board"));  // only where the board was sampled (GPU, NVML)
  m.board = summarize_board({{1500, 690, true, false}, {1700, 650, false, false}}, 1980, 700);
  const nlohmann::json board = to_json(m)["board"];
  EXPECT_DOUBLE_EQ(board["sm_clock_mhz"].get<double>(), 1600);
  EXPECT_DOUBLE_EQ(board["power_w"].get<double>(), 670);
  EXPECT_DOUBLE_EQ(board["power_capped"].get<double>(), 0.5);
  EXPECT_EQ(board["samples"].get<int64_t>(), 2);
  EXPECT_FALSE(board.contains("sm_clock_counted_mhz"));  // only where the SMs' count was taken (GPU)
  m.board.sm_mhz_counted = 1450;
  EXPECT_DOUBLE_EQ(to_json(m)["board"]["sm_clock_counted_mhz"].get<double>(), 1450);
  m.board = BoardSummary{};  // no NVML, the count alone
  m.board.sm_mhz_counted = 1450;
  EXPECT_EQ(to_json(m)["board"], nlohmann::json({{"sm_clock_counted_mhz", 1450.0}}));
}

StepMetrics with(int64_t step, std::vector<int64_t> load, double comm_fraction, double sync_ms) {
  StepMetrics m;
  m.step = step;
  m.time.step = 1.0;
  m.time.comm_wait = comm_fraction;
  m.grad_sync_ms = sync_ms;
  LayerRouting l;
  l.layer = 2;
  l.tokens_E = std::move(load);
  m.layers = {l};
  return m;
}

TEST(Alerts, OncePerEpisodeAtTheThresholds) {
  AlertMonitor monitor(AlertThresholds{0.15, 0.20, 5.0});
  // At or under every threshold: 11/9.75 - 1 = 0.13, wait 20% exactly, 5 ms exactly.
  EXPECT_TRUE(monitor.check(with(1, {10, 10, 8, 11}, 0.2, 5.0)).empty());
  auto events = monitor.check(with(2, {10, 10, 6, 14}, 0.25, 6.0));  // 14/10 - 1 = 0.4
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].kind, "imbalance");
  EXPECT_TRUE(events[0].raised);
  EXPECT_NEAR(events[0].value, 0.4, 1e-12);
  EXPECT_NE(events[0].message.find("alert: step 2: expert load imbalance 40.0% (layer 2"), std::string::npos)
      << events[0].message;
  EXPECT_NE(events[1].message.find("communication wait 25.0% of the step > 20.0%"), std::string::npos)
      << events[1].message;
  EXPECT_NE(events[2].message.find("gradient-sync latency 6.00 ms > 5.00 ms"), std::string::npos) << events[2].message;
  // Still over: nothing new.
  EXPECT_TRUE(monitor.check(with(3, {10, 10, 5, 15}, 0.9, 9.0)).empty());
  EXPECT_TRUE(monitor.active("imbalance"));
  // Imbalance back under: one "cleared" event; the others stay quiet.
  events = monitor.check(with(4, {10, 10, 10, 10}, 0.9, 9.0));
  ASSERT_EQ(events.size(), 1u);
  EXPECT_FALSE(events[0].raised);
  EXPECT_EQ(events[0].kind, "imbalance");
  // A new episode raises again.
  events = monitor.check(with(5, {0, 0, 0, 40}, 0.9, 9.0));
  ASSERT_EQ(events.size(), 1u);
  EXPECT_TRUE(events[0].raised);
}

TEST(Console, PlainLinesKeepTheirFormat) {
  std::ostringstream out;
  ConsoleSink console(out, 2, /*progress_bar=*/false);
  for (int64_t s = 1; s <= 5; ++s) {
    StepMetrics m = with(s, {1, 3}, 0, 0);
    m.steps = 5;
    m.loss = 2.5;
    m.lr = 1e-3;
    m.tokens = 100;
    m.time.step = 0.5;
    console.step(m);
  }
  const std::string text = out.str();
  // Steps 1 (first), 2, 4 and 5 (last); 200 tokens/s; imbalance 3/2 - 1.
  EXPECT_EQ(text,
            "step 1/5 | loss 2.5000 | aux 0.0000 | z 0.0000 | lr 1.00e-03 | grad_norm 0.000 | imbalance 0.50 | tok/s 200 | eta 0m02s\n"
            "step 2/5 | loss 2.5000 | aux 0.0000 | z 0.0000 | lr 1.00e-03 | grad_norm 0.000 | imbalance 0.50 | tok/s 200 | eta 0m01s\n"
            "step 4/5 | loss 2.5000 | aux 0.0000 | z 0.0000 | lr 1.00e-03 | grad_norm 0.000 | imbalance 0.50 | tok/s 200 | eta 0m00s\n"
            "step 5/5 | loss 2.5000 | aux 0.0000 | z 0.0000 | lr 1.00e-03 | grad_norm 0.000 | imbalance 0.50 | tok/s 200 | eta 0m00s\n");
  EXPECT_EQ(text.find('\r'), std::string::npos);
  // metrics.phase_times: one more line under the step's.
  StepMetrics m = with(6, {1, 3}, 0, 0);
  m.steps = 6;
  m.time.step = 0.5;
  m.phase_ms = {{"attention", 1.5}, {"experts", 4.25}};
  console.step(m);
  const std::string more = out.str().substr(text.size());
  EXPECT_NE(more.find("\n      phases (ms): attention 1.5 | experts 4.2\n"), std::string::npos) << more;
  EXPECT_EQ(more.find("board"), std::string::npos) << "no board line without samples";
  // GPU, board sampled: one more line with the step's clock and power.
  m.step = 7;
  m.steps = 7;
  m.phase_ms.clear();
  m.board = summarize_board({{1500, 690, true, false}, {1700, 650, false, false}}, 1980, 700);
  console.step(m);
  const std::string board = out.str().substr(text.size() + more.size());
  EXPECT_NE(board.find("\n      board: SM clock 1600 MHz | power 670 W | power-capped 50%\n"), std::string::npos) << board;
  // The SMs' own count beside NVML's clock, and alone where NVML is not read.
  m.step = 8;
  m.steps = 8;
  m.board.sm_mhz_counted = 1450;
  console.step(m);
  m.step = 9;
  m.steps = 9;
  m.board = BoardSummary{};
  m.board.sm_mhz_counted = 1450;
  console.step(m);
  const std::string counted = out.str().substr(text.size() + more.size() + board.size());
  EXPECT_NE(counted.find("\n      board: SM clock 1600 MHz (SMs counted 1450 MHz) | power 670 W | power-capped 50%\n"),
            std::string::npos)
      << counted;
  EXPECT_NE(counted.find("\n      board: SMs counted 1450 MHz\n"), std::string::npos) << counted;
}

// Validations and checkpoint saves take time: tok/s is the interval's tokens over its
// wall time, and the ETA adds the validations and saves still due at their mean times.
TEST(Console, ThroughputAndEtaCountValidationAndCheckpointTime) {
  std::ostringstream out;
  ConsoleSink console(out, 1, /*progress_bar=*/false);
  console.set_schedule(/*val_interval=*/2, /*checkpoint_interval=*/2, /*checkpoints=*/true);
  auto step = [&](int64_t s) {
    StepMetrics m = with(s, {1, 1}, 0, 0);  // 1 s per step
    m.steps = 4;
    m.tokens = 200;
    console.step(m);
  };
  auto eta_of = [](const std::string& line) { return line.substr(line.rfind("eta ") + 4); };
  auto tok_s_of = [](const std::string& line) {
    const auto at = line.find("tok/s ") + 6;
    return line.substr(at, line.find(' ', at) - at);
  };
  auto last_line = [&] {
    std::string text = out.str();
    text.pop_back();
    return text.substr(text.rfind('\n') + 1);
  };
  console.validation_done(0, 2.0);  // before step 1: not training time, but its mean counts
  step(1);
  // 3 steps x 1 s + validations at steps 2 and 4 x 2 s; no save measured yet.
  EXPECT_EQ(eta_of(last_line()), "0m07s");
  EXPECT_EQ(tok_s_of(last_line()), "200");
  step(2);
  EXPECT_EQ(eta_of(last_line()), "0m06s");  // 2 steps + validations at 2 and 4
  console.validation_done(2, 2.0);
  console.checkpoint_done(2, 5.0);
  step(3);
  // 200 tokens over 2 s validating + 5 s saving + 1 s stepping; left: step 4 (1 s), its
  // validation (2 s) and its save (5 s).
  EXPECT_EQ(tok_s_of(last_line()), "25");
  EXPECT_EQ(eta_of(last_line()), "0m08s");
  EXPECT_NEAR(console.eta(), 8.0, 1e-12);
  step(4);
  EXPECT_EQ(eta_of(last_line()), "0m07s");  // the last validation and save are still to come
  console.validation_done(4, 2.0);
  console.checkpoint_done(4, 5.0);
  EXPECT_EQ(console.eta(), 0.0);
}

TEST(Console, ProgressBarOnATerminal) {
  std::ostringstream out;
  ConsoleSink console(out, 100, /*progress_bar=*/true);
  StepMetrics m = with(1, {1, 1}, 0, 0);
  m.steps = 4;
  m.tokens = 10;
  m.time.step = 30;
  console.step(m);
  console.line("val step 1 | val_loss 1.0000");
  const std::string text = out.str();
  // The first step's line, then the bar (25%, 3 steps x 30 s left), cleared before the
  // next line and redrawn after it.
  EXPECT_NE(text.find("step 1/4 | loss"), std::string::npos) << text;
  EXPECT_NE(text.find("\r\x1b[K[#######.......................]  25% step 1/4 | eta 1m30s"), std::string::npos) << text;
  EXPECT_NE(text.find("\r\x1b[Kval step 1 | val_loss 1.0000\n\r\x1b[K[#######"), std::string::npos) << text;
  // Anyone else writing to the stream erases the bar first.
  out << "checkpoint: saved step 1\n";
  EXPECT_NE(out.str().find("eta 1m30s\r\x1b[Kcheckpoint: saved step 1\n"), std::string::npos) << out.str();
  console.step(m);
  console.finish();
  EXPECT_EQ(out.str().substr(out.str().size() - 4), "\r\x1b[K");
}

// `moe` routes spdlog into the console's stream (core/log.h): its lines come in the
// console's one format, and a progress bar is erased before them as before any other line.
TEST(Console, SpdlogLinesShareTheFormatAndEraseTheBar) {
  const auto previous = spdlog::default_logger();
  std::ostringstream out;
  {
    ConsoleSink console(out, 100, /*progress_bar=*/true);
    log_to(out);
    spdlog::info("topology: {} ranks", 4);
    EXPECT_EQ(out.str(), "topology: 4 ranks\n");
    StepMetrics m = with(1, {1, 1}, 0, 0);
    m.steps = 4;
    m.tokens = 10;
    m.time.step = 30;
    console.step(m);
    spdlog::warn("resume: {}", "equal blocks");
    spdlog::error("gone");
    EXPECT_NE(out.str().find("eta 1m30s\r\x1b[Kwarning: resume: equal blocks\nerror: gone\n"), std::string::npos)
        << out.str();
    EXPECT_EQ(out.str().find("[info]"), std::string::npos) << out.str();
    spdlog::set_default_logger(previous);
  }
}

TEST(Console, GivesTheStreamItsBufferBack) {
  std::ostringstream text;
  std::ostream& out = text;  // ostringstream::rdbuf() always names its own buffer
  std::streambuf* own = out.rdbuf();
  {
    ConsoleSink console(out, 1, /*progress_bar=*/true);
    EXPECT_NE(out.rdbuf(), own);
  }
  EXPECT_EQ(out.rdbuf(), own);
}

TEST(Feed, ReturnsRecordsSinceAnIndex) {
  MetricsFeed feed;
  EXPECT_EQ(nlohmann::json::parse(feed.since(0)),
            nlohmann::json::parse(R"({"run":null,"records":[],"next":0,"done":false})"));
  feed.set_run({{"type", "run"}, {"n_experts", 4}});
  for (int i = 1; i <= 3; ++i) feed.add({{"type", "step"}, {"step", i}});
  auto j = nlohmann::json::parse(feed.since(1));
  EXPECT_EQ(j["records"].size(), 2u);
  EXPECT_EQ(j["records"][0]["step"], 2);
  EXPECT_EQ(j["next"], 3);
  EXPECT_EQ(j["run"]["n_experts"], 4);
  feed.set_done();
  j = nlohmann::json::parse(feed.since(99));  // past the end: nothing, not an error
  EXPECT_TRUE(j["records"].empty());
  EXPECT_TRUE(j["done"].get<bool>());
}

}  // namespace
}  // namespace moe

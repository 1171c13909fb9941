#include "obs/console.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <ostream>

namespace moe {

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, seconds));
  if (s >= 3600) return fmt::format("{}h{:02d}m", s / 3600, (s % 3600) / 60);
  return fmt::format("{}m{:02d}s", s / 60, s % 60);
}

namespace {
constexpr std::string_view kEraseLine = "\r\x1b[K";  // carriage return, erase to end of line

// How many of the steps after..last (after excluded) have an event that comes every
// `interval` steps (0: never) and after the last step.
int64_t events_due(int64_t interval, int64_t after, int64_t last) {
  if (after >= last) return 0;
  int64_t n = interval > 0 ? last / interval - after / interval : 0;
  if (interval <= 0 || last % interval != 0) ++n;
  return n;
}
}  // namespace

void ConsoleSink::BarEraser::erase() {
  if (!bar_shown) return;
  bar_shown = false;
  target_->sputn(kEraseLine.data(), static_cast<std::streamsize>(kEraseLine.size()));
}

ConsoleSink::BarEraser::int_type ConsoleSink::BarEraser::overflow(int_type ch) {
  if (traits_type::eq_int_type(ch, traits_type::eof())) return traits_type::not_eof(ch);
  erase();
  return target_->sputc(traits_type::to_char_type(ch));
}

std::streamsize ConsoleSink::BarEraser::xsputn(const char* s, std::streamsize n) {
  if (n > 0) erase();
  return target_->sputn(s, n);
}

ConsoleSink::ConsoleSink(std::ostream& out, int64_t log_interval, bool progress_bar)
    : out_(out), log_interval_(std::max<int64_t>(1, log_interval)), progress_bar_(progress_bar) {
  if (progress_bar_) {
    out_.flush();
    eraser_ = std::make_unique<BarEraser>(out_.rdbuf());
    out_.rdbuf(eraser_.get());
  }
}

ConsoleSink::~ConsoleSink() {
  if (!eraser_) return;
  out_.flush();
  out_.rdbuf(eraser_->target());
}

void ConsoleSink::clear_bar() {
  if (!eraser_ || !eraser_->bar_shown) return;
  eraser_->bar_shown = false;
  eraser_->target()->sputn(kEraseLine.data(), static_cast<std::streamsize>(kEraseLine.size()));
}

void ConsoleSink::draw_bar() {
  if (!progress_bar_ || steps_ <= 0) return;
  constexpr int kWidth = 30;
  const double done = std::clamp(static_cast<double>(last_step_) / static_cast<double>(steps_), 0.0, 1.0);
  const int filled = static_cast<int>(done * kWidth);
  const double eta = this->eta();
  // Written past the eraser, which would otherwise erase the bar it is drawing.
  out_.flush();
  const std::string bar =
      std::string(kEraseLine) + fmt::format("[{}{}] {:3.0f}% step {}/{} | eta {}", std::string(filled, '#'),
                                            std::string(kWidth - filled, '.'), done * 100, last_step_, steps_,
                                            format_duration(eta));
  eraser_->target()->sputn(bar.data(), static_cast<std::streamsize>(bar.size()));
  eraser_->target()->pubsync();
  eraser_->bar_shown = true;
}

void ConsoleSink::set_schedule(int64_t val_interval, int64_t checkpoint_interval, bool checkpoints) {
  val_interval_ = val_interval;
  checkpoint_interval_ = checkpoint_interval;
  checkpoints_ = checkpoints;
}

void ConsoleSink::validation_done(int64_t step, double seconds) {
  ++vals_seen_;
  val_seconds_ += seconds;
  last_val_step_ = step;
  // The validation before the first step is not part of the training's wall time.
  if (steps_seen_ > 0) interval_seconds_ += seconds;
}

void ConsoleSink::checkpoint_done(int64_t step, double seconds) {
  ++saves_seen_;
  save_seconds_ += seconds;
  last_save_step_ = step;
  if (steps_seen_ > 0) interval_seconds_ += seconds;
}

double ConsoleSink::eta() const {
  if (steps_seen_ == 0) return 0;
  double left = step_seconds_ / static_cast<double>(steps_seen_) * static_cast<double>(steps_ - last_step_);
  // The last step's validation and save come after its line: due from that step on,
  // unless they already happened.
  if (vals_seen_ > 0)
    left += val_seconds_ / static_cast<double>(vals_seen_) *
            static_cast<double>(events_due(val_interval_, std::max(last_step_ - 1, last_val_step_), steps_));
  if (checkpoints_ && saves_seen_ > 0)
    left += save_seconds_ / static_cast<double>(saves_seen_) *
            static_cast<double>(events_due(checkpoint_interval_, std::max(last_step_ - 1, last_save_step_), steps_));
  return left;
}

void ConsoleSink::line(const std::string& text) {
  out_ << text << '\n';  // the eraser removes the bar first
  out_.flush();
  draw_bar();
}

void ConsoleSink::step(const StepMetrics& m) {
  ++steps_seen_;
  last_step_ = m.step;
  steps_ = m.steps;
  step_seconds_ += m.time.step;
  interval_tokens_ += m.tokens;
  interval_seconds_ += m.time.step;
  const bool log = steps_seen_ == 1 || m.step % log_interval_ == 0 || m.step == m.steps;
  if (log) {
    fmt::print(out_,
               "step {:>{}}/{} | loss {:.4f} | aux {:.4f} | z {:.4f} | lr {:.2e} | grad_norm {:.3f} "
               "| imbalance {:.2f} | tok/s {:.0f} | eta {}\n",
               m.step, std::to_string(m.steps).size(), m.steps, m.loss, m.aux_loss, m.z_loss, m.lr, m.grad_norm,
               m.max_imbalance(), static_cast<double>(interval_tokens_) / std::max(interval_seconds_, 1e-9),
               format_duration(eta()));
    // Several ranks: what communication cost (one process has none).
    if (m.time.comm_wait > 0 || m.grad_sync_ms > 0 || m.a2a_bytes > 0)
      fmt::print(out_, "      comm wait {:.1f}% | grad sync {:.2f} ms | all-to-all {:.2f} MB at {:.2f} GB/s\n",
                 m.comm_wait_fraction() * 100, m.grad_sync_ms, static_cast<double>(m.a2a_bytes) / 1e6,
                 m.a2a_bandwidth / 1e9);
    if (!m.phase_ms.empty()) {
      std::string line;
      for (const auto& [phase, ms] : m.phase_ms) line += fmt::format("{}{} {:.1f}", line.empty() ? "" : " | ", phase, ms);
      fmt::print(out_, "      phases (ms): {}\n", line);
    }
    // GPU: the clock the step ran at (an H200 at its power limit runs well below its maximum).
    const std::string counted =
        m.board.sm_mhz_counted > 0 ? fmt::format("SMs counted {:.0f} MHz", m.board.sm_mhz_counted) : std::string();
    if (m.board.samples > 0)
      fmt::print(out_, "      board: SM clock {:.0f} MHz{} | power {:.0f} W | power-capped {:.0f}%\n",
                 m.board.sm_mhz_mean, counted.empty() ? "" : " (" + counted + ")", m.board.power_w_mean,
                 100 * m.board.power_capped);
    else if (!counted.empty())
      fmt::print(out_, "      board: {}\n", counted);
    interval_tokens_ = 0;
    interval_seconds_ = 0;
  }
  out_.flush();
  draw_bar();
}

void ConsoleSink::finish() {
  out_.flush();
  clear_bar();
  if (eraser_) eraser_->target()->pubsync();
}

}  // namespace moe

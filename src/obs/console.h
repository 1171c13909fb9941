// The console: a line per logged step ("step N/M | loss ... | eta ..."), validation and
// alert lines, and, when stdout is a terminal, a progress bar with the ETA redrawn in
// place under them after every step. Throughput and ETA count the whole wall time:
// the time of validations and checkpoint saves is counted too (and shown on their own lines). Other code printing to the same stream (checkpoint
// notices) needs no care: the stream is routed through a filter that erases the bar
// before any other output, and the next step redraws it.
#pragma once
#include <cstdint>
#include <memory>
#include <ostream>
#include <streambuf>
#include <string>

#include "obs/metrics.h"

namespace moe {

std::string format_duration(double seconds);  // "4m05s", "1h02m"

class ConsoleSink {
 public:
  ConsoleSink(std::ostream& out, int64_t log_interval, bool progress_bar);
  ~ConsoleSink();  // gives `out` its own buffer back
  ConsoleSink(const ConsoleSink&) = delete;
  ConsoleSink& operator=(const ConsoleSink&) = delete;
  // Prints a full line (the progress bar, if shown, is cleared first and redrawn after).
  void line(const std::string& text);
  // The step line every log_interval steps, on the first and on the last step. Its tok/s
  // is the interval's tokens over its wall time: steps, validations and checkpoint saves.
  void step(const StepMetrics& m);
  // When validations and checkpoints come, for the ETA: every val_interval steps (0:
  // never) and after the last step; checkpoints likewise when `checkpoints` is set.
  void set_schedule(int64_t val_interval, int64_t checkpoint_interval, bool checkpoints);
  // Time spent outside the steps after step `step`: a validation, or the time a checkpoint
  // save held up training. Their means enter the ETA; the time enters the next step line's tok/s.
  void validation_done(int64_t step, double seconds);
  void checkpoint_done(int64_t step, double seconds);
  // Seconds left: the remaining steps, validations and checkpoints at their mean times so
  // far (checkpoints count from the first save on).
  double eta() const;
  // Removes the progress bar so that what follows starts on a clean line.
  void finish();

 private:
  // Passes everything to `target`, first erasing the progress bar if it is shown.
  class BarEraser : public std::streambuf {
   public:
    explicit BarEraser(std::streambuf* target) : target_(target) {}
    std::streambuf* target() const { return target_; }
    bool bar_shown = false;

   protected:
    int_type overflow(int_type ch) override;
    std::streamsize xsputn(const char* s, std::streamsize n) override;
    int sync() override { return target_->pubsync(); }

   private:
    void erase();
    std::streambuf* target_;
  };

  void clear_bar();
  void draw_bar();

  std::ostream& out_;
  std::unique_ptr<BarEraser> eraser_;  // installed on out_ while the bar is on
  int64_t log_interval_;
  bool progress_bar_;
  int64_t steps_seen_ = 0, last_step_ = 0, steps_ = 0;
  double step_seconds_ = 0;  // sum over the steps seen
  int64_t interval_tokens_ = 0;
  double interval_seconds_ = 0;  // steps, validations and saves since the last step line
  // Schedule and measured times of validations and checkpoint saves.
  int64_t val_interval_ = 0, checkpoint_interval_ = 0;
  bool checkpoints_ = false;
  int64_t vals_seen_ = 0, saves_seen_ = 0;
  double val_seconds_ = 0, save_seconds_ = 0;
  int64_t last_val_step_ = -1, last_save_step_ = -1;
};

}  // namespace moe

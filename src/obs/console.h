// The console: a line per logged step ("step N/M | loss ... | eta ..."), validation and
// alert lines, and, when stdout is a terminal, a progress bar with the ETA redrawn in
// place under them after every step. Other code printing to the same stream (checkpoint
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
  // The step line every log_interval steps, on the first and on the last step.
  void step(const StepMetrics& m);
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
  double step_seconds_ = 0;  // sum over the steps seen: the ETA counts training time only
  int64_t interval_tokens_ = 0;
  double interval_seconds_ = 0;
};

}  // namespace moe

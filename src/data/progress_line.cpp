#include "data/progress_line.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>

namespace moe {

ProgressLine::ProgressLine(std::string label, int64_t total_bytes, std::FILE* out, double quiet_seconds,
                           double interval_seconds)
    : label_(std::move(label)), total_bytes_(total_bytes), out_(out), tty_(isatty(fileno(out)) == 1),
      quiet_seconds_(quiet_seconds), interval_seconds_(interval_seconds), start_(Clock::now()), last_(start_) {}

void ProgressLine::update(int64_t bytes_done, int64_t docs_done) {
  const auto now = Clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  if (elapsed < quiet_seconds_) return;
  if (printed_ > 0 && std::chrono::duration<double>(now - last_).count() < interval_seconds_) return;
  last_ = now;
  print(bytes_done, docs_done, false);
}

void ProgressLine::finish(int64_t bytes_done, int64_t docs_done) {
  if (printed_ > 0) print(bytes_done, docs_done, true);
}

void ProgressLine::print(int64_t bytes_done, int64_t docs_done, bool last) {
  const double elapsed = std::max(1e-9, std::chrono::duration<double>(Clock::now() - start_).count());
  const double mb = static_cast<double>(bytes_done) / 1e6, total_mb = static_cast<double>(total_bytes_) / 1e6;
  const double percent = total_bytes_ > 0 ? 100.0 * static_cast<double>(bytes_done) / static_cast<double>(total_bytes_) : 100.0;
  const std::string line = fmt::format("{}: {:.1f}/{:.1f} MB ({:.0f}%) | {} docs | {:.1f} MB/s | {:.0f} s", label_, mb,
                                       total_mb, percent, docs_done, mb / elapsed, elapsed);
  // On a terminal the line is rewritten in place; in a log each update is a line of its own.
  if (tty_) fmt::print(out_, "\r{}{}", line, last ? "\n" : "");
  else fmt::print(out_, "{}\n", line);
  std::fflush(out_);
  ++printed_;
}

}  // namespace moe

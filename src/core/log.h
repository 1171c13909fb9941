// One console format for everything `moe` prints: "topic: text" lines, whether the
// trainer writes them to its stream or a layer logs them through spdlog (dist, backends).
// log_to routes spdlog into the same stream in that format, so the lines interleave in
// the order they happen and a progress bar drawn on the stream is erased before each
// (obs/console.h). Info lines are the message alone; warnings start "warning: " and
// errors "error: ", as the trainer's own warnings do.
#pragma once
#include <iosfwd>

namespace moe {

// spdlog's default logger writes to `out` (which must outlive the logging) from now on.
void log_to(std::ostream& out);

}  // namespace moe

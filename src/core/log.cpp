#include "core/log.h"

#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <mutex>
#include <ostream>
#include <string_view>

namespace moe {
namespace {

class StreamSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  explicit StreamSink(std::ostream& out) : out_(out) {}

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    std::string_view prefix;
    if (msg.level >= spdlog::level::err)
      prefix = "error: ";
    else if (msg.level == spdlog::level::warn)
      prefix = "warning: ";
    // One write per line, so that a stream filter (the progress bar's eraser) sees it whole.
    std::string line(prefix);
    line.append(msg.payload.data(), msg.payload.size());
    line += '\n';
    out_ << line;
    out_.flush();
  }
  void flush_() override { out_.flush(); }

 private:
  std::ostream& out_;
};

}  // namespace

void log_to(std::ostream& out) {
  auto logger = std::make_shared<spdlog::logger>("moe", std::make_shared<StreamSink>(out));
  logger->set_level(spdlog::get_level());
  spdlog::set_default_logger(std::move(logger));
}

}  // namespace moe

#include "obs/feed.h"

#include <algorithm>

namespace moe {

void MetricsFeed::set_run(nlohmann::json run) {
  std::string text = run.dump();
  std::lock_guard lock(mutex_);
  run_ = std::move(text);
}

void MetricsFeed::add(const nlohmann::json& record) {
  std::string text = record.dump();
  std::lock_guard lock(mutex_);
  records_.push_back(std::move(text));
}

void MetricsFeed::set_done() {
  std::lock_guard lock(mutex_);
  done_ = true;
}

std::string MetricsFeed::since(int64_t since) const {
  std::lock_guard lock(mutex_);
  const auto count = static_cast<int64_t>(records_.size());
  since = std::clamp<int64_t>(since, 0, count);
  std::string out = "{\"run\":" + run_ + ",\"records\":[";
  for (int64_t i = since; i < count; ++i) {
    if (i > since) out += ',';
    out += records_[static_cast<size_t>(i)];
  }
  out += "],\"next\":" + std::to_string(count) + ",\"done\":" + (done_ ? "true" : "false") + "}";
  return out;
}

int64_t MetricsFeed::size() const {
  std::lock_guard lock(mutex_);
  return static_cast<int64_t>(records_.size());
}

}  // namespace moe

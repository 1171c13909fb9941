// The records of a run in memory, shared between the training thread (which adds them)
// and the dashboard server's threads (which read them). Records are JSONL records:
// {"type": "step" | "val" | "alert" | "summary", ...}; the "run" record is kept apart.
#pragma once
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moe {

class MetricsFeed {
 public:
  void set_run(nlohmann::json run);
  void add(const nlohmann::json& record);
  void set_done();
  // {"run": ..., "records": [records from index `since` on], "next": count, "done": bool}
  // as JSON text. A client polls with since = the last answer's next.
  std::string since(int64_t since) const;
  int64_t size() const;

 private:
  mutable std::mutex mutex_;
  std::string run_ = "null";
  std::vector<std::string> records_;  // serialised once, on the training thread
  bool done_ = false;
};

}  // namespace moe

// Shell commands from tests: one runner (exit code and output), and the test oracles' venv
// python that scripts/setup.sh fills (.deps/venv; ctest passes MOE_PYTHON / MOE_SOURCE_DIR).
#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace moe::test {

// The source tree (MOE_SOURCE_DIR, else found from this header's path).
inline std::filesystem::path source_root() {
  if (const char* s = std::getenv("MOE_SOURCE_DIR"); s && *s) return s;
  return std::filesystem::path(__FILE__).parent_path().parent_path();
}

inline std::string oracle_python() {
  if (const char* p = std::getenv("MOE_PYTHON"); p && *p) return p;
  return (source_root() / ".deps/venv/bin/python").string();
}

struct CommandResult {
  int exit_code = -1;  // -1: killed by a signal
  std::string output;  // stdout and stderr together (stdout alone without merge_stderr)
};

inline CommandResult run_command(const std::string& command, bool merge_stderr = true) {
  CommandResult result;
  FILE* pipe = popen((command + (merge_stderr ? " 2>&1" : "")).c_str(), "r");
  if (!pipe) return result;
  std::array<char, 4096> buffer{};
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.output.append(buffer.data(), n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

}  // namespace moe::test

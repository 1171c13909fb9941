// Errors that carry context. Throw through MOE_CHECK / MOE_THROW; the CLI turns
// ConfigError into exit code 2 and any other Error into exit code 1.
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

#include "core/error_base.h"

namespace moe {
namespace detail {
[[noreturn]] inline void throw_error(const char* file, int line, const std::string& message) {
  // Keep only the path below src/ so messages stay short.
  std::string where = file;
  if (auto pos = where.rfind("src/"); pos != std::string::npos) where = where.substr(pos);
  throw Error(fmt::format("{} ({}:{})", message, where, line));
}
}  // namespace detail

}  // namespace moe

// MOE_CHECK(cond, "format {}", args...): throws moe::Error naming the failed condition.
#define MOE_CHECK(cond, ...)                                                                 \
  do {                                                                                       \
    if (!(cond)) [[unlikely]]                                                                \
      ::moe::detail::throw_error(__FILE__, __LINE__,                                         \
                                 fmt::format("check failed: {}: {}", #cond,                  \
                                             fmt::format(__VA_ARGS__)));                     \
  } while (0)

#define MOE_THROW(...) ::moe::detail::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__))

#define MOE_CONFIG_ERROR(...) throw ::moe::ConfigError(fmt::format(__VA_ARGS__))

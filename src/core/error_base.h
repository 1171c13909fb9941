// The error types and a printf-style thrower, without fmt: CUDA sources (which nvcc
// compiles, and fmt's compile-time format checks do not survive) use this header;
// everything else uses core/error.h, which adds the fmt-based MOE_CHECK.
#pragma once
#include <cstdarg>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace moe {

// A runtime failure: the message says what went wrong and where.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad user input (config key, command-line value, missing file named in a config).
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A host allocation that did not fit (an arena's block): the batch controller catches it
// and retries with a smaller micro-batch.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

namespace detail {

// Throws moe::Error with the printf-formatted message and "(file:line)".
[[noreturn]] inline __attribute__((format(printf, 3, 4))) void throw_printf(const char* file, int line,
                                                                            const char* format, ...) {
  va_list args;
  va_start(args, format);
  va_list copy;
  va_copy(copy, args);
  const int size = std::vsnprintf(nullptr, 0, format, copy);
  va_end(copy);
  std::vector<char> buffer(static_cast<size_t>(size > 0 ? size : 0) + 1);
  std::vsnprintf(buffer.data(), buffer.size(), format, args);
  va_end(args);
  std::string where = file;
  if (auto pos = where.rfind("src/"); pos != std::string::npos) where = where.substr(pos);
  throw Error(std::string(buffer.data()) + " (" + where + ":" + std::to_string(line) + ")");
}

}  // namespace detail

}  // namespace moe

// MOE_CHECKF(cond, "printf format %d", args...): for code that cannot use fmt.
#define MOE_CHECKF(cond, ...)                                                        \
  do {                                                                               \
    if (!(cond)) [[unlikely]] ::moe::detail::throw_printf(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

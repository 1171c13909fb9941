// The TOML run-config loader: any bytes either parse or throw moe::ConfigError.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "config/run_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    moe::RunConfig config = moe::parse_config(text, "fuzz.toml");
    // What parses must write back to the same config.
    const std::string written = moe::config_to_toml(config);
    if (moe::config_to_toml(moe::parse_config(written, "written")) != written) __builtin_trap();
  } catch (const moe::ConfigError&) {
  }
  return 0;
}

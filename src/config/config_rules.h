// The validation rules of a RunConfig, one owner (config_rules.cpp); run_config.cpp's reader
// and validate_config call them and turn a broken rule into a ConfigError that says where
// the keys involved were set.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace moe {

struct RunConfig;

// A rule that failed: the keys involved (to find where they were set) and the message.
struct RuleBroken {
  std::vector<std::string> keys;
  std::string message;
};

// Throws RuleBroken for the first rule `config` breaks.
void check_run_config(const RunConfig& config);

// A TOML basic string: quotes, backslashes and control characters escaped.
std::string toml_string(std::string_view s);

}  // namespace moe

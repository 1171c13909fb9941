#include "data/jsonl.h"

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moe {

bool is_jsonl_path(std::string_view path) { return path.ends_with(".jsonl"); }

bool is_blank_jsonl_line(std::string_view line) { return line.find_first_not_of(" \t\r") == std::string_view::npos; }

std::string jsonl_document(std::string_view line, const std::string& field, std::string_view path, int64_t line_no,
                           std::string_view field_key) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception&) {
    MOE_CONFIG_ERROR("{}:{}: not valid JSON (a .jsonl file holds one JSON object per line)", path, line_no);
  }
  if (!j.is_object()) MOE_CONFIG_ERROR("{}:{}: not a JSON object (a .jsonl file holds one JSON object per line)", path, line_no);
  const auto it = j.find(field);
  if (it == j.end() || !it->is_string()) MOE_CONFIG_ERROR("{}:{}: no string field '{}' ({})", path, line_no, field, field_key);
  return it->get<std::string>();
}

}  // namespace moe

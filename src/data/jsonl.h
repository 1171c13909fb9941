// JSON Lines documents: each line of a .jsonl file is a JSON object whose string field
// (data.text_field, --text-field) is one document. Shared by data.dir and `moe tokenize`.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace moe {

// True for the file names read as JSON Lines rather than as one document of text.
bool is_jsonl_path(std::string_view path);

// True when the line holds only whitespace (skipped, as blank lines end many JSONL files).
bool is_blank_jsonl_line(std::string_view line);

// The document of one line. Throws ConfigError "<path>:<line>: not valid JSON" or
// "<path>:<line>: no string field '<field>' (<key>)" naming the key that sets the field.
std::string jsonl_document(std::string_view line, const std::string& field, std::string_view path, int64_t line_no,
                           std::string_view field_key);

}  // namespace moe

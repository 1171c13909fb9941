// Small file helpers of the data pipeline: whole-file reads with errors that name the
// file, and atomic writes (temporary name, fsync, rename).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moe {

// Throws ConfigError "<what> '<path>' does not exist / is a directory / is not a regular
// file / cannot be read: <reason>".
std::string read_whole_file(const std::string& path, std::string_view what);
// The same for at most `limit` bytes of the file.
std::string read_file_prefix(const std::string& path, int64_t limit, std::string_view what);

// The regular files under the directory `root` whose name ends with `extension`, as
// (path relative to root with '/' separators, path), sorted by the relative path.
// Symlinked directories are not followed (a link cycle cannot loop); symlinked files are.
// A directory that cannot be listed, or a matching entry that cannot be examined (a
// broken symlink), is a ConfigError "<what>: cannot read '<path>': <reason>": nothing
// is skipped silently.
std::vector<std::pair<std::string, std::string>> list_files_under(const std::string& root, std::string_view extension,
                                                                  std::string_view what);


}  // namespace moe

#include "core/build_info.h"

#include <fmt/format.h>

#include "moe_version.h"

namespace moe {

std::string build_info() {
#if defined(__clang__)
  const std::string compiler = fmt::format("clang {}.{}.{}", __clang_major__, __clang_minor__, __clang_patchlevel__);
#elif defined(__GNUC__)
  const std::string compiler = fmt::format("gcc {}.{}.{}", __GNUC__, __GNUC_MINOR__, __GNUC_PATCHLEVEL__);
#else
  const std::string compiler = "unknown compiler";
#endif
  return fmt::format("moe-train {} ({} build, {})\n{}", MOE_GIT_COMMIT, MOE_BUILD_TYPE, compiler,
                     gpu_library_versions());
}

#ifndef MOE_HAVE_CUDA
std::string gpu_library_versions() { return "CPU-only build (no CUDA backend)"; }
#endif

}  // namespace moe

// What this binary is (`moe --version`): the source's git commit (with "+changes" when it
// was built from an edited tree), the build type and compiler, and on CUDA builds the
// CUDA runtime, driver, cuDNN and NCCL versions it finds.
#pragma once
#include <string>

namespace moe {

// Several lines, the first "moe-train <commit> (<build type>, <compiler>)".
std::string build_info();
// The GPU libraries' versions (CUDA builds), or that the build is CPU-only: one line.
std::string gpu_library_versions();

}  // namespace moe

// gpu_library_versions() of CUDA builds: the runtime this binary carries, the driver and
// cuDNN found on this machine (both opened at run time), and NCCL.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <fmt/format.h>

#include "core/build_info.h"

namespace moe {
namespace {

std::string cuda_version(int v) { return v > 0 ? fmt::format("{}.{}", v / 1000, v % 1000 / 10) : "none"; }

// cuDNN is loaded at run time (cudnn-frontend's dynamic loading): its version if the
// library can be opened here.
std::string cudnn_version() {
  for (const char* name : {"libcudnn.so.9", "libcudnn.so"}) {
    void* lib = dlopen(name, RTLD_LAZY | RTLD_LOCAL);
    if (!lib) continue;
    using GetVersion = size_t (*)();
    const auto get = reinterpret_cast<GetVersion>(dlsym(lib, "cudnnGetVersion"));
    const size_t v = get ? get() : 0;
    dlclose(lib);
    if (v > 0) return fmt::format("{}.{}.{}", v / 10000, v % 10000 / 100, v % 100);
  }
  return "not found";
}

}  // namespace

std::string gpu_library_versions() {
  int runtime = 0, driver = 0, nccl = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  cudaGetLastError();  // no driver (CI): not an error for later calls to report
  if (ncclGetVersion(&nccl) != ncclSuccess) nccl = 0;
  return fmt::format("CUDA runtime {} (built with {}), driver {}, cuDNN {}, NCCL {}.{}.{}", cuda_version(runtime),
                     cuda_version(CUDART_VERSION), driver > 0 ? cuda_version(driver) : "not found", cudnn_version(),
                     nccl / 10000, nccl % 10000 / 100, nccl % 100);
}

}  // namespace moe

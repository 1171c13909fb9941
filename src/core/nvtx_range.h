// NVTX ranges, for an Nsight Systems timeline that reads like the phase table
// (docs/PROFILING.md). NVTX3 is header-only (the CUDA toolkit's nvtx3/); with no profiler
// attached each call returns at once, so the ranges are always on. Without the CUDA
// build they compile to nothing.
//
// Two kinds: NvtxRange, a push/pop range of a scope (steps, forward, layers), which
// nests; NvtxPhases, a row of phases each ending where the next begins (start/end
// ranges, which need not nest inside the scopes they cross).
#pragma once
#include <cstdint>
#include <string>

#ifdef MOE_HAVE_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

namespace moe {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) {
#ifdef MOE_HAVE_CUDA
    nvtxRangePushA(name);
#else
    (void)name;
#endif
  }
  explicit NvtxRange(const std::string& name) : NvtxRange(name.c_str()) {}
  ~NvtxRange() {
#ifdef MOE_HAVE_CUDA
    nvtxRangePop();
#endif
  }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

class NvtxPhases {
 public:
  NvtxPhases() = default;
  ~NvtxPhases() { end(); }
  NvtxPhases(const NvtxPhases&) = delete;
  NvtxPhases& operator=(const NvtxPhases&) = delete;
  // Ends the current phase, if any, and starts `name`.
  void begin(const char* name) {
    end();
#ifdef MOE_HAVE_CUDA
    id_ = nvtxRangeStartA(name);
    open_ = true;
#else
    (void)name;
#endif
  }
  void end() {
#ifdef MOE_HAVE_CUDA
    if (open_) nvtxRangeEnd(id_);
#endif
    open_ = false;
  }
  bool open() const { return open_; }

 private:
  uint64_t id_ = 0;
  bool open_ = false;
};

}  // namespace moe

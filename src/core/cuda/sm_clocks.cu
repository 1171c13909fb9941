#include "core/cuda/sm_clocks.h"

#include "core/cuda/device_clock.cuh"

namespace moe::gpu {

namespace {

constexpr uint32_t kMaxSmId = 512;  // %smid is below %nsmid, 132-144 on Hopper

struct Counters {
  unsigned long long *sm_mark, *sm_cycles, *sm_ns;  // [kMaxSmId] each
  unsigned long long *phase_cycles, *phase_ns;      // [phases] each
};

Counters counters(unsigned long long* state, int n_phases) {
  return {state, state + kMaxSmId, state + 2 * kMaxSmId, state + 3 * kMaxSmId, state + 3 * kMaxSmId + n_phases};
}

// One thread a block; the first block of this mark on an SM stamps it (two blocks of one
// launch may share an SM, and an SM may get none: its next interval then spans two marks
// and is not charged).
__global__ void stamp_kernel(Counters c, unsigned long long mark, int phase_before) {
  if (threadIdx.x != 0) return;
  const unsigned long long cycles = clock64(), ns = global_ns();
  const uint32_t sm = sm_id();
  if (sm >= kMaxSmId) return;
  const unsigned long long previous = atomicMax(&c.sm_mark[sm], mark);
  if (previous >= mark) return;
  if (previous != 0 && previous == mark - 1 && phase_before >= 0) {
    atomicAdd(&c.phase_cycles[phase_before], cycles - c.sm_cycles[sm]);
    atomicAdd(&c.phase_ns[phase_before], ns - c.sm_ns[sm]);
  }
  c.sm_cycles[sm] = cycles;
  c.sm_ns[sm] = ns;
}

}  // namespace

SmClocks::SmClocks(int n_phases)
    : n_phases_(n_phases), blocks_(multiprocessor_count()), state_(3 * kMaxSmId + 2 * static_cast<size_t>(n_phases)) {
  state_.fill_bytes(0);
}

void SmClocks::stamp(int phase_before, cudaStream_t stream) {
  MOE_CHECKF(phase_before < n_phases_, "SM clocks: phase %d of %d", phase_before, n_phases_);
  stamp_kernel<<<blocks_, 32, 0, stream>>>(counters(state_.data(), n_phases_), ++marks_, phase_before);
  MOE_CUDA_CHECK_LAUNCH();
}

std::vector<double> SmClocks::take_mhz(cudaStream_t stream) {
  const size_t n = static_cast<size_t>(n_phases_);
  std::vector<unsigned long long> sums(2 * n);
  unsigned long long* device_sums = state_.data() + 3 * kMaxSmId;
  MOE_CUDA_CHECK(
      cudaMemcpyAsync(sums.data(), device_sums, sums.size() * sizeof(sums[0]), cudaMemcpyDeviceToHost, stream));
  MOE_CUDA_CHECK(cudaMemsetAsync(device_sums, 0, sums.size() * sizeof(sums[0]), stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> mhz(n, 0.0);
  for (size_t p = 0; p < n; ++p)
    if (sums[n + p] > 0) mhz[p] = 1e3 * static_cast<double>(sums[p]) / static_cast<double>(sums[n + p]);
  return mhz;
}

}  // namespace moe::gpu

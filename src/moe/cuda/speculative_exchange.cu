// Speculative dispatch on the GPU (moe.speculative_dispatch, docs/ROUTING_CACHE.md): where
// each exact row comes from, and the receiver's merge of the early rows and the
// corrections into the exact blocks. CPU references: moe/speculative_exchange.cpp.
#include <cstdint>

#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "moe/cuda/token_blocks.cuh"
#include "moe/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kRowThreads = 128;

// One block per rank p walks the tokens in order (as token_blocks): a correction's place
// is its rank among the tokens going to p that did not go early.
__global__ void speculation_sources_kernel(int32_t* source_U, int32_t* corr_pos_TP, int32_t* corr_tokens_P,
                                           const int32_t* pos_TP, const int32_t* tokens_P,
                                           const int32_t* spec_pos_TP, int64_t T, int P) {
  const int p = blockIdx.x;
  const int64_t start = block_start(tokens_P, p);
  int64_t seen = 0;
  for (int64_t base = 0; base < T; base += blockDim.x) {
    const int64_t t = base + threadIdx.x;
    int32_t pos = -1, early = -1;
    if (t < T) {
      pos = pos_TP[t * P + p];
      early = spec_pos_TP[t * P + p];
    }
    const int here = pos >= 0 && early < 0;
    int chunk_total;
    const int inclusive = block_inclusive_scan(here, &chunk_total);
    if (t < T) {
      const int32_t corr = here ? static_cast<int32_t>(seen + inclusive - 1) : -1;
      corr_pos_TP[t * P + p] = corr;
      if (pos >= 0) source_U[start + pos] = early >= 0 ? early : -corr - 1;
    }
    seen += chunk_total;
    __syncthreads();
  }
  if (threadIdx.x == 0) corr_tokens_P[p] = static_cast<int32_t>(seen);
}

// One block per exact row, threads over its 4-byte words.
__global__ void merge_speculated_rows_kernel(uint32_t* rows_U, const int32_t* source_U, const int32_t* starts_3P1,
                                             const uint32_t* spec_rows, const uint32_t* corr_rows, int64_t words,
                                             int P) {
  const int64_t u = blockIdx.x;
  int p = 0;
  while (p + 1 < P && u >= starts_3P1[p + 1]) ++p;
  const int32_t s = source_U[u];
  const uint32_t* from = s >= 0 ? spec_rows + (starts_3P1[P + 1 + p] + s) * words
                                : corr_rows + (starts_3P1[2 * (P + 1) + p] + (-s - 1)) * words;
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) rows_U[u * words + i] = from[i];
}

}  // namespace

void speculation_sources(int32_t* source_U, int32_t* corr_pos_TP, int32_t* corr_tokens_P, const int32_t* pos_TP,
                         const int32_t* tokens_P, const int32_t* spec_pos_TP, int64_t T, int P, Stream stream) {
  MOE_CHECKF(P >= 1 && P <= 32, "speculation_sources: %d ranks (1 to 32)", P);
  speculation_sources_kernel<<<static_cast<unsigned>(P), kScanThreads, 0, stream>>>(
      source_U, corr_pos_TP, corr_tokens_P, pos_TP, tokens_P, spec_pos_TP, T, P);
  MOE_CUDA_CHECK_LAUNCH();
}

void merge_speculated_rows(void* rows_U, const int32_t* source_U, int64_t U, const int32_t* starts_3P1,
                           const void* spec_rows, const void* corr_rows, int64_t row_bytes, int P, Stream stream) {
  MOE_CHECKF(row_bytes % 4 == 0 && P >= 1, "merge_speculated_rows: rows of %lld bytes (4-byte words), %d ranks",
             static_cast<long long>(row_bytes), P);
  if (U == 0 || row_bytes == 0) return;
  merge_speculated_rows_kernel<<<static_cast<unsigned>(U), kRowThreads, 0, stream>>>(
      static_cast<uint32_t*>(rows_U), source_U, starts_3P1, static_cast<const uint32_t*>(spec_rows),
      static_cast<const uint32_t*>(corr_rows), row_bytes / 4, P);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda

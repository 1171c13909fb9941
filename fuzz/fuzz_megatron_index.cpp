// The Megatron .idx reader (data/megatron_dataset.h): any bytes are parsed to an index whose
// document offsets run from 0 to the token count without decreasing, or refused with
// moe::Error.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "core/error.h"
#include "data/megatron_dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const moe::MegatronIndex index = moe::parse_megatron_index(std::span<const uint8_t>(data, size), "fuzz");
    if (index.doc_offsets.empty() || index.doc_offsets.front() != 0 || index.doc_offsets.back() != index.n_tokens)
      std::abort();
    for (size_t d = 1; d < index.doc_offsets.size(); ++d)
      if (index.doc_offsets[d] < index.doc_offsets[d - 1]) std::abort();
  } catch (const moe::Error&) {
  }
  return 0;
}

#include "train/batch_controller.h"

#include <fmt/format.h>

#include <new>

#include "core/error.h"

namespace moe {

BatchPlan fit_micro_batch(int64_t global_batch_tokens, int64_t seq_len, int64_t micro_batch, size_t limit_bytes,
                          const std::function<size_t(int64_t)>& bytes_for,
                          const std::function<void(int64_t)>& allocate) {
  MOE_CHECK(micro_batch > 0 && seq_len > 0 && global_batch_tokens % (micro_batch * seq_len) == 0,
            "global batch {} is not a multiple of micro_batch {} x seq_len {}", global_batch_tokens, micro_batch,
            seq_len);
  BatchPlan plan{micro_batch, global_batch_tokens / (micro_batch * seq_len), {}};
  auto halve = [&](const std::string& why) {
    if (plan.micro_batch % 2 != 0)
      MOE_THROW("memory: a micro-batch of {} sequences {}, and it cannot be halved evenly (global batch {} tokens)",
                plan.micro_batch, why, global_batch_tokens);
    plan.notes.push_back(fmt::format("memory: micro-batch {} {}; halved to {} x {} accumulation steps ({} tokens/step)",
                                     plan.micro_batch, why, plan.micro_batch / 2, plan.micro_steps * 2,
                                     global_batch_tokens));
    plan.micro_batch /= 2;
    plan.micro_steps *= 2;
  };
  for (;;) {
    if (limit_bytes > 0) {
      const size_t bytes = bytes_for(plan.micro_batch);
      if (bytes > limit_bytes) {
        halve(fmt::format("plans {:.1f} MB, over the {:.1f} MB limit", static_cast<double>(bytes) / 1e6,
                          static_cast<double>(limit_bytes) / 1e6));
        continue;
      }
    }
    try {
      allocate(plan.micro_batch);
      return plan;
    } catch (const std::bad_alloc&) {
      halve("failed to allocate");
    } catch (const OutOfMemory& e) {  // an arena's block (core/arena.h)
      halve(fmt::format("failed to allocate ({})", e.what()));
    }
  }
}

}  // namespace moe

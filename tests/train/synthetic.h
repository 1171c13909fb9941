// A synthetic task for training tests: random tokens, and at position i the target is
// a fixed permutation of the token two places back. Solving it needs attention (to look
// back) and the FFN/experts (to apply the permutation); a working trainer drives the
// loss to near zero, a broken one cannot.
#pragma once
#include <numeric>
#include <vector>

#include "config/run_config.h"
#include "core/rng.h"
#include "data/batch_source.h"

namespace moe::test {

class LookBackTask final : public BatchSource {
 public:
  // The permutation is fixed (the task); `stream` picks which token sequences are drawn,
  // so training and validation sources share the task but not the data.
  LookBackTask(int64_t vocab, int64_t seq_len, uint64_t stream)
      : vocab_(vocab), seq_len_(seq_len), rng_(stream, "lookback") {
    const CounterRng task_rng(0, "lookback.permutation");
    permutation_.resize(static_cast<size_t>(vocab));
    std::iota(permutation_.begin(), permutation_.end(), 0);
    for (int64_t i = vocab - 1; i > 0; --i)
      std::swap(permutation_[static_cast<size_t>(i)],
                permutation_[task_rng.bits(static_cast<uint64_t>(i))[0] % static_cast<uint32_t>(i + 1)]);
  }
  void next_batch(int64_t batch, int32_t* inputs_BS, int32_t* targets_BS) override {
    for (int64_t b = 0; b < batch; ++b) {
      int32_t* in = inputs_BS + b * seq_len_;
      int32_t* tgt = targets_BS + b * seq_len_;
      for (int64_t s = 0; s < seq_len_; ++s)
        in[s] = static_cast<int32_t>(rng_.bits(counter_++)[0] % static_cast<uint32_t>(vocab_));
      for (int64_t s = 0; s < seq_len_; ++s)
        tgt[s] = s < 2 ? -1 : permutation_[static_cast<size_t>(in[s - 2])];
    }
  }
  void reset() override { counter_ = 0; }
  std::vector<int64_t> state() const override { return {static_cast<int64_t>(counter_)}; }
  void restore(const std::vector<int64_t>& state) override { counter_ = static_cast<uint64_t>(state.at(0)); }

 private:
  int64_t vocab_, seq_len_;
  CounterRng rng_;
  uint64_t counter_ = 0;
  std::vector<int32_t> permutation_;
};

// A model and schedule that learn LookBackTask (16 ids, 16 positions) in 150 steps.
inline RunConfig lookback_config() {
  RunConfig config;
  ModelConfig& m = config.model;
  m.vocab_size = 16;
  m.dim = 32;
  m.n_layers = 2;
  m.n_heads = 2;
  m.n_kv_heads = 1;
  m.seq_len = 16;
  m.moe.n_experts = 4;
  m.moe.top_k = 2;
  m.moe.expert_hidden = 32;
  config.training.micro_batch = 16;
  config.training.global_batch_tokens = 512;  // 2 micro-batches
  config.training.steps = 150;
  config.training.val_batches = 4;
  config.training.val_interval = 0;
  config.lr.peak = 1e-2;
  config.lr.warmup_steps = 20;
  config.optimizer.weight_decay = 0.0;
  config.metrics.log_interval = 50;
  return config;
}

}  // namespace moe::test

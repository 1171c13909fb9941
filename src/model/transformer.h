// The MoE transformer: token embedding -> N blocks of
// [RMSNorm -> attention -> residual; RMSNorm -> MoE (or dense) FFN -> residual]
// -> final RMSNorm -> LM head -> mean cross-entropy. Forward and backward by hand;
// every buffer comes from arenas planned for a given micro-batch size.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/arena.h"
#include "model/attention.h"
#include "config/model_config.h"
#include "model/ffn.h"
#include "model/kv_cache.h"
#include "model/moe_layer.h"
#include "model/parameters.h"

namespace moe {

struct ForwardResult {
  double ce_loss = 0;   // mean cross-entropy over the micro-batch's targets
  double aux_loss = 0;  // sum over MoE layers, coefficients applied
  double z_loss = 0;    // sum over MoE layers, coefficients applied
  int64_t dropped = 0;  // assignments dropped by capacity, all layers
  double total() const { return ce_loss + aux_loss + z_loss; }
};

template <typename T>
class Transformer {
 public:
  Transformer(const ModelConfig& config, uint64_t seed);
  Transformer(const Transformer&) = delete;
  // The parameters `config` registers (names, shapes, planned_offsets), none allocated:
  // the layout of a model too large for this host (train/memory_plan.h).
  static ParameterStore<T> parameter_specs(const ModelConfig& config);
  Transformer& operator=(const Transformer&) = delete;

  // Plans the activation and scratch arenas for micro-batches of `batch` sequences.
  void plan(int64_t batch);
  int64_t planned_batch() const { return batch_; }
  // Bytes plan(batch) would take for activations and scratch, without allocating them.
  size_t planned_bytes(int64_t batch);
  // inputs_BS / targets_BS: token ids, [batch, seq_len]. Targets of -1 are ignored.
  ForwardResult forward(const int32_t* inputs_BS, const int32_t* targets_BS);
  // The last forward's logits, [batch * seq_len, vocab].
  const T* logits_TV() const { return logits_TV_; }
  // Incremental decoding (docs/GENERATION.md): appends `n` tokens of one sequence at
  // positions cache.length().. (the cache holds the keys and values before them), and
  // writes the logits after the last one into logits_V. MoE layers route dropless. Uses
  // no planned arena, so it runs whether or not plan() was called, and changes no state
  // of forward/backward.
  void forward_cached(const int32_t* tokens_n, int64_t n, KvCache<T>& cache, T* logits_V) const;
  // Backward of (ce + aux + z) * loss_scale, accumulated into the parameter gradients.
  void backward(double loss_scale) { backward(loss_scale, loss_scale); }
  // The same with the cross-entropy weighted by ce_scale and the MoE losses by router_scale
  // (data parallelism: a rank's cross-entropy is its share of the global mean, while the
  // MoE layers already differentiate the global aux and z losses).
  void backward(double ce_scale, double router_scale);

  // Backward finishes the parameter gradients in stages: stage 0 the LM head and final
  // norm, stage 1 + i block n_layers - 1 - i, stage n_layers + 1 the embedding (with a
  // tied head, its gradient is complete only then). The hook, when set, is called after
  // each stage (data parallelism starts reducing a finished layer's gradients).
  int backward_stages() const { return backward_stages(config_); }
  // The stage after which the gradient of the parameter named `name` is complete.
  int backward_stage_of(const std::string& name) const { return backward_stage_of(config_, name); }
  // The same rules for a model not built (the memory planner's parameter_specs layout).
  static int backward_stages(const ModelConfig& config) { return static_cast<int>(config.n_layers) + 2; }
  static int backward_stage_of(const ModelConfig& config, const std::string& name);
  std::function<void(int stage)> on_backward_stage;
  // ZeRO-3: called before the forward (backward = false) or the backward first reads a
  // stage's parameter values, and after it last does (before on_backward_stage), so that
  // they can be gathered just in time and released after use. Stages as above; a tied
  // head reads the embedding's values (stage n_layers + 1) in stage 0 too.
  std::function<void(int stage, bool backward)> on_parameters_needed, on_parameters_done;

  ParameterStore<T>& params() { return params_; }
  const ParameterStore<T>& params() const { return params_; }
  const ModelConfig& config() const { return config_; }
  std::vector<MoELayer<T>*> moe_layers();
  std::vector<const MoELayer<T>*> moe_layers() const;
  // Data and expert parallelism for every MoE layer (exchanges[i] and slots[i] for the i-th
  // MoE layer; empty: none). Call plan() afterwards.
  void set_moe_parallel(MoEBatchGroup* batch, const std::vector<ExpertExchange*>& exchanges,
                        const std::vector<const ExpertSlots*>& slots = {});
  // Bytes of the planned activation and scratch arenas.
  size_t activation_bytes() const;

 private:
  // allocate = false: the parameters registered only (parameter_specs).
  Transformer(const ModelConfig& config, uint64_t seed, bool allocate);
  struct Block {
    int norm1 = -1, norm2 = -1;
    std::unique_ptr<AttentionLayer<T>> attention;
    std::unique_ptr<FeedForward<T>> dense;  // exactly one of dense / moe is set
    std::unique_ptr<MoELayer<T>> moe;
    // Saved activations.
    T *x_TD = nullptr, *n1_TD = nullptr, *rstd1_T = nullptr, *h_TD = nullptr, *n2_TD = nullptr,
      *rstd2_T = nullptr;
  };

  ModelConfig config_;
  ParameterStore<T> params_;
  int embedding_ = -1, final_norm_ = -1, head_ = -1;
  std::vector<Block> blocks_;
  std::optional<Arena> saved_, scratch_;
  int64_t batch_ = 0, tokens_ = 0;
  const int32_t* inputs_ = nullptr;
  const int32_t* targets_ = nullptr;
  // Saved by the model itself.
  int32_t* positions_T_ = nullptr;
  T *final_x_TD_ = nullptr, *final_n_TD_ = nullptr, *final_rstd_T_ = nullptr, *logits_TV_ = nullptr,
    *lse_T_ = nullptr;
  // Scratch: gradient of the residual stream, and of a normed input.
  T *dres_TD_ = nullptr, *dnorm_TD_ = nullptr;

  void plan_into(Arena& saved, Arena& scratch, int64_t batch);
};

}  // namespace moe

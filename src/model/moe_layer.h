// The MoE feed-forward: router (fp32 linear with bias) -> temperature softmax or sigmoid
// -> top-k (+ optional selection bias) -> optional renormalisation -> capacity ->
// permute into expert-contiguous rows -> SwiGLU experts -> weighted combine, plus
// shared experts that every token goes through. Adds the aux and z losses.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "config/model_config.h"
#include "model/expert_parallel_dispatcher.h"
#include "model/ffn.h"
#include "model/parameters.h"
#include "moe/routing_cache.h"

namespace moe {

// What one forward pass of a MoE layer measured.
struct MoEForwardStats {
  double aux_loss = 0;   // already multiplied by its coefficient
  double z_loss = 0;     // already multiplied by its coefficient
  int64_t dropped = 0;   // assignments dropped by capacity
  int64_t expert_rows = 0;  // rows this rank's experts computed (expert parallelism: its window's share)
};

// Routing measurements accumulated over forwards since reset_load(), for metrics.
struct MoERoutingStats {
  std::vector<int64_t> kept_E;  // assignments each expert processed (after capacity dropping)
  int64_t dropped = 0;          // assignments dropped by capacity
  double entropy_sum = 0;       // sum over tokens of the router distribution's entropy (nats)
  int64_t tokens = 0;
  SpeculationRows speculation;  // moe.speculative_dispatch: this rank's rows received early, wasted, corrected
};

// Data parallelism: the data-parallel ranks whose micro-batches together form one global
// micro-batch. Rank r's local sequence b is sequence b * size() + r of the global one, which
// is exactly the micro-batch of a single-process run with size() times the micro-batch
// (the sliced loaders read sequences k * world + r). The aux loss, the z-loss and capacity
// dropping are computed over the global micro-batch, so N ranks reproduce that run.
// Implemented over a communicator in src/dist/expert_exchange.h.
class MoEBatchGroup {
 public:
  virtual ~MoEBatchGroup() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // values[i] = sum over the ranks of values[i] (blocking).
  virtual void sum(double* values, int64_t count) = 0;
  // all gets size() * count values: rank 0's first.
  virtual void all_gather(const int64_t* values, int64_t count, int64_t* all) = 0;
};

template <typename T>
class MoELayer {
 public:
  MoELayer(ParameterStore<T>& params, const ModelConfig& config, const std::string& prefix);
  void plan(Arena& saved, Arena& scratch, int64_t tokens);
  // y_TD = moe(x_TD). Adds the assignments per expert (before dropping) to load_E().
  MoEForwardStats forward(T* y_TD, const T* x_TD);
  // Decoding: y_nD = moe(x_nD) for n tokens, routed as forward routes them but dropless
  // (every assignment kept whatever moe.capacity_factor, as Mixtral-style inference does),
  // in its own scratch: no load, routing statistics or saved tensors change. One process.
  void forward_dropless(T* y_nD, const T* x_nD, int64_t n) const;
  // dx_TD = d moe / dx . dy_TD (overwritten). The aux and z losses are differentiated with
  // weight `loss_scale` (the same factor that scaled dy).
  void backward(T* dx_TD, const T* dy_TD, const T* x_TD, double loss_scale);

  // Assignments per expert accumulated since the last reset (for balancing and metrics).
  const std::vector<int64_t>& load_E() const { return load_E_; }
  // Resets load_E() and routing_stats().
  void reset_load();
  const MoERoutingStats& routing_stats() const { return routing_; }
  // Aux-loss-free balancing: bias_e += rate * sign(mean load - load_e), then reset load.
  void update_balancing_bias();
  std::vector<float>& balance_bias_E() { return bias_E_; }
  const std::vector<float>& balance_bias_E() const { return bias_E_; }
  // The last forward's top-k choices, [tokens of the micro-batch, top_k] (this rank's tokens).
  const int32_t* experts_TK() const { return expert_TK_; }
  // The router temperature this layer routes with: moe.temperature, or with
  // moe.temperature_control the controller's current value (moe/temperature_control.h).
  double temperature() const { return cfg_.temperature_control ? temperature_state_[0] : cfg_.temperature; }
  bool temperature_control() const { return cfg_.temperature_control; }
  // The controller's state, [temperature, smoothed imbalance] (checkpointed).
  std::vector<float>& temperature_state() { return temperature_state_; }
  const std::vector<float>& temperature_state() const { return temperature_state_; }
  // Temperature auto-tuning: one controller step from load_E() towards the imbalance target.
  void update_temperature(double target);
  const std::string& prefix() const { return prefix_; }
  int64_t n_experts() const { return E_; }
  // Distributed runs: the global micro-batch's ranks (aux loss, z-loss, capacity), and
  // with expert parallelism the exchange with the EP ranks and this layer's slots (read at
  // every forward: a re-placement between steps changes them in place). Null: none. Set
  // before plan().
  void set_parallel(MoEBatchGroup* batch, ExpertExchange* exchange = nullptr, const ExpertSlots* slots = nullptr);
  // moe.speculative_dispatch (docs/ROUTING_CACHE.md): `cache` guesses this layer's
  // experts from the MoE layer before (null: no speculation; needs expert parallelism).
  void set_route_predictor(const RoutingCache* cache) { predictor_ = cache; }
  // Once the MoE layer before has routed this forward's tokens_T (its choices prev_TK):
  // guesses this layer's experts and starts the speculative dispatch (nothing without a
  // predictor). The forward then sends the guessed rows as soon as it starts.
  void speculate(const int32_t* tokens_T, const int32_t* prev_TK);
  // Replaces the accumulated load (the data-parallel sum, before the balancing update).
  void set_load(const std::vector<int64_t>& load_E) { load_E_ = load_E; }

 private:
  void record_routing(int64_t dropped);
  bool global_batch() const { return batch_ != nullptr && batch_->size() > 1; }
  // Aux and z losses over the global micro-batch (forward values; saves f_E for backward).
  void global_router_losses(MoEForwardStats& stats);
  void global_aux_backward(double loss_scale);
  // Capacity dropping by position in the global micro-batch, rows by slot.
  int64_t assign_rows_global(const int32_t* slot_TK);
  // The slot of each assignment: the expert itself, or through the layer's slot table.
  const int32_t* slots_of_assignments();
  void experts_forward_local();
  // The SwiGLU experts over rows laid out by expert (offsets_E1 / counts_E), `rows` in all.
  void experts_forward(const int32_t* offsets_E1, const int32_t* counts_E, int64_t rows, const T* x_RD, T* gate_RF,
                       T* up_RF, T* act_RF, T* y_RD) const;
  // Selection bias in the layer's type (null when moe.bias_balancing is off).
  const T* selection_bias(std::vector<T>& bias_E) const;
  void experts_backward_local();

  ParameterStore<T>& params_;
  MoEConfig cfg_;
  std::string prefix_;
  int64_t D_, E_, K_, F_, S_, T_ = 0, rows_ = 0, capacity_ = 0;
  int router_w_, router_b_ = -1, w1_, w3_, w2_;  // router_b_ -1: moe.router_bias off
  std::vector<FeedForward<T>> shared_;
  std::vector<int64_t> load_E_;
  MoERoutingStats routing_;
  std::vector<float> bias_E_;         // selection bias (not a parameter: no gradient)
  std::vector<T> bias_T_;             // bias_E_ in the layer's type, for router_select
  std::vector<float> temperature_state_;  // [temperature, smoothed imbalance]
  MoEBatchGroup* batch_ = nullptr;
  const ExpertSlots* slots_ = nullptr;
  std::unique_ptr<ExpertParallelDispatcher<T>> dispatcher_;  // expert parallelism
  const RoutingCache* predictor_ = nullptr;  // moe.speculative_dispatch
  std::vector<int32_t> guess_TQ_;            // its guesses: experts, then slots
  std::vector<double> global_fraction_E_;  // global aux loss: assignment fractions, for backward
  std::vector<int32_t> slot_of_expert_;    // expert parallelism: this forward's slot table
  // Saved from forward. Rows are laid out by slot (the expert itself without expert
  // parallelism): counts_E_ and offsets_E1_ are per slot.
  T *logits_TE_ = nullptr, *scores_TE_ = nullptr, *weight_TK_ = nullptr;
  int32_t *expert_TK_ = nullptr, *slot_TK_ = nullptr, *row_TK_ = nullptr, *counts_E_ = nullptr,
          *offsets_E1_ = nullptr, *token_of_row_R_ = nullptr;
  T *x_RD_ = nullptr, *gate_RF_ = nullptr, *up_RF_ = nullptr, *act_RF_ = nullptr, *y_RD_ = nullptr;
  // Scratch for backward.
  T *dy_RD_ = nullptr, *dweight_TK_ = nullptr, *dact_RF_ = nullptr, *dgate_RF_ = nullptr,
    *dup_RF_ = nullptr, *dx_RD_ = nullptr, *dscores_TE_ = nullptr, *dlogits_TE_ = nullptr;
};

}  // namespace moe

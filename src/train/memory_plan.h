// The device memory of one GPU training rank, estimated on the host from the run config
// and a layout (GPUs, EP, ZeRO level, micro-batch, recomputation): what GpuParameterStore,
// GpuTransformer::plan, the expert dispatcher, the data-parallel groups and the libraries
// allocate, without a GPU. `moe plan` prints it and the layouts that fit; `moe train`
// refuses a layout that cannot fit before allocating anything. What is counted and the
// assumptions: docs/MEMORY_PLAN.md.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "config/run_config.h"

namespace moe {

// Where and how one rank trains.
struct MemoryLayout {
  int64_t gpus = 1;           // ranks, one per GPU
  int64_t gpus_per_node = 8;
  int64_t expert_parallel = 1;
  int64_t zero = 0;           // parallel.zero over the data-parallel group (experts: their replicas)
  int64_t micro_batch = 1;    // sequences
  int64_t recompute_layers = 0;  // training.recompute_layers (-1: all)
  ExpertRecompute recompute_experts = ExpertRecompute::None;
  int64_t recompute_experts_layers = -1;  // training.recompute_experts_layers (-1: every MoE layer)
  // training.deterministic_attention = ordered in a deterministic run: no dP workspace.
  bool ordered_attention = false;
  bool operator==(const MemoryLayout&) const = default;
};

// The layout `config` asks for over `gpus` GPUs, `gpus_per_node` to a node.
MemoryLayout configured_layout(const RunConfig& config, int64_t gpus, int64_t gpus_per_node);

// How `layout`'s attention backward sums dQ (the run's determinism, the layout's form).
AttentionDq attention_dq_of(const RunConfig& config, const MemoryLayout& layout);

// Bytes on one GPU (the largest rank's share where ranks differ).
struct MemoryEstimate {
  int64_t weights = 0;      // bf16 hi halves of the master weights
  int64_t master_lo = 0;    // their int16 lo halves
  int64_t gradients = 0;    // fp32 (bf16 on the expert tensors: training.expert_grad_dtype)
  int64_t moments = 0;      // AdamW m and v (optimizer.state_dtype)
  int64_t fp32_copies = 0;  // the router biases, read in fp32
  // ZeRO 2-3: the memory the middle stages' gradients (and, at 3, weights) outside the
  // rank's own pieces share, two pools by the stage's parity: what a stage's unreduced
  // gradients and gathered weights live in while in flight.
  int64_t zero_pools = 0;
  // Per layer: what it keeps for its backward (only its input when recomputed), and the
  // one buffer set the recomputed layers share.
  std::vector<int64_t> layer_activations;
  int64_t recompute_set = 0;
  int64_t step_buffers = 0;  // per micro-batch, not per layer: LM head, backward scratch, routing sums
  // One allocation for the LM head's bf16 gradient, the MoE backward's row gradients and
  // cuDNN's attention workspace (never in use at once): the largest of the three.
  int64_t shared_scratch = 0;
  int64_t fp8_weights = 0;   // training.precision = fp8: the MoE layers' quantised expert weights (fp8_weight_cache)
  int64_t exchange = 0;      // the expert-parallel dispatcher's scratch, bf16 gradient buckets
  int64_t workspace = 0;     // cuBLAS, cuDNN attention, grouped GEMMs, NCCL's buffers
  int64_t runtime = 0;       // the CUDA context and the libraries' kernels (once per process)

  int64_t activations() const;  // the layers' and the recompute set
  int64_t total() const;
  // Named components in a fixed order (activations as one), for tables and messages.
  struct Component {
    std::string name;
    int64_t bytes = 0;
  };
  std::vector<Component> components() const;
  Component largest() const;
};

MemoryEstimate estimate_memory(const RunConfig& config, const MemoryLayout& layout);

// The smallest micro-batch `moe train`'s halving on an allocation failure reaches from
// `micro_batch` (it halves while the micro-batch is even).
int64_t smallest_halved_micro_batch(int64_t micro_batch);

struct LayoutFit {
  MemoryLayout layout;
  MemoryEstimate estimate;
};

// The layouts over `gpus` GPUs whose estimate is at most `budget_bytes`: EP dividing
// n_experts and the GPUs, ZeRO 0-3, the micro-batch halved (global batch kept),
// recomputation off, of the experts, of every layer. Best first: the least recomputation,
// then the lowest ZeRO level, the largest micro-batch, the smallest EP, the least memory.
std::vector<LayoutFit> layouts_that_fit(const RunConfig& config, int64_t gpus, int64_t gpus_per_node,
                                        int64_t budget_bytes);

// "parallel.zero = 1, training.micro_batch = 2" : the settings where `to` differs from
// `from` (empty when none).
std::string layout_changes(const MemoryLayout& from, const MemoryLayout& to);

// moe train's check before allocating: a ConfigError (one line) when the layout cannot fit
// in `budget_bytes` even at the smallest micro-batch the halving reaches, naming the
// largest component and a setting that fits (of the fitting layouts, the first with the
// fewest settings changed; on more GPUs, doubling, when none fits on these). `ranks_per_gpu` > 1: thread ranks sharing
// one GPU (their estimates add up, the runtime once).
void check_memory_fits(const RunConfig& config, int64_t gpus, int64_t gpus_per_node, int64_t ranks_per_gpu,
                       int64_t budget_bytes);

// The budget of `moe plan` without --gpu-memory-gb and of the refusal: the GPU's memory
// less a reserve for the allocator's rounding, fragmentation and what the estimate leaves
// out (docs/MEMORY_PLAN.md).
constexpr double kDefaultGpuMemoryGb = 141.0;  // an H200
constexpr double kMemoryReserveGb = 2.0;

}  // namespace moe

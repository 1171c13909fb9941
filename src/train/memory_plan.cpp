#include "train/memory_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <tuple>
#include <utility>

#include "core/error.h"
#include "core/fp8.h"
#include "dist/zero_shards.h"
#include "kernels/adamw_math.h"
#include "model/expert_layout.h"
#include "model/gpu_buffer_sizes.h"
#include "model/gpu_state_layout.h"
#include "model/transformer.h"
#include "moe/expert_slots.h"
#include "train/state_memory.h"

namespace moe {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Library and runtime constants the estimate assumes (docs/MEMORY_PLAN.md says how they
// were chosen). Everything else below is computed from the config.
constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kBlasWorkspace = 32 * kMiB;       // cuda::Blas's default
constexpr int64_t kGroupedGemmWorkspace = 64 * kMiB;  // ExpertGemm's group arrays and workspace (bounded)
constexpr int64_t kCudaRuntime = 1000 * kMiB;       // context, cuBLAS/cuDNN/NCCL kernels, cuDNN plans
constexpr int64_t kNcclPerCommunicator = 256 * kMiB;  // a communicator's ring/tree buffers
constexpr int64_t kNcclPerPeer = 8 * kMiB;          // p2p buffers per all-to-all peer (send + recv)
constexpr int kReduceLanes = 2;                     // GpuDataParallel's bf16 side streams
constexpr int64_t kRmsnormRowsPerBlock = 32;        // rmsnorm backward's partial sums (rmsnorm.cu)

// What the estimate needs of the parameter block, from the config alone.
struct ModelBlocks {
  ParameterBlockLayout layout;  // storage, backward stages, the router biases (state_memory.h)
  int64_t storage = 0;          // elements, alignment padding included (ParameterStore's layout)
  std::vector<RangeList> expert_tensors;  // per MoE layer: w1, w3, w2
};

ModelBlocks model_blocks(const ModelConfig& config) {
  if (config.vocab_size <= 0)
    MOE_CONFIG_ERROR("model.vocab_size = {}: the memory plan needs the vocabulary size (set it; training takes it "
                     "from the tokenizer)",
                     config.vocab_size);
  const ParameterStore<float> specs = Transformer<float>::parameter_specs(config);
  const std::vector<int64_t> offsets = specs.planned_offsets();
  ModelBlocks b;
  b.layout = parameter_block_layout(config, specs);
  b.storage = b.layout.storage;
  std::string last_group;
  for (int id = 0; id < specs.size(); ++id) {
    const ParamSpec& spec = specs.spec(id);
    if (spec.expert_group.empty()) continue;
    if (spec.expert_group != last_group) b.expert_tensors.emplace_back();
    last_group = spec.expert_group;
    b.expert_tensors.back().push_back({offsets[static_cast<size_t>(id)], spec.shape.numel()});
  }
  return b;
}

ExpertLayout equal_layout(const ModelBlocks& blocks, int64_t n_experts, int64_t ep, bool split) {
  ExpertLayout layout;
  for (const RangeList& tensors : blocks.expert_tensors)
    layout.push_back({equal_expert_slots(n_experts, static_cast<int>(ep), split), tensors});
  return layout;
}

// Which ZeRO levels the GPU applies (GpuBackend::make_data_parallel, check_gpu_config),
// one place to adjust as they grow: levels 1-3 over more than one GPU (under expert
// parallelism the shared parameters over all GPUs and the experts over their replicas,
// without split experts or re-placement), 2 and 3 without CUDA graphs and with fp32 sums;
// the layout search offers only those. What a level keeps is state_memory.h's, from the
// GPU's own plans.
bool gpu_applies_zero(int64_t gpus, int64_t zero) { return gpus > 1 && zero >= 1; }
bool gpu_offers_zero(const RunConfig& config, int64_t zero, int64_t ep) {
  if (zero == 0) return true;
  if (ep > 1 && (config.parallel.split_experts || config.parallel.rebalance_interval > 0)) return false;
  return zero == 1 || (!config.training.cuda_graphs && config.parallel.grad_reduce_dtype == ReduceDtype::Fp32);
}

// Mirrors GpuTransformer::plan: the buffers of one layer's activations (gpu_layers.h's
// Activations), dense and/or MoE, without the expert rows buffers the MoE layers share.
struct ActivationShape {
  int64_t B, S, T, D, H, G, d, E, K, F, dense_hidden, n_shared, P;
  ExpertRowBounds rows;
};

int64_t attention_and_norms_bytes(const ActivationShape& a) {
  const int64_t bf = 2, f32 = 4;
  return 3 * a.T * a.D * bf + 2 * a.T * f32                             // n1, h, n2; rstd1, rstd2
         + 2 * a.T * a.H * a.d * bf + 2 * a.T * a.G * a.d * bf + a.B * a.H * a.S * f32;  // q|k|v rows, out; stats
}

int64_t assign_rows_scratch(int64_t T, int64_t K, int64_t E) {  // moe/cuda/dispatch.cu (kTile 256)
  return T * K + E * std::max<int64_t>(1, ceil_div(T * K, 256));
}

// An MoE layer's own buffers; x_rows / gate_up / act rows are counted here unless
// `shared_*` (recompute_experts: one buffer for all MoE layers; act under fp8 weight gradients: none).
int64_t moe_buffers_bytes(const ActivationShape& a, bool share_x, bool share_act, bool share_gate_up) {
  const int64_t T = a.T, K = a.K, E = a.E, D = a.D, F = a.F, RL = a.rows.max_local_rows;
  int64_t bytes = 2 * T * E * 4 + T * K * 4 + 2 * T * 4          // logits, scores; weight; aux, z terms
                  + 3 * T * K * 4 + 2 * E * 4 + (E + 1) * 4        // expert, row, slot; counts; offsets
                  + std::max(T * K, a.rows.max_rows) * 4           // token_of_row (padded rows: R)
                  + assign_rows_scratch(T, K, E) * 4               // rank
                  + std::max(a.rows.max_rows, RL) * D * 2          // y_rows
                  + a.n_shared * (T * 2 * F + T * F) * 2;          // shared experts' gate|up and act
  if (!share_x) bytes += RL * D * 2;
  if (!share_act) bytes += RL * F * 2;
  if (!share_gate_up) bytes += RL * 2 * F * 2;
  if (a.P > 1) {  // GpuExpertParallelDispatcher::plan_layer
    const int64_t U = a.rows.max_tokens;
    bytes += T * a.P * 4 + a.P * 4 + 2 * U * K * 4 + (a.rows.max_local_experts + 1) * 4 + RL * 4;
  }
  return bytes;
}

// GpuTransformer::plan's per micro-batch buffers (not per layer).
int64_t step_buffers_bytes(const ActivationShape& a, int64_t V, int64_t n_layers) {
  const int64_t T = a.T, D = a.D, E = a.E, K = a.K, W = std::max(a.F, a.dense_hidden);
  const int64_t head_rows = lm_head_chunk_rows(T, V);
  int64_t bytes = 3 * T * 4 + 2 * T * D * 2                        // inputs, targets, positions; final_x, final_n
                  + head_rows * V * 4 + 2 * T * 4                    // logits chunk; final_rstd, loss
                  + (1 + 2 * n_layers) * 4 + n_layers * 4 + ceil_div(T, 256) * 8;  // sums, kept_rows, routing scratch
  bytes += 2 * T * D * 2 + 2 * T * a.H * a.d * 2 + 2 * T * a.G * a.d * 2;  // dres, dnorm; dq|dk|dv rows, dattn
  bytes += T * E * 2 + T * W * 2 + T * 2 * W * 2 + T * K * 4 + T * E * 4;     // dlogits bf16, dffn_*, dweight, dlogits
  bytes += ceil_div(T, kRmsnormRowsPerBlock) * D * 4 + 5 * T * 4 + a.S * a.d * 4;  // norm partials, embedding scratch, rope
  return bytes;
}

// GpuExpertParallelDispatcher::plan's scratch.
// GpuExpertParallelDispatcher::plan's scratch: the token rows both ways (and their fp8
// wire form when parallel.a2a_compression may send fp8 rows), the routing, the counts; with
// moe.speculative_dispatch (plan_speculation) the early rows out and in and the corrections
// in, of the wider row format, and their index arrays.
int64_t dispatcher_bytes(const ActivationShape& a, bool split, bool fp8_rows, bool speculative) {
  if (a.P <= 1) return 0;
  const int64_t U = a.rows.max_tokens, K = a.K, E = a.E, P = a.P, L = a.rows.max_local_experts;
  int64_t bytes = 2 * U * a.D * 2 + 2 * U * K * 4 + assign_rows_scratch(U, K, L) * 4 + L * 4 + (E + 2 * P) * 4 +
                  a.T * K * 4 + (P + 1) * 4 + (split ? 2 * P * E * 4 : 0) + P * (L + 1) * 4 + 3 * U * K * 4;
  if (fp8_rows) bytes += 2 * U * fp8_row_bytes(a.D);
  if (speculative) {
    const int64_t row = std::max<int64_t>(2 * a.D, fp8_rows ? fp8_row_bytes(a.D) : 0);
    bytes += 3 * U * row + (2 * a.T * P + 4 * P + 2 * U + 3 * (P + 1)) * 4;
  }
  return bytes;
}

int64_t nccl_bytes(const MemoryLayout& layout) {
  if (layout.gpus <= 1) return 0;
  const int64_t ep = layout.expert_parallel;
  int64_t bytes = kNcclPerCommunicator;  // the world (data parallel)
  if (ep > 1) {
    bytes += kNcclPerCommunicator + (ep - 1) * kNcclPerPeer;        // the EP group's all-to-all
    if (layout.gpus / ep > 1) bytes += kNcclPerCommunicator;        // the experts' replicas
  }
  return bytes;
}

void check_expert_parallel(const RunConfig& config, const MemoryLayout& layout) {
  const int64_t E = config.model.moe.n_experts, ep = std::max<int64_t>(1, layout.expert_parallel);
  if (ep > 1 && (E <= 0 || E % ep != 0 || layout.gpus % ep != 0))
    MOE_CONFIG_ERROR("parallel.expert_parallel = {} must divide moe.n_experts = {} and the {} GPUs", ep, E,
                     layout.gpus);
}

// The parameter state of the largest rank (with split experts the EP ranks' differ; under
// ZeRO rank 0's and the last rank's pieces): a function of the GPUs, EP and the ZeRO level
// only, so the layout search computes it once per pair of those.
StateBytes state_of_elements(const RunConfig& config, const MemoryLayout& layout, const ModelBlocks& blocks,
                             int64_t moment_elem);

// The GPU store's interleaved gate|up pairs (GpuTransformer::State::interleave_gate_up):
// none under expert parallelism or where interleaves_gate_up is off.
std::vector<HiInterleave> store_gate_up_pairs(const RunConfig& config, const ModelBlocks& blocks, int64_t ep) {
  if (ep > 1 || !interleaves_gate_up(config.training)) return {};
  std::vector<std::pair<Range, Range>> w1_w3;
  for (const RangeList& tensors : blocks.expert_tensors) w1_w3.push_back({tensors.at(0), tensors.at(1)});
  return gate_up_pairs(w1_w3, config.model.moe.n_experts);
}

StateBytes state_with(const RunConfig& config, const MemoryLayout& layout, const ModelBlocks& blocks) {
  const MomentDtype moments = config.optimizer.state_dtype;
  // fp8 moments: 1 B a code, and a scale byte per 16 state elements for each moment
  // (GpuParameterStore's two arrays: the whole block's on one GPU, exact; packed under
  // ZeRO, 1 / 16 of the codes' chunk-rounded bytes, within 2 chunks / 16 of the store's).
  const bool fp8 = moments == MomentDtype::Fp8;
  StateBytes state =
      state_of_elements(config, layout, blocks, fp8 ? 1 : static_cast<int64_t>(moment_bytes_per_element(moments)));
  constexpr int64_t kB = adamw_math::kMomentBlock;
  const bool packed = gpu_applies_zero(std::max<int64_t>(1, layout.gpus), layout.zero);
  if (fp8) state.moments += packed ? (state.moments + kB - 1) / kB : 2 * ((blocks.storage + kB - 1) / kB);
  return state;
}

// `moment_elem`: bytes of both moments' storage per element, over two.
StateBytes state_of_elements(const RunConfig& config, const MemoryLayout& layout, const ModelBlocks& blocks,
                             int64_t moment_elem) {
  check_expert_parallel(config, layout);
  const int64_t E = config.model.moe.n_experts, ep = std::max<int64_t>(1, layout.expert_parallel);
  const bool split = ep > 1 && config.parallel.split_experts;
  const int64_t gpus = std::max<int64_t>(1, layout.gpus);
  StateBytes state;
  const int64_t bucket = dist::gradient_bucket_elems(config.parallel.bucket_mb, blocks.storage);
  const int64_t zero = gpu_applies_zero(gpus, layout.zero) ? layout.zero : 0;
  if (ep <= 1) {
    // The GPU store's interleaved gate|up pairs, which ZeRO's plan cuts at expert slices.
    const std::vector<HiInterleave> pairs = store_gate_up_pairs(config, blocks, ep);
    state = data_parallel_state_bytes(blocks.layout, zero, static_cast<int>(gpus), bucket, moment_elem, pairs);
    // bf16 expert gradients (one GPU only: refused over more ranks at launch).
    if (config.training.expert_grad_dtype == GradDtype::Bf16 && gpus == 1) {
      RangeList tensors;
      for (const RangeList& layer : blocks.expert_tensors) tensors.insert(tensors.end(), layer.begin(), layer.end());
      std::sort(tensors.begin(), tensors.end());
      state.gradients = split_gradient_bytes(blocks.layout, tensors);
    }
    return state;
  }
  if (split) {
    // Split experts (never under ZeRO): each EP rank's resident chunks, its window's hinge included.
    const ExpertLayout experts = equal_layout(blocks, E, ep, split);
    for (int p = 0; p < ep; ++p) {
      const StateBytes rank = rank_state_bytes(blocks.layout, resident_ranges(experts, p, blocks.storage), 0, {}, moment_elem);
      if (rank.total() > state.total()) state = rank;
    }
    return state;
  }
  const ExpertLayout experts = equal_layout(blocks, E, ep, false);
  RangeList tensors;
  for (const RangeList& layer : blocks.expert_tensors) tensors.insert(tensors.end(), layer.begin(), layer.end());
  std::sort(tensors.begin(), tensors.end());
  std::vector<RangeList> own;
  for (int p = 0; p < ep; ++p) own.push_back(own_expert_ranges(experts, p));
  state = expert_parallel_state_bytes(blocks.layout, tensors, own, zero, static_cast<int>(gpus), bucket, moment_elem);
  return state;
}

}  // namespace

AttentionDq attention_dq_of(const RunConfig& config, const MemoryLayout& layout) {
  if (!config.training.deterministic) return AttentionDq::Atomic;
  return layout.ordered_attention ? AttentionDq::Ordered : AttentionDq::Workspace;
}

namespace {

// `state`: state_with's for this layout.
MemoryEstimate estimate_with(const RunConfig& config, const MemoryLayout& layout, const ModelBlocks& blocks,
                             const StateBytes& state) {
  check_expert_parallel(config, layout);
  const ModelConfig& c = config.model;
  const int64_t E = c.moe.n_experts, ep = std::max<int64_t>(1, layout.expert_parallel);
  const bool split = ep > 1 && config.parallel.split_experts;
  const int64_t gpus = std::max<int64_t>(1, layout.gpus), replicas = gpus / ep;
  MemoryEstimate m;
  m.weights = state.weights;
  m.master_lo = state.master_lo;
  m.gradients = state.gradients;
  m.moments = state.moments;
  m.zero_pools = state.pools;
  m.fp32_copies = total_count(blocks.layout.fp32_copies) * 4;

  // Activations and the step's buffers, as GpuTransformer::plan allocates them.
  ActivationShape a{layout.micro_batch, c.seq_len, layout.micro_batch * c.seq_len, c.dim, c.n_heads, c.n_kv_heads,
                    c.head_dim(), E, c.moe.top_k, c.moe.expert_hidden, c.dense_hidden, c.moe.n_shared_experts, ep, {}};
  const int64_t cap = ep > 1 && config.parallel.rebalance_interval > 0 ? config.parallel.rebalance_max_experts : 0;
  a.rows = expert_row_bounds(c.moe, a.T, ep, split, cap, ep > 1 ? 1 : expert_row_align(config.training));
  const bool share_x_act = layout.recompute_experts != ExpertRecompute::None;
  const bool share_gate_up = layout.recompute_experts == ExpertRecompute::All;
  // fp8 weight gradients: the backward takes act from gate|up itself; no act buffer at all.
  const bool fp8_wgrad =
      config.training.precision == TrainingPrecision::Fp8 && config.training.fp8_weight_gradients;
  const int64_t dense_bytes = a.T * 2 * c.dense_hidden * 2 + a.T * c.dense_hidden * 2;
  // An MoE layer's buffers with the shared expert rows (recompute_experts), and with its own
  // (the MoE layers past recompute_experts_layers; the layers recomputed whole share one set
  // either way).
  const int64_t moe_bytes = E > 0 ? moe_buffers_bytes(a, share_x_act, share_x_act || fp8_wgrad, share_gate_up) : 0;
  const int64_t moe_own_rows_bytes = E > 0 ? moe_buffers_bytes(a, false, fp8_wgrad, false) : 0;
  const int64_t core_bytes = attention_and_norms_bytes(a), input_bytes = a.T * c.dim * 2;
  // ffn_out [T, D]: dense layers', and MoE layers' unless the next norm sums their rows.
  const int64_t ffn_out_bytes = a.T * c.dim * 2;
  const int64_t moe_ffn_out_bytes = combine_in_next_norm(ep > 1, c.moe.n_shared_experts) ? 0 : ffn_out_bytes;
  const int64_t n_layers = c.n_layers;
  const int64_t recomputed = layout.recompute_layers < 0 ? n_layers : std::min(layout.recompute_layers, n_layers);
  bool recompute_dense = false, recompute_moe = false, rows_shared = false;
  for (int64_t l = 0; l < n_layers; ++l) {
    const bool is_moe = l >= c.first_dense_layers;
    if (l < recomputed) {
      (is_moe ? recompute_moe : recompute_dense) = true;
      rows_shared = rows_shared || (is_moe && share_x_act);
      m.layer_activations.push_back(input_bytes);
    } else {
      const bool shares =
          is_moe && shares_expert_rows(share_x_act, layout.recompute_experts_layers, l - c.first_dense_layers);
      rows_shared = rows_shared || shares;
      m.layer_activations.push_back(input_bytes + core_bytes +
                                    (is_moe ? (shares ? moe_bytes : moe_own_rows_bytes) + moe_ffn_out_bytes
                                            : dense_bytes + ffn_out_bytes));
    }
  }
  if (recompute_dense || recompute_moe)
    m.recompute_set = core_bytes + (recompute_dense ? dense_bytes : 0) + (recompute_moe ? moe_bytes : 0) +
                      (recompute_dense ? ffn_out_bytes : moe_ffn_out_bytes);  // the shared set's ffn_out
  // The expert rows buffers shared by the MoE layers under recompute_experts.
  if (E > 0 && rows_shared) {
    const int64_t RL = a.rows.max_local_rows;
    if (share_x_act) m.recompute_set += RL * c.dim * 2 + (fp8_wgrad ? 0 : RL * a.F * 2);
    if (share_gate_up) m.recompute_set += RL * 2 * a.F * 2;
  }
  m.step_buffers = step_buffers_bytes(a, c.vocab_size, n_layers);
  // dlogits_head, the expert rows' gradients and cuDNN's attention workspace share one
  // allocation: the largest of them (model/gpu_buffer_sizes.h); no d act rows where SwiGLU's
  // backward runs inside the down data gradient (GpuTransformer::State::swiglu_in_gemm).
  const bool swiglu_in_gemm = swiglu_in_gemm_applies(config.training, a.F) &&
                              !store_gate_up_pairs(config, blocks, ep).empty();
  m.shared_scratch = std::max(
      shared_scratch_sizes(a.T, c.vocab_size, c.dim, a.F, std::max(a.rows.max_rows, a.rows.max_local_rows),
                           a.rows.max_local_rows, !swiglu_in_gemm)
          .bytes(),
      attention_workspace_estimate(a.B, a.H, a.S, a.d, attention_dq_of(config, layout),
                                   config.training.attention_query_chunks, c.n_kv_heads));
  // training.precision = fp8: one or two operands' quantised rows (codes and 1x128 scales), shared
  // by the layers; every MoE layer's quantised expert weights (fp8_weight_cache), or else
  // scratch for two of the local experts' weight tensors (codes and 128x128 scales).
  if (E > 0 && config.training.precision == TrainingPrecision::Fp8) {
    const int64_t RL = a.rows.max_local_rows, width = fp8_expert_row_width(c.dim, a.F), L = a.rows.max_local_experts;
    m.step_buffers += RL * width + RL * width / 128 * 4;
    if (config.training.fp8_weight_cache)
      m.fp8_weights = std::max<int64_t>(0, n_layers - c.first_dense_layers) * fp8_expert_weight_sizes(L, c.dim, a.F).bytes();
    else
      m.step_buffers += 2 * L * c.dim * a.F + 2 * L * ceil_div(c.dim, 128) * ceil_div(a.F, 128) * 4;
    if (fp8_wgrad)  // the token columns of the weight gradients' operands
      m.step_buffers += fp8_token_column_sizes(RL, L, c.dim, a.F).bytes();
  }
  // ... and the dense projections' (ProjectionGemms): the rows and the weight of the largest
  // projection GEMM that runs in fp8 (model/gpu_buffer_sizes.h).
  if (config.training.precision == TrainingPrecision::Fp8) m.step_buffers += fp8_projection_scratch(c, a.T).bytes();

  // Exchange buffers: the dispatcher's; bf16 gradient sums' scratch per reduction group.
  m.exchange = dispatcher_bytes(a, split, config.parallel.a2a_compression != A2aCompression::None,
                                config.model.moe.speculative_dispatch);
  if (gpus > 1 && config.parallel.grad_reduce_dtype == ReduceDtype::Bf16) {
    const int64_t bucket = dist::gradient_bucket_elems(config.parallel.bucket_mb, blocks.storage);
    const int64_t groups = ep > 1 && replicas > 1 ? 2 : 1;
    m.exchange += groups * kReduceLanes * (bucket + dist::kZeroAlign * gpus) * 2;
  }

  // Workspaces: cuBLAS, the grouped GEMMs, NCCL (cuDNN's is in the shared scratch).
  m.workspace = kBlasWorkspace + (E > 0 ? kGroupedGemmWorkspace : 0) + nccl_bytes(layout);
  if (E > 0 && config.training.precision == TrainingPrecision::Fp8) {
    m.workspace += kGroupedGemmWorkspace;  // ExpertGemmFp8's
    if (fp8_wgrad) m.workspace += kGroupedGemmWorkspace;  // ExpertWeightGemmFp8's
  }
  m.runtime = kCudaRuntime;
  return m;
}

// Recomputation settings from the least to the most: (layers, experts).
// Layer recompute x expert recompute; (0, None) first (fits_over relies on it).
std::vector<std::pair<int64_t, ExpertRecompute>> recompute_choices(bool expert_parallel) {
  if (expert_parallel) return {{0, ExpertRecompute::None}, {-1, ExpertRecompute::None}};
  return {{0, ExpertRecompute::None},
          {0, ExpertRecompute::Swiglu},
          {0, ExpertRecompute::All},
          {-1, ExpertRecompute::None},
          {-1, ExpertRecompute::All}};
}

int recompute_rank(const MemoryLayout& l) {
  const int layers = l.recompute_layers == 0 ? 0 : 3;
  return layers + static_cast<int>(l.recompute_experts);
}

std::vector<LayoutFit> fits_over(const RunConfig& config, const ModelBlocks& blocks, int64_t gpus,
                                 int64_t gpus_per_node, int64_t budget_bytes) {
  const ModelConfig& c = config.model;
  const int64_t E = c.moe.n_experts, moe_layers = E > 0 ? c.n_layers - c.first_dense_layers : 0;
  std::vector<int64_t> eps;
  for (int64_t ep = 1; ep <= std::max<int64_t>(1, E); ++ep)
    if ((ep == 1 || E % ep == 0) && gpus % ep == 0) eps.push_back(ep);
  std::vector<int64_t> micro_batches;
  for (int64_t mb = config.training.micro_batch;; mb /= 2) {
    if (config.training.global_batch_tokens % (gpus * mb * c.seq_len) == 0) micro_batches.push_back(mb);
    if (mb % 2 != 0) break;
  }
  const bool ordered_attention = configured_layout(config, gpus, gpus_per_node).ordered_attention;
  std::vector<LayoutFit> fits;
  for (int64_t ep : eps)
    for (int64_t zero = 0; zero <= (gpus > 1 ? 3 : 0); ++zero) {
      if (!gpu_offers_zero(config, zero, ep)) continue;
      const StateBytes state = state_with(config, {gpus, gpus_per_node, ep, zero}, blocks);
      for (int64_t mb : micro_batches) {
        // Two passes: the configured attention backward, then (deterministic runs) the other one
        // for the layouts the configured one does not fit and it makes fit with less memory.
        // add_if_fits says whether the layout is covered: added, or (second pass) its
        // configured twin fits already, so that neither pass stops early on the other's fit.
        for (const bool other_form : {false, true}) {
          if (other_form && !config.training.deterministic) break;
          const auto add_if_fits = [&](MemoryLayout layout) {
            MemoryEstimate estimate = estimate_with(config, layout, blocks, state);
            if (!other_form) {
              if (estimate.total() > budget_bytes) return false;
              fits.push_back({layout, std::move(estimate)});
              return true;
            }
            if (estimate.total() <= budget_bytes) return true;
            layout.ordered_attention = !layout.ordered_attention;
            MemoryEstimate other = estimate_with(config, layout, blocks, state);
            if (other.total() > budget_bytes || other.total() >= estimate.total()) return false;
            fits.push_back({layout, std::move(other)});
            return true;
          };
          // recompute_choices lists nothing recomputed first, so this is known before the
          // expert-only choices come.
          bool nothing_recomputed_fits = false;
          for (const auto& [layers, experts] : recompute_choices(ep > 1)) {
            MemoryLayout layout{gpus, gpus_per_node, ep, zero, mb, layers, experts, -1, ordered_attention};
            if (layers != 0 || experts == ExpertRecompute::None) {
              const bool fit = add_if_fits(layout);
              nothing_recomputed_fits = nothing_recomputed_fits || (fit && layers == 0);
              continue;
            }
            // Expert rows recomputed in the first MoE layers only: the fewest that fit, from 2
            // (one layer alone shares its rows with none), else every one; not at all where
            // nothing recomputed fits already.
            if (nothing_recomputed_fits) continue;
            for (int64_t n = 2;; ++n) {
              const bool every = n >= moe_layers;
              layout.recompute_experts_layers = every ? -1 : n;
              if (add_if_fits(layout) || every) break;
            }
          }
        }
      }
    }
  // The other attention backward last: ordered dQ ran 4.6x slower than the dP workspace's
  // (olmoe-mini, H100, cuDNN 9.26: 354 against 76 ms of attention a step), far more than any
  // recomputation costs, so it is a layout's last resort, not a trade for recomputation.
  const auto key = [&](const LayoutFit& f) {
    return std::make_tuple(f.layout.ordered_attention != ordered_attention, recompute_rank(f.layout), f.layout.zero,
                           -f.layout.micro_batch, f.layout.expert_parallel, f.estimate.total());
  };
  std::sort(fits.begin(), fits.end(), [&](const LayoutFit& x, const LayoutFit& y) { return key(x) < key(y); });
  return fits;
}

double gb(int64_t bytes) { return static_cast<double>(bytes) / 1e9; }
std::string gpus_text(int64_t gpus) { return fmt::format("{} GPU{}", gpus, gpus == 1 ? "" : "s"); }

}  // namespace

MemoryLayout configured_layout(const RunConfig& config, int64_t gpus, int64_t gpus_per_node) {
  const TrainingConfig& t = config.training;
  // The MoE layers that recompute matter only when something is recomputed.
  const int64_t experts_layers = t.recompute_experts == ExpertRecompute::None ? -1 : t.recompute_experts_layers;
  return {gpus,
          gpus_per_node,
          config.parallel.expert_parallel,
          config.parallel.zero,
          t.micro_batch,
          t.recompute_layers,
          t.recompute_experts,
          experts_layers,
          attention_dq(t.deterministic, t.deterministic_attention) == AttentionDq::Ordered};
}

int64_t MemoryEstimate::activations() const {
  int64_t sum = recompute_set;
  for (int64_t bytes : layer_activations) sum += bytes;
  return sum;
}

std::vector<MemoryEstimate::Component> MemoryEstimate::components() const {
  return {{"weights (bf16)", weights},
          {"master lo halves (int16)", master_lo},
          {"gradients (fp32)", gradients},
          {"AdamW moments", moments},
          {"fp32 copies (router biases)", fp32_copies},
          {"ZeRO stage pools", zero_pools},
          {"activations", activations()},
          {"step buffers", step_buffers},
          {"shared scratch", shared_scratch},
          {"fp8 expert weights", fp8_weights},
          {"exchange buffers", exchange},
          {"workspace", workspace},
          {"CUDA runtime", runtime}};
}

int64_t MemoryEstimate::total() const {
  int64_t sum = 0;
  for (const Component& component : components()) sum += component.bytes;
  return sum;
}

MemoryEstimate::Component MemoryEstimate::largest() const {
  const std::vector<Component> all = components();
  return *std::max_element(all.begin(), all.end(),
                           [](const Component& a, const Component& b) { return a.bytes < b.bytes; });
}

MemoryEstimate estimate_memory(const RunConfig& config, const MemoryLayout& layout) {
  const ModelBlocks blocks = model_blocks(config.model);
  return estimate_with(config, layout, blocks, state_with(config, layout, blocks));
}

int64_t smallest_halved_micro_batch(int64_t micro_batch) {
  while (micro_batch > 1 && micro_batch % 2 == 0) micro_batch /= 2;
  return micro_batch;
}

std::vector<LayoutFit> layouts_that_fit(const RunConfig& config, int64_t gpus, int64_t gpus_per_node,
                                        int64_t budget_bytes) {
  return fits_over(config, model_blocks(config.model), gpus, gpus_per_node, budget_bytes);
}

namespace {

std::vector<std::string> changed_settings(const MemoryLayout& from, const MemoryLayout& to) {
  std::vector<std::string> changes;
  if (to.gpus != from.gpus) changes.push_back(gpus_text(to.gpus));
  if (to.expert_parallel != from.expert_parallel)
    changes.push_back(fmt::format("parallel.expert_parallel = {}", to.expert_parallel));
  if (to.zero != from.zero) changes.push_back(fmt::format("parallel.zero = {}", to.zero));
  if (to.micro_batch != from.micro_batch) changes.push_back(fmt::format("training.micro_batch = {}", to.micro_batch));
  if (to.recompute_layers != from.recompute_layers)
    changes.push_back(fmt::format("training.recompute_layers = {}", to.recompute_layers));
  if (to.recompute_experts != from.recompute_experts)
    changes.push_back(fmt::format("training.recompute_experts = \"{}\"", name_of(to.recompute_experts)));
  if (to.recompute_experts_layers != from.recompute_experts_layers)
    changes.push_back(fmt::format("training.recompute_experts_layers = {}", to.recompute_experts_layers));
  if (to.ordered_attention != from.ordered_attention)
    changes.push_back(to.ordered_attention ? "training.deterministic_attention = \"ordered\" (cuDNN >= 9.25, Hopper; a slower backward)"
                                           : "training.deterministic_attention = \"workspace\"");
  return changes;
}

// The refusal's suggestion: of the fits (best first), the first with the fewest settings
// changed from `from`, the other attention backward only where nothing with `from`'s fits
// (its cost: fits_over).
const LayoutFit& closest_fit(const std::vector<LayoutFit>& fits, const MemoryLayout& from) {
  const auto key = [&](const LayoutFit& f) {
    return std::make_pair(f.layout.ordered_attention != from.ordered_attention, changed_settings(from, f.layout).size());
  };
  return *std::min_element(fits.begin(), fits.end(),
                           [&](const LayoutFit& a, const LayoutFit& b) { return key(a) < key(b); });
}

}  // namespace

std::string layout_changes(const MemoryLayout& from, const MemoryLayout& to) {
  return fmt::format("{}", fmt::join(changed_settings(from, to), ", "));
}

void check_memory_fits(const RunConfig& config, int64_t gpus, int64_t gpus_per_node, int64_t ranks_per_gpu,
                       int64_t budget_bytes) {
  const ModelBlocks blocks = model_blocks(config.model);
  const int64_t ranks = std::max<int64_t>(1, ranks_per_gpu);
  MemoryLayout layout = configured_layout(config, gpus, gpus_per_node);
  layout.micro_batch = smallest_halved_micro_batch(layout.micro_batch);
  // Thread ranks share the GPU: their estimates add up, the process's runtime counted once.
  const auto on_gpu = [&](const MemoryEstimate& e) { return ranks * (e.total() - e.runtime) + e.runtime; };
  const MemoryEstimate estimate = estimate_with(config, layout, blocks, state_with(config, layout, blocks));
  if (on_gpu(estimate) <= budget_bytes) return;
  const MemoryEstimate::Component largest = estimate.largest();
  const std::string what =
      fmt::format("the estimated {:.1f} GB per GPU{} (training.micro_batch = {}{}) exceeds {:.1f} GB (largest: {} "
                  "{:.1f} GB{})",
                  gb(on_gpu(estimate)), ranks > 1 ? fmt::format(" ({} thread ranks)", ranks) : "", layout.micro_batch,
                  layout.micro_batch != config.training.micro_batch ? ", the smallest the halving reaches" : "",
                  gb(budget_bytes), largest.name, gb(largest.bytes), ranks > 1 ? " per rank" : "");
  // Per-rank budget for the search: ranks * (total - runtime) + runtime <= budget.
  const int64_t rank_budget = (budget_bytes - estimate.runtime) / ranks + estimate.runtime;
  const MemoryLayout configured = configured_layout(config, gpus, gpus_per_node);
  std::vector<LayoutFit> fits = fits_over(config, blocks, gpus, gpus_per_node, rank_budget);
  if (!fits.empty()) {
    const LayoutFit& fit = closest_fit(fits, configured);
    MOE_CONFIG_ERROR("{}; {} over {} fits ({:.1f} GB)", what, layout_changes(configured, fit.layout), gpus_text(gpus),
                     gb(on_gpu(fit.estimate)));
  }
  // None on these GPUs: the fewest GPUs (doubling) on which one fits.
  for (int64_t more = gpus * 2; more <= (int64_t{1} << 16) && ranks == 1; more *= 2) {
    fits = fits_over(config, blocks, more, gpus_per_node, budget_bytes);
    if (fits.empty()) continue;
    MemoryLayout there = configured;
    there.gpus = more;
    const LayoutFit& fit = closest_fit(fits, there);
    const std::string changes = layout_changes(there, fit.layout);
    MOE_CONFIG_ERROR("{}; no layout fits on {}: {}{} fit ({:.1f} GB)", what, gpus_text(gpus), gpus_text(more),
                     changes.empty() ? "" : " with " + changes, gb(fit.estimate.total()));
  }
  MOE_CONFIG_ERROR("{}; no layout of parallel.expert_parallel, parallel.zero, training.micro_batch, recomputation "
                   "and training.deterministic_attention fits",
                   what);
}

}  // namespace moe

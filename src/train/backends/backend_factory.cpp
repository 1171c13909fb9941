#include "train/backends/backend_factory.h"

#include "core/error.h"
#include "dist/communicator.h"
#include "dist/launch_env.h"
#include "dist/zero_shards.h"
#include "train/backends/cpu_backend.h"
#include "train/backends/parallel_cpu_backend.h"
#include "train/memory_plan.h"
#ifdef MOE_HAVE_CUDA
#include "train/backends/cuda/gpu_backend.h"
#endif

namespace moe {
namespace {

bool gpu_visible() {
#ifdef MOE_HAVE_CUDA
  return gpu_present();
#else
  return false;
#endif
}

// Whether training.device asks for the GPU (auto: when one is visible), refusing nothing.
bool asks_for_gpu(TrainingDevice device) {
  return device == TrainingDevice::Cuda || (device == TrainingDevice::Auto && gpu_visible());
}

// What the GPU path does not do is refused up front rather than silently ignored.
// `ranks`: the GPU world's size (1: one GPU).
void check_gpu_config(const RunConfig& config, int ranks) {
  if (config.training.memory_limit_mb > 0)
    MOE_CONFIG_ERROR("training.memory_limit_mb applies to the CPU path; on the GPU the micro-batch is halved when "
                     "an allocation fails");
  if (config.model.moe.route_groups > 32)
    MOE_CONFIG_ERROR("moe.route_groups = {}: the GPU router ranks at most 32 groups (one per lane of a warp)",
                     config.model.moe.route_groups);
  const int64_t zero = config.parallel.zero, ep = config.parallel.expert_parallel;
  // ZeRO-2 and 3 reduce-scatter each backward stage as it ends, on every micro-batch (3 also
  // gathers each stage's weights for its forward and backward).
  if (zero >= 2 && config.training.cuda_graphs)
    MOE_CONFIG_ERROR("parallel.zero = {} on the GPU cannot run inside CUDA graphs: set training.cuda_graphs = false",
                     zero);
  if (zero >= 2 && config.parallel.grad_reduce_dtype == ReduceDtype::Bf16)
    MOE_CONFIG_ERROR("parallel.zero = {} sums the gradients in fp32: set parallel.grad_reduce_dtype = fp32", zero);
  // ZeRO under expert parallelism packs each rank's experts' optimizer state into its
  // pieces, which re-placement (moving whole experts' state between ranks) cannot reach.
  if (zero >= 1 && ep > 1 && config.parallel.split_experts)
    MOE_CONFIG_ERROR("parallel.zero = {} with parallel.expert_parallel = {} on the GPU does not split experts: set "
                     "parallel.split_experts = false or parallel.zero = 0",
                     zero, ep);
  const int64_t per_expert = config.model.dim * config.model.moe.expert_hidden;
  if (zero >= 1 && ep > 1 && per_expert % dist::kZeroAlign != 0)
    MOE_CONFIG_ERROR("parallel.zero = {} with parallel.expert_parallel = {} on the GPU shards experts in pieces of {} "
                     "elements: model.dim x moe.expert_hidden = {} is not a multiple of it",
                     zero, ep, dist::kZeroAlign, per_expert);
  if (zero >= 1 && ep > 1 && config.parallel.rebalance_interval > 0)
    MOE_CONFIG_ERROR("parallel.zero = {} with parallel.expert_parallel = {} on the GPU keeps experts where they are: "
                     "set parallel.rebalance_interval = 0 or parallel.zero = 0",
                     zero, ep);
  if (ep <= 1) return;
  // Over one rank make_backend refuses expert parallelism itself, after these.
  if (ranks > 1 && ranks % ep != 0)
    MOE_CONFIG_ERROR("parallel.expert_parallel = {} must divide the {} ranks of the launch", ep, ranks);
  // Expert parallelism on the GPU waits on the host for each MoE layer's row counts.
  if (config.training.cuda_graphs)
    MOE_CONFIG_ERROR("parallel.expert_parallel = {} on the GPU cannot run inside CUDA graphs: set "
                     "training.cuda_graphs = false",
                     ep);
  if (config.training.recompute_experts != ExpertRecompute::None)
    MOE_CONFIG_ERROR("parallel.expert_parallel = {} on the GPU needs training.recompute_experts = none (got {}); "
                     "training.recompute_layers works",
                     ep, name_of(config.training.recompute_experts));
  if (config.model.moe.n_experts % ep != 0)
    MOE_CONFIG_ERROR("parallel.expert_parallel = {} must divide moe.n_experts = {}", ep, config.model.moe.n_experts);
}

// training.device = auto that resolved to the CPU (device = cpu is refused by the config).
void refuse_fp8_on_cpu(const RunConfig& config) {
  if (config.training.precision == TrainingPrecision::Fp8)
    MOE_CONFIG_ERROR("training.precision = fp8 runs on the GPU only, and training.device = {} resolved to the CPU: "
                     "use --device=cuda or training.precision = bf16",
                     name_of(config.training.device));
  if (config.training.bf16_gemm_backend == GemmBackend::DeepGemm && config.training.precision == TrainingPrecision::Bf16)
    MOE_CONFIG_ERROR("training.bf16_gemm_backend = deepgemm runs on the GPU only, and training.device = {} resolved to "
                     "the CPU: use --device=cuda or training.bf16_gemm_backend = cutlass",
                     name_of(config.training.device));
}

// parallel.backend = nccl (or a world in device memory) trains on the GPU.
void check_gpu_world(const RunConfig& config, int ranks) {
  if (!wants_gpu(config.training))
    MOE_CONFIG_ERROR("parallel.backend = nccl trains on the GPU, but training.device = {} resolves to the CPU: use "
                     "--device=cuda, or parallel.backend = mpi/tcp for CPU ranks",
                     name_of(config.training.device));
  check_gpu_config(config, ranks);
}

#ifdef MOE_HAVE_CUDA
// The memory plan (train/memory_plan.h) before anything is allocated on the GPU: a layout
// that cannot fit even at the smallest micro-batch the halving on an allocation failure
// reaches is refused with one line naming a setting that fits. Which micro-batch fits is
// still the allocation's call (the estimate is not exact; docs/MEMORY_PLAN.md).
void check_gpu_memory(const RunConfig& config, const dist::Communicator* world) {
  const int64_t ranks = world ? world->size() : 1;
  const bool threads = world && world->backend() == "threads";  // thread ranks share this one GPU
  const dist::LaunchEnv env = dist::read_launch_env();
  const int64_t per_node = threads || env.world_size != ranks ? ranks : std::max(1, env.local_size);
  const auto budget = static_cast<int64_t>(gpu_memory_bytes()) - static_cast<int64_t>(kMemoryReserveGb * 1e9);
  check_memory_fits(config, ranks, per_node, threads ? ranks : 1, budget);
}
#endif

std::unique_ptr<ModelBackend> gpu_backend(const RunConfig& config, HostState host,
                                          std::unique_ptr<dist::Communicator> world) {
#ifdef MOE_HAVE_CUDA
  check_gpu_memory(config, world.get());
  return make_gpu_backend(config, std::move(host), std::move(world));
#else
  (void)config, (void)host, (void)world;
  MOE_THROW("no CUDA backend in this build");
#endif
}

}  // namespace

bool wants_gpu(const TrainingConfig& training) {
  if (training.device == TrainingDevice::Cpu) return false;
  if (training.device == TrainingDevice::Auto) return gpu_visible();
#ifndef MOE_HAVE_CUDA
  MOE_CONFIG_ERROR("training.device = cuda, but this build has no CUDA backend (nvcc was not found at build time)");
#endif
  if (!gpu_visible()) MOE_CONFIG_ERROR("training.device = cuda, but no CUDA device is visible");
  return true;
}

void resolve_gemm_backends(RunConfig& config, bool deepgemm_runs) {
  TrainingConfig& t = config.training;
  GemmBackend& backend = t.gemm_backend(t.precision);
  if (backend == GemmBackend::Auto) backend = gemm_backend_for(config, t.precision, deepgemm_runs);
}

void resolve_gemm_backends(RunConfig& config) {
  const TrainingConfig& t = config.training;
  if (t.gemm_backend(t.precision) != GemmBackend::Auto) return;
#ifdef MOE_HAVE_CUDA
  resolve_gemm_backends(config, asks_for_gpu(t.device) && deepgemm_present());
#else
  resolve_gemm_backends(config, false);
#endif
}

CommBackend resolve_comm_backend(const RunConfig& config) {
  if (config.parallel.backend != CommBackend::Auto) return config.parallel.backend;
#ifdef MOE_HAVE_CUDA
  const bool gpu = asks_for_gpu(config.training.device);
#else
  const bool gpu = false;  // device = cuda is refused with its own message (wants_gpu)
#endif
  return gpu && dist::read_launch_env().world_size > 1 ? CommBackend::Nccl : CommBackend::Auto;
}

std::unique_ptr<ModelBackend> make_backend(const RunConfig& config, std::unique_ptr<dist::Communicator> world) {
  MOE_CHECK(world != nullptr, "the trainer needs a world communicator");
  // The host state: the CPU reference trains it, the other backends start from it.
  HostState host;
  host.model = std::make_unique<Transformer<float>>(config.model, config.training.seed);
  host.optimizer = std::make_unique<AdamW>(config.optimizer, host.model->params());
  const ParallelConfig& pc = config.parallel;
  // NCCL (or another device-memory backend, e.g. threads sharing one GPU in tests): data
  // parallel on the GPU, a world of one included.
  const bool device_world = world->device_memory();
  // bf16 expert gradients live in one GPU's second gradient block, which the data-parallel
  // sums (a device world of one included), ZeRO and expert parallelism do not cover
  // (docs/MEMORY_PLAN.md).
  if (config.training.expert_grad_dtype == GradDtype::Bf16 && (world->size() > 1 || world->device_memory()))
    MOE_CONFIG_ERROR("training.expert_grad_dtype = bf16 keeps one GPU's expert gradients outside the data-parallel "
                     "sums: not over {} ranks of parallel.backend = {}; set training.expert_grad_dtype = fp32",
                     world->size(), world->backend());
  if (device_world) check_gpu_world(config, world->size());
  if (world->size() == 1) {
    if (pc.expert_parallel > 1)
      MOE_CONFIG_ERROR("parallel.expert_parallel = {} needs a launch of a multiple of {} ranks (this one has 1)",
                       pc.expert_parallel, pc.expert_parallel);
    if (device_world) return gpu_backend(config, std::move(host), std::move(world));
    if (wants_gpu(config.training)) {
      check_gpu_config(config, 1);
      return gpu_backend(config, std::move(host), nullptr);
    }
    refuse_fp8_on_cpu(config);
    return make_cpu_backend(config, std::move(host));
  }
  const TrainingDevice device = config.training.device;
  if (!device_world && asks_for_gpu(device))
    MOE_CONFIG_ERROR("training.device = {} with parallel.backend = {} ({} ranks): multi-rank GPU training needs "
                     "parallel.backend = nccl (or auto); use --device=cpu for the CPU path",
                     name_of(device), world->backend(), world->size());
  if (device_world) return gpu_backend(config, std::move(host), std::move(world));
  refuse_fp8_on_cpu(config);
  return std::make_unique<ParallelCpuBackend>(config, std::move(host), std::move(world));
}

}  // namespace moe

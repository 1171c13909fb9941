// Causal grouped-query attention through cuDNN's fused SDPA (flash attention), forward
// and backward, built with cudnn-frontend. Graphs are built once per shape and cached.
// Tensors use our [B, S, heads, d] layout directly (cuDNN takes strides), with q, k, v
// and their gradients at any row stride (the fused projection's [T, (H + 2G) d] rows).
// cuDNN itself is loaded at run time (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING), hence
// fe::detail:: calls.
#include <cudnn.h>
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>

#include "core/error.h"
#include "core/gpu.h"
#include "kernels/gpu_ops.h"

// The library handle cudnn-frontend's dynamic-loading shim reads; set by load_cudnn().
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}

namespace moe::cuda {
namespace fe = cudnn_frontend;

namespace {

#define MOE_CUDNN_CHECK(call)                                                           \
  do {                                                                                  \
    cudnnStatus_t moe_status_ = (call);                                                 \
    MOE_CHECK(moe_status_ == CUDNN_STATUS_SUCCESS, "cuDNN: {}", fe::detail::get_error_string(moe_status_)); \
  } while (0)

#define MOE_FE_CHECK(expr)                                                              \
  do {                                                                                  \
    auto moe_fe_status_ = (expr);                                                       \
    MOE_CHECK(moe_fe_status_.is_good(), "cudnn-frontend: {}", moe_fe_status_.get_message()); \
  } while (0)

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV };

// [B, heads, S, d] dims over our [B, S, heads, d] memory.
std::vector<int64_t> bhsd_dims(int64_t B, int64_t heads, int64_t S, int64_t d) { return {B, heads, S, d}; }
// ld: elements from one token's heads to the next token's (heads * d when packed).
std::vector<int64_t> bshd_strides(int64_t ld, int64_t S, int64_t d) { return {S * ld, d, ld, 1}; }

// B, S, H, G, d, scale, and the row strides of q (dq) and of k, v (dk, dv).
using Shape = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t, int64_t>;

// A call's shape, checked: the query heads in groups of the kv heads; row strides given as 0
// become the packed ones, and a token's heads must fit in its row.
Shape checked_shape(int64_t B, int64_t S, int64_t H, int64_t G, int64_t d, float scale, int64_t ld_q, int64_t ld_kv) {
  MOE_CHECK(H % G == 0, "attention: {} query heads do not divide into {} kv heads", H, G);
  if (ld_q == 0) ld_q = H * d;
  if (ld_kv == 0) ld_kv = G * d;
  MOE_CHECK(ld_q >= H * d && ld_kv >= G * d, "attention: row strides {} (q) and {} (k, v) below {} and {} elements",
            ld_q, ld_kv, H * d, G * d);
  return {B, S, H, G, d, scale, ld_q, ld_kv};
}

void load_cudnn() {
  if (fe::cudnn_dlhandle) return;
  for (const char* name : {"libcudnn.so.9", "libcudnn.so"}) {
    fe::cudnn_dlhandle = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
    if (fe::cudnn_dlhandle) return;
  }
  MOE_THROW("cuDNN 9 not found: dlopen(libcudnn.so.9) failed: {}", dlerror());
}

// An engine of cuDNN's and the knob values of one of its configurations.
struct EngineConfig {
  int64_t engine;
  std::unordered_map<fe::KnobType_t, int64_t> knobs;
};

// AttentionDq::Ordered: cuDNN's Hopper attention backward engine with its dQ tiles added in
// a fixed order (STAGES = 4, 64 x 64 tiles), on the regular graph (fp32 dQ accumulation, no
// dP workspace). The configuration cudnn-frontend 1.32 itself pins for a deterministic
// backward whose dP workspace the user caps below its size (CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT;
// node/scaled_dot_product_flash_attention.h, override_heuristics_query), named here
// instead of steered through the process environment.
EngineConfig ordered_dq_engine() {
  return {6,
          {{fe::KnobType_t::TILE_M, 2},
           {fe::KnobType_t::TILE_N, 1},
           {fe::KnobType_t::KERNEL_CFG, 2},
           {fe::KnobType_t::STREAM_K, 0},
           {fe::KnobType_t::TILE_CGA_M, 0},
           {fe::KnobType_t::STAGES, 4}}};
}

// Why the ordered dQ engine cannot run here (it exists from cuDNN 9.25 on, for sm_90
// only), or nothing.
std::optional<std::string> ordered_dq_refusal() {
  load_cudnn();
  const int64_t version = static_cast<int64_t>(fe::detail::get_backend_version());
  int device = 0, major = 0, minor = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (version >= 92500 && major == 9) return std::nullopt;
  return fmt::format(
      "training.deterministic_attention = ordered needs cuDNN >= 9.25 on a Hopper GPU (sm_90); this run has cuDNN "
      "{}.{}.{} on sm_{}{}: use \"workspace\"",
      version / 10000, version / 100 % 100, version % 100, major, minor);
}

}  // namespace

// A built graph and the workspace it runs in.
struct BuiltGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  size_t workspace_bytes = 0;
};

struct Attention::State {
  cudnnHandle_t handle = nullptr;
  std::map<Shape, BuiltGraph> forward_graphs, backward_graphs;
  gpu::DeviceArray<char> workspace;
  void* external = nullptr;  // use_workspace's
  size_t external_bytes = 0;
  AttentionDq dq_order = AttentionDq::Workspace;

  void* workspace_for(const BuiltGraph& built) {
    if (external) {
      MOE_CHECK(built.workspace_bytes <= external_bytes,
                "attention: cuDNN needs {} bytes of workspace, the shared scratch holds {}", built.workspace_bytes,
                external_bytes);
      return external;
    }
    if (built.workspace_bytes > workspace.size()) workspace = gpu::DeviceArray<char>(built.workspace_bytes);
    return workspace.data();
  }

  std::shared_ptr<fe::graph::Graph> new_graph() {
    auto graph = std::make_shared<fe::graph::Graph>();
    graph->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    return graph;
  }

  std::shared_ptr<fe::graph::Tensor_attributes> bshd(fe::graph::Graph& graph, const char* name, Uid uid, int64_t B,
                                                     int64_t heads, int64_t S, int64_t d, int64_t ld) {
    return graph.tensor(fe::graph::Tensor_attributes()
                            .set_name(name)
                            .set_uid(uid)
                            .set_dim(bhsd_dims(B, heads, S, d))
                            .set_stride(bshd_strides(ld, S, d)));
  }

  std::shared_ptr<fe::graph::Tensor_attributes> stats(fe::graph::Graph& graph, int64_t B, int64_t H, int64_t S) {
    return graph.tensor(fe::graph::Tensor_attributes()
                            .set_name("stats")
                            .set_uid(kStats)
                            .set_dim({B, H, S, 1})
                            .set_stride({H * S, S, 1, 1})
                            .set_data_type(fe::DataType_t::FLOAT));
  }

  // pinned: this engine configuration instead of the heuristics' first choice.
  static BuiltGraph build(std::shared_ptr<fe::graph::Graph> graph, cudnnHandle_t handle,
                          const EngineConfig* pinned = nullptr) {
    MOE_FE_CHECK(graph->validate());
    MOE_FE_CHECK(graph->build_operation_graph(handle));
    if (pinned) MOE_FE_CHECK(graph->create_execution_plan(pinned->engine, pinned->knobs));
    else MOE_FE_CHECK(graph->create_execution_plans({fe::HeurMode_t::A}));
    MOE_FE_CHECK(graph->check_support(handle));
    MOE_FE_CHECK(graph->build_plans(handle));
    int64_t bytes = 0;
    MOE_FE_CHECK(graph->get_workspace_size(bytes));
    return {std::move(graph), static_cast<size_t>(bytes)};
  }

  const BuiltGraph& forward_graph(const Shape& shape) {
    auto found = forward_graphs.find(shape);
    if (found != forward_graphs.end()) return found->second;
    const auto [B, S, H, G, d, scale, ld_q, ld_kv] = shape;
    auto graph = new_graph();
    auto q = bshd(*graph, "q", kQ, B, H, S, d, ld_q), k = bshd(*graph, "k", kK, B, G, S, d, ld_kv),
         v = bshd(*graph, "v", kV, B, G, S, d, ld_kv);
    auto options = fe::graph::SDPA_attributes()
                       .set_name("attention")
                       .set_generate_stats(true)
                       .set_causal_mask(true)
                       .set_attn_scale(scale);
    auto [o, lse] = graph->sdpa(q, k, v, options);
    o->set_output(true).set_uid(kO).set_dim(bhsd_dims(B, H, S, d)).set_stride(bshd_strides(H * d, S, d));
    lse->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim({B, H, S, 1}).set_stride(
        {H * S, S, 1, 1});
    return forward_graphs.emplace(shape, build(std::move(graph), handle)).first->second;
  }

  const BuiltGraph& backward_graph(const Shape& shape) {
    auto found = backward_graphs.find(shape);
    if (found != backward_graphs.end()) return found->second;
    const auto [B, S, H, G, d, scale, ld_q, ld_kv] = shape;
    auto graph = new_graph();
    auto q = bshd(*graph, "q", kQ, B, H, S, d, ld_q), k = bshd(*graph, "k", kK, B, G, S, d, ld_kv),
         v = bshd(*graph, "v", kV, B, G, S, d, ld_kv);
    auto o = bshd(*graph, "o", kO, B, H, S, d, H * d), d_o = bshd(*graph, "do", kdO, B, H, S, d, H * d);
    auto lse = stats(*graph, B, H, S);
    auto options = fe::graph::SDPA_backward_attributes()
                       .set_name("attention_backward")
                       .set_causal_mask(true)
                       .set_attn_scale(scale)
                       .set_deterministic_algorithm(dq_order == AttentionDq::Workspace);
    auto [dq, dk, dv] = graph->sdpa_backward(q, k, v, o, d_o, lse, options);
    dq->set_output(true).set_uid(kdQ).set_dim(bhsd_dims(B, H, S, d)).set_stride(bshd_strides(ld_q, S, d));
    dk->set_output(true).set_uid(kdK).set_dim(bhsd_dims(B, G, S, d)).set_stride(bshd_strides(ld_kv, S, d));
    dv->set_output(true).set_uid(kdV).set_dim(bhsd_dims(B, G, S, d)).set_stride(bshd_strides(ld_kv, S, d));
    if (dq_order != AttentionDq::Ordered) return backward_graphs.emplace(shape, build(std::move(graph), handle)).first->second;
    if (const std::optional<std::string> refusal = ordered_dq_refusal()) MOE_THROW("{}", *refusal);
    const EngineConfig ordered = ordered_dq_engine();
    try {
      return backward_graphs.emplace(shape, build(std::move(graph), handle, &ordered)).first->second;
    } catch (const Error& e) {
      // The engine's one configuration does not serve every shape cuDNN's heuristics do.
      MOE_THROW(
          "training.deterministic_attention = ordered: cuDNN's ordered-dQ engine does not take this attention "
          "(batch {}, {} query / {} key-value heads, {} tokens, head dim {}): use \"workspace\" ({})",
          B, H, G, S, d, e.what());
    }
  }
};

Attention::Attention() : state_(new State) {
  load_cudnn();
  MOE_CUDNN_CHECK(fe::detail::create_handle(&state_->handle));
}

bool Attention::ordered_dq_runs() { return !ordered_dq_refusal().has_value(); }

void Attention::set_dq(AttentionDq dq) {
  if (dq == state_->dq_order) return;
  state_->dq_order = dq;
  state_->backward_graphs.clear();  // rebuilt with the other dQ accumulation on next use
}

size_t Attention::workspace_bytes(int64_t B, int64_t S, int64_t H, int64_t G, int64_t d, float scale, int64_t ld_q,
                                  int64_t ld_kv) {
  const Shape shape = checked_shape(B, S, H, G, d, scale, ld_q, ld_kv);
  return std::max(state_->forward_graph(shape).workspace_bytes, state_->backward_graph(shape).workspace_bytes);
}

void Attention::use_workspace(void* workspace, size_t bytes) {
  state_->external = workspace;
  state_->external_bytes = workspace ? bytes : 0;
  if (workspace) state_->workspace = gpu::DeviceArray<char>();  // its own, no longer used
}

Attention::~Attention() {
  if (state_->handle) fe::detail::destroy_handle(state_->handle);
  delete state_;
}

void Attention::forward(bf16* out_BSHd, float* stats_BHS, const bf16* q_BSHd, const bf16* k_BSGd, const bf16* v_BSGd,
                        int64_t B, int64_t S, int64_t H, int64_t G, int64_t d, float scale, Stream stream,
                        int64_t ld_q, int64_t ld_kv) {
  const BuiltGraph& built = state_->forward_graph(checked_shape(B, S, H, G, d, scale, ld_q, ld_kv));
  MOE_CUDNN_CHECK(fe::detail::set_stream(state_->handle, stream));
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<bf16*>(q_BSHd)},
                                             {kK, const_cast<bf16*>(k_BSGd)},
                                             {kV, const_cast<bf16*>(v_BSGd)},
                                             {kO, out_BSHd},
                                             {kStats, stats_BHS}};
  MOE_FE_CHECK(built.graph->execute(state_->handle, pack, state_->workspace_for(built)));
}

void Attention::backward(bf16* dq_BSHd, bf16* dk_BSGd, bf16* dv_BSGd, const bf16* dout_BSHd, const bf16* q_BSHd,
                         const bf16* k_BSGd, const bf16* v_BSGd, const bf16* out_BSHd, const float* stats_BHS,
                         int64_t B, int64_t S, int64_t H, int64_t G, int64_t d, float scale, Stream stream,
                         int64_t ld_q, int64_t ld_kv) {
  const BuiltGraph& built = state_->backward_graph(checked_shape(B, S, H, G, d, scale, ld_q, ld_kv));
  MOE_CUDNN_CHECK(fe::detail::set_stream(state_->handle, stream));
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<bf16*>(q_BSHd)},     {kK, const_cast<bf16*>(k_BSGd)},
                                             {kV, const_cast<bf16*>(v_BSGd)},     {kO, const_cast<bf16*>(out_BSHd)},
                                             {kdO, const_cast<bf16*>(dout_BSHd)}, {kStats, const_cast<float*>(stats_BHS)},
                                             {kdQ, dq_BSHd},                      {kdK, dk_BSGd},
                                             {kdV, dv_BSGd}};
  MOE_FE_CHECK(built.graph->execute(state_->handle, pack, state_->workspace_for(built)));
}

}  // namespace moe::cuda

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
// ld: elements from one token's heads to the next token's (heads * d when packed); S: the
// tokens of a batch's sequence (a view of fewer rows keeps the whole sequence's batch stride).
std::vector<int64_t> bshd_strides(int64_t ld, int64_t S, int64_t d) { return {S * ld, d, ld, 1}; }

constexpr size_t kAlign = 256;
size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Query chunk c of `chunks` over S tokens: rows [first, end) (end is also the keys it sees).
int64_t chunk_start(int64_t S, int64_t chunks, int64_t c) { return S * c / chunks; }

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

// A backward graph: the call's shape, its query rows and key rows (S and S but for a query
// chunk's), and whether dK, dV go to the chunks' scratch (rows of 2 G d: k heads, v heads).
using BackwardKey = std::tuple<Shape, int64_t, int64_t, bool>;

// A built graph and the workspace it runs in.
struct BuiltGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  size_t workspace_bytes = 0;
};

struct Attention::State {
  cudnnHandle_t handle = nullptr;
  std::map<Shape, BuiltGraph> forward_graphs;
  std::map<BackwardKey, BuiltGraph> backward_graphs;
  gpu::DeviceArray<char> workspace;
  void* external = nullptr;  // use_workspace's
  size_t external_bytes = 0;
  AttentionDq dq_order = AttentionDq::Workspace;
  int64_t query_chunks = 1;

  // The workspace of `bytes` (own, grown as needed, or use_workspace's, checked).
  char* workspace_of(size_t bytes) {
    if (external) {
      MOE_CHECK(bytes <= external_bytes, "attention: cuDNN needs {} bytes of workspace, the shared scratch holds {}",
                bytes, external_bytes);
      return static_cast<char*>(external);
    }
    if (bytes > workspace.size()) workspace = gpu::DeviceArray<char>(bytes);
    return workspace.data();
  }
  void* workspace_for(const BuiltGraph& built) { return workspace_of(built.workspace_bytes); }

  // The chunked backward's workspace: the chunks' dK | dV scratch [B, S, 2 G d] bf16 and a
  // chunk's packed stats [B, H, rows] fp32 first, then the largest of their graphs' cuDNN
  // workspaces.
  int64_t chunks_of(const Shape& shape) const { return std::min(query_chunks, std::get<1>(shape)); }
  // Where a chunk's packed stats start (after the dK | dV scratch).
  static size_t chunk_stats_at(const Shape& shape) {
    const auto [B, S, H, G, d, scale, ld_q, ld_kv] = shape;
    return aligned(static_cast<size_t>(B * S * 2 * G * d) * sizeof(bf16));
  }
  size_t chunk_scratch_bytes(const Shape& shape) const {
    const auto [B, S, H, G, d, scale, ld_q, ld_kv] = shape;
    const int64_t chunks = chunks_of(shape), rows = S - chunk_start(S, chunks, chunks - 1);
    return chunks > 1 ? chunk_stats_at(shape) + aligned(static_cast<size_t>(B * H * rows) * sizeof(float)) : 0;
  }
  const BuiltGraph& chunk_graph(const Shape& shape, int64_t c) {
    const int64_t S = std::get<1>(shape), chunks = chunks_of(shape);
    const int64_t first = chunk_start(S, chunks, c), end = chunk_start(S, chunks, c + 1);
    return backward_graph(shape, end - first, end, end < S);
  }
  size_t backward_bytes(const Shape& shape) {
    size_t most = 0;
    for (int64_t c = 0; c < chunks_of(shape); ++c) most = std::max(most, chunk_graph(shape, c).workspace_bytes);
    return chunk_scratch_bytes(shape) + most;
  }

  std::shared_ptr<fe::graph::Graph> new_graph() {
    auto graph = std::make_shared<fe::graph::Graph>();
    graph->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    return graph;
  }

  // rows of a batch's S tokens (all S but for a query chunk's view).
  std::shared_ptr<fe::graph::Tensor_attributes> bshd(fe::graph::Graph& graph, const char* name, Uid uid, int64_t B,
                                                     int64_t heads, int64_t S, int64_t d, int64_t ld,
                                                     int64_t rows) {
    return graph.tensor(fe::graph::Tensor_attributes()
                            .set_name(name)
                            .set_uid(uid)
                            .set_dim(bhsd_dims(B, heads, rows, d))
                            .set_stride(bshd_strides(ld, S, d)));
  }

  // Packed [B, H, rows]: cuDNN < 9.26 takes no other stats layout (a chunk's are copied).
  std::shared_ptr<fe::graph::Tensor_attributes> stats(fe::graph::Graph& graph, int64_t B, int64_t H, int64_t rows) {
    return graph.tensor(fe::graph::Tensor_attributes()
                            .set_name("stats")
                            .set_uid(kStats)
                            .set_dim({B, H, rows, 1})
                            .set_stride({H * rows, rows, 1, 1})
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
    auto q = bshd(*graph, "q", kQ, B, H, S, d, ld_q, S), k = bshd(*graph, "k", kK, B, G, S, d, ld_kv, S),
         v = bshd(*graph, "v", kV, B, G, S, d, ld_kv, S);
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

  // q_rows queries (the last of a batch's S, or a chunk's) against the first kv_rows keys,
  // causal from the bottom right (query i sees keys up to kv_rows - q_rows + i: a chunk's
  // keys end at its last query); dK, dV into the chunks' scratch (rows of 2 G d) or in place.
  const BuiltGraph& backward_graph(const Shape& shape, int64_t q_rows, int64_t kv_rows, bool kv_scratch) {
    const BackwardKey key{shape, q_rows, kv_rows, kv_scratch};
    auto found = backward_graphs.find(key);
    if (found != backward_graphs.end()) return found->second;
    const auto [B, S, H, G, d, scale, ld_q, ld_kv] = shape;
    auto graph = new_graph();
    auto q = bshd(*graph, "q", kQ, B, H, S, d, ld_q, q_rows), k = bshd(*graph, "k", kK, B, G, S, d, ld_kv, kv_rows),
         v = bshd(*graph, "v", kV, B, G, S, d, ld_kv, kv_rows);
    auto o = bshd(*graph, "o", kO, B, H, S, d, H * d, q_rows), d_o = bshd(*graph, "do", kdO, B, H, S, d, H * d, q_rows);
    auto lse = stats(*graph, B, H, q_rows);
    auto options = fe::graph::SDPA_backward_attributes()
                       .set_name("attention_backward")
                       .set_attn_scale(scale)
                       .set_deterministic_algorithm(dq_order == AttentionDq::Workspace);
    // The whole sequence keeps the top-left mask it always had (the same graph, the same bits).
    if (q_rows == kv_rows) options.set_causal_mask(true);
    else options.set_causal_mask_bottom_right(true);
    auto [dq, dk, dv] = graph->sdpa_backward(q, k, v, o, d_o, lse, options);
    const int64_t ld_dkv = kv_scratch ? 2 * G * d : ld_kv;
    dq->set_output(true).set_uid(kdQ).set_dim(bhsd_dims(B, H, q_rows, d)).set_stride(bshd_strides(ld_q, S, d));
    dk->set_output(true).set_uid(kdK).set_dim(bhsd_dims(B, G, kv_rows, d)).set_stride(bshd_strides(ld_dkv, S, d));
    dv->set_output(true).set_uid(kdV).set_dim(bhsd_dims(B, G, kv_rows, d)).set_stride(bshd_strides(ld_dkv, S, d));
    if (dq_order != AttentionDq::Ordered) return backward_graphs.emplace(key, build(std::move(graph), handle)).first->second;
    if (const std::optional<std::string> refusal = ordered_dq_refusal()) MOE_THROW("{}", *refusal);
    const EngineConfig ordered = ordered_dq_engine();
    try {
      return backward_graphs.emplace(key, build(std::move(graph), handle, &ordered)).first->second;
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
  return std::max(state_->forward_graph(shape).workspace_bytes, state_->backward_bytes(shape));
}

void Attention::set_query_chunks(int64_t chunks) {
  MOE_CHECK(chunks >= 1, "attention: {} query chunks (at least 1)", chunks);
  state_->query_chunks = chunks;
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
  const Shape shape = checked_shape(B, S, H, G, d, scale, ld_q, ld_kv);
  MOE_CUDNN_CHECK(fe::detail::set_stream(state_->handle, stream));
  ld_q = std::get<6>(shape);
  ld_kv = std::get<7>(shape);
  const int64_t chunks = state_->chunks_of(shape);
  if (chunks == 1) {
    const BuiltGraph& built = state_->chunk_graph(shape, 0);
    std::unordered_map<int64_t, void*> pack = {
        {kQ, const_cast<bf16*>(q_BSHd)},     {kK, const_cast<bf16*>(k_BSGd)},
        {kV, const_cast<bf16*>(v_BSGd)},     {kO, const_cast<bf16*>(out_BSHd)},
        {kdO, const_cast<bf16*>(dout_BSHd)}, {kStats, const_cast<float*>(stats_BHS)},
        {kdQ, dq_BSHd},                      {kdK, dk_BSGd},
        {kdV, dv_BSGd}};
    MOE_FE_CHECK(built.graph->execute(state_->handle, pack, state_->workspace_for(built)));
    return;
  }
  // Query chunks, the last first: it writes dK, dV in place (every key row), each earlier
  // chunk its own into the scratch, added after it in this fixed order (docs/DETERMINISM.md).
  const size_t scratch_bytes = state_->chunk_scratch_bytes(shape);
  char* workspace = state_->workspace_of(state_->backward_bytes(shape));
  bf16* dk_scratch = reinterpret_cast<bf16*>(workspace);
  bf16* dv_scratch = dk_scratch + G * d;
  float* chunk_stats = reinterpret_cast<float*>(workspace + State::chunk_stats_at(shape));
  for (int64_t c = chunks - 1; c >= 0; --c) {
    const int64_t first = chunk_start(S, chunks, c), end = chunk_start(S, chunks, c + 1);
    const BuiltGraph& built = state_->chunk_graph(shape, c);
    const bool in_place = end == S;
    const int64_t rows = end - first;
    MOE_CUDA_CHECK(cudaMemcpy2DAsync(chunk_stats, rows * sizeof(float), stats_BHS + first, S * sizeof(float),
                                     rows * sizeof(float), B * H, cudaMemcpyDeviceToDevice, stream));
    std::unordered_map<int64_t, void*> pack = {
        {kQ, const_cast<bf16*>(q_BSHd + first * ld_q)},
        {kK, const_cast<bf16*>(k_BSGd)},
        {kV, const_cast<bf16*>(v_BSGd)},
        {kO, const_cast<bf16*>(out_BSHd + first * H * d)},
        {kdO, const_cast<bf16*>(dout_BSHd + first * H * d)},
        {kStats, chunk_stats},
        {kdQ, dq_BSHd + first * ld_q},
        {kdK, in_place ? dk_BSGd : dk_scratch},
        {kdV, in_place ? dv_BSGd : dv_scratch}};
    MOE_FE_CHECK(built.graph->execute(state_->handle, pack, workspace + scratch_bytes));
    if (in_place) continue;
    add_batched_rows(dk_BSGd, ld_kv, dk_scratch, 2 * G * d, B, S, end, G * d, stream);
    add_batched_rows(dv_BSGd, ld_kv, dv_scratch, 2 * G * d, B, S, end, G * d, stream);
  }
}

}  // namespace moe::cuda

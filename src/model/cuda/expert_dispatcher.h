// How an MoE layer's routed tokens reach the experts that compute them, and come back:
// dispatch (this rank's kept assignments -> expert input rows, laid out by local slot),
// combine (the experts' output rows -> each token's weighted sum) and their backwards,
// behind one interface as in Megatron's token dispatchers. The local dispatcher is a
// permutation (every expert here); the expert-parallel one sends each token once to every
// EP rank computing one of its experts and sums the partial combines that come back
// (docs/EXPERT_PARALLEL.md). Each owns its scratch; what a layer keeps for its backward
// stays in the layer's MoEBuffers. The grouped GEMMs between dispatch and combine are
// the model's (gpu_moe.cpp).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "model/cuda/gpu_layers.h"
#include "model/cuda/gpu_transformer.h"
#include "moe/speculative_exchange.h"

namespace moe::gpu_model {

// What GpuTransformer::plan sizes the dispatch for.
struct DispatchShape {
  int64_t tokens = 0, dim = 0, top_k = 0, n_experts = 0;
  int64_t max_rows = 0;  // rows of this rank's row layout (T * K, or fewer under a capacity)
  int64_t capacity = 0;  // per expert and source rank (0: dropless)
  int64_t max_local_experts = 0;  // slots a rank computes at most
  bool split_experts = false;
  bool speculative = false;  // moe.speculative_dispatch: room for the early rows
  // > 1 (the local dispatcher only): each expert's rows start at a multiple of it
  // (fp8_padded_rows), and the rows' codes are one group of max_rows rows.
  int64_t row_align = 1;
};

// One MoE layer's forward dispatches since the last DispatchStats take (expert
// parallelism; zeros otherwise).
struct DispatchStats {
  SpeculationRows speculation;  // this rank's rows received early and used, wasted, and corrected
  // GPU time on the model's stream from the router's end to the expert rows in place:
  // what the exchange (and the host's read of its counts) adds to the critical path.
  double wait_s = 0;
};

class ExpertDispatcher {
 public:
  virtual ~ExpertDispatcher() = default;
  // Allocates the scratch for `shape` (every plan()); returns the most rows a rank's
  // experts may get (what the expert row buffers hold).
  virtual int64_t plan(const DispatchShape& shape) = 0;
  // Allocates what one layer keeps from its forward for its backward (MoEBuffers' token
  // blocks and received routing; nothing for the local dispatcher).
  virtual void plan_layer(MoEBuffers& m) const = 0;
  // Forward: m.x_rows <- the rows this rank's experts compute, by local slot, from x_TD
  // and the layer's row layout (m.row, m.counts, m.offsets, m.token_of_row by slot;
  // slot_TK the routed slots, m.weight the combine weights).
  virtual void dispatch(const Layer& layer, MoEBuffers& m, const bf16* x_TD, const int32_t* slot_TK) = 0;
  // After dispatch: the row offsets per local slot the grouped GEMMs read (device), and
  // the rows the row-wise kernels cover.
  virtual const int32_t* expert_offsets(const MoEBuffers& m) const = 0;
  virtual int64_t expert_rows(const MoEBuffers& m) const = 0;
  // out_TD <- each token's weighted sum of its experts' m.y_rows.
  virtual void combine(MoEBuffers& m, bf16* out_TD) = 0;
  // The same sum as rows a later kernel adds where it reads them (the next RMSNorm:
  // cuda::ResidualBranch), or none (expert parallelism: the rows come home by exchange).
  virtual cuda::ResidualBranch combine_rows(const MoEBuffers& /*m*/) const { return {}; }
  // Backward of combine: dy_rows (by local row) and dweight_TK (this rank's tokens) from
  // the output gradient; the expert-parallel one leaves the weights' gradients with the
  // experts' ranks until dispatch_backward brings them home.
  virtual void combine_backward(MoEBuffers& m, const bf16* dout_TD, bf16* dy_rows, float* dweight_TK) = 0;
  // training.precision = fp8: dispatch and combine_backward that also write the expert
  // rows' e4m3 codes [R, D] and 1 x 128 scales (cuda::RowCodes over expert_offsets and
  // expert_rows, `experts` local experts) for the experts' GEMMs, sparing them a pass over
  // the rows. False, with nothing done, where this dispatcher cannot (expert parallelism:
  // the rows arrive by exchange): the caller then runs the plain one and quantises.
  virtual bool dispatch_fp8(const Layer& /*layer*/, MoEBuffers& /*m*/, const bf16* /*x_TD*/,
                            const int32_t* /*slot_TK*/, uint8_t* /*codes_RD*/, float* /*scales*/,
                            int64_t /*experts*/) {
    return false;
  }
  virtual bool combine_backward_fp8(MoEBuffers& /*m*/, const bf16* /*dout_TD*/, bf16* /*dy_rows*/,
                                    float* /*dweight_TK*/, uint8_t* /*codes_RD*/, float* /*scales*/,
                                    int64_t /*experts*/) {
    return false;
  }
  // Backward of dispatch: dx_TD (overwritten) from the expert input rows' gradients, and
  // the combine weights' gradients home into dweight_TK.
  virtual void dispatch_backward(MoEBuffers& m, const bf16* dx_rows, bf16* dx_TD, float* dweight_TK) = 0;

  // moe.speculative_dispatch (docs/ROUTING_CACHE.md), expert parallelism only.
  // keep_routed_experts(true): the next dispatch also brings the layer's top-k experts
  // [T, K] to the host with its one synchronisation (routed_experts_host() after it).
  virtual void keep_routed_experts(bool on) { (void)on; }
  virtual const int32_t* routed_experts_host() const { return nullptr; }
  // The guessed slots pred_slot_TQ (host, [T, Q]) of the next MoE layer `next`: arms its
  // dispatch (the early blocks' sizes start out now). input_ready() right after that
  // layer's input is written (before its router); its dispatch() sends the guessed rows
  // first, on a side stream beside the router, and only the misses after the plan.
  virtual void speculate(const Layer& next, const int32_t* pred_slot_TQ, int64_t Q) {
    (void)next, (void)pred_slot_TQ, (void)Q;
  }
  virtual void input_ready() {}
  // Per MoE layer (moe_layers of them) since the last call; resets.
  virtual std::vector<DispatchStats> take_stats(int moe_layers) {
    return std::vector<DispatchStats>(static_cast<size_t>(moe_layers));
  }
};

// `mark` charges the work enqueued after it to a phase (model/cuda/gpu_phases.h).
std::unique_ptr<ExpertDispatcher> make_local_dispatcher(cudaStream_t stream, std::function<void(int)> mark);
std::unique_ptr<ExpertDispatcher> make_expert_parallel_dispatcher(std::shared_ptr<GpuExpertExchange> exchange,
                                                                  cudaStream_t stream, std::function<void(int)> mark);

}  // namespace moe::gpu_model

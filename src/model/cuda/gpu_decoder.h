// Decoding on the GPU (`moe generate` where there is one): the CPU decoder's path
// (Transformer::forward_cached) in fp32 kernels (decode_kernels.h) over a device copy of
// the model's fp32 weights and a device KV cache. Routing, a few numbers per token, is
// decided on the host with the CPU's own router (same choices, same tie rules); the
// experts then run on the device. Logits match the CPU decoder's to fp32 rounding
// (tests/gpu/test_gpu_decoder.cpp). docs/GENERATION.md.
#pragma once
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/decoder.h"

namespace moe {

class GpuDecoder final : public Decoder {
 public:
  // Uploads the weights; `model` must outlive the decoder (its config and balancing biases).
  explicit GpuDecoder(const Transformer<float>& model);
  ~GpuDecoder() override;
  int64_t context() const override;
  int64_t length() const override;
  int64_t vocab_size() const override;
  void reset() override;
  std::span<const float> forward_step(std::span<const int32_t> tokens) override;
  std::string device() const override;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace moe

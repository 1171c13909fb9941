// The GPU decoder against the CPU decoder (the reference): the same logits, to fp32
// rounding, after a prefill and after each single-token step, for a model with every
// path (a dense first layer, GQA, shared experts, a router bias and a balancing bias);
// the cache resets; greedy generation writes the same tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "gpu_test_util.h"
#include "model/cuda/gpu_decoder.h"
#include "model/generator.h"
#include "small_models.h"

namespace moe {
namespace {

double max_relative_error(std::span<const float> got, std::span<const float> want) {
  double scale = 0, err = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, static_cast<double>(std::fabs(want[i])));
    err = std::max(err, static_cast<double>(std::fabs(got[i] - want[i])));
  }
  return err / scale;
}

void set_biases(Transformer<float>& model) {
  auto& params = model.params();
  // Non-zero biases, so that both are read on both paths.
  for (int id = 0; id < params.size(); ++id)
    if (params.spec(id).name.ends_with("router.bias"))
      for (int64_t e = 0; e < params.numel(id); ++e) params.value(id)[e] = 0.05f * static_cast<float>(e % 3);
  for (MoELayer<float>* layer : model.moe_layers())
    for (size_t e = 0; e < layer->balance_bias_E().size(); ++e) layer->balance_bias_E()[e] = 0.01f * static_cast<float>(e % 4);
}

TEST(GpuDecoder, LogitsMatchTheCpuDecoderStepByStep) {
  MOE_REQUIRE_GPU();
  ModelConfig c = test::small_moe_model(0.0);
  c.moe.bias_balancing = true;
  Transformer<float> model(c, 11);
  set_biases(model);
  CpuDecoder cpu(model);
  GpuDecoder gpu(model);
  EXPECT_EQ(gpu.context(), cpu.context());
  EXPECT_NE(gpu.device().find("GPU"), std::string::npos) << gpu.device();
  std::vector<int32_t> prompt(20);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 37 + 5) % c.vocab_size);
  for (int round = 0; round < 2; ++round) {  // the second after reset(): a cache that starts over
    SCOPED_TRACE(round);
    const std::span<const float> want_prefill = cpu.forward_step(prompt);
    const std::vector<float> cpu_prefill(want_prefill.begin(), want_prefill.end());
    const std::span<const float> got = gpu.forward_step(prompt);
    EXPECT_LE(max_relative_error(got, cpu_prefill), 1e-4);
    for (int step = 0; step < 8; ++step) {
      const int32_t next = static_cast<int32_t>((step * 101 + 7) % c.vocab_size);
      const std::span<const float> w = cpu.forward_step(std::span<const int32_t>(&next, 1));
      const std::vector<float> cpu_step(w.begin(), w.end());
      EXPECT_LE(max_relative_error(gpu.forward_step(std::span<const int32_t>(&next, 1)), cpu_step), 1e-4) << step;
    }
    EXPECT_EQ(gpu.length(), cpu.length());
    cpu.reset();
    gpu.reset();
  }
}

TEST(GpuDecoder, GreedyGenerationWritesTheCpuTokensAcrossSlides) {
  MOE_REQUIRE_GPU();
  ModelConfig c = test::small_moe_model(0.0);
  c.tie_embeddings = true;
  Transformer<float> model(c, 11);
  set_biases(model);
  CpuDecoder cpu(model);
  GpuDecoder gpu(model);
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6};
  GenerateOptions options;
  options.max_tokens = 100;  // past the 64-position context: the window slides
  options.sampling.temperature = 0;
  const GenerateResult want = generate(cpu, prompt, options);
  const GenerateResult got = generate(gpu, prompt, options);
  EXPECT_GT(want.slides, 0);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.slides, want.slides);
}

}  // namespace
}  // namespace moe

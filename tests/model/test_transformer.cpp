// Whole-model tests: gradients of (cross-entropy + aux + z) against fp64 central
// differences for tiny configs covering dense and MoE blocks, dropping by capacity,
// an expert that receives no tokens, shared experts, tied and untied heads.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "gradcheck.h"
#include "model/transformer.h"

namespace moe {
namespace {

ModelConfig tiny_config() {
  ModelConfig config;
  config.vocab_size = 11;
  config.dim = 8;
  config.n_layers = 2;
  config.n_heads = 2;
  config.n_kv_heads = 1;
  config.seq_len = 5;
  config.dense_hidden = 12;
  config.moe.n_experts = 4;
  config.moe.top_k = 2;
  config.moe.expert_hidden = 6;
  config.moe.aux_loss_coef = 0.05;
  config.moe.z_loss_coef = 0.01;
  config.moe.temperature = 0.5;
  return config;
}

struct Batch {
  std::vector<int32_t> inputs, targets;
};

Batch random_batch(const ModelConfig& config, int64_t batch, uint64_t seed) {
  Batch b;
  CounterRng rng(seed, "batch");
  for (int64_t i = 0; i < batch * config.seq_len; ++i) {
    b.inputs.push_back(static_cast<int32_t>(rng.bits(static_cast<uint64_t>(i))[0] % config.vocab_size));
    b.targets.push_back(static_cast<int32_t>(rng.bits(static_cast<uint64_t>(i))[1] % config.vocab_size));
  }
  b.targets[3] = -1;  // an ignored position
  return b;
}

// Runs backward once, then compares every parameter's gradient with central differences.
void check_model_gradients(Transformer<double>& model, const Batch& batch, double tol = 1e-6) {
  auto& params = model.params();
  params.zero_grads();
  model.forward(batch.inputs.data(), batch.targets.data());
  model.backward(1.0);
  for (int id = 0; id < params.size(); ++id) {
    const int64_t n = params.numel(id);
    std::vector<double> values(params.value(id), params.value(id) + n);
    std::vector<double> analytic(params.grad(id), params.grad(id) + n);
    auto loss = [&]() {
      std::copy(values.begin(), values.end(), params.value(id));
      return model.forward(batch.inputs.data(), batch.targets.data()).total();
    };
    test::expect_gradient_close(params.spec(id).name, values, analytic, loss, tol, /*step=*/1e-6);
    std::copy(values.begin(), values.end(), params.value(id));
  }
}

TEST(TransformerGrad, DenseFirstLayerCapacityDropsSharedExpertUntied) {
  ModelConfig config = tiny_config();
  config.first_dense_layers = 1;
  config.n_layers = 3;
  config.moe.n_shared_experts = 1;
  config.moe.capacity_factor = 0.5;  // 10 tokens x 2 slots, capacity 3 per expert: drops
  config.moe.renormalize = true;
  Transformer<double> model(config, 7);
  model.plan(2);
  // Expert 3 of layer 1 is never chosen: its gradient must be exactly zero.
  auto& params = model.params();
  params.value(params.find("layers.1.moe.router.bias"))[3] = -50.0;
  const Batch batch = random_batch(config, 2, 1);
  ForwardResult fwd = model.forward(batch.inputs.data(), batch.targets.data());
  EXPECT_GT(fwd.dropped, 0);
  EXPECT_GT(fwd.aux_loss, 0);
  EXPECT_GT(fwd.z_loss, 0);
  EXPECT_EQ(model.moe_layers()[0]->load_E()[3], 0);
  check_model_gradients(model, batch);
  const int w1 = params.find("layers.1.moe.experts.w1");
  const int64_t per_expert = params.numel(w1) / 4;
  for (int64_t i = 0; i < per_expert; ++i) EXPECT_EQ(params.grad(w1)[3 * per_expert + i], 0.0);
}

TEST(TransformerGrad, SigmoidNoRenormTiedDropless) {
  ModelConfig config = tiny_config();
  config.tie_embeddings = true;
  config.moe.score_func = ScoreFunc::Sigmoid;
  config.moe.renormalize = false;
  config.moe.capacity_factor = 0.0;
  config.moe.bias_balancing = true;
  Transformer<double> model(config, 11);
  model.plan(2);
  EXPECT_EQ(model.params().find("lm_head"), -1);
  // A non-zero selection bias changes which experts are chosen but carries no gradient.
  for (auto* layer : model.moe_layers()) layer->balance_bias_E() = {0.3f, -0.2f, 0.1f, 0.0f};
  const Batch batch = random_batch(config, 2, 2);
  EXPECT_EQ(model.forward(batch.inputs.data(), batch.targets.data()).dropped, 0);
  check_model_gradients(model, batch);
}

// moe.temperature_control: each MoE layer routes with its own temperature. The gradients
// hold with two different ones (0.5 and 2.0, z-loss and aux loss included), and a model
// whose layers all hold 0.5 computes exactly what moe.temperature = 0.5 computes.
TEST(TransformerGrad, PerLayerTemperatures) {
  ModelConfig config = tiny_config();
  config.n_layers = 3;
  config.moe.temperature_control = true;
  config.moe.temperature = 1.0;
  Transformer<double> model(config, 13);
  model.plan(2);
  const auto layers = model.moe_layers();
  ASSERT_EQ(layers.size(), 3u);
  for (auto* layer : layers) EXPECT_EQ(layer->temperature(), 1.0);
  const Batch batch = random_batch(config, 2, 3);
  auto total = [&](Transformer<double>& m) { return m.forward(batch.inputs.data(), batch.targets.data()).total(); };
  for (auto* layer : layers) layer->temperature_state()[0] = 0.5f;
  ModelConfig fixed = tiny_config();
  fixed.n_layers = 3;
  fixed.moe.temperature = 0.5;
  Transformer<double> reference(fixed, 13);
  reference.plan(2);
  EXPECT_EQ(total(model), total(reference));
  // One layer's own value changes the loss: the layers do read their own temperature.
  layers[1]->temperature_state()[0] = 2.0f;
  EXPECT_NE(total(model), total(reference));
  check_model_gradients(model, batch);
}

TEST(TransformerGrad, FloatMatchesDouble) {
  ModelConfig config = tiny_config();
  config.moe.capacity_factor = 1.0;
  Transformer<double> model64(config, 3);
  Transformer<float> model32(config, 3);
  model64.plan(2);
  model32.plan(2);
  const Batch batch = random_batch(config, 2, 3);
  const double loss64 = model64.forward(batch.inputs.data(), batch.targets.data()).total();
  const double loss32 = model32.forward(batch.inputs.data(), batch.targets.data()).total();
  EXPECT_NEAR(loss32, loss64, 1e-5 * std::abs(loss64));
  model64.backward(1.0);
  model32.backward(1.0);
  for (int id = 0; id < model64.params().size(); ++id) {
    double max_abs = 0, max_err = 0;
    for (int64_t i = 0; i < model64.params().numel(id); ++i) {
      const double g64 = model64.params().grad(id)[i], g32 = model32.params().grad(id)[i];
      max_abs = std::max(max_abs, std::abs(g64));
      max_err = std::max(max_err, std::abs(g64 - g32));
    }
    EXPECT_LE(max_err, 1e-4 * std::max(max_abs, 1e-3)) << model64.params().spec(id).name;
  }
}

TEST(TransformerInit, NamedKeyedAndScaled) {
  ModelConfig config = tiny_config();
  config.dim = 64;
  config.moe.expert_hidden = 128;
  Transformer<float> a(config, 5), b(config, 5), c(config, 6);
  auto& pa = a.params();
  for (int id = 0; id < pa.size(); ++id)
    for (int64_t i = 0; i < pa.numel(id); ++i)
      ASSERT_EQ(pa.value(id)[i], b.params().value(id)[i]) << pa.spec(id).name;
  EXPECT_NE(pa.value(0)[0], c.params().value(0)[0]);
  auto stddev = [&](const std::string& name) {
    const int id = pa.find(name);
    EXPECT_GE(id, 0) << name;
    double sq = 0;
    for (int64_t i = 0; i < pa.numel(id); ++i) sq += static_cast<double>(pa.value(id)[i]) * pa.value(id)[i];
    return std::sqrt(sq / static_cast<double>(pa.numel(id)));
  };
  EXPECT_NEAR(stddev("layers.0.attn.wq"), 0.02, 0.002);
  EXPECT_NEAR(stddev("layers.0.attn.wo"), 0.02 / std::sqrt(4.0), 0.001);  // 1/sqrt(2 * layers)
  EXPECT_NEAR(stddev("layers.1.moe.experts.w1"), std::sqrt(2.0 / 64), 0.005);   // Kaiming, fan-in D
  EXPECT_NEAR(stddev("layers.1.moe.experts.w2"), std::sqrt(2.0 / 128), 0.005);  // fan-in F
  EXPECT_EQ(stddev("layers.1.moe.router.bias"), 0.0);
  EXPECT_EQ(stddev("final_norm"), 1.0);
  // Norms and biases are excluded from weight decay.
  EXPECT_FALSE(pa.spec(pa.find("final_norm")).weight_decay);
  EXPECT_FALSE(pa.spec(pa.find("layers.0.moe.router.bias")).weight_decay);
  EXPECT_TRUE(pa.spec(pa.find("layers.0.moe.experts.w3")).weight_decay);
}

}  // namespace
}  // namespace moe

// Incremental decoding against the training model's own forward: the logits after each
// token of a cached decode (a prompt prefilled at once, in chunks, then token by token)
// equal the last-position logits of a full forward over the same tokens; MoE layers route
// dropless whatever the capacity factor; past the context the window slides with
// positions restarting at 0.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/rng.h"
#include "model/decoder.h"
#include "model/generator.h"
#include "model/transformer.h"

namespace moe {
namespace {

// Dense first block, GQA, shared expert, non-zero router and balancing biases: every
// path of the decode.
ModelConfig decode_config() {
  ModelConfig config;
  config.vocab_size = 23;
  config.dim = 16;
  config.n_layers = 3;
  config.n_heads = 4;
  config.n_kv_heads = 2;
  config.seq_len = 12;
  config.first_dense_layers = 1;
  config.dense_hidden = 24;
  config.init_std = 0.3;  // logits of order 1, so that a relative tolerance means something
  config.moe.n_experts = 4;
  config.moe.top_k = 2;
  config.moe.expert_hidden = 12;
  config.moe.n_shared_experts = 1;
  config.moe.capacity_factor = 0.0;
  config.moe.bias_balancing = true;
  return config;
}

template <typename T>
void perturb_biases(Transformer<T>& model) {
  auto& params = model.params();
  for (MoELayer<T>* layer : model.moe_layers()) {
    T* bias = params.value(params.find(layer->prefix() + ".router.bias"));
    for (int64_t e = 0; e < layer->n_experts(); ++e) bias[e] = static_cast<T>(0.1 * static_cast<double>(e) - 0.15);
    layer->balance_bias_E() = {0.05f, -0.02f, 0.0f, 0.01f};
  }
}

std::vector<int32_t> random_tokens(int64_t count, int64_t vocab, uint64_t seed) {
  CounterRng rng(seed, "tokens");
  std::vector<int32_t> tokens;
  for (int64_t i = 0; i < count; ++i) tokens.push_back(static_cast<int32_t>(rng.bits(static_cast<uint64_t>(i))[0] % vocab));
  return tokens;
}

// The full forward's logits at position n - 1 for tokens[0..n) (the rest of the sequence
// padded; causal attention keeps it out of position n - 1).
template <typename T>
std::vector<T> reference_logits(Transformer<T>& model, const std::vector<int32_t>& tokens, int64_t n) {
  const ModelConfig& config = model.config();
  std::vector<int32_t> inputs(static_cast<size_t>(config.seq_len), 0), targets(inputs.size(), -1);
  std::copy(tokens.begin(), tokens.begin() + n, inputs.begin());
  model.forward(inputs.data(), targets.data());
  const T* row = model.logits_TV() + (n - 1) * config.vocab_size;
  return std::vector<T>(row, row + config.vocab_size);
}

// |decoded - reference| <= rel * max |reference| over the vocabulary.
template <typename T>
void expect_logits_near(const T* decoded, const std::vector<T>& reference, double rel, int64_t n) {
  double scale = 0;
  for (T v : reference) scale = std::max(scale, std::abs(static_cast<double>(v)));
  ASSERT_GT(scale, 0.1);
  for (size_t v = 0; v < reference.size(); ++v)
    ASSERT_NEAR(static_cast<double>(decoded[v]), static_cast<double>(reference[v]), rel * scale)
        << "token " << v << " after " << n << " tokens";
}

// Prefill of 5 tokens, then chunks of 1 and 3, then single tokens to the full context.
template <typename T>
void check_decode_matches_forward(double rel) {
  const ModelConfig config = decode_config();
  Transformer<T> model(config, 5);
  perturb_biases(model);
  model.plan(1);
  const std::vector<int32_t> tokens = random_tokens(config.seq_len, config.vocab_size, 3);
  KvCache<T> cache(config, config.seq_len);
  std::vector<T> logits(static_cast<size_t>(config.vocab_size));
  int64_t done = 0;
  for (int64_t chunk : {5, 1, 3, 1, 1, 1}) {
    model.forward_cached(tokens.data() + done, chunk, cache, logits.data());
    done += chunk;
    EXPECT_EQ(cache.length(), done);
    expect_logits_near(logits.data(), reference_logits(model, tokens, done), rel, done);
  }
  EXPECT_EQ(done, config.seq_len);
}

TEST(KvCacheDecode, MatchesTheFullForwardInDouble) { check_decode_matches_forward<double>(1e-12); }

TEST(KvCacheDecode, MatchesTheFullForwardInFloat) { check_decode_matches_forward<float>(1e-5); }

// A model that drops by capacity in training decodes as the same weights without capacity,
// and decoding changes none of the training forward's state (routing load).
TEST(KvCacheDecode, RoutesDroplessWhateverTheCapacityFactor) {
  ModelConfig config = decode_config();
  config.moe.capacity_factor = 0.3;
  Transformer<double> capped(config, 9);
  config.moe.capacity_factor = 0.0;
  Transformer<double> dropless(config, 9);  // the same weights: they depend on seed and name only
  capped.plan(1);
  dropless.plan(1);
  const std::vector<int32_t> tokens = random_tokens(config.seq_len, config.vocab_size, 4);
  std::vector<int32_t> targets(tokens.size(), 1);
  EXPECT_GT(capped.forward(tokens.data(), targets.data()).dropped, 0);  // training does drop here
  const std::vector<int64_t> load_before = capped.moe_layers()[0]->load_E();
  KvCache<double> cache(config, config.seq_len);
  std::vector<double> logits(static_cast<size_t>(config.vocab_size));
  capped.forward_cached(tokens.data(), config.seq_len, cache, logits.data());
  expect_logits_near(logits.data(), reference_logits(dropless, tokens, config.seq_len), 1e-12, config.seq_len);
  EXPECT_EQ(capped.moe_layers()[0]->load_E(), load_before);
}

TEST(KvCacheDecode, RefusesTokensPastTheCacheAndOutsideTheVocabulary) {
  const ModelConfig config = decode_config();
  Transformer<float> model(config, 1);
  KvCache<float> cache(config, 4);
  std::vector<float> logits(static_cast<size_t>(config.vocab_size));
  const std::vector<int32_t> five(5, 1), bad = {static_cast<int32_t>(config.vocab_size)};
  EXPECT_THROW(model.forward_cached(five.data(), 5, cache, logits.data()), Error);
  EXPECT_THROW(model.forward_cached(bad.data(), 1, cache, logits.data()), Error);
  EXPECT_EQ(cache.length(), 0);
  EXPECT_THROW(KvCache<float>(config, config.seq_len + 1), Error);
}

// Greedy generation through the CPU decoder: each token is the argmax of a full forward
// over the window the decoder holds. Past the 12-token context the window restarts at
// position 0 with the newest 6 tokens and grows again.
TEST(KvCacheDecode, GreedyGenerationFollowsTheFullForwardAcrossWindowSlides) {
  const ModelConfig config = decode_config();
  Transformer<float> model(config, 21);
  perturb_biases(model);
  model.plan(1);
  CpuDecoder decoder(model);
  const std::vector<int32_t> prompt = random_tokens(7, config.vocab_size, 8);
  GenerateOptions options;
  options.max_tokens = 30;
  options.sampling.temperature = 0;
  std::vector<int32_t> streamed;
  const GenerateResult result = generate(decoder, prompt, options, [&](int32_t t) { streamed.push_back(t); });
  ASSERT_EQ(result.tokens.size(), 30u);
  EXPECT_EQ(streamed, result.tokens);
  EXPECT_FALSE(result.stopped_at_eos);
  // Windows: history[0..12) fills the cache after token 5; then [7..13) .. [7..19), etc.
  EXPECT_EQ(result.slides, 4);
  std::vector<int32_t> history = prompt;
  size_t window_start = 0;
  for (size_t i = 0; i < result.tokens.size(); ++i) {
    const size_t end = history.size();  // the window is history[window_start, end)
    const std::vector<int32_t> window(history.begin() + static_cast<std::ptrdiff_t>(window_start), history.end());
    const std::vector<float> reference = reference_logits(model, window, static_cast<int64_t>(window.size()));
    const auto argmax = std::max_element(reference.begin(), reference.end()) - reference.begin();
    ASSERT_EQ(result.tokens[i], argmax) << "token " << i << ", window [" << window_start << ", " << end << ")";
    history.push_back(result.tokens[i]);
    if (history.size() - window_start > static_cast<size_t>(config.seq_len)) window_start = history.size() - 6;
  }
}

// Sampling is a pure function of the seed: the same seed gives the same tokens, another
// seed other tokens; the end-of-text token stops generation without being emitted.
TEST(KvCacheDecode, SeededSamplingRepeatsAndStopsAtEos) {
  const ModelConfig config = decode_config();
  Transformer<float> model(config, 2);
  CpuDecoder decoder(model);
  const std::vector<int32_t> prompt = {1, 2, 3};
  GenerateOptions options;
  options.max_tokens = 25;
  options.sampling = SamplingOptions{1.5, 0, 1.0};
  options.seed = 42;
  const GenerateResult first = generate(decoder, prompt, options);
  const GenerateResult again = generate(decoder, prompt, options);
  EXPECT_EQ(first.tokens, again.tokens);
  options.seed = 43;
  EXPECT_NE(generate(decoder, prompt, options).tokens, first.tokens);
  options.seed = 42;
  options.eos = first.tokens[4];
  const auto at = std::find(first.tokens.begin(), first.tokens.end(), *options.eos) - first.tokens.begin();
  const GenerateResult stopped = generate(decoder, prompt, options);
  EXPECT_TRUE(stopped.stopped_at_eos);
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>(first.tokens.begin(), first.tokens.begin() + at));
}

}  // namespace
}  // namespace moe

#include "model/transformer.h"

#include <cmath>

#include "kernels/cross_entropy.h"
#include "kernels/embedding.h"
#include "kernels/matmul.h"
#include "kernels/rmsnorm.h"

namespace moe {
namespace {

// The residual connection: out += branch.
template <typename T>
void add_inplace(T* out, const T* branch, int64_t count) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) out[i] += branch[i];
}

}  // namespace

template <typename T>
Transformer<T>::Transformer(const ModelConfig& config, uint64_t seed) : Transformer(config, seed, true) {}

template <typename T>
ParameterStore<T> Transformer<T>::parameter_specs(const ModelConfig& config) {
  const Transformer unallocated(config, 0, false);
  return unallocated.params_;
}

template <typename T>
Transformer<T>::Transformer(const ModelConfig& config, uint64_t seed, bool allocate) : config_(config) {
  MOE_CHECK(config.vocab_size > 0, "model.vocab_size must be set (got {})", config.vocab_size);
  const int64_t D = config.dim;
  embedding_ = params_.add({"embedding", Shape{config.vocab_size, D}, Init::Normal, config.init_std});
  const double residual_std = config.init_std / std::sqrt(2.0 * static_cast<double>(config.n_layers));
  blocks_.resize(static_cast<size_t>(config.n_layers));
  for (int64_t l = 0; l < config.n_layers; ++l) {
    Block& block = blocks_[static_cast<size_t>(l)];
    const std::string prefix = "layers." + std::to_string(l);
    block.norm1 = params_.add({prefix + ".attn_norm", Shape{D}, Init::Ones, 0, /*decay=*/false});
    block.attention = std::make_unique<AttentionLayer<T>>(params_, config, prefix + ".attn");
    block.norm2 = params_.add({prefix + ".ffn_norm", Shape{D}, Init::Ones, 0, /*decay=*/false});
    if (l < config.first_dense_layers)
      block.dense = std::make_unique<FeedForward<T>>(
          params_, prefix + ".ffn", D, config.dense_hidden,
          FeedForwardInit{Init::Normal, config.init_std, residual_std});
    else
      block.moe = std::make_unique<MoELayer<T>>(params_, config, prefix + ".moe");
  }
  final_norm_ = params_.add({"final_norm", Shape{D}, Init::Ones, 0, /*decay=*/false});
  head_ = config.tie_embeddings
              ? embedding_
              : params_.add({"lm_head", Shape{config.vocab_size, D}, Init::Normal, config.init_std});
  if (allocate) params_.allocate(seed);
}

template <typename T>
void Transformer<T>::plan_into(Arena& saved, Arena& scratch, int64_t batch) {
  const int64_t S = config_.seq_len, D = config_.dim, V = config_.vocab_size;
  const int64_t T_ = batch * S;
  positions_T_ = saved.alloc_array<int32_t>(T_);
  for (auto& block : blocks_) {
    block.x_TD = saved.alloc_array<T>(T_ * D);
    block.n1_TD = saved.alloc_array<T>(T_ * D);
    block.rstd1_T = saved.alloc_array<T>(T_);
    block.h_TD = saved.alloc_array<T>(T_ * D);
    block.n2_TD = saved.alloc_array<T>(T_ * D);
    block.rstd2_T = saved.alloc_array<T>(T_);
  }
  final_x_TD_ = saved.alloc_array<T>(T_ * D);
  final_n_TD_ = saved.alloc_array<T>(T_ * D);
  final_rstd_T_ = saved.alloc_array<T>(T_);
  logits_TV_ = saved.alloc_array<T>(T_ * V);
  lse_T_ = saved.alloc_array<T>(T_);
  // The residual gradients live through the whole backward; layers' scratch stacks above.
  dres_TD_ = scratch.alloc_array<T>(T_ * D);
  dnorm_TD_ = scratch.alloc_array<T>(T_ * D);
  for (auto& block : blocks_) {
    block.attention->plan(saved, scratch, batch);
    if (block.moe) block.moe->plan(saved, scratch, T_);
    else block.dense->plan(saved, scratch, T_);
  }
}

template <typename T>
void Transformer<T>::plan(int64_t batch) {
  MOE_CHECK(batch > 0, "micro-batch must be positive, got {}", batch);
  Arena measure_saved = Arena::measuring("activations"), measure_scratch = Arena::measuring("scratch");
  plan_into(measure_saved, measure_scratch, batch);
  saved_.emplace("activations", measure_saved.high_water());
  scratch_.emplace("scratch", measure_scratch.high_water());
  plan_into(*saved_, *scratch_, batch);
  batch_ = batch;
  tokens_ = batch * config_.seq_len;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0; s < config_.seq_len; ++s)
      positions_T_[b * config_.seq_len + s] = static_cast<int32_t>(s);
}

template <typename T>
size_t Transformer<T>::planned_bytes(int64_t batch) {
  MOE_CHECK(batch > 0, "micro-batch must be positive, got {}", batch);
  Arena measure_saved = Arena::measuring("activations"), measure_scratch = Arena::measuring("scratch");
  plan_into(measure_saved, measure_scratch, batch);
  // Measuring hands out null views: plan the current batch again to take real views back.
  if (batch_ > 0) plan(batch_);
  return measure_saved.high_water() + measure_scratch.high_water();
}

template <typename T>
ForwardResult Transformer<T>::forward(const int32_t* inputs_BS, const int32_t* targets_BS) {
  MOE_CHECK(batch_ > 0, "forward before plan()");
  inputs_ = inputs_BS;
  targets_ = targets_BS;
  const int64_t D = config_.dim, V = config_.vocab_size, T_ = tokens_;
  const double eps = config_.norm_eps;
  ForwardResult result;
  const int L = static_cast<int>(blocks_.size());
  auto needed = [&](int stage) {
    if (on_parameters_needed) on_parameters_needed(stage, false);
  };
  auto done = [&](int stage) {
    if (on_parameters_done) on_parameters_done(stage, false);
  };
  T* x_TD = blocks_.empty() ? final_x_TD_ : blocks_[0].x_TD;
  needed(L + 1);
  embedding_forward<T>(x_TD, inputs_BS, params_.value(embedding_), T_, V, D);
  done(L + 1);
  for (size_t l = 0; l < blocks_.size(); ++l) {
    Block& block = blocks_[l];
    needed(L - static_cast<int>(l));
    T* next_x_TD = l + 1 < blocks_.size() ? blocks_[l + 1].x_TD : final_x_TD_;
    rmsnorm_forward<T>(block.n1_TD, block.rstd1_T, block.x_TD, params_.value(block.norm1), T_, D, eps);
    block.attention->forward(block.h_TD, block.n1_TD, positions_T_);
    add_inplace(block.h_TD, block.x_TD, T_ * D);
    rmsnorm_forward<T>(block.n2_TD, block.rstd2_T, block.h_TD, params_.value(block.norm2), T_, D, eps);
    if (block.moe) {
      MoEForwardStats stats = block.moe->forward(next_x_TD, block.n2_TD);
      // moe.speculative_dispatch: the next MoE layer guesses its experts from these.
      for (size_t n = l + 1; n < blocks_.size(); ++n)
        if (blocks_[n].moe) {
          blocks_[n].moe->speculate(inputs_BS, block.moe->experts_TK());
          break;
        }
      result.aux_loss += stats.aux_loss;
      result.z_loss += stats.z_loss;
      result.dropped += stats.dropped;
    } else {
      block.dense->forward(next_x_TD, block.n2_TD, /*accumulate=*/false);
    }
    add_inplace(next_x_TD, block.h_TD, T_ * D);
    done(L - static_cast<int>(l));
  }
  needed(0);
  rmsnorm_forward<T>(final_n_TD_, final_rstd_T_, final_x_TD_, params_.value(final_norm_), T_, D, eps);
  linear_forward<T>(logits_TV_, final_n_TD_, params_.value(head_), nullptr, T_, D, V);
  result.ce_loss = cross_entropy_forward<T>(lse_T_, logits_TV_, targets_BS, T_, V);
  done(0);
  return result;
}

template <typename T>
void Transformer<T>::forward_cached(const int32_t* tokens_n, int64_t n, KvCache<T>& cache, T* logits_V) const {
  MOE_CHECK(n > 0 && cache.length() + n <= cache.capacity(), "decoding {} tokens after {} of a {}-position cache", n,
            cache.length(), cache.capacity());
  const int64_t D = config_.dim, V = config_.vocab_size, start = cache.length();
  const double eps = config_.norm_eps;
  for (int64_t i = 0; i < n; ++i)
    MOE_CHECK(tokens_n[i] >= 0 && tokens_n[i] < V, "token id {} outside the vocabulary of {}", tokens_n[i], V);
  std::vector<T> x_nD(static_cast<size_t>(n * D)), h_nD(x_nD.size()), normed_nD(x_nD.size()),
      rstd_n(static_cast<size_t>(n));
  embedding_forward<T>(x_nD.data(), tokens_n, params_.value(embedding_), n, V, D);
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const Block& block = blocks_[l];
    const auto layer = static_cast<int64_t>(l);
    rmsnorm_forward<T>(normed_nD.data(), rstd_n.data(), x_nD.data(), params_.value(block.norm1), n, D, eps);
    block.attention->forward_cached(h_nD.data(), normed_nD.data(), n, start, cache.keys(layer), cache.values(layer));
    add_inplace(h_nD.data(), x_nD.data(), n * D);
    rmsnorm_forward<T>(normed_nD.data(), rstd_n.data(), h_nD.data(), params_.value(block.norm2), n, D, eps);
    if (block.moe) block.moe->forward_dropless(x_nD.data(), normed_nD.data(), n);
    else block.dense->forward_inference(x_nD.data(), normed_nD.data(), n, /*accumulate=*/false);
    add_inplace(x_nD.data(), h_nD.data(), n * D);
  }
  cache.advance(n);
  // Only the last token's logits are needed.
  const T* last_D = x_nD.data() + (n - 1) * D;
  rmsnorm_forward<T>(normed_nD.data(), rstd_n.data(), last_D, params_.value(final_norm_), 1, D, eps);
  linear_forward<T>(logits_V, normed_nD.data(), params_.value(head_), nullptr, 1, D, V);
}

template <typename T>
void Transformer<T>::backward(double ce_scale, double router_scale) {
  MOE_CHECK(inputs_ != nullptr, "backward without a forward");
  const int64_t D = config_.dim, V = config_.vocab_size, T_ = tokens_;
  const int L = static_cast<int>(blocks_.size());
  auto needed = [&](int stage) {
    if (on_parameters_needed) on_parameters_needed(stage, true);
  };
  auto stage_done = [&](int stage) {
    if (on_parameters_done) on_parameters_done(stage, true);
    if (on_backward_stage) on_backward_stage(stage);
  };
  needed(0);
  // The logits buffer becomes their gradient (in place).
  cross_entropy_backward<T>(logits_TV_, logits_TV_, lse_T_, targets_, T_, V, ce_scale);
  linear_backward<T>(dnorm_TD_, params_.grad(head_), nullptr, logits_TV_, final_n_TD_,
                     params_.value(head_), T_, D, V);
  rmsnorm_backward<T>(dres_TD_, params_.grad(final_norm_), dnorm_TD_, final_x_TD_,
                      params_.value(final_norm_), final_rstd_T_, T_, D, /*accumulate_dx=*/false);
  stage_done(0);
  for (size_t l = blocks_.size(); l-- > 0;) {
    Block& block = blocks_[l];
    needed(L - static_cast<int>(l));
    // dres holds d(block output); the FFN branch adds its path into it, giving d h.
    if (block.moe) block.moe->backward(dnorm_TD_, dres_TD_, block.n2_TD, router_scale);
    else block.dense->backward(dnorm_TD_, dres_TD_, block.n2_TD, /*accumulate_dx=*/false);
    rmsnorm_backward<T>(dres_TD_, params_.grad(block.norm2), dnorm_TD_, block.h_TD,
                        params_.value(block.norm2), block.rstd2_T, T_, D, /*accumulate_dx=*/true);
    block.attention->backward(dnorm_TD_, dres_TD_, block.n1_TD, positions_T_);
    rmsnorm_backward<T>(dres_TD_, params_.grad(block.norm1), dnorm_TD_, block.x_TD,
                        params_.value(block.norm1), block.rstd1_T, T_, D, /*accumulate_dx=*/true);
    stage_done(static_cast<int>(blocks_.size() - l));
  }
  needed(L + 1);
  embedding_backward<T>(params_.grad(embedding_), inputs_, dres_TD_, T_, V, D);
  inputs_ = nullptr;
  stage_done(backward_stages() - 1);
}

template <typename T>
int Transformer<T>::backward_stage_of(const ModelConfig& config, const std::string& name) {
  const int L = static_cast<int>(config.n_layers);
  if (name == "embedding") return L + 1;
  if (name.starts_with("layers.")) {
    const int layer = std::stoi(name.substr(7));
    MOE_CHECK(layer >= 0 && layer < L, "parameter {} names a layer outside [0, {})", name, L);
    return L - layer;
  }
  return 0;  // lm_head, final_norm
}

template <typename T>
void Transformer<T>::set_moe_parallel(MoEBatchGroup* batch, const std::vector<ExpertExchange*>& exchanges,
                                      const std::vector<const ExpertSlots*>& slots) {
  auto layers = moe_layers();
  MOE_CHECK(exchanges.empty() || (exchanges.size() == layers.size() && slots.size() == layers.size()),
            "{} expert exchanges and {} slot tables for {} MoE layers", exchanges.size(), slots.size(), layers.size());
  for (size_t i = 0; i < layers.size(); ++i)
    layers[i]->set_parallel(batch, exchanges.empty() ? nullptr : exchanges[i], exchanges.empty() ? nullptr : slots[i]);
}

template <typename T>
std::vector<const MoELayer<T>*> Transformer<T>::moe_layers() const {
  std::vector<const MoELayer<T>*> layers;
  for (const auto& block : blocks_)
    if (block.moe) layers.push_back(block.moe.get());
  return layers;
}

template <typename T>
std::vector<MoELayer<T>*> Transformer<T>::moe_layers() {
  std::vector<MoELayer<T>*> layers;
  for (auto& block : blocks_)
    if (block.moe) layers.push_back(block.moe.get());
  return layers;
}

template <typename T>
size_t Transformer<T>::activation_bytes() const {
  return (saved_ ? saved_->capacity() : 0) + (scratch_ ? scratch_->capacity() : 0);
}

template class Transformer<float>;
template class Transformer<double>;

}  // namespace moe

#include "dist/a2a_compression.h"

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/error.h"

namespace moe::dist {

A2aCompressionSwitch::A2aCompressionSwitch(A2aCompression mode, int layers, double threshold)
    : mode_(mode), threshold_(threshold), fp8_(static_cast<size_t>(layers), mode == A2aCompression::Fp8 ? 1 : 0) {
  MOE_CHECK(layers >= 0 && threshold >= 0, "a2a compression: {} layers, threshold {}", layers, threshold);
}

int A2aCompressionSwitch::compressed_layers() const {
  int n = 0;
  for (char on : fp8_) n += on;
  return n;
}

bool A2aCompressionSwitch::update(double wait_fraction, const std::vector<double>& layer_wait_s) {
  if (mode_ != A2aCompression::Auto || fp8_.empty()) return false;
  MOE_CHECK(layer_wait_s.size() == fp8_.size(), "a2a compression: waits of {} layers for {}", layer_wait_s.size(),
            fp8_.size());
  above_ = wait_fraction > threshold_ ? above_ + 1 : 0;
  below_ = wait_fraction < threshold_ / 2 ? below_ + 1 : 0;
  // The layer to switch: the longest wait among the uncompressed (on), the shortest among
  // the compressed (off); ties to the lowest index.
  auto pick = [&](bool compressed, bool longest) {
    int best = -1;
    for (int l = 0; l < layers(); ++l) {
      if (fp8(l) != compressed) continue;
      const double w = layer_wait_s[static_cast<size_t>(l)];
      if (best < 0 || (longest ? w > layer_wait_s[static_cast<size_t>(best)] : w < layer_wait_s[static_cast<size_t>(best)]))
        best = l;
    }
    return best;
  };
  int layer = -1;
  bool on = false;
  if (above_ >= kPatience) {
    layer = pick(false, true);
    on = true;
  } else if (below_ >= kPatience) {
    layer = pick(true, false);
  }
  if (layer < 0) return false;
  fp8_[static_cast<size_t>(layer)] = on ? 1 : 0;
  above_ = below_ = 0;
  return true;
}

bool A2aCompressionSwitch::observe(double wait_fraction, const std::vector<double>& layer_wait_s,
                                   const std::function<void(std::vector<double>&)>& max_over_ranks, bool log) {
  if (mode_ != A2aCompression::Auto || fp8_.empty()) return false;
  std::vector<double> values{wait_fraction};
  values.insert(values.end(), layer_wait_s.begin(), layer_wait_s.end());
  if (max_over_ranks) max_over_ranks(values);
  if (!update(values[0], std::vector<double>(values.begin() + 1, values.end()))) return false;
  if (log)
    spdlog::info("a2a compression (auto): comm wait {:.1f}% of the step, {} of {} MoE layers now send fp8",
                 values[0] * 100, compressed_layers(), layers());
  return true;
}

std::string A2aCompressionSwitch::save() const {
  nlohmann::json state;
  state["fp8"] = std::vector<int>(fp8_.begin(), fp8_.end());
  state["above"] = above_;
  state["below"] = below_;
  return state.dump();
}

bool A2aCompressionSwitch::restore(const std::string& text) {
  if (mode_ != A2aCompression::Auto) return true;  // fixed modes carry no state
  const nlohmann::json state = nlohmann::json::parse(text, nullptr, false);
  if (state.is_discarded() || !state.is_object()) return false;
  const auto flags = state.value("fp8", std::vector<int>{});
  if (flags.size() != fp8_.size()) return false;
  for (size_t l = 0; l < flags.size(); ++l) fp8_[l] = flags[l] != 0 ? 1 : 0;
  above_ = state.value("above", 0);
  below_ = state.value("below", 0);
  return true;
}

}  // namespace moe::dist

// The [optimizer] and [lr] sections: AdamW and the warmup + cosine schedule
// (docs/CONFIG.md describes every key).
#pragma once
#include <array>
#include <cstdint>

#include "config/enum_names.h"

namespace moe {

// Storage of the AdamW moments m and v: fp32, or bf16 rounded to nearest even on write.
enum class MomentDtype { Fp32, Bf16 };
inline constexpr std::array<EnumName<MomentDtype>, 2> kMomentDtypeNames{
    {{MomentDtype::Fp32, "fp32"}, {MomentDtype::Bf16, "bf16"}}};
constexpr std::span<const EnumName<MomentDtype>> enum_names(MomentDtype) { return kMomentDtypeNames; }

struct OptimizerConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;          // decoupled; never applied to norms and biases
  MomentDtype state_dtype = MomentDtype::Fp32;
};

struct LrConfig {
  double peak = 3e-3;
  int64_t warmup_steps = 30;          // linear from peak/warmup to peak
  double min_ratio = 0.1;             // cosine decays to peak*min_ratio at the last step
};

}  // namespace moe

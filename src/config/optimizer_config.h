// The [optimizer] and [lr] sections: AdamW and the warmup + cosine schedule
// (docs/CONFIG.md describes every key).
#pragma once
#include <array>
#include <cstdint>

#include "config/enum_names.h"

namespace moe {

// Storage of the AdamW moments m and v: fp32, bf16 rounded to nearest even on write, or fp8
// e4m3 codes with a power-of-two scale per 16 elements (kernels/adamw_math.h).
enum class MomentDtype { Fp32, Bf16, Fp8 };
inline constexpr std::array<EnumName<MomentDtype>, 3> kMomentDtypeNames{
    {{MomentDtype::Fp32, "fp32"}, {MomentDtype::Bf16, "bf16"}, {MomentDtype::Fp8, "fp8"}}};
constexpr std::span<const EnumName<MomentDtype>> enum_names(MomentDtype) { return kMomentDtypeNames; }
// Bytes a moment takes per element: 4, 2, or fp8's code plus its block's scale byte / 16.
constexpr double moment_bytes_per_element(MomentDtype d) {
  return d == MomentDtype::Fp32 ? 4.0 : d == MomentDtype::Bf16 ? 2.0 : 1.0 + 1.0 / 16;
}

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

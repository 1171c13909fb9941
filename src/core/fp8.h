// fp8 e4m3 (OCP FP8, "E4M3FN": bias 7, no infinities, 0x7F/0xFF NaN, largest finite 448)
// on the host: the CPU reference of the GPU's __nv_cvt_float_to_fp8(x, __NV_SATFINITE,
// __NV_E4M3) (cvt.rn.satfinite.e4m3x2.f32: round to nearest even, magnitudes past 448 and
// infinities saturate to +-448, NaN becomes 0x7F), and the row format of the expert
// exchange's compression (parallel.a2a_compression; docs/EXPERT_PARALLEL.md section 10):
// a row of D values travels as [fp32 scale | D e4m3 codes | zero padding to 4 bytes],
// scale = amax / 448 (a row of zeros: scale 0, codes 0), code = e4m3(x / scale), value =
// decode(code) * scale. tests/gpu/test_gpu_fp8.cpp checks the GPU against this bit for bit.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace moe {

inline constexpr float kFp8E4m3Max = 448.0f;

namespace fp8 {
// The fp8 GEMMs' scale block: activations per 1 x 128 tile, weights per 128 x 128 block
// (kernels/fp8_blockwise.h), and the row padding per expert of DeepGEMM's grouped layout.
inline constexpr int64_t kBlock = 128;
}  // namespace fp8

inline uint8_t float_to_fp8_e4m3(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return 0x7f;                 // NaN
  if (mag >= 0x43e00000u) return sign | 0x7e;         // >= 448 (and inf): saturate
  if (mag < 0x3c800000u) {                            // below 2^-6: subnormals, steps of 2^-9
    float a;
    std::memcpy(&a, &mag, sizeof a);
    const float q = std::nearbyint(a * 512.0f);       // exact scaling; ties to even (default mode)
    return sign | static_cast<uint8_t>(q);            // q = 8 is 2^-6, the first normal's code
  }
  // Normal: exponent field e - 127 + 7, the top 3 mantissa bits, the other 20 rounded to
  // nearest even (a carry steps into the exponent; past 448 cannot happen below 0x43e00000).
  uint32_t code = (((mag >> 23) - 120u) << 3) | ((mag >> 20) & 7u);
  const uint32_t rest = mag & 0xfffffu;
  if (rest > 0x80000u || (rest == 0x80000u && (code & 1u))) ++code;
  return sign | static_cast<uint8_t>(code);
}

inline float fp8_e4m3_to_float(uint8_t code) {
  const uint32_t e = (code >> 3) & 0xfu, m = code & 7u;
  float a;
  if (e == 0xf && m == 7) a = std::numeric_limits<float>::quiet_NaN();
  else if (e == 0) a = std::ldexp(static_cast<float>(m), -9);
  else a = std::ldexp(static_cast<float>(8 + m), static_cast<int>(e) - 10);
  return code & 0x80u ? -a : a;
}

// Bytes of one compressed row of D values: the scale, the codes, padding to 4 bytes.
constexpr int64_t fp8_row_bytes(int64_t D) { return 4 + (D + 3) / 4 * 4; }

// One row's scale: amax / 448 (0 for a row of zeros).
inline float fp8_row_scale(float amax) { return amax / kFp8E4m3Max; }

// Quantises x[0 .. D) (float or double, converted to float first) into `row`
// (fp8_row_bytes(D) bytes).
template <typename T>
void quantize_row_fp8(void* row, const T* x, int64_t D) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::fmax(amax, std::fabs(static_cast<float>(x[d])));
  const float scale = fp8_row_scale(amax);
  auto* bytes = static_cast<uint8_t*>(row);
  std::memcpy(bytes, &scale, sizeof scale);
  uint8_t* codes = bytes + 4;
  for (int64_t d = 0; d < D; ++d) codes[d] = scale == 0.0f ? 0 : float_to_fp8_e4m3(static_cast<float>(x[d]) / scale);
  for (int64_t d = D; d < fp8_row_bytes(D) - 4; ++d) codes[d] = 0;
}

// x[0 .. D) = decode(code) * scale (a float product, then converted to T).
template <typename T>
void dequantize_row_fp8(T* x, const void* row, int64_t D) {
  const auto* bytes = static_cast<const uint8_t*>(row);
  float scale;
  std::memcpy(&scale, bytes, sizeof scale);
  for (int64_t d = 0; d < D; ++d) x[d] = static_cast<T>(fp8_e4m3_to_float(bytes[4 + d]) * scale);
}

}  // namespace moe

// The AdamW that writes the expert weights' fp8 codes as it steps them
// (cuda::adamw_weight_tiles, for the segments multi_tensor_adamw skips as tiled) against
// the flat kernel over every segment followed by quantize_weight_blocks on the new
// weights: the same hi and lo halves, moments, codes and scales, byte for byte; with fp32
// and bf16 moments, fp32 and bf16 gradients, weight decay on one tensor, a global clip
// factor, a segment of the flat kernel between the tensors and a skipped step.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/adamw_math.h"
#include "kernels/fp8_gpu_ops.h"
#include "optim/gpu_ops.h"

namespace moe {
namespace {

namespace am = adamw_math;

template <typename T>
void expect_same_bytes(const gpu::DeviceArray<T>& got, const gpu::DeviceArray<T>& want, const std::string& what) {
  const std::vector<T> g = test::to_host(got), w = test::to_host(want);
  ASSERT_EQ(g.size(), w.size()) << what;
  EXPECT_EQ(std::memcmp(g.data(), w.data(), g.size() * sizeof(T)), 0) << what << " differ";
}

struct Tensor {
  int64_t offset, E, N, K;
};

TEST(GpuAdamWWeightTiles, StepAndCodesMatchTheFlatKernelAndTheQuantiser) {
  MOE_REQUIRE_GPU();
  // Two expert tensors with a plain segment between them (its offsets keep 8-element alignment).
  const std::vector<Tensor> tensors = {{0, 2, 256, 384}, {2 * 256 * 384 + 1000, 3, 128, 256}};
  const int64_t plain_offset = 2 * 256 * 384, plain_numel = 1000;
  const int64_t storage = tensors[1].offset + tensors[1].E * tensors[1].N * tensors[1].K;
  CounterRng rng(7, "weight tiles");
  for (const bool bf16_moments : {false, true}) {
    for (const bool bf16_grads : {false, true}) {
      for (const bool skip : {false, true}) {
        SCOPED_TRACE(std::string(bf16_moments ? "bf16" : "fp32") + " moments, " + (bf16_grads ? "bf16" : "fp32") +
                     " gradients" + (skip ? ", skipped step" : ""));
        const auto n = static_cast<size_t>(storage);
        std::vector<float> grads(n), weights(n), m(n), v(n);
        for (size_t i = 0; i < n; ++i) {
          grads[i] = static_cast<float>(rng.normal(4 * i));
          weights[i] = static_cast<float>(0.3 * rng.normal(4 * i + 1) * (1 + i % 7));  // block scales differ
          m[i] = static_cast<float>(0.01 * rng.normal(4 * i + 2));
          v[i] = static_cast<float>(1e-4 * rng.uniform(4 * i + 3));
          if (bf16_grads) grads[i] = am::round_to_bf16(grads[i]);
          if (bf16_moments) m[i] = am::round_to_bf16(m[i]), v[i] = am::round_to_bf16(v[i]);
        }
        const auto [hi, lo] = test::master_halves(weights);
        // The segments: the tensors (decay on the first only) and the plain one.
        std::vector<cuda::OptimizerSegment> segments;
        int64_t chunks = 0;
        auto add = [&](int64_t offset, int64_t numel, int32_t decay) {
          cuda::OptimizerSegment seg;
          seg.offset = offset;
          seg.numel = numel;
          seg.first_chunk = chunks;
          seg.decay = decay;
          seg.bf16_grad = bf16_grads;
          chunks += (numel + am::kNormChunk - 1) / am::kNormChunk;
          segments.push_back(seg);
        };
        add(tensors[0].offset, tensors[0].E * tensors[0].N * tensors[0].K, 1);
        add(plain_offset, plain_numel, 1);
        add(tensors[1].offset, tensors[1].E * tensors[1].N * tensors[1].K, 0);
        am::AdamWScalars s = am::adamw_step_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 3);
        s.grad_scale = 0.75f;  // a global clip
        s.skip = skip;
        auto scalars_d = test::to_device(std::vector<am::AdamWScalars>{s});

        struct Run {
          gpu::DeviceArray<bf16> hi;
          gpu::DeviceArray<int16_t> lo;
          gpu::DeviceArray<float> m32, v32;
          gpu::DeviceArray<bf16> m16, v16;
          std::vector<gpu::DeviceArray<uint8_t>> codes, codes_t;
          std::vector<gpu::DeviceArray<float>> scales, scales_t;
        };
        auto make_run = [&] {
          Run r{test::to_device(hi), test::to_device(lo), test::to_device(m), test::to_device(v),
                test::to_device(test::to_bf16(m)), test::to_device(test::to_bf16(v)), {}, {}, {}, {}};
          for (const Tensor& t : tensors) {
            const auto codes = static_cast<size_t>(t.E * t.N * t.K), scales = static_cast<size_t>(t.E * t.N * t.K / 16384);
            r.codes.push_back(test::poisoned<uint8_t>(codes));
            r.codes_t.push_back(test::poisoned<uint8_t>(codes));
            r.scales.push_back(test::poisoned<float>(scales));
            r.scales_t.push_back(test::poisoned<float>(scales));
          }
          return r;
        };
        auto grads32_d = test::to_device(grads);
        auto grads16_d = test::to_device(test::to_bf16(grads));
        const float* g32 = bf16_grads ? nullptr : grads32_d.data();
        const bf16* g16 = bf16_grads ? grads16_d.data() : nullptr;
        auto moments = [&](Run& r, bool second) -> void* {
          if (bf16_moments) return second ? static_cast<void*>(r.v16.data()) : static_cast<void*>(r.m16.data());
          return second ? static_cast<void*>(r.v32.data()) : static_cast<void*>(r.m32.data());
        };

        // Reference: the flat kernel over everything, then the quantiser on the new weights.
        Run want = make_run();
        auto flat_d = test::to_device(segments);
        cuda::multi_tensor_adamw(want.hi.data(), want.lo.data(), nullptr, g32, moments(want, false),
                                 moments(want, true), bf16_moments, flat_d.data(),
                                 static_cast<int64_t>(segments.size()), chunks, scalars_d.data(), nullptr, g16);
        for (size_t i = 0; i < tensors.size(); ++i) {
          const Tensor& t = tensors[i];
          cuda::quantize_weight_blocks(want.codes[i].data(), want.scales[i].data(), want.codes_t[i].data(),
                                       want.scales_t[i].data(), want.hi.data() + t.offset, t.E, t.N, t.K, nullptr);
        }
        // The tiled step: the flat kernel skips the tensors, the tile kernel steps and codes them.
        Run got = make_run();
        std::vector<cuda::OptimizerSegment> tiled = segments;
        tiled[0].tiled = tiled[2].tiled = 1;
        auto tiled_d = test::to_device(tiled);
        std::vector<cuda::Fp8WeightTiles> tiles;
        int64_t n_tiles = 0;
        for (size_t i = 0; i < tensors.size(); ++i) {
          const Tensor& t = tensors[i];
          cuda::Fp8WeightTiles w;
          w.w = {t.offset, t.E, t.N, t.K, got.codes[i].data(), got.scales[i].data(), got.codes_t[i].data(),
                 got.scales_t[i].data()};
          w.first_tile = n_tiles;
          w.decay = tiled[i == 0 ? 0 : 2].decay;
          w.bf16_grad = bf16_grads;
          n_tiles += t.E * (t.N / 128) * (t.K / 128);
          tiles.push_back(w);
        }
        auto tiles_d = test::to_device(tiles);
        cuda::multi_tensor_adamw(got.hi.data(), got.lo.data(), nullptr, g32, moments(got, false), moments(got, true),
                                 bf16_moments, tiled_d.data(), static_cast<int64_t>(tiled.size()), chunks,
                                 scalars_d.data(), nullptr, g16);
        cuda::adamw_weight_tiles(got.hi.data(), got.lo.data(), g32, moments(got, false), moments(got, true),
                                 bf16_moments, tiles_d.data(), static_cast<int64_t>(tiles.size()), n_tiles,
                                 scalars_d.data(), nullptr, g16);
        expect_same_bytes(got.hi, want.hi, "hi halves");
        expect_same_bytes(got.lo, want.lo, "lo halves");
        if (bf16_moments) {
          expect_same_bytes(got.m16, want.m16, "m");
          expect_same_bytes(got.v16, want.v16, "v");
        } else {
          expect_same_bytes(got.m32, want.m32, "m");
          expect_same_bytes(got.v32, want.v32, "v");
        }
        for (size_t i = 0; i < tensors.size(); ++i) {
          if (skip) break;  // a skipped step writes no codes (the cache keeps the old ones)
          const std::string what = "tensor " + std::to_string(i) + " ";
          expect_same_bytes(got.codes[i], want.codes[i], what + "codes");
          expect_same_bytes(got.scales[i], want.scales[i], what + "scales");
          expect_same_bytes(got.codes_t[i], want.codes_t[i], what + "transposed codes");
          expect_same_bytes(got.scales_t[i], want.scales_t[i], what + "transposed scales");
        }
      }
    }
  }
}

}  // namespace
}  // namespace moe

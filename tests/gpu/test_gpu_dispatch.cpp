// GPU dispatch (capacity, permute, combine), embedding and cuBLASLt GEMM against the
// CPU ops, including dropped tokens, experts with no tokens and ragged sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "gpu_test_util.h"
#include "core/fp8.h"
#include "kernels/embedding.h"
#include "kernels/fp8_blockwise.h"
#include "kernels/fp8_gpu_ops.h"
#include "kernels/gpu_ops.h"
#include "moe/gpu_ops.h"
#include "kernels/matmul.h"
#include "moe/dispatch.h"
#include "moe/token_exchange.h"

namespace moe {
namespace {

struct DispatchCase {
  int64_t T, E, K, D;
  double capacity_factor;
};

class GpuDispatch : public ::testing::TestWithParam<DispatchCase> {};

TEST_P(GpuDispatch, LayoutPermuteCombineMatchCpu) {
  MOE_REQUIRE_GPU();
  const auto [T, E, K, D, cf] = GetParam();
  // Routing skewed towards low experts, and the last expert never chosen.
  std::vector<int32_t> expert(T * K);
  CounterRng rng(1, "routing");
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> chosen;
    for (int64_t k = 0; k < K; ++k) {
      int32_t e;
      uint64_t draw = static_cast<uint64_t>(t * K + k) * 16;
      do {
        // A quarter of the draws spread over experts 0..E-2, the rest over the lower half.
        const uint32_t r = rng.bits(draw++)[0];
        const int64_t lower_half = std::max<int64_t>(1, (E - 1) / 2);
        e = static_cast<int32_t>(r % 4 == 0 ? r % (E - 1) : (r >> 8) % lower_half);
      } while (std::find(chosen.begin(), chosen.end(), e) != chosen.end());
      chosen.push_back(e);
      expert[t * K + k] = e;
    }
  }
  const int64_t capacity = expert_capacity(cf, T, K, E);
  std::vector<int32_t> row_ref(T * K), counts_ref(E), offsets_ref(E + 1), token_ref(T * K);
  const int64_t R = assign_rows(row_ref.data(), counts_ref.data(), offsets_ref.data(), token_ref.data(),
                                expert.data(), T, E, K, capacity);
  if (cf > 0 && T > 1) EXPECT_LT(R, T * K) << "the case should drop tokens";
  EXPECT_EQ(counts_ref[E - 1], 0) << "the case should leave an expert empty";

  auto expert_d = to_device(expert);
  auto row_d = poisoned<int32_t>(T * K), counts_d = poisoned<int32_t>(E), offsets_d = poisoned<int32_t>(E + 1);
  auto token_d = poisoned<int32_t>(T * K), scratch_d = poisoned<int32_t>(cuda::assign_rows_scratch(T, K, E));
  auto load_d = to_device(std::vector<int64_t>(E, 5));
  cuda::assign_rows(row_d.data(), counts_d.data(), offsets_d.data(), token_d.data(), load_d.data(), scratch_d.data(),
                    expert_d.data(), T, E, K, capacity, nullptr);
  EXPECT_EQ(to_host(row_d), row_ref);
  EXPECT_EQ(to_host(counts_d), counts_ref);
  EXPECT_EQ(to_host(offsets_d), offsets_ref);
  auto token = to_host(token_d);
  EXPECT_TRUE(std::equal(token.begin(), token.begin() + R, token_ref.begin()));
  auto load = to_host(load_d);
  for (int64_t e = 0; e < E; ++e)
    EXPECT_EQ(load[e], 5 + std::count(expert.begin(), expert.end(), static_cast<int32_t>(e)));

  // Permute, combine and their backward on the layout.
  auto x = random_bf16_floats(T * D, 2, "x");
  auto y = random_bf16_floats(T * K * D, 3, "y");
  auto weight = random_bf16_floats(T * K, 4, "w");
  auto dout = random_bf16_floats(T * D, 5, "dout");
  std::vector<float> x_rows_ref(R * D), out_ref(T * D), dy_ref(R * D), dweight_ref(T * K), dx_ref(T * D);
  permute_forward<float>(x_rows_ref.data(), x.data(), token_ref.data(), R, D);
  combine_forward<float>(out_ref.data(), y.data(), weight.data(), row_ref.data(), T, K, D);
  combine_backward<float>(dy_ref.data(), dweight_ref.data(), dout.data(), y.data(), weight.data(), row_ref.data(), T,
                          K, D);
  permute_backward<float>(dx_ref.data(), y.data(), row_ref.data(), T, K, D, false);

  auto x_d = to_device_bf16(x), y_d = to_device_bf16(y), dout_d = to_device_bf16(dout);
  auto weight_d = to_device(weight);
  auto x_rows_d = poisoned<bf16>(T * K * D);
  cuda::permute_forward(x_rows_d.data(), x_d.data(), token_d.data(), offsets_d.data(), T * K, E, D, nullptr);
  auto x_rows = to_host_float(x_rows_d);
  x_rows.resize(R * D);
  expect_close("permuted rows", x_rows, x_rows_ref, 0, 0);
  auto by_token_d = poisoned<bf16>(T * K * D);
  cuda::permute_forward_by_token(by_token_d.data(), x_d.data(), row_d.data(), T, K, D, nullptr);
  auto by_token = to_host_float(by_token_d);
  by_token.resize(R * D);
  expect_close("permuted rows from the token side", by_token, x_rows_ref, 0, 0);
  auto out_d = poisoned<bf16>(T * D), dy_d = poisoned<bf16>(T * K * D), dx_d = poisoned<bf16>(T * D);
  auto dweight_d = poisoned<float>(T * K);
  cuda::combine_forward(out_d.data(), y_d.data(), weight_d.data(), row_d.data(), T, K, D, nullptr);
  cuda::combine_backward(dy_d.data(), dweight_d.data(), dout_d.data(), y_d.data(), weight_d.data(), row_d.data(), T,
                         K, D, nullptr);
  cuda::permute_backward(dx_d.data(), y_d.data(), row_d.data(), T, K, D, false, nullptr);
  expect_close("combine", to_host_float(out_d), out_ref, kBf16Rtol, 1e-2);
  auto dy = to_host_float(dy_d);
  dy.resize(R * D);
  expect_close("combine backward dy", dy, dy_ref, kBf16Rtol, 1e-3);
  expect_close("combine backward dweight", to_host(dweight_d), dweight_ref, 1e-4, 1e-3);
  expect_close("permute backward", to_host_float(dx_d), dx_ref, kBf16Rtol, 1e-2);

  // fp8: the permute and the combine backward writing the rows' e4m3 codes and scales too
  // give the plain kernels' rows and what the quantiser makes of them afterwards, bit for
  // bit, and write nothing else (every buffer starts from the same poison).
  auto codes_d = poisoned<uint8_t>(T * K * D), codes_want_d = poisoned<uint8_t>(T * K * D);
  auto scales_d = poisoned<float>(T * K * D / 128 + 1), scales_want_d = poisoned<float>(T * K * D / 128 + 1);
  const cuda::RowCodes codes{codes_d.data(), scales_d.data(), offsets_d.data(), E, T * K};
  if (D % fp8::kBlock != 0) {
    EXPECT_THROW(cuda::permute_forward_by_token_fp8(by_token_d.data(), codes, x_d.data(), row_d.data(), T, K, D,
                                                    nullptr),
                 Error);
    EXPECT_THROW(cuda::combine_backward_fp8(dy_d.data(), codes, dweight_d.data(), dout_d.data(), y_d.data(),
                                            weight_d.data(), row_d.data(), T, K, D, nullptr),
                 Error);
    return;
  }
  auto same_bytes = [](const auto& got, const auto& want, const char* what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(got[0])), 0) << what << " differ";
  };
  auto fused_rows_d = poisoned<bf16>(T * K * D);
  cuda::permute_forward_by_token_fp8(fused_rows_d.data(), codes, x_d.data(), row_d.data(), T, K, D, nullptr);
  cuda::quantize_rows_blockwise(codes_want_d.data(), scales_want_d.data(), by_token_d.data(), D, offsets_d.data(), E,
                                T * K, D, nullptr);
  same_bytes(to_host(fused_rows_d), to_host(by_token_d), "permute's rows (fp8 form)");
  same_bytes(to_host(codes_d), to_host(codes_want_d), "permute's codes");
  same_bytes(to_host(scales_d), to_host(scales_want_d), "permute's scales");

  auto fused_dy_d = poisoned<bf16>(T * K * D);
  auto fused_dweight_d = poisoned<float>(T * K);
  codes_d.fill_bytes(0xff), codes_want_d.fill_bytes(0xff), scales_d.fill_bytes(0xff), scales_want_d.fill_bytes(0xff);
  cuda::combine_backward_fp8(fused_dy_d.data(), codes, fused_dweight_d.data(), dout_d.data(), y_d.data(),
                             weight_d.data(), row_d.data(), T, K, D, nullptr);
  cuda::quantize_rows_blockwise(codes_want_d.data(), scales_want_d.data(), dy_d.data(), D, offsets_d.data(), E, T * K,
                                D, nullptr);
  same_bytes(to_host(fused_dy_d), to_host(dy_d), "combine backward's dy (fp8 form)");
  same_bytes(to_host(fused_dweight_d), to_host(dweight_d), "combine backward's dweight (fp8 form)");
  same_bytes(to_host(codes_d), to_host(codes_want_d), "combine backward's codes");
  same_bytes(to_host(scales_d), to_host(scales_want_d), "combine backward's scales");
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuDispatch,
                         ::testing::Values(DispatchCase{7, 4, 2, 9, 0.0}, DispatchCase{300, 8, 2, 64, 0.75},
                                           DispatchCase{4096, 64, 8, 128, 1.25}, DispatchCase{2049, 128, 2, 256, 0.0},
                                           DispatchCase{1, 3, 1, 5, 1.0},
                                           // olmoe-mini's K and D (vector path, 128 and 256 lanes per token),
                                           // D = 4096 (two vectors per lane), K = 12 (two chunks of slots), and
                                           // D = 24 (three vectors per row, 64 tokens per block).
                                           DispatchCase{2048, 64, 8, 1024, 1.0}, DispatchCase{1024, 64, 8, 2048, 1.25},
                                           DispatchCase{65, 16, 4, 4096, 0.0}, DispatchCase{200, 32, 12, 64, 1.0},
                                           DispatchCase{333, 32, 8, 24, 1.0},
                                           // 160 experts: more experts than threads in a tile.
                                           DispatchCase{700, 160, 6, 64, 1.0}));

// Routed experts through a slot table (a re-placement's relabelling), against a host loop.
TEST(GpuDispatchKernels, LookupMapsEveryIndexThroughTheTable) {
  MOE_REQUIRE_GPU();
  const int64_t E = 37, n = 3 * 1000 + 17;  // more than one block, a ragged tail
  std::vector<int32_t> table(E), index(n), expected(n);
  for (int64_t e = 0; e < E; ++e) table[e] = static_cast<int32_t>((e * 11 + 5) % E);  // a permutation
  CounterRng rng(3, "lookup");
  for (int64_t i = 0; i < n; ++i) index[i] = static_cast<int32_t>(rng.bits(static_cast<uint64_t>(i))[0] % E);
  for (int64_t i = 0; i < n; ++i) expected[i] = table[index[i]];
  auto table_d = to_device(table), index_d = to_device(index);
  auto out_d = poisoned<int32_t>(n);
  cuda::lookup(out_d.data(), table_d.data(), index_d.data(), n, nullptr);
  EXPECT_EQ(to_host(out_d), expected);
}

// Expert parallelism's token exchange (moe/cuda/token_exchange.cu) against the CPU
// references (moe/token_exchange.h): three ranks with unequal slot counts (one with none),
// a capacity that drops, D both vectorised and not; with split experts (the one slot of
// the empty block shared by all three ranks) and without; and the receiving rank's
// layout, assign_rows with "elsewhere" (-1) entries.
class GpuTokenExchange : public ::testing::TestWithParam<bool> {};

TEST_P(GpuTokenExchange, MatchesCpu) {
  MOE_REQUIRE_GPU();
  const bool split = GetParam();
  const int64_t T = 1500, K = 4, E = 9;
  const int P = 3;
  const std::vector<int32_t> bounds = {0, 2, 2, 9};
  std::vector<int32_t> window_end;
  for (int64_t end : slot_window_ends(std::vector<int64_t>(bounds.begin(), bounds.end()), split))
    window_end.push_back(static_cast<int32_t>(end));
  CounterRng rng(9, "token exchange");
  std::vector<int32_t> slot(T * K);
  std::vector<float> weight(T * K);
  for (int64_t i = 0; i < T * K; ++i) {
    slot[i] = static_cast<int32_t>(rng.bits(static_cast<uint64_t>(i))[0] % E);
    weight[i] = static_cast<float>(rng.bits(static_cast<uint64_t>(i))[1] % 1000) / 1000.0f;
  }
  std::vector<int32_t> row(T * K), counts(E), offsets(E + 1), token_of_row(T * K);
  assign_rows(row.data(), counts.data(), offsets.data(), token_of_row.data(), slot.data(), T, E, K,
              expert_capacity(1.0, T, K, E));
  // The other home ranks' counts: most rows in slot 2, so with split experts both cuts
  // fall inside it (rank 1 computes only a middle part of it).
  std::vector<int32_t> counts_PE(counts.begin(), counts.end());
  for (int p = 1; p < P; ++p)
    for (int64_t e = 0; e < E; ++e) counts_PE.push_back(static_cast<int32_t>((e < 2 ? 2000 : e == 2 ? 6000 : 300) + 37 * p));
  std::vector<int32_t> cuts(P + 1), rank(T * K);
  boundary_cuts(cuts.data(), counts_PE.data(), bounds.data(), split, E, P);
  if (split) {
    EXPECT_GT(cuts[1], 2 * kSlotParts);
    EXPECT_LT(cuts[2], 3 * kSlotParts) << "both cuts inside the shared slot";
  }
  route_ranks(rank.data(), row.data(), slot.data(), offsets.data(), cuts.data(), T, K, P);
  std::vector<int32_t> pos(T * P), tokens(P);
  token_blocks(pos.data(), tokens.data(), rank.data(), T, K, P);
  const int64_t U = tokens[0] + tokens[1] + tokens[2];
  auto row_d = to_device(row), slot_d = to_device(slot), bounds_d = to_device(bounds), counts_d = to_device(counts);
  auto weight_d = to_device(weight);
  auto offsets_d = to_device(offsets), counts_pe_d = to_device(counts_PE);
  auto window_end_d = to_device(window_end);
  auto cuts_d = poisoned<int32_t>(P + 1), rank_d = poisoned<int32_t>(T * K);
  cuda::boundary_cuts(cuts_d.data(), counts_pe_d.data(), bounds_d.data(), split, E, P, nullptr);
  EXPECT_EQ(to_host(cuts_d), cuts);
  cuda::route_ranks(rank_d.data(), row_d.data(), slot_d.data(), offsets_d.data(), cuts_d.data(), T, K, P, nullptr);
  EXPECT_EQ(to_host(rank_d), rank);
  auto pos_d = poisoned<int32_t>(T * P), tokens_d = poisoned<int32_t>(P);
  cuda::token_blocks(pos_d.data(), tokens_d.data(), rank_d.data(), T, K, P, nullptr);
  EXPECT_EQ(to_host(pos_d), pos);
  EXPECT_EQ(to_host(tokens_d), tokens);
  int64_t packed_size = 0;
  for (int p = 0; p < P; ++p) packed_size += window_end[p] - bounds[p] + 1;
  std::vector<int32_t> routed(U * K), packed(packed_size);
  std::vector<float> weights(U * K);
  pack_routing(routed.data(), weights.data(), pos.data(), tokens.data(), rank.data(), slot.data(), weight.data(),
               bounds.data(), T, K, P);
  pack_counts(packed.data(), counts.data(), tokens.data(), bounds.data(), window_end.data(), cuts.data(), P);
  auto routed_d = poisoned<int32_t>(U * K), packed_d = poisoned<int32_t>(packed_size);
  auto weights_d = poisoned<float>(U * K);
  cuda::pack_routing(routed_d.data(), weights_d.data(), pos_d.data(), tokens_d.data(), rank_d.data(), slot_d.data(),
                     weight_d.data(), bounds_d.data(), T, K, P, nullptr);
  cuda::pack_counts(packed_d.data(), counts_d.data(), tokens_d.data(), bounds_d.data(), window_end_d.data(),
                    cuts_d.data(), P, nullptr);
  EXPECT_EQ(to_host(routed_d), routed);
  EXPECT_EQ(to_host(weights_d), weights);
  EXPECT_EQ(to_host(packed_d), packed);
  // Rank 2's layout of its block (slots 2..8 as local 0..6, -1 for the others').
  const int64_t first = tokens[0] + tokens[1], n = tokens[2], L = 7;
  std::vector<int32_t> local_row(n * K), local_counts(L), local_offsets(L + 1), local_token(n * K);
  assign_rows(local_row.data(), local_counts.data(), local_offsets.data(), local_token.data(),
              routed.data() + first * K, n, L, K, n * K);
  auto local_slot_d = to_device(std::vector<int32_t>(routed.begin() + first * K, routed.end()));
  auto local_row_d = poisoned<int32_t>(n * K), local_counts_d = poisoned<int32_t>(L);
  auto local_offsets_d = poisoned<int32_t>(L + 1), local_token_d = poisoned<int32_t>(n * K);
  auto scratch_d = poisoned<int32_t>(cuda::assign_rows_scratch(n, K, L));
  cuda::assign_rows(local_row_d.data(), local_counts_d.data(), local_offsets_d.data(), local_token_d.data(), nullptr,
                    scratch_d.data(), local_slot_d.data(), n, L, K, n * K, nullptr);
  EXPECT_EQ(to_host(local_row_d), local_row);
  EXPECT_EQ(to_host(local_offsets_d), local_offsets);
  const auto got_token = to_host(local_token_d);
  EXPECT_TRUE(std::equal(got_token.begin(), got_token.begin() + local_offsets[L], local_token.begin()));
  // Rows out by token, sums back by token (rank order), for a vectorised and a ragged D.
  for (int64_t D : {64, 12}) {
    const auto x = random_bf16_floats(T * D, 3, "x"), blocks = random_bf16_floats(U * D, 4, "blocks");
    std::vector<float> scattered(U * D), summed(T * D);
    scatter_token_rows(scattered.data(), x.data(), pos.data(), tokens.data(), T, P, D);
    sum_token_rows(summed.data(), blocks.data(), pos.data(), tokens.data(), T, P, D);
    auto x_d = to_device_bf16(x), blocks_d = to_device_bf16(blocks);
    auto scattered_d = poisoned<bf16>(U * D), summed_d = poisoned<bf16>(T * D);
    cuda::scatter_token_rows(scattered_d.data(), x_d.data(), pos_d.data(), tokens_d.data(), T, P, D, nullptr);
    cuda::sum_token_rows(summed_d.data(), blocks_d.data(), pos_d.data(), tokens_d.data(), T, P, D, nullptr);
    EXPECT_EQ(test::to_float(to_host(scattered_d)), scattered) << "D " << D;
    expect_close("token sums", test::to_float(to_host(summed_d)), summed, 1.0 / 128, 1e-6);
    // The same with fp8 rows (parallel.a2a_compression): the fused kernels give the
    // unfused pairs' bytes bit for bit (quantise after scattering; dequantise before summing).
    const int64_t B = fp8_row_bytes(D);
    auto wire_d = poisoned<uint8_t>(U * B), fused_wire_d = poisoned<uint8_t>(U * B);
    cuda::quantize_rows_fp8(wire_d.data(), scattered_d.data(), U, D, nullptr);
    cuda::scatter_token_rows_fp8(fused_wire_d.data(), x_d.data(), pos_d.data(), tokens_d.data(), T, P, D, nullptr);
    EXPECT_EQ(to_host(fused_wire_d), to_host(wire_d)) << "D " << D;
    auto block_wire_d = poisoned<uint8_t>(U * B);
    auto dequantised_d = poisoned<bf16>(U * D);
    auto unfused_d = poisoned<bf16>(T * D), fused_d = poisoned<bf16>(T * D);
    cuda::quantize_rows_fp8(block_wire_d.data(), blocks_d.data(), U, D, nullptr);
    cuda::dequantize_rows_fp8(dequantised_d.data(), block_wire_d.data(), U, D, nullptr);
    cuda::sum_token_rows(unfused_d.data(), dequantised_d.data(), pos_d.data(), tokens_d.data(), T, P, D, nullptr);
    cuda::sum_token_rows_fp8(fused_d.data(), block_wire_d.data(), pos_d.data(), tokens_d.data(), T, P, D, nullptr);
    const auto fused = to_host(fused_d), unfused = to_host(unfused_d);
    for (size_t i = 0; i < fused.size(); ++i) ASSERT_EQ(fused[i].bits, unfused[i].bits) << "D " << D << " element " << i;
  }
  const auto values = random_bf16_floats(U * K, 5, "values");
  std::vector<float> value_sums(T * K);
  sum_token_rows(value_sums.data(), values.data(), pos.data(), tokens.data(), T, P, K);
  auto values_d = to_device(values);
  auto value_sums_d = poisoned<float>(T * K);
  cuda::sum_token_values(value_sums_d.data(), values_d.data(), pos_d.data(), tokens_d.data(), T, K, P, nullptr);
  EXPECT_EQ(to_host(value_sums_d), value_sums);
}

INSTANTIATE_TEST_SUITE_P(Split, GpuTokenExchange, ::testing::Bool());

// permute_backward with accumulate, the scalar fallback for rows that are not 16-byte
// aligned (same results as the vector path up to rounding), and bitwise-repeatable combine
// backward (the weight gradients are block reductions in a fixed order).
TEST(GpuDispatchKernels, AccumulateUnalignedRowsAndRepeatableCombineBackward) {
  MOE_REQUIRE_GPU();
  const int64_t T = 1000, E = 16, K = 8, D = 1024;
  std::vector<int32_t> expert(T * K);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) expert[t * K + k] = static_cast<int32_t>((t * 3 + k * (t % 2 ? 1 : 2)) % E);
  const int64_t capacity = expert_capacity(0.75, T, K, E);
  std::vector<int32_t> row(T * K), counts(E), offsets(E + 1), token(T * K);
  const int64_t R = assign_rows(row.data(), counts.data(), offsets.data(), token.data(), expert.data(), T, E, K,
                                capacity);
  ASSERT_LT(R, T * K) << "the case should drop tokens";
  auto rows = random_bf16_floats(T * K * D, 6, "rows");
  auto dx0 = random_bf16_floats(T * D, 7, "dx0");
  auto weight = random_bf16_floats(T * K, 8, "w");
  std::vector<float> dx_ref = dx0;
  permute_backward<float>(dx_ref.data(), rows.data(), row.data(), T, K, D, true);
  auto row_d = to_device(row);
  auto rows_d = to_device_bf16(rows);
  for (int64_t misalign : {0, 1}) {
    // Row bases one element past a 16-byte boundary force the scalar kernels.
    std::vector<float> dx_host(misalign, 0.0f), rows_host(misalign, 0.0f);
    dx_host.insert(dx_host.end(), dx0.begin(), dx0.end());
    rows_host.insert(rows_host.end(), rows.begin(), rows.end());
    auto dx_d = to_device_bf16(dx_host), shifted_rows_d = to_device_bf16(rows_host);
    cuda::permute_backward(dx_d.data() + misalign, shifted_rows_d.data() + misalign, row_d.data(), T, K, D, true,
                           nullptr);
    auto dx = to_host_float(dx_d);
    dx.erase(dx.begin(), dx.begin() + misalign);
    expect_close("permute backward accumulate misalign=" + std::to_string(misalign), dx, dx_ref, kBf16Rtol, 1e-2);

    auto out_d = poisoned<bf16>(T * D + misalign);
    std::vector<float> out_ref(T * D);
    combine_forward<float>(out_ref.data(), rows.data(), weight.data(), row.data(), T, K, D);
    auto weight_d = to_device(weight);
    cuda::combine_forward(out_d.data() + misalign, shifted_rows_d.data() + misalign, weight_d.data(), row_d.data(), T,
                          K, D, nullptr);
    auto out = to_host_float(out_d);
    out.erase(out.begin(), out.begin() + misalign);
    expect_close("combine misalign=" + std::to_string(misalign), out, out_ref, kBf16Rtol, 1e-2);
  }
  // Combine backward twice into fresh poisoned outputs: identical bits.
  auto dout_d = to_device_bf16(random_bf16_floats(T * D, 9, "dout"));
  auto weight_d = to_device(weight);
  std::vector<float> first_dweight;
  std::vector<bf16> first_dy;
  for (int repeat = 0; repeat < 2; ++repeat) {
    auto dy_d = poisoned<bf16>(T * K * D);
    auto dweight_d = poisoned<float>(T * K);
    cuda::combine_backward(dy_d.data(), dweight_d.data(), dout_d.data(), rows_d.data(), weight_d.data(), row_d.data(),
                           T, K, D, nullptr);
    auto dweight = to_host(dweight_d);
    auto dy = to_host(dy_d);
    dy.resize(R * D);
    for (int64_t i = 0; i < T * K; ++i)
      if (row[i] < 0) ASSERT_EQ(dweight[i], 0.0f) << "dropped slot " << i;
    if (repeat == 0) {
      first_dweight = dweight;
      first_dy = dy;
    } else {
      EXPECT_TRUE(first_dweight == dweight) << "combine backward dweight is not repeatable";
      EXPECT_TRUE(std::equal(first_dy.begin(), first_dy.end(), dy.begin(),
                             [](bf16 a, bf16 b) { return a.bits == b.bits; }))
          << "combine backward dy is not repeatable";
    }
  }
}

// Rows padded per expert to 128 (training.fp8_gemm_backend = deepgemm): the CPU layout with
// each expert's rows moved to an aligned start, the kept count without the padding; the
// fp8 permute's rows and codes (one group of R rows) with the padding zeroed by
// zero_padding_rows are the CPU quantiser's of the padded rows, bit for bit, and rows past
// the last expert untouched; permute_backward reads the tokens' rows only (NaN padding
// rows leave the CPU's sum).
TEST(GpuDispatchKernels, RowsPaddedPerExpert) {
  MOE_REQUIRE_GPU();
  const int64_t T = 300, E = 6, K = 2, D = 256, A = 128;
  std::vector<int32_t> expert(T * K);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) expert[t * K + k] = static_cast<int32_t>((t * 5 + k * (t % 3 + 1)) % (E - 1));
  const int64_t capacity = expert_capacity(1.0, T, K, E);
  std::vector<int32_t> row_ref(T * K), counts_ref(E), offsets_ref(E + 1), token_ref(T * K);
  const int64_t kept = assign_rows(row_ref.data(), counts_ref.data(), offsets_ref.data(), token_ref.data(),
                                   expert.data(), T, E, K, capacity);
  ASSERT_LT(kept, T * K) << "the case should drop tokens";
  ASSERT_EQ(counts_ref[E - 1], 0) << "the case should leave an expert empty";
  std::vector<int32_t> offsets(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + (counts_ref[e] + A - 1) / A * A;
  const int64_t R = (T * K + (A - 1) * E + 3) / 4 * 4;
  ASSERT_LE(offsets[E], R);
  auto expert_d = to_device(expert);
  auto row_d = poisoned<int32_t>(T * K), counts_d = poisoned<int32_t>(E), offsets_d = poisoned<int32_t>(E + 1);
  auto token_d = poisoned<int32_t>(R), scratch_d = poisoned<int32_t>(cuda::assign_rows_scratch(T, K, E));
  auto kept_d = poisoned<int32_t>(1);
  cuda::assign_rows(row_d.data(), counts_d.data(), offsets_d.data(), token_d.data(), nullptr, scratch_d.data(),
                    expert_d.data(), T, E, K, capacity, nullptr, A, kept_d.data());
  EXPECT_EQ(to_host(counts_d), counts_ref);
  EXPECT_EQ(to_host(offsets_d), offsets);
  EXPECT_EQ(to_host(kept_d)[0], kept);
  const std::vector<int32_t> row = to_host(row_d);
  for (int64_t i = 0; i < T * K; ++i) {
    const int32_t e = expert[i];
    EXPECT_EQ(row[i], row_ref[i] < 0 ? -1 : row_ref[i] - offsets_ref[e] + offsets[e]) << "slot " << i;
  }
  // The padded rows on the host: each expert's kept rows at its aligned start, zeros after.
  const auto x = random_bf16_floats(T * D, 11, "x");
  std::vector<bf16> padded(R * D, float_to_bf16(0.0f));
  for (int64_t i = 0; i < T * K; ++i)
    if (row[i] >= 0)
      for (int64_t d = 0; d < D; ++d) padded[row[i] * D + d] = float_to_bf16(x[i / K * D + d]);
  std::vector<uint8_t> codes_ref(R * D);
  std::vector<float> scales_ref(R * D / fp8::kBlock);
  fp8::quantize_rows_blockwise(codes_ref.data(), scales_ref.data(), padded.data(), D, nullptr, 1, R, D);
  auto x_d = to_device_bf16(x);
  auto rows_d = poisoned<bf16>(R * D);
  auto codes_d = poisoned<uint8_t>(R * D);
  auto scales_d = poisoned<float>(R * D / fp8::kBlock);
  const cuda::RowCodes codes{codes_d.data(), scales_d.data(), nullptr, 1, R};
  cuda::permute_forward_by_token_fp8(rows_d.data(), codes, x_d.data(), row_d.data(), T, K, D, nullptr);
  cuda::zero_padding_rows(rows_d.data(), codes, offsets_d.data(), counts_d.data(), E, D, A, nullptr);
  const std::vector<bf16> rows = to_host(rows_d);
  const std::vector<uint8_t> got_codes = to_host(codes_d);
  const std::vector<float> got_scales = to_host(scales_d);
  const int64_t used = offsets[E], KB = D / fp8::kBlock;
  size_t rows_differ = 0, codes_differ = 0, scales_differ = 0, past_written = 0;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t d = 0; d < D; ++d) {
      const size_t i = static_cast<size_t>(r * D + d);
      if (r < used) {
        rows_differ += rows[i].bits != padded[i].bits;
        codes_differ += got_codes[i] != codes_ref[i];
      } else {
        past_written += rows[i].bits != 0xffff;
      }
    }
    for (int64_t kb = 0; kb < KB && r < used; ++kb) {
      const size_t at = static_cast<size_t>(fp8::activation_scale_index(0, R, r, kb, KB));
      scales_differ += std::memcmp(&got_scales[at], &scales_ref[at], sizeof(float)) != 0;
    }
  }
  EXPECT_EQ(rows_differ, 0u) << "padded rows";
  EXPECT_EQ(codes_differ, 0u) << "padded rows' codes";
  EXPECT_EQ(scales_differ, 0u) << "padded rows' scales";
  EXPECT_EQ(past_written, 0u) << "rows past the last expert written";
  // The permute's backward over the padded layout reads the tokens' rows only: padding
  // rows full of NaN leave dx the CPU's sum.
  auto dx = random_bf16_floats(R * D, 12, "dx");
  std::vector<float> want(T * D);
  permute_backward<float>(want.data(), dx.data(), row.data(), T, K, D, false);
  std::vector<bool> is_token_row(static_cast<size_t>(R), false);
  for (int64_t i = 0; i < T * K; ++i)
    if (row[i] >= 0) is_token_row[static_cast<size_t>(row[i])] = true;
  for (int64_t r = 0; r < R; ++r)
    if (!is_token_row[static_cast<size_t>(r)])
      for (int64_t d = 0; d < D; ++d) dx[static_cast<size_t>(r * D + d)] = std::nanf("");
  auto dx_d = to_device_bf16(dx);
  auto out_d = poisoned<bf16>(T * D);
  cuda::permute_backward(out_d.data(), dx_d.data(), row_d.data(), T, K, D, false, nullptr);
  expect_close("permute backward over padded rows", to_host_float(out_d), want, kBf16Rtol, 1e-2);
}

TEST(GpuEmbedding, ForwardAndDeterministicBackwardMatchCpu) {
  MOE_REQUIRE_GPU();
  for (auto [T, V, D] : {std::tuple<int64_t, int64_t, int64_t>{9, 5, 7}, {4096, 32000, 256}, {3000, 300, 64}}) {
    auto table = random_bf16_floats(V * D, 1, "table");
    auto dout = random_bf16_floats(T * D, 2, "dout");
    std::vector<int32_t> ids(T);
    CounterRng rng(3, "ids");
    for (int64_t t = 0; t < T; ++t) ids[t] = static_cast<int32_t>(rng.bits(t)[0] % (t % 5 == 0 ? 3 : V));
    std::vector<float> out_ref(T * D), dtable_ref(V * D, 0.5f);
    embedding_forward<float>(out_ref.data(), ids.data(), table.data(), T, V, D);
    embedding_backward<float>(dtable_ref.data(), ids.data(), dout.data(), T, V, D);
    auto table_d = to_device_bf16(table), dout_d = to_device_bf16(dout);
    auto ids_d = to_device(ids);
    auto out_d = poisoned<bf16>(T * D);
    cuda::embedding_forward(out_d.data(), ids_d.data(), table_d.data(), T, V, D, nullptr);
    expect_close("embedding forward", to_host_float(out_d), out_ref, 0, 0);
    gpu::DeviceArray<char> scratch(cuda::embedding_backward_scratch_bytes(T));
    std::vector<float> first;
    for (int repeat = 0; repeat < 2; ++repeat) {
      auto dtable_d = to_device(std::vector<float>(V * D, 0.5f));
      cuda::embedding_backward(dtable_d.data(), ids_d.data(), dout_d.data(), T, V, D, scratch.data(), scratch.size(),
                               nullptr);
      auto dtable = to_host(dtable_d);
      expect_close("embedding backward", dtable, dtable_ref, 1e-5, 1e-5);
      if (repeat == 0) first = dtable;
      else EXPECT_TRUE(first == dtable) << "embedding backward is not deterministic";
    }
  }
}

TEST(GpuGemm, MatchesCpuForEveryTransposeAndOutputType) {
  MOE_REQUIRE_GPU();
  cuda::Blas blas;
  // All multiprocessors, then cuBLASLt told to use 20 (parallel.comm_sms leaves the rest to NCCL).
  for (int sm_limit : {0, 20})
  for (auto [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {37, 65, 129}, {512, 1024, 256}, {4096, 96, 40}}) {
    blas.set_sm_limit(sm_limit);
    for (int trans = 0; trans < 4; ++trans) {
      const bool ta = trans & 1, tb = trans & 2;
      auto a = random_bf16_floats(M * K, 1, "a"), b = random_bf16_floats(K * N, 2, "b");
      auto c0 = random_bf16_floats(M * N, 3, "c");
      const int64_t lda = ta ? M : K, ldb = tb ? K : N;
      for (bool fp32_out : {false, true}) {
        std::vector<float> ref = c0;
        gemm<float>(ta, tb, M, N, K, 1.5f, a.data(), lda, b.data(), ldb, fp32_out ? 1.0f : 0.0f, ref.data(), N);
        auto a_d = to_device_bf16(a), b_d = to_device_bf16(b);
        std::vector<float> got;
        if (fp32_out) {
          auto c_d = to_device(c0);
          blas.gemm(ta, tb, M, N, K, 1.5f, a_d.data(), lda, b_d.data(), ldb, 1.0f, c_d.data(), true, N, nullptr);
          got = to_host(c_d);
        } else {
          auto c_d = poisoned<bf16>(M * N);
          blas.gemm(ta, tb, M, N, K, 1.5f, a_d.data(), lda, b_d.data(), ldb, 0.0f, c_d.data(), false, N, nullptr);
          got = to_host_float(c_d);
        }
        expect_close("gemm M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
                         " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) + " fp32=" + std::to_string(fp32_out) +
                         " sm_limit=" + std::to_string(sm_limit),
                     got, ref, fp32_out ? 1e-4 : kBf16Rtol, 1e-3 * std::sqrt(static_cast<double>(K)));
      }
    }
  }
}

// The next layer's norm summing an MoE layer's rows itself (cuda::ResidualBranch gathered)
// against combine_forward followed by the norm with that branch: the same bytes of y,
// rstd, the residual stream and (fp8) y's codes, with dropped slots (row -1), on the vector
// path, the scalar kernel (D % 8 != 0, or rows one element past a 16-byte boundary) and
// the fp8 kernel and its fallback (D past 8192). The reference's branch is misaligned with
// the rows, so that both sides take the same norm kernel (the vector and scalar kernels sum
// a row's squares in different orders).
TEST(GpuDispatchKernels, NormSumsTheCombinesRowsBitForBit) {
  MOE_REQUIRE_GPU();
  struct Case {
    int64_t T, E, K, D, misalign;
    bool codes;
  };
  for (const Case c : {Case{600, 8, 2, 2048, 0, false}, Case{600, 8, 2, 2048, 0, true}, Case{300, 64, 8, 1024, 0, false},
                       Case{300, 64, 8, 1024, 1, false}, Case{77, 8, 2, 100, 0, false}, Case{40, 4, 2, 8320, 0, true},
                       Case{0, 4, 2, 256, 0, false}}) {
    const auto [T, E, K, D, misalign, with_codes] = c;
    const std::string at = "T " + std::to_string(T) + ", K " + std::to_string(K) + ", D " + std::to_string(D) +
                           ", misalign " + std::to_string(misalign) + (with_codes ? ", codes" : "");
    std::vector<int32_t> expert(T * K);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) expert[t * K + k] = static_cast<int32_t>((t * 5 + k * (1 + t % 3)) % E);
    std::vector<int32_t> row(T * K), counts(E), offsets(E + 1), token(T * K);
    const int64_t R = assign_rows(row.data(), counts.data(), offsets.data(), token.data(), expert.data(), T, E, K,
                                  expert_capacity(T > 0 ? 0.8 : 0.0, T, K, E));
    if (T > 0) ASSERT_LT(R, T * K) << "the case should drop slots: " << at;
    // Expert outputs of every magnitude, as the norm's input meets them.
    std::vector<float> rows(misalign, 0.0f), y = random_bf16_floats(std::max<int64_t>(1, R) * D, 11, "y");
    for (int64_t i = 0; i < static_cast<int64_t>(y.size()); ++i) y[i] = std::ldexp(y[i], static_cast<int>(i / D % 9) - 4);
    rows.insert(rows.end(), y.begin(), y.end());
    auto rows_d = to_device_bf16(rows), x_d = to_device_bf16(random_bf16_floats(T * D, 12, "x"));
    auto w_d = to_device_bf16(random_bf16_floats(D, 13, "w"));
    auto weight_d = to_device(random_bf16_floats(T * K, 14, "weight"));
    auto row_d = to_device(row);
    const bf16* y_rows = rows_d.data() + misalign;
    struct Outputs {
      gpu::DeviceArray<bf16> y, residual;
      gpu::DeviceArray<float> rstd, scales;
      gpu::DeviceArray<uint8_t> codes;
    };
    const int64_t TD = std::max<int64_t>(1, T * D);  // T = 0: buffers all the same (none is touched)
    auto fresh = [&] {
      return Outputs{poisoned<bf16>(TD), poisoned<bf16>(TD), poisoned<float>(std::max<int64_t>(1, T)),
                     poisoned<float>(TD / 128 + 1), poisoned<uint8_t>(TD)};
    };
    auto norm = [&](Outputs& o, const cuda::ResidualBranch& branch) {
      if (with_codes)
        cuda::rmsnorm_forward_fp8(o.y.data(), {o.codes.data(), o.scales.data(), nullptr, 1, T}, o.rstd.data(),
                                  o.residual.data(), x_d.data(), branch, w_d.data(), T, D, 1e-5f, nullptr);
      else
        cuda::rmsnorm_forward(o.y.data(), o.rstd.data(), o.residual.data(), x_d.data(), branch, w_d.data(), T, D,
                              1e-5f, nullptr);
    };
    Outputs want = fresh(), got = fresh();
    auto combined_d = poisoned<bf16>(TD + misalign);
    cuda::combine_forward(combined_d.data() + misalign, y_rows, weight_d.data(), row_d.data(), T, K, D, nullptr);
    norm(want, combined_d.data() + misalign);
    norm(got, cuda::ResidualBranch{y_rows, weight_d.data(), row_d.data(), K});
    EXPECT_TRUE(same_bits(to_host(got.y), to_host(want.y))) << "y: " << at;
    EXPECT_TRUE(same_bits(to_host(got.residual), to_host(want.residual))) << "residual: " << at;
    EXPECT_TRUE(same_bits(to_host(got.rstd), to_host(want.rstd))) << "rstd: " << at;
    if (with_codes) {
      EXPECT_TRUE(same_bits(to_host(got.codes), to_host(want.codes))) << "codes: " << at;
      EXPECT_TRUE(same_bits(to_host(got.scales), to_host(want.scales))) << "scales: " << at;
    }
  }
}

}  // namespace
}  // namespace moe

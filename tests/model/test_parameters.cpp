// ParameterStore's name index: ids in registration order, lookups by name, and a name
// registered twice refused (the index is a hash map: registering N names is O(N), which
// the model's construction relies on for deep models); resident ranges give memory back.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "model/parameters.h"
#include "obs/metrics.h"

namespace moe {
namespace {

TEST(ParameterStore, FindsEveryNameAndRefusesDuplicates) {
  ParameterStore<float> store;
  constexpr int kCount = 5000;
  for (int i = 0; i < kCount; ++i)
    EXPECT_EQ(store.add({"layers." + std::to_string(i) + ".w", Shape{2}}), i);
  for (int i = 0; i < kCount; i += 499) EXPECT_EQ(store.find("layers." + std::to_string(i) + ".w"), i);
  EXPECT_EQ(store.find("layers.5000.w"), -1);
  EXPECT_EQ(store.find(""), -1);
  try {
    store.add({"layers.17.w", Shape{3}});
    ADD_FAILURE() << "a name registered twice";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 'layers.17.w' registered twice"), std::string::npos) << e.what();
  }
  EXPECT_EQ(store.size(), kCount);  // the refused one left no trace
  EXPECT_EQ(store.add({"layers.5000.w", Shape{1}}), kCount);
  EXPECT_EQ(store.find("layers.5000.w"), kCount);
  store.allocate(1);
  EXPECT_EQ(store.total_numel(), 2 * kCount + 1);
}

// Expert parallelism keeps a rank's own experts only: the rest of the block goes back to
// the OS (the process's resident set falls), reads as zero, and zero_grads leaves it alone.
TEST(ParameterStore, NonResidentRangesGiveTheirMemoryBack) {
  constexpr int64_t kElements = int64_t{16} << 20;  // 64 MiB of values, 64 MiB of gradients
  ParameterStore<float> store;
  const int id = store.add({"experts.w", Shape{16, kElements / 16}});
  store.allocate(7);  // the values are written: committed
  const float kept = store.value(id)[100];
  ASSERT_NE(kept, 0.0f);
  const int64_t before = resident_set_bytes();
  store.set_resident({{0, kElements / 4}});
  const int64_t released = before - resident_set_bytes();
  EXPECT_GT(released, int64_t{40} << 20) << "three quarters of the 64 MiB of values";
  EXPECT_EQ(store.value(id)[100], kept);
  EXPECT_EQ(store.value(id)[kElements / 2], 0.0f);  // inside the released pages
  EXPECT_EQ(store.resident(), (RangeList{{0, kElements / 4}}));
  const int64_t zeroing = resident_set_bytes();
  store.zero_grads();  // commits the resident quarter of the gradients only
  EXPECT_LT(resident_set_bytes() - zeroing, int64_t{24} << 20);
  store.set_resident({{0, kElements}});  // everything again: the whole block
  EXPECT_EQ(store.resident(), (RangeList{{0, kElements}}));
  EXPECT_THROW(store.set_resident({{10, 20}, {5, 10}}), Error);  // not sorted
  EXPECT_THROW(store.set_resident({{0, kElements + 1}}), Error);  // past the block
}

// ZeRO-2/3 release the other ranks' pieces: zero afterwards (partial pages at the ends
// zeroed by hand, whole pages given back), the neighbours untouched; residency unchanged.
TEST(ParameterStore, ReleasedRangesReadZeroAndGiveTheirMemoryBack) {
  constexpr int64_t kElements = int64_t{16} << 20;  // 64 MiB of values, 64 MiB of gradients
  ParameterStore<float> store;
  const int id = store.add({"w", Shape{kElements}});
  store.allocate(7);
  float* values = store.value(id);
  float* grads = store.grad(id);
  for (int64_t i = 0; i < kElements; ++i) grads[i] = 1.0f;
  const float before_edge = values[1000 - 1], after_edge = values[kElements / 2 + 1001];
  const Range released{1000, kElements / 2 + 1};
  const int64_t before = resident_set_bytes();
  store.release_values({released});
  store.release_grads({released});
  EXPECT_GT(before - resident_set_bytes(), int64_t{56} << 20) << "about half of each 64 MiB block";
  EXPECT_EQ(values[1000 - 1], before_edge);
  EXPECT_EQ(values[released.end()], after_edge);
  for (int64_t i : {released.offset, released.offset + 1, kElements / 4, released.end() - 1}) {
    EXPECT_EQ(values[i], 0.0f) << i;
    EXPECT_EQ(grads[i], 0.0f) << i;
  }
  EXPECT_EQ(grads[released.offset - 1], 1.0f);
  EXPECT_EQ(grads[released.end()], 1.0f);
  EXPECT_EQ(store.resident(), (RangeList{{0, kElements}}));
  store.zero_grads({{0, 10}});
  EXPECT_EQ(grads[9], 0.0f);
  EXPECT_EQ(grads[10], 1.0f);
  EXPECT_THROW(store.release_grads({{kElements - 1, 2}}), Error);  // past the block
}

}  // namespace
}  // namespace moe

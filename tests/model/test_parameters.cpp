// ParameterStore's name index: ids in registration order, lookups by name, and a name
// registered twice refused (the index is a hash map: registering N names is O(N), which
// the model's construction relies on for deep models).
#include <gtest/gtest.h>

#include <string>

#include "model/parameters.h"

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

}  // namespace
}  // namespace moe

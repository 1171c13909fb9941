// One check for the project's error rule: the call throws E with one line that names
// every fragment given.
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

namespace moe::test {

template <typename E>
void expect_one_line_error(const std::function<void()>& fn, const std::vector<std::string>& fragments) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << fragments.front();
  } catch (const E& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    for (const auto& f : fragments) EXPECT_NE(message.find(f), std::string::npos) << "'" << f << "' not in: " << message;
  }
}

}  // namespace moe::test

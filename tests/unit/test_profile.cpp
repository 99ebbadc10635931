// Profiling scopes accumulate only when enabled, and the report names them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "shardit/core/profile.h"

namespace test_profile {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

void profiled_work() { SHARDIT_PROFILE_SCOPE("profiled_work"); }

TEST(Profile, ScopesCountOnlyWhileEnabled) {
  shardit::profile::enable(false);
  shardit::profile::reset();
  profiled_work();
  EXPECT_THAT(shardit::profile::report(), Not(HasSubstr("profiled_work")));

  shardit::profile::enable(true);
  profiled_work();
  profiled_work();
  shardit::profile::enable(false);
  const std::string report = shardit::profile::report();
  EXPECT_THAT(report, HasSubstr("profiled_work"));
  // Two calls recorded, in the calls column.
  EXPECT_THAT(report, ::testing::ContainsRegex("profiled_work +2 "));
}

}  // namespace
}  // namespace test_profile

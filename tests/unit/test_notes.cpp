// Notes (core/notes.h): printed on stderr, or taken by the innermost collector of the thread that
// emits them, each note once, and never by another thread's collector.
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "shardit/core/notes.h"

namespace {

TEST(Notes, GoToTheInnermostCollectorOfTheirThreadOnceEach) {
  shardit::NoteCollector outer;
  shardit::note("first");
  {
    shardit::NoteCollector inner;
    shardit::note("second");
    shardit::note("second");
    EXPECT_EQ(inner.notes(), std::vector<std::string>{"second"});
  }
  std::thread other([] { shardit::note("from another thread"); });
  other.join();
  shardit::note("third");
  EXPECT_EQ(outer.notes(), (std::vector<std::string>{"first", "third"}));
}

TEST(Notes, WithoutACollectorArePrintedOnStderr) {
  ::testing::internal::CaptureStderr();
  shardit::note("a prompt was truncated");
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "note: a prompt was truncated\n");
}

}  // namespace

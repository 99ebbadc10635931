// What a user reads. Notes (core/notes.h): printed on stderr, or taken by the innermost collector
// of the thread that emits them, each note once, and never by another thread's collector. Error
// messages (core/error.h): c10's without the backtrace, the path first for std::filesystem's, and
// an allocation failure named as such with what to do.
#include <gtest/gtest.h>

#include <filesystem>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#include "shardit/core/error.h"
#include "shardit/core/notes.h"

namespace test_messages {
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

TEST(ErrorMessage, NamesAnAllocationFailureAndWhatToDo) {
  const std::string message = shardit::error_message(std::bad_alloc());
  EXPECT_NE(message.find("out of memory"), std::string::npos) << message;
  EXPECT_NE(message.find("--nproc-per-node"), std::string::npos) << message;
  const std::string array_message = shardit::error_message(std::bad_array_new_length());
  EXPECT_NE(array_message.find("out of memory"), std::string::npos) << array_message;
}

TEST(ErrorMessage, PutsTheFilesystemPathFirstAndNamesALinkLoop) {
  const std::filesystem::filesystem_error error(
      "status", "model/transformer", std::make_error_code(std::errc::too_many_symbolic_link_levels));
  EXPECT_EQ(shardit::error_message(error),
            "model/transformer: " + std::make_error_code(std::errc::too_many_symbolic_link_levels).message() +
                " (a symbolic link loop)");
}

TEST(ErrorMessage, DropsC10sBacktrace) {
  try {
    TORCH_CHECK(false, "tensor 'x' has shape [2]");
    FAIL() << "TORCH_CHECK(false) did not throw";
  } catch (const c10::Error& e) {
    EXPECT_EQ(shardit::error_message(e), "tensor 'x' has shape [2]");
  }
}

}  // namespace
}  // namespace test_messages

#pragma once
// Errors follow c10's split: TORCH_CHECK for anything a user can cause (bad files, shapes, plans,
// environment), TORCH_INTERNAL_ASSERT for shardit's own invariants. Both throw c10::Error.
#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace shardit {

/// The message of an exception without c10's backtrace: what a CLI prints to a user.
std::string error_message(const std::exception& e);

/// `text` on one line, its control characters (newline, ESC, DEL, ...) written as \n, \r, \t or
/// \xNN: how a message that may quote a user's path or value is printed, so that it cannot forge
/// lines or drive the terminal.
std::string printable_line(const std::string& text);

}  // namespace shardit

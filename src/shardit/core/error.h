#pragma once
// Errors follow c10's split: TORCH_CHECK for anything a user can cause (bad files, shapes, plans,
// environment), TORCH_INTERNAL_ASSERT for shardit's own invariants. Both throw c10::Error.
#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace shardit {

/// The message of an exception without c10's backtrace: what a CLI prints to a user.
std::string error_message(const std::exception& e);

}  // namespace shardit

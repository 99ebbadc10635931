// Where the built-in model's trained weights are (src/shardit/CMakeLists.txt defines both values
// for this file alone, outside the precompiled header and the unity batches, so that no other
// file recompiles when they change).
#include "shardit/models/builtin.h"

namespace shardit::models {

std::string builtin_weights_file() { return SHARDIT_BUILTIN_WEIGHTS_FILE; }

std::string builtin_weights_sha256() { return SHARDIT_BUILTIN_WEIGHTS_SHA256; }

}  // namespace shardit::models

// libFuzzer target for SafetensorsFile::parse_header.
// Input: 8 bytes (little endian) giving the data-section size, then the header bytes.
// Every input must either be rejected with c10::Error or give tensors that satisfy the format's
// invariants; anything else (crash, other exception, broken invariant) is a bug.
#include <c10/util/Logging.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "shardit/io/safetensors.h"

namespace {

void require(bool condition) {
  if (!condition) std::abort();
}

void check_invariants(const std::vector<shardit::io::TensorInfo>& tensors, uint64_t data_size) {
  const shardit::io::TensorInfo* previous = nullptr;
  for (const auto& info : tensors) {
    require(info.begin <= info.end && info.end <= data_size);
    require(info.numel() >= 0);
    require(static_cast<uint64_t>(info.numel()) * shardit::io::st_dtype_size(info.dtype) == info.nbytes());
    for (const int64_t dim : info.shape) require(dim >= 0);
    if (previous != nullptr) require(previous->begin <= info.begin);  // sorted by offset
    if (info.nbytes() != 0) {
      if (previous != nullptr && previous->nbytes() != 0) require(previous->end <= info.begin);
      previous = &info;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // c10::Error captures a symbolized backtrace by default; skip it to keep the fuzzer fast.
  c10::SetStackTraceFetcher([] { return std::string(); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint64_t data_size = 0;
  std::memcpy(&data_size, data, 8);
  const char* json = reinterpret_cast<const char*>(data + 8);
  std::map<std::string, std::string> metadata;
  try {
    const auto tensors =
        shardit::io::SafetensorsFile::parse_header("fuzz.safetensors", json, size - 8, data_size, &metadata);
    check_invariants(tensors, data_size);
  } catch (const c10::Error&) {
    // Rejected with a message: the expected outcome for malformed headers.
  }
  return 0;
}

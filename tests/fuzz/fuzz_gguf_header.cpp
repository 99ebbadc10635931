// libFuzzer target for GgufFile::parse_header.
// Input: a whole GGUF file (header and data section). Every input must either be rejected with
// c10::Error or give a header that satisfies the format's invariants; anything else (crash, read
// outside the input, other exception, broken invariant) is a bug.
#include <c10/util/Logging.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "shardit/io/gguf.h"

namespace {

void require(bool condition) {
  if (!condition) std::abort();
}

void check_invariants(const shardit::io::GgufHeader& header, uint64_t size) {
  require(header.version == 2 || header.version == 3);
  require(header.alignment != 0 && (header.alignment & (header.alignment - 1)) == 0);
  require(header.data_offset % header.alignment == 0);
  std::set<std::string> names;
  std::vector<std::pair<uint64_t, uint64_t>> extents;
  for (const auto& tensor : header.tensors) {
    require(names.insert(tensor.name).second);
    require(!tensor.dims.empty() && tensor.dims.size() <= 4);
    for (const int64_t dim : tensor.dims) require(dim >= 0);
    const auto block = shardit::io::ggml_block(tensor.type);
    require(tensor.row_length() % block.block_size == 0);
    require(tensor.nbytes == static_cast<uint64_t>(tensor.rows()) * tensor.row_bytes());
    require(tensor.offset % header.alignment == 0);
    if (tensor.nbytes == 0) continue;
    require(header.data_offset <= size && tensor.offset + tensor.nbytes <= size - header.data_offset);
    extents.emplace_back(tensor.offset, tensor.offset + tensor.nbytes);
  }
  std::sort(extents.begin(), extents.end());
  for (size_t i = 1; i < extents.size(); ++i) require(extents[i - 1].second <= extents[i].first);
  std::set<std::string> keys;
  for (const auto& [key, value] : header.metadata) {
    require(keys.insert(key).second);
    (void)value.describe();
    for (uint64_t i = 0; value.type == shardit::io::GgufValueType::Array && i < std::min<uint64_t>(value.count, 4); ++i) {
      (void)value.element(i).describe();
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
  try {
    const auto header = shardit::io::GgufFile::parse_header("fuzz.gguf", data, size);
    check_invariants(header, size);
  } catch (const c10::Error&) {
    // Rejected with a message: the expected outcome for malformed files.
  }
  return 0;
}

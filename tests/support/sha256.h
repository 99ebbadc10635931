#pragma once
// SHA-256 (FIPS 180-4) of a byte string, as `sha256sum` prints it: the golden cases record the
// hashes of tensors too large to store (tests/golden/edit_qwenimage/case.json).
#include <ATen/ATen.h>

#include <string>

namespace shardit::testing {

/// Lower-case hex digest of `size` bytes at `data`.
std::string sha256_hex(const void* data, size_t size);

/// The digest of a tensor's bytes in row-major order (contiguous copy on the CPU; little-endian
/// hosts, as the golden data is).
std::string sha256_hex(const at::Tensor& tensor);

}  // namespace shardit::testing

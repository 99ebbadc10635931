#pragma once
// GGUF files built byte by byte for tests: valid ones, and broken ones where each field can be set
// to anything (a count, a length, a type, an offset), as a corrupt or hostile file would.
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace shardit::testing {

inline std::string le_u32(uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); }
inline std::string le_u64(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }
/// A GGUF string: u64 length, then the bytes.
inline std::string gguf_string(const std::string& s) { return le_u64(s.size()) + s; }

/// The parts of a GGUF file, in order; `build()` joins them, padding the header to `alignment`.
struct GgufBytes {
  std::string magic = "GGUF";
  uint32_t version = 3;
  int64_t tensor_count = -1;    ///< -1: the number of tensor infos added
  int64_t metadata_count = -1;  ///< -1: the number of key/values added
  uint64_t alignment = 32;
  std::vector<std::string> metadata;  ///< encoded key/values
  std::vector<std::string> tensors;   ///< encoded tensor infos
  std::string data;                   ///< the data section

  /// A key/value: key, u32 value type, value bytes.
  GgufBytes& kv(const std::string& key, uint32_t type, const std::string& value) {
    metadata.push_back(gguf_string(key) + le_u32(type) + value);
    return *this;
  }
  GgufBytes& kv_u32(const std::string& key, uint32_t v) { return kv(key, 4, le_u32(v)); }
  GgufBytes& kv_string(const std::string& key, const std::string& v) { return kv(key, 8, gguf_string(v)); }
  /// A tensor info: dims in GGUF order (innermost first), the ggml type number, the offset.
  GgufBytes& tensor(const std::string& name, const std::vector<uint64_t>& dims, uint32_t type, uint64_t offset) {
    std::string info = gguf_string(name) + le_u32(static_cast<uint32_t>(dims.size()));
    for (const uint64_t d : dims) info += le_u64(d);
    tensors.push_back(info + le_u32(type) + le_u64(offset));
    return *this;
  }
  std::string header() const {
    std::string out = magic + le_u32(version);
    out += le_u64(tensor_count < 0 ? tensors.size() : static_cast<uint64_t>(tensor_count));
    out += le_u64(metadata_count < 0 ? metadata.size() : static_cast<uint64_t>(metadata_count));
    for (const auto& m : metadata) out += m;
    for (const auto& t : tensors) out += t;
    return out;
  }
  std::string build() const {
    std::string out = header();
    out += std::string((alignment - out.size() % alignment) % alignment, '\0');
    return out + data;
  }
  /// Writes build() to `path`; returns `path`.
  std::string write(const std::string& path) const {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << build();
    return path;
  }
};

}  // namespace shardit::testing

// The safetensors header parser and the dtype table. Kept apart from the file/tensor code: this
// translation unit needs only c10's error type and nlohmann-json, so the libFuzzer target
// (tests/fuzz) compiles it with clang and links it against c10 alone.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "shardit/core/error.h"
#include "shardit/io/json.h"
#include "shardit/io/safetensors.h"

namespace shardit::io {

namespace {

struct DtypeEntry {
  StDtype dtype;
  const char* name;
  int64_t size;
};

constexpr DtypeEntry kDtypes[] = {
    {StDtype::F64, "F64", 8},          {StDtype::F32, "F32", 4},
    {StDtype::F16, "F16", 2},          {StDtype::BF16, "BF16", 2},
    {StDtype::I64, "I64", 8},          {StDtype::I32, "I32", 4},
    {StDtype::I16, "I16", 2},          {StDtype::I8, "I8", 1},
    {StDtype::U8, "U8", 1},            {StDtype::BOOL, "BOOL", 1},
    {StDtype::F8_E4M3, "F8_E4M3", 1},  {StDtype::F8_E5M2, "F8_E5M2", 1},
};

const DtypeEntry& entry_of(StDtype dtype) {
  for (const auto& entry : kDtypes) {
    if (entry.dtype == dtype) return entry;
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled StDtype ", static_cast<int>(dtype));
}

// The safetensors format caps the header at 100 MB; a larger length is a corrupt file.
constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;

StDtype parse_dtype(const std::string& label, const std::string& name, const nlohmann::json& entry) {
  const auto it = entry.find("dtype");
  TORCH_CHECK(it != entry.end(), label, ": tensor '", name, "' has no \"dtype\"");
  TORCH_CHECK(it->is_string(), label, ": tensor '", name, "' has \"dtype\" ", brief(*it),
              ", expected a string such as \"F32\"");
  return st_dtype_from_name(it->get<std::string>(), label + ": tensor '" + name + "'");
}

std::vector<int64_t> parse_shape(const std::string& label, const std::string& name,
                                 const nlohmann::json& entry) {
  const auto it = entry.find("shape");
  TORCH_CHECK(it != entry.end(), label, ": tensor '", name, "' has no \"shape\"");
  TORCH_CHECK(it->is_array(), label, ": tensor '", name, "' has \"shape\" ", brief(*it),
              ", expected an array of non-negative integers");
  std::vector<int64_t> shape;
  shape.reserve(it->size());
  for (const auto& dim : *it) {
    TORCH_CHECK(dim.is_number_integer(), label, ": tensor '", name, "' has shape entry ",
                brief(dim), ", expected a non-negative integer");
    if (dim.is_number_unsigned()) {
      const uint64_t value = dim.get<uint64_t>();
      TORCH_CHECK(value <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), label,
                  ": tensor '", name, "' has dimension ", value, ", which is too large");
      shape.push_back(static_cast<int64_t>(value));
    } else {
      const int64_t value = dim.get<int64_t>();
      TORCH_CHECK(value >= 0, label, ": tensor '", name, "' has negative dimension ", value,
                  " in shape ", brief(*it));
      shape.push_back(value);
    }
  }
  return shape;
}

std::pair<uint64_t, uint64_t> parse_offsets(const std::string& label, const std::string& name,
                                            const nlohmann::json& entry) {
  const auto it = entry.find("data_offsets");
  TORCH_CHECK(it != entry.end(), label, ": tensor '", name, "' has no \"data_offsets\"");
  const bool pair = it->is_array() && it->size() == 2 && (*it)[0].is_number_unsigned() &&
                    (*it)[1].is_number_unsigned();
  TORCH_CHECK(pair, label, ": tensor '", name, "' has \"data_offsets\" ", brief(*it),
              ", expected [begin, end] with two non-negative integers");
  return {(*it)[0].get<uint64_t>(), (*it)[1].get<uint64_t>()};
}

void parse_metadata(const std::string& label, const nlohmann::json& value,
                    std::map<std::string, std::string>* metadata) {
  TORCH_CHECK(value.is_object(), label, ": \"__metadata__\" is ", brief(value),
              ", expected an object mapping strings to strings");
  for (const auto& [key, item] : value.items()) {
    TORCH_CHECK(item.is_string(), label, ": \"__metadata__\" entry '", key, "' is ", brief(item),
                ", expected a string");
    if (metadata) (*metadata)[key] = item.get<std::string>();
  }
}

}  // namespace

StDtype st_dtype_from_name(const std::string& name, const std::string& context) {
  for (const auto& entry : kDtypes) {
    if (name == entry.name) return entry.dtype;
  }
  TORCH_CHECK(false, context, ": unknown dtype \"", name,
              "\" (known: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2)");
}

const char* st_dtype_name(StDtype dtype) { return entry_of(dtype).name; }

int64_t st_dtype_size(StDtype dtype) { return entry_of(dtype).size; }

int64_t TensorInfo::numel() const {
  int64_t count = 1;
  for (const int64_t dim : shape) count *= dim;
  return count;
}

std::vector<TensorInfo> SafetensorsFile::parse_header(const std::string& file_label,
                                                      const char* json, size_t json_size,
                                                      uint64_t data_size,
                                                      std::map<std::string, std::string>* metadata) {
  const std::string& label = file_label;
  TORCH_CHECK(json_size <= kMaxHeaderBytes, label, ": header is ", json_size,
              " bytes, more than the format's limit of ", kMaxHeaderBytes, " bytes");

  // parse_json refuses repeated keys (which would silently hide a tensor) and absurd nesting.
  const nlohmann::json header = parse_json(json, json_size, label, JsonLimits{kMaxHeaderBytes, 16}, "header");
  TORCH_CHECK(header.is_object(), label, ": header is a JSON ", header.type_name(),
              ", expected an object mapping tensor names to {dtype, shape, data_offsets}");

  std::vector<TensorInfo> tensors;
  tensors.reserve(header.size());
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      parse_metadata(label, entry, metadata);
      continue;
    }
    // Names are printed by inspect and in errors: control characters could forge terminal output.
    const bool printable = std::none_of(name.begin(), name.end(), [](char c) {
      return static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
    });
    TORCH_CHECK(printable, label, ": tensor name ", quoted(name),
                " contains control characters; no checkpoint format produces them");
    TORCH_CHECK(entry.is_object(), label, ": tensor '", name, "' is ", brief(entry),
                ", expected an object with dtype, shape and data_offsets");
    TensorInfo info;
    info.name = name;
    info.dtype = parse_dtype(label, name, entry);
    info.shape = parse_shape(label, name, entry);
    std::tie(info.begin, info.end) = parse_offsets(label, name, entry);
    TORCH_CHECK(info.begin <= info.end, label, ": tensor '", name, "' has data_offsets [",
                info.begin, ", ", info.end, "] with begin after end");
    TORCH_CHECK(info.end <= data_size, label, ": tensor '", name, "' has data_offsets [",
                info.begin, ", ", info.end, "] beyond the data section of ", data_size,
                " bytes (truncated file?)");

    // numel x element size, refusing anything that overflows 64 bits.
    uint64_t needed = static_cast<uint64_t>(st_dtype_size(info.dtype));
    // The product of the non-zero dims must fit int64 too, so that LibTorch can hold the shape
    // even when a zero dim makes the tensor empty.
    bool overflow = false;
    int64_t nonzero_product = 1;
    for (const int64_t dim : info.shape) {
      overflow = overflow || __builtin_mul_overflow(needed, static_cast<uint64_t>(dim), &needed);
      if (dim != 0) {
        overflow = overflow || __builtin_mul_overflow(nonzero_product, dim, &nonzero_product);
      }
    }
    TORCH_CHECK(!overflow, label, ": tensor '", name, "' has shape ", c10::IntArrayRef(info.shape),
                " x ", st_dtype_name(info.dtype), ", whose byte size overflows 64 bits");
    TORCH_CHECK(needed == info.nbytes(), label, ": tensor '", name, "' has data_offsets [",
                info.begin, ", ", info.end, "] (", info.nbytes(), " bytes) but shape ",
                c10::IntArrayRef(info.shape), " x ", st_dtype_name(info.dtype), " needs ", needed,
                " bytes");
    tensors.push_back(std::move(info));
  }

  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // The format requires the tensors to cover the data section exactly, with no overlap, hole or
  // trailing bytes (bytes no tensor owns could hide a second file format in the same file).
  // Empty tensors occupy no bytes, so they can sit anywhere inside the section.
  const TensorInfo* previous = nullptr;
  uint64_t covered = 0;  // end of the bytes owned so far
  for (const auto& info : tensors) {
    if (info.nbytes() == 0) continue;
    if (previous != nullptr) {
      TORCH_CHECK(info.begin >= previous->end, label, ": tensors '", previous->name,
                  "' (data_offsets [", previous->begin, ", ", previous->end, "]) and '", info.name,
                  "' (data_offsets [", info.begin, ", ", info.end, "]) overlap");
    }
    TORCH_CHECK(info.begin == covered, label, ": tensor '", info.name, "' (data_offsets [",
                info.begin, ", ", info.end, "]) leaves bytes [", covered, ", ", info.begin,
                ") of the data section unowned",
                previous ? " after tensor '" + previous->name + "'" : std::string(),
                "; the format allows no holes between tensors");
    covered = info.end;
    previous = &info;
  }
  TORCH_CHECK(covered == data_size, label, ": the data section is ", data_size,
              " bytes but its tensors end at byte ", covered, "; the ", data_size - covered,
              " trailing bytes belong to no tensor (corrupt or concatenated file?)");
  return tensors;
}

}  // namespace shardit::io

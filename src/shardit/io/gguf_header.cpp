// The GGUF header parser, the ggml type table and the metadata values. Kept apart from the mapping
// and the tensor reads: this translation unit needs only c10's error type (and io/json's quoting
// of names), so the libFuzzer target (tests/fuzz) compiles it with clang and links it against c10
// alone.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "shardit/core/error.h"
#include "shardit/io/gguf.h"
#include "shardit/io/json.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "shardit's GGUF reader needs a little-endian host");

namespace shardit::io {

namespace {

struct TypeEntry {
  GgmlType type;
  const char* name;
  GgmlBlock block;
};

// ggml's type traits (block elements, block bytes), as gguf-py's GGML_QUANT_SIZES lists them.
constexpr TypeEntry kTypes[] = {
    {GgmlType::F32, "F32", {1, 4}},           {GgmlType::F16, "F16", {1, 2}},
    {GgmlType::Q4_0, "Q4_0", {32, 18}},       {GgmlType::Q4_1, "Q4_1", {32, 20}},
    {GgmlType::Q5_0, "Q5_0", {32, 22}},       {GgmlType::Q5_1, "Q5_1", {32, 24}},
    {GgmlType::Q8_0, "Q8_0", {32, 34}},       {GgmlType::Q8_1, "Q8_1", {32, 40}},
    {GgmlType::Q2_K, "Q2_K", {256, 84}},      {GgmlType::Q3_K, "Q3_K", {256, 110}},
    {GgmlType::Q4_K, "Q4_K", {256, 144}},     {GgmlType::Q5_K, "Q5_K", {256, 176}},
    {GgmlType::Q6_K, "Q6_K", {256, 210}},     {GgmlType::Q8_K, "Q8_K", {256, 292}},
    {GgmlType::IQ2_XXS, "IQ2_XXS", {256, 66}}, {GgmlType::IQ2_XS, "IQ2_XS", {256, 74}},
    {GgmlType::IQ3_XXS, "IQ3_XXS", {256, 98}}, {GgmlType::IQ1_S, "IQ1_S", {256, 50}},
    {GgmlType::IQ4_NL, "IQ4_NL", {32, 18}},   {GgmlType::IQ3_S, "IQ3_S", {256, 110}},
    {GgmlType::IQ2_S, "IQ2_S", {256, 82}},    {GgmlType::IQ4_XS, "IQ4_XS", {256, 136}},
    {GgmlType::I8, "I8", {1, 1}},             {GgmlType::I16, "I16", {1, 2}},
    {GgmlType::I32, "I32", {1, 4}},           {GgmlType::I64, "I64", {1, 8}},
    {GgmlType::F64, "F64", {1, 8}},           {GgmlType::IQ1_M, "IQ1_M", {256, 56}},
    {GgmlType::BF16, "BF16", {1, 2}},         {GgmlType::TQ1_0, "TQ1_0", {256, 54}},
    {GgmlType::TQ2_0, "TQ2_0", {256, 66}},    {GgmlType::MXFP4, "MXFP4", {32, 17}},
    {GgmlType::NVFP4, "NVFP4", {64, 36}},     {GgmlType::Q1_0, "Q1_0", {128, 18}},
};

const TypeEntry* find_type(uint32_t value) {
  for (const auto& entry : kTypes) {
    if (static_cast<uint32_t>(entry.type) == value) return &entry;
  }
  return nullptr;
}

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint32_t kMaxDims = 4;         // GGML_MAX_DIMS
// The format caps keys at 65535 bytes; tensor names are far shorter in practice (ggml: 63).
constexpr uint64_t kMaxNameBytes = 65535;
// No metadata string of a real file comes near this (chat templates and licences are kilobytes);
// a larger length is a corrupt file, refused before any allocation.
constexpr uint64_t kMaxStringBytes = 64ull << 20;
// Arrays of arrays exist (nested token lists); deeper nesting than this is a hostile file.
constexpr int kMaxArrayDepth = 8;

int64_t scalar_size(GgufValueType type) {
  switch (type) {
    case GgufValueType::Uint8:
    case GgufValueType::Int8:
    case GgufValueType::Bool: return 1;
    case GgufValueType::Uint16:
    case GgufValueType::Int16: return 2;
    case GgufValueType::Uint32:
    case GgufValueType::Int32:
    case GgufValueType::Float32: return 4;
    case GgufValueType::Uint64:
    case GgufValueType::Int64:
    case GgufValueType::Float64: return 8;
    case GgufValueType::String:
    case GgufValueType::Array: return 0;
  }
  return 0;
}

bool has_control_characters(const std::string& text) {
  return std::any_of(text.begin(), text.end(), [](char c) {
    return static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
  });
}

// A name for messages: quoted, and cut short when long (a name can be 64 KiB).
std::string shown(const std::string& name) {
  return quoted(name.size() > 80 ? name.substr(0, 77) + "..." : name);
}

/// Reads the header's fields in order, never past `size`; every error names the file, the byte
/// position and what was being read.
class Cursor {
 public:
  Cursor(const std::string& label, const uint8_t* data, uint64_t size) : label_(label), data_(data), size_(size) {}

  uint64_t position() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }

  void need(uint64_t bytes, const std::string& what) const {
    TORCH_CHECK(bytes <= left(), label_, ": ", what, " needs ", bytes, " bytes at byte ", pos_, " but the file has ",
                left(), " bytes left (a truncated download or not a GGUF file; fetch the file again)");
  }
  template <class T>
  T scalar(const std::string& what) {
    need(sizeof(T), what);
    T value;
    std::memcpy(&value, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  std::string bytes(uint64_t count, const std::string& what) {
    need(count, what);
    std::string out(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(count));
    pos_ += count;
    return out;
  }
  /// A u64 length then that many bytes, the length at most `max_bytes`.
  std::string string(const std::string& what, uint64_t max_bytes) {
    const uint64_t length = scalar<uint64_t>(what + " (its length)");
    TORCH_CHECK(length <= left(), label_, ": ", what, " is ", length, " bytes long at byte ", pos_,
                " but the file has only ", left(), " bytes left (corrupt or truncated file)");
    TORCH_CHECK(length <= max_bytes, label_, ": ", what, " is ", length, " bytes long, more than the limit of ",
                max_bytes, " bytes (corrupt file)");
    return bytes(length, what);
  }
  /// Checks that `count` items of at least `min_bytes` each can fit in what is left.
  void check_count(uint64_t count, uint64_t min_bytes, const std::string& what) const {
    TORCH_CHECK(count <= left() / min_bytes, label_, ": ", what, " declares ", count, " entries at byte ", pos_,
                ", but the ", left(), " bytes left could hold at most ", left() / min_bytes,
                " (corrupt or truncated file)");
  }
  const std::string& label() const { return label_; }

 private:
  const std::string& label_;
  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
};

GgufValueType read_value_type(Cursor& in, const std::string& what) {
  const uint32_t raw = in.scalar<uint32_t>(what);
  TORCH_CHECK(raw <= static_cast<uint32_t>(GgufValueType::Float64), in.label(), ": ", what, " is ", raw,
              ", not a GGUF value type (0-12: uint8 ... float64); the file is corrupt or of a newer format");
  return static_cast<GgufValueType>(raw);
}

GgufValue read_value(Cursor& in, GgufValueType type, const std::string& key, int depth) {
  GgufValue value;
  value.type = type;
  const std::string what = "metadata '" + key + "'";
  if (type == GgufValueType::String) {
    value.bytes = in.string(what + " (a string)", kMaxStringBytes);
    return value;
  }
  if (type != GgufValueType::Array) {
    value.bytes = in.bytes(static_cast<uint64_t>(scalar_size(type)), what);
    return value;
  }
  TORCH_CHECK(depth < kMaxArrayDepth, in.label(), ": ", what, " nests arrays more than ", kMaxArrayDepth,
              " deep (corrupt or hostile file)");
  value.element_type = read_value_type(in, what + " (its element type)");
  value.count = in.scalar<uint64_t>(what + " (its element count)");
  switch (value.element_type) {
    case GgufValueType::String:
      in.check_count(value.count, 8, what + " (an array of strings)");
      value.strings.reserve(static_cast<size_t>(value.count));
      for (uint64_t i = 0; i < value.count; ++i) {
        value.strings.push_back(in.string(what + " element " + std::to_string(i), kMaxStringBytes));
      }
      break;
    case GgufValueType::Array:
      in.check_count(value.count, 12, what + " (an array of arrays)");
      value.arrays.reserve(static_cast<size_t>(value.count));
      for (uint64_t i = 0; i < value.count; ++i) {
        value.arrays.push_back(read_value(in, GgufValueType::Array, key + "[" + std::to_string(i) + "]", depth + 1));
      }
      break;
    default: {
      const auto size = static_cast<uint64_t>(scalar_size(value.element_type));
      in.check_count(value.count, size, what + " (an array of " + gguf_value_type_name(value.element_type) + ")");
      value.bytes = in.bytes(value.count * size, what);
    }
  }
  return value;
}

void read_metadata(Cursor& in, uint64_t count, GgufHeader* header) {
  // A key/value takes at least 14 bytes: a u64 length, one byte of key, a u32 type, one byte of value.
  in.check_count(count, 14, "the header's metadata");
  std::set<std::string> keys;
  for (uint64_t i = 0; i < count; ++i) {
    const std::string index = "metadata entry " + std::to_string(i);
    std::string key = in.string(index + " key", kMaxNameBytes);
    TORCH_CHECK(!key.empty() && !has_control_characters(key), in.label(), ": ", index, " has key ", shown(key),
                ", which is empty or holds control characters (corrupt file)");
    TORCH_CHECK(keys.insert(key).second, in.label(), ": metadata key ", shown(key),
                " appears twice; a valid GGUF file has each key once (corrupt or hand-edited file)");
    const GgufValueType type = read_value_type(in, "metadata '" + key + "' (its type)");
    GgufValue value = read_value(in, type, key, 0);
    header->metadata.emplace_back(std::move(key), std::move(value));
  }
}

uint64_t read_alignment(const std::string& label, const GgufHeader& header) {
  for (const auto& [key, value] : header.metadata) {
    if (key != "general.alignment") continue;
    TORCH_CHECK(value.type == GgufValueType::Uint32, label, ": metadata 'general.alignment' is ", value.describe(),
                ", expected a uint32 (the format's type for it)");
    const auto alignment = static_cast<uint64_t>(value.integer(key));
    TORCH_CHECK(alignment != 0 && (alignment & (alignment - 1)) == 0, label, ": metadata 'general.alignment' is ",
                alignment, ", expected a power of two (32 when absent)");
    return alignment;
  }
  return 32;
}

GgufTensorInfo read_tensor_info(Cursor& in, uint64_t index, uint64_t alignment) {
  const std::string& label = in.label();
  GgufTensorInfo info;
  info.name = in.string("tensor info " + std::to_string(index) + " name", kMaxNameBytes);
  TORCH_CHECK(!info.name.empty() && !has_control_characters(info.name), label, ": tensor ", index, " is named ",
              shown(info.name), ", which is empty or holds control characters (corrupt file)");
  const std::string what = "tensor " + shown(info.name);
  const uint32_t n_dims = in.scalar<uint32_t>(what + " (its number of dimensions)");
  TORCH_CHECK(n_dims >= 1 && n_dims <= kMaxDims, label, ": ", what, " has ", n_dims,
              " dimensions; GGUF tensors have 1 to ", kMaxDims, " (corrupt file)");
  int64_t elements = 1;
  int64_t rows = 1;
  bool overflow = false;
  for (uint32_t d = 0; d < n_dims; ++d) {
    const uint64_t dim = in.scalar<uint64_t>(what + " (dimension " + std::to_string(d) + ")");
    TORCH_CHECK(dim <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), label, ": ", what,
                " has dimension ", d, " of ", dim, ", beyond int64 (corrupt file)");
    info.dims.push_back(static_cast<int64_t>(dim));
    overflow = overflow || __builtin_mul_overflow(elements, static_cast<int64_t>(dim), &elements);
    if (d > 0) overflow = overflow || __builtin_mul_overflow(rows, static_cast<int64_t>(dim), &rows);
  }
  const uint32_t raw_type = in.scalar<uint32_t>(what + " (its ggml type)");
  const TypeEntry* type = find_type(raw_type);
  TORCH_CHECK(type != nullptr, label, ": ", what, " has ggml type ", raw_type,
              ", which this reader does not know (it knows ggml's types 0-41 as of gguf-py 0.19.0); the file "
              "needs a newer reader, or re-quantize the tensor to a known type");
  info.type = type->type;
  info.offset = in.scalar<uint64_t>(what + " (its offset)");
  const std::vector<int64_t> shape = info.shape();
  TORCH_CHECK(!overflow, label, ": ", what, " has dimensions ", c10::IntArrayRef(info.dims),
              " whose element count overflows int64 (corrupt file)");
  const GgmlBlock block = type->block;
  TORCH_CHECK(info.dims[0] % block.block_size == 0, label, ": ", what, " (", type->name, ", LibTorch shape ",
              c10::IntArrayRef(shape), ") has rows of ", info.dims[0], " elements, not a multiple of ", type->name,
              "'s block of ", block.block_size, " elements (corrupt file: a ggml row holds whole blocks)");
  uint64_t row_bytes = 0;
  uint64_t nbytes = 0;
  const bool bytes_overflow =
      __builtin_mul_overflow(static_cast<uint64_t>(info.dims[0] / block.block_size),
                             static_cast<uint64_t>(block.type_size), &row_bytes) ||
      __builtin_mul_overflow(row_bytes, static_cast<uint64_t>(rows), &nbytes) ||
      nbytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  TORCH_CHECK(!bytes_overflow, label, ": ", what, " (", type->name, ", dimensions ", c10::IntArrayRef(info.dims),
              ") has a byte size that overflows int64 (corrupt file)");
  info.nbytes = nbytes;
  TORCH_CHECK(info.offset % alignment == 0, label, ": ", what, " starts at offset ", info.offset,
              " of the data section, not a multiple of the file's alignment of ", alignment,
              " bytes (corrupt file, or general.alignment was changed after writing)");
  return info;
}

void check_tensor_extents(const std::string& label, const GgufHeader& header, uint64_t size) {
  const bool any_bytes = std::any_of(header.tensors.begin(), header.tensors.end(),
                                     [](const GgufTensorInfo& t) { return t.nbytes > 0; });
  if (!any_bytes) return;
  TORCH_CHECK(header.data_offset <= size, label, ": the data section starts at byte ", header.data_offset,
              " (after the header, aligned to ", header.alignment, "), past the end of the ", size,
              "-byte file (truncated download; fetch the file again)");
  const uint64_t data_size = size - header.data_offset;
  std::vector<const GgufTensorInfo*> order;
  for (const auto& tensor : header.tensors) {
    const std::string dims = c10::str(c10::IntArrayRef(tensor.dims));
    TORCH_CHECK(tensor.offset <= data_size && tensor.nbytes <= data_size - tensor.offset, label, ": tensor ",
                shown(tensor.name), " (", ggml_type_name(tensor.type), ", dimensions ", dims, ", ", tensor.nbytes,
                " bytes at offset ", tensor.offset, ") ends past the end of the file, whose data section holds ",
                data_size, " bytes (truncated download; fetch the file again)");
    if (tensor.nbytes > 0) order.push_back(&tensor);
  }
  std::sort(order.begin(), order.end(),
            [](const GgufTensorInfo* a, const GgufTensorInfo* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < order.size(); ++i) {
    const GgufTensorInfo& previous = *order[i - 1];
    const GgufTensorInfo& tensor = *order[i];
    TORCH_CHECK(previous.offset + previous.nbytes <= tensor.offset, label, ": tensors ", shown(previous.name),
                " (bytes [", previous.offset, ", ", previous.offset + previous.nbytes, ") of the data section) and ",
                shown(tensor.name), " (bytes [", tensor.offset, ", ", tensor.offset + tensor.nbytes,
                ")) overlap (corrupt or hand-edited file)");
  }
}

}  // namespace

bool ggml_type_known(uint32_t value) { return find_type(value) != nullptr; }

GgmlBlock ggml_block(GgmlType type) {
  const TypeEntry* entry = find_type(static_cast<uint32_t>(type));
  TORCH_INTERNAL_ASSERT(entry != nullptr, "unknown ggml type ", static_cast<uint32_t>(type));
  return entry->block;
}

const char* ggml_type_name(GgmlType type) {
  const TypeEntry* entry = find_type(static_cast<uint32_t>(type));
  return entry != nullptr ? entry->name : "?";
}

uint64_t ggml_bytes(GgmlType type, int64_t elements) {
  const GgmlBlock block = ggml_block(type);
  return static_cast<uint64_t>(elements / block.block_size * block.type_size);
}

const char* gguf_value_type_name(GgufValueType type) {
  static const char* const kNames[] = {"uint8", "int8",   "uint16", "int16",  "uint32", "int32",  "float32",
                                       "bool",  "string", "array",  "uint64", "int64",  "float64"};
  const auto index = static_cast<uint32_t>(type);
  return index < sizeof(kNames) / sizeof(kNames[0]) ? kNames[index] : "?";
}

// ---------------------------------------------------------------------------------------------
// GgufValue

bool GgufValue::is_integer() const {
  return scalar_size(type) != 0 && type != GgufValueType::Float32 && type != GgufValueType::Float64 &&
         type != GgufValueType::Bool;
}

int64_t GgufValue::integer(const std::string& key) const {
  TORCH_CHECK(is_integer(), "GGUF metadata '", key, "' is ", describe(), ", expected an integer");
  const char* p = bytes.data();
  TORCH_INTERNAL_ASSERT(bytes.size() == static_cast<size_t>(scalar_size(type)));
  auto load = [p](auto zero) {
    decltype(zero) v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  };
  switch (type) {
    case GgufValueType::Uint8: return load(uint8_t{});
    case GgufValueType::Int8: return load(int8_t{});
    case GgufValueType::Uint16: return load(uint16_t{});
    case GgufValueType::Int16: return load(int16_t{});
    case GgufValueType::Uint32: return load(uint32_t{});
    case GgufValueType::Int32: return load(int32_t{});
    case GgufValueType::Int64: return load(int64_t{});
    case GgufValueType::Uint64: {
      const uint64_t v = load(uint64_t{});
      TORCH_CHECK(v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), "GGUF metadata '", key,
                  "' is ", v, ", beyond int64");
      return static_cast<int64_t>(v);
    }
    default: break;
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled GGUF integer type");
}

double GgufValue::number(const std::string& key) const {
  if (type == GgufValueType::Float32 || type == GgufValueType::Float64) {
    TORCH_INTERNAL_ASSERT(bytes.size() == static_cast<size_t>(scalar_size(type)));
    if (type == GgufValueType::Float64) {
      double v;
      std::memcpy(&v, bytes.data(), 8);
      return v;
    }
    float v;
    std::memcpy(&v, bytes.data(), 4);
    return v;
  }
  if (type == GgufValueType::Uint64 && is_integer()) {
    uint64_t v;
    std::memcpy(&v, bytes.data(), 8);
    return static_cast<double>(v);
  }
  TORCH_CHECK(is_integer(), "GGUF metadata '", key, "' is ", describe(), ", expected a number");
  return static_cast<double>(integer(key));
}

bool GgufValue::boolean(const std::string& key) const {
  TORCH_CHECK(type == GgufValueType::Bool, "GGUF metadata '", key, "' is ", describe(), ", expected a bool");
  return bytes.at(0) != 0;
}

const std::string& GgufValue::string(const std::string& key) const {
  TORCH_CHECK(type == GgufValueType::String, "GGUF metadata '", key, "' is ", describe(), ", expected a string");
  return bytes;
}

GgufValue GgufValue::element(uint64_t index) const {
  TORCH_CHECK(type == GgufValueType::Array && index < count, "GGUF metadata value ", describe(), " has no element ",
              index);
  if (element_type == GgufValueType::Array) return arrays[static_cast<size_t>(index)];
  GgufValue out;
  out.type = element_type;
  if (element_type == GgufValueType::String) {
    out.bytes = strings[static_cast<size_t>(index)];
  } else {
    const auto size = static_cast<size_t>(scalar_size(element_type));
    out.bytes = bytes.substr(static_cast<size_t>(index) * size, size);
  }
  return out;
}

std::string GgufValue::describe() const {
  switch (type) {
    case GgufValueType::Array:
      return "array of " + std::to_string(count) + " " + gguf_value_type_name(element_type);
    case GgufValueType::String: return "string " + shown(bytes);
    case GgufValueType::Bool: return bytes.at(0) != 0 ? "bool true" : "bool false";
    case GgufValueType::Float32:
    case GgufValueType::Float64: return std::string(gguf_value_type_name(type)) + " " + c10::str(number(""));
    case GgufValueType::Uint64: {
      uint64_t v;
      std::memcpy(&v, bytes.data(), 8);
      return "uint64 " + std::to_string(v);
    }
    default: return std::string(gguf_value_type_name(type)) + " " + std::to_string(integer(""));
  }
}

// ---------------------------------------------------------------------------------------------
// GgufTensorInfo

std::vector<int64_t> GgufTensorInfo::shape() const { return std::vector<int64_t>(dims.rbegin(), dims.rend()); }

int64_t GgufTensorInfo::rows() const {
  int64_t count = 1;
  for (size_t d = 1; d < dims.size(); ++d) count *= dims[d];
  return count;
}

int64_t GgufTensorInfo::blocks_per_row() const { return row_length() / ggml_block(type).block_size; }

uint64_t GgufTensorInfo::row_bytes() const {
  return static_cast<uint64_t>(blocks_per_row()) * static_cast<uint64_t>(ggml_block(type).type_size);
}

// ---------------------------------------------------------------------------------------------
// The header

GgufHeader GgufFile::parse_header(const std::string& file_label, const uint8_t* data, uint64_t size) {
  const std::string& label = file_label;
  Cursor in(label, data, size);
  TORCH_CHECK(size >= 24, label, ": file is ", size,
              " bytes, too short for a GGUF file (it starts with a 24-byte header: magic, version, counts)");
  const uint32_t magic = in.scalar<uint32_t>("the magic");
  TORCH_CHECK(magic == kMagic, label, ": does not start with \"GGUF\" (it starts with bytes 0x", std::hex, magic,
              std::dec, " read little endian); not a GGUF file");
  GgufHeader header;
  header.version = in.scalar<uint32_t>("the version");
  TORCH_CHECK(header.version != 0x02000000 && header.version != 0x03000000, label,
              ": is a big-endian GGUF file, which this reader does not read; convert it to little endian "
              "(gguf-py's gguf_convert_endian)");
  TORCH_CHECK(header.version == 2 || header.version == 3, label, ": GGUF version ", header.version,
              " is not supported (versions 2 and 3 are; version 1 files predate August 2023: convert them again)");
  const uint64_t tensor_count = in.scalar<uint64_t>("the tensor count");
  const uint64_t metadata_count = in.scalar<uint64_t>("the metadata count");
  read_metadata(in, metadata_count, &header);
  header.alignment = read_alignment(label, header);

  // A tensor info takes at least 32 bytes: a u64 name length and one byte of name, a u32 n_dims
  // with one u64 dimension, a u32 type and a u64 offset (8 + 1 + 4 + 8 + 4 + 8 = 33).
  in.check_count(tensor_count, 33, "the header's tensor list");
  std::set<std::string> names;
  header.tensors.reserve(static_cast<size_t>(tensor_count));
  for (uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensorInfo info = read_tensor_info(in, i, header.alignment);
    TORCH_CHECK(names.insert(info.name).second, label, ": tensor ", shown(info.name),
                " appears twice in the header (corrupt or hand-edited file)");
    header.tensors.push_back(std::move(info));
  }
  const uint64_t end = in.position();
  uint64_t padded = 0;
  TORCH_CHECK(!__builtin_add_overflow(end, header.alignment - 1, &padded), label, ": alignment overflow");
  header.data_offset = padded / header.alignment * header.alignment;
  check_tensor_extents(label, header, size);
  return header;
}

}  // namespace shardit::io

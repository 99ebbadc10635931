#pragma once
// GGUF files (the container of ggml, llama.cpp and the GGUF checkpoints of diffusion transformers):
// a fully validated header, the raw bytes of a tensor as a zero-copy view over mmap, and reads of
// only some rows, or only some blocks of each row, of a tensor (what a tensor-parallel rank needs).
// The bytes of the block formats are described here (ggml_type_traits); turning blocks into
// weights is arithmetic and lives in nn/gguf_dequantize.h.
//
// Layout (versions 2 and 3, little endian): "GGUF", u32 version, u64 tensor count, u64 metadata
// count, the metadata key/values, the tensor infos (name, u32 n_dims, u64 dims[n_dims], u32 ggml
// type, u64 offset), padding to `general.alignment` (default 32), then the data section; each
// tensor's offset is relative to the data section and a multiple of the alignment.
#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardit/io/safetensors.h"  // Range, ReadStats

namespace shardit::io {

/// ggml's tensor types, with ggml's numbers (the values stored in a GGUF file).
enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23,
  I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39, NVFP4 = 40, Q1_0 = 41,
};

/// A ggml type's block: `block_size` elements stored in `type_size` bytes (1 element for plain
/// types such as F32).
struct GgmlBlock {
  int64_t block_size = 0;
  int64_t type_size = 0;
};

/// True when `value` is a ggml type this reader knows the block of.
bool ggml_type_known(uint32_t value);
/// The block of a known type (an internal error otherwise: check ggml_type_known first).
GgmlBlock ggml_block(GgmlType type);
/// "Q4_K", "F16", ...
const char* ggml_type_name(GgmlType type);
/// The bytes `elements` elements of `type` take (whole blocks: elements / block_size * type_size).
uint64_t ggml_bytes(GgmlType type, int64_t elements);

/// The value types of GGUF metadata, with the format's numbers.
enum class GgufValueType : uint32_t {
  Uint8 = 0, Int8 = 1, Uint16 = 2, Int16 = 3, Uint32 = 4, Int32 = 5, Float32 = 6, Bool = 7,
  String = 8, Array = 9, Uint64 = 10, Int64 = 11, Float64 = 12,
};
/// "uint8", "string", "array", ...
const char* gguf_value_type_name(GgufValueType type);

/// One metadata value. Scalars and arrays of scalars keep their little-endian bytes (an array of a
/// million token ids costs its bytes, not a million objects); strings their bytes as stored.
struct GgufValue {
  GgufValueType type = GgufValueType::Uint8;
  std::string bytes;                      ///< a scalar's bytes, a string, or an array of scalars' bytes
  GgufValueType element_type = GgufValueType::Uint8;  ///< arrays: the type of the elements
  uint64_t count = 0;                     ///< arrays: the number of elements
  std::vector<std::string> strings;       ///< arrays of strings
  std::vector<GgufValue> arrays;          ///< arrays of arrays

  bool is_integer() const;  ///< one of the 8 integer types
  /// The value of an integer scalar (any width or sign); throws naming `key` when it is another
  /// type or, for uint64, above int64's range.
  int64_t integer(const std::string& key) const;
  /// An integer or floating scalar as a double; throws naming `key` otherwise.
  double number(const std::string& key) const;
  bool boolean(const std::string& key) const;
  const std::string& string(const std::string& key) const;
  /// Element `index` of an array of scalars, as a scalar value.
  GgufValue element(uint64_t index) const;
  /// A short rendering for messages and `inspect` ("uint32 32", "array of 3 string", ...).
  std::string describe() const;
};

/// One tensor's entry in a GGUF header.
struct GgufTensorInfo {
  std::string name;
  GgmlType type = GgmlType::F32;
  /// GGUF (ggml) order: dims[0] is the innermost, contiguous dimension (the row length, in
  /// elements) and the last one the outermost. shape() gives LibTorch's order (the reverse).
  std::vector<int64_t> dims;
  uint64_t offset = 0;  ///< byte offset inside the data section (a multiple of the alignment)
  uint64_t nbytes = 0;  ///< rows() * row_bytes()

  /// LibTorch order ([out, in] for a Linear weight): dims reversed.
  std::vector<int64_t> shape() const;
  int64_t row_length() const { return dims.empty() ? 1 : dims[0]; }
  /// The product of every dimension but the innermost (the outer dimension in LibTorch's order).
  int64_t rows() const;
  int64_t blocks_per_row() const;
  uint64_t row_bytes() const;
};

/// What a GGUF header holds, validated against the file's size.
struct GgufHeader {
  uint32_t version = 0;
  uint64_t alignment = 32;
  uint64_t data_offset = 0;  ///< where the data section starts in the file
  /// Metadata in file order (keys are unique).
  std::vector<std::pair<std::string, GgufValue>> metadata;
  /// Tensors in file order.
  std::vector<GgufTensorInfo> tensors;
};

/// One .gguf file, memory-mapped read-only. Everything in the header is checked on open: the
/// magic and version (2 or 3), every count, string length and dimension against the bytes left
/// in the file (overflow-safe), known value and tensor types, unique keys and tensor names, row
/// lengths that are whole blocks, tensors inside the file, aligned and not overlapping. Errors name
/// the file, the key or tensor, the sizes and what to do. Nothing is read beyond the file.
class GgufFile {
 public:
  /// Opens and validates `path`. `stats` (optional) receives the byte counts of reads.
  static std::shared_ptr<GgufFile> open(const std::string& path, std::shared_ptr<ReadStats> stats = nullptr);
  /// Validates the header of a GGUF file whose first `size` bytes (the whole file) are `data`.
  /// Used by open() and by the fuzzer; reads only inside [data, data + size). Throws c10::Error.
  static GgufHeader parse_header(const std::string& file_label, const uint8_t* data, uint64_t size);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return header_.version; }
  uint64_t alignment() const { return header_.alignment; }
  const std::vector<GgufTensorInfo>& tensors() const { return header_.tensors; }
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return header_.metadata; }
  /// The metadata value of `key`, or nullptr.
  const GgufValue* find_metadata(const std::string& key) const;
  bool contains(const std::string& name) const;
  /// Throws naming the file and the tensor when it is absent.
  const GgufTensorInfo& info(const std::string& name) const;

  /// The tensor's raw bytes as a uint8 CPU tensor [rows, row_bytes] aliasing the mapping (no copy;
  /// it keeps the file mapped while alive). Read-only in spirit: writing to it is undefined.
  at::Tensor view(const std::string& name) const;
  /// An owned copy of rows [rows.begin, rows.end) of the tensor's bytes: uint8 [rows, row_bytes].
  /// Only those bytes are copied (a colwise split: each rank's whole rows).
  at::Tensor read_rows(const std::string& name, Range rows) const;
  /// An owned copy of blocks [blocks.begin, blocks.end) of each row in `rows`: uint8
  /// [rows, blocks * type_size], one contiguous span per row (a rowwise split on block boundaries).
  at::Tensor read_row_blocks(const std::string& name, Range rows, Range blocks) const;

 private:
  GgufFile() = default;
  std::string path_;
  std::shared_ptr<void> mapping_;  // the mmap; views hold a copy
  const uint8_t* base_ = nullptr;
  GgufHeader header_;
  std::map<std::string, size_t> index_;
  std::shared_ptr<ReadStats> stats_;
};

}  // namespace shardit::io

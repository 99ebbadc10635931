#pragma once
// safetensors files: a fully validated header, zero-copy views over mmap, and sliced reads that
// touch only the bytes of a shard (what lets each tensor-parallel rank read only its own slice).
#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shardit::io {

/// The dtype names of the safetensors format.
enum class StDtype { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2 };

/// "F32" -> StDtype::F32; throws (naming `context`) on an unknown name.
StDtype st_dtype_from_name(const std::string& name, const std::string& context);
const char* st_dtype_name(StDtype dtype);
int64_t st_dtype_size(StDtype dtype);
/// The LibTorch scalar type of a safetensors dtype (F8 types need LibTorch >= 2.1: error otherwise).
at::ScalarType to_scalar_type(StDtype dtype);
/// The type a read holds a tensor's bytes in: to_scalar_type, except F8 types before LibTorch 2.1,
/// whose raw bytes are read as uint8 (decode them with shardit::fp8_decode, core/fp8.h).
at::ScalarType storage_scalar_type(StDtype dtype);
/// F64, F32, F16, BF16, F8_E4M3, F8_E5M2.
bool st_dtype_is_floating(StDtype dtype);
/// True for F8_E4M3 and F8_E5M2.
bool st_dtype_is_fp8(StDtype dtype);
StDtype from_scalar_type(at::ScalarType type);

/// One tensor's entry in a safetensors header.
struct TensorInfo {
  std::string name;
  StDtype dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  ///< byte offset inside the data section
  uint64_t end = 0;    ///< one past the last byte, inside the data section
  /// A GGUF tensor stored in quantized blocks: its ggml type's number (io::GgmlType, gguf.h), -1
  /// for a tensor of a plain dtype. `shape` is then its elements' (LibTorch order), `dtype` U8,
  /// and reads give its codes: uint8 [rows, bytes of the row's blocks read].
  int32_t ggml_block_type = -1;
  int64_t numel() const;
  bool is_gguf_blocks() const { return ggml_block_type >= 0; }
  uint64_t nbytes() const { return end - begin; }
};

/// A half-open index range [begin, end) along one dimension of a tensor.
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const Range& other) const { return begin == other.begin && end == other.end; }
};

/// Counts the bytes copied out of checkpoint files. Shared by the files of one checkpoint, so
/// tests and benchmarks can show that a rank read only its shard.
struct ReadStats {
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> tensors_read{0};
};

/// One .safetensors file, memory-mapped read-only. The header is validated completely on open:
/// length within the file, valid JSON, known dtypes, shape x dtype size == byte range, every range
/// inside the data section and no two overlapping. Errors name the file, the tensor and the problem.
class SafetensorsFile {
 public:
  /// Opens and validates `path`. `stats` (optional) receives the byte counts of reads.
  static std::shared_ptr<SafetensorsFile> open(const std::string& path,
                                               std::shared_ptr<ReadStats> stats = nullptr);
  /// Validates a header given as bytes (the part after the 8-byte length) for a data section of
  /// `data_size` bytes. Used by open() and by the fuzzer. Throws c10::Error on any problem.
  static std::vector<TensorInfo> parse_header(const std::string& file_label, const char* json,
                                              size_t json_size, uint64_t data_size,
                                              std::map<std::string, std::string>* metadata);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  /// Tensor names in the order of their data offsets.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  /// Throws naming the file and the tensor when it is absent.
  const TensorInfo& info(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  /// A CPU tensor aliasing the mapped bytes (no copy). It keeps the file mapped while alive.
  /// Read-only in spirit: writing to it is undefined.
  at::Tensor view(const std::string& name) const;
  /// An owned copy, converted to `dtype` when given (F8 tensors: decoded exactly to a floating
  /// `dtype`; without one, held as storage_scalar_type).
  at::Tensor read(const std::string& name, std::optional<at::ScalarType> dtype = std::nullopt) const;
  /// read(name) when the file holds `name`, otherwise nullopt (an optional argument of a case).
  std::optional<at::Tensor> read_if_present(const std::string& name) const;
  /// Reads only the elements of `ranges` along `dim` and concatenates them along `dim`, converted
  /// to `dtype` when given. Only the bytes of those ranges are copied from the file (for dim > 0
  /// that is one contiguous span per outer index). Throws naming the tensor when a range is out of
  /// bounds.
  at::Tensor read_slices(const std::string& name, int64_t dim, const std::vector<Range>& ranges,
                         std::optional<at::ScalarType> dtype = std::nullopt) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  std::shared_ptr<void> mapping_;  // the mmap; views hold a copy
  const char* data_ = nullptr;     // start of the data section
  uint64_t data_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
  std::shared_ptr<ReadStats> stats_;
};

/// Writes tensors (any layout; written contiguous, in the given order) as a safetensors file.
/// `stored_as` names tensors held as raw uint8 bytes of another one-byte dtype (F8_E4M3, F8_E5M2:
/// FP8 bytes on a LibTorch without float8 types), written under that dtype.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {},
                      const std::map<std::string, StDtype>& stored_as = {});

/// One piece of a mapped tensor (Checkpoint::with_mapping): rows [rows->begin, rows->end) along
/// dim 0 of the file's tensor `key`, or the whole tensor when `rows` is nullopt.
struct TensorPiece {
  std::string key;
  std::optional<Range> rows;
};

/// Names a model reads -> the pieces of the file's tensors each is made of, concatenated along
/// dim 0 in order: a rename is one whole piece; a fused `qkv` gives to_q, to_k and to_v a third of
/// its rows each; a [shift, scale] modulation read as [scale, shift] is its two halves swapped.
using KeyMapping = std::map<std::string, std::vector<TensorPiece>>;

class GgufFile;

/// A checkpoint made of one or several safetensors files: a single file, a folder with one
/// `*.safetensors` file, or a sharded set described by `*.safetensors.index.json`; or one GGUF
/// file (`*.gguf`): its F32, F16 and BF16 tensors read as those dtypes, its block-quantized ones
/// as their codes (TensorInfo::ggml_block_type; a read never dequantizes, the loader does).
///
/// A checkpoint may carry a KeyMapping (with_mapping): it then speaks the model's names, every
/// accessor below resolving a name to its pieces, and read_slices copies only the bytes of the
/// requested rows of each piece, so a rank reads only its heads' rows of a fused tensor. The
/// mapping reaches the files through two private functions alone (source_info, source_read:
/// a file's tensor by its own name, whole or by ranges of rows); another container format
/// (quantized row blocks, say) plugs in below the mapping by providing those two for its files.
class Checkpoint {
 public:
  /// `path` is a .safetensors file, an .index.json file, or a folder holding exactly one of
  /// `<prefix>.safetensors.index.json` or one `<prefix>.safetensors` file (diffusers'
  /// `diffusion_pytorch_model*` and transformers' `model*` are both recognised).
  static Checkpoint open(const std::string& path);
  /// True when `path` is a GGUF file (its first four bytes are "GGUF").
  static bool is_gguf(const std::string& path);

  /// Every tensor name, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;
  /// The safetensors file holding `name`; throws naming the checkpoint when absent, or when it is a
  /// GGUF checkpoint.
  const SafetensorsFile& file_of(const std::string& name) const;
  /// The path of the file holding `name` (either container); throws naming the checkpoint when absent.
  const std::string& path_of(const std::string& name) const;
  /// Every file the checkpoint reads, safetensors or GGUF.
  std::vector<std::string> file_paths() const;
  /// The GGUF file of a GGUF checkpoint, or nullptr.
  const std::shared_ptr<GgufFile>& gguf() const { return gguf_; }
  at::Tensor read(const std::string& name, std::optional<at::ScalarType> dtype = std::nullopt) const;
  at::Tensor read_slices(const std::string& name, int64_t dim, const std::vector<Range>& ranges,
                         std::optional<at::ScalarType> dtype = std::nullopt) const;
  const std::vector<std::shared_ptr<SafetensorsFile>>& files() const { return files_; }
  const std::string& path() const { return path_; }
  const ReadStats& stats() const { return *stats_; }

  /// This checkpoint under the names of `mapping` (only those: a file tensor no piece names is
  /// not listed). Checked before anything is read: every piece's tensor exists, its rows lie inside
  /// it, and the pieces of one name share their dtype and their trailing dimensions; errors name
  /// the file, the name and the piece. The files, and their ReadStats, are shared.
  Checkpoint with_mapping(const KeyMapping& mapping) const;
  /// True when the names are a mapping's (with_mapping).
  bool mapped() const { return mapped_ != nullptr; }
  /// The files' own tensor names, sorted, whatever the mapping.
  std::vector<std::string> source_names() const;
  /// A tensor of the files by its own name (the unmapped view), or nullptr when absent.
  const TensorInfo* find_source(const std::string& key) const;

 private:
  struct MappedTensor {
    std::vector<TensorPiece> pieces;
    TensorInfo info;  ///< the assembled tensor: its dtype and shape; begin = 0, end = its byte count
  };
  /// The files' tensor `key` ("" for a checkpoint error naming `name`, the mapped name asked for).
  const TensorInfo& source_info(const std::string& key) const;
  /// The files' tensor `key`, whole (`rows` empty) or the rows of `rows` (dim 0), concatenated;
  /// then, for `dim` > 0, only the `columns` ranges along `dim` (a GGUF block tensor's on block
  /// boundaries: only those blocks of each row are read).
  at::Tensor source_read(const std::string& key, const std::vector<Range>& rows, std::optional<at::ScalarType> dtype,
                         int64_t dim = 0, const std::vector<Range>& columns = {}) const;
  at::Tensor gguf_read(const std::string& key, const std::vector<Range>& rows, std::optional<at::ScalarType> dtype,
                       int64_t dim, const std::vector<Range>& columns) const;
  const MappedTensor& mapped_tensor(const std::string& name) const;
  /// Makes this a checkpoint of the GGUF file `path` (io/checkpoint_gguf.cpp).
  void open_gguf(const std::string& path);
  std::string path_;
  std::shared_ptr<const std::map<std::string, MappedTensor>> mapped_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> file_index_;  // tensor name -> files_ index
  std::shared_ptr<GgufFile> gguf_;             // a GGUF checkpoint's file (then files_ is empty)
  std::shared_ptr<const std::map<std::string, TensorInfo>> gguf_tensors_;  // its tensors in our terms
  std::shared_ptr<ReadStats> stats_;
};

}  // namespace shardit::io

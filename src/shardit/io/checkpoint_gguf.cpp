// A GGUF file as a Checkpoint's source (io::Checkpoint::source_info / source_read): its tensors
// in LibTorch order, plain ones (F32, F16, BF16, integers) read as their dtype, block-quantized
// ones as their codes. A rank's read copies only its rows (whole rows of codes) or, along the row,
// only its blocks; a column range that cuts a block is refused (the loader checks the degree
// before reading, so this is the last line).
#include <c10/util/Exception.h>

#include <unistd.h>
#include <memory>

#include "shardit/io/file.h"
#include "shardit/io/gguf.h"
#include "shardit/io/safetensors.h"

namespace shardit::io {

namespace {

/// The safetensors dtype of a plain ggml type; nullopt for block types.
std::optional<StDtype> plain_dtype(GgmlType type) {
  switch (type) {
    case GgmlType::F32: return StDtype::F32;
    case GgmlType::F16: return StDtype::F16;
    case GgmlType::BF16: return StDtype::BF16;
    case GgmlType::F64: return StDtype::F64;
    case GgmlType::I8: return StDtype::I8;
    case GgmlType::I16: return StDtype::I16;
    case GgmlType::I32: return StDtype::I32;
    case GgmlType::I64: return StDtype::I64;
    default: return std::nullopt;
  }
}

/// `columns` (element ranges along a row of `tensor`) as ranges of its blocks; refuses a range
/// that cuts a block.
std::vector<Range> block_ranges(const std::string& path, const GgufTensorInfo& tensor, const std::vector<Range>& columns) {
  const int64_t block = ggml_block(tensor.type).block_size;
  std::vector<Range> out;
  for (const Range& range : columns) {
    TORCH_CHECK(range.begin % block == 0 && range.end % block == 0, path, ": tensor '", tensor.name, "' is stored in ",
                ggml_type_name(tensor.type), " blocks of ", block, " elements; columns [", range.begin, ", ", range.end,
                ") cut a block (a split along its rows must fall on block boundaries)");
    out.push_back({range.begin / block, range.end / block});
  }
  return out;
}

}  // namespace

bool Checkpoint::is_gguf(const std::string& path) {
  // Not a regular file (a FIFO would block an open, a folder has no magic): not GGUF; the
  // safetensors path that follows names the problem.
  if (!regular_file_problem(path).empty()) return false;
  uint64_t size = 0;
  const UniqueFd fd = open_regular_file(path, &size);
  char magic[4] = {};
  return size >= sizeof(magic) && ::pread(fd.get(), magic, sizeof(magic), 0) == static_cast<ssize_t>(sizeof(magic)) &&
         std::string(magic, sizeof(magic)) == "GGUF";
}

void Checkpoint::open_gguf(const std::string& path) {
  gguf_ = GgufFile::open(path, stats_);
  auto tensors = std::make_shared<std::map<std::string, TensorInfo>>();
  for (const GgufTensorInfo& tensor : gguf_->tensors()) {
    TensorInfo info;
    info.name = tensor.name;
    info.shape = tensor.shape();
    if (const auto dtype = plain_dtype(tensor.type)) {
      info.dtype = *dtype;
    } else {
      info.dtype = StDtype::U8;
      info.ggml_block_type = static_cast<int32_t>(tensor.type);
    }
    info.begin = tensor.offset;
    info.end = tensor.offset + tensor.nbytes;
    tensors->emplace(tensor.name, std::move(info));
  }
  gguf_tensors_ = std::move(tensors);
}

at::Tensor Checkpoint::gguf_read(const std::string& key, const std::vector<Range>& rows,
                                 std::optional<at::ScalarType> dtype, int64_t dim,
                                 const std::vector<Range>& columns) const {
  const GgufTensorInfo& tensor = gguf_->info(key);
  const TensorInfo& info = gguf_tensors_->at(key);
  const auto ndim = static_cast<int64_t>(info.shape.size());
  TORCH_CHECK(!info.is_gguf_blocks() || !dtype, path_, ": tensor '", key, "' is stored in ",
              ggml_type_name(tensor.type), " blocks; read its codes and dequantize them (nn/gguf_dequantize.h)");
  std::vector<int64_t> shape = info.shape;
  at::Tensor bytes;
  if (ndim <= 1) {
    // One GGUF row: dim-0 ranges are element ranges along it.
    const std::vector<Range> elements = rows.empty() ? std::vector<Range>{{0, tensor.row_length()}} : rows;
    std::vector<at::Tensor> parts;
    int64_t count = 0;
    for (const Range& blocks : block_ranges(path_, tensor, elements)) parts.push_back(gguf_->read_row_blocks(key, {0, 1}, blocks));
    for (const Range& range : elements) count += range.size();
    if (ndim == 1) shape[0] = count;
    bytes = at::cat(parts, 1);
  } else {
    // GGUF rows per index of dim 0 (the outer dimensions after the first, flattened).
    const int64_t per = tensor.rows() / info.shape[0];
    const std::vector<Range> outer = rows.empty() ? std::vector<Range>{{0, info.shape[0]}} : rows;
    const bool along_row = dim == ndim - 1 && !columns.empty();
    TORCH_CHECK(dim == 0 || along_row || !info.is_gguf_blocks(), path_, ": tensor '", key, "' (",
                ggml_type_name(tensor.type), ", shape ", c10::IntArrayRef(info.shape),
                ") can be split along its first or last dimension only, not ", dim);
    const std::vector<Range> blocks =
        along_row ? block_ranges(path_, tensor, columns) : std::vector<Range>{{0, tensor.blocks_per_row()}};
    std::vector<at::Tensor> parts;
    shape[0] = 0;
    for (const Range& range : outer) {
      std::vector<at::Tensor> row_parts;
      for (const Range& span : blocks) row_parts.push_back(gguf_->read_row_blocks(key, {range.begin * per, range.end * per}, span));
      parts.push_back(row_parts.size() == 1 ? row_parts.front() : at::cat(row_parts, 1));
      shape[0] += range.size();
    }
    if (along_row) {
      shape[static_cast<size_t>(dim)] = 0;
      for (const Range& range : columns) shape[static_cast<size_t>(dim)] += range.size();
    }
    bytes = parts.size() == 1 ? parts.front() : at::cat(parts, 0);
    if (dim > 0 && !along_row && !columns.empty()) {
      // A plain tensor split along a middle dimension: its rows read whole, then narrowed.
      const at::Tensor whole = bytes.view(to_scalar_type(info.dtype)).reshape(shape);
      std::vector<at::Tensor> pieces;
      for (const Range& range : columns) pieces.push_back(whole.narrow(dim, range.begin, range.size()));
      const at::Tensor out = at::cat(pieces, dim);
      return dtype ? out.to(*dtype) : out;
    }
  }
  if (info.is_gguf_blocks()) return bytes;  // codes [rows, bytes]
  const at::Tensor values = bytes.view(to_scalar_type(info.dtype)).reshape(shape);
  return dtype ? values.to(*dtype) : values;
}

}  // namespace shardit::io

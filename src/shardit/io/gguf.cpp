#include "shardit/io/gguf.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "shardit/core/error.h"
#include "shardit/io/file.h"
#include "shardit/io/json.h"

namespace shardit::io {

namespace {

/// The read-only mapping of a whole file, which views share, and its descriptor, which reads use
/// (pread: a file truncated while open gives an error, not SIGBUS).
struct GgufMapping {
  void* base = MAP_FAILED;
  size_t size = 0;
  int fd = -1;
  ~GgufMapping() {
    if (base != MAP_FAILED) munmap(base, size);
    if (fd >= 0) close(fd);
  }
};

void check_gguf_range(const std::string& path, const GgufTensorInfo& tensor, Range range, int64_t limit, const char* what) {
  TORCH_CHECK(range.begin >= 0 && range.begin <= range.end && range.end <= limit, path, ": tensor ",
              quoted(tensor.name), " (", ggml_type_name(tensor.type), ", LibTorch shape ",
              c10::IntArrayRef(tensor.shape()), ") has ", limit, " ", what, "; [", range.begin, ", ", range.end,
              ") is out of range");
}

}  // namespace

std::shared_ptr<GgufFile> GgufFile::open(const std::string& path, std::shared_ptr<ReadStats> stats) {
  uint64_t file_size = 0;
  UniqueFd fd = open_regular_file(path, &file_size);
  TORCH_CHECK(file_size >= 24, path, ": file is ", file_size,
              " bytes, too short for a GGUF file (it starts with a 24-byte header: magic, version, counts)");
  auto mapping = std::make_shared<GgufMapping>();
  mapping->size = static_cast<size_t>(file_size);
  mapping->fd = fd.release();
  mapping->base = mmap(nullptr, mapping->size, PROT_READ, MAP_PRIVATE, mapping->fd, 0);
  TORCH_CHECK(mapping->base != MAP_FAILED, path, ": mmap of ", file_size, " bytes failed: ", std::strerror(errno));

  std::shared_ptr<GgufFile> file(new GgufFile());
  file->path_ = path;
  file->stats_ = std::move(stats);
  file->base_ = static_cast<const uint8_t*>(mapping->base);
  file->header_ = parse_header(path, file->base_, file_size);
  for (size_t i = 0; i < file->header_.tensors.size(); ++i) file->index_[file->header_.tensors[i].name] = i;
  file->mapping_ = std::move(mapping);
  return file;
}

GgufFile::~GgufFile() = default;

const GgufValue* GgufFile::find_metadata(const std::string& key) const {
  for (const auto& [name, value] : header_.metadata) {
    if (name == key) return &value;
  }
  return nullptr;
}

bool GgufFile::contains(const std::string& name) const { return index_.count(name) != 0; }

const GgufTensorInfo& GgufFile::info(const std::string& name) const {
  const auto it = index_.find(name);
  TORCH_CHECK(it != index_.end(), path_, ": no tensor named ", quoted(name), " (the file has ",
              header_.tensors.size(), " tensors)");
  return header_.tensors[it->second];
}

at::Tensor GgufFile::view(const std::string& name) const {
  const GgufTensorInfo& tensor = info(name);
  std::shared_ptr<void> keep_alive = mapping_;
  void* ptr = const_cast<uint8_t*>(base_ + header_.data_offset + tensor.offset);
  return at::from_blob(ptr, {tensor.rows(), static_cast<int64_t>(tensor.row_bytes())}, [keep_alive](void*) {},
                       at::TensorOptions().dtype(at::kByte));
}

at::Tensor GgufFile::read_rows(const std::string& name, Range rows) const {
  const GgufTensorInfo& tensor = info(name);
  return read_row_blocks(name, rows, Range{0, tensor.blocks_per_row()});
}

at::Tensor GgufFile::read_row_blocks(const std::string& name, Range rows, Range blocks) const {
  const GgufTensorInfo& tensor = info(name);
  check_gguf_range(path_, tensor, rows, tensor.rows(), "rows");
  check_gguf_range(path_, tensor, blocks, tensor.blocks_per_row(), "blocks in each row");
  const auto type_size = static_cast<uint64_t>(ggml_block(tensor.type).type_size);
  const uint64_t row_bytes = tensor.row_bytes();
  const uint64_t span = static_cast<uint64_t>(blocks.size()) * type_size;
  at::Tensor out = at::empty({rows.size(), static_cast<int64_t>(span)}, at::TensorOptions().dtype(at::kByte));
  auto* dst = reinterpret_cast<char*>(out.data_ptr<uint8_t>());
  const int fd = static_cast<const GgufMapping*>(mapping_.get())->fd;
  const uint64_t start = header_.data_offset + tensor.offset + static_cast<uint64_t>(blocks.begin) * type_size;
  for (int64_t r = rows.begin; r < rows.end && span > 0; ++r) {
    pread_exact(fd, dst, span, start + static_cast<uint64_t>(r) * row_bytes, path_, name);
    dst += span;
  }
  if (stats_) {
    stats_->bytes_read += span * static_cast<uint64_t>(rows.size());
    stats_->tensors_read += 1;
  }
  return out;
}

}  // namespace shardit::io

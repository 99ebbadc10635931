#include "shardit/io/safetensors.h"

#include "shardit/core/compat.h"

#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include "shardit/core/error.h"
#include "shardit/core/fp8.h"
#include "shardit/io/file.h"
#include "shardit/io/gguf.h"
#include "shardit/io/json.h"

// safetensors is little endian; the raw copies below assume the host is too.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "shardit's safetensors I/O needs a little-endian host");

namespace shardit::io {

namespace fs = std::filesystem;

namespace {

/// The mapped file and its descriptor: views share it, reads pread() from the descriptor.
struct Mapping {
  void* base = MAP_FAILED;
  size_t size = 0;
  int fd = -1;
  ~Mapping() {
    if (base != MAP_FAILED) munmap(base, size);
    if (fd >= 0) close(fd);
  }
};

at::Tensor maybe_convert(at::Tensor tensor, StDtype stored, std::optional<at::ScalarType> dtype) {
  if (!dtype || *dtype == tensor.scalar_type()) return tensor;
  if (st_dtype_is_fp8(stored) && tensor.scalar_type() == at::kByte) {
    TORCH_CHECK(at::isFloatingType(*dtype), "an ", st_dtype_name(stored), " tensor converts to a floating dtype only, not ",
                *dtype);
    return fp8_decode(tensor, stored == StDtype::F8_E4M3 ? Fp8Format::E4M3 : Fp8Format::E5M2, *dtype);
  }
  return tensor.to(*dtype);
}

}  // namespace

at::ScalarType to_scalar_type(StDtype dtype) {
  switch (dtype) {
    case StDtype::F64: return at::kDouble;
    case StDtype::F32: return at::kFloat;
    case StDtype::F16: return at::kHalf;
    case StDtype::BF16: return at::kBFloat16;
    case StDtype::I64: return at::kLong;
    case StDtype::I32: return at::kInt;
    case StDtype::I16: return at::kShort;
    case StDtype::I8: return at::kChar;
    case StDtype::U8: return at::kByte;
    case StDtype::BOOL: return at::kBool;
#if SHARDIT_HAS_FLOAT8
    case StDtype::F8_E4M3: return at::kFloat8_e4m3fn;
    case StDtype::F8_E5M2: return at::kFloat8_e5m2;
#else
    case StDtype::F8_E4M3:
    case StDtype::F8_E5M2:
      TORCH_CHECK(false, "safetensors dtype ", st_dtype_name(dtype), " needs LibTorch >= 2.1 (this is ",
                  TORCH_VERSION, "); convert the checkpoint to BF16/F16/F32 first");
#endif
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled StDtype ", static_cast<int>(dtype));
}

at::ScalarType storage_scalar_type(StDtype dtype) {
  if (st_dtype_is_fp8(dtype) && !SHARDIT_HAS_FLOAT8) return at::kByte;
  return to_scalar_type(dtype);
}

bool st_dtype_is_fp8(StDtype dtype) { return dtype == StDtype::F8_E4M3 || dtype == StDtype::F8_E5M2; }

bool st_dtype_is_floating(StDtype dtype) {
  return dtype == StDtype::F64 || dtype == StDtype::F32 || dtype == StDtype::F16 || dtype == StDtype::BF16 ||
         st_dtype_is_fp8(dtype);
}

StDtype from_scalar_type(at::ScalarType type) {
  switch (type) {
    case at::kDouble: return StDtype::F64;
    case at::kFloat: return StDtype::F32;
    case at::kHalf: return StDtype::F16;
    case at::kBFloat16: return StDtype::BF16;
    case at::kLong: return StDtype::I64;
    case at::kInt: return StDtype::I32;
    case at::kShort: return StDtype::I16;
    case at::kChar: return StDtype::I8;
    case at::kByte: return StDtype::U8;
    case at::kBool: return StDtype::BOOL;
#if SHARDIT_HAS_FLOAT8
    case at::kFloat8_e4m3fn: return StDtype::F8_E4M3;
    case at::kFloat8_e5m2: return StDtype::F8_E5M2;
#endif
    default:
      TORCH_CHECK(false, "LibTorch dtype ", c10::toString(type),
                  " has no safetensors equivalent (supported: float64/32/16, bfloat16, int64/32/16/8, "
                  "uint8, bool, float8)");
  }
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path,
                                                       std::shared_ptr<ReadStats> stats) {
  auto mapping = std::make_shared<Mapping>();
  uint64_t file_size = 0;
  mapping->fd = open_regular_file(path, &file_size).release();
  TORCH_CHECK(file_size >= 8, path, ": file is ", file_size,
              " bytes, too short for a safetensors file (it starts with an 8-byte header length)");

  uint64_t header_size = 0;
  pread_exact(mapping->fd, reinterpret_cast<char*>(&header_size), 8, 0, path, "<header length>");
  TORCH_CHECK(header_size <= file_size - 8, path, ": header length ", header_size,
              " exceeds the file size ", file_size, " (truncated file, or not a safetensors file)");

  std::string header(header_size, '\0');
  pread_exact(mapping->fd, header.data(), header_size, 8, path, "<header>");
  const uint64_t data_offset = 8 + header_size;

  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->stats_ = std::move(stats);
  file->data_size_ = file_size - data_offset;
  file->tensors_ = parse_header(path, header.data(), header.size(), file->data_size_, &file->metadata_);
  for (size_t i = 0; i < file->tensors_.size(); ++i) file->index_[file->tensors_[i].name] = i;

  mapping->size = file_size;
  mapping->base = mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, mapping->fd, 0);
  TORCH_CHECK(mapping->base != MAP_FAILED, path, ": mmap of ", file_size, " bytes failed: ",
              std::strerror(errno));
  file->data_ = static_cast<const char*>(mapping->base) + data_offset;
  file->mapping_ = std::move(mapping);
  return file;
}

SafetensorsFile::~SafetensorsFile() = default;

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& info : tensors_) out.push_back(info.name);
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const { return index_.count(name) != 0; }

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto it = index_.find(name);
  TORCH_CHECK(it != index_.end(), path_, ": no tensor named '", name, "' (the file has ",
              tensors_.size(), " tensors)");
  return tensors_[it->second];
}

at::Tensor SafetensorsFile::view(const std::string& name) const {
  const TensorInfo& tensor = info(name);
  const at::ScalarType type = storage_scalar_type(tensor.dtype);
  std::shared_ptr<void> keep_alive = mapping_;
  void* ptr = const_cast<char*>(data_ + tensor.begin);
  return at::from_blob(ptr, tensor.shape, [keep_alive](void*) {}, at::TensorOptions().dtype(type));
}

at::Tensor SafetensorsFile::read(const std::string& name, std::optional<at::ScalarType> dtype) const {
  const TensorInfo& tensor = info(name);
  at::Tensor out = at::empty(tensor.shape, at::TensorOptions().dtype(storage_scalar_type(tensor.dtype)));
  const auto* mapping = static_cast<const Mapping*>(mapping_.get());
  const uint64_t file_offset =
      static_cast<uint64_t>(data_ - static_cast<const char*>(mapping->base)) + tensor.begin;
  pread_exact(mapping->fd, static_cast<char*>(out.data_ptr()), tensor.nbytes(), file_offset, path_, name);
  if (stats_) {
    stats_->bytes_read += tensor.nbytes();
    stats_->tensors_read += 1;
  }
  return maybe_convert(std::move(out), tensor.dtype, dtype);
}

std::optional<at::Tensor> SafetensorsFile::read_if_present(const std::string& name) const {
  if (!contains(name)) return std::nullopt;
  return read(name);
}

at::Tensor SafetensorsFile::read_slices(const std::string& name, int64_t dim,
                                        const std::vector<Range>& ranges,
                                        std::optional<at::ScalarType> dtype) const {
  const TensorInfo& tensor = info(name);
  const int64_t ndim = static_cast<int64_t>(tensor.shape.size());
  TORCH_CHECK(ndim > 0, path_, ": tensor '", name, "' is a scalar and cannot be sliced");
  TORCH_CHECK(dim >= -ndim && dim < ndim, path_, ": tensor '", name, "' has ", ndim,
              " dims; cannot slice along dim ", dim);
  if (dim < 0) dim += ndim;
  const int64_t extent = tensor.shape[dim];
  int64_t total = 0;
  for (const Range& range : ranges) {
    TORCH_CHECK(range.begin >= 0 && range.begin <= range.end && range.end <= extent, path_,
                ": tensor '", name, "' of shape ", at::IntArrayRef(tensor.shape), ": range [",
                range.begin, ", ", range.end, ") along dim ", dim, " is out of bounds for size ",
                extent);
    total += range.size();
  }

  std::vector<int64_t> out_shape = tensor.shape;
  out_shape[dim] = total;
  at::Tensor out = at::empty(out_shape, at::TensorOptions().dtype(storage_scalar_type(tensor.dtype)));

  // The tensor is [outer, extent, inner]: each (outer index, range) is one contiguous span.
  int64_t outer = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= tensor.shape[d];
  uint64_t inner_bytes = static_cast<uint64_t>(st_dtype_size(tensor.dtype));
  for (int64_t d = dim + 1; d < ndim; ++d) inner_bytes *= static_cast<uint64_t>(tensor.shape[d]);
  const uint64_t src_row = static_cast<uint64_t>(extent) * inner_bytes;
  const uint64_t dst_row = static_cast<uint64_t>(total) * inner_bytes;

  const auto* mapping = static_cast<const Mapping*>(mapping_.get());
  const uint64_t file_offset =
      static_cast<uint64_t>(data_ - static_cast<const char*>(mapping->base)) + tensor.begin;
  char* dst = static_cast<char*>(out.data_ptr());
  uint64_t copied = 0;
  for (int64_t o = 0; o < outer; ++o) {
    uint64_t dst_pos = static_cast<uint64_t>(o) * dst_row;
    for (const Range& range : ranges) {
      const uint64_t bytes = static_cast<uint64_t>(range.size()) * inner_bytes;
      if (bytes == 0) continue;
      const uint64_t src_pos = static_cast<uint64_t>(o) * src_row +
                               static_cast<uint64_t>(range.begin) * inner_bytes;
      pread_exact(mapping->fd, dst + dst_pos, bytes, file_offset + src_pos, path_, name);
      dst_pos += bytes;
      copied += bytes;
    }
  }
  if (stats_) {
    stats_->bytes_read += copied;
    stats_->tensors_read += 1;
  }
  return maybe_convert(std::move(out), tensor.dtype, dtype);
}

// ---------------------------------------------------------------------------------------------
// Writer

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata,
                      const std::map<std::string, StDtype>& stored_as) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> contiguous;
  contiguous.reserve(tensors.size());
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK(tensor.defined(), path, ": tensor '", name, "' is undefined");
    TORCH_CHECK(name != "__metadata__", path, ": '__metadata__' is reserved and cannot name a tensor");
    TORCH_CHECK(!header.contains(name), path, ": tensor '", name, "' is given twice");
    StDtype dtype = from_scalar_type(tensor.scalar_type());
    const auto raw = stored_as.find(name);
    if (raw != stored_as.end()) {
      TORCH_CHECK(tensor.element_size() == 1 && st_dtype_size(raw->second) == 1, path, ": tensor '", name,
                  "' is ", tensor.scalar_type(), ", which cannot be written as ", st_dtype_name(raw->second),
                  " (give the raw bytes as uint8)");
      dtype = raw->second;
    }
    at::Tensor data = tensor.to(at::kCPU).contiguous();
    const uint64_t nbytes = static_cast<uint64_t>(data.numel()) * st_dtype_size(dtype);
    header[name] = {{"dtype", st_dtype_name(dtype)},
                    {"shape", data.sizes().vec()},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
    contiguous.push_back(std::move(data));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  AtomicFile out(path);
  const uint64_t header_size = text.size();
  out.write(&header_size, 8);
  out.write(text.data(), text.size());
  for (const auto& data : contiguous) out.write(data.data_ptr(), data.nbytes());
  out.commit();
}

// ---------------------------------------------------------------------------------------------
// Checkpoint

namespace {

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool has_weight_prefix(const std::string& filename) {
  return filename.rfind("diffusion_pytorch_model", 0) == 0 || filename.rfind("model", 0) == 0;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

/// The weights file of a folder: one recognised index, else one recognised .safetensors file.
std::string find_weights_in_folder(const std::string& dir) {
  std::vector<std::string> indexes;
  std::vector<std::string> singles;
  std::vector<std::string> others;
  for (const auto& entry : fs::directory_iterator(dir)) {
    // Anything but a folder counts, so that a FIFO or a dangling link named like the weights is
    // reported by open() with its reason rather than skipped.
    if (entry.is_directory()) continue;
    const std::string filename = entry.path().filename().string();
    if (ends_with(filename, ".safetensors.index.json")) {
      (has_weight_prefix(filename) ? indexes : others).push_back(filename);
    } else if (ends_with(filename, ".safetensors")) {
      (has_weight_prefix(filename) ? singles : others).push_back(filename);
    }
  }
  std::sort(indexes.begin(), indexes.end());
  std::sort(singles.begin(), singles.end());
  std::sort(others.begin(), others.end());
  if (!indexes.empty()) {
    TORCH_CHECK(indexes.size() == 1, dir, ": ambiguous weights: several index files (",
                join(indexes), "); keep one, or open the index file directly");
    return (fs::path(dir) / indexes.front()).string();
  }
  TORCH_CHECK(!singles.empty(), dir,
              ": no weights found (expected diffusion_pytorch_model*.safetensors or "
              "model*.safetensors, or their .safetensors.index.json)",
              others.empty() ? std::string() : "; other safetensors files here: " + join(others));
  TORCH_CHECK(singles.size() == 1, dir, ": ambiguous weights: several files (", join(singles),
              ") and no .safetensors.index.json; add the index, or open one file directly");
  return (fs::path(dir) / singles.front()).string();
}

}  // namespace

Checkpoint Checkpoint::open(const std::string& path) {
  TORCH_CHECK(fs::exists(fs::symlink_status(path)), path, ": no such file or directory");
  std::string target = path;
  if (fs::is_directory(path)) target = find_weights_in_folder(path);

  Checkpoint checkpoint;
  checkpoint.path_ = path;
  checkpoint.stats_ = std::make_shared<ReadStats>();
  if (!fs::is_directory(path) && is_gguf(target)) {
    checkpoint.open_gguf(target);
    return checkpoint;
  }

  std::vector<std::string> file_paths;
  std::map<std::string, std::string> index_map;  // tensor -> file name, from the index
  if (ends_with(target, ".index.json")) {
    const nlohmann::json index = read_json_file(target);
    TORCH_CHECK(index.is_object() && index.contains("weight_map") && index.at("weight_map").is_object(),
                target, ": expected an object with a \"weight_map\" object (tensor name -> file)");
    std::set<std::string> files;
    for (const auto& [name, file] : index.at("weight_map").items()) {
      TORCH_CHECK(file.is_string(), target, ": weight_map entry '", name, "' is not a file name");
      // Shards live beside the index: a name that leaves the folder (absolute, or through "..")
      // would read whatever file it points at.
      const fs::path relative = fs::path(file.get<std::string>()).lexically_normal();
      const bool inside = !file.get<std::string>().empty() && relative.is_relative() && !relative.empty() &&
                          *relative.begin() != "..";
      TORCH_CHECK(inside, target, ": weight_map entry '", name, "' names ", quoted(file.get<std::string>()),
                  ", which is outside the index's folder; shards must sit beside the index");
      index_map[name] = file.get<std::string>();
      files.insert(file.get<std::string>());
    }
    const fs::path dir = fs::path(target).parent_path();
    for (const auto& file : files) {
      const std::string file_path = (dir / file).string();
      const std::string problem = regular_file_problem(file_path);
      if (!problem.empty()) {
        const auto listed = std::find_if(index_map.begin(), index_map.end(),
                                         [&](const auto& item) { return item.second == file; });
        TORCH_CHECK(false, target, ": names '", file, "' (for tensor '", listed->first, "' and maybe others) but ",
                    problem);
      }
      file_paths.push_back(file_path);
    }
  } else {
    file_paths.push_back(target);
  }

  // Every tensor of every file counts, also one a (stale) index forgot to list; the index is
  // then checked against the files.
  for (const auto& file_path : file_paths) {
    const size_t file_index = checkpoint.files_.size();
    auto file = SafetensorsFile::open(file_path, checkpoint.stats_);
    for (const auto& name : file->names()) {
      const auto [it, inserted] = checkpoint.file_index_.emplace(name, file_index);
      TORCH_CHECK(inserted, path, ": tensor '", name, "' is in two files: ",
                  checkpoint.files_[it->second]->path(), " and ", file_path);
    }
    checkpoint.files_.push_back(std::move(file));
  }
  for (const auto& [name, file] : index_map) {
    const auto it = checkpoint.file_index_.find(name);
    const std::string expected = (fs::path(target).parent_path() / file).string();
    TORCH_CHECK(it != checkpoint.file_index_.end(), target, ": tensor '", name,
                "' is listed for ", file, " but ", expected, " does not contain it");
    TORCH_CHECK(fs::path(checkpoint.files_[it->second]->path()) == fs::path(expected), target,
                ": tensor '", name, "' is listed for ", file, " but is in ",
                checkpoint.files_[it->second]->path());
  }
  return checkpoint;
}

std::vector<std::string> Checkpoint::source_names() const {
  std::vector<std::string> out;
  if (gguf_) {
    for (const auto& item : *gguf_tensors_) out.push_back(item.first);
    return out;
  }
  out.reserve(file_index_.size());
  for (const auto& item : file_index_) out.push_back(item.first);
  return out;
}

std::vector<std::string> Checkpoint::names() const {
  if (!mapped_) return source_names();
  std::vector<std::string> out;
  out.reserve(mapped_->size());
  for (const auto& item : *mapped_) out.push_back(item.first);
  return out;
}

bool Checkpoint::contains(const std::string& name) const {
  return mapped_ ? mapped_->count(name) != 0 : find_source(name) != nullptr;
}

const TensorInfo* Checkpoint::find_source(const std::string& key) const {
  if (gguf_) {
    const auto found = gguf_tensors_->find(key);
    return found == gguf_tensors_->end() ? nullptr : &found->second;
  }
  const auto it = file_index_.find(key);
  return it == file_index_.end() ? nullptr : &files_[it->second]->info(key);
}

const TensorInfo& Checkpoint::source_info(const std::string& key) const {
  const TensorInfo* info = find_source(key);
  TORCH_CHECK(info != nullptr, path_, ": checkpoint has no tensor named '", key, "' (it has ",
              gguf_ ? gguf_tensors_->size() : file_index_.size(), " tensors)");
  return *info;
}

at::Tensor Checkpoint::source_read(const std::string& key, const std::vector<Range>& rows,
                                   std::optional<at::ScalarType> dtype, int64_t dim,
                                   const std::vector<Range>& columns) const {
  source_info(key);  // names the checkpoint when absent
  if (gguf_) return gguf_read(key, rows, dtype, dim, columns);
  const SafetensorsFile& file = *files_[file_index_.at(key)];
  if (dim == 0) return rows.empty() ? file.read(key, dtype) : file.read_slices(key, 0, rows, dtype);
  if (rows.empty()) return file.read_slices(key, dim, columns, dtype);
  const at::Tensor part = file.read_slices(key, 0, rows, dtype);
  std::vector<at::Tensor> pieces;
  for (const Range& range : columns) pieces.push_back(part.narrow(dim, range.begin, range.size()));
  return at::cat(pieces, dim);
}

const Checkpoint::MappedTensor& Checkpoint::mapped_tensor(const std::string& name) const {
  const auto it = mapped_->find(name);
  TORCH_CHECK(it != mapped_->end(), path_, ": checkpoint has no tensor mapped to '", name, "' (it maps ",
              mapped_->size(), " names)");
  return it->second;
}

const SafetensorsFile& Checkpoint::file_of(const std::string& name) const {
  const std::string& key = mapped_ ? mapped_tensor(name).pieces.front().key : name;
  source_info(key);
  TORCH_CHECK(!gguf_, path_, ": is a GGUF file, not safetensors (tensor '", name, "')");
  return *files_[file_index_.at(key)];
}

const std::string& Checkpoint::path_of(const std::string& name) const {
  const std::string& key = mapped_ ? mapped_tensor(name).pieces.front().key : name;
  source_info(key);
  return gguf_ ? gguf_->path() : files_[file_index_.at(key)]->path();
}

std::vector<std::string> Checkpoint::file_paths() const {
  if (gguf_) return {gguf_->path()};
  std::vector<std::string> out;
  for (const auto& file : files_) out.push_back(file->path());
  return out;
}

const TensorInfo& Checkpoint::info(const std::string& name) const {
  return mapped_ ? mapped_tensor(name).info : source_info(name);
}

at::Tensor Checkpoint::read(const std::string& name, std::optional<at::ScalarType> dtype) const {
  if (!mapped_) return source_read(name, {}, dtype);
  const MappedTensor& tensor = mapped_tensor(name);
  if (tensor.pieces.size() == 1 && !tensor.pieces.front().rows) return source_read(tensor.pieces.front().key, {}, dtype);
  const int64_t rows = tensor.info.shape.at(0);
  return read_slices(name, 0, {{0, rows}}, dtype);
}

at::Tensor Checkpoint::read_slices(const std::string& name, int64_t dim, const std::vector<Range>& ranges,
                                   std::optional<at::ScalarType> dtype) const {
  const std::string& whole = mapped_ ? mapped_tensor(name).pieces.front().key : name;
  const bool one_piece = !mapped_ || (mapped_tensor(name).pieces.size() == 1 && !mapped_tensor(name).pieces.front().rows);
  if (one_piece && !gguf_) return file_of(name).read_slices(whole, dim, ranges, dtype);
  if (one_piece) {
    const auto ndim = static_cast<int64_t>(source_info(whole).shape.size());
    TORCH_CHECK(dim >= -ndim && dim < std::max<int64_t>(ndim, 1), path_, ": tensor '", name, "' has ", ndim,
                " dimensions; cannot slice dim ", dim);
    if (dim < 0) dim += ndim;
    return dim == 0 ? source_read(whole, ranges, dtype) : source_read(whole, {}, dtype, dim, ranges);
  }
  const MappedTensor& tensor = mapped_tensor(name);
  const auto ndim = static_cast<int64_t>(tensor.info.shape.size());
  TORCH_CHECK(dim >= -ndim && dim < ndim, path_, ": tensor '", name, "' has ", ndim, " dimensions; cannot slice dim ",
              dim);
  if (dim < 0) dim += ndim;
  const int64_t extent = tensor.info.shape[static_cast<size_t>(dim)];
  for (const Range& range : ranges) {
    TORCH_CHECK(range.begin >= 0 && range.begin <= range.end && range.end <= extent, path_, ": range [", range.begin,
                ", ", range.end, ") of tensor '", name, "' is outside its dim ", dim, " of size ", extent);
  }
  std::vector<at::Tensor> parts;
  if (dim == 0) {
    // Each requested range, piece by piece: only the rows inside it are read from each piece;
    // consecutive rows of one source tensor go out in one read.
    std::string key;
    std::vector<Range> rows;
    const auto flush = [&] {
      if (!rows.empty()) parts.push_back(source_read(key, rows, dtype));
      rows.clear();
    };
    for (const Range& range : ranges) {
      int64_t offset = 0;
      for (const TensorPiece& piece : tensor.pieces) {
        const Range source = piece.rows ? *piece.rows : Range{0, source_info(piece.key).shape.at(0)};
        const int64_t begin = std::max(range.begin, offset);
        const int64_t end = std::min(range.end, offset + source.size());
        if (begin < end) {
          if (piece.key != key) flush();
          key = piece.key;
          rows.push_back({source.begin + begin - offset, source.begin + end - offset});
        }
        offset += source.size();
      }
    }
    flush();
  } else {
    // Along another dimension: each piece's rows, only the requested columns of them.
    for (const TensorPiece& piece : tensor.pieces) {
      parts.push_back(source_read(piece.key, piece.rows ? std::vector<Range>{*piece.rows} : std::vector<Range>{}, dtype,
                                  dim, ranges));
    }
  }
  if (parts.empty() && tensor.info.is_gguf_blocks()) return at::empty({0, 0}, at::TensorOptions().dtype(at::kByte));
  if (parts.empty()) {
    std::vector<int64_t> shape = tensor.info.shape;
    shape[0] = 0;
    return at::empty(shape, at::TensorOptions().dtype(dtype.value_or(storage_scalar_type(tensor.info.dtype))));
  }
  return parts.size() == 1 ? parts.front() : at::cat(parts, 0);
}

Checkpoint Checkpoint::with_mapping(const KeyMapping& mapping) const {
  TORCH_CHECK(!mapped_, path_, ": the checkpoint is already mapped; map its source names once");
  auto tensors = std::make_shared<std::map<std::string, MappedTensor>>();
  for (const auto& [name, pieces] : mapping) {
    TORCH_CHECK(!pieces.empty(), path_, ": the mapping gives '", name, "' no pieces");
    MappedTensor tensor;
    tensor.pieces = pieces;
    TensorInfo& info = tensor.info;
    info.name = name;
    for (size_t p = 0; p < pieces.size(); ++p) {
      const TensorPiece& piece = pieces[p];
      const TensorInfo* source = find_source(piece.key);
      TORCH_CHECK(source != nullptr, path_, ": '", name, "' is read from tensor '", piece.key,
                  "', which the file does not hold");
      TORCH_CHECK(pieces.size() == 1 || !source->shape.empty(), path_, ": '", name, "' joins several pieces, but '",
                  piece.key, "' is a scalar");
      if (piece.rows) {
        const int64_t extent = source->shape.empty() ? 0 : source->shape[0];
        TORCH_CHECK(piece.rows->begin >= 0 && piece.rows->begin < piece.rows->end && piece.rows->end <= extent,
                    path_, ": '", name, "' reads rows [", piece.rows->begin, ", ", piece.rows->end, ") of tensor '",
                    piece.key, "', which has ", extent, " rows (shape ", c10::IntArrayRef(source->shape), ")");
      }
      std::vector<int64_t> shape = source->shape;
      if (piece.rows) shape[0] = piece.rows->size();
      if (p == 0) {
        info.dtype = source->dtype;
        info.ggml_block_type = source->ggml_block_type;
        info.shape = shape;
        continue;
      }
      const bool same_rows = std::equal(shape.begin() + 1, shape.end(), info.shape.begin() + 1, info.shape.end());
      TORCH_CHECK(source->dtype == info.dtype && source->ggml_block_type == info.ggml_block_type && same_rows, path_, ": '", name, "' joins '", pieces.front().key,
                  "' (", st_dtype_name(info.dtype), ") and '", piece.key, "' (", st_dtype_name(source->dtype),
                  ", shape ", c10::IntArrayRef(source->shape), "), which differ in dtype or row shape");
      info.shape[0] += shape[0];
    }
    info.begin = 0;
    info.end = info.is_gguf_blocks()
                                      ? ggml_bytes(static_cast<GgmlType>(info.ggml_block_type), info.numel())
                                      : static_cast<uint64_t>(info.numel() * st_dtype_size(info.dtype));
    tensors->emplace(name, std::move(tensor));
  }
  Checkpoint out = *this;
  out.mapped_ = std::move(tensors);
  return out;
}

}  // namespace shardit::io

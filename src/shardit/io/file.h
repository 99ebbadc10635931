#pragma once
// Opening untrusted input files: the file type is checked before anything can block (a FIFO, a
// device or a directory given where a file is expected), and every refusal names the path and why.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shardit::io {

/// An owned file descriptor, closed on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd();
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

/// Opens `path` read-only as a regular file, never blocking: the type is checked with stat()
/// first and the open itself is non-blocking, so a FIFO or a device is refused instead of waited
/// on. Errors name the path and the reason (missing, dangling symbolic link, a directory, a FIFO,
/// no permission). `size` (optional) receives the file size. With `follow_links` false, a
/// symbolic link at `path` is refused (for files served to others from a folder).
UniqueFd open_regular_file(const std::string& path, uint64_t* size = nullptr, bool follow_links = true);

/// Reads exactly `size` bytes at `offset` of `fd` (the file `path`) into `dst`, retrying short
/// reads; an error names the path, the tensor `name` and the byte (a file truncated while open
/// gives this error, where a read through a mapping would be killed by SIGBUS).
void pread_exact(int fd, char* dst, size_t size, uint64_t offset, const std::string& path, const std::string& name);

/// The whole content of the regular file `path`, refused (naming the path) when it is larger
/// than `max_bytes`; `follow_links` as for open_regular_file.
std::string read_regular_file(const std::string& path, uint64_t max_bytes, bool follow_links = true);

/// Why `path` cannot be read as a regular file ("" when it can): used where a file is looked for
/// by name, so that the error says "is a directory" or "is a FIFO" rather than "not found".
std::string regular_file_problem(const std::string& path);

/// Checks, before any work is done, that `path` can be written as a command's output: its folder
/// exists and accepts a new file (a temporary file is created there and removed), it is not a
/// folder, FIFO or device, and it is none of `inputs` (compared by device and inode, so another
/// spelling or a link of an input is refused too); an input that is a folder (a model folder)
/// stands for every file under it. Errors name the path and the reason.
void check_output_path(const std::string& path, const std::vector<std::string>& inputs);

/// A file written all or nothing: the bytes go to a temporary file in the same folder, which
/// commit() flushes to disk and renames onto `path`. A writer destroyed without commit() (an
/// error, a full disk, a file-size limit) removes the temporary file and leaves `path` as it was.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  /// Appends `size` bytes; throws naming the file on a write error (ENOSPC, EFBIG ...).
  void write(const void* data, size_t size);
  /// Makes the written bytes the content of `path`.
  void commit();

 private:
  std::string path_;
  std::string temp_path_;
  UniqueFd fd_;
  bool committed_ = false;
};

}  // namespace shardit::io

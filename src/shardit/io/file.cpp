#include "shardit/io/file.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

namespace shardit::io {

namespace {

const char* type_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

std::string link_target(const std::string& path) {
  std::vector<char> buffer(4096);
  const ssize_t n = ::readlink(path.c_str(), buffer.data(), buffer.size() - 1);
  return n > 0 ? std::string(buffer.data(), static_cast<size_t>(n)) : std::string("?");
}

}  // namespace

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

std::string regular_file_problem(const std::string& path) {
  if (path.empty()) return "(empty path): no file named";
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int error = errno;
    struct stat link {};
    if (error == ENOENT && ::lstat(path.c_str(), &link) == 0 && S_ISLNK(link.st_mode)) {
      return path + ": is a symbolic link to '" + link_target(path) + "', which does not exist";
    }
    if (error == ELOOP) return path + ": symbolic link loop";
    if (error == ENOENT) return path + ": no such file (it does not exist)";
    return path + ": cannot access: " + std::strerror(error);
  }
  if (!S_ISREG(st.st_mode)) return path + ": is " + type_name(st.st_mode) + ", expected a regular file";
  return "";
}

UniqueFd open_regular_file(const std::string& path, uint64_t* size, bool follow_links) {
  if (!follow_links) {
    struct stat link {};
    TORCH_CHECK(::lstat(path.c_str(), &link) != 0 || !S_ISLNK(link.st_mode), path,
                ": is a symbolic link, which is not followed here");
  }
  // stat() first: open() on a FIFO blocks until a writer appears, even before fstat could look.
  const std::string problem = regular_file_problem(path);
  TORCH_CHECK(problem.empty(), problem);
  // O_NONBLOCK as well, for a file swapped for a FIFO between the stat and the open (and
  // O_NOFOLLOW for one swapped for a link).
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | (follow_links ? 0 : O_NOFOLLOW)));
  TORCH_CHECK(fd.get() >= 0, path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  TORCH_CHECK(::fstat(fd.get(), &st) == 0, path, ": cannot stat: ", std::strerror(errno));
  TORCH_CHECK(S_ISREG(st.st_mode), path, ": is ", type_name(st.st_mode), ", expected a regular file");
  const int flags = ::fcntl(fd.get(), F_GETFL);
  TORCH_CHECK(flags >= 0 && ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) == 0, path,
              ": cannot configure the descriptor: ", std::strerror(errno));
  if (size != nullptr) *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

void pread_exact(int fd, char* dst, size_t size, uint64_t offset, const std::string& path, const std::string& name) {
  size_t done = 0;
  while (done < size) {
    const ssize_t got = ::pread(fd, dst + done, size - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    TORCH_CHECK(got > 0, path, ": reading tensor '", name, "' failed at byte ", offset + done, ": ",
                got < 0 ? std::strerror(errno) : "unexpected end of file (was it truncated?)");
    done += static_cast<size_t>(got);
  }
}

std::string read_regular_file(const std::string& path, uint64_t max_bytes, bool follow_links) {
  uint64_t size = 0;
  const UniqueFd fd = open_regular_file(path, &size, follow_links);
  TORCH_CHECK(size <= max_bytes, path, ": is ", size, " bytes, more than the limit of ", max_bytes,
              " bytes for this kind of file");
  std::string text(static_cast<size_t>(size), '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t got = ::read(fd.get(), text.data() + done, text.size() - done);
    if (got < 0 && errno == EINTR) continue;
    TORCH_CHECK(got >= 0, path, ": read failed: ", std::strerror(errno));
    if (got == 0) break;  // shrank meanwhile
    done += static_cast<size_t>(got);
  }
  text.resize(done);
  return text;
}

namespace {

namespace fs = std::filesystem;

// The folder of `path` ("." for a bare file name).
std::string folder_of(const std::string& path) {
  const std::string parent = fs::path(path).parent_path().string();
  return parent.empty() ? "." : parent;
}

// A new empty file "<folder>/.<name>.XXXXXX" (mode 0600 until commit).
UniqueFd make_temp(const std::string& path, std::string* temp_path) {
  std::string pattern = (fs::path(folder_of(path)) / ("." + fs::path(path).filename().string() + ".XXXXXX")).string();
  std::vector<char> buffer(pattern.begin(), pattern.end());
  buffer.push_back('\0');
  UniqueFd fd(::mkostemp(buffer.data(), O_CLOEXEC));
  TORCH_CHECK(fd.get() >= 0, path, ": cannot create a file in ", folder_of(path), ": ", std::strerror(errno));
  *temp_path = buffer.data();
  return fd;
}

}  // namespace

namespace {

bool same_file(const struct stat& a, const struct stat& b) { return a.st_dev == b.st_dev && a.st_ino == b.st_ino; }

/// The file under `folder` (recursively, links to files followed, links to folders not) that is
/// `target`, or "". Bounded: a folder of more entries than any model folder holds is refused.
std::string file_in_folder(const std::string& folder, const struct stat& target) {
  constexpr size_t kMaxEntries = 1000000;
  size_t entries = 0;
  std::error_code error;
  for (fs::recursive_directory_iterator it(folder, fs::directory_options::skip_permission_denied, error), end;
       !error && it != end; it.increment(error)) {
    TORCH_CHECK(++entries <= kMaxEntries, folder, ": holds more than ", kMaxEntries,
                " entries; an output path cannot be checked against it");
    struct stat entry {};
    if (::stat(it->path().c_str(), &entry) == 0 && !S_ISDIR(entry.st_mode) && same_file(entry, target)) {
      return it->path().string();
    }
  }
  return "";
}

}  // namespace

void check_output_path(const std::string& path, const std::vector<std::string>& inputs) {
  TORCH_CHECK(!path.empty(), "the output path is empty");
  TORCH_CHECK(fs::path(path).has_filename(), path, ": the output must name a file, not a folder");
  const std::string folder = folder_of(path);
  struct stat folder_st {};
  TORCH_CHECK(::stat(folder.c_str(), &folder_st) == 0, path, ": cannot write here: folder ", folder, ": ",
              std::strerror(errno));
  TORCH_CHECK(S_ISDIR(folder_st.st_mode), path, ": cannot write here: ", folder, " is not a folder");
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    TORCH_CHECK(S_ISREG(st.st_mode), path, ": is ", type_name(st.st_mode),
                "; the output must be a regular file (it is replaced as a whole)");
    for (const auto& input : inputs) {
      struct stat in {};
      if (::stat(input.c_str(), &in) != 0) continue;
      const std::string same = S_ISDIR(in.st_mode) ? file_in_folder(input, st) : (same_file(in, st) ? input : "");
      TORCH_CHECK(same.empty(), path, ": is also an input of this command (", same,
                  S_ISDIR(in.st_mode) ? ", in the folder " + input : std::string(),
                  "); writing the output there would destroy it; choose another output path");
    }
  }
  // Proves that a file can be created in the folder (permissions, read-only mounts, quota on
  // inodes) before the expensive work; the output itself is written the same way (AtomicFile).
  std::string probe;
  const UniqueFd fd = make_temp(path, &probe);
  ::unlink(probe.c_str());
}

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  fd_ = make_temp(path_, &temp_path_);
}

AtomicFile::~AtomicFile() {
  if (!committed_ && !temp_path_.empty()) ::unlink(temp_path_.c_str());
}

void AtomicFile::write(const void* data, size_t size) {
  const char* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_.get(), bytes, size);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, path_, ": writing failed: ", n < 0 ? std::strerror(errno) : "no progress",
                "; the output was not written (nothing was changed at this path)");
    bytes += n;
    size -= static_cast<size_t>(n);
  }
}

void AtomicFile::commit() {
  TORCH_INTERNAL_ASSERT(!committed_, path_, ": committed twice");
  // The permissions a plain create would give (0666 less the umask).
  const mode_t mask = ::umask(0);
  ::umask(mask);
  TORCH_CHECK(::fchmod(fd_.get(), 0666 & ~mask) == 0, path_, ": cannot set permissions: ", std::strerror(errno));
  TORCH_CHECK(::fsync(fd_.get()) == 0, path_, ": writing failed at flush: ", std::strerror(errno),
              "; the output was not written (nothing was changed at this path)");
  const int fd = fd_.release();
  TORCH_CHECK(::close(fd) == 0, path_, ": writing failed at close: ", std::strerror(errno));
  TORCH_CHECK(::rename(temp_path_.c_str(), path_.c_str()) == 0, path_, ": cannot move the written file into place: ",
              std::strerror(errno));
  committed_ = true;
}

}  // namespace shardit::io

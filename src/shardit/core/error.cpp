#include "shardit/core/error.h"

#include <filesystem>
#include <new>
#include <system_error>

namespace shardit {

std::string error_message(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  // std::filesystem's own words ("filesystem error: status: Too many levels of symbolic links
  // [x]") put the path last: the path first, as every other message does.
  if (const auto* fs_error = dynamic_cast<const std::filesystem::filesystem_error*>(&e)) {
    std::string text = fs_error->path1().empty() ? std::string("a file") : fs_error->path1().string();
    if (!fs_error->path2().empty()) text += " -> " + fs_error->path2().string();
    text += ": " + fs_error->code().message();
    if (fs_error->code() == std::errc::too_many_symbolic_link_levels) text += " (a symbolic link loop)";
    return text;
  }
  // Raised by a container or an allocation outside LibTorch (whose own allocator names the bytes
  // it asked for): "std::bad_alloc" alone says nothing a user can act on.
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
    return std::string("out of memory (") + e.what() +
           "): the work needs more memory than this host gives the process; make it smaller (image size, "
           "batch, sequence length) or split it over more ranks (--nproc-per-node)";
  }
  return e.what();
}

std::string printable_line(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte != 0x7f) {
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[byte >> 4];
      out += kHex[byte & 0xf];
    }
  }
  return out;
}

}  // namespace shardit

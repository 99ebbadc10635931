#include "shardit/serving/multipart.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

#include "shardit/io/json.h"
#include "shardit/serving/api.h"

namespace shardit::serving {

namespace {

/// RFC 2046's longest boundary.
constexpr size_t kMaxBoundary = 70;
/// The longest file name accepted (a file system's usual bound on one name).
constexpr size_t kMaxFilename = 255;
/// The longest part name: every field name is far shorter.
constexpr size_t kMaxName = 64;

std::string lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.remove_suffix(1);
  return text;
}

/// RFC 7230's token characters (header names, parameter names, unquoted values).
bool is_token_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) != 0 || std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

/// The media type of a Content-Type value, in lower case, without its parameters.
std::string media_type(std::string_view content_type) {
  return lower(trim(content_type.substr(0, content_type.find(';'))));
}

/// At most 40 bytes of a client's text, quoted (control characters escaped) for a message.
std::string excerpt(std::string_view text) {
  const bool cut = text.size() > 40;
  return io::quoted(std::string(text.substr(0, 40))) + (cut ? "..." : "");
}

/// One `; key=value` list (a Content-Type's or a Content-Disposition's parameters), starting at
/// the first ';'. Values are tokens or quoted strings (backslash escapes a character). Throws
/// the message `what(...)` gives for a malformed list or a key given twice.
std::vector<std::pair<std::string, std::string>> parameters(std::string_view text, const std::string& where) {
  std::vector<std::pair<std::string, std::string>> out;
  size_t p = text.find(';');
  if (p == std::string_view::npos) return out;
  const auto malformed = [&](const std::string& why) {
    return ApiError(400, fmt::format("{}: {} in {}", where, why, excerpt(text)));
  };
  while (p < text.size()) {
    if (text[p] != ';') throw malformed(fmt::format("'{}' where ';' or the end belongs", text[p]));
    ++p;
    while (p < text.size() && (text[p] == ' ' || text[p] == '\t')) ++p;
    if (p == text.size()) break;  // a trailing ';'
    const size_t key_start = p;
    while (p < text.size() && is_token_char(text[p])) ++p;
    const std::string key = lower(text.substr(key_start, p - key_start));
    if (key.empty() || p == text.size() || text[p] != '=') throw malformed("a parameter without '=value'");
    ++p;
    std::string value;
    if (p < text.size() && text[p] == '"') {
      ++p;
      bool closed = false;
      while (p < text.size()) {
        const char c = text[p++];
        if (c == '"') {
          closed = true;
          break;
        }
        if (c == '\\' && p < text.size()) {
          value += text[p++];
        } else {
          value += c;
        }
      }
      if (!closed) throw malformed(fmt::format("the quoted value of '{}' does not end", key));
    } else {
      const size_t value_start = p;
      while (p < text.size() && is_token_char(text[p])) ++p;
      value = std::string(text.substr(value_start, p - value_start));
      if (value.empty()) throw malformed(fmt::format("'{}' has an empty value", key));
    }
    while (p < text.size() && (text[p] == ' ' || text[p] == '\t')) ++p;
    for (const auto& [earlier, unused] : out) {
      if (earlier == key) throw malformed(fmt::format("'{}' is given twice", key));
    }
    out.emplace_back(key, std::move(value));
  }
  return out;
}

/// A part name a field may have: what is safe to echo and can name no header or path.
bool is_plain_name(const std::string& name) {
  if (name.empty() || name.size() > kMaxName) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == '.' || c == '-' || c == '[' ||
           c == ']';
  });
}

/// Why a client's file name is refused ("" when it is accepted): it is only ever quoted in
/// messages, but a name with folders in it says the client meant a path.
std::string filename_problem(const std::string& filename) {
  if (filename.size() > kMaxFilename) return fmt::format("is {} bytes long; at most {} are accepted", filename.size(), kMaxFilename);
  for (const char c : filename) {
    if (c == '/' || c == '\\') return fmt::format("holds the path character '{}'; send the file's own name, without folders", c);
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) return fmt::format("holds the control character 0x{:02x}", byte);
  }
  if (filename == "." || filename == "..") return "names a folder";
  return "";
}

/// The header lines of one part (its head without the empty line) into `part`.
void read_part_head(std::string_view head, size_t index, FormPart& part) {
  const std::string where = fmt::format("part {}", index + 1);
  bool disposition = false, type = false, encoding = false;
  while (!head.empty()) {
    const size_t end = head.find("\r\n");
    const std::string_view line = head.substr(0, end);
    head.remove_prefix(end == std::string_view::npos ? head.size() : end + 2);
    for (const char c : line) {
      const auto byte = static_cast<unsigned char>(c);
      if ((byte < 0x20 && c != '\t') || byte == 0x7f) {
        throw ApiError(400, fmt::format("{}: its head holds the control character 0x{:02x} (a header line ends "
                                        "with CRLF, and nothing else is a line end)",
                                        where, byte));
      }
    }
    if (line.empty() || line.front() == ' ' || line.front() == '\t') {
      throw ApiError(400, fmt::format("{}: a header line {} is empty or folded (starts with a space); write each "
                                      "header on one line",
                                      where, excerpt(line)));
    }
    const size_t colon = line.find(':');
    const std::string_view raw_name = line.substr(0, colon);
    if (colon == std::string_view::npos || raw_name.empty() ||
        !std::all_of(raw_name.begin(), raw_name.end(), is_token_char)) {
      throw ApiError(400, fmt::format("{}: the head line {} is not a header (Name: value)", where, excerpt(line)));
    }
    const std::string name = lower(raw_name);
    const std::string_view value = trim(line.substr(colon + 1));
    const auto once = [&](bool& seen, const char* header) {
      if (seen) throw ApiError(400, fmt::format("{}: its head gives {} twice", where, header));
      seen = true;
    };
    if (name == "content-disposition") {
      once(disposition, "Content-Disposition");
      const std::string kind = media_type(value);
      if (kind != "form-data") {
        throw ApiError(400, fmt::format("{}: its Content-Disposition is {}, not form-data", where, excerpt(kind)));
      }
      for (auto& [key, text] : parameters(value, where + "'s Content-Disposition")) {
        if (key == "name") {
          part.name = std::move(text);
        } else if (key == "filename") {
          part.filename = std::move(text);
        } else if (key == "filename*") {
          throw ApiError(400, fmt::format("{}: 'filename*' is not accepted (RFC 7578 4.2); give the file name as "
                                          "filename=\"...\" in UTF-8",
                                          where));
        }
      }
    } else if (name == "content-type") {
      once(type, "Content-Type");
      part.content_type = media_type(value);
      if (part.content_type.rfind("multipart/", 0) == 0) {
        throw ApiError(415, fmt::format("{}: a nested multipart body ({}) is not accepted; send each file as its "
                                        "own part of the form",
                                        where, excerpt(part.content_type)));
      }
    } else if (name == "content-transfer-encoding") {
      once(encoding, "Content-Transfer-Encoding");
      const std::string transfer = lower(value);
      if (transfer != "7bit" && transfer != "8bit" && transfer != "binary") {
        throw ApiError(400, fmt::format("{}: the Content-Transfer-Encoding {} is not accepted; send the part's "
                                        "bytes as they are (binary)",
                                        where, excerpt(value)));
      }
    }
    // RFC 7578 4.8: any other header of a part is ignored.
  }
  if (!disposition) {
    throw ApiError(400, fmt::format("{}: it has no Content-Disposition header; each part needs "
                                    "'Content-Disposition: form-data; name=\"...\"'",
                                    where));
  }
  if (!is_plain_name(part.name)) {
    throw ApiError(400, fmt::format("{}: its name {} is not a field name (1 to {} letters, digits and _ . - [ ])",
                                    where, excerpt(part.name), kMaxName));
  }
  if (part.filename) {
    const std::string problem = filename_problem(*part.filename);
    if (!problem.empty()) {
      throw ApiError(400, fmt::format("{}: the file name {} {}", part.label(index), excerpt(*part.filename), problem),
                     part.name);
    }
  }
}

}  // namespace

bool FormPart::is_file() const {
  return filename.has_value() ||
         (!content_type.empty() && content_type != "text/plain" && content_type != "application/json");
}

std::string FormPart::label(size_t index) const { return fmt::format("part {} ({})", index + 1, io::quoted(name)); }

bool is_form_data(const std::string& content_type) { return media_type(content_type) == "multipart/form-data"; }

std::string multipart_boundary(const std::string& content_type) {
  std::string boundary;
  bool found = false;
  for (auto& [key, value] : parameters(content_type, "the Content-Type")) {
    if (key == "boundary") boundary = std::move(value), found = true;
  }
  if (!found) {
    throw ApiError(400, "the Content-Type multipart/form-data has no boundary parameter "
                        "('multipart/form-data; boundary=...')");
  }
  // RFC 2046's bchars; a space may not end it.
  const bool allowed = std::all_of(boundary.begin(), boundary.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) != 0 || std::string_view("'()+_,-./:=? ").find(c) != std::string_view::npos;
  });
  if (boundary.empty() || boundary.size() > kMaxBoundary || !allowed || boundary.back() == ' ') {
    throw ApiError(400, fmt::format("the multipart boundary {} is not one of RFC 2046: 1 to {} letters, digits or "
                                    "'()+_,-./:=? (not ending in a space)",
                                    excerpt(boundary), kMaxBoundary));
  }
  return boundary;
}

std::vector<FormPart> parse_multipart(std::string_view body, const std::string& boundary,
                                      const MultipartLimits& limits) {
  const std::string delimiter = "--" + boundary;
  const std::string next_delimiter = "\r\n" + delimiter;
  size_t pos = 0;
  if (body.substr(0, delimiter.size()) == delimiter) {
    pos = delimiter.size();
  } else {
    // A preamble (ignored) ends with the line end before the first boundary line.
    const size_t first = body.find(next_delimiter);
    if (first == std::string_view::npos) {
      throw ApiError(400, fmt::format("the multipart body holds no boundary line {} (the Content-Type's boundary); "
                                      "the body is not the form its Content-Type announces",
                                      io::quoted(delimiter)));
    }
    pos = first + next_delimiter.size();
  }
  std::vector<FormPart> parts;
  for (size_t index = 0;; ++index) {
    // After a boundary line: "--" closes the form (an epilogue after it is ignored); otherwise
    // optional spaces, then the line end, then the next part's head.
    if (body.substr(pos, 2) == "--") break;
    while (pos < body.size() && (body[pos] == ' ' || body[pos] == '\t')) ++pos;
    if (pos == body.size()) {
      throw ApiError(400, fmt::format("the multipart body ends after a boundary line, without the closing {}--; "
                                      "it was cut short",
                                      delimiter));
    }
    if (body.substr(pos, 2) != "\r\n") {
      throw ApiError(400, fmt::format("boundary line {} is followed by {} instead of a line end (CRLF) or \"--\"; "
                                      "the boundary must not occur inside a part",
                                      index + 1, excerpt(body.substr(pos, 16))));
    }
    pos += 2;
    if (parts.size() == limits.max_parts) {
      throw ApiError(400, fmt::format("the form has more than {} parts; send at most {} (the images and the "
                                      "fields, each once)",
                                      limits.max_parts, limits.max_parts));
    }
    FormPart part;
    size_t content_start = pos + 2;
    if (body.substr(pos, 2) != "\r\n") {
      const std::string_view window = body.substr(pos, limits.max_part_head_bytes);
      const size_t head_end = window.find("\r\n\r\n");
      if (head_end == std::string_view::npos) {
        throw ApiError(400, window.size() < limits.max_part_head_bytes
                                ? fmt::format("part {}: the body ends inside its head (no empty line after its "
                                              "headers); it was cut short",
                                              index + 1)
                                : fmt::format("part {}: its head is longer than {} bytes", index + 1,
                                              limits.max_part_head_bytes));
      }
      read_part_head(body.substr(pos, head_end), index, part);
      content_start = pos + head_end + 4;
    } else {
      read_part_head({}, index, part);  // no headers: refused for its missing Content-Disposition
    }
    const size_t end = body.find(next_delimiter, content_start);
    if (end == std::string_view::npos) {
      throw ApiError(400, fmt::format("{} never ends: no boundary line {} follows it (the body was cut short, or "
                                      "its boundary is not the Content-Type's)",
                                      part.label(index), io::quoted(delimiter)),
                     part.name);
    }
    part.data = body.substr(content_start, end - content_start);
    if (part.data.empty()) {
      throw ApiError(400, fmt::format("{} is empty (0 bytes); leave a field out rather than send it empty",
                                      part.label(index)),
                     part.name);
    }
    if (!part.is_file() && part.data.size() > limits.max_text_bytes) {
      throw ApiError(400, fmt::format("{} is a text field of {} bytes; at most {} are accepted", part.label(index),
                                      part.data.size(), limits.max_text_bytes),
                     part.name);
    }
    parts.push_back(std::move(part));
    pos = end + next_delimiter.size();
  }
  if (parts.empty()) throw ApiError(400, "the form has no parts");
  return parts;
}

}  // namespace shardit::serving

#pragma once
// multipart/form-data bodies (RFC 7578), as OpenAI's clients send POST /v1/images/edits: the
// boundary of a Content-Type, and a whole body (read under the server's body cap) split into its
// parts. Parts are views into the body, so nothing is copied or allocated for a part's bytes, and
// the count of parts is checked before one more is kept. Anything malformed, ambiguous or hostile
// is an ApiError (400, or 415 for a nested multipart part) naming the part and what to do; a
// client's file name is only ever checked and quoted in messages, never used as a path.
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace shardit::serving {

/// Bounds on a form, checked while it is parsed.
struct MultipartLimits {
  /// The most parts: 10 images and every field of the request fit well within it.
  size_t max_parts = 64;
  /// The most bytes of one part's head (its header lines and the empty line that ends them).
  size_t max_part_head_bytes = 4096;
  /// The most bytes of a text field's value (a part without a file name); files are bounded only
  /// by the body.
  size_t max_text_bytes = size_t{64} << 10;
};

/// One part of a form.
struct FormPart {
  /// Its Content-Disposition name: 1 to 64 of A-Za-z0-9 and _ . - [ ].
  std::string name;
  /// Its file name where it has one (checked: no path characters, no control characters).
  std::optional<std::string> filename;
  /// Its Content-Type's media type in lower case ("image/png"), "" when it has none.
  std::string content_type;
  /// Its bytes: a view into the body it was parsed from (never empty).
  std::string_view data;

  /// A file part: one with a file name, or with a Content-Type other than text (text/plain,
  /// application/json), as clients send files.
  bool is_file() const;
  /// How messages name it: `part 3 ("prompt")`.
  std::string label(size_t index) const;
};

/// Whether a Content-Type is multipart/form-data (its media type, in any case).
bool is_form_data(const std::string& content_type);

/// The boundary of a `multipart/form-data; boundary=...` Content-Type (RFC 2046: 1 to 70
/// characters of its set, quoted or not); throws ApiError 400 naming what is wrong.
std::string multipart_boundary(const std::string& content_type);

/// Splits `body` into its parts (RFC 7578 over RFC 2046's framing: CRLF line ends, a preamble
/// and an epilogue ignored). Every part needs a Content-Disposition `form-data` with a name, may
/// have a Content-Type (not multipart: nested forms are refused, 415) and a file name, and holds
/// at least one byte. Throws ApiError naming the part for: a boundary line that never comes or
/// never closes, more than `limits.max_parts` parts, a head over `limits.max_part_head_bytes` or
/// with control characters or folded lines, a header given twice, a name or file name outside
/// the rules above, `filename*`, an encoded part (Content-Transfer-Encoding other than 7bit, 8bit
/// or binary), an empty part, a text field over `limits.max_text_bytes`.
std::vector<FormPart> parse_multipart(std::string_view body, const std::string& boundary,
                                      const MultipartLimits& limits = {});

}  // namespace shardit::serving

// multipart/form-data without a server: the parser's framing, part heads and bounds (each
// refusal named), and a form turned into the same request a JSON body gives, through the same
// checks.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "shardit/io/png.h"
#include "shardit/serving/api.h"
#include "shardit/serving/base64.h"
#include "shardit/serving/multipart.h"

namespace test_multipart {
namespace {

using shardit::serving::ApiError;
using shardit::serving::FormPart;
using shardit::serving::ImageEndpoint;
using shardit::serving::ImageRequest;
using shardit::serving::MultipartLimits;
using shardit::serving::parse_image_form;
using shardit::serving::parse_image_request;
using shardit::serving::parse_multipart;

const std::string kBoundary = "XyZ-42";

/// One part: its head lines (without line ends) and its bytes.
std::string part(const std::vector<std::string>& head, const std::string& data) {
  std::string out = "--" + kBoundary + "\r\n";
  for (const auto& line : head) out += line + "\r\n";
  return out + "\r\n" + data + "\r\n";
}

std::string field(const std::string& name, const std::string& value) {
  return part({"Content-Disposition: form-data; name=\"" + name + "\""}, value);
}

std::string file(const std::string& name, const std::string& filename, const std::string& data,
                 const std::string& type = "image/png") {
  return part({"Content-Disposition: form-data; name=\"" + name + "\"; filename=\"" + filename + "\"",
               "Content-Type: " + type},
              data);
}

std::string closed(const std::string& parts) { return parts + "--" + kBoundary + "--\r\n"; }

/// The status and message parse_multipart raises for `body` ({0, ""} when it raises none).
std::pair<int, std::string> refusal(const std::string& body, const MultipartLimits& limits = {}) {
  try {
    parse_multipart(body, kBoundary, limits);
  } catch (const ApiError& e) {
    return {e.status(), e.message()};
  }
  return {0, ""};
}

bool starts_with(const std::string& text, const std::string& start) { return text.rfind(start, 0) == 0; }

TEST(Multipart, SplitsPartsAsViewsIntoTheBody) {
  const std::string body = "preamble to ignore\r\n" +
                           closed(field("prompt", "a cat\r\n-- not a boundary") + file("image[]", "a.png", "\x89PNG") +
                                  part({"content-disposition: FORM-DATA;name=plain", "X-Other: ignored"}, "x")) +
                           "epilogue";
  const auto parts = parse_multipart(body, kBoundary);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0].name, "prompt");
  EXPECT_EQ(parts[0].data, "a cat\r\n-- not a boundary");
  EXPECT_FALSE(parts[0].is_file());
  EXPECT_EQ(parts[1].name, "image[]");
  EXPECT_EQ(parts[1].filename, "a.png");
  EXPECT_EQ(parts[1].content_type, "image/png");
  EXPECT_TRUE(parts[1].is_file());
  EXPECT_EQ(parts[2].name, "plain");
  EXPECT_EQ(parts[2].data, "x");
  // Views: no part's bytes were copied.
  EXPECT_GE(parts[1].data.data(), body.data());
  EXPECT_LE(parts[1].data.data() + parts[1].data.size(), body.data() + body.size());
  // A quoted value's escapes are read; an unknown parameter is ignored.
  const auto quoted = parse_multipart(closed(part({R"(Content-Disposition: form-data; x="1;2"; name="a\_b")"}, "v")),
                                      kBoundary);
  ASSERT_EQ(quoted.size(), 1u);
  EXPECT_EQ(quoted[0].name, "a_b");
}

TEST(Multipart, BoundariesFromTheContentType) {
  using shardit::serving::multipart_boundary;
  EXPECT_EQ(multipart_boundary("multipart/form-data; boundary=abc"), "abc");
  EXPECT_EQ(multipart_boundary("multipart/form-data; charset=utf-8; boundary=\"a b:c\""), "a b:c");
  EXPECT_TRUE(shardit::serving::is_form_data("Multipart/Form-Data ; boundary=x"));
  EXPECT_FALSE(shardit::serving::is_form_data("multipart/mixed; boundary=x"));
  for (const std::string bad : {"multipart/form-data", "multipart/form-data; boundary=\"ab", "multipart/form-data; boundary=a\r\nb",
                                "multipart/form-data; boundary=\"ends \"", "multipart/form-data; boundary=a; boundary=b"}) {
    EXPECT_THROW(multipart_boundary(bad), ApiError) << bad;
  }
}

// Every hostile or malformed form is refused with its own message, naming the part.
TEST(Multipart, HostileFormsAreRefusedByName) {
  static constexpr char kNulInName[] = "Content-Disposition: form-data; name=\"a\0b\"";
  const std::string ok = field("prompt", "a");
  struct Case {
    std::string body;
    int status;
    std::string message_start;
  };
  std::string many;
  for (int i = 0; i < 65; ++i) many += field("f" + std::to_string(i), "v");
  const std::vector<Case> cases = {
      {"", 400, "the multipart body holds no boundary line \"--XyZ-42\""},
      {"just text", 400, "the multipart body holds no boundary line"},
      {"--" + kBoundary + "--", 400, "the form has no parts"},
      // The closing boundary never comes: the body was cut short.
      {ok + "--" + kBoundary, 400, "the multipart body ends after a boundary line"},
      {ok, 400, "part 1 (\"prompt\") never ends"},
      {"--" + kBoundary + "\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nhello", 400,
       "part 1 (\"prompt\") never ends: no boundary line \"--XyZ-42\" follows it"},
      {"--" + kBoundary + "\r\nContent-Disposition: form-data; name=\"prompt\"", 400,
       "part 1: the body ends inside its head"},
      {ok + "--" + kBoundary + "junk\r\n", 400,
       "boundary line 2 is followed by \"junk\\r\\n\" instead of a line end"},
      {closed(many), 400, "the form has more than 64 parts"},
      {closed(part({"Content-Disposition: form-data; name=\"" + std::string(5000, 'a') + "\""}, "v")), 400,
       "part 1: its head is longer than 4096 bytes"},
      {closed(field("prompt", "")), 400, "part 1 (\"prompt\") is empty (0 bytes)"},
      {closed(file("image", "a.png", "")), 400, "part 1 (\"image\") is empty (0 bytes)"},
      {closed(field("prompt", std::string(70000, 'a'))), 400, "part 1 (\"prompt\") is a text field of 70000 bytes"},
      {closed(part({}, "v")), 400, "part 1: it has no Content-Disposition header"},
      {closed(part({"Content-Type: text/plain"}, "v")), 400, "part 1: it has no Content-Disposition header"},
      {closed(part({"Content-Disposition: attachment; name=\"a\""}, "v")), 400,
       "part 1: its Content-Disposition is \"attachment\", not form-data"},
      {closed(part({"Content-Disposition: form-data; name=\"a\"", "Content-Disposition: form-data; name=\"b\""}, "v")),
       400, "part 1: its head gives Content-Disposition twice"},
      {closed(part({"Content-Disposition: form-data; name=\"a\"; name=\"b\""}, "v")), 400,
       "part 1's Content-Disposition: 'name' is given twice"},
      {closed(part({"Content-Disposition: form-data; name=\"a", "X: y\""}, "v")), 400,
       "part 1's Content-Disposition: the quoted value of 'name' does not end"},
      // Header injection through a name: a bare line feed, a NUL, a folded line, a name that is
      // not a field name (as browsers escape a CR LF in it).
      {closed(part({"Content-Disposition: form-data; name=\"a\nContent-Type: image/png\""}, "v")), 400,
       "part 1: its head holds the control character 0x0a"},
      {closed(part({std::string(kNulInName, sizeof(kNulInName) - 1)}, "v")), 400,
       "part 1: its head holds the control character 0x00"},
      {closed(part({"Content-Disposition: form-data;", " name=\"a\""}, "v")), 400,
       "part 1: a header line \" name=\\\"a\\\"\" is empty or folded"},
      {closed(part({"Content-Disposition: form-data; name=\"a%0D%0AX-Injected: 1\""}, "v")), 400,
       "part 1: its name \"a%0D%0AX-Injected: 1\" is not a field name"},
      {closed(part({"Content-Disposition: form-data; name=\"\""}, "v")), 400, "part 1: its name \"\" is not a field name"},
      {closed(part({"Content-Disposition form-data"}, "v")), 400,
       "part 1: the head line \"Content-Disposition form-data\" is not a header"},
      // File names are never paths.
      {closed(file("image", "../../etc/passwd", "x")), 400,
       "part 1 (\"image\"): the file name \"../../etc/passwd\" holds the path character '/'"},
      {closed(file("image", "C:\\\\Windows\\\\a.png", "x")), 400,
       "part 1 (\"image\"): the file name \"C:\\\\Windows\\\\a.png\" holds the path character '\\'"},
      {closed(file("image", "..", "x")), 400, "part 1 (\"image\"): the file name \"..\" names a folder"},
      {closed(file("image", std::string(300, 'a'), "x")), 400, "part 1 (\"image\"): the file name"},
      {closed(part({"Content-Disposition: form-data; name=\"image\"; filename*=UTF-8''a.png"}, "x")), 400,
       "part 1: 'filename*' is not accepted"},
      // Nested multipart and encoded parts.
      {closed(part({"Content-Disposition: form-data; name=\"image\"", "Content-Type: multipart/mixed; boundary=in"},
                   "--in\r\n\r\nx\r\n--in--")),
       415, "part 1: a nested multipart body (\"multipart/mixed\") is not accepted"},
      {closed(part({"Content-Disposition: form-data; name=\"image\"", "Content-Transfer-Encoding: base64"}, "eA==")),
       400, "part 1: the Content-Transfer-Encoding \"base64\" is not accepted"},
  };
  for (const auto& c : cases) {
    const auto [status, message] = refusal(c.body);
    EXPECT_EQ(status, c.status) << c.message_start << "\n" << message;
    EXPECT_TRUE(starts_with(message, c.message_start)) << "expected: " << c.message_start << "\ngot: " << message;
  }
}

std::string png_bytes() { return shardit::io::encode_png(at::full({16, 16, 3}, 90, at::kByte)); }

/// The request parse_image_form makes of `body`, or its refusal's message.
std::pair<ImageRequest, std::string> form_request(const std::string& body) {
  try {
    return {parse_image_form(parse_multipart(body, kBoundary), {}, "tiny"), ""};
  } catch (const ApiError& e) {
    return {ImageRequest{}, e.message()};
  }
}

// A form gives the request the same JSON body gives: the same fields, types and checks.
TEST(Multipart, FormGivesTheRequestTheJsonBodyGives) {
  const std::string png = png_bytes();
  const std::string body =
      closed(file("image[]", "a.png", png) + file("image[]", "b.png", png, "application/octet-stream") +
             field("prompt", "a cat") + field("n", "2") + field("size", "64x48") + field("seed", "7") +
             field("num_inference_steps", "3") + field("guidance_scale", "2.5") + field("response_format", "b64_json") +
             field("output_format", "jpeg") + field("output_compression", "80") + field("stream", "false") +
             field("quality", "high") + field("cache", R"({"kind": "first_block_cache", "threshold": 0.1})"));
  const auto [form, error] = form_request(body);
  ASSERT_EQ(error, "");
  const std::string b64 = shardit::serving::base64_encode(png);
  const ImageRequest json = parse_image_request(
      R"({"image": [")" + b64 + R"(", ")" + b64 +
          R"("], "prompt": "a cat", "n": 2, "size": "64x48", "seed": 7, "num_inference_steps": 3,
             "guidance_scale": 2.5, "response_format": "b64_json", "output_format": "jpeg",
             "output_compression": 80, "stream": false, "quality": "high",
             "cache": {"kind": "first_block_cache", "threshold": 0.1}})",
      {}, "tiny", ImageEndpoint::Edits);
  EXPECT_EQ(form.to_json(), json.to_json());
  EXPECT_EQ(form.warnings, json.warnings);
  EXPECT_EQ(form.pixels.size(), 2u);
  // One image as `image`.
  const auto [single, single_error] = form_request(closed(file("image", "a.png", png) + field("prompt", "a")));
  ASSERT_EQ(single_error, "");
  EXPECT_EQ(single.images.size(), 1u);
}

TEST(Multipart, FormFieldsAreRefusedAsTheJsonBodysAre) {
  const std::string png = png_bytes();
  const std::string image = file("image", "a.png", png);
  std::string eleven;
  for (int i = 0; i < 11; ++i) eleven += file("image[]", "a.png", png);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {closed(field("prompt", "a")), "'image' is required: the image(s) to edit, as file parts"},
      {closed(image), "'prompt' is required"},
      {closed(image + field("prompt", "a") + field("n", "abc")), "'n' must be an integer, got string"},
      {closed(image + field("prompt", "a") + field("n", "1.5")), "'n' must be an integer, got number"},
      {closed(image + field("prompt", "a") + field("n", "9")), "'n' must be between 1 and 4, got 9"},
      {closed(image + field("prompt", "a") + field("stream", "true")), "'stream' true is not supported"},
      {closed(image + field("prompt", "a") + field("steps", "3")), "unknown field \"steps\" (fields: image, prompt,"},
      {closed(image + field("prompt", "a") + field("prompt", "b")), "'prompt' is given twice (part 3 (\"prompt\") repeats it)"},
      {closed(image + file("prompt", "p.txt", "a cat", "text/plain")), "'prompt' must be a text field, got a file"},
      {closed(image + file("seed", "s.png", "7")), "'seed' must be a text field, got a file"},
      {closed(image + field("prompt", "a \xff")), "'prompt' is not valid UTF-8; send text as UTF-8"},
      {closed(image + image + field("prompt", "a")), "part 2 (\"image\") is a second image part beside \"image\""},
      {closed(image + file("image[]", "b.png", png) + field("prompt", "a")),
       "part 2 (\"image[]\") is a second image part beside \"image\""},
      {closed(eleven + field("prompt", "a")), "'image' holds 11 images; at most 10 are accepted"},
      {closed(image + file("mask", "m.png", png) + field("prompt", "a")), "'mask' is not supported: no pipeline"},
      {closed(file("image", "a.txt", "not a picture") + field("prompt", "a")), "'image': not a PNG or JPEG image"},
      {closed(file("image", "a.webp", std::string("RIFF\x10\0\0\0WEBPVP8 ", 16)) + field("prompt", "a")),
       "'image': a WebP image, which is not read here"},
  };
  for (const auto& [body, message_start] : cases) {
    const std::string error = form_request(body).second;
    EXPECT_TRUE(starts_with(error, message_start)) << "expected: " << message_start << "\ngot: " << error;
  }
}

}  // namespace
}  // namespace test_multipart

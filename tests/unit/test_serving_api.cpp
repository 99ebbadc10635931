// The images API's request checks and encodings, without a server: base64 both ways, every field's
// type and range check, the request as the other ranks receive it.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "shardit/io/image.h"
#include "shardit/io/png.h"
#include "shardit/serving/api.h"
#include "shardit/serving/base64.h"
#include "shardit/serving/http_server.h"

namespace test_serving_api {
namespace {

using shardit::serving::ApiError;
using shardit::serving::ImageRequest;
using shardit::serving::RequestLimits;
using shardit::serving::base64_decode;
using shardit::serving::base64_encode;
using shardit::serving::parse_image_request;

// The ApiError `body` raises (status 0 and "" when it raises none).
std::pair<int, std::string> refusal(const std::string& body, const RequestLimits& limits = {}) {
  try {
    parse_image_request(body, limits, "tiny");
  } catch (const ApiError& e) {
    return {e.status(), e.message()};
  }
  return {0, ""};
}

TEST(ServingApi, Base64MatchesRfc4648Vectors) {
  // RFC 4648 section 10.
  const std::pair<std::string, std::string> vectors[] = {{"", ""},         {"f", "Zg=="},         {"fo", "Zm8="},
                                                         {"foo", "Zm9v"},  {"foob", "Zm9vYg=="},  {"fooba", "Zm9vYmE="},
                                                         {"foobar", "Zm9vYmFy"}};
  for (const auto& [plain, encoded] : vectors) {
    EXPECT_EQ(base64_encode(plain), encoded);
    EXPECT_EQ(base64_decode(encoded), plain);
  }
  std::string bytes;
  for (int i = 0; i < 256; ++i) bytes += static_cast<char>(i);
  EXPECT_EQ(base64_decode(base64_encode(bytes)), bytes);
  EXPECT_FALSE(base64_decode("Zm9").has_value());
  EXPECT_FALSE(base64_decode("Zm9v!A==").has_value());
  EXPECT_FALSE(base64_decode("Z===").has_value());
}

TEST(ServingApi, ParsesEveryFieldAndRoundTripsToTheRanks) {
  RequestLimits limits;
  limits.url_output = true;
  const ImageRequest request = parse_image_request(
      R"({"prompt": "a cat", "model": "tiny", "n": 2, "size": "64x32", "response_format": "url", "seed": 9,
          "negative_prompt": "blur", "num_inference_steps": 3, "guidance_scale": 3.5, "true_cfg_scale": 1.5,
          "user": "me"})",
      limits, "tiny");
  const ImageRequest copy = ImageRequest::from_json(request.to_json());
  for (const ImageRequest* r : {&request, &copy}) {
    EXPECT_EQ(r->prompt, "a cat");
    EXPECT_EQ(r->n, 2);
    EXPECT_EQ(r->width, 64);
    EXPECT_EQ(r->height, 32);
    EXPECT_EQ(r->response_format, "url");
    EXPECT_EQ(r->seed, 9u);
    EXPECT_EQ(r->negative_prompt, "blur");
    EXPECT_EQ(r->num_inference_steps, 3);
    EXPECT_EQ(r->guidance_scale, 3.5);
    EXPECT_EQ(r->true_cfg_scale, 1.5);
  }
  const auto generate = copy.to_generate();
  EXPECT_EQ(generate.prompt, std::vector<std::string>{"a cat"});
  EXPECT_EQ(generate.num_images_per_prompt, 2);
  EXPECT_EQ(generate.seed, 9u);
  EXPECT_FALSE(generate.on_progress);
  // Notes are on: the server collects them into the answer's "warnings" (core/notes.h).
  EXPECT_TRUE(generate.notes);
}

TEST(ServingApi, LoraChoicesAreCheckedDefaultedAndSentToTheRanks) {
  RequestLimits limits;
  limits.lora = {{"style", 0.8}, {"detail", 1.0}};
  // Without "lora": every adapter at its start weight; [] for none; any subset, in the request's order.
  const auto names = [](const ImageRequest& r) {
    std::vector<std::pair<std::string, double>> out;
    for (const auto& choice : r.lora) out.emplace_back(choice.name, choice.scale);
    return out;
  };
  using Choices = std::vector<std::pair<std::string, double>>;
  EXPECT_EQ(names(parse_image_request(R"({"prompt": "a"})", limits, "tiny")),
            (Choices{{"style", 0.8}, {"detail", 1.0}}));
  EXPECT_TRUE(parse_image_request(R"({"prompt": "a", "lora": []})", limits, "tiny").lora.empty());
  const ImageRequest chosen = parse_image_request(
      R"({"prompt": "a", "lora": [{"name": "detail", "scale": -0.5}, {"name": "style"}]})", limits, "tiny");
  EXPECT_EQ(names(chosen), (Choices{{"detail", -0.5}, {"style", 1.0}}));
  EXPECT_EQ(names(ImageRequest::from_json(chosen.to_json())), names(chosen));
  // An adapter named as the model: the base model with it alone.
  EXPECT_EQ(names(parse_image_request(R"({"prompt": "a", "model": "style"})", limits, "tiny")),
            (Choices{{"style", 0.8}}));

  EXPECT_EQ(refusal(R"({"prompt": "a", "lora": [{"name": "ink"}, {"name": "style"}, {"name": "oil"}]})", limits).second,
            "unknown LoRA adapters \"ink\", \"oil\" in 'lora' (this server loaded: style, detail; GET /v1/models "
            "lists them)");
  EXPECT_EQ(refusal(R"({"prompt": "a", "lora": [{"name": "style"}, {"name": "style", "scale": 2}]})", limits).second,
            "'lora' names the adapter \"style\" twice");
  EXPECT_EQ(refusal(R"({"prompt": "a", "lora": [{"scale": 2}]})", limits).second, "'lora[0].name' is required");
  EXPECT_EQ(refusal(R"({"prompt": "a", "lora": [{"name": "style", "scale": 1e5}]})", limits).second,
            "'lora[0].scale' must be between -10000 and 10000, got 100000.0");
  EXPECT_EQ(refusal(R"({"prompt": "a", "lora": [7]})", limits).second,
            "'lora[0]' must be an object {\"name\": ..., \"scale\": ...}, got integer");
  limits.lora_fused = true;
  EXPECT_EQ(refusal(R"({"prompt": "a", "lora": []})", limits).first, 400);
}

TEST(ServingApi, DrawsASeedWhenNoneIsGiven) {
  const ImageRequest a = parse_image_request(R"({"prompt": "a"})", {}, "tiny");
  const ImageRequest b = parse_image_request(R"({"prompt": "a"})", {}, "tiny");
  EXPECT_NE(a.seed, b.seed);
  EXPECT_LT(a.seed, 1ull << 63);
  EXPECT_FALSE(a.width.has_value());  // the pipeline's default size
}

TEST(ServingApi, RangesHoldForUnsignedAndNegativeValues) {
  EXPECT_EQ(refusal(R"({"prompt": "a", "n": 0})"), std::make_pair(400, std::string("'n' must be between 1 and 4, got 0")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "n": -3})").second, "'n' must be between 1 and 4, got -3");
  EXPECT_EQ(refusal(R"({"prompt": "a", "n": 18446744073709551615})").second,
            "'n' must be between 1 and 4, got 18446744073709551615");
  EXPECT_EQ(refusal(R"({"prompt": "a", "seed": 9223372036854775808})").second,
            "'seed' must be between 0 and 9223372036854775807, got 9223372036854775808");
  EXPECT_EQ(refusal(R"({"prompt": "a", "guidance_scale": 101})").second,
            "'guidance_scale' must be between 0 and 100, got 101");
  EXPECT_EQ(refusal(R"({"prompt": "a", "size": "0x64"})").second,
            "'size' 0x64 is not supported: width and height must be between 16 and 2048");
  EXPECT_EQ(refusal(R"({"prompt": "a", "size": "64x64x3"})").first, 400);
  EXPECT_EQ(refusal(R"({"prompt": "a", "size": "auto"})").first, 0);
  EXPECT_EQ(refusal(R"({"prompt": "a", "model": "other"})").first, 404);
  EXPECT_EQ(refusal(R"({"prompt": "a", "user": 1})").second, "'user' must be a string, got integer");
}

TEST(ServingApi, ErrorBodyHasOpenAiShape) {
  const ApiError error(429, "full");
  EXPECT_EQ(error.body().dump(),
            R"({"error":{"code":null,"message":"full","param":null,"type":"rate_limit_error"}})");
  EXPECT_EQ(ApiError(404, "m", "model", "model_not_found").body()["error"]["code"], "model_not_found");
  EXPECT_EQ(ApiError(503, "m").type(), "service_unavailable_error");
  EXPECT_EQ(ApiError(500, "m").type(), "server_error");
}

}  // namespace
}  // namespace test_serving_api

namespace test_serving_api {
namespace {

TEST(ServingApi, StepCachePerRequestOverridesTheServersDefault) {
  using shardit::models::StepCacheConfig;
  RequestLimits limits;
  // No server default: off unless the request asks.
  EXPECT_FALSE(parse_image_request(R"({"prompt": "a"})", limits, "tiny").cache.has_value());
  const ImageRequest asked = parse_image_request(
      R"({"prompt": "a", "cache": {"kind": "first_block_cache", "threshold": 0.1}})", limits, "tiny");
  ASSERT_TRUE(asked.cache.has_value());
  EXPECT_EQ(asked.cache->to_string(), "first_block_cache:threshold=0.1");
  // As the other ranks receive it, and as the pipeline runs it.
  EXPECT_EQ(ImageRequest::from_json(asked.to_json()).cache->to_string(), asked.cache->to_string());
  EXPECT_EQ(asked.to_generate().cache->to_string(), asked.cache->to_string());
  // The server's default (serve --cache) for requests that do not say; null turns it off.
  limits.cache = StepCacheConfig::parse("taylorseer_lite:cache_interval=4");
  EXPECT_EQ(parse_image_request(R"({"prompt": "a"})", limits, "tiny").cache->to_string(), limits.cache->to_string());
  EXPECT_FALSE(parse_image_request(R"({"prompt": "a", "cache": null})", limits, "tiny").cache.has_value());
  // A bad config is a 400 naming the field and the key.
  const auto [status, message] = refusal(R"({"prompt": "a", "cache": {"kind": "first_block_cache", "thresh": 1}})");
  EXPECT_EQ(status, 400);
  EXPECT_NE(message.find("'cache'"), std::string::npos) << message;
  EXPECT_NE(message.find("thresh"), std::string::npos) << message;
  EXPECT_EQ(refusal(R"({"prompt": "a", "cache": "first_block_cache"})").first, 400);
}

// check_request_head's status for a request with `headers` (method, path as given).
int head_status(const std::string& method, const std::string& path,
                const std::vector<std::pair<std::string, std::string>>& headers, bool takes_body = true,
                bool takes_form = false) {
  httplib::Request request;
  request.method = method;
  request.path = path;
  for (const auto& [key, value] : headers) request.headers.emplace(key, value);
  return shardit::serving::check_request_head(request, 1 << 20, takes_body, takes_form).status;
}

TEST(ServingApi, RequestHeadsAreCheckedBeforeTheirBody) {
  const std::string post = "POST", path = "/v1/images/generations";
  EXPECT_EQ(head_status(post, path, {{"Content-Length", "10"}}), 0);
  EXPECT_EQ(head_status(post, path, {{"Transfer-Encoding", "chunked"}}), 0);
  EXPECT_EQ(head_status(post, path, {{"Transfer-Encoding", "CHUNKED"}}), 0);
  EXPECT_EQ(head_status(post, path, {{"Content-Length", "1048576"}}), 0);
  EXPECT_EQ(head_status(post, path, {{"Content-Length", "10"}, {"Content-Encoding", "identity"}}), 0);
  EXPECT_EQ(head_status("GET", "/health", {}, false), 0);
  EXPECT_EQ(head_status(post, path, {{"Content-Length", "1048577"}}), 413);
  EXPECT_EQ(head_status(post, path, {{"Content-Length", "-5"}}), 400);
  EXPECT_EQ(head_status(post, path, {{"Content-Length", "+5"}}), 400);
  EXPECT_EQ(head_status(post, path, {{"Content-Length", " 5"}}), 400);
  EXPECT_EQ(head_status(post, path, {{"Content-Length", ""}}), 400);
  EXPECT_EQ(head_status(post, path, {{"Content-Length", "18446744073709551616"}}), 400);
  EXPECT_EQ(head_status(post, path, {{"Content-Length", "5"}, {"Content-Length", "5"}}), 400);
  EXPECT_EQ(head_status(post, path, {}), 411);
  EXPECT_EQ(head_status("PUT", path, {}, false), 411);
  EXPECT_EQ(head_status(post, path, {{"Content-Length", "5"}, {"Content-Encoding", "gzip"}}), 415);
  EXPECT_EQ(head_status(post, path, {{"Content-Length", "5"}, {"Content-Encoding", "br"}}), 415);
  EXPECT_EQ(head_status(post, path, {{"Transfer-Encoding", "gzip"}}), 501);
  EXPECT_EQ(head_status(post, path, {{"Transfer-Encoding", "chunked"}, {"Content-Length", "5"}}), 400);
  EXPECT_EQ(head_status(post, path, {{"Content-Length", "5"}, {"Content-Type", "multipart/form-data; boundary=x"}}),
            415);
  // A route that reads forms takes multipart/form-data with a boundary, and no other multipart.
  const auto form_status = [&](const std::string& type) {
    return head_status(post, "/v1/images/edits", {{"Content-Length", "5"}, {"Content-Type", type}}, true, true);
  };
  EXPECT_EQ(form_status("multipart/form-data; boundary=x"), 0);
  EXPECT_EQ(form_status("Multipart/Form-Data; Boundary=\"a b\""), 0);
  EXPECT_EQ(form_status("application/json"), 0);
  EXPECT_EQ(form_status("multipart/form-data"), 400);
  EXPECT_EQ(form_status("multipart/form-data; boundary="), 400);
  EXPECT_EQ(form_status("multipart/form-data; boundary=" + std::string(71, 'a')), 400);
  EXPECT_EQ(form_status("multipart/form-data; boundary=a; boundary=b"), 400);
  EXPECT_EQ(form_status("multipart/mixed; boundary=x"), 415);
  EXPECT_EQ(head_status(post, "/v1/other", {{"Content-Length", "5"}}, false), 404);
  EXPECT_EQ(head_status("GET", "/health", {{"Transfer-Encoding", "chunked"}}, false), 400);
  EXPECT_EQ(head_status("GET", "/health", {{"Content-Length", "0"}}, false), 0);
}

TEST(ServingApi, InvalidUtf8IsNamedByItsField) {
  EXPECT_EQ(refusal("{\"prompt\": \"a \xff\"}"),
            std::make_pair(400, std::string("'prompt' is not valid UTF-8; send text as UTF-8")));
  EXPECT_EQ(refusal("{\"prompt\": \"a\", \"negative_prompt\": [\"\xc3\"]}"),
            std::make_pair(400, std::string("'negative_prompt' is not valid UTF-8; send text as UTF-8")));
  EXPECT_EQ(refusal("{\"pro\xffmpt\": \"a\"}"),
            std::make_pair(400, std::string("the request body is not valid UTF-8 (in a field name); send text as UTF-8")));
  // The error body can always be written, whatever bytes its message quotes.
  const ApiError error(400, "bad \xff bytes", "\xfe");
  EXPECT_NO_THROW(error.body().dump());
}

}  // namespace
}  // namespace test_serving_api

namespace test_serving_api {
namespace {

// Every field of OpenAI's images request schema: accepted, each one without a meaning here noted
// once; the two that cannot be served (stream, a transparent background) refused by name.
TEST(ServingApi, OpenAiFieldsAreAcceptedWithWarningsOrRefusedByName) {
  const std::string every = R"({"prompt": "a", "model": "tiny", "n": 1, "size": "auto", "response_format": "b64_json",
      "quality": "standard", "style": "vivid", "user": "u1", "background": "opaque", "moderation": "low",
      "output_format": "jpeg", "output_compression": 80, "partial_images": 0, "stream": false,
      "input_fidelity": "high", "safety_identifier": "s1", "complexity": "low", "frame_count": 1,
      "frame_duration_ms": 100, "svg": {"effort": "low", "model": "m"}})";
  const ImageRequest request = parse_image_request(every, {}, "tiny");
  EXPECT_EQ(request.output_format, "jpeg");
  EXPECT_EQ(request.output_compression, 80);
  EXPECT_EQ(request.file_extension(), "jpg");
  ASSERT_EQ(request.warnings.size(), 11u);
  for (const char* field : {"quality", "style", "moderation", "input_fidelity", "partial_images", "user",
                            "safety_identifier", "complexity", "frame_count", "frame_duration_ms", "svg"}) {
    const std::string start = std::string("'") + field + "' was ignored: ";
    EXPECT_EQ(std::count_if(request.warnings.begin(), request.warnings.end(),
                            [&](const std::string& w) { return w.rfind(start, 0) == 0; }),
              1)
        << field;
  }
  // The answer's format travels to the replica that encodes it, and does not split batches.
  const ImageRequest copy = ImageRequest::from_json(request.to_json());
  EXPECT_EQ(copy.output_format, "jpeg");
  EXPECT_EQ(copy.output_compression, 80);
  EXPECT_TRUE(copy.warnings.empty());
  EXPECT_EQ(copy.batch_key(), parse_image_request(R"({"prompt": "b", "size": "auto"})", {}, "tiny").batch_key());
  // The mask of an edit is refused by name: no served pipeline inpaints.
  const std::string png = base64_encode(shardit::io::encode_png(at::zeros({16, 16, 3}, at::kByte)));
  try {
    parse_image_request(R"({"prompt": "a", "image": ")" + png + R"(", "mask": ")" + png + "\"}", {}, "tiny",
                        shardit::serving::ImageEndpoint::Edits);
    ADD_FAILURE() << "a mask was accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    EXPECT_EQ(e.param(), "mask");
    EXPECT_EQ(e.message().rfind("'mask' is not supported: no pipeline this server can serve inpaints", 0), 0u)
        << e.message();
  }

  // The formats and fields without a raster answer here are refused by name; the ignored ones are
  // still type-checked.
  for (const char* format : {"webp", "gif", "svg"}) {
    try {
      parse_image_request(std::string(R"({"prompt": "a", "output_format": ")") + format + "\"}", {}, "tiny");
      ADD_FAILURE() << format << " was accepted";
    } catch (const ApiError& e) {
      EXPECT_EQ(e.message(), std::string("'output_format' \"") + format + "\" is not supported: send \"png\" or \"jpeg\"");
    }
  }
  for (const auto& [body, message] : std::vector<std::pair<std::string, std::string>>{
           {R"({"prompt": "a", "svg": "x"})", "'svg' must be an object, got string"},
           {R"({"prompt": "a", "frame_count": "2"})", "'frame_count' must be an integer, got string"},
           {R"({"prompt": "a", "frame_count": -1})", "'frame_count' must be between 0 and 1000000, got -1"},
           {R"({"prompt": "a", "complexity": 3})", "'complexity' must be a string, got integer"}}) {
    try {
      parse_image_request(body, {}, "tiny");
      ADD_FAILURE() << body << " was accepted";
    } catch (const ApiError& e) {
      EXPECT_EQ(e.message(), message);
    }
  }
  try {
    parse_image_request(R"({"prompt": "a", "image": ")" + png + R"(", "markup": ")" + png + "\"}", {}, "tiny",
                        shardit::serving::ImageEndpoint::Edits);
    ADD_FAILURE() << "a markup image was accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param(), "markup");
    EXPECT_EQ(e.message().rfind("'markup' is not supported", 0), 0u) << e.message();
  }

  // null stands for absent in OpenAI's optional fields; a plain request has no notes.
  const ImageRequest nulls = parse_image_request(
      R"({"prompt": "a", "quality": null, "stream": null, "output_format": null, "background": null})", {}, "tiny");
  EXPECT_TRUE(nulls.warnings.empty());
  EXPECT_EQ(nulls.output_format, "png");
  EXPECT_EQ(nulls.file_extension(), "png");
  const ImageRequest png_compressed = parse_image_request(R"({"prompt": "a", "output_compression": 50})", {}, "tiny");
  ASSERT_EQ(png_compressed.warnings.size(), 1u);
  EXPECT_FALSE(png_compressed.output_compression.has_value());
  EXPECT_EQ(png_compressed.warnings[0],
            "'output_compression' was ignored: it applies to output_format \"jpeg\" only (PNG is lossless)");

  EXPECT_EQ(refusal(R"({"prompt": "a", "stream": true})"),
            std::make_pair(400, std::string("'stream' true is not supported: this server answers with the finished "
                                            "images only (no server-sent events or partial images); leave 'stream' "
                                            "out or send false")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "stream": "yes"})").second, "'stream' must be a boolean, got string");
  EXPECT_EQ(refusal(R"({"prompt": "a", "background": "transparent"})").second,
            "'background' \"transparent\" is not supported: this pipeline's images have no alpha channel; send "
            "\"opaque\" or \"auto\"");
  EXPECT_EQ(refusal(R"({"prompt": "a", "background": "white"})").second,
            "'background' must be \"transparent\", \"opaque\" or \"auto\", got \"white\"");
  EXPECT_EQ(refusal(R"({"prompt": "a", "output_format": "webp"})").second,
            "'output_format' \"webp\" is not supported: send \"png\" or \"jpeg\"");
  EXPECT_EQ(refusal(R"({"prompt": "a", "output_format": "bmp"})").second,
            "'output_format' must be \"png\" or \"jpeg\", got \"bmp\"");
  EXPECT_EQ(refusal(R"({"prompt": "a", "output_format": "jpeg", "output_compression": 101})").second,
            "'output_compression' must be between 0 and 100, got 101");
  EXPECT_EQ(refusal(R"({"prompt": "a", "output_compression": "high"})").second,
            "'output_compression' must be an integer, got string");
  EXPECT_EQ(refusal(R"({"prompt": "a", "quality": 3})").second, "'quality' must be a string, got integer");
  EXPECT_EQ(refusal(R"({"prompt": "a", "partial_images": 4})").second,
            "'partial_images' must be between 0 and 3, got 4");
  EXPECT_EQ(refusal(R"({"prompt": "a", "user": null})").second, "'user' must be a string, got null");
  // mask is an edits field; what is not OpenAI's stays unknown.
  EXPECT_EQ(refusal(R"({"prompt": "a", "mask": "x"})").second.rfind("unknown field \"mask\" (fields: ", 0), 0u);
  EXPECT_EQ(refusal(R"({"prompt": "a", "steps": 4})").second.rfind("unknown field \"steps\" (fields: ", 0), 0u);
}

// output_format "jpeg": the answer's image is a JPEG (by its signature) of the same pixels, to
// within JPEG's loss; "png" stays the lossless PNG.
TEST(ServingApi, EncodesTheAnswersImageInItsOutputFormat) {
  const at::Tensor pixels =
      at::arange(32 * 48 * 3, at::kInt).remainder(251).to(at::kByte).reshape({32, 48, 3});
  ImageRequest request;
  EXPECT_TRUE(shardit::io::decode_image(request.encode_image(pixels, {})).equal(pixels));
  request.output_format = "jpeg";
  const std::string jpeg = request.encode_image(pixels, {{"prompt", "a"}});
  EXPECT_EQ(shardit::io::sniff_image_format(jpeg.substr(0, 8)), "jpeg");
  const at::Tensor decoded = shardit::io::decode_image(jpeg);
  EXPECT_EQ(decoded.sizes(), pixels.sizes());
  request.output_compression = 10;
  EXPECT_LT(request.encode_image(pixels, {}).size(), jpeg.size());
  EXPECT_THROW(shardit::io::encode_jpeg(at::zeros({4, 4}, at::kByte), 90), c10::Error);
}

}  // namespace
}  // namespace test_serving_api

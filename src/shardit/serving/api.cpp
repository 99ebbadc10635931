#include "shardit/serving/api.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <random>
#include <regex>

#include "shardit/core/error.h"
#include "shardit/io/image.h"
#include "shardit/io/json.h"
#include "shardit/io/png.h"
#include "shardit/serving/base64.h"
#include "shardit/serving/multipart.h"
#include "shardit/tokenizers/unicode.h"

namespace shardit::serving {

namespace {

using nlohmann::json;

// The JSON type of `value` in words, as messages name it.
std::string type_name(const json& value) {
  if (value.is_number_integer()) return "integer";
  if (value.is_number_float()) return "number";
  return value.type_name();
}

ApiError bad_type(const std::string& field, const std::string& expected, const json& value) {
  return ApiError(400, fmt::format("'{}' must be {}, got {}", field, expected, type_name(value)), field);
}

std::string string_field(const json& value, const std::string& field) {
  if (!value.is_string()) throw bad_type(field, "a string", value);
  return value.get<std::string>();
}

int64_t integer_field(const json& value, const std::string& field, int64_t low, int64_t high) {
  if (!value.is_number_integer()) throw bad_type(field, "an integer", value);
  // Non-negative integers parse as unsigned (and may exceed int64's range).
  const bool in_range = value.is_number_unsigned()
                            ? value.get<uint64_t>() <= static_cast<uint64_t>(high) &&
                                  (low <= 0 || value.get<uint64_t>() >= static_cast<uint64_t>(low))
                            : value.get<int64_t>() >= low && value.get<int64_t>() <= high;
  if (!in_range) {
    throw ApiError(400, fmt::format("'{}' must be between {} and {}, got {}", field, low, high, value.dump()), field);
  }
  return value.get<int64_t>();
}

double number_field(const json& value, const std::string& field, double low, double high) {
  if (!value.is_number()) throw bad_type(field, "a number", value);
  const double number = value.get<double>();
  if (!(number >= low && number <= high)) {
    throw ApiError(400, fmt::format("'{}' must be between {} and {}, got {}", field, low, high, value.dump()), field);
  }
  return number;
}

std::string checked_prompt(const json& value, const std::string& field, const RequestLimits& limits,
                           bool allow_empty) {
  std::string prompt = string_field(value, field);
  if (!allow_empty && prompt.find_first_not_of(" \t\r\n") == std::string::npos) {
    throw ApiError(400, fmt::format("'{}' must not be empty", field), field);
  }
  if (static_cast<int64_t>(prompt.size()) > limits.max_prompt_chars) {
    throw ApiError(400,
                   fmt::format("'{}' is {} bytes long; at most {} are accepted (longer prompts are truncated to {} "
                               "tokens anyway)",
                               field, prompt.size(), limits.max_prompt_chars, limits.max_sequence_length),
                   field);
  }
  return prompt;
}

/// The top-level field of a JSON object whose value holds the first syntax error of `body` ("" when
/// the error is in a field's name or outside any value): a request's invalid UTF-8 is named by
/// its field.
std::string field_at_first_error(const std::string& body) {
  struct Locator : nlohmann::json_sax<json> {
    int depth = 0;
    std::string last_key;
    bool in_value = false;  // between a top-level key and the end of its value
    std::string field;

    bool value() {
      if (depth == 1) in_value = false;
      return true;
    }
    bool null() override { return value(); }
    bool boolean(bool) override { return value(); }
    bool number_integer(number_integer_t) override { return value(); }
    bool number_unsigned(number_unsigned_t) override { return value(); }
    bool number_float(number_float_t, const string_t&) override { return value(); }
    bool string(string_t&) override { return value(); }
    bool binary(binary_t&) override { return value(); }
    bool start_object(std::size_t) override { return ++depth, true; }
    bool end_object() override { return --depth, value(); }
    bool start_array(std::size_t) override { return ++depth, true; }
    bool end_array() override { return --depth, value(); }
    bool key(string_t& name) override {
      if (depth == 1) last_key = name, in_value = true;
      return true;
    }
    bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
      field = in_value ? last_key : "";
      return false;
    }
  } locator;
  json::sax_parse(body, &locator);
  return locator.field;
}

/// An edits request's count of reference images, checked before any is read.
void check_image_count(size_t count) {
  if (count == 0) throw ApiError(400, "'image' must hold at least one image", "image");
  if (static_cast<int64_t>(count) > pipelines::kMaxReferenceImages) {
    throw ApiError(400, fmt::format("'image' holds {} images; at most {} are accepted", count,
                                    pipelines::kMaxReferenceImages),
                   "image");
  }
}

/// The reference images' files (each with the field that names it in messages) into `request`,
/// bytes and pixels. Every image's header is checked against the limits' pixel budgets (its own,
/// and the request's together) before any is decoded; then each is decoded once, here, under the
/// decode timeout, so a truncated or hostile file is a 400 before the request is queued, and rank 0
/// does not decode it again.
void decode_images(std::vector<std::pair<std::string, std::string>> files, ImageRequest& request,
                   const RequestLimits& limits) {
  std::vector<std::string> fields;
  for (auto& [field, bytes] : files) {
    request.images.push_back(std::move(bytes));
    fields.push_back("'" + field + "'");
  }
  io::DecodeLimits decode;
  decode.max_pixels = limits.max_image_pixels;
  decode.max_pixels_option = "serve --max-image-pixels";
  try {
    int64_t total = 0;
    for (size_t i = 0; i < fields.size(); ++i) {
      const auto [height, width] = io::image_size(request.images[i], fields[i], decode);
      total += height * width;
    }
    if (total > limits.max_request_pixels) {
      throw ApiError(400,
                     fmt::format("'image' holds {} images of {} pixels together; at most {} pixels a request are "
                                 "decoded (serve --max-request-pixels): send fewer or smaller images",
                                 fields.size(), total, limits.max_request_pixels),
                     "image");
    }
    decode.deadline = std::chrono::steady_clock::now() + limits.decode_timeout;
    decode.deadline_words = fmt::format("serve --decode-timeout ({} s) for a request's images",
                                        std::chrono::duration<double>(limits.decode_timeout).count());
    for (size_t i = 0; i < fields.size(); ++i) {
      request.pixels.push_back(io::decode_image(request.images[i], fields[i], decode));
    }
  } catch (const ApiError&) {
    throw;
  } catch (const std::exception& e) {
    throw ApiError(400, error_message(e), "image");
  }
}

/// The reference images of an edits request's JSON: `value` is one string or an array of them,
/// each base64 of a PNG or JPEG, or a data:image/... URL holding it.
void read_images(const json& value, ImageRequest& request, const RequestLimits& limits) {
  const json list = value.is_array() ? value : json::array({value});
  check_image_count(list.size());
  std::vector<std::pair<std::string, std::string>> files;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string field = value.is_array() ? fmt::format("image[{}]", i) : std::string("image");
    std::string text = string_field(list[i], field);
    // data:image/png;base64,<data> as browsers write it.
    if (text.rfind("data:", 0) == 0) {
      const size_t comma = text.find(',');
      const std::string head = text.substr(0, std::min(comma, text.size()));
      if (comma == std::string::npos || head.find(";base64") == std::string::npos) {
        throw ApiError(400, fmt::format("'{}' is a data: URL without base64 data", field), "image");
      }
      if (head.rfind("data:image/", 0) != 0) {
        throw ApiError(400,
                       fmt::format("'{}' is a data: URL of {}, not an image; send data:image/png or "
                                   "data:image/jpeg",
                                   field, io::brief(json(head.substr(5, head.find(';') - 5)))),
                       "image");
      }
      text.erase(0, comma + 1);
    }
    std::optional<std::string> bytes = base64_decode(text);
    if (!bytes) throw ApiError(400, fmt::format("'{}' is not base64 (standard alphabet, padded)", field), "image");
    files.emplace_back(field, std::move(*bytes));
  }
  decode_images(std::move(files), request, limits);
}

/// The body's "lora": [{"name": NAME, "scale": W}, ...], every name loaded and given once.
std::vector<LoraChoice> lora_field(const json& value, const RequestLimits& limits) {
  if (limits.lora_fused) {
    throw ApiError(400, "'lora' cannot be chosen per request: the server merged its adapters into the weights "
                        "(--fuse-lora); start it without --fuse-lora to choose adapters per request",
                   "lora");
  }
  if (!value.is_array()) throw bad_type("lora", "an array of {\"name\": ..., \"scale\": ...}", value);
  std::vector<std::string> loaded;
  for (const auto& choice : limits.lora) loaded.push_back(choice.name);
  std::vector<LoraChoice> choices;
  std::vector<std::string> unknown;
  for (size_t i = 0; i < value.size(); ++i) {
    const json& item = value[i];
    const std::string field = fmt::format("lora[{}]", i);
    if (!item.is_object()) throw bad_type(field, "an object {\"name\": ..., \"scale\": ...}", item);
    for (const auto& [key, unused] : item.items()) {
      if (key != "name" && key != "scale") {
        throw ApiError(400, fmt::format("unknown field {} in '{}' (fields: name, scale)", io::quoted(key), field),
                       "lora");
      }
    }
    if (!item.contains("name")) throw ApiError(400, fmt::format("'{}.name' is required", field), "lora");
    LoraChoice choice;
    choice.name = string_field(item["name"], field + ".name");
    // The adapters' own bound on a weight (parallel/lora.cpp), refused here before any rank sees it.
    if (item.contains("scale")) choice.scale = number_field(item["scale"], field + ".scale", -1e4, 1e4);
    for (const auto& earlier : choices) {
      if (earlier.name == choice.name) {
        throw ApiError(400, fmt::format("'lora' names the adapter {} twice", io::quoted(choice.name)), "lora");
      }
    }
    if (std::find(loaded.begin(), loaded.end(), choice.name) == loaded.end())
      unknown.push_back(io::quoted(choice.name));
    choices.push_back(choice);
  }
  if (!unknown.empty()) {
    throw ApiError(400,
                   fmt::format("unknown LoRA adapter{} {} in 'lora' (this server loaded: {}; GET /v1/models lists "
                               "them)",
                               unknown.size() > 1 ? "s" : "", fmt::join(unknown, ", "),
                               loaded.empty() ? "none, start it with --lora NAME=FILE"
                                              : fmt::format("{}", fmt::join(loaded, ", "))),
                   "lora");
  }
  return choices;
}

/// The largest count an ignored field (frame_count, frame_duration_ms) is accepted with: the type is
/// checked, and a count beyond any real request's is refused rather than echoed.
constexpr int64_t kMaxIgnoredCount = 1'000'000;

/// An OpenAI request field that changes nothing here: accepted when of OpenAI's type, answered
/// with a warning saying why.
struct IgnoredField {
  enum class Type { String, Count, Object };
  const char* name;
  Type type;
  const char* why;
};

const std::vector<IgnoredField>& ignored_fields() {
  using Type = IgnoredField::Type;
  static const std::vector<IgnoredField> fields = {
      {"quality", Type::String, "the quality follows num_inference_steps and guidance_scale"},
      {"style", Type::String, "there is no style setting; describe the style in the prompt"},
      {"moderation", Type::String, "this server does not moderate"},
      {"input_fidelity", Type::String, "reference images are followed as the pipeline follows them"},
      {"partial_images", Type::Count, "partial images are only sent while streaming, which is not served"},
      {"user", Type::String, "end-user ids are not recorded"},
      {"safety_identifier", Type::String, "end-user ids are not recorded"},
      {"complexity", Type::String, "the amount of detail follows the prompt and num_inference_steps"},
      {"frame_count", Type::Count, "the answer holds still images only"},
      {"frame_duration_ms", Type::Count, "the answer holds still images only"},
      {"svg", Type::Object, "the answer holds raster images only (output_format \"png\" or \"jpeg\")"},
  };
  return fields;
}

/// OpenAI's optional fields take null for "not given"; shardit's own and `user`, `mask` and
/// `markup` do not.
bool given(const json& document, const std::string& field) {
  if (!document.contains(field)) return false;
  const bool nullable = field != "user" && field != "mask" && field != "markup";
  return !(nullable && document[field].is_null());
}

/// OpenAI's fields beyond shardit's own: output_format and output_compression into `request`;
/// stream, a mask and a transparent background refused (none is served); the others
/// type-checked and noted in request.warnings.
void read_openai_fields(const json& document, ImageRequest& request) {
  if (given(document, "mask")) {
    throw ApiError(400,
                   "'mask' is not supported: no pipeline this server can serve inpaints (FluxPipeline, "
                   "FluxKontextPipeline, Flux2KleinPipeline, Flux2Pipeline and QwenImagePipeline edit the whole "
                   "image; inpainting pipelines such as diffusers' FluxFillPipeline or FluxInpaintPipeline would "
                   "take a mask, and none is served); leave 'mask' out and say the change in the prompt",
                   "mask");
  }
  if (given(document, "markup")) {
    throw ApiError(400,
                   "'markup' is not supported: the pipelines this server serves take no drawn-over copy of the "
                   "image; leave 'markup' out and say the change in the prompt",
                   "markup");
  }
  if (given(document, "stream") && !document["stream"].is_boolean()) {
    throw bad_type("stream", "a boolean", document["stream"]);
  }
  if (given(document, "stream") && document["stream"].get<bool>()) {
    throw ApiError(400,
                   "'stream' true is not supported: this server answers with the finished images only (no "
                   "server-sent events or partial images); leave 'stream' out or send false",
                   "stream");
  }
  if (given(document, "background")) {
    const std::string background = string_field(document["background"], "background");
    if (background == "transparent") {
      throw ApiError(400,
                     "'background' \"transparent\" is not supported: this pipeline's images have no alpha "
                     "channel; send \"opaque\" or \"auto\"",
                     "background");
    }
    if (background != "opaque" && background != "auto") {
      throw ApiError(400, fmt::format("'background' must be \"transparent\", \"opaque\" or \"auto\", got {}",
                                      io::quoted(background)),
                     "background");
    }
  }
  if (given(document, "output_format")) {
    request.output_format = string_field(document["output_format"], "output_format");
    if (request.output_format == "webp" || request.output_format == "gif" || request.output_format == "svg") {
      throw ApiError(400, fmt::format("'output_format' {} is not supported: send \"png\" or \"jpeg\"",
                                      io::quoted(request.output_format)),
                     "output_format");
    }
    if (request.output_format != "png" && request.output_format != "jpeg") {
      throw ApiError(400, fmt::format("'output_format' must be \"png\" or \"jpeg\", got {}",
                                      io::quoted(request.output_format)),
                     "output_format");
    }
  }
  if (given(document, "output_compression")) {
    const int64_t compression = integer_field(document["output_compression"], "output_compression", 0, 100);
    if (request.output_format == "jpeg") {
      request.output_compression = compression;
    } else {
      request.warnings.push_back("'output_compression' was ignored: it applies to output_format \"jpeg\" only "
                                 "(PNG is lossless)");
    }
  }
  for (const IgnoredField& field : ignored_fields()) {
    if (!given(document, field.name)) continue;
    const json& value = document[field.name];
    switch (field.type) {
      case IgnoredField::Type::String: string_field(value, field.name); break;
      case IgnoredField::Type::Count:
        integer_field(value, field.name, 0, std::string(field.name) == "partial_images" ? 3 : kMaxIgnoredCount);
        break;
      case IgnoredField::Type::Object:
        if (!value.is_object()) throw bad_type(field.name, "an object", value);
        break;
    }
    request.warnings.push_back(fmt::format("'{}' was ignored: {}", field.name, field.why));
  }
}

uint64_t random_seed() {
  static std::mutex mutex;
  static std::mt19937_64 engine{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mutex);
  return engine() >> 1;  // kept below 2^63: every JSON reader takes it as an integer
}

}  // namespace

ApiError::ApiError(int status, std::string message, std::string param, std::string code)
    : status_(status), message_(std::move(message)), param_(std::move(param)), code_(std::move(code)) {}

std::string ApiError::type() const {
  switch (status_) {
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable_error";
    default: return status_ >= 500 ? "server_error" : "invalid_request_error";
  }
}

nlohmann::json ApiError::body() const {
  // The message and param may quote the client's bytes, which need not be UTF-8: such bytes are
  // replaced (U+FFFD) so that the body can always be written.
  const auto valid = [](const std::string& text) { return tokenizers::sanitize_utf8(text); };
  json error = {{"message", valid(message_)}, {"type", type()}};
  error["param"] = param_.empty() ? json(nullptr) : json(valid(param_));
  error["code"] = code_.empty() ? json(nullptr) : json(code_);
  return json{{"error", error}};
}

const std::vector<std::string>& request_fields(ImageEndpoint endpoint) {
  static const std::vector<std::string> fields = {
      "prompt",         "model",          "n",          "size",           "response_format",
      "seed",           "negative_prompt", "num_inference_steps", "guidance_scale", "true_cfg_scale",
      "cache",          "lora",           "user",
      // OpenAI's, beyond the above (docs/serving.md says what each does here).
      "background",     "moderation",     "output_compression", "output_format", "partial_images",
      "quality",        "stream",         "style",          "input_fidelity", "safety_identifier",
      "complexity",     "frame_count",    "frame_duration_ms", "svg"};
  static const std::vector<std::string> edit_fields = [] {
    std::vector<std::string> all = {"image"};
    all.insert(all.end(), fields.begin(), fields.end());
    all.push_back("mask");
    all.push_back("markup");
    return all;
  }();
  return endpoint == ImageEndpoint::Edits ? edit_fields : fields;
}

namespace {

ApiError unknown_field(const std::string& key, ImageEndpoint endpoint) {
  const auto& fields = request_fields(endpoint);
  return ApiError(400, fmt::format("unknown field {} (fields: {})", io::quoted(key), fmt::join(fields, ", ")), key);
}

/// The checks of a request on its fields as a JSON object, whichever form the body had: the
/// fields known at `endpoint`, their types and ranges, the model. An edits request's images are
/// the document's "image" (base64), or `files` (field name and file bytes) where the body was a
/// form.
ImageRequest request_from_document(const json& document, const RequestLimits& limits, const std::string& model_id,
                                   ImageEndpoint endpoint,
                                   std::vector<std::pair<std::string, std::string>>* files) {
  const auto& fields = request_fields(endpoint);
  for (const auto& [key, value] : document.items()) {
    if (std::find(fields.begin(), fields.end(), key) == fields.end()) throw unknown_field(key, endpoint);
  }
  ImageRequest request;
  request.max_sequence_length = limits.max_sequence_length;
  if (!document.contains("prompt")) throw ApiError(400, "'prompt' is required", "prompt");
  request.prompt = checked_prompt(document["prompt"], "prompt", limits, false);
  request.lora = limits.lora;
  if (document.contains("model")) {
    const std::string model = string_field(document["model"], "model");
    // An adapter's name (as GET /v1/models lists it) is the base model with that adapter alone.
    const auto adapter = std::find_if(limits.lora.begin(), limits.lora.end(),
                                      [&model](const LoraChoice& choice) { return choice.name == model; });
    if (adapter != limits.lora.end()) {
      if (!limits.lora_fused) request.lora = {*adapter};  // fused: every adapter is in the weights
    } else if (model != model_id) {
      throw ApiError(404,
                     fmt::format("the model {} does not exist; this server serves '{}'", io::quoted(model), model_id),
                     "model", "model_not_found");
    }
  }
  if (document.contains("n")) request.n = integer_field(document["n"], "n", 1, limits.max_images);
  if (document.contains("size")) {
    const std::string size = string_field(document["size"], "size");
    std::smatch match;
    static const std::regex size_re("([0-9]{1,6})x([0-9]{1,6})");
    if (size != "auto") {
      if (!std::regex_match(size, match, size_re)) {
        throw ApiError(400, fmt::format("'size' must be \"WIDTHxHEIGHT\" in pixels (e.g. \"512x512\") or \"auto\", got {}",
                                        io::quoted(size)),
                       "size");
      }
      const int64_t width = std::stoll(match[1]);
      const int64_t height = std::stoll(match[2]);
      const int64_t m = limits.size_multiple;
      if (width < m || height < m || width > limits.max_side || height > limits.max_side) {
        throw ApiError(400, fmt::format("'size' {} is not supported: width and height must be between {} and {}", size,
                                        m, limits.max_side),
                       "size");
      }
      if (width % m != 0 || height % m != 0) {
        throw ApiError(400, fmt::format("'size' {} is not supported by this model: width and height must be "
                                        "multiples of {} (e.g. {}x{})",
                                        size, m, width / m * m, height / m * m),
                       "size");
      }
      request.width = width;
      request.height = height;
    }
  }
  if (document.contains("response_format")) {
    request.response_format = string_field(document["response_format"], "response_format");
    if (request.response_format != "b64_json" && request.response_format != "url") {
      throw ApiError(400, fmt::format("'response_format' must be \"b64_json\" or \"url\", got {}",
                                      io::quoted(request.response_format)),
                     "response_format");
    }
    if (request.response_format == "url" && !limits.url_output) {
      throw ApiError(400, "'response_format' \"url\" is not served: the server was started without --output-dir",
                     "response_format");
    }
  }
  request.seed = document.contains("seed")
                     ? static_cast<uint64_t>(
                           integer_field(document["seed"], "seed", 0, std::numeric_limits<int64_t>::max()))
                     : random_seed();
  if (document.contains("negative_prompt")) {
    request.negative_prompt = checked_prompt(document["negative_prompt"], "negative_prompt", limits, true);
  }
  if (document.contains("num_inference_steps")) {
    request.num_inference_steps =
        integer_field(document["num_inference_steps"], "num_inference_steps", 1, limits.max_steps);
  }
  if (document.contains("guidance_scale")) {
    request.guidance_scale = number_field(document["guidance_scale"], "guidance_scale", 0, 100);
  }
  if (document.contains("true_cfg_scale")) {
    request.true_cfg_scale = number_field(document["true_cfg_scale"], "true_cfg_scale", 0, 100);
  }
  request.cache = limits.cache;
  if (document.contains("cache")) {
    const json& cache = document["cache"];
    if (cache.is_null() || cache == false) {
      request.cache.reset();
    } else {
      try {
        request.cache = models::StepCacheConfig::from_json(cache);
      } catch (const std::exception& e) {
        throw ApiError(400, "'cache': " + error_message(e), "cache");
      }
    }
  }
  if (document.contains("lora")) request.lora = lora_field(document["lora"], limits);
  read_openai_fields(document, request);
  if (endpoint == ImageEndpoint::Edits && files != nullptr) {
    check_image_count(files->size());
    decode_images(std::move(*files), request, limits);
  } else if (endpoint == ImageEndpoint::Edits) {
    if (!document.contains("image")) {
      throw ApiError(400, "'image' is required: the image(s) to edit, base64 PNG or JPEG", "image");
    }
    read_images(document["image"], request, limits);
  }
  return request;
}

}  // namespace

ImageRequest parse_image_request(const std::string& body, const RequestLimits& limits, const std::string& model_id,
                                 ImageEndpoint endpoint) {
  json document;
  try {
    document = io::parse_json(body.data(), body.size(), "the request body");
  } catch (const std::exception& e) {
    bool invalid_utf8 = false;
    tokenizers::sanitize_utf8(body, &invalid_utf8);
    if (invalid_utf8) {
      const std::string field = field_at_first_error(body);
      throw ApiError(400,
                     field.empty() ? "the request body is not valid UTF-8 (in a field name); send text as UTF-8"
                                   : fmt::format("'{}' is not valid UTF-8; send text as UTF-8", field),
                     field);
    }
    throw ApiError(400, "the request body is not valid JSON: " + error_message(e));
  }
  if (!document.is_object()) {
    throw ApiError(400, "the request body must be a JSON object, got " + type_name(document));
  }
  return request_from_document(document, limits, model_id, endpoint, nullptr);
}

namespace {

/// Whether a form field's value is read as JSON (a number, a boolean, an object or an array, as
/// the JSON body gives them); every other field's value is its text. A value that is not JSON
/// stays text, so that the checks name its type as for a JSON body ("'n' must be an integer,
/// got string").
bool form_value_is_json(const std::string& field) {
  static const std::vector<std::string> fields = {"n",     "seed", "num_inference_steps", "guidance_scale",
                                                  "true_cfg_scale", "cache", "lora", "output_compression",
                                                  "partial_images", "stream", "frame_count",
                                                  "frame_duration_ms", "svg"};
  return std::find(fields.begin(), fields.end(), field) != fields.end();
}

}  // namespace

ImageRequest parse_image_form(const std::vector<FormPart>& parts, const RequestLimits& limits,
                              const std::string& model_id) {
  json document = json::object();
  std::vector<std::pair<std::string, std::string>> files;
  std::string images_as;  // "image" or "image[]", as the first image part named it
  for (size_t i = 0; i < parts.size(); ++i) {
    const FormPart& part = parts[i];
    if (part.name == "image" || part.name == "image[]") {
      if (!images_as.empty() && (images_as != part.name || part.name == "image")) {
        throw ApiError(400,
                       fmt::format("{} is a second image part beside {}: send one image as 'image', or one or "
                                   "more as 'image[]', each once",
                                   part.label(i), io::quoted(images_as)),
                       "image");
      }
      images_as = part.name;
      check_image_count(files.size() + 1);
      files.emplace_back(part.name == "image" ? "image" : fmt::format("image[{}]", files.size()),
                         std::string(part.data));
      continue;
    }
    const auto& fields = request_fields(ImageEndpoint::Edits);
    if (std::find(fields.begin(), fields.end(), part.name) == fields.end()) {
      throw unknown_field(part.name, ImageEndpoint::Edits);
    }
    if (document.contains(part.name)) {
      throw ApiError(400, fmt::format("'{}' is given twice ({} repeats it); give each field once", part.name,
                                      part.label(i)),
                     part.name);
    }
    if (part.name == "mask" || part.name == "markup") {
      document[part.name] = "";  // a file: refused by name with the request's other checks
      continue;
    }
    if (part.is_file()) {
      throw ApiError(400,
                     fmt::format("'{}' must be a text field, got a file ({}{}{}); send its value as a form field",
                                 part.name, part.label(i), part.filename ? ", file name " + io::quoted(*part.filename) : "",
                                 part.content_type.empty() ? "" : ", Content-Type " + part.content_type),
                     part.name);
    }
    const std::string text(part.data);
    bool invalid_utf8 = false;
    tokenizers::sanitize_utf8(text, &invalid_utf8);
    if (invalid_utf8) {
      throw ApiError(400, fmt::format("'{}' is not valid UTF-8; send text as UTF-8", part.name), part.name);
    }
    json value = text;
    if (form_value_is_json(part.name)) {
      try {
        value = io::parse_json(text.data(), text.size(), "'" + part.name + "'");
      } catch (const std::exception&) {
        // Not JSON: its text, whose type the checks refuse by name.
      }
    }
    document[part.name] = std::move(value);
  }
  if (files.empty()) {
    throw ApiError(400, "'image' is required: the image(s) to edit, as file parts named 'image' or 'image[]' (PNG "
                        "or JPEG)",
                   "image");
  }
  return request_from_document(document, limits, model_id, ImageEndpoint::Edits, &files);
}

void check_with_pipeline(const ImageRequest& request, const pipelines::DiffusionPipeline& pipeline) {
  try {
    pipeline.check(request.to_generate());
  } catch (const std::exception& e) {
    throw ApiError(400, error_message(e));
  }
}

std::string ImageRequest::encode_image(const at::Tensor& pixels,
                                       const std::vector<std::pair<std::string, std::string>>& png_text) const {
  if (output_format == "jpeg") {
    return io::encode_jpeg(pixels, static_cast<int>(output_compression.value_or(kDefaultJpegQuality)));
  }
  return io::encode_png(pixels, png_text);
}

std::string ImageRequest::file_extension() const { return output_format == "jpeg" ? "jpg" : "png"; }

pipelines::GenerateRequest ImageRequest::to_generate() const {
  pipelines::GenerateRequest request;
  request.prompt = {prompt};
  if (negative_prompt) request.negative_prompt = {*negative_prompt};
  request.height = height;
  request.width = width;
  request.num_inference_steps = num_inference_steps;
  request.guidance_scale = guidance_scale;
  request.true_cfg_scale = true_cfg_scale;
  request.num_images_per_prompt = n;
  request.max_sequence_length = max_sequence_length;
  request.seed = seed;
  request.cache = cache;
  request.max_area = max_area;
  if (!pixels.empty()) {
    request.image = pixels;
  } else {
    for (size_t i = 0; i < images.size(); ++i) request.image.push_back(io::decode_image(images[i], fmt::format("image[{}]", i)));
  }
  // Notes go to the client's answer ("warnings"): the server collects them (core/notes.h).
  request.notes = true;
  return request;
}

nlohmann::json ImageRequest::to_json() const {
  json out = {{"prompt", prompt}, {"n", n}, {"response_format", response_format}, {"seed", seed},
              {"max_sequence_length", max_sequence_length}};
  if (negative_prompt) out["negative_prompt"] = *negative_prompt;
  if (width) out["width"] = *width;
  if (height) out["height"] = *height;
  if (num_inference_steps) out["num_inference_steps"] = *num_inference_steps;
  if (guidance_scale) out["guidance_scale"] = *guidance_scale;
  if (true_cfg_scale) out["true_cfg_scale"] = *true_cfg_scale;
  if (cache) out["cache"] = cache->to_json();
  if (max_area) out["max_area"] = *max_area;
  if (!images.empty()) {
    json encoded = json::array();
    for (const std::string& bytes : images) encoded.push_back(base64_encode(bytes));
    out["images"] = encoded;
  }
  out["lora"] = lora_json(lora);
  if (output_format != "png") out["output_format"] = output_format;
  if (output_compression) out["output_compression"] = *output_compression;
  return out;
}

json lora_json(const std::vector<LoraChoice>& lora) {
  json out = json::array();
  for (const auto& choice : lora) out.push_back({{"name", choice.name}, {"scale", choice.scale}});
  return out;
}

std::string ImageRequest::batch_key() const {
  if (!images.empty() || cache) return "";
  json key = to_json();
  for (const char* own : {"prompt", "seed", "response_format", "output_format", "output_compression"}) key.erase(own);
  // Whether there is a negative prompt decides CFG; its text is the request's own.
  key["negative_prompt"] = negative_prompt.has_value();
  return key.dump();
}

ImageRequest ImageRequest::from_json(const nlohmann::json& json) {
  ImageRequest request;
  request.prompt = json.at("prompt").get<std::string>();
  request.n = json.at("n").get<int64_t>();
  request.response_format = json.at("response_format").get<std::string>();
  request.seed = json.at("seed").get<uint64_t>();
  request.max_sequence_length = json.at("max_sequence_length").get<int64_t>();
  if (json.contains("negative_prompt")) request.negative_prompt = json["negative_prompt"].get<std::string>();
  if (json.contains("width")) request.width = json["width"].get<int64_t>();
  if (json.contains("height")) request.height = json["height"].get<int64_t>();
  if (json.contains("num_inference_steps")) request.num_inference_steps = json["num_inference_steps"].get<int64_t>();
  if (json.contains("guidance_scale")) request.guidance_scale = json["guidance_scale"].get<double>();
  if (json.contains("true_cfg_scale")) request.true_cfg_scale = json["true_cfg_scale"].get<double>();
  if (json.contains("cache")) request.cache = models::StepCacheConfig::from_json(json["cache"]);
  if (json.contains("max_area")) request.max_area = json["max_area"].get<int64_t>();
  if (json.contains("images")) {
    for (const auto& encoded : json["images"]) request.images.push_back(base64_decode(encoded.get<std::string>()).value());
  }
  if (json.contains("output_format")) request.output_format = json["output_format"].get<std::string>();
  if (json.contains("output_compression")) request.output_compression = json["output_compression"].get<int64_t>();
  for (const auto& choice : json.at("lora")) {
    request.lora.push_back({choice.at("name").get<std::string>(), choice.at("scale").get<double>()});
  }
  return request;
}

}  // namespace shardit::serving

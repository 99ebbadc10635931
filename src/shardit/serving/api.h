#pragma once
// The OpenAI images API as shardit serves it: the request fields of POST /v1/images/generations
// and POST /v1/images/edits (the same, plus reference images), their checks (each failure an ApiError with the HTTP status and OpenAI's error object), and the
// request as every rank receives it.
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>

#include "shardit/pipelines/pipeline.h"

namespace shardit::serving {

/// An error answered to a client: the HTTP status and OpenAI's error object
/// {"error": {"message", "type", "param", "code"}}.
class ApiError : public std::exception {
 public:
  ApiError(int status, std::string message, std::string param = "", std::string code = "");
  int status() const { return status_; }
  const std::string& message() const { return message_; }
  const std::string& param() const { return param_; }
  /// OpenAI's error type for the status: invalid_request_error (400, 404, 413),
  /// rate_limit_error (429), server_error (500), service_unavailable_error (503).
  std::string type() const;
  /// The JSON body.
  nlohmann::json body() const;
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  int status_;
  std::string message_;
  std::string param_;
  std::string code_;
};

/// One LoRA adapter a request turns on: a name the server loaded (`serve --lora NAME=FILE[:W]`)
/// and its weight (diffusers' set_adapters weight).
struct LoraChoice {
  std::string name;
  double scale = 1.0;
};

/// Adapters as set_adapters takes them, as the control plane sends them and as an answer lists
/// them: [{"name", "scale"}, ...].
nlohmann::json lora_json(const std::vector<LoraChoice>& lora);

/// What the server accepts (set by `shardit serve` options).
struct RequestLimits {
  int64_t max_images = 4;            ///< largest `n`
  int64_t max_steps = 100;           ///< largest `num_inference_steps`
  int64_t max_side = 2048;           ///< largest width or height in pixels
  int64_t size_multiple = 16;        ///< width and height must be multiples (2 x the VAE's scale)
  int64_t max_prompt_chars = 10000;  ///< longer prompts are refused before tokenizing
  int64_t max_sequence_length = 512; ///< tokens kept per prompt (longer prompts are truncated)
  bool url_output = false;           ///< whether response_format "url" is served (an output folder is set)
  /// The step cache of requests that do not say (`serve --cache`); none: off.
  std::optional<models::StepCacheConfig> cache;
  /// The LoRA adapters loaded at start, at the weights a request without "lora" gets.
  std::vector<LoraChoice> lora;
  /// Whether they were merged into the weights (--fuse-lora): then no request may choose.
  bool lora_fused = false;
  /// Reference images (POST /v1/images/edits), checked from their headers before any is decoded:
  /// the most pixels one image may declare (`serve --max-image-pixels`) and all of a request's
  /// together (`--max-request-pixels`).
  int64_t max_image_pixels = int64_t{8192} * 8192;
  int64_t max_request_pixels = int64_t{2} * 8192 * 8192;
  /// The most time decoding one request's images may take (`--decode-timeout`).
  std::chrono::milliseconds decode_timeout{10000};
};

/// The JPEG quality of output_format "jpeg" when the request gives no output_compression
/// (OpenAI's default, 100).
constexpr int64_t kDefaultJpegQuality = 100;

/// One POST /v1/images/generations request, checked. `seed` is always set (drawn by the server
/// when the client gave none), so every rank runs the same generation.
struct ImageRequest {
  std::string prompt;
  std::optional<std::string> negative_prompt;
  int64_t n = 1;
  std::optional<int64_t> width;
  std::optional<int64_t> height;
  std::string response_format = "b64_json";
  /// The answer's image files: "png" or "jpeg" (OpenAI's output_format).
  std::string output_format = "png";
  /// The JPEG quality (OpenAI's output_compression, 0 to 100); none: kDefaultJpegQuality.
  std::optional<int64_t> output_compression;
  /// Why OpenAI fields the request gave change nothing here, one note each, for the answer's
  /// "warnings". Only where the request was parsed (not in to_json).
  std::vector<std::string> warnings;
  uint64_t seed = 0;
  std::optional<int64_t> num_inference_steps;
  std::optional<double> guidance_scale;
  std::optional<double> true_cfg_scale;
  int64_t max_sequence_length = 512;
  /// Step caching: the body's "cache" ({"kind": ..., keys}; null or false: none), or the server's.
  std::optional<models::StepCacheConfig> cache;
  /// POST /v1/images/edits: the reference images as the client sent them (PNG or JPEG bytes, each
  /// checked to decode); to_generate decodes them only where `pixels` is empty.
  std::vector<std::string> images;
  /// The same images decoded (uint8 [H, W, 3]) where the request was parsed: to_generate takes
  /// them instead of decoding again; empty on the ranks that received the request as JSON.
  std::vector<at::Tensor> pixels;
  /// FluxKontextPipeline's output area: the server sets width x height when the client gave a
  /// size, so that `size` is the answer's size (Kontext would rescale it to 1024² otherwise).
  std::optional<int64_t> max_area;
  /// The LoRA adapters active for this request, in order: the body's "lora" ([{"name", "scale"}];
  /// [] for none), or the server's (RequestLimits::lora).
  std::vector<LoraChoice> lora;

  /// What a request must share with others to run in one batch (serve --max-batch): everything
  /// but the prompt, the negative prompt's text, the seed and the answer's format. Empty when it
  /// runs alone: with reference images, or with a step cache (which decides for a whole batch).
  std::string batch_key() const;
  /// The answer's image `pixels` (uint8 [H, W, 3]) in output_format: a PNG with `png_text` chunks,
  /// or a JPEG at output_compression.
  std::string encode_image(const at::Tensor& pixels,
                           const std::vector<std::pair<std::string, std::string>>& png_text) const;
  /// The file name extension of output_format: "png" or "jpg".
  std::string file_extension() const;
  /// The pipeline call (no progress display, no notes on stderr).
  pipelines::GenerateRequest to_generate() const;
  /// As the control plane sends it to the other ranks.
  nlohmann::json to_json() const;
  /// What to_json() wrote.
  static ImageRequest from_json(const nlohmann::json& json);
};

/// The endpoint a request body came to.
enum class ImageEndpoint { Generations, Edits };

/// Parses and checks a request body (throws ApiError naming the field): a JSON object of the
/// known fields (shardit's and OpenAI's, null standing for absent in OpenAI's optional ones)
/// with the right types and ranges, the `model` (when given) equal to `model_id`.
/// `seed` is drawn when absent. Edits also need `image`: one image or an array of up to
/// pipelines::kMaxReferenceImages, each base64 (or a data:image/... URL) of a PNG or JPEG that
/// decodes within io::kMaxInputImageSide and the limits' pixel budgets and decode timeout. Checks against the pipeline itself are check_with_pipeline's.
ImageRequest parse_image_request(const std::string& body, const RequestLimits& limits, const std::string& model_id,
                                 ImageEndpoint endpoint = ImageEndpoint::Generations);

struct FormPart;

/// Parses and checks an edits request sent as multipart/form-data (its parts: parse_multipart),
/// as OpenAI's clients send it: the images as file parts `image` (one) or `image[]` (1 to
/// pipelines::kMaxReferenceImages), every other field of the JSON body as a text part, each once.
/// A field whose JSON value is a number, a boolean, an object or an array (n, seed, stream, lora,
/// cache, ...) is read from its text as JSON; the request then goes through the JSON body's checks
/// (parse_image_request's), so a form is refused where the same JSON body is, with the same
/// message. A file part where a text field belongs, a field given twice and text that is not
/// UTF-8 are refused (ApiError 400 naming the field).
ImageRequest parse_image_form(const std::vector<FormPart>& parts, const RequestLimits& limits,
                              const std::string& model_id);

/// The request checked by the pipeline's own check() (what `shardit generate` refuses), as an
/// ApiError 400 with the pipeline's message.
void check_with_pipeline(const ImageRequest& request, const pipelines::DiffusionPipeline& pipeline);

/// The fields parse_image_request accepts at `endpoint`, in the order documented.
const std::vector<std::string>& request_fields(ImageEndpoint endpoint = ImageEndpoint::Generations);

}  // namespace shardit::serving

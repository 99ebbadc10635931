// `shardit preprocess-image`: an input image as the editing pipelines prepare it for the VAE
// encoder (pipelines/image_processor.h; Qwen-Image editing also for its text encoder), written as
// PNGs, or a check of an image_preprocess cases file against the images diffusers made.
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "apps/commands.h"
#include "shardit/io/file.h"
#include "shardit/io/image.h"
#include "shardit/io/json.h"
#include "shardit/io/png.h"
#include "shardit/pipelines/image_processor.h"
#include "shardit/pipelines/pipeline_qwenimage_edit_plus.h"

namespace shardit::apps {

namespace {

struct PreprocessImageOptions {
  std::string image;
  std::string pipeline = "flux2";
  std::string out;
  std::string cases;
  std::optional<int64_t> max_area;
};

/// The model input [1, 3, h, w] of `pixels` as `pipeline` ("flux2" or "kontext") makes it.
at::Tensor preprocess(const at::Tensor& pixels, const std::string& pipeline) {
  if (pipeline == "flux2") return pipelines::flux2_condition_image(pixels);
  TORCH_CHECK(pipeline == "kontext", "preprocess-image: unknown pipeline '", pipeline, "'; use flux2 or kontext");
  const auto [height, width] = pipelines::kontext_image_size(pixels.size(0), pixels.size(1), /*auto_resize=*/true);
  return pipelines::kontext_condition_image(pixels, height, width);
}

/// Whether `pipeline` resamples an image of this size (else it only crops and normalises).
bool resizes(const std::string& pipeline, int64_t height, int64_t width) {
  if (pipeline == "flux2") return height * width > 1024 * 1024;
  return pipelines::kontext_image_size(height, width, true) != std::make_pair(height, width);
}

/// A model input [1, 3, h, w] in [-1, 1] back to the uint8 [h, w, 3] image it equals.
at::Tensor to_pixels(const at::Tensor& input) {
  return io::to_uint8_pixels(((input[0].permute({1, 2, 0}) + 1.0) / 2.0));
}

/// One case of an image_preprocess cases file: "" when it passes, else why not; `detail`
/// receives what was compared.
std::string check_case(const nlohmann::json& entry, const std::filesystem::path& dir, std::string* detail) {
  const std::string source = entry.at("source").get<std::string>();
  const std::string pipeline = entry.at("pipeline").get<std::string>();
  const at::Tensor pixels = io::read_image((dir / source).string());
  if (entry.contains("source_hw")) {
    const auto hw = entry.at("source_hw").get<std::vector<int64_t>>();
    if (hw != std::vector<int64_t>{pixels.size(0), pixels.size(1)}) {
      return "the source decodes to " + std::to_string(pixels.size(0)) + "x" + std::to_string(pixels.size(1)) +
             ", the case says " + std::to_string(hw.at(0)) + "x" + std::to_string(hw.at(1));
    }
  }
  if (entry.contains("error")) {
    const std::string expected = entry.at("error").get<std::string>();
    try {
      const at::Tensor input = preprocess(pixels, pipeline);
      return "expected the error \"" + expected + "\", got an image of " + std::to_string(input.size(2)) + "x" +
             std::to_string(input.size(3));
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      *detail = "error \"" + message + "\"";
      return message == expected ? "" : "expected the error \"" + expected + "\", got \"" + message + "\"";
    }
  }
  const at::Tensor input = preprocess(pixels, pipeline);
  const at::Tensor expected_pixels = io::read_image((dir / entry.at("expected").get<std::string>()).string());
  const at::Tensor ours = to_pixels(input).to(at::kInt);
  const at::Tensor theirs = expected_pixels.to(at::kInt);
  if (ours.sizes() != theirs.sizes()) {
    return "size " + std::to_string(ours.size(0)) + "x" + std::to_string(ours.size(1)) + ", expected " +
           std::to_string(theirs.size(0)) + "x" + std::to_string(theirs.size(1));
  }
  // Within one 8-bit level where Pillow resampled (a C++ Lanczos may round a sum differently);
  // exact where the image was only cropped and normalised.
  const bool resampled = resizes(pipeline, pixels.size(0), pixels.size(1));
  const int64_t allowed = resampled ? 1 : 0;
  const at::Tensor difference = (ours - theirs).abs();
  const int64_t largest = difference.max().item<int64_t>();
  const int64_t differing = difference.gt(0).sum().item<int64_t>();
  *detail = std::to_string(ours.size(0)) + "x" + std::to_string(ours.size(1)) + (resampled ? ", resampled" : ", cropped") +
            ", max difference " + std::to_string(largest) + " level(s), " + std::to_string(differing) + " of " +
            std::to_string(difference.numel()) + " values differ";
  // The tensor must also be exactly png / 255 * 2 - 1 of our own image (no other rounding).
  if (!at::equal(pipelines::pixels_to_model_input(to_pixels(input)), input)) return "the tensor is not x / 255 * 2 - 1 of 8-bit pixels";
  return largest <= allowed ? "" : *detail + " (allowed " + std::to_string(allowed) + ")";
}

int run_cases(const std::string& path) {
  const nlohmann::json file = io::read_json_file(path);
  TORCH_CHECK(file.is_object() && file.contains("cases") && file.at("cases").is_array(), path,
              ": not an image_preprocess cases file (expected an object with a \"cases\" array)");
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  size_t passed = 0;
  size_t failed = 0;
  for (const auto& entry : file.at("cases")) {
    const std::string name = entry.value("pipeline", std::string("?")) + " " + entry.value("source", std::string("?"));
    std::string detail;
    std::string problem;
    try {
      problem = check_case(entry, dir, &detail);
    } catch (const c10::Error& e) {
      problem = e.what_without_backtrace();
    } catch (const nlohmann::json::exception& e) {
      problem = std::string("malformed case: ") + e.what();
    }
    if (problem.empty()) {
      ++passed;
      std::printf("ok %s: %s\n", name.c_str(), detail.c_str());
    } else {
      ++failed;
      std::printf("MISMATCH %s: %s\n", name.c_str(), problem.c_str());
    }
  }
  std::printf("%s: %zu passed, %zu failed\n", path.c_str(), passed, failed);
  return failed == 0 && passed > 0 ? 0 : 1;
}

/// Qwen-Image editing (QwenImageEditPlusPipeline): the VAE's input to `out`, and the image the
/// text encoder's processor receives (the 384² condition image) beside it as <out>.condition.png.
int run_qwenimage_edit(const PreprocessImageOptions& options) {
  std::filesystem::path condition_path(options.out);
  condition_path.replace_extension(".condition.png");
  io::check_output_path(options.out, {options.image});
  io::check_output_path(condition_path.string(), {options.image});
  const int64_t area = options.max_area.value_or(pipelines::kQwenImageEditVaeArea);
  const pipelines::QwenImageEditImage image = pipelines::qwenimage_edit_plus_image(io::read_image(options.image), area);
  io::write_png(options.out, to_pixels(image.vae_input));
  io::write_png(condition_path.string(), image.condition);
  std::printf("%s: qwenimage-edit VAE input of %lldx%lld (calculate_dimensions at the %lld-pixel area)\n",
              options.out.c_str(), static_cast<long long>(image.vae_height), static_cast<long long>(image.vae_width),
              static_cast<long long>(area));
  std::printf("%s: qwenimage-edit condition image of %lldx%lld (the text encoder's processor resizes it again "
              "within its min_pixels/max_pixels)\n",
              condition_path.string().c_str(), static_cast<long long>(image.condition.size(0)),
              static_cast<long long>(image.condition.size(1)));
  return 0;
}

int run_preprocess_image(const PreprocessImageOptions& options) {
  if (!options.cases.empty()) return run_cases(options.cases);
  TORCH_CHECK(!options.image.empty() && !options.out.empty(),
              "preprocess-image: give --image IN --out OUT.png, or --cases FILE");
  TORCH_CHECK(!options.max_area || options.pipeline == "qwenimage-edit",
              "preprocess-image: --max-area is for --pipeline qwenimage-edit");
  if (options.pipeline == "qwenimage-edit") return run_qwenimage_edit(options);
  io::check_output_path(options.out, {options.image});
  const at::Tensor input = preprocess(io::read_image(options.image), options.pipeline);
  io::write_png(options.out, to_pixels(input));
  std::printf("%s: %s input of %lldx%lld written\n", options.out.c_str(), options.pipeline.c_str(),
              static_cast<long long>(input.size(2)), static_cast<long long>(input.size(3)));
  return 0;
}

}  // namespace

void register_preprocess_image(CLI::App& app, CommandBody& body) {
  auto options = std::make_shared<PreprocessImageOptions>();
  CLI::App* command = app.add_subcommand(
      "preprocess-image", "Prepare an input image as an editing pipeline does (written as a PNG), or check a cases file");
  auto* image = command->add_option("--image", options->image, "the input image (PNG or JPEG)");
  command->add_option("--pipeline", options->pipeline,
                      "flux2 (FLUX.2 [klein]/[dev] reference images) | kontext (FLUX.1 Kontext, auto-resized) | "
                      "qwenimage-edit (QwenImageEditPlusPipeline: the VAE's image to --out, the text encoder's "
                      "condition image to <out>.condition.png); default flux2")
      ->check(CLI::IsMember({"flux2", "kontext", "qwenimage-edit"}));
  command->add_option("--max-area", options->max_area,
                      "qwenimage-edit: the VAE image's area in pixels (default 1048576 = 1024x1024)")
      ->check(CLI::Range(int64_t{1}, pipelines::kMaxArea));
  auto* out = command->add_option("--out", options->out, "the processed image as a PNG (never the input)");
  auto* cases = command->add_option("--cases", options->cases,
                                    "an image_preprocess case.json to check; exits 1 on any mismatch");
  cases->excludes(image);
  cases->excludes(out);
  command->callback([&body, options] {
    body = [options] {
      const int status = run_preprocess_image(*options);
      std::fflush(stdout);
      return status;
    };
  });
}

}  // namespace shardit::apps

#pragma once
// The golden pipeline cases (pipeline_flux1, pipeline_flux2_klein, pipeline_qwenimage): the
// request their case.json `call` describes, from the stored prompt embeddings and latents, and
// the comparison of a run with the stored per-step latents, image and PNGs.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "shardit/pipelines/pipeline.h"

namespace shardit::testing {

struct PipelineCase {
  std::string dir;                     ///< the pipeline folder
  pipelines::GenerateRequest request;  ///< with prompt embeddings, latents and the call's values
  std::vector<std::string> cli_args;   ///< the same as `shardit generate` arguments (no --out)
  int64_t steps = 0;
  int64_t batch = 0;
  /// Where the expected outputs are (outputs.safetensors, image_<i>.png) and the prefix of their
  /// names: the pipeline folder and "" for text-to-image; an edit case's folder and "<run>.".
  std::string outputs_dir;
  std::string output_prefix;
  /// The pipeline class to load the folder as (`--pipeline`), when not model_index.json's.
  std::optional<std::string> pipeline_class;
};

/// Reads `dir`'s case.json, inputs.safetensors and the embeddings in outputs.safetensors.
PipelineCase read_pipeline_case(const std::string& dir);

/// The golden case `name` with its prompts as text (case.json `call`: prompt, negative_prompt)
/// instead of the stored embeddings, in the request and the CLI arguments alike.
PipelineCase read_prompt_case(const std::string& name);

/// The editing case `name` (edit_flux2_klein, edit_flux2_dev, edit_flux1_kontext), run `run`
/// ("refs_a", "refs_ab"): the pipeline case its `latents` come from, with the run's reference
/// images (request.image and --image), Kontext's class, max_area and _auto_resize, and the
/// edit case's outputs as the expected ones.
PipelineCase read_edit_case(const std::string& name, const std::string& run);

/// The Qwen-Image editing run `tag` of the golden folder `name` (case.json `pipeline.runs`:
/// edit_qwenimage's plus_one ... edit_one_cfg; edit_qwenimage_zero_cond_t's run with
/// Qwen-Image-Edit-2511's transformer): its prompt (and negative prompt) as text, its images,
/// seed, true_cfg_scale, the case's VAE area as max_area, height/width where the run gives them,
/// and QwenImageEditPipeline as the class for the runs of that pipeline; request and CLI alike.
PipelineCase read_qwen_edit_case(const std::string& tag, const std::string& name = "edit_qwenimage");

/// The tags of every run of the golden folder `name` (case.json `pipeline.runs`), in order.
std::vector<std::string> qwen_edit_case_tags(const std::string& name = "edit_qwenimage");

/// The case with `steps` denoising steps instead of its own (request and CLI arguments).
void set_case_steps(PipelineCase& golden, int64_t steps);

// Tolerances from the golden README: every intermediate |a - b| <= 1e-4 + 1e-4 |b|, the image
// <= 1e-4 absolute, PNG pixels +-1.
constexpr double kPipelineAtol = 1e-4;
constexpr double kPipelineRtol = 1e-4;
constexpr double kImageAtol = 1e-4;

/// Compares the latents after each step (`step_latents[k]` with stepK.latents), the image with
/// `image`, and uint8(round(image * 255)) with the stored image_<i>.png (+-1). `what` names the run.
void expect_pipeline_matches(const PipelineCase& golden, const std::vector<at::Tensor>& step_latents,
                             const at::Tensor& image, const std::string& what);

/// Runs the case's request through the C++ API on this rank alone (VAE loaded, text encoders
/// when the folder has them) and compares every step, the image and the final latents.
void expect_api_matches(PipelineCase& golden, const std::string& what);

/// What `shardit generate` wrote for a golden case.
struct GenerateCliRun {
  std::vector<at::Tensor> step_latents;  ///< stepK.latents from --save-steps
  at::Tensor image;
  at::Tensor latents;
  std::vector<std::string> pngs;
  std::string output;  ///< stdout + stderr
  at::Tensor cache_computed;  ///< `cache.computed` when the run had a step cache
  at::Tensor cache_ratio;     ///< `cache.ratio` (First-Block Cache)
};

/// Runs `shardit <global_options> generate` with the case's arguments and `options` (more
/// generate flags), writing into a temp folder; a test failure when it exits non-zero.
GenerateCliRun run_generate_cli(const PipelineCase& golden, const std::string& global_options,
                                const std::string& options = "");

/// Compares PNG files written by `shardit generate` with the stored ones (+-1 per channel).
void expect_pngs_match(const PipelineCase& golden, const std::vector<std::string>& pngs, const std::string& what);

}  // namespace shardit::testing

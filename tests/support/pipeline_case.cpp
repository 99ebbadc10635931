#include "support/pipeline_case.h"

#include <fmt/format.h>

#include <algorithm>

#include "shardit/io/image.h"
#include "shardit/io/json.h"
#include "shardit/io/png.h"
#include "shardit/io/safetensors.h"
#include "support/test_support.h"

namespace shardit::testing {

PipelineCase read_pipeline_case(const std::string& dir) {
  PipelineCase golden;
  golden.dir = dir;
  const nlohmann::json case_json = io::read_json_file(dir + "/case.json");
  const nlohmann::json& call = case_json.at("call");
  auto& request = golden.request;
  request.height = call.at("height").get<int64_t>();
  request.width = call.at("width").get<int64_t>();
  request.num_inference_steps = call.at("num_inference_steps").get<int64_t>();
  request.num_images_per_prompt = call.value("num_images_per_prompt", int64_t{1});
  request.max_sequence_length = call.value("max_sequence_length", int64_t{512});
  request.notes = false;
  golden.cli_args = {"--model",
                     dir,
                     "--prompt-embeds",
                     dir + "/outputs.safetensors",
                     "--latents",
                     dir + "/inputs.safetensors",
                     "--height",
                     std::to_string(*request.height),
                     "--width",
                     std::to_string(*request.width),
                     "--steps",
                     std::to_string(*request.num_inference_steps),
                     "--num-images",
                     std::to_string(request.num_images_per_prompt),
                     "--max-sequence-length",
                     std::to_string(request.max_sequence_length)};
  if (call.contains("guidance_scale")) {
    request.guidance_scale = call.at("guidance_scale").get<double>();
    golden.cli_args.insert(golden.cli_args.end(), {"--guidance", fmt::format("{}", *request.guidance_scale)});
  }
  if (call.contains("true_cfg_scale")) {
    request.true_cfg_scale = call.at("true_cfg_scale").get<double>();
    golden.cli_args.insert(golden.cli_args.end(), {"--true-cfg-scale", fmt::format("{}", *request.true_cfg_scale)});
  }
  const std::string outputs = dir + "/outputs.safetensors";
  request.prompt_embeds = pipelines::read_prompt_embeds(outputs);
  request.negative_prompt_embeds = pipelines::read_prompt_embeds(outputs, "negative_");
  request.latents = io::SafetensorsFile::open(dir + "/inputs.safetensors")->read("latents");
  golden.steps = *request.num_inference_steps;
  golden.batch = request.prompt_embeds->num_prompts() * request.num_images_per_prompt;
  golden.outputs_dir = dir;
  return golden;
}

PipelineCase read_edit_case(const std::string& name, const std::string& run) {
  const std::string edit_dir = golden_path(name);
  const nlohmann::json edit = io::read_json_file(edit_dir + "/case.json");
  const nlohmann::json& call = edit.at("call");
  // "latents": "../pipeline_flux2_klein/inputs.safetensors['latents']": the pipeline case it edits from.
  const std::string latents = call.at("latents").get<std::string>();
  const size_t start = latents.find("../") + 3;
  PipelineCase golden = read_pipeline_case(golden_path(latents.substr(start, latents.find('/', start) - start)));
  golden.outputs_dir = edit_dir;
  golden.output_prefix = run + ".";
  EXPECT_EQ(call.at("num_inference_steps").get<int64_t>(), golden.steps) << name;
  EXPECT_EQ(call.at("height").get<int64_t>(), *golden.request.height) << name;
  EXPECT_EQ(call.at("width").get<int64_t>(), *golden.request.width) << name;
  EXPECT_EQ(call.at("guidance_scale").get<double>(), golden.request.guidance_scale.value_or(-1)) << name;
  const std::string pipeline = edit.at("pipeline").get<std::string>();
  if (pipeline.rfind("FluxKontextPipeline", 0) == 0) {
    golden.pipeline_class = "FluxKontextPipeline";
    golden.cli_args.insert(golden.cli_args.end(), {"--pipeline", "FluxKontextPipeline"});
  }
  if (call.contains("max_area")) {
    golden.request.max_area = call.at("max_area").get<int64_t>();
    golden.cli_args.insert(golden.cli_args.end(), {"--max-area", std::to_string(*golden.request.max_area)});
  }
  if (call.contains("_auto_resize") && !call.at("_auto_resize").get<bool>()) {
    golden.request.auto_resize = false;
    golden.cli_args.push_back("--no-auto-resize");
  }
  bool found = false;
  for (const auto& entry : edit.at("runs")) {
    if (entry.at("tag").get<std::string>() != run) continue;
    found = true;
    for (const auto& reference : entry.at("references")) {
      const std::string path = edit_dir + "/" + reference.get<std::string>();
      golden.request.image.push_back(io::read_image(path));
      golden.cli_args.insert(golden.cli_args.end(), {"--image", path});
    }
  }
  EXPECT_TRUE(found) << name << " has no run " << run;
  return golden;
}

PipelineCase read_qwen_edit_case(const std::string& tag, const std::string& name) {
  const std::string dir = golden_path(name);
  const nlohmann::json pipeline = io::read_json_file(dir + "/case.json").at("pipeline");
  PipelineCase golden;
  golden.dir = dir;
  golden.outputs_dir = dir;
  golden.output_prefix = tag + ".";
  golden.steps = pipeline.at("num_inference_steps").get<int64_t>();
  golden.batch = 1;
  auto& request = golden.request;
  request.notes = false;
  request.prompt = {pipeline.at("prompt").get<std::string>()};
  request.num_inference_steps = golden.steps;
  request.max_area = pipeline.at("areas").at("vae").get<int64_t>();
  golden.cli_args = {"--model", dir, "--prompt", request.prompt[0], "--steps", std::to_string(golden.steps),
                     "--max-area", std::to_string(*request.max_area)};
  bool found = false;
  for (const auto& run : pipeline.at("runs")) {
    if (run.at("tag").get<std::string>() != tag) continue;
    found = true;
    request.seed = run.at("seed").get<uint64_t>();
    request.true_cfg_scale = run.at("true_cfg_scale").get<double>();
    golden.cli_args.insert(golden.cli_args.end(), {"--seed", std::to_string(request.seed), "--true-cfg-scale",
                                                   fmt::format("{}", *request.true_cfg_scale)});
    if (run.contains("height")) {
      request.height = run.at("height").get<int64_t>();
      request.width = run.at("width").get<int64_t>();
      golden.cli_args.insert(golden.cli_args.end(), {"--height", std::to_string(*request.height), "--width",
                                                     std::to_string(*request.width)});
    }
    if (run.contains("negative_prompt")) {
      request.negative_prompt = {run.at("negative_prompt").get<std::string>()};
      golden.cli_args.insert(golden.cli_args.end(), {"--negative-prompt", request.negative_prompt[0]});
    }
    for (const auto& image : run.at("images")) {
      const std::string path = dir + "/" + image.get<std::string>();
      request.image.push_back(io::read_image(path));
      golden.cli_args.insert(golden.cli_args.end(), {"--image", path});
    }
    const std::string class_name = run.at("pipeline").get<std::string>();
    if (class_name != io::read_json_file(dir + "/model_index.json").at("_class_name").get<std::string>()) {
      golden.pipeline_class = class_name;
      golden.cli_args.insert(golden.cli_args.end(), {"--pipeline", class_name});
    }
  }
  EXPECT_TRUE(found) << name << " has no pipeline run " << tag;
  return golden;
}

std::vector<std::string> qwen_edit_case_tags(const std::string& name) {
  std::vector<std::string> tags;
  const nlohmann::json case_json = io::read_json_file(golden_path(name) + "/case.json");
  for (const auto& run : case_json.at("pipeline").at("runs")) {
    tags.push_back(run.at("tag").get<std::string>());
  }
  return tags;
}

namespace {

/// A string or a list of strings of case.json `call` (empty when absent).
std::vector<std::string> call_strings(const nlohmann::json& call, const std::string& key) {
  if (!call.contains(key)) return {};
  const nlohmann::json& value = call.at(key);
  if (value.is_string()) return {value.get<std::string>()};
  return value.get<std::vector<std::string>>();
}

}  // namespace

PipelineCase read_prompt_case(const std::string& name) {
  PipelineCase golden = read_pipeline_case(golden_path(name));
  const nlohmann::json call = io::read_json_file(golden.dir + "/case.json").at("call");
  golden.request.prompt = call_strings(call, "prompt");
  golden.request.negative_prompt = call_strings(call, "negative_prompt");
  golden.request.prompt_embeds.reset();
  golden.request.negative_prompt_embeds.reset();
  EXPECT_EQ(static_cast<int64_t>(golden.request.prompt.size()) * golden.request.num_images_per_prompt, golden.batch);

  std::vector<std::string> args;
  for (size_t i = 0; i < golden.cli_args.size(); ++i) {
    if (golden.cli_args[i] == "--prompt-embeds") {
      ++i;
      continue;
    }
    args.push_back(golden.cli_args[i]);
  }
  for (const auto& prompt : golden.request.prompt) args.insert(args.end(), {"--prompt", prompt});
  for (const auto& prompt : golden.request.negative_prompt) args.insert(args.end(), {"--negative-prompt", prompt});
  golden.cli_args = args;
  return golden;
}

void set_case_steps(PipelineCase& golden, int64_t steps) {
  golden.steps = steps;
  golden.request.num_inference_steps = steps;
  const auto flag = std::find(golden.cli_args.begin(), golden.cli_args.end(), "--steps");
  ASSERT_TRUE(flag != golden.cli_args.end() && flag + 1 != golden.cli_args.end());
  *(flag + 1) = std::to_string(steps);
}

void expect_pipeline_matches(const PipelineCase& golden, const std::vector<at::Tensor>& step_latents,
                             const at::Tensor& image, const std::string& what) {
  const auto outputs = io::SafetensorsFile::open(golden.outputs_dir + "/outputs.safetensors");
  ASSERT_EQ(static_cast<int64_t>(step_latents.size()), golden.steps) << what;
  for (int64_t k = 0; k < golden.steps; ++k) {
    const std::string name = golden.output_prefix + "step" + std::to_string(k) + ".latents";
    EXPECT_TRUE(tensors_close(what + ": " + name, step_latents[static_cast<size_t>(k)].to(at::kFloat),
                              outputs->read(name), kPipelineAtol, kPipelineRtol));
  }
  const at::Tensor expected = outputs->read(golden.output_prefix + "image");
  const auto image_check = tensors_close(what + ": image", image, expected, kImageAtol, 0.0);
  EXPECT_TRUE(image_check);
  std::cout << image_check.message() << "\n";
  for (int64_t i = 0; i < golden.batch; ++i) {
    const at::Tensor png =
        io::read_png(golden.outputs_dir + "/" + golden.output_prefix + "image_" + std::to_string(i) + ".png").to(at::kInt);
    const at::Tensor ours = io::to_uint8_pixels(image[i]).to(at::kInt);
    EXPECT_LE((ours - png).abs().max().item<int>(), 1) << what << ": image " << i << " pixels";
  }
}

void expect_api_matches(PipelineCase& golden, const std::string& what) {
  std::vector<at::Tensor> steps;
  golden.request.callback_on_step_end = [&steps](int64_t, const at::Tensor& latents) {
    steps.push_back(latents.clone());
  };
  pipelines::PipelineLoadOptions options;
  options.load_vae = true;
  options.pipeline_class = golden.pipeline_class;
  const auto pipeline = pipelines::DiffusionPipeline::from_pretrained(golden.dir, options);
  const auto result = pipeline->generate(golden.request);
  expect_pipeline_matches(golden, steps, result.image, what);
  ASSERT_FALSE(steps.empty()) << what;
  EXPECT_TRUE(at::equal(result.latents, steps.back())) << what;
}

GenerateCliRun run_generate_cli(const PipelineCase& golden, const std::string& global_options,
                                const std::string& options) {
  const std::string dir = make_temp_dir("pipeline-cli");
  std::string command = cli_path() + " " + global_options + " generate";
  for (const auto& arg : golden.cli_args) {
    std::string quoted;
    for (char c : arg) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
    command += " '" + quoted + "'";
  }
  command += " " + options + " --out " + dir + "/out.png --out-tensors " + dir + "/tensors.safetensors --save-steps";
  GenerateCliRun run;
  EXPECT_EQ(run_command(command, &run.output), 0) << run.output;
  const auto tensors = io::SafetensorsFile::open(dir + "/tensors.safetensors");
  for (int64_t k = 0; k < golden.steps; ++k)
    run.step_latents.push_back(tensors->read("step" + std::to_string(k) + ".latents"));
  run.image = tensors->read("image");
  run.latents = tensors->read("latents");
  if (tensors->contains("cache.computed")) run.cache_computed = tensors->read("cache.computed");
  if (tensors->contains("cache.ratio")) run.cache_ratio = tensors->read("cache.ratio");
  run.pngs = io::image_paths(dir + "/out.png", golden.batch);
  return run;
}

void expect_pngs_match(const PipelineCase& golden, const std::vector<std::string>& pngs, const std::string& what) {
  ASSERT_EQ(static_cast<int64_t>(pngs.size()), golden.batch) << what;
  for (int64_t i = 0; i < golden.batch; ++i) {
    const at::Tensor expected =
        io::read_png(golden.outputs_dir + "/" + golden.output_prefix + "image_" + std::to_string(i) + ".png").to(at::kInt);
    const at::Tensor ours = io::read_png(pngs[static_cast<size_t>(i)]).to(at::kInt);
    ASSERT_EQ(ours.sizes(), expected.sizes()) << what << ": " << pngs[static_cast<size_t>(i)];
    EXPECT_LE((ours - expected).abs().max().item<int>(), 1) << what << ": " << pngs[static_cast<size_t>(i)];
  }
}

}  // namespace shardit::testing

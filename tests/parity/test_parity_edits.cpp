// Editing with reference images, single rank, against diffusers' Flux2KleinPipeline(image=[...]),
// Flux2Pipeline(image=[...]), FluxKontextPipeline(image=...), QwenImageEditPlusPipeline(image=[...])
// and QwenImageEditPipeline(image=...) on the golden edit cases: the
// reference tokens and ids appended to the first transformer call, the latents after every step
// (noise tokens only), the image and its PNG, through the C++ API and `shardit generate --image`;
// and the errors of a request whose images a pipeline cannot take.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "shardit/io/image.h"
#include "shardit/io/json.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/step_cache.h"
#include "shardit/pipelines/image_processor.h"
#include "shardit/pipelines/pipeline.h"
#include "support/pipeline_case.h"
#include "support/test_support.h"

namespace test_parity_edits {
namespace {

using shardit::pipelines::DiffusionPipeline;
using shardit::pipelines::PipelineLoadOptions;
using shardit::testing::PipelineCase;

struct EditRun {
  std::string name;  ///< the golden folder
  std::string run;   ///< its run tag
};

std::string run_label(const EditRun& edit) { return edit.name + "_" + edit.run; }

std::unique_ptr<DiffusionPipeline> load_edit_pipeline(const PipelineCase& golden) {
  PipelineLoadOptions options;
  options.load_vae = true;
  options.load_text_encoders = false;
  options.pipeline_class = golden.pipeline_class;
  return DiffusionPipeline::from_pretrained(golden.dir, options);
}

class EditParity : public ::testing::TestWithParam<EditRun> {};

TEST_P(EditParity, ApiMatchesDiffusers) {
  PipelineCase golden = shardit::testing::read_edit_case(GetParam().name, GetParam().run);
  shardit::testing::expect_api_matches(golden, run_label(GetParam()) + " (API, TP=1)");
}

// The first transformer call's hidden_states are the noise tokens then every reference image's
// packed, normalised latents; img_ids likewise (FLUX.2 (10 + 10 k, row, col, 0), Kontext (1, row, col)).
TEST_P(EditParity, ReferenceTokensAndIdsMatchTheFirstTransformerCall) {
  const PipelineCase golden = shardit::testing::read_edit_case(GetParam().name, GetParam().run);
  const auto pipeline = load_edit_pipeline(golden);
  const auto references = pipeline->reference_tokens(golden.request, golden.batch);
  ASSERT_TRUE(references.defined());
  const auto outputs = shardit::io::SafetensorsFile::open(golden.outputs_dir + "/outputs.safetensors");
  const at::Tensor hidden = outputs->read(golden.output_prefix + "transformer.hidden_states");  // [B, N + M, C]
  const at::Tensor ids = outputs->read(golden.output_prefix + "transformer.img_ids");
  const int64_t m = references.latents.size(1);
  const int64_t n = hidden.size(1) - m;
  ASSERT_EQ(n, (*golden.request.height / 16) * (*golden.request.width / 16));
  EXPECT_TRUE(shardit::testing::tensors_close(run_label(GetParam()) + ": reference tokens", references.latents,
                                              hidden.narrow(1, n, m), shardit::testing::kPipelineAtol,
                                              shardit::testing::kPipelineRtol));
  // FLUX.2's ids are batched [B, N + M, 4]; FLUX.1's [N + M, 3].
  const int64_t sequence_dim = ids.dim() == 3 ? 1 : 0;
  ASSERT_EQ(references.ids.sizes(), ids.narrow(sequence_dim, n, m).sizes());
  EXPECT_TRUE(at::equal(references.ids.to(ids.scalar_type()), ids.narrow(sequence_dim, n, m)))
      << references.ids << "\nexpected\n" << ids.narrow(sequence_dim, n, m);
}

TEST_P(EditParity, CliWithImageMatchesDiffusers) {
  const PipelineCase golden = shardit::testing::read_edit_case(GetParam().name, GetParam().run);
  const auto run = shardit::testing::run_generate_cli(golden, "");
  shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image, run_label(GetParam()) + " (CLI)");
  shardit::testing::expect_pngs_match(golden, run.pngs, run_label(GetParam()) + " (CLI PNG)");
}

INSTANTIATE_TEST_SUITE_P(Golden, EditParity,
                         ::testing::Values(EditRun{"edit_flux2_klein", "refs_a"}, EditRun{"edit_flux2_klein", "refs_ab"},
                                           EditRun{"edit_flux2_dev", "refs_a"},
                                           EditRun{"edit_flux1_kontext", "refs_a"}),
                         [](const auto& info) { return run_label(info.param); });

// Qwen-Image editing (QwenImageEditPlusPipeline with 1, 2, 3 images, QwenImageEditPipeline),
// without and with true CFG, from the prompt as text: the text encoder reads it with the images.
// edit_qwenimage_zero_cond_t: two images and true CFG with Qwen-Image-Edit-2511's transformer
// (zero_cond_t: the reference tokens modulated with timestep 0), diffusers 0.37.0.
struct QwenEditRun {
  std::string name;  ///< the golden folder
  std::string tag;   ///< its run
};

const std::vector<std::string> kQwenEditRuns = {"plus_one",     "plus_two",       "plus_three", "plus_one_cfg",
                                                "plus_two_cfg", "plus_three_cfg", "edit_one",   "edit_one_cfg"};
const std::vector<std::string> kQwenEditZeroCondTRuns = {"plus_two_cfg_zero_cond_t"};

std::vector<QwenEditRun> qwen_edit_runs() {
  std::vector<QwenEditRun> runs;
  for (const auto& tag : kQwenEditRuns) runs.push_back({"edit_qwenimage", tag});
  for (const auto& tag : kQwenEditZeroCondTRuns) runs.push_back({"edit_qwenimage_zero_cond_t", tag});
  return runs;
}

class QwenEditParity : public ::testing::TestWithParam<QwenEditRun> {};

TEST_P(QwenEditParity, ApiMatchesDiffusers) {
  PipelineCase golden = shardit::testing::read_qwen_edit_case(GetParam().tag, GetParam().name);
  shardit::testing::expect_api_matches(golden, GetParam().name + " " + GetParam().tag + " (API, TP=1)");
}

// The first transformer call's hidden_states: the noise tokens, then every image's packed,
// normalised latents; each image's grid as img_shapes gives it.
TEST_P(QwenEditParity, ReferenceTokensAndGridsMatchTheFirstTransformerCall) {
  const PipelineCase golden = shardit::testing::read_qwen_edit_case(GetParam().tag, GetParam().name);
  const auto pipeline = load_edit_pipeline(golden);
  const auto references = pipeline->reference_tokens(golden.request, golden.batch);
  ASSERT_TRUE(references.defined());
  const auto outputs = shardit::io::SafetensorsFile::open(golden.outputs_dir + "/outputs.safetensors");
  const at::Tensor hidden = outputs->read(golden.output_prefix + "transformer.hidden_states");  // [B, N + M, C]
  const int64_t m = references.latents.size(1);
  EXPECT_TRUE(shardit::testing::tensors_close(GetParam().name + " " + GetParam().tag + ": reference tokens",
                                              references.latents, hidden.narrow(1, hidden.size(1) - m, m),
                                              shardit::testing::kPipelineAtol, shardit::testing::kPipelineRtol));
  const nlohmann::json case_json = shardit::io::read_json_file(golden.dir + "/case.json");
  for (const auto& run : case_json.at("pipeline").at("runs")) {
    if (run.at("tag").get<std::string>() != GetParam().tag) continue;
    // img_shapes: the noise grid, then each image's.
    auto shapes = run.at("img_shapes").get<std::vector<std::vector<int64_t>>>();
    shapes.erase(shapes.begin());
    std::vector<int64_t> flat;
    for (const auto& shape : shapes) flat.insert(flat.end(), shape.begin(), shape.end());
    EXPECT_TRUE(at::equal(references.ids, at::tensor(flat, at::kLong).view({-1, 3}))) << references.ids;
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, QwenEditParity, ::testing::ValuesIn(qwen_edit_runs()),
                         [](const auto& info) { return info.param.tag; });

TEST(QwenEditCasesGolden, EveryRunOfTheCaseIsTested) {
  EXPECT_EQ(shardit::testing::qwen_edit_case_tags(), kQwenEditRuns);
  EXPECT_EQ(shardit::testing::qwen_edit_case_tags("edit_qwenimage_zero_cond_t"), kQwenEditZeroCondTRuns);
}

// The zero_cond_t case is Qwen-Image-Edit-2511's transformer: its folder says so, and it is the
// only difference from edit_qwenimage's (the same weights), so the runs above check zero_cond_t.
TEST(QwenEditCasesGolden, ZeroCondTFolderDiffersInZeroCondTOnly) {
  const std::string dir = shardit::testing::golden_path("edit_qwenimage_zero_cond_t");
  const std::string base = shardit::testing::golden_path("edit_qwenimage");
  nlohmann::json config = shardit::io::read_json_file(dir + "/transformer/config.json");
  nlohmann::json base_config = shardit::io::read_json_file(base + "/transformer/config.json");
  EXPECT_TRUE(config.at("zero_cond_t").get<bool>());
  EXPECT_FALSE(base_config.at("zero_cond_t").get<bool>());
  for (auto* c : {&config, &base_config}) {
    c->erase("zero_cond_t");
    c->erase("_diffusers_version");
  }
  EXPECT_EQ(config, base_config);
}

// `shardit generate --image` (repeated): the output size from the last image, and the
// single-image pipeline with CFG through --pipeline.
TEST(QwenEditCliGolden, GenerateWithImagesMatchesDiffusers) {
  for (const std::string tag : {"plus_three", "edit_one_cfg"}) {
    const PipelineCase golden = shardit::testing::read_qwen_edit_case(tag);
    const auto run = shardit::testing::run_generate_cli(golden, "");
    shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image, tag + " (CLI)");
    shardit::testing::expect_pngs_match(golden, run.pngs, tag + " (CLI PNG)");
  }
}

// What a Qwen-Image edit request is refused for, before anything loads: named, with the way out.
TEST(QwenEditErrorsGolden, RequestsThePipelinesCannotTake) {
  PipelineCase golden = shardit::testing::read_qwen_edit_case("plus_three");
  PipelineLoadOptions options;  // opened only: nothing loads
  const auto plus = DiffusionPipeline::open(golden.dir, options);
  EXPECT_EQ(plus->class_name(), "QwenImageEditPlusPipeline");
  auto request = golden.request;
  request.image.push_back(request.image.front());
  const std::string four = shardit::testing::error_of([&] { plus->check(request); });
  EXPECT_NE(four.find("QwenImageEditPlusPipeline takes at most 3 reference images"), std::string::npos) << four;
  request = golden.request;
  request.image.clear();
  const std::string none = shardit::testing::error_of([&] { plus->check(request); });
  EXPECT_NE(none.find("edits images: give 1 to 3 with --image"), std::string::npos) << none;
  request = golden.request;
  request.prompt.push_back("another");
  const std::string prompts = shardit::testing::error_of([&] { plus->check(request); });
  EXPECT_NE(prompts.find("takes one prompt per call"), std::string::npos) << prompts;
  // A 1000:1 strip has no height at the case's 48² area.
  request = golden.request;
  request.image = {at::zeros({2, 2000, 3}, at::kByte), golden.request.image.front()};
  const std::string strip = shardit::testing::error_of([&] { plus->check(request); });
  EXPECT_NE(strip.find("reference image 0 (--image)"), std::string::npos) << strip;
  EXPECT_NE(strip.find("aspect ratio is too extreme"), std::string::npos) << strip;

  options.pipeline_class = "QwenImageEditPipeline";
  const auto single = DiffusionPipeline::open(golden.dir, options);
  request = golden.request;
  EXPECT_NE(shardit::testing::error_of([&] { single->check(request); }).find("QwenImageEditPipeline takes at most 1"),
            std::string::npos);

  // A text-to-image Qwen-Image folder has no processor: its text encoder cannot read images.
  options.pipeline_class = "QwenImageEditPlusPipeline";
  const std::string t2i = shardit::testing::error_of(
      [&] { DiffusionPipeline::open(shardit::testing::golden_path("pipeline_qwenimage"), options); });
  EXPECT_NE(t2i.find("lists no 'processor' component"), std::string::npos) << t2i;
  // And the text-to-image pipeline refuses images, naming the edit pipelines.
  options.pipeline_class = "QwenImagePipeline";
  const auto t2i_pipeline = DiffusionPipeline::open(golden.dir, options);
  EXPECT_NE(shardit::testing::error_of([&] { t2i_pipeline->check(golden.request); }).find("QwenImageEditPlusPipeline"),
            std::string::npos);
}

// A Qwen-Image-Edit (2509-style, single-image) folder names QwenImageEditPipeline in its
// model_index.json: it opens as that class without --pipeline; the Plus folder as Plus.
TEST(QwenEditFolderGolden, ModelIndexChoosesTheEditPipeline) {
  const std::string dir = shardit::testing::make_temp_dir("qwen-edit-folder") + "/edit";
  const std::string plus_dir = shardit::testing::golden_path("edit_qwenimage");
  std::filesystem::create_directories(dir);
  for (const char* component : {"scheduler", "transformer", "vae", "text_encoder", "tokenizer", "processor"}) {
    std::filesystem::copy(plus_dir + "/" + component, dir + "/" + component, std::filesystem::copy_options::recursive);
  }
  nlohmann::json index = shardit::io::read_json_file(plus_dir + "/model_index.json");
  index["_class_name"] = "QwenImageEditPipeline";
  std::ofstream(dir + "/model_index.json") << index.dump(2);
  PipelineLoadOptions options;
  options.load_text_encoders = false;
  EXPECT_EQ(DiffusionPipeline::open(dir, options)->class_name(), "QwenImageEditPipeline");
  EXPECT_EQ(DiffusionPipeline::open(plus_dir, options)->class_name(), "QwenImageEditPlusPipeline");
}

// Step caching is the transformer's (models/step_cache.h), whatever the pipeline: a First-Block
// Cache that skips every step it may computes the first step of both CFG branches in full (diffusers'
// latents after step 0) and skips the second, reporting both contexts.
TEST(QwenEditCacheGolden, FirstBlockCacheSkipsAfterAFullFirstStep) {
  PipelineCase golden = shardit::testing::read_qwen_edit_case("plus_three_cfg");
  std::vector<at::Tensor> steps;
  golden.request.callback_on_step_end = [&steps](int64_t, const at::Tensor& latents) { steps.push_back(latents.clone()); };
  golden.request.cache = shardit::models::StepCacheConfig::parse("first_block_cache:threshold=1000000");
  PipelineLoadOptions options;
  options.load_vae = true;
  const auto pipeline = DiffusionPipeline::from_pretrained(golden.dir, options);
  const auto result = pipeline->generate(golden.request);
  EXPECT_EQ(result.cache_contexts, (std::vector<std::string>{"cond", "uncond"}));
  ASSERT_TRUE(result.cache_computed.defined());
  EXPECT_TRUE(at::equal(result.cache_computed, at::tensor({1, 1, 0, 0}, at::kLong).view({2, 2})))
      << result.cache_computed;
  const auto outputs = shardit::io::SafetensorsFile::open(golden.outputs_dir + "/outputs.safetensors");
  EXPECT_TRUE(shardit::testing::tensors_close("plus_three_cfg cached: step0.latents", steps.at(0),
                                              outputs->read("plus_three_cfg.step0.latents"),
                                              shardit::testing::kPipelineAtol, shardit::testing::kPipelineRtol));
}

// LoRA adapters are the transformer's too: a Qwen-Image PEFT adapter (lora_qwenimage_peft, whose
// modules the edit case's transformer shares) loaded at its weight, and fused, give the same edit,
// and not the edit without it.
TEST(QwenEditLoraGolden, AdapterAndFusedAdapterGiveTheSameEdit) {
  const PipelineCase golden = shardit::testing::read_qwen_edit_case("plus_two");
  const std::string adapter = shardit::testing::golden_path("lora_qwenimage_peft") + "/pixel.safetensors";
  std::vector<at::Tensor> latents;
  for (const bool fuse : {false, true}) {
    PipelineLoadOptions options;
    options.lora = {{adapter, 0.8, ""}};
    options.fuse_lora = fuse;
    latents.push_back(DiffusionPipeline::from_pretrained(golden.dir, options)->generate(golden.request).latents);
  }
  EXPECT_TRUE(shardit::testing::tensors_close("plus_two: LoRA fused vs unfused", latents[1], latents[0],
                                              shardit::testing::kPipelineAtol, shardit::testing::kPipelineRtol));
  const at::Tensor base =
      shardit::io::SafetensorsFile::open(golden.outputs_dir + "/outputs.safetensors")->read("plus_two.step1.latents");
  EXPECT_GT((latents[0] - base).abs().max().item<double>(), 1e-2) << "the adapter changed nothing";
}

// What a request with images is refused for, before anything runs: named, with the way out.
TEST(EditErrorsGolden, PipelinesRefuseImagesTheyCannotTake) {
  const std::string flux1 = shardit::testing::golden_path("pipeline_flux1");
  PipelineCase text_to_image = shardit::testing::read_pipeline_case(flux1);
  text_to_image.request.image = {at::zeros({64, 64, 3}, at::kByte)};
  PipelineLoadOptions options;
  options.load_text_encoders = false;
  const auto flux = DiffusionPipeline::open(flux1, options);
  EXPECT_NE(shardit::testing::error_of([&] { flux->check(text_to_image.request); }).find("FluxKontextPipeline"),
            std::string::npos);
  text_to_image.request.image.clear();
  text_to_image.request.max_area = 4096;
  EXPECT_NE(shardit::testing::error_of([&] { flux->check(text_to_image.request); }).find("max_area"), std::string::npos);

  PipelineCase klein = shardit::testing::read_edit_case("edit_flux2_klein", "refs_a");
  const auto flux2 = DiffusionPipeline::open(klein.dir, options);
  klein.request.image.assign(11, klein.request.image.front());
  EXPECT_NE(shardit::testing::error_of([&] { flux2->check(klein.request); }).find("at most 10"), std::string::npos);
  // Flux2ImageProcessor.check_image_input's own messages.
  klein.request.image = {at::zeros({50, 200, 3}, at::kByte)};
  EXPECT_NE(shardit::testing::error_of([&] { flux2->check(klein.request); })
                .find("Image too small: 200\u00d750. Both dimensions must be at least 64px"),
            std::string::npos);
  // A 1x1 first reference is named as the reference it is, with its own size, not by the output
  // size that would have been derived from it ("an image of 0x0").
  klein.request.image = {at::zeros({1, 1, 3}, at::kByte)};
  const std::string tiny = shardit::testing::error_of([&] { flux2->check(klein.request); });
  EXPECT_NE(tiny.find("reference image 0 (--image): Image too small: 1\u00d71"), std::string::npos) << tiny;
  EXPECT_EQ(tiny.find("0x0"), std::string::npos) << tiny;
  klein.request.image = {at::zeros({64, 600, 3}, at::kByte)};
  EXPECT_NE(shardit::testing::error_of([&] { flux2->check(klein.request); }).find("Aspect ratio too extreme"),
            std::string::npos);
  klein.request.image = {at::zeros({64, 64}, at::kByte)};
  EXPECT_NE(shardit::testing::error_of([&] { flux2->check(klein.request); }).find("uint8 [H, W, 3]"), std::string::npos);

  // Kontext repeats its images to fill the batch: 2 images cannot fill 3.
  PipelineCase kontext = shardit::testing::read_edit_case("edit_flux1_kontext", "refs_a");
  options.pipeline_class = "FluxKontextPipeline";
  const auto kontext_pipeline = DiffusionPipeline::open(kontext.dir, options);
  EXPECT_EQ(kontext_pipeline->class_name(), "FluxKontextPipeline");
  kontext.request.image.push_back(kontext.request.image.front());
  kontext.request.num_images_per_prompt = 3;
  kontext.request.latents.reset();
  EXPECT_NE(shardit::testing::error_of([&] { kontext_pipeline->check(kontext.request); }).find("cannot duplicate"),
            std::string::npos);
  options.pipeline_class = "NoSuchPipeline";
  EXPECT_NE(shardit::testing::error_of([&] { DiffusionPipeline::open(flux1, options); }).find("--pipeline"),
            std::string::npos);
}

// A real Kontext folder names FluxKontextPipeline in its model_index.json (its components are
// FLUX.1's): it opens as Kontext without --pipeline, and edits as the golden Kontext run does.
TEST(EditKontextFolderGolden, ModelIndexNamingKontextOpensAsKontext) {
  const std::string dir = shardit::testing::make_temp_dir("kontext-folder") + "/kontext";
  const std::string flux1 = shardit::testing::golden_path("pipeline_flux1");
  std::filesystem::create_directories(dir);
  for (const char* component : {"scheduler", "transformer", "vae"}) {
    std::filesystem::copy(flux1 + "/" + component, dir + "/" + component, std::filesystem::copy_options::recursive);
  }
  nlohmann::json index = shardit::io::read_json_file(flux1 + "/model_index.json");
  index["_class_name"] = "FluxKontextPipeline";
  for (const char* text : {"text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"}) index[text] = {nullptr, nullptr};
  std::ofstream(dir + "/model_index.json") << index.dump(2);

  PipelineCase golden = shardit::testing::read_edit_case("edit_flux1_kontext", "refs_a");
  PipelineLoadOptions options;
  options.load_vae = true;
  const auto pipeline = DiffusionPipeline::from_pretrained(dir, options);
  EXPECT_EQ(pipeline->class_name(), "FluxKontextPipeline");
  std::vector<at::Tensor> steps;
  golden.request.callback_on_step_end = [&steps](int64_t, const at::Tensor& latents) { steps.push_back(latents.clone()); };
  const auto result = pipeline->generate(golden.request);
  shardit::testing::expect_pipeline_matches(golden, steps, result.image, "Kontext folder");
}

// The FLUX.2 pipelines take the output size from the first reference image when none is given.
TEST(EditSizesGolden, Flux2TakesTheOutputSizeFromTheFirstImage) {
  PipelineCase klein = shardit::testing::read_edit_case("edit_flux2_klein", "refs_ab");
  PipelineLoadOptions options;
  options.load_text_encoders = false;
  const auto flux2 = DiffusionPipeline::open(klein.dir, options);
  klein.request.height.reset();
  klein.request.width.reset();
  klein.request.latents.reset();
  const at::Tensor& first = klein.request.image.front();
  const auto expected = shardit::pipelines::flux2_condition_size(first.size(0), first.size(1));
  flux2->check(klein.request);  // the size must be valid
  EXPECT_EQ(expected.first % 16, 0);
  EXPECT_EQ(expected.second % 16, 0);
  // A 3000 x 1500 image is brought to a 1024² area first, then floored to multiples of 16.
  const auto big = shardit::pipelines::flux2_condition_size(1500, 3000);
  EXPECT_LE(big.first * big.second, 1024 * 1024);
  EXPECT_EQ(big, (std::pair<int64_t, int64_t>{720, 1440}));
}

}  // namespace
}  // namespace test_parity_edits

// diffusers pipeline folders, component folders, the golden folders, and `shardit inspect`.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "shardit/io/model_folder.h"
#include "support/test_support.h"

namespace shardit::io {
namespace test_model_folder {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using shardit::testing::error_of;
namespace fs = std::filesystem;

const std::string kNoWeights =
    "no weights found (expected diffusion_pytorch_model*.safetensors or model*.safetensors, or their "
    ".safetensors.index.json)";

void write_text(const std::string& path, const std::string& text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path) << text;
}

/// A small pipeline: a sharded transformer, a single-file vae, a scheduler, a missing tokenizer.
std::string make_pipeline() {
  const std::string root = testing::make_temp_dir("pipeline");
  write_text(root + "/model_index.json", R"({
    "_class_name": "FluxPipeline", "_diffusers_version": "0.40.0",
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "tokenizer_2": [null, null],
    "text_encoder": ["transformers", "CLIPTextModel"]
  })");
  write_text(root + "/transformer/config.json", R"({"_class_name": "FluxTransformer2DModel", "num_layers": 2})");
  save_safetensors(root + "/transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
                   {{"x_embedder.weight", at::ones({8, 4})}});
  save_safetensors(root + "/transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
                   {{"proj_out.weight", at::ones({4, 8})}, {"proj_out.bias", at::ones({4})}});
  write_text(root + "/transformer/diffusion_pytorch_model.safetensors.index.json",
             R"({"weight_map": {"x_embedder.weight": "diffusion_pytorch_model-00001-of-00002.safetensors",
                 "proj_out.weight": "diffusion_pytorch_model-00002-of-00002.safetensors",
                 "proj_out.bias": "diffusion_pytorch_model-00002-of-00002.safetensors"}})");
  write_text(root + "/vae/config.json", R"({"_class_name": "AutoencoderKL"})");
  save_safetensors(root + "/vae/diffusion_pytorch_model.safetensors", {{"decoder.conv_in.weight", at::ones({2, 2})}});
  write_text(root + "/scheduler/scheduler_config.json", R"({"_class_name": "FlowMatchEulerDiscreteScheduler"})");
  return root;
}

TEST(ModelFolder, GoldenComponentFoldersOpenAndListTensors) {
  int opened = 0;
  for (const auto& entry : fs::recursive_directory_iterator(testing::golden_path(""))) {
    if (!entry.is_directory() || !fs::exists(entry.path() / "config.json")) continue;
    SCOPED_TRACE(entry.path().string());
    const ModelFolder folder = ModelFolder::open(entry.path().string());
    EXPECT_FALSE(folder.is_pipeline());
    EXPECT_TRUE(folder.components().empty());
    const ComponentFolder component = folder.component("");
    EXPECT_EQ(component.name, entry.path().filename().string());
    EXPECT_TRUE(component.config.is_object());
    const Checkpoint weights = component.weights();
    EXPECT_GT(weights.names().size(), 0u);
    for (const auto& name : weights.names()) {
      const TensorInfo& info = weights.info(name);
      EXPECT_EQ(static_cast<int64_t>(info.nbytes()), info.numel() * st_dtype_size(info.dtype)) << name;
    }
    ++opened;
  }
  EXPECT_GT(opened, 0) << "no folder with config.json under " << testing::golden_path("");
}

TEST(ModelFolder, GoldenFluxComponent) {
  const ModelFolder folder = ModelFolder::open(testing::golden_path("flux_b1_square"));
  const ComponentFolder component = folder.component("flux_b1_square");
  EXPECT_EQ(component.class_name(), "FluxTransformer2DModel");
  const Checkpoint weights = component.weights();
  // x_embedder = Linear(in_channels, num_attention_heads * attention_head_dim), per the config.
  const int64_t inner = component.config.at("num_attention_heads").get<int64_t>() *
                        component.config.at("attention_head_dim").get<int64_t>();
  EXPECT_EQ(weights.info("x_embedder.weight").shape,
            (std::vector<int64_t>{inner, component.config.at("in_channels").get<int64_t>()}));
  EXPECT_FALSE(weights.contains("sample"));  // outputs.safetensors is not a weights file
  EXPECT_EQ(error_of([&] { folder.component("vae"); }),
            testing::golden_path("flux_b1_square") +
                ": is a single component folder ('flux_b1_square'), so it has no component 'vae'");
}

TEST(ModelFolder, PipelineComponents) {
  const std::string root = make_pipeline();
  const ModelFolder folder = ModelFolder::open(root);
  EXPECT_TRUE(folder.is_pipeline());
  EXPECT_EQ(folder.model_index().at("_class_name"), "FluxPipeline");
  EXPECT_EQ(folder.components(),
            (std::vector<std::string>{"scheduler", "text_encoder", "transformer", "vae"}));

  const ComponentFolder transformer = folder.component("transformer");
  EXPECT_EQ(transformer.name, "transformer");
  EXPECT_EQ(transformer.class_name(), "FluxTransformer2DModel");
  const Checkpoint weights = transformer.weights();
  EXPECT_EQ(weights.names(), (std::vector<std::string>{"proj_out.bias", "proj_out.weight", "x_embedder.weight"}));
  EXPECT_EQ(weights.files().size(), 2u);
  EXPECT_TRUE(at::equal(weights.read("proj_out.weight"), at::ones({4, 8})));

  EXPECT_EQ(folder.component("vae").weights().names(), std::vector<std::string>{"decoder.conv_in.weight"});
  EXPECT_EQ(folder.component("scheduler").class_name(), "FlowMatchEulerDiscreteScheduler");
  EXPECT_EQ(error_of([&] { folder.component("scheduler").weights(); }),
            root + "/scheduler: " + kNoWeights);
}

TEST(ModelFolderErrors, MissingPieces) {
  const std::string root = make_pipeline();
  const ModelFolder folder = ModelFolder::open(root);
  EXPECT_EQ(error_of([&] { folder.component("tokenizer_2"); }),
            root + ": model_index.json has no component 'tokenizer_2' (it has: scheduler, text_encoder, "
                   "transformer, vae)");
  EXPECT_EQ(error_of([&] { folder.component("text_encoder"); }),
            root + "/text_encoder: component 'text_encoder' has no folder here");
  fs::create_directories(root + "/text_encoder");
  EXPECT_EQ(error_of([&] { folder.component("text_encoder"); }),
            root + "/text_encoder: component 'text_encoder' has no config.json (nor scheduler_config.json / "
                   "tokenizer_config.json)");

  const std::string empty = testing::make_temp_dir("empty-model");
  EXPECT_EQ(error_of([&] { ModelFolder::open(empty); }),
            empty + ": neither model_index.json (a diffusers pipeline folder) nor config.json (a component "
                    "folder) is here");
  EXPECT_EQ(error_of([&] { ModelFolder::open(empty + "/missing"); }), empty + "/missing: no such file or directory");
  write_text(empty + "/file.txt", "x");
  EXPECT_EQ(error_of([&] { ModelFolder::open(empty + "/file.txt"); }),
            empty + "/file.txt: not a folder (expected a diffusers pipeline folder with model_index.json, or a "
                    "component folder with config.json)");

  const std::string no_components = testing::make_temp_dir("no-components");
  write_text(no_components + "/model_index.json", R"({"_class_name": "FluxPipeline"})");
  EXPECT_EQ(error_of([&] { ModelFolder::open(no_components); }),
            no_components + "/model_index.json: lists no components (entries like \"transformer\": [\"diffusers\", "
                            "\"FluxTransformer2DModel\"])");

  const std::string bad_json = testing::make_temp_dir("bad-json");
  write_text(bad_json + "/config.json", "{\"a\": ");
  // The cause in parentheses is nlohmann-json's own wording.
  EXPECT_THAT(error_of([&] { ModelFolder::open(bad_json).component(""); }),
              StartsWith(bad_json + "/config.json: invalid JSON ([json.exception.parse_error.101] parse error at "
                                    "line 1, column 7: "));
  EXPECT_EQ(error_of([&] { read_json_file(bad_json + "/nothing.json"); }), bad_json + "/nothing.json: no such file (it does not exist)");
}

TEST(ModelFolderErrors, ComponentWithoutWeights) {
  const std::string dir = testing::make_temp_dir("component-noweights");
  write_text(dir + "/config.json", R"({"_class_name": "FluxTransformer2DModel"})");
  save_safetensors(dir + "/inputs.safetensors", {{"a", at::zeros({1})}});
  EXPECT_EQ(error_of([&] { ModelFolder::open(dir).component("").weights(); }),
            dir + ": " + kNoWeights + "; other safetensors files here: inputs.safetensors");
}

// `shardit inspect` over a component folder, a pipeline folder and one file.
TEST(InspectCommand, PrintsConfigAndTensorTableOfAGoldenCase) {
  std::string output;
  const std::string golden = testing::golden_path("flux_b1_square");
  ASSERT_EQ(testing::run_command(testing::cli_path() + " inspect " + golden, &output), 0) << output;
  EXPECT_THAT(output, HasSubstr("\"_class_name\": \"FluxTransformer2DModel\""));
  const Checkpoint checkpoint = Checkpoint::open(golden);
  const TensorInfo& x_embedder = checkpoint.info("x_embedder.weight");
  EXPECT_THAT(output, HasSubstr("x_embedder.weight"));
  EXPECT_THAT(output, HasSubstr("[" + std::to_string(x_embedder.shape[0]) + ", " + std::to_string(x_embedder.shape[1]) + "]"));
  EXPECT_THAT(output, HasSubstr(std::to_string(x_embedder.nbytes())));
  const size_t count = checkpoint.names().size();
  EXPECT_THAT(output, HasSubstr(std::to_string(count) + " tensors"));

  ASSERT_EQ(testing::run_command(testing::cli_path() + " inspect --plan --tp 2 " + golden, &output), 0) << output;
  EXPECT_THAT(output, HasSubstr("tensor-parallel plan of FluxTransformer2DModel at TP=2"));
  EXPECT_THAT(output, HasSubstr("transformer_blocks.0.attn.to_q.weight"));
  // A degree that does not divide the head count: the resolver's message, and a non-zero exit.
  const int64_t heads = ModelFolder::open(golden).component("").config.at("num_attention_heads").get<int64_t>();
  int64_t degree = 2;
  while (heads % degree == 0) ++degree;
  EXPECT_NE(testing::run_command(testing::cli_path() + " inspect --plan --tp " + std::to_string(degree) + " " + golden,
                                 &output),
            0);
  EXPECT_THAT(output, HasSubstr("num_attention_heads = " + std::to_string(heads) +
                                ", which does not divide by tp_degree " + std::to_string(degree) +
                                "; degrees that would work (up to 64): " + testing::divisors_of(heads)));

  const std::string root = make_pipeline();
  write_text(root + "/text_encoder/config.json", R"({"architectures": ["CLIPTextModel"]})");
  save_safetensors(root + "/text_encoder/model.safetensors", {{"text_model.final_layer_norm.weight", at::ones({4})}});
  ASSERT_EQ(testing::run_command(testing::cli_path() + " inspect " + root, &output), 0) << output;
  EXPECT_THAT(output, HasSubstr("FluxPipeline"));
  EXPECT_THAT(output, HasSubstr("proj_out.bias"));
  EXPECT_THAT(output, HasSubstr("decoder.conv_in.weight"));
  EXPECT_THAT(output, HasSubstr("text_model.final_layer_norm.weight"));

  const std::string file = root + "/vae/diffusion_pytorch_model.safetensors";
  ASSERT_EQ(testing::run_command(testing::cli_path() + " inspect " + file, &output), 0) << output;
  EXPECT_THAT(output, HasSubstr("decoder.conv_in.weight"));
  EXPECT_THAT(output, HasSubstr("1 tensors"));
}

TEST(InspectCommand, FailsCleanlyOnBadPath) {
  std::string output;
  const std::string missing = testing::make_temp_dir("inspect-missing") + "/nothing";
  EXPECT_NE(testing::run_command(testing::cli_path() + " inspect " + missing, &output), 0);
  EXPECT_THAT(output, AllOf(HasSubstr(missing), HasSubstr("no such file or directory")));
  EXPECT_THAT(output, ::testing::Not(HasSubstr("Exception raised from")));  // no backtrace
}

}  // namespace
}  // namespace test_model_folder
}  // namespace shardit::io

// Single-file transformers (`--transformer FILE`): the golden FLUX.1, FLUX.2 and Qwen-Image
// transformers written by tests/golden/tools/make_single_file_cases.py in Black Forest Labs' and
// ComfyUI's layouts (fused qkv and linear1, swapped final modulation, prefixed keys; FLUX.1 also
// as ComfyUI's "fp8 scaled") must give the diffusers folder's output bit for bit at TP 1 and 2:
// the mapping reassembles exactly the folder's fp32 weights, so every product is the same. A TP=2
// rank reads only its heads' rows of the fused tensors; an FP8 file holds half of bf16's bytes.
// The files are made in the build folder by the CTest entry make_single_file_cases.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>

#include "shardit/core/fp8.h"
#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/png.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/parallel/tensor_parallel.h"
#include "support/multiprocess.h"
#include "support/pipeline_case.h"
#include "support/single_file_case.h"
#include "support/test_support.h"

namespace test_single_file {
namespace {

using shardit::io::Checkpoint;
using shardit::parallel::TensorParallelModule;
using shardit::testing::env_or;
using shardit::testing::error_of;
using shardit::testing::golden_path;
using shardit::testing::is_worker;
using shardit::testing::load_transformer;
using shardit::testing::run_case;
using shardit::testing::run_ranks;
using shardit::testing::tensors_close;
using ::testing::HasSubstr;

using Case = shardit::testing::SingleFileCase;
const auto& kCases = shardit::testing::kSingleFileCases;

/// A file written by make_single_file_cases.py.
std::string single_file(const std::string& name) { return shardit::testing::single_file_path(name + ".safetensors"); }

std::shared_ptr<TensorParallelModule> load_from_file(const std::string& model_dir, const std::string& path,
                                                     bool sharded, at::ScalarType dtype = at::kFloat,
                                                     std::optional<Checkpoint>* checkpoint = nullptr) {
  return shardit::testing::load_transformer_file(model_dir, path, sharded, dtype, checkpoint);
}

/// Bytes this rank reads of the sharded tensors that the file stores under other names (fused
/// qkv / linear1 parts, renames) under the model's TP plan, against their whole size: a fresh
/// mapping, so the counter holds these reads alone.
std::pair<uint64_t, uint64_t> fused_bytes_read(const std::string& model_dir, const std::string& path, int degree,
                                               int rank) {
  const auto folder = shardit::io::open_component(model_dir, "transformer");
  auto model = shardit::models::create_transformer(folder);
  const Checkpoint weights = shardit::models::open_transformer_file(path, folder.class_name(), *model);
  const shardit::parallel::ResolvedPlan plan = model->resolve(degree);
  const uint64_t before = weights.stats().bytes_read.load();
  uint64_t whole = 0;
  for (const auto& spec : plan.parameters) {
    if (!spec.is_sharded() || weights.find_source(spec.parameter) != nullptr) continue;
    whole += weights.info(spec.parameter).nbytes();
    weights.read_slices(spec.parameter, spec.dim, spec.ranges_per_rank[static_cast<size_t>(rank)]);
  }
  return {weights.stats().bytes_read.load() - before, whole};
}

/// Worker: the folder's and the file's transformer at TP = the world size give the same bits;
/// the file's rank read exactly its shard, and half of the fused tensors.
void tp_worker() {
  auto& world = shardit::dist::World::init();
  const std::string model_dir = env_or("SHARDIT_SF_MODEL");
  const std::string path = env_or("SHARDIT_SF_FILE");
  auto folder_model = load_transformer(model_dir, "shard-on-load");
  std::optional<Checkpoint> checkpoint;
  auto file_model = load_from_file(model_dir, path, /*sharded=*/true, at::kFloat, &checkpoint);
  const at::Tensor expected = run_case(*folder_model, model_dir);
  const at::Tensor sample = run_case(*file_model, model_dir);
  EXPECT_TRUE(at::equal(sample, expected)) << path << " at TP=" << world.size() << ": max difference "
                                           << (sample - expected).abs().max().item<double>();
  // fp32 file, fp32 weights: the bytes read are the bytes held, this rank's shard only.
  EXPECT_EQ(checkpoint->stats().bytes_read.load(), static_cast<uint64_t>(file_model->parameter_bytes()));
  EXPECT_LT(file_model->parameter_bytes(), folder_model->resolved_plan()->replicated_bytes() +
                                               folder_model->resolved_plan()->sharded_bytes());
  const auto [read, whole] = fused_bytes_read(model_dir, path, world.size(), world.rank());
  if (whole > 0) {
    EXPECT_EQ(read * static_cast<uint64_t>(world.size()), whole) << "rank " << world.rank() << " read " << read
                                                                  << " of the mapped sharded tensors' " << whole << " bytes";
    std::cout << "rank " << world.rank() << " read " << read << " of " << whole << " bytes of mapped sharded tensors\n";
  }
}

void expect_tp2_bit_exact(const Case& c) {
  EXPECT_EQ(run_ranks(2, {{"SHARDIT_SF_MODEL", golden_path(c.golden_case)}, {"SHARDIT_SF_FILE", single_file(c.file)}}),
            0)
      << c.file;
}

TEST(SingleFile, GoldenFilesGiveTheFolderOutputBitForBitAtTp1) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.file);
    const std::string model_dir = golden_path(c.golden_case);
    const at::Tensor expected = run_case(*load_transformer(model_dir), model_dir);
    const at::Tensor sample = run_case(*load_from_file(model_dir, single_file(c.file), false), model_dir);
    EXPECT_TRUE(at::equal(sample, expected)) << "max difference " << (sample - expected).abs().max().item<double>();
    // And diffusers' output within the golden set's fp32 tolerance.
    const at::Tensor golden = shardit::io::SafetensorsFile::open(model_dir + "/outputs.safetensors")->read("sample");
    EXPECT_TRUE(tensors_close(std::string(c.file) + " sample", sample, golden, 1e-4, 1e-4));
  }
}

TEST(SingleFile, GoldenFlux1BflAtTp2IsBitExact) {
  if (is_worker()) return tp_worker();
  expect_tp2_bit_exact(kCases[0]);
}

TEST(SingleFile, GoldenFlux2BflAtTp2IsBitExact) {
  if (is_worker()) return tp_worker();
  expect_tp2_bit_exact(kCases[1]);
}

TEST(SingleFile, GoldenQwenImageComfyUiAtTp2IsBitExact) {
  if (is_worker()) return tp_worker();
  expect_tp2_bit_exact(kCases[2]);
}

/// The FP8 file's weights as stored (codes decoded exactly, times their scales), dense fp32 under
/// the model's names, written to a file of this rank.
std::string dequantized_copy(const Checkpoint& fp8) {
  std::vector<std::pair<std::string, at::Tensor>> dense;
  for (const std::string& name : fp8.names()) {
    if (name.size() > 13 && name.compare(name.size() - 13, 13, ".scale_weight") == 0) continue;
    if (fp8.info(name).dtype != shardit::io::StDtype::F8_E4M3) {
      dense.emplace_back(name, fp8.read(name, at::kFloat));
      continue;
    }
    at::Tensor codes = fp8.read(name);
    if (codes.scalar_type() != at::kByte) codes = codes.view(at::kByte);
    const std::string scale = name.substr(0, name.size() - 7) + ".scale_weight";
    const at::Tensor values = shardit::fp8_decode(codes, shardit::Fp8Format::E4M3, at::kFloat);
    dense.emplace_back(name, fp8.contains(scale) ? values * fp8.read(scale, at::kFloat) : values);
  }
  const std::string path = shardit::testing::make_temp_dir("fp8-dense") + "/dense.safetensors";
  shardit::io::save_safetensors(path, dense);
  return path;
}

/// Worker: per-rank bytes of the FP8 file against the bf16 load of the same weights, and its
/// output against the dense model of its own dequantized weights.
void fp8_worker() {
  auto& world = shardit::dist::World::init();
  const std::string model_dir = env_or("SHARDIT_SF_MODEL");
  auto fp8 = load_from_file(model_dir, env_or("SHARDIT_SF_FP8"), true, at::kBFloat16);
  auto bf16 = load_from_file(model_dir, env_or("SHARDIT_SF_FILE"), true, at::kBFloat16);
  const double ratio = static_cast<double>(fp8->parameter_bytes()) / static_cast<double>(bf16->parameter_bytes());
  std::cout << "rank " << world.rank() << ": FP8 file " << fp8->parameter_bytes() << " bytes, bf16 "
            << bf16->parameter_bytes() << " (ratio " << ratio << ")\n";
  // Every Linear weight in one byte instead of two; biases and norms (a few percent of this tiny
  // model) stay in bf16.
  EXPECT_GT(ratio, 0.45);
  EXPECT_LT(ratio, 0.6);
  // In fp32 compute, the 8-bit Linears dequantize to exactly the stored values times their scale:
  // the output is the dense model's with those weights, up to the order of fp32 sums (1e-5 of the
  // output's scale, as the TP tests). A wrong scale, row or piece moves it by O(scale).
  std::optional<Checkpoint> checkpoint;
  auto fp8_f32 = load_from_file(model_dir, env_or("SHARDIT_SF_FP8"), true, at::kFloat, &checkpoint);
  auto dense = shardit::models::create_transformer(shardit::io::open_component(model_dir, "transformer"));
  shardit::parallel::LoadOptions options;
  options.tensor_parallel = shardit::testing::world_tensor_parallel();
  dense->load(Checkpoint::open(dequantized_copy(*checkpoint)), options);
  const at::Tensor expected = run_case(*dense, model_dir);
  const double scale = expected.abs().max().item<double>();
  EXPECT_TRUE(tensors_close("FP8 file's sample (fp32 compute)", run_case(*fp8_f32, model_dir), expected,
                            1e-5 * scale, 0.0));
}

TEST(SingleFile, GoldenFp8FilesHoldHalfOfBf16AtTp2) {
  if (is_worker()) return fp8_worker();
  // ComfyUI's "fp8 scaled" (per-tensor scale_weight) and plain fp8_e4m3fn (no scales) forms.
  for (const char* fp8 : {"flux1_bfl_fp8_scaled", "flux1_bfl_fp8_e4m3fn"}) {
    EXPECT_EQ(run_ranks(2, {{"SHARDIT_SF_MODEL", golden_path("flux_b1_square")},
                            {"SHARDIT_SF_FILE", single_file("flux1_bfl")},
                            {"SHARDIT_SF_FP8", single_file(fp8)}}),
              0)
        << fp8;
  }
}

// ---------------------------------------------------------------------------------------------
// Bad files: each a named error before any weight is read.

std::string open_error(const std::string& model_case, const std::string& path) {
  const auto folder = shardit::io::open_component(golden_path(model_case), "transformer");
  auto model = shardit::models::create_transformer(folder);
  return error_of([&] { shardit::models::open_transformer_file(path, folder.class_name(), *model); });
}

TEST(SingleFile, GoldenBflFileWithoutAQkvIsRefusedListingIt) {
  const Checkpoint bfl = Checkpoint::open(single_file("flux1_bfl"));
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const std::string& name : bfl.names()) {
    if (name != "double_blocks.0.img_attn.qkv.weight") tensors.emplace_back(name, bfl.read(name));
  }
  const std::string path = shardit::testing::make_temp_dir("single-file") + "/no_qkv.safetensors";
  shardit::io::save_safetensors(path, tensors);
  const std::string message = open_error("flux_b1_square", path);
  EXPECT_THAT(message, HasSubstr("(BFL layout): 1 tensor(s) that FluxTransformer2DModel needs are missing: "
                                 "'double_blocks.0.img_attn.qkv.weight' (for transformer_blocks.0.attn.to_k.weight "
                                 "transformer_blocks.0.attn.to_q.weight transformer_blocks.0.attn.to_v.weight)"));
}

TEST(SingleFile, GoldenFileOfAnotherFamilyIsNamed) {
  EXPECT_THAT(open_error("flux_b1_square", single_file("flux2_bfl")),
              HasSubstr("holds a Flux2Transformer2DModel (BFL layout: has 'single_stream_modulation.lin.weight'), but "
                        "the model folder's transformer is FluxTransformer2DModel"));
  EXPECT_THAT(open_error("flux_b1_square", single_file("qwenimage_comfyui")),
              HasSubstr("holds a QwenImageTransformer2DModel (ComfyUI layout"));
  EXPECT_THAT(open_error("qwenimage_b1_square", single_file("flux1_bfl_fp8_scaled")),
              HasSubstr("holds a FluxTransformer2DModel (BFL layout"));
  // The diffusers folder's own file of another family.
  EXPECT_THAT(open_error("flux2_b1_square", golden_path("flux_b1_square/diffusion_pytorch_model.safetensors")),
              HasSubstr("holds a FluxTransformer2DModel (diffusers layout"));
}

TEST(SingleFile, GoldenUnknownMissingAndTruncatedFilesAreNamed) {
  const std::string dir = shardit::testing::make_temp_dir("single-file-bad");
  shardit::io::save_safetensors(dir + "/other.safetensors", {{"encoder.layers.0.weight", at::ones({2, 2})}});
  EXPECT_THAT(open_error("flux_b1_square", dir + "/other.safetensors"),
              HasSubstr("is not a FluxTransformer2DModel file in a known layout: expected BFL: "
                        "'double_blocks.0.img_mod.lin.weight'; or diffusers: 'transformer_blocks.0.norm1.linear.weight'"));
  EXPECT_THAT(open_error("flux_b1_square", dir + "/absent.safetensors"), HasSubstr("no such file or directory"));
  // The first half of a real file: its header promises bytes that are not there.
  const std::string whole = single_file("flux1_bfl");
  std::filesystem::copy_file(whole, dir + "/truncated.safetensors");
  std::filesystem::resize_file(dir + "/truncated.safetensors", std::filesystem::file_size(whole) / 2);
  EXPECT_THAT(open_error("flux_b1_square", dir + "/truncated.safetensors"), HasSubstr("truncated.safetensors"));
}

TEST(SingleFile, GoldenCliRefusesABadFileAndWritesNothing) {
  const std::string dir = shardit::testing::make_temp_dir("single-file-cli");
  const std::string model_dir = golden_path("flux_b1_square");
  for (const std::string& file : {dir + "/absent.safetensors", single_file("flux2_bfl")}) {
    std::string output;
    const int status = shardit::testing::run_command(
        shardit::testing::cli_path() + " run-transformer --model " + model_dir + " --inputs " + model_dir +
            " --transformer " + file + " --out " + dir + "/sample.safetensors 2>&1",
        &output);
    EXPECT_NE(status, 0) << output;
    EXPECT_THAT(output, HasSubstr(file));
    EXPECT_FALSE(std::filesystem::exists(dir + "/sample.safetensors"));
  }
  // The same file accepted by run-transformer gives the folder's sample.
  std::string output;
  ASSERT_EQ(shardit::testing::run_command(shardit::testing::cli_path() + " run-transformer --model " + model_dir +
                                              " --inputs " + model_dir + " --transformer " + single_file("flux1_bfl") +
                                              " --out " + dir + "/sample.safetensors 2>&1",
                                          &output),
            0)
      << output;
  const at::Tensor sample = shardit::io::SafetensorsFile::open(dir + "/sample.safetensors")->read("sample");
  EXPECT_TRUE(at::equal(sample, run_case(*load_transformer(model_dir), model_dir)));
}

// `generate --model FOLDER --transformer FILE` at TP 2: the FLUX.1 pipeline with its transformer
// from Black Forest Labs' file writes the folder's image, the same PNG bytes and tensors.
TEST(SingleFile, GoldenGenerateWithTransformerFileAtTp2GivesTheFolderImage) {
  if (is_worker()) return;
  const auto golden = shardit::testing::read_pipeline_case(golden_path("pipeline_flux1"));
  const auto folder = shardit::testing::run_generate_cli(golden, "--nproc-per-node 2");
  const auto file = shardit::testing::run_generate_cli(golden, "--nproc-per-node 2",
                                                       "--transformer " + single_file("pipeline_flux1_bfl"));
  EXPECT_NE(file.output.find("tp 2 of 2 ranks"), std::string::npos) << file.output;
  EXPECT_TRUE(at::equal(file.image, folder.image));
  ASSERT_EQ(file.pngs.size(), folder.pngs.size());
  for (size_t i = 0; i < file.pngs.size(); ++i) {
    EXPECT_TRUE(at::equal(shardit::io::read_png(file.pngs[i]), shardit::io::read_png(folder.pngs[i]))) << file.pngs[i];
  }
  shardit::testing::expect_pngs_match(golden, file.pngs, "pipeline_flux1 with --transformer (CLI PNG, TP=2)");
}

}  // namespace
}  // namespace test_single_file

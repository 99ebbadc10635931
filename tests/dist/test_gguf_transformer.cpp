// GGUF transformers (`--transformer FILE.gguf`): the golden FLUX.1, FLUX.2 and Qwen-Image
// transformers written by tests/golden/tools/make_gguf_transformer_cases.py with gguf-py (F16, BF16,
// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; city96's names: Black Forest Labs' keys, ComfyUI's for Qwen-Image)
// load through the single-file layouts, their Linear weights kept in GGUF blocks per rank. Checked:
// the output equals the dense model of the same file's weights as gguf-py dequantizes them, and the
// fp32 golden within a bound per type, at TP 1 and 2; the same for Q4_K, Q5_K and Q6_K files of
// the golden transformers widened to whole 256-value super-blocks (random weights, their fp32
// file as the reference); `generate --transformer FILE.gguf` at TP 2; bad files named before any
// compute. The files are made in the build folder by the CTest entry
// make_gguf_transformer_cases.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/memory_plan.h"
#include "shardit/models/registry.h"
#include "shardit/nn/quantized_weight.h"
#include "shardit/parallel/tensor_parallel.h"
#include "support/multiprocess.h"
#include "support/pipeline_case.h"
#include "support/single_file_case.h"
#include "support/test_support.h"

namespace test_gguf_transformer {
namespace {

using shardit::io::Checkpoint;
using shardit::parallel::TensorParallelModule;
using shardit::testing::error_of;
using shardit::testing::golden_path;
using shardit::testing::is_worker;
using shardit::testing::run_case;
using shardit::testing::run_ranks;
using ::testing::HasSubstr;

using Case = shardit::testing::SingleFileCase;
const auto& kCases = shardit::testing::kSingleFileCases;

/// The bound of each type on max |sample - golden| / max |golden| (fp32 compute): 1.5x the largest
/// measured over the three golden models at TP 1 and 2 (in the comment). The error is the rounding
/// of the weights alone, every other operation being the fp32 golden's; the tiny random models have
/// none of a trained model's structure, so 4- and 5-bit blocks move their output by 5-25 %. The
/// tight check is the one against the dequantized weights (1e-6), which a wrong row, block or scale
/// fails by orders of magnitude.
struct TypeBound {
  const char* type;
  double bound;
};
const TypeBound kTypes[] = {
    {"f16", 1.5e-3},  // measured 7.1e-4 (FLUX.1)
    {"bf16", 1e-2},   // measured 5.6e-3 (FLUX.1)
    {"q8_0", 3e-2},   // measured 1.7e-2 (FLUX.1)
    {"q5_1", 0.18},   // measured 0.118 (FLUX.1)
    {"q5_0", 0.25},   // measured 0.162 (FLUX.1)
    {"q4_1", 0.31},   // measured 0.203 (FLUX.1)
    {"q4_0", 0.37},   // measured 0.242 (FLUX.1)
};

/// A file written by make_gguf_transformer_cases.py.
std::string gguf_file(const std::string& name, const std::string& suffix = ".gguf") {
  return shardit::testing::single_file_path("gguf/" + name + suffix);
}

std::shared_ptr<TensorParallelModule> load_from_file(const std::string& model_dir, const std::string& path, bool sharded,
                                                     std::optional<Checkpoint>* checkpoint = nullptr) {
  return shardit::testing::load_transformer_file(model_dir, path, sharded, at::kFloat, checkpoint);
}

double relative_error(const at::Tensor& sample, const at::Tensor& expected) {
  return (sample - expected).abs().max().item<double>() / expected.abs().max().item<double>();
}

/// Every case and type at TP = the world size: the GGUF model against the dense model of gguf-py's
/// dequantized weights (1e-6 of the output's scale: the same fp32 weights, products summed in
/// another order where the dense layer multiplies column blocks in place) and against the fp32
/// golden within the type's bound. A quantized Linear must hold GGUF blocks, not dense values.
void check_all(bool sharded, int rank) {
  for (const Case& c : kCases) {
    const std::string model_dir = golden_path(c.golden_case);
    const at::Tensor golden = shardit::io::SafetensorsFile::open(model_dir + "/outputs.safetensors")->read("sample");
    for (const TypeBound& type : kTypes) {
      const std::string name = std::string(c.file) + "." + type.type;
      SCOPED_TRACE(name);
      std::optional<Checkpoint> checkpoint;
      auto model = load_from_file(model_dir, gguf_file(name), sharded, &checkpoint);
      auto dense = load_from_file(model_dir, gguf_file(name, ".dequantized.safetensors"), sharded);
      const at::Tensor sample = run_case(*model, model_dir);
      const at::Tensor expected = run_case(*dense, model_dir);
      const double to_dense = relative_error(sample, expected);
      const double to_golden = relative_error(sample, golden);
      EXPECT_LE(to_dense, 1e-6);
      EXPECT_LE(to_golden, type.bound);
      if (rank == 0) std::cout << name << ": " << to_dense << " from its dequantized weights, " << to_golden << " from the fp32 golden\n";
      if (std::string(type.type).rfind("q", 0) == 0) {
        int64_t quantized = 0;
        for (const auto& spec : model->resolved_plan()->parameters) quantized += spec.block_elements > 1 ? 1 : 0;
        EXPECT_GT(quantized, 0) << "no weight held in GGUF blocks";
      }
    }
  }
}

TEST(GgufTransformer, GoldenFilesMatchTheirDequantizedWeightsAndTheGoldenAtTp1) { check_all(false, 0); }

TEST(GgufTransformer, GoldenFilesMatchTheirDequantizedWeightsAndTheGoldenAtTp2) {
  if (is_worker()) {
    auto& world = shardit::dist::World::init();
    check_all(true, world.rank());
    return;
  }
  EXPECT_EQ(run_ranks(2), 0);
}

// The K-quants: rows of whole 256-value super-blocks, which the golden models' 64-wide layers do
// not have, so make_gguf_transformer_cases.py widens each golden transformer (32 heads of 16: 512
// hidden; one double and one single block; random weights drawn like the golden ones) and writes
// its fp32 single file (the reference) and Q4_K, Q5_K and Q6_K files made by ggml_k_quants.py.
struct WideCase {
  const char* file;
  const char* inputs_case;  ///< the golden case whose inputs it runs (they do not depend on the width)
};
const WideCase kWideCases[] = {{"flux1_bfl_wide", "flux_b1_square"},
                               {"flux2_bfl_wide", "flux2_b1_square"},
                               {"qwenimage_comfyui_wide", "qwenimage_b1_square"}};
/// max |sample - fp32| / max |fp32|: 1.5x the largest measured over the three models at TP 1 and 2
/// (the scales are ggml_k_quants.py's plain ones, not ggml's searched ones).
const TypeBound kKTypes[] = {
    {"q6_k", 0.06},  // measured 0.039 (FLUX.1)
    {"q5_k", 0.17},  // measured 0.110 (FLUX.1)
    {"q4_k", 0.25},  // measured 0.165 (FLUX.1)
};

/// The plan of the transformer of `config_dir` at `tp` with the weights counted as `checkpoint`
/// stores them (fp32 compute).
shardit::parallel::ResolvedPlan stored_plan(const std::string& config_dir, const Checkpoint& checkpoint, int tp) {
  auto model = shardit::models::create_transformer(shardit::io::open_component(config_dir, "transformer"));
  return model->resolve_as_stored(checkpoint, tp, at::kFloat);
}

void check_wide(bool sharded, int rank) {
  for (const WideCase& c : kWideCases) {
    const std::string config_dir = gguf_file("wide/" + std::string(c.file), "");
    const std::string inputs_dir = golden_path(c.inputs_case);
    auto fp32 = load_from_file(config_dir, gguf_file("wide/" + std::string(c.file), ".safetensors"), sharded);
    const at::Tensor reference = run_case(*fp32, inputs_dir);
    for (const TypeBound& type : kKTypes) {
      const std::string name = "wide/" + std::string(c.file) + "." + type.type;
      SCOPED_TRACE(name);
      std::optional<Checkpoint> checkpoint;
      auto model = load_from_file(config_dir, gguf_file(name), sharded, &checkpoint);
      auto dense = load_from_file(config_dir, gguf_file(name, ".dequantized.safetensors"), sharded);
      const at::Tensor sample = run_case(*model, inputs_dir);
      const double to_dense = relative_error(sample, run_case(*dense, inputs_dir));
      const double to_fp32 = relative_error(sample, reference);
      EXPECT_LE(to_dense, 1e-6);
      EXPECT_LE(to_fp32, type.bound);
      if (rank == 0) std::cout << name << ": " << to_dense << " from its dequantized weights, " << to_fp32 << " from fp32\n";
      // Most Linears hold the file's K-quant blocks (256 values each), as stored.
      int64_t super_blocks = 0;
      for (const auto& spec : model->resolved_plan()->parameters) super_blocks += spec.block_elements == 256 ? 1 : 0;
      EXPECT_GE(super_blocks, 10) << "weights held in 256-value blocks";
      // What `inspect --plan --transformer` counts (the plan as the file stores the weights) is
      // what the load holds.
      const auto planned = stored_plan(config_dir, *checkpoint, sharded ? 2 : 1);
      int64_t planned_bytes = 0;
      for (const auto& spec : planned.parameters) planned_bytes += spec.is_buffer ? 0 : spec.bytes_on_rank(rank);
      EXPECT_EQ(planned_bytes, model->parameter_bytes());
    }
  }
}

TEST(GgufTransformer, GoldenWideKQuantFilesMatchTheirDequantizedWeightsAtTp1) { check_wide(false, 0); }

TEST(GgufTransformer, GoldenWideKQuantFilesMatchTheirDequantizedWeightsAtTp2) {
  if (is_worker()) {
    auto& world = shardit::dist::World::init();
    check_wide(true, world.rank());
    return;
  }
  EXPECT_EQ(run_ranks(2), 0);
}

/// `inspect --plan --json --tp 2 --dtype DTYPE CONFIG_DIR --transformer FILE`: the transformer's
/// bytes per rank.
int64_t inspected_bytes_per_rank(const std::string& config_dir, const std::string& file, const std::string& dtype,
                                 const std::string& options = "") {
  std::string output;
  const int status = shardit::testing::run_command(shardit::testing::cli_path() + " inspect --plan --json --tp 2 --dtype " +
                                                       dtype + " " + options + " " + config_dir + " --transformer " +
                                                       file + " 2>&1",
                                                   &output);
  EXPECT_EQ(status, 0) << output;
  const nlohmann::json json = nlohmann::json::parse(output, nullptr, false);
  EXPECT_FALSE(json.is_discarded()) << output;
  EXPECT_EQ(json.value("transformer_file", ""), file);
  return json.is_discarded() ? int64_t{0} : json["components"][0]["per_rank_bytes"].get<int64_t>();
}

// `inspect --plan --transformer FILE` counts the transformer as the file stores it: Q4_K Linears at
// 144 bytes per 256 weights, FP8 ones at one byte, the rest at the compute dtype; the same
// weights' fp32 or bf16 form at 4 or 2 bytes a weight, or quantized on load with --weights-dtype.
TEST(GgufTransformer, GoldenInspectPlanCountsGgufAndFp8FilesAsStored) {
  const std::string config_dir = gguf_file("wide/flux1_bfl_wide", "");
  const auto per_rank_bytes = [&](const std::string& file) {
    return inspected_bytes_per_rank(config_dir, file, "f32");
  };
  const std::string q4_k = gguf_file("wide/flux1_bfl_wide.q4_k");
  const int64_t stored = per_rank_bytes(q4_k);
  const int64_t fp32 = per_rank_bytes(gguf_file("wide/flux1_bfl_wide", ".safetensors"));
  const auto folder = shardit::io::open_component(config_dir, "transformer");
  auto model = shardit::models::create_transformer(folder);
  const Checkpoint checkpoint = shardit::models::open_transformer_file(q4_k, folder.class_name(), *model);
  EXPECT_EQ(stored, shardit::models::memory_of(model->resolve_as_stored(checkpoint, 2, at::kFloat)).per_rank_bytes);
  EXPECT_EQ(fp32, shardit::models::memory_of(model->resolve(2, at::kFloat)).per_rank_bytes);
  std::cout << "per rank at TP 2: Q4_K file " << stored << " bytes, fp32 file " << fp32 << " bytes\n";
  EXPECT_LT(stored * 5, fp32);  // Q4_K is 4.5 bits a weight against fp32's 32

  // ComfyUI's FP8 files of the golden FLUX.1 against its BFL file, in bf16: about half.
  const auto single_file = shardit::testing::single_file_path;
  const int64_t bf16 =
      inspected_bytes_per_rank(golden_path("flux_b1_square"), single_file("flux1_bfl.safetensors"), "bf16");
  for (const char* fp8 : {"flux1_bfl_fp8_scaled.safetensors", "flux1_bfl_fp8_e4m3fn.safetensors"}) {
    const int64_t bytes = inspected_bytes_per_rank(golden_path("flux_b1_square"), single_file(fp8), "bf16");
    EXPECT_LT(bytes * 10, bf16 * 6) << fp8 << ": " << bytes << " bytes per rank, bf16 " << bf16;
    EXPECT_GT(bytes * 10, bf16 * 4) << fp8;
  }
  // The BFL file quantized on load (--weights-dtype fp8) counts what the folder's plan counts with
  // that option: its Linears in one byte but the ones kept in high precision (embedders,
  // modulation, output head), which ComfyUI's FP8 files store in FP8 too.
  const auto flux1 = shardit::io::open_component(golden_path("flux_b1_square"), "transformer");
  const int64_t on_load = shardit::models::memory_of(shardit::models::create_transformer(flux1)->resolve(
                                                         2, at::kBFloat16, shardit::parallel::TpPlanKind::Full,
                                                         shardit::nn::WeightsDtype::Fp8))
                              .per_rank_bytes;
  EXPECT_EQ(inspected_bytes_per_rank(golden_path("flux_b1_square"), single_file("flux1_bfl.safetensors"), "bf16",
                                     "--weights-dtype fp8"),
            on_load);
  EXPECT_LT(on_load, bf16);
}

// A TP=2 rank reads its rows of the colwise weights and its blocks of the rowwise ones: of the
// quantized Q8_0 FLUX.1 file's tensors, about half (the replicated ones whole on both ranks).
TEST(GgufTransformer, GoldenRankReadsItsShareOfTheBlocks) {
  if (is_worker()) {
    auto& world = shardit::dist::World::init();
    std::optional<Checkpoint> checkpoint;
    auto model = load_from_file(golden_path("flux_b1_square"), gguf_file("flux1_bfl.q8_0"), true, &checkpoint);
    uint64_t whole = 0;
    for (const std::string& name : checkpoint->source_names()) whole += checkpoint->find_source(name)->nbytes();
    const uint64_t read = checkpoint->stats().bytes_read.load();
    std::cout << "rank " << world.rank() << " read " << read << " of the file's " << whole << " tensor bytes\n";
    EXPECT_LT(read, whole * 6 / 10);
    EXPECT_GT(read, whole * 4 / 10);
    return;
  }
  EXPECT_EQ(run_ranks(2), 0);
}

// `generate --model FOLDER --transformer FILE.gguf` at TP 1 and 2: the FLUX.1 pipeline with its
// transformer from the Q8_0 file writes the folder's image within Q8_0's bound (pixels in [0, 1]),
// and the image of the same weights dequantized by gguf-py and given dense (1e-6 of the latents).
TEST(GgufTransformer, GoldenGenerateWithGgufTransformerAtTp1And2GivesTheFolderImage) {
  if (is_worker()) return;
  const auto golden = shardit::testing::read_pipeline_case(golden_path("pipeline_flux1"));
  const auto folder = shardit::testing::run_generate_cli(golden, "--nproc-per-node 2");
  const auto one_rank =
      shardit::testing::run_generate_cli(golden, "", "--transformer " + gguf_file("pipeline_flux1_bfl.q8_0"));
  EXPECT_LE((one_rank.image - folder.image).abs().max().item<double>(), 4e-2);
  const auto file = shardit::testing::run_generate_cli(golden, "--nproc-per-node 2",
                                                       "--transformer " + gguf_file("pipeline_flux1_bfl.q8_0"));
  EXPECT_LE(relative_error(file.latents, one_rank.latents), 1e-5);  // TP 2 sums the rows in two parts
  const auto dense = shardit::testing::run_generate_cli(
      golden, "--nproc-per-node 2",
      "--transformer " + gguf_file("pipeline_flux1_bfl.q8_0", ".dequantized.safetensors"));
  EXPECT_NE(file.output.find("tp 2 of 2 ranks"), std::string::npos) << file.output;
  const double difference = (file.image - folder.image).abs().max().item<double>();
  std::cout << "Q8_0 image: max difference " << difference << " from the folder's; latents "
            << relative_error(file.latents, dense.latents) << " from the dense dequantized weights'\n";
  EXPECT_LE(difference, 4e-2);  // measured 1.9e-2 (mean 2.1e-3)
  EXPECT_FALSE(at::equal(file.image, folder.image));  // the weights are the Q8_0 ones
  EXPECT_LE(relative_error(file.latents, dense.latents), 1e-6);  // measured 1.1e-7
}

// ---------------------------------------------------------------------------------------------
// Bad files: each a named error before any compute.

std::string open_error(const std::string& model_case, const std::string& path) {
  const auto folder = shardit::io::open_component(golden_path(model_case), "transformer");
  auto model = shardit::models::create_transformer(folder);
  return error_of([&] { shardit::models::open_transformer_file(path, folder.class_name(), *model); });
}

TEST(GgufTransformer, GoldenFileOfAnotherFamilyIsNamed) {
  EXPECT_THAT(open_error("flux_b1_square", gguf_file("flux2_bfl.q8_0")),
              HasSubstr("holds a Flux2Transformer2DModel (BFL layout: has 'single_stream_modulation.lin.weight'), but "
                        "the model folder's transformer is FluxTransformer2DModel"));
  EXPECT_THAT(open_error("qwenimage_b1_square", gguf_file("flux1_bfl.q4_0")),
              HasSubstr("holds a FluxTransformer2DModel (BFL layout"));
}

TEST(GgufTransformer, GoldenTruncatedAndNonGgufFilesAreNamed) {
  const std::string dir = shardit::testing::make_temp_dir("gguf-bad");
  const std::string whole = gguf_file("flux1_bfl.q8_0");
  std::filesystem::copy_file(whole, dir + "/truncated.gguf");
  std::filesystem::resize_file(dir + "/truncated.gguf", std::filesystem::file_size(whole) / 2);
  EXPECT_THAT(open_error("flux_b1_square", dir + "/truncated.gguf"), HasSubstr(dir + "/truncated.gguf: "));
  std::ofstream(dir + "/text.gguf") << "not a GGUF file at all";
  EXPECT_THAT(open_error("flux_b1_square", dir + "/text.gguf"), HasSubstr(dir + "/text.gguf"));
}

// The golden FLUX.1's rowwise layers take 64 inputs: 2 Q8_0 blocks of 32 per row, so TP 4 would cut
// them (and the wide one's Q4_K rows of 2 super-blocks); refused on load, before any weight is read, with the degrees that keep the blocks whole.
TEST(GgufTransformer, GoldenDegreeThatCutsBlocksIsRefusedListingWorkingDegrees) {
  if (is_worker()) {
    shardit::dist::World::init();
    const std::string message =
        error_of([] { load_from_file(golden_path("flux_b1_square"), gguf_file("flux1_bfl.q8_0"), true); });
    EXPECT_THAT(message, HasSubstr("flux1_bfl.q8_0.gguf: tensor '"));
    EXPECT_THAT(message, HasSubstr("(Q8_0, shape ["));
    EXPECT_THAT(message, HasSubstr("at degree 4 splits its rows at columns ["));
    EXPECT_THAT(message, HasSubstr("degrees that keep every GGUF block whole: 1, 2 "));
    // A Q4_K super-block is 256 values: the wide FLUX.1's 512 inputs split in 2, not in 4.
    const std::string k_message = error_of([] {
      load_from_file(gguf_file("wide/flux1_bfl_wide", ""), gguf_file("wide/flux1_bfl_wide.q4_k"), true);
    });
    EXPECT_THAT(k_message, HasSubstr("(Q4_K, shape ["));
    EXPECT_THAT(k_message, HasSubstr("is stored in blocks of 256 elements along its rows"));
    EXPECT_THAT(k_message, HasSubstr("degrees that keep every GGUF block whole: 1, 2 "));
    return;
  }
  EXPECT_EQ(run_ranks(4), 0);
}

}  // namespace
}  // namespace test_gguf_transformer

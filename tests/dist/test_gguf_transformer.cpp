// GGUF transformers (`--transformer FILE.gguf`): the golden FLUX.1, FLUX.2 and Qwen-Image
// transformers written by tests/golden/tools/make_gguf_transformer_cases.py with gguf-py (F16, BF16,
// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; city96's names: Black Forest Labs' keys, ComfyUI's for Qwen-Image)
// load through the single-file layouts, their Linear weights kept in GGUF blocks per rank. Checked:
// the output equals the dense model of the same file's weights as gguf-py dequantizes them, and the
// fp32 golden within a bound per type, at TP 1 and 2; `generate --transformer FILE.gguf` at TP 2;
// bad files named before any compute. The files are made in the build folder by the CTest entry
// make_gguf_transformer_cases.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/parallel/tensor_parallel.h"
#include "support/multiprocess.h"
#include "support/pipeline_case.h"
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

struct Case {
  const char* file;
  const char* golden_case;
};
const Case kCases[] = {{"flux1_bfl", "flux_b1_square"},
                       {"flux2_bfl", "flux2_b1_square"},
                       {"qwenimage_comfyui", "qwenimage_b1_square"}};

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

/// A file written by make_gguf_transformer_cases.py (in the build folder, or $SHARDIT_SINGLE_FILE_DIR/gguf).
std::string gguf_file(const std::string& name, const std::string& suffix = ".gguf") {
  const char* dir = std::getenv("SHARDIT_SINGLE_FILE_DIR");
  const std::string path = std::string(dir ? dir : SHARDIT_SINGLE_FILE_DIR) + "/gguf/" + name + suffix;
  if (!std::filesystem::exists(path)) {
    throw std::runtime_error(path + " is missing: run `ctest -R 'make_single_file_cases|make_gguf_transformer_cases'` "
                             "first (tests/golden/tools/make_gguf_transformer_cases.py writes it)");
  }
  return path;
}

std::shared_ptr<TensorParallelModule> load_from_file(const std::string& model_dir, const std::string& path, bool sharded,
                                                     std::optional<Checkpoint>* checkpoint = nullptr) {
  const auto folder = shardit::io::open_component(model_dir, "transformer");
  auto model = shardit::models::create_transformer(folder);
  const Checkpoint weights = shardit::models::open_transformer_file(path, folder.class_name(), *model);
  shardit::parallel::LoadOptions options;
  if (sharded) options.tensor_parallel = shardit::testing::world_tensor_parallel();
  model->load(weights, options);
  if (checkpoint != nullptr) *checkpoint = weights;
  return model;
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

// `generate --model FOLDER --transformer FILE.gguf` at TP 2: the FLUX.1 pipeline with its
// transformer from the Q8_0 file writes the folder's image within Q8_0's bound (pixels in [0, 1]),
// and the image of the same weights dequantized by gguf-py and given dense (1e-6 of the latents).
TEST(GgufTransformer, GoldenGenerateWithGgufTransformerAtTp2GivesTheFolderImage) {
  if (is_worker()) return;
  const auto golden = shardit::testing::read_pipeline_case(golden_path("pipeline_flux1"));
  const auto folder = shardit::testing::run_generate_cli(golden, "--nproc-per-node 2");
  const auto file = shardit::testing::run_generate_cli(golden, "--nproc-per-node 2",
                                                       "--transformer " + gguf_file("pipeline_flux1_bfl.q8_0"));
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
// them; refused on load, before any weight is read, with the degrees that keep the blocks whole.
TEST(GgufTransformer, GoldenDegreeThatCutsBlocksIsRefusedListingWorkingDegrees) {
  if (is_worker()) {
    shardit::dist::World::init();
    const std::string message =
        error_of([] { load_from_file(golden_path("flux_b1_square"), gguf_file("flux1_bfl.q8_0"), true); });
    EXPECT_THAT(message, HasSubstr("flux1_bfl.q8_0.gguf: tensor '"));
    EXPECT_THAT(message, HasSubstr("(Q8_0, shape ["));
    EXPECT_THAT(message, HasSubstr("at degree 4 splits its rows at columns ["));
    EXPECT_THAT(message, HasSubstr("degrees that keep every GGUF block whole: 1, 2 "));
    return;
  }
  EXPECT_EQ(run_ranks(4), 0);
}

}  // namespace
}  // namespace test_gguf_transformer

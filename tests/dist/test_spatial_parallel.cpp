// The parallel VAE decode in real multi-process groups: each rank decodes a band of the latent
// rows (halo rows exchanged with its neighbours, GroupNorm statistics and attention keys/values
// over the group) and the gathered sample equals the single-rank decode of the same process.
// Three VAEs (the golden cases and the 8x VAEs of the pipeline cases), 2, 3 and 4 ranks, heights
// that the degree does not divide; per-rank memory; the neighbour exchange itself; the errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "shardit/core/compat.h"
#include "shardit/dist/world.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/models/vae/vae.h"
#include "shardit/nn/module.h"
#include "shardit/nn/spatial_parallel_layer.h"
#include "shardit/parallel/spatial_parallel.h"
#include "shardit/pipelines/pipeline.h"
#include "support/multiprocess.h"
#include "support/pipeline_case.h"
#include "support/test_support.h"

namespace test_spatial_parallel {
namespace {

using shardit::testing::env_or;
using shardit::testing::golden_path;
using shardit::testing::is_worker;
using shardit::testing::run_ranks;
using shardit::testing::tensors_close;
using ::testing::HasSubstr;

// The golden README's VAE tolerance. The parallel decode changes only the order of summation in
// the GroupNorm statistics (sums of bands) and the zero padding at the bands' outer edges; a
// wrong halo or statistic gives O(1) errors.
constexpr double kTol = 1e-4;

std::shared_ptr<shardit::models::AutoencoderModel> load_vae(const std::string& case_name) {
  const shardit::io::ComponentFolder folder = shardit::io::open_component(golden_path(case_name), "vae");
  auto vae = shardit::models::create_vae(folder);
  vae->load(folder.weights(), {});
  return vae;
}

at::Tensor random_latents(std::vector<int64_t> shape, uint64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::normal(0.0, 1.0, shape, generator);
}

/// The decoder input of a golden VAE case (the reference's z).
at::Tensor golden_z(const std::string& case_name) {
  return shardit::io::SafetensorsFile::open(golden_path(case_name) + "/inputs.safetensors")->read("z");
}

/// A latent of h x w for `vae` (Qwen-Image: one frame).
std::vector<int64_t> latent_shape(const shardit::models::AutoencoderModel& vae, int64_t batch, int64_t h, int64_t w) {
  if (vae.type_name() == "AutoencoderKLQwenImage") return {batch, vae.latent_channels(), 1, h, w};
  return {batch, vae.latent_channels(), h, w};
}

/// Decodes z alone, then over the world by row bands; expects the same sample on every rank.
void expect_parallel_equals_single(shardit::models::AutoencoderModel& vae, const at::Tensor& z,
                                   const std::string& what) {
  shardit::dist::World& world = shardit::dist::World::get();
  const at::Tensor single = vae.decode(z);
  vae.enable_parallel_decode(world.group());
  ASSERT_EQ(vae.parallel_decode_degree(), world.size());
  const at::Tensor parallel = vae.decode(z);
  vae.disable_parallel_decode();
  const auto result = tensors_close(what + " on " + std::to_string(world.size()) + " ranks", parallel, single, kTol, kTol);
  EXPECT_TRUE(result);
  if (world.rank() == 0) std::cout << "  " << result.message() << "\n";
}

class SpatialParallelGoldenVae : public ::testing::TestWithParam<int> {};

// The three golden VAE cases: the parallel decode equals the single-rank decode and diffusers'.
TEST_P(SpatialParallelGoldenVae, DecodeEqualsSingleRankAndDiffusers) {
  if (is_worker()) {
    shardit::dist::World::init();
    for (const std::string name : {"vae_flux1", "vae_flux2", "vae_qwenimage"}) {
      auto vae = load_vae(name);
      const at::Tensor z = golden_z(name);
      expect_parallel_equals_single(*vae, z, name);
      vae->enable_parallel_decode(shardit::dist::World::get().group());
      const at::Tensor sample = vae->decode(z);
      const auto outputs = shardit::io::SafetensorsFile::open(golden_path(name) + "/outputs.safetensors");
      EXPECT_TRUE(tensors_close(name + " parallel vs diffusers", sample, outputs->read("sample"), kTol, kTol));
    }
    return;
  }
  EXPECT_EQ(run_ranks(GetParam()), 0);
}

// Larger random latents whose height the degree does not divide (uneven bands), batch 2, through
// the 8x VAEs of the pipeline cases (three upsamplers: the bands double three times) and the
// golden ones.
TEST_P(SpatialParallelGoldenVae, UnevenBandsOfLargerLatentsEqualSingleRank) {
  if (is_worker()) {
    shardit::dist::World::init();
    const int64_t degree = shardit::dist::World::get().size();
    const int64_t height = 4 * degree + 1;  // bands of 5, 4 / 5, 4, 4 / 5, 4, 4, 4
    for (const std::string name :
         {"pipeline_flux1", "pipeline_flux2_klein", "pipeline_qwenimage", "vae_flux1", "vae_qwenimage"}) {
      auto vae = load_vae(name);
      const at::Tensor z = random_latents(latent_shape(*vae, 2, height, 7), 17);
      expect_parallel_equals_single(*vae, z, name + " " + std::to_string(height) + "x7");
    }
    // The single-row bands of a height equal to the degree.
    auto vae = load_vae("vae_flux2");
    expect_parallel_equals_single(*vae, random_latents(latent_shape(*vae, 1, degree, 6), 5), "vae_flux2 one row each");
    // bf16 weights and activations (halos and gathers travel as bf16, statistics in fp32/f64):
    // within bf16 rounding (8 bits of mantissa, 4e-3 relative) of the bf16 single-rank decode.
    vae->to(at::kCPU, at::kBFloat16);
    const at::Tensor z = random_latents(latent_shape(*vae, 1, height, 7), 23).to(at::kBFloat16);
    const at::Tensor single = vae->decode(z).to(at::kFloat);
    vae->enable_parallel_decode(shardit::dist::World::get().group());
    const at::Tensor parallel = vae->decode(z).to(at::kFloat);
    EXPECT_TRUE(tensors_close("vae_flux2 bf16", parallel, single, 3e-2, 3e-2));
    return;
  }
  EXPECT_EQ(run_ranks(GetParam()), 0);
}

INSTANTIATE_TEST_SUITE_P(Degrees, SpatialParallelGoldenVae, ::testing::Values(2, 3, 4));

/// Counts the bytes of live CPU tensors and their high-water mark, forwarding to the default
/// allocator: the activations a rank holds, whatever op allocates them. (Raw allocations, as
/// oneDNN makes them, need the data pointer as the context: sizes are kept by pointer.)
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) { instance_ = this; }
  c10::DataPtr allocate(size_t n) SHARDIT_ALLOCATE_CONST override {
    c10::DataPtr inner = base_->allocate(n);
    const c10::Device device = inner.device();
    void* data = inner.get();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      TORCH_INTERNAL_ASSERT(inner.release_context() == data, "the base allocator's context is not its data");
      sizes_[data] = n;
      live_ += static_cast<int64_t>(n);
      peak_ = std::max(peak_, live_);
    }
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
#if SHARDIT_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#endif
  /// Restarts the high-water mark at the bytes live now; returns them.
  int64_t reset_peak() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_ = live_;
  }
  int64_t peak() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }

 private:
  static void release(void* data) {
    c10::DeleterFnPtr deleter = nullptr;
    {
      std::lock_guard<std::mutex> lock(instance_->mutex_);
      // Raw memory allocated before the counter was installed is freed here too, uncounted.
      auto it = instance_->sizes_.find(data);
      if (it != instance_->sizes_.end()) {
        instance_->live_ -= static_cast<int64_t>(it->second);
        instance_->sizes_.erase(it);
      }
      deleter = instance_->base_->raw_deleter();
    }
    deleter(data);
  }
  static CountingAllocator* instance_;
  c10::Allocator* base_;
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, size_t> sizes_;
  mutable int64_t live_ = 0;
  mutable int64_t peak_ = 0;
};
CountingAllocator* CountingAllocator::instance_ = nullptr;

// Per rank, the decode's peak of live tensor bytes (everything it allocates, activations and
// temporaries) and its largest intermediate, alone and over 2 ranks: each rank holds about half.
TEST(SpatialParallelGoldenMemory, EachRankHoldsAboutItsShareOfTheActivations) {
  if (is_worker()) {
    shardit::dist::World& world = shardit::dist::World::init();
    static CountingAllocator counter(c10::GetCPUAllocator());
    c10::SetCPUAllocator(&counter, /*priority=*/100);
    auto vae = load_vae("pipeline_flux1");
    // 512 x 384 pixels: the activations dwarf the weights, the latent and the gathered sample.
    const at::Tensor z = random_latents(latent_shape(*vae, 1, 64, 48), 3);
    const auto measure = [&](int64_t* largest) {
      const int64_t before = counter.reset_peak();
      *largest = 0;
      const auto start = std::chrono::steady_clock::now();
      {
        const shardit::nn::ObserveForward observe([&](const std::string&, const std::string&, const at::Tensor& value) {
          *largest = std::max<int64_t>(*largest, value.numel());
        });
        vae->decode(z);
      }
      std::cout << "rank " << world.rank() << ": decode on " << vae->parallel_decode_degree() << " rank(s) took "
                << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << " s\n";
      return counter.peak() - before;
    };
    int64_t single_largest = 0, band_largest = 0;
    const int64_t single_peak = measure(&single_largest);
    vae->enable_parallel_decode(world.group());
    const int64_t band_peak = measure(&band_largest);
    vae->disable_parallel_decode();
    c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), /*priority=*/101);
    const double ratio = static_cast<double>(band_peak) / static_cast<double>(single_peak);
    std::cout << "rank " << world.rank() << ": decode peak " << single_peak / (1 << 20) << " MiB alone, "
              << band_peak / (1 << 20) << " MiB on " << world.size() << " ranks (" << ratio
              << "); largest intermediate " << single_largest << " -> " << band_largest << " values\n";
    // The largest intermediate is exactly this rank's band of the alone one (64 rows: 32 each).
    EXPECT_EQ(band_largest * world.size(), single_largest);
    // Half the activations (16-32 channels), plus the halo rows and the gathered sample (3
    // channels, whole, after the activations are freed): measured 0.50. A decode that copied a
    // band per convolution reached 0.60; one that held whole maps anywhere would be near 1.
    EXPECT_LT(ratio, 0.55);
    return;
  }
  EXPECT_EQ(run_ranks(2), 0);
}

// The neighbour exchange: member r sends (r, 10r) and gets r-1's second and r+1's first tensor;
// the ends get undefined tensors; bf16 travels; bytes are counted.
TEST(SpatialParallelExchange, NeighboursSwapEdgesInGroupOrder) {
  if (is_worker()) {
    shardit::dist::World& world = shardit::dist::World::init();
    auto group = world.group();
    const int r = group->rank(), n = group->size();
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      const at::Tensor to_previous = at::full({2, 3}, r, at::TensorOptions().dtype(dtype));
      const at::Tensor to_next = at::full({2, 3}, 10 * r, at::TensorOptions().dtype(dtype));
      group->stats().reset();
      const auto [from_previous, from_next] = group->neighbour_exchange(to_previous, to_next);
      EXPECT_EQ(from_previous.defined(), r > 0);
      EXPECT_EQ(from_next.defined(), r + 1 < n);
      if (r > 0) {
        EXPECT_TRUE(at::equal(from_previous, at::full({2, 3}, 10 * (r - 1), to_previous.options())));
      }
      if (r + 1 < n) {
        EXPECT_TRUE(at::equal(from_next, at::full({2, 3}, r + 1, to_next.options())));
      }
      EXPECT_EQ(group->stats().calls_by_op["neighbour_exchange"], 1u);
      EXPECT_EQ(group->stats().bytes_sent, static_cast<uint64_t>(((r > 0) + (r + 1 < n)) * 6 * to_next.element_size()));
    }
    // Uneven bands gather back in order.
    const auto [first, count] = shardit::nn::row_band(7, n, r);
    const at::Tensor whole = at::arange(7 * 4, at::kFloat).view({1, 7, 4});
    EXPECT_TRUE(at::equal(shardit::nn::gather_rows(whole.narrow(1, first, count), 1, *group), whole));
    return;
  }
  EXPECT_EQ(run_ranks(3), 0);
}

// Too many ranks for the rows, and tiling with a parallel decode: refused on every rank, by name.
TEST(SpatialParallelGoldenErrors, TooManyRanksForTheRowsAndTilingAreRefused) {
  if (is_worker()) {
    shardit::dist::World& world = shardit::dist::World::init();
    auto vae = load_vae("vae_flux1");
    vae->enable_parallel_decode(world.group());
    const at::Tensor z = random_latents(latent_shape(*vae, 1, 2, 5), 1);  // 2 rows over 3 ranks
    const std::string message = shardit::testing::error_of([&] { vae->decode(z); });
    EXPECT_THAT(message, HasSubstr("2 rows"));
    EXPECT_THAT(message, HasSubstr("3 ranks"));
    EXPECT_THAT(message, HasSubstr("largest degree that works for this height is 2"));
    vae->enable_tiling();
    EXPECT_THAT(shardit::testing::error_of([&] { vae->decode(random_latents(latent_shape(*vae, 1, 6, 5), 1)); }),
                HasSubstr("tiled decoding and a parallel decode"));
    // Still usable afterwards: nothing was sent by the refused calls.
    vae->disable_tiling();
    const at::Tensor ok = random_latents(latent_shape(*vae, 1, 6, 5), 2);
    const at::Tensor parallel = vae->decode(ok);
    vae->disable_parallel_decode();
    EXPECT_TRUE(tensors_close("after refusals", parallel, vae->decode(ok), kTol, kTol));
    return;
  }
  EXPECT_EQ(run_ranks(3), 0);
}

// The pipeline options refuse what cannot work, before anything is loaded.
TEST(SpatialParallelGoldenErrors, PipelineRefusesVaeParallelWithTilingOrWithoutTheVae) {
  const std::string dir = golden_path("pipeline_flux1");
  shardit::pipelines::PipelineLoadOptions options;
  options.vae_parallel = true;
  options.vae_tiling = true;
  EXPECT_THAT(shardit::testing::error_of([&] { shardit::pipelines::DiffusionPipeline::open(dir, options); }),
              HasSubstr("vae_parallel (--vae-parallel) and vae_tiling (--tiled-vae) do not combine"));
  options.vae_tiling = false;
  options.load_vae = false;
  EXPECT_THAT(shardit::testing::error_of([&] { shardit::pipelines::DiffusionPipeline::open(dir, options); }),
              HasSubstr("vae_parallel needs the VAE on every rank"));
}

// The pipelines with vae_parallel: every rank of the world (TP 2 on 2 ranks; the
// whole world with a replicated transformer on 3) loads the VAE, decodes its band, and holds the
// golden image.
void pipeline_worker() {
  shardit::dist::World& world = shardit::dist::World::init();
  shardit::testing::PipelineCase golden = shardit::testing::read_pipeline_case(env_or("SHARDIT_PIPELINE_CASE"));
  shardit::pipelines::PipelineLoadOptions options;
  options.vae_parallel = true;
  if (world.size() == 2) {
    options.parallel = shardit::parallel::ParallelDims{1, 1, 1, 2}.build(world);
  }
  const auto pipeline = shardit::pipelines::DiffusionPipeline::from_pretrained(golden.dir, options);
  ASSERT_NE(pipeline->vae(), nullptr);
  EXPECT_EQ(pipeline->vae()->parallel_decode_degree(), world.size());
  std::vector<at::Tensor> steps;
  golden.request.callback_on_step_end = [&steps](int64_t, const at::Tensor& latents) {
    steps.push_back(latents.clone());
  };
  const auto result = pipeline->generate(golden.request);
  shardit::testing::expect_pipeline_matches(golden, steps, result.image,
                                            golden.dir + " (vae_parallel on " + std::to_string(world.size()) +
                                                " ranks, rank " + std::to_string(world.rank()) + ")");
}

class SpatialParallelGoldenPipelines : public ::testing::TestWithParam<std::string> {};

TEST_P(SpatialParallelGoldenPipelines, ApiOnTwoAndThreeRanksGivesTheGoldenImageOnEveryRank) {
  if (is_worker()) return pipeline_worker();
  const std::string dir = golden_path(GetParam());
  EXPECT_EQ(run_ranks(2, {{"SHARDIT_PIPELINE_CASE", dir}}), 0);
  EXPECT_EQ(run_ranks(3, {{"SHARDIT_PIPELINE_CASE", dir}}), 0);
}

TEST_P(SpatialParallelGoldenPipelines, GenerateVaeParallelOnTwoRanks) {
  if (is_worker()) return;
  auto golden = shardit::testing::read_pipeline_case(golden_path(GetParam()));
  golden.cli_args.push_back("--vae-parallel");
  const auto run = shardit::testing::run_generate_cli(golden, "--nproc-per-node 2");
  shardit::testing::expect_pipeline_matches(golden, run.step_latents, run.image, GetParam() + " (CLI, --vae-parallel)");
  shardit::testing::expect_pngs_match(golden, run.pngs, GetParam() + " (CLI PNG, --vae-parallel)");
}

INSTANTIATE_TEST_SUITE_P(Golden, SpatialParallelGoldenPipelines,
                         ::testing::Values("pipeline_flux1", "pipeline_flux2_klein", "pipeline_qwenimage"),
                         [](const auto& info) { return info.param.substr(9); });

// `shardit --nproc-per-node 3 run-vae`: the ranks decode together and rank 0 writes the sample
// and every intermediate whole, equal to diffusers'.
TEST(SpatialParallelGoldenCli, RunVaeOnThreeRanksWritesTheGoldenTensors) {
  if (is_worker()) return;
  for (const std::string name : {"vae_flux2", "vae_qwenimage"}) {
    const std::string dir = golden_path(name);
    const std::string out = shardit::testing::make_temp_dir("run_vae_parallel") + "/out.safetensors";
    std::string output;
    ASSERT_EQ(shardit::testing::run_command(shardit::testing::cli_path() + " --nproc-per-node 3 run-vae --model " +
                                                dir + " --inputs " + dir + " --out " + out,
                                            &output),
              0)
        << output;
    EXPECT_THAT(output, HasSubstr("3 ranks by row bands"));
    const auto written = shardit::io::SafetensorsFile::open(out);
    const auto outputs = shardit::io::SafetensorsFile::open(dir + "/outputs.safetensors");
    for (const std::string& tensor : outputs->names()) {
      ASSERT_TRUE(written->contains(tensor)) << "run-vae did not write '" << tensor << "'";
      EXPECT_TRUE(tensors_close("run-vae on 3 ranks " + name + " " + tensor, written->read(tensor),
                                outputs->read(tensor), kTol, kTol));
    }
  }
  std::string output;
  const std::string dir = golden_path("vae_flux1");
  EXPECT_NE(shardit::testing::run_command(shardit::testing::cli_path() + " --nproc-per-node 2 run-vae --tiled --model " +
                                              dir + " --inputs " + dir + " --out " +
                                              shardit::testing::make_temp_dir("run_vae_tiled") + "/out.safetensors",
                                          &output),
            0);
  EXPECT_THAT(output, HasSubstr("--tiled decodes on one rank"));
}

}  // namespace
}  // namespace test_spatial_parallel

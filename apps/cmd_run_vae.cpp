// `shardit run-vae`: decodes a golden-style VAE case (inputs.safetensors holding the pipeline's
// `latents`, FLUX.2's `latents_patchified`, or the decoder input `z`) and writes `sample` with
// the decoder's intermediates under the reference's names. Started on several ranks
// (--nproc-per-node), they decode together, each a band of the rows.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "apps/commands.h"
#include "shardit/core/dtype.h"
#include "shardit/dist/world.h"
#include "shardit/io/file.h"
#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/models/vae/vae.h"
#include "shardit/nn/module.h"
#include "shardit/nn/spatial_parallel_layer.h"

namespace shardit::apps {

namespace {

struct RunVaeOptions {
  std::string model;
  std::string inputs;
  std::string out;
  std::string dtype = "f32";
  bool tiled = false;
};

int run_vae(const RunVaeOptions& options) {
  dist::World& world = dist::World::get();
  const at::ScalarType dtype = parse_compute_dtype(options.dtype);
  const io::ComponentFolder component = io::open_component(options.model, "vae");
  std::shared_ptr<models::AutoencoderModel> vae = models::create_vae(component);

  const std::string inputs_path = read_case_inputs(options.inputs, component).file;
  const auto inputs = io::SafetensorsFile::open(inputs_path);
  // Before any work: the output must not land on anything read (the component folder, the case).
  if (world.rank() == 0) {
    io::check_output_path(options.out, {options.model, component.dir, inputs_path, options.inputs});
  }

  parallel::LoadOptions load_options;
  load_options.dtype = dtype;
  load_options.device = world.device();
  vae->load(component.weights(), load_options);
  if (options.tiled) vae->enable_tiling();
  // Several ranks decode together, each a band of the rows; the tensors written are whole.
  TORCH_CHECK(!(options.tiled && world.size() > 1), "run-vae: --tiled decodes on one rank, but ", world.size(),
              " ranks were started (they decode in parallel, by row bands); drop --tiled or run one rank");
  vae->enable_parallel_decode(world.group());

  std::vector<std::pair<std::string, at::Tensor>> recorded;
  const auto record = [&recorded](const std::string& path, const std::string& name, const at::Tensor& value) {
    const std::string golden_name = models::vae_intermediate_name(path, name);
    recorded.emplace_back(golden_name, value.to(at::kCPU, at::kFloat).contiguous().clone());
  };
  const auto read_input = [&](const std::string& name) { return inputs->read(name, dtype).to(world.device()); };

  const auto start = std::chrono::steady_clock::now();
  at::Tensor z;
  {
    const nn::ObserveForward observe(record);
    if (inputs->contains("latents_patchified")) {
      z = vae->denormalize_latents(read_input("latents_patchified"));
    } else if (inputs->contains("latents")) {
      z = vae->denormalize_latents(read_input("latents"));
    } else {
      TORCH_CHECK(inputs->contains("z"), inputs_path, ": holds none of 'latents', 'latents_patchified' or 'z'");
      z = read_input("z");
    }
  }
  at::Tensor sample;
  {
    // Under a parallel decode the decoder's intermediates arrive as bands: gathered in order.
    const auto record_band = [&](const std::string& path, const std::string& name, const at::Tensor& band) {
      record(path, name, nn::gather_rows(band, -2, *world.group()));
    };
    const nn::ObserveForward observe(world.size() == 1 ? nn::ForwardObserver(record)
                                                       : nn::ForwardObserver(record_band));
    sample = vae->decode(z);
  }
  const auto end = std::chrono::steady_clock::now();

  if (world.rank() == 0) {
    std::vector<std::pair<std::string, at::Tensor>> tensors{{"sample", sample.to(at::kCPU, at::kFloat).contiguous()}};
    for (auto& entry : recorded) tensors.push_back(std::move(entry));
    io::save_safetensors(options.out, tensors);
    const std::string split = world.size() > 1 ? fmt::format(", {} ranks by row bands", world.size()) : "";
    fmt::print("{} ({}{}{}): sample {} in {:.3f} s -> {}\n", vae->type_name(), options.dtype,
               options.tiled ? ", tiled" : "", split, fmt::join(sample.sizes(), "x"),
               std::chrono::duration<double>(end - start).count(), options.out);
  }
  return 0;
}

}  // namespace

void register_run_vae(CLI::App& app, CommandBody& body) {
  auto options = std::make_shared<RunVaeOptions>();
  CLI::App* command =
      app.add_subcommand("run-vae", "decode a VAE case folder and write `sample` and the intermediates");
  command->add_option("--model", options->model, "VAE component folder (or pipeline folder)")->required();
  command->add_option("--inputs", options->inputs,
                      "case folder with inputs.safetensors (latents, latents_patchified or z), or the file")
      ->required();
  command->add_option("--out", options->out, "output .safetensors file (float32)")->required();
  command->add_option("--dtype", options->dtype, "compute dtype: f32 or bf16");
  command->add_flag("--tiled", options->tiled, "decode in tiles (diffusers' enable_tiling, default tile sizes)");
  command->callback([&body, options] { body = [options] { return run_vae(*options); }; });
}

}  // namespace shardit::apps

#include "shardit/pipelines/pipeline.h"
#include "shardit/pipelines/auto_pipeline.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/ScopeExit.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <numeric>
#include <tuple>

#include "shardit/core/notes.h"
#include "shardit/core/units.h"
#include "shardit/dist/mesh.h"
#include "shardit/parallel/context_parallel.h"
#include "shardit/dist/world.h"
#include "shardit/io/image.h"
#include "shardit/io/png.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/registry.h"
#include "shardit/nn/inputs.h"
#include "shardit/nn/int8_compute.h"
#include "shardit/nn/linear.h"

namespace shardit::pipelines {

namespace {

bool is_floating(at::ScalarType type) { return at::isFloatingType(type); }

}  // namespace

PromptEmbeds PromptEncoder::encode(const std::vector<std::string>& prompts, const std::vector<at::Tensor>& images,
                                   int64_t max_sequence_length) {
  TORCH_CHECK(images.empty(), "this pipeline's text encoder reads text only; it cannot encode ", images.size(),
              " images with the prompt");
  return encode(prompts, max_sequence_length);
}

std::optional<PromptEmbeds> read_prompt_embeds(const std::string& path, const std::string& prefix) {
  const auto file = io::SafetensorsFile::open(path);
  if (!file->contains(prefix + "prompt_embeds")) return std::nullopt;
  PromptEmbeds embeds;
  embeds.prompt_embeds = file->read(prefix + "prompt_embeds");
  if (file->contains(prefix + "pooled_prompt_embeds"))
    embeds.pooled_prompt_embeds = file->read(prefix + "pooled_prompt_embeds");
  if (file->contains(prefix + "prompt_embeds_mask"))
    embeds.prompt_embeds_mask = file->read(prefix + "prompt_embeds_mask");
  return embeds;
}

void check_prompt_embeds(const PromptEmbeds& embeds, int64_t joint_attention_dim, int64_t pooled_dim,
                         const std::string& what) {
  const at::Tensor& x = embeds.prompt_embeds;
  TORCH_CHECK(x.defined(), what, " is missing");
  TORCH_CHECK(is_floating(x.scalar_type()), what, " has dtype ", x.scalar_type(),
              "; prompt embeddings are floating point (float32, bfloat16, float16)");
  TORCH_CHECK(x.dim() == 3 && x.size(0) >= 1 && x.size(1) >= 1, what, " has shape ", x.sizes(),
              ", expected [prompts, tokens, ", joint_attention_dim, "]");
  TORCH_CHECK(x.size(2) == joint_attention_dim, what, " has width ", x.size(2), " (shape ", x.sizes(),
              "), but the transformer's joint_attention_dim is ", joint_attention_dim,
              ": the embeddings were made for another model");
  if (pooled_dim > 0) {
    TORCH_CHECK(embeds.pooled_prompt_embeds.has_value(), what, ": pooled_prompt_embeds [", x.size(0), ", ", pooled_dim,
                "] is missing (FLUX.1 needs the CLIP pooled output too)");
    const at::Tensor& pooled = *embeds.pooled_prompt_embeds;
    TORCH_CHECK(is_floating(pooled.scalar_type()), what, ": pooled_prompt_embeds has dtype ", pooled.scalar_type(),
                "; expected floating point");
    TORCH_CHECK(pooled.dim() == 2 && pooled.size(0) == x.size(0) && pooled.size(1) == pooled_dim, what,
                ": pooled_prompt_embeds has shape ", pooled.sizes(), ", expected [", x.size(0), ", ", pooled_dim,
                "] (the transformer's pooled_projection_dim)");
  }
  if (embeds.prompt_embeds_mask.has_value()) {
    const at::Tensor& mask = *embeds.prompt_embeds_mask;
    TORCH_CHECK(!is_floating(mask.scalar_type()) && !at::isComplexType(mask.scalar_type()), what,
                ": prompt_embeds_mask has dtype ", mask.scalar_type(), "; expected int64 or bool (1 = valid token)");
    TORCH_CHECK(mask.dim() == 2 && mask.size(0) == x.size(0) && mask.size(1) == x.size(1), what,
                ": prompt_embeds_mask has shape ", mask.sizes(), ", expected [", x.size(0), ", ", x.size(1), "]");
  }
}

PromptEmbeds repeat_prompt_embeds(const PromptEmbeds& embeds, int64_t n, at::ScalarType dtype, at::Device device) {
  PromptEmbeds out;
  // Contiguous, as generate_batch's concatenation is (a product's rounding may follow the layout).
  out.prompt_embeds = embeds.prompt_embeds.repeat_interleave(n, 0).to(device, dtype).contiguous();
  if (embeds.pooled_prompt_embeds)
    out.pooled_prompt_embeds = embeds.pooled_prompt_embeds->repeat_interleave(n, 0).to(device, dtype);
  if (embeds.prompt_embeds_mask)
    out.prompt_embeds_mask = embeds.prompt_embeds_mask->repeat_interleave(n, 0).to(device, at::kLong);
  return out;
}

at::Tensor seeded_noise(at::IntArrayRef shape, uint64_t seed) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, generator, at::TensorOptions().dtype(at::kFloat));
}

at::Tensor pack_latents_2x2(const at::Tensor& latents) {
  const int64_t b = latents.size(0), c = latents.size(1), h = latents.size(2) / 2, w = latents.size(3) / 2;
  // [B, C, h, 2, w, 2] -> [B, h, w, C, 2, 2]
  return latents.reshape({b, c, h, 2, w, 2}).permute({0, 2, 4, 1, 3, 5}).reshape({b, h * w, c * 4});
}

at::Tensor unpack_latents_2x2(const at::Tensor& packed, int64_t h, int64_t w) {
  const int64_t b = packed.size(0), c = packed.size(2) / 4;
  // [B, h, w, C, 2, 2] -> [B, C, h, 2, w, 2]
  return packed.reshape({b, h, w, c, 2, 2}).permute({0, 3, 1, 4, 2, 5}).reshape({b, c, h * 2, w * 2});
}

void check_given_latents(const at::Tensor& latents, const std::vector<int64_t>& expected, const std::string& layout) {
  TORCH_CHECK(at::isFloatingType(latents.scalar_type()), "latents have dtype ", latents.scalar_type(),
              "; expected floating point");
  TORCH_CHECK(latents.sizes().vec() == expected, "latents have shape ", latents.sizes(), ", expected ",
              at::IntArrayRef(expected), " (", layout, ") for this batch, height and width");
}

std::vector<std::string> negative_prompts_for(const std::vector<std::string>& negative, int64_t num_prompts) {
  if (negative.empty()) return {};
  if (negative.size() == 1) return std::vector<std::string>(static_cast<size_t>(num_prompts), negative[0]);
  TORCH_CHECK(static_cast<int64_t>(negative.size()) == num_prompts, negative.size(), " negative prompts for ",
              num_prompts, " prompts; give one negative prompt, or one per prompt");
  return negative;
}

namespace {

void check_range(const char* what, int64_t value, int64_t low, int64_t high) {
  TORCH_CHECK(value >= low && value <= high, what, " is ", value, "; it must be between ", low, " and ", high);
}

void check_finite_scale(const char* what, const std::optional<double>& value) {
  // Far beyond any useful scale, well inside float's range (a larger one fails in LibTorch's
  // float conversion, naming nothing).
  constexpr double kMaxGuidance = 1e4;
  if (value) {
    TORCH_CHECK(std::isfinite(*value) && std::abs(*value) <= kMaxGuidance, what, " is ", *value,
                "; it must be a finite number from ", -kMaxGuidance, " to ", kMaxGuidance);
  }
}

void check_finite_tensor(const std::string& what, const at::Tensor& tensor) {
  const std::string bad = nn::non_finite(tensor);
  TORCH_CHECK(bad.empty(), what, ": ", bad, "; they would make the image NaN (black)");
}

void check_finite_embeds(const std::optional<PromptEmbeds>& embeds, const std::string& what) {
  if (!embeds) return;
  check_finite_tensor(what, embeds->prompt_embeds);
  if (embeds->pooled_prompt_embeds) check_finite_tensor(what + ": pooled_prompt_embeds", *embeds->pooled_prompt_embeds);
}

}  // namespace

void check_request(const GenerateRequest& request) {
  if (request.num_inference_steps) {
    check_range("num_inference_steps (--steps)", *request.num_inference_steps, 1, kMaxInferenceSteps);
  }
  check_range("num_images_per_prompt (--num-images)", request.num_images_per_prompt, 1, kMaxImagesPerCall);
  check_range("max_sequence_length (--max-sequence-length)", request.max_sequence_length, 1, kMaxSequenceLength);
  if (request.height) check_range("height (--height)", *request.height, 1, kMaxImageSide);
  if (request.width) check_range("width (--width)", *request.width, 1, kMaxImageSide);
  TORCH_CHECK(!(request.prompt_embeds && !request.prompt.empty()),
              "give either prompts or prompt embeddings, not both");
  TORCH_CHECK(request.prompt_embeds || !request.prompt.empty(), "no prompt: give prompts or prompt embeddings");
  const int64_t prompts =
      request.prompt_embeds ? request.prompt_embeds->num_prompts() : static_cast<int64_t>(request.prompt.size());
  // Both factors are bounded above, so the product cannot overflow.
  TORCH_CHECK(prompts <= kMaxImagesPerCall && prompts * request.num_images_per_prompt <= kMaxImagesPerCall, prompts,
              " prompts x ", request.num_images_per_prompt, " images per prompt (--num-images) is more than ",
              kMaxImagesPerCall, " images in one call; split the work into several calls");
  check_finite_scale("guidance_scale (--guidance)", request.guidance_scale);
  check_finite_scale("true_cfg_scale (--true-cfg-scale)", request.true_cfg_scale);
  check_finite_embeds(request.prompt_embeds, "prompt_embeds");
  check_finite_embeds(request.negative_prompt_embeds, "negative_prompt_embeds");
  if (request.latents) check_finite_tensor("latents (--latents)", *request.latents);
  const auto images = static_cast<int64_t>(request.image.size());
  TORCH_CHECK(images <= kMaxReferenceImages, images, " reference images (--image) given; a call takes at most ",
              kMaxReferenceImages);
  for (int64_t i = 0; i < images; ++i) {
    const at::Tensor& image = request.image[static_cast<size_t>(i)];
    TORCH_CHECK(image.defined() && image.dim() == 3 && image.size(2) == 3 && image.scalar_type() == at::kByte,
                "reference image ", i, " (--image) must be 8-bit RGB pixels uint8 [H, W, 3], got ",
                image.defined() ? image.toString() : std::string("nothing"), " of shape ",
                image.defined() ? image.sizes() : c10::IntArrayRef{});
    check_range("reference image height", image.size(0), 1, io::kMaxInputImageSide);
    check_range("reference image width", image.size(1), 1, io::kMaxInputImageSide);
  }
  if (request.max_area) check_range("max_area (--max-area)", *request.max_area, 1, kMaxArea);
}

DiffusionPipeline::DiffusionPipeline(io::ModelFolder folder, const PipelineLoadOptions& options,
                                     const std::string& pipeline_class, const std::string& transformer_class)
    : folder_(std::move(folder)), options_(options) {
  TORCH_CHECK(folder_.is_pipeline(), folder_.root(), " has no model_index.json; give a diffusers pipeline folder");
  const auto listed = folder_.components();
  for (const char* name : {"transformer", "scheduler", "vae"}) {
    TORCH_CHECK(std::find(listed.begin(), listed.end(), name) != listed.end(), folder_.root(),
                "/model_index.json: the pipeline has no '", name, "' component; a ", pipeline_class,
                " folder needs transformer/, scheduler/ and vae/");
  }
  // Everything is opened before anything is loaded: a missing folder or file is named at once.
  const io::ComponentFolder transformer_folder = folder_.component("transformer");
  const io::ComponentFolder vae_folder = folder_.component("vae");
  TORCH_CHECK(transformer_folder.class_name() == transformer_class, transformer_folder.dir,
              "/config.json: _class_name is '", transformer_folder.class_name(), "', but a ", pipeline_class,
              " needs a ", transformer_class);
  TORCH_CHECK(!(options_.vae_parallel && options_.vae_tiling), pipeline_class,
              ": vae_parallel (--vae-parallel) and vae_tiling (--tiled-vae) do not combine; the parallel decode "
              "already splits the activations over the ranks: choose one");
  TORCH_CHECK(!(options_.vae_parallel && options_.load_vae == std::optional<bool>(false)), pipeline_class,
              ": vae_parallel needs the VAE on every rank, but load_vae is false here");
  vae_weights_ = vae_folder.weights();
  vae_model_ = models::create_vae(vae_folder);
  vae_scale_factor_ = vae_model_->vae_scale_factor();
  // The scheduler class model_index.json names, through the registry (it refuses other classes).
  const nlohmann::json& scheduler_entry = folder_.model_index().at("scheduler");
  scheduler_config_ =
      models::create_scheduler((std::filesystem::path(folder_.root()) / "scheduler").string(),
                               scheduler_entry.at(1).get<std::string>())
          .config();
  transformer_ = models::create_transformer(transformer_folder);
  transformer_weights_ = options_.transformer_file ? models::open_transformer_file(*options_.transformer_file,
                                                                                   transformer_class, *transformer_)
                                                   : transformer_folder.weights();
  TORCH_INTERNAL_ASSERT(dynamic_cast<models::JointTransformer2DModel*>(transformer_.get()) != nullptr, pipeline_class,
                        ": ", transformer_class, " is not a joint-stream transformer");
  // The adapter files are opened and checked against the transformer before any weight is read.
  adapter_files_ = models::open_lora_files(options_.lora, *transformer_);

  const parallel::ParallelLayout& layout = options_.parallel;
  TORCH_CHECK(layout.mesh || layout.dims.product() == 1, pipeline_class, ": PipelineLoadOptions::parallel has the "
              "degrees ", layout.dims.to_string(), " but no mesh; make it with ParallelDims::build(world)");
  transformer_parallel_ = layout.tensor_parallel();
  if (layout.mesh && layout.dims.cfg == 2) cfg_group_ = layout.mesh->group("cfg");
}

models::JointTransformer2DModel& DiffusionPipeline::joint_transformer() const {
  return static_cast<models::JointTransformer2DModel&>(*transformer_);
}

parallel::ParallelDims DiffusionPipeline::parallel_dims() const {
  parallel::ParallelDims dims = options_.parallel.dims;
  if (transformer_->resolved_plan() != nullptr) dims.tp = transformer_->tp_degree();
  return dims;
}

void DiffusionPipeline::check_parallel() const {
  TORCH_CHECK(options_.parallel.dims.cfg == 1 || supports_cfg(), class_name(),
              ": CFG-parallel (cfg 2, --cfg-parallel) runs the conditional and unconditional branches of "
              "classifier-free guidance on the two halves of the mesh, but this pipeline runs no CFG (",
              cfg_condition(), "); drop --cfg-parallel");
  if (transformer_parallel_ && !transformer_->resolved_plan()) {
    parallel::check_split(*transformer_, options_.parallel.dims, dist::World::get().size(),
                          class_name() + "'s transformer", supports_cfg(), options_.dtype);
  }
}

at::Tensor DiffusionPipeline::guided(
    bool do_cfg, const std::function<at::Tensor(bool conditional)>& branch,
    const std::function<at::Tensor(const at::Tensor& cond, const at::Tensor& uncond)>& combine) const {
  if (!do_cfg) {
    TORCH_INTERNAL_ASSERT(!cfg_group_, "CFG-parallel on a request without CFG (check() refuses it)");
    return branch(true);
  }
  if (!cfg_group_) {
    const at::Tensor cond = branch(true);
    return combine(cond, branch(false));
  }
  // This half's branch, then both: [2, ...] with the conditional prediction first (cfg index 0).
  const at::Tensor mine = branch(cfg_group_->rank() == 0);
  const at::Tensor both = cfg_group_->all_gather(mine.unsqueeze(0).contiguous(), 0);
  return combine(both[0], both[1]);
}

const PromptEncoderRecipe& DiffusionPipeline::prompt_encoding() const {
  return pipeline_class(class_name(), "the pipeline class").prompt_encoder;
}

void DiffusionPipeline::load() {
  if (loaded_) return;
  check_parallel();
  dist::World& world = dist::World::get();
  // The ranks of one replica: consecutive blocks of cfg x ulysses x ring x tp (the mesh's layout).
  const int replica_size = options_.independent_replicas ? options_.parallel.dims.product() : world.size();
  TORCH_CHECK(replica_size >= 1 && world.size() % replica_size == 0, class_name(), ": replicas of ", replica_size,
              " ranks do not divide the world of ", world.size());
  TORCH_CHECK(replica_size == world.size() || !options_.vae_parallel, class_name(),
              ": a parallel VAE decode spans the world, so it cannot serve independent replicas (",
              world.size() / replica_size, " of ", replica_size, " ranks); drop --vae-parallel");
  replica_group_ = world.group();
  if (replica_size < world.size()) {
    for (int first = 0; first < world.size(); first += replica_size) {
      std::vector<int> ranks(static_cast<size_t>(replica_size));
      std::iota(ranks.begin(), ranks.end(), first);
      std::shared_ptr<dist::Group> group = world.new_group(ranks);
      if (group) replica_group_ = group;
    }
  }
  parallel::LoadOptions load;
  load.dtype = options_.dtype;
  load.device = options_.device;
  load.tensor_parallel = transformer_parallel_;
  load.weights = options_.weights;
  load.int8_compute = options_.int8_compute;
  // Refused before the text encoders load, not after them.
  if (load.int8_compute) nn::check_int8_compute(load.weights, load.device);
  // The text encoders first: their degree (--text-encoder-tp) is checked before any weight is read,
  // rather than after the (larger) transformer has loaded.
  if (!prompt_encoder_ && options_.load_text_encoders && has_prompt_encoder_components(folder_, prompt_encoding())) {
    TextEncoderLoadOptions text;
    text.dtype = options_.dtype;
    text.device = options_.device;
    text.tp_degree = options_.text_encoder_tp;
    text.transformer_tp_degree = options_.parallel.dims.tp;
    text.replica_size = replica_size;
    prompt_encoder_ = load_prompt_encoder(folder_, class_name(), prompt_encoding(), text);
  }
  transformer_->load(transformer_weights_, load);
  lora_ = std::make_unique<parallel::LoraAdapters>(*transformer_);
  if (!adapter_files_.empty()) {
    models::load_lora_files(*lora_, adapter_files_, options_.lora_scale, options_.fuse_lora);
    adapter_files_.clear();  // read: the files need not stay mapped
  }
  if (options_.parallel.dims.ulysses > 1 || options_.parallel.dims.ring > 1) {
    // The transformer's sequence is split over the mesh's "ulysses" and "ring" dimensions.
    transformer_->enable_context_parallelism(parallel::ContextParallelConfig(*options_.parallel.mesh));
  }
  if (options_.vae_parallel || options_.load_vae.value_or(world.rank() % replica_size == 0)) {
    parallel::LoadOptions vae_load;  // replicated: no parallel config
    vae_load.dtype = options_.dtype;
    vae_load.device = options_.device;
    vae_model_->load(vae_weights_, vae_load);
    if (options_.vae_tiling) vae_model_->enable_tiling();
    if (options_.vae_parallel) {
      // Every rank ends the denoising loop with the same latents (tp, cfg, context-parallel and
      // replica ranks alike), so the whole world decodes together.
      vae_model_->enable_parallel_decode(dist::World::get().group());
    }
    vae_ = vae_model_;
  }
  loaded_ = true;
}

parallel::LoraAdapters& DiffusionPipeline::lora_adapters() {
  TORCH_CHECK(lora_ != nullptr, class_name(), ": load() the pipeline before its LoRA adapters");
  return *lora_;
}

void DiffusionPipeline::load_lora_weights(const std::vector<models::LoraRequest>& requests, double lora_scale,
                                          bool fuse) {
  parallel::LoraAdapters& adapters = lora_adapters();
  models::load_lora_files(adapters, models::open_lora_files(requests, *transformer_), lora_scale, fuse);
}

void DiffusionPipeline::check(const GenerateRequest& request) const {
  check_request(request);
  check_parallel();
  if (request.cache) joint_transformer().check_cache_config(*request.cache);
  TORCH_CHECK(!cfg_group_ || runs_cfg(request), class_name(),
              ": CFG-parallel (cfg 2, --cfg-parallel) runs the conditional and unconditional branches of "
              "classifier-free guidance on the two halves of the mesh, but this request runs no CFG (",
              cfg_condition(), "); drop --cfg-parallel, or ask for CFG");
  TORCH_CHECK(takes_negative_prompt() || !has_negative_prompt(request), class_name(),
              " takes no negative prompt (", cfg_condition(), "); drop --negative-prompt / negative_prompt_embeds");
  const auto [height, width] = resolve_size(request, /*note=*/false);
  const int64_t h = height / (vae_scale_factor_ * 2);
  const int64_t w = width / (vae_scale_factor_ * 2);
  // The schedule of this size (a few numbers), made now: where the size's shift overflows the
  // schedule's float32 arithmetic (as it does in diffusers' numpy, exp(mu) past 3.4e38), the size
  // is refused by its numbers before anything is allocated.
  const int64_t steps = request.num_inference_steps.value_or(call_defaults().num_inference_steps);
  try {
    make_scheduler(steps, scheduler_mu(h * w, steps));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, class_name(), ": a ", height, "x", width, " image is ", h * w,
                " latent tokens, and the scheduler has no schedule for that many: ", e.msg(),
                "; choose a smaller size");
  }
  int64_t num_prompts = static_cast<int64_t>(request.prompt.size());
  if (request.prompt_embeds) {
    check_prompt_embeds(*request.prompt_embeds, joint_attention_dim(), pooled_projection_dim(), "prompt_embeds");
    num_prompts = request.prompt_embeds->num_prompts();
  }
  if (!request.prompt_embeds && !request.prompt.empty() && !prompt_encoder_) {
    TORCH_CHECK(options_.load_text_encoders && has_prompt_encoder_components(folder_, prompt_encoding()), folder_.root(),
                ": prompts given as text, but the ", class_name(),
                " has no text encoder to encode them (model_index.json needs its tokenizer and text_encoder "
                "components, or pass prompt embeddings instead)");
  }
  if (request.negative_prompt_embeds) {
    check_prompt_embeds(*request.negative_prompt_embeds, joint_attention_dim(), pooled_projection_dim(),
                        "negative_prompt_embeds");
  }
  if (request.latents) {
    check_given_latents(*request.latents, latents_shape(num_prompts * request.num_images_per_prompt, h, w),
                        latents_layout());
  }
  const auto images = static_cast<int64_t>(request.image.size());
  TORCH_CHECK(images == 0 || max_reference_images() > 0, class_name(),
              " takes no reference images (--image): it generates from text only; edit with a FLUX.2 folder "
              "(Flux2KleinPipeline, Flux2Pipeline), a Qwen-Image-Edit folder (QwenImageEditPlusPipeline, "
              "QwenImageEditPipeline) or a FLUX.1 folder as FluxKontextPipeline (--pipeline FluxKontextPipeline)");
  TORCH_CHECK(images <= max_reference_images(), class_name(), " takes at most ", max_reference_images(),
              " reference images (--image), got ", images);
  if (images > 0) check_reference_images(request, num_prompts * request.num_images_per_prompt);
  TORCH_CHECK(!request.max_area || takes_max_area(), class_name(),
              " takes no max_area (--max-area): only FluxKontextPipeline and the Qwen-Image edit pipelines size their "
              "images by an area");
}

ReferenceTokens DiffusionPipeline::reference_tokens(const GenerateRequest& request, int64_t /*batch*/) const {
  TORCH_CHECK(request.image.empty(), class_name(), " takes no reference images");
  return {};
}

void DiffusionPipeline::check_reference_images(const GenerateRequest& /*request*/, int64_t /*batch*/) const {}

at::Tensor DiffusionPipeline::encode_image_latents(const at::Tensor& image) const {
  const std::shared_ptr<dist::Group>& world = replica_group_ ? replica_group_ : dist::World::get().group();
  const auto encode_here = [&] {
    TORCH_CHECK(vae_ != nullptr && vae_->has_encoder(), class_name(), ": the VAE (", folder_.root(),
                "/vae) has no encoder to encode reference images");
    // The VAE is loaded in the pipeline's dtype on its device.
    const at::Tensor z = vae_->encode(image.to(options_.device, options_.dtype));
    at::Tensor latents = vae_->normalize_latents(z);
    if (latents.dim() == 5) latents = latents.select(2, 0);  // Qwen-Image's one frame: [1, C, 1, h, w] -> [1, C, h, w]
    return latents.to(at::kFloat).to(at::kCPU).contiguous();
  };
  // Under a parallel decode every rank holds the VAE and encodes its band of the rows together
  // with the others; alone, this rank encodes.
  if (options_.vae_parallel || world->size() == 1) return encode_here();

  // Otherwise the ranks that load the VAE (world rank 0 by default) encode, and the lowest of them
  // sends the latents to every rank: the transformer's ranks all need the reference tokens.
  at::Tensor has_vae = at::full({1}, vae_ != nullptr ? 1 : 0, at::kLong);
  const at::Tensor holders = world->all_gather(has_vae, 0);  // [world size]
  const at::Tensor first = holders.nonzero();
  TORCH_CHECK(first.numel() > 0, class_name(), ": no rank loads the VAE (load_vae false everywhere), so no rank can "
              "encode the reference images");
  const int root = static_cast<int>(first[0][0].item<int64_t>());
  at::Tensor latents;
  if (world->rank() == root) latents = encode_here();
  // The shape first ([1, C, h, w]), then the values, both from the root.
  at::Tensor shape = world->rank() == root ? at::tensor(latents.sizes().vec(), at::kLong) : at::zeros({4}, at::kLong);
  world->broadcast(shape, root);
  if (world->rank() != root) {
    latents = at::empty(std::vector<int64_t>(shape.data_ptr<int64_t>(), shape.data_ptr<int64_t>() + 4), at::kFloat);
  }
  world->broadcast(latents, root);
  return latents;
}

GenerateResult DiffusionPipeline::generate(const GenerateRequest& request) {
  TORCH_CHECK(loaded_, class_name(), ": load() the weights before generate()");
  check(request);
  PreparedRequest call = prepare(request);
  // The request's step cache for this call only; without one, the transformer's own (if any).
  models::JointTransformer2DModel& model = joint_transformer();
  std::optional<models::StepCacheConfig> standing;
  if (model.step_cache() != nullptr) standing = model.step_cache()->config();
  if (request.cache) model.enable_cache(*request.cache);
  const auto restore = c10::make_scope_exit([&model, &standing, &request] {
    if (!request.cache) return;
    if (standing) {
      model.enable_cache(*standing);
    } else {
      model.disable_cache();
    }
  });
  if (model.step_cache() != nullptr) model.step_cache()->reset();
  GenerateResult result = generate_prepared(call, request);
  if (model.step_cache() != nullptr) report_cache(*model.step_cache(), call, result);
  return result;
}

void DiffusionPipeline::report_cache(const models::StepCache& cache, const PreparedRequest& call,
                                     GenerateResult& result) const {
  const int64_t steps = call.num_inference_steps;
  const std::vector<models::CacheContextRecord> records = cache.records();
  // One forward per step in each context this rank ran: "cond", and "uncond" with CFG (under
  // CFG-parallel, only this half's).
  const size_t expected = call.do_cfg && !cfg_group_ ? 2 : 1;
  TORCH_INTERNAL_ASSERT(records.size() == expected, class_name(), ": the step cache saw ", records.size(),
                        " contexts, expected ", expected);
  const auto columns = static_cast<int64_t>(records.size());
  at::Tensor computed = at::zeros({steps, columns}, at::kLong);
  at::Tensor ratio = at::full({steps, columns}, std::numeric_limits<double>::quiet_NaN(), at::kDouble);
  for (int64_t c = 0; c < columns; ++c) {
    const models::CacheContextRecord& record = records[static_cast<size_t>(c)];
    TORCH_INTERNAL_ASSERT(static_cast<int64_t>(record.computed.size()) == steps, class_name(), ": context ",
                          record.context, " has ", record.computed.size(), " cache decisions for ", steps, " steps");
    for (int64_t i = 0; i < steps; ++i) {
      computed[i][c] = static_cast<int64_t>(record.computed[static_cast<size_t>(i)]);
      if (!record.ratios.empty()) ratio[i][c] = record.ratios[static_cast<size_t>(i)];
    }
  }
  if (cfg_group_) {
    // Each half decided its own branch: [steps, 2], the conditional column first (cfg index 0).
    computed = cfg_group_->all_gather(computed, 1);
    ratio = cfg_group_->all_gather(ratio, 1);
  }
  result.cache = cache.config();
  result.cache_contexts = call.do_cfg ? std::vector<std::string>{"cond", "uncond"} : std::vector<std::string>{"cond"};
  result.cache_computed = computed;
  if (cache.first_block()) result.cache_ratio = ratio;
  result.cache_state_bytes = cache.state_bytes();
}

PreparedRequest DiffusionPipeline::prepare(const GenerateRequest& request) const {
  PreparedRequest call;
  std::tie(call.height, call.width) = resolve_size(request, request.notes);
  const CallDefaults defaults = call_defaults();
  call.num_inference_steps = request.num_inference_steps.value_or(defaults.num_inference_steps);
  call.guidance_scale = request.guidance_scale.value_or(defaults.guidance_scale);
  call.true_cfg_scale = request.true_cfg_scale.value_or(defaults.true_cfg_scale);
  call.do_cfg = runs_cfg(request);
  const int64_t n = request.num_images_per_prompt;

  const PromptEmbeds positive = positive_embeds(request);
  const int64_t num_prompts = positive.num_prompts();
  const std::optional<PromptEmbeds> negative = call_negative_embeds(request, call, num_prompts);
  TORCH_INTERNAL_ASSERT(!call.do_cfg || negative.has_value(), class_name(), ": CFG without negative embeddings");

  // The latent token grid: the VAE's latent is (H/8, W/8), its 2x2 patches (H/16, W/16) tokens.
  call.h = call.height / (vae_scale_factor_ * 2);
  call.w = call.width / (vae_scale_factor_ * 2);
  call.batch = num_prompts * n;
  // [B, N, C4], contiguous: a product's kernel (and its rounding) may follow its input's layout,
  // and generate_batch's concatenated latents are contiguous too.
  call.latents = prepare_latents(request, call.batch, call.h, call.w).contiguous();
  call.references = reference_tokens(request, call.batch);
  if (call.references.defined()) {
    call.references.latents = call.references.latents.to(call.device(), call.dtype());
    call.references.ids = call.references.ids.to(call.device());
  }
  call.cond = repeat_prompt_embeds(positive, n, call.dtype(), call.device());
  if (call.do_cfg) call.uncond = repeat_prompt_embeds(*negative, n, call.dtype(), call.device());
  call.scheduler = make_scheduler(call.num_inference_steps, scheduler_mu(call.h * call.w, call.num_inference_steps));
  return call;
}

std::optional<PromptEmbeds> DiffusionPipeline::call_negative_embeds(const GenerateRequest& request,
                                                                    const PreparedRequest& /*call*/,
                                                                    int64_t num_prompts) const {
  return negative_embeds(request, num_prompts);
}

double DiffusionPipeline::scheduler_mu(int64_t image_seq_len, int64_t /*steps*/) const {
  return calculate_shift(image_seq_len);
}

at::Tensor DiffusionPipeline::packed_noise_latents(const GenerateRequest& request, int64_t batch, int64_t h,
                                                   int64_t w) const {
  if (request.latents) return initial_latents(request, batch, h, w);
  const int64_t channels = latents_shape(batch, h, w).back() / 4;
  return pack_latents_2x2(seeded_noise({batch, channels, 2 * h, 2 * w}, request.seed));  // [B, N, 4C]
}

at::Tensor DiffusionPipeline::initial_latents(const GenerateRequest& request, int64_t batch, int64_t h,
                                              int64_t w) const {
  const std::vector<int64_t> shape = latents_shape(batch, h, w);
  if (request.latents) {
    check_given_latents(*request.latents, shape, latents_layout());
    return *request.latents;
  }
  return seeded_noise(shape, request.seed);
}

std::pair<int64_t, int64_t> DiffusionPipeline::requested_size(const GenerateRequest& request) const {
  return {request.height.value_or(default_size()), request.width.value_or(default_size())};
}

std::pair<int64_t, int64_t> DiffusionPipeline::resolve_size(const GenerateRequest& request, bool note) const {
  const int64_t multiple = vae_scale_factor_ * 2;
  const auto [height, width] = requested_size(request);
  const int64_t rounded_height = height / multiple * multiple;
  const int64_t rounded_width = width / multiple * multiple;
  TORCH_CHECK(rounded_height > 0 && rounded_width > 0, class_name(), ": an image of ", height, "x", width,
              " (height x width) is too small: both sides must be at least ", multiple,
              " pixels (2 x the VAE's scale factor ", vae_scale_factor_, ")");
  if (note && (rounded_height != height || rounded_width != width) && dist::World::get().rank() == 0) {
    shardit::note(fmt::format("height and width must be multiples of {}; {}x{} is resized to {}x{}", multiple, height,
                              width, rounded_height, rounded_width));
  }
  return {rounded_height, rounded_width};
}

std::optional<PromptEmbeds> DiffusionPipeline::embeds_for(const std::optional<PromptEmbeds>& given,
                                                          const std::vector<std::string>& prompts,
                                                          int64_t max_sequence_length, const char* what,
                                                          const std::vector<at::Tensor>& images) const {
  if (given) return given;
  if (prompts.empty()) return std::nullopt;
  TORCH_CHECK(prompt_encoder_ != nullptr, class_name(), ": ", what,
              " given as text, but this pipeline has no prompt encoder; pass prompt embeddings "
              "(--prompt-embeds) instead");
  if (!images.empty()) return prompt_encoder_->encode(prompts, images, max_sequence_length);
  return prompt_encoder_->encode(prompts, max_sequence_length);
}

std::vector<at::Tensor> DiffusionPipeline::prompt_images(const GenerateRequest& /*request*/) const { return {}; }

PromptEmbeds DiffusionPipeline::positive_embeds(const GenerateRequest& request) const {
  const PromptEmbeds embeds = *embeds_for(request.prompt_embeds, request.prompt, request.max_sequence_length, "prompt",
                                          request.prompt_embeds ? std::vector<at::Tensor>{} : prompt_images(request));
  check_prompt_embeds(embeds, joint_attention_dim(), pooled_projection_dim(), "prompt_embeds");
  return embeds;
}

std::optional<PromptEmbeds> DiffusionPipeline::negative_embeds(const GenerateRequest& request, int64_t num_prompts,
                                                               const std::optional<std::string>& default_prompt) const {
  std::vector<std::string> prompts = negative_prompts_for(request.negative_prompt, num_prompts);
  if (prompts.empty() && default_prompt) prompts.assign(static_cast<size_t>(num_prompts), *default_prompt);
  // diffusers encodes the negative prompt with the same images as the prompt.
  const auto embeds = embeds_for(request.negative_prompt_embeds, prompts, request.max_sequence_length,
                                 "negative prompt",
                                 request.negative_prompt_embeds || prompts.empty() ? std::vector<at::Tensor>{}
                                                                                   : prompt_images(request));
  if (embeds) {
    check_prompt_embeds(*embeds, joint_attention_dim(), pooled_projection_dim(), "negative_prompt_embeds");
    TORCH_CHECK(embeds->num_prompts() == num_prompts, "negative_prompt_embeds has ", embeds->num_prompts(),
                " rows for ", num_prompts, " prompts");
  }
  return embeds;
}

GenerateResult DiffusionPipeline::make_result(const at::Tensor& latents, const PreparedRequest& call, double guidance) {
  GenerateResult result;
  result.latents = latents.to(at::kCPU, at::kFloat);
  result.height = call.height;
  result.width = call.width;
  result.num_inference_steps = call.num_inference_steps;
  result.guidance = guidance;
  result.cfg = call.do_cfg;
  return result;
}

double DiffusionPipeline::calculate_shift(int64_t image_seq_len) const {
  return schedulers::calculate_shift(image_seq_len, scheduler_config_.base_image_seq_len,
                                     scheduler_config_.max_image_seq_len, scheduler_config_.base_shift,
                                     scheduler_config_.max_shift);
}

schedulers::FlowMatchEulerDiscreteScheduler DiffusionPipeline::make_scheduler(int64_t steps, double mu) const {
  schedulers::FlowMatchEulerDiscreteScheduler scheduler(scheduler_config_);
  scheduler.set_timesteps(steps, schedulers::pipeline_sigmas(steps), mu);
  scheduler.set_begin_index(0);
  return scheduler;
}

at::Tensor DiffusionPipeline::denoise(PreparedRequest& call, const GenerateRequest& request,
                                      const TransformerCall& transformer, const CfgCombine& combine) const {
  schedulers::FlowMatchEulerDiscreteScheduler& scheduler = call.scheduler;
  const at::Tensor timesteps = scheduler.timesteps();
  const int64_t steps = timesteps.size(0);
  at::Tensor latents = call.latents;
  if (request.on_progress) request.on_progress(0, steps);
  for (int64_t i = 0; i < steps; ++i) {
    const float t = timesteps[i].item<float>();
    // The pipelines pass t.expand(B).to(latents.dtype) / 1000.
    const at::Tensor timestep = at::full({latents.size(0)}, t, at::TensorOptions().dtype(at::kFloat))
                                    .to(latents.scalar_type())
                                    .div(1000)
                                    .to(latents.device());
    const at::Tensor noise_pred = guided(
        call.do_cfg,
        [&](bool conditional) {
          // Each CFG branch has its own cache state, as diffusers' pipelines' cache_context.
          if (models::StepCache* cache = joint_transformer().step_cache()) {
            cache->set_context(conditional ? "cond" : "uncond");
          }
          return transformer(conditional ? call.cond : *call.uncond, latents, timestep);
        },
        combine);
    latents = scheduler.step(noise_pred, t, latents);
    if (request.callback_on_step_end) request.callback_on_step_end(i, latents);
    if (request.on_progress) request.on_progress(i + 1, steps);
  }
  return latents;
}

at::Tensor DiffusionPipeline::decode_image(const at::Tensor& vae_latents) const {
  TORCH_INTERNAL_ASSERT(vae_ != nullptr);
  const at::Tensor z = vae_->denormalize_latents(vae_latents);
  at::Tensor sample;
  if (nn::SamplewiseProducts::active() && z.size(0) > 1) {
    // Each image decoded alone, as it would be without the others (a convolution's kernel may
    // depend on the batch).
    std::vector<at::Tensor> images;
    for (int64_t i = 0; i < z.size(0); ++i) images.push_back(vae_->decode(z.narrow(0, i, 1)));
    sample = at::cat(images, 0);
  } else {
    sample = vae_->decode(z);
  }
  if (sample.dim() == 5) sample = sample.select(2, 0);  // [B, 3, 1, H, W] -> [B, 3, H, W]
  // NaN would become black pixels after the clamp and the cast: a silent wrong image.
  const std::string bad = nn::non_finite(sample);
  TORCH_CHECK(bad.empty(), class_name(), ": the decoded image is not finite (", bad, "): a weight of the "
              "transformer or the VAE, or an input, holds NaN or infinite values; no image is written");
  // VaeImageProcessor.postprocess(output_type="np"): [-1, 1] -> [0, 1], NCHW -> NHWC.
  return (sample.to(at::kFloat) / 2 + 0.5).clamp(0, 1).permute({0, 2, 3, 1}).contiguous().to(at::kCPU);
}

}  // namespace shardit::pipelines

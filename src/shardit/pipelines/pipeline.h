#pragma once
// What the three text-to-image pipelines share (diffusers' DiffusionPipeline role): loading a
// pipeline folder with each component under its own parallel config, the start of every call
// (defaults, size, prompt embeddings given directly or made by a PromptEncoder, the CFG decision,
// seeded latents, the scheduler), the denoising loop, and decoding to an image on the ranks that
// hold a VAE. Each family (pipeline_flux, ...) adds what its diffusers __call__ does differently.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/models/joint_transformer.h"
#include "shardit/models/lora_formats.h"
#include "shardit/models/step_cache.h"
#include "shardit/models/vae/vae.h"
#include "shardit/nn/quantized_weight.h"
#include "shardit/parallel/lora.h"
#include "shardit/parallel/parallel_dims.h"
#include "shardit/parallel/tensor_parallel.h"
#include "shardit/schedulers/scheduling_flow_match_euler_discrete.h"

namespace shardit::pipelines {

/// The text conditioning of a batch of prompts, as the transformer takes it (one row per prompt;
/// the pipeline repeats each row num_images_per_prompt times).
struct PromptEmbeds {
  at::Tensor prompt_embeds;                        ///< [P, L, joint_attention_dim], floating
  std::optional<at::Tensor> pooled_prompt_embeds;  ///< [P, pooled_projection_dim] (FLUX.1)
  std::optional<at::Tensor> prompt_embeds_mask;    ///< [P, L], 1 = valid token (Qwen-Image); none: all valid

  int64_t num_prompts() const { return prompt_embeds.defined() ? prompt_embeds.size(0) : 0; }
};

/// Reads prompt embeddings from a safetensors file under the pipelines' names: `prompt_embeds`,
/// `pooled_prompt_embeds`, `prompt_embeds_mask`, each with the prefix `negative_` for the
/// negative prompt (`prefix` is "" or "negative_"). nullopt when `<prefix>prompt_embeds` is absent.
std::optional<PromptEmbeds> read_prompt_embeds(const std::string& path, const std::string& prefix = "");

struct PromptEncoderRecipe;

/// Turns prompts into PromptEmbeds for one pipeline family: what the text encoders provide
/// (CLIP + T5 for FLUX.1, Qwen3 for FLUX.2 klein, Qwen2.5-VL for Qwen-Image), tokenizing and
/// templating included.
class PromptEncoder {
 public:
  virtual ~PromptEncoder() = default;
  /// One row per prompt, as the pipeline's encode_prompt with num_images_per_prompt = 1.
  virtual PromptEmbeds encode(const std::vector<std::string>& prompts, int64_t max_sequence_length) = 0;
  /// The same for prompts that see images (the Qwen-Image edit pipelines: Qwen2.5-VL with its
  /// vision tower reads each prompt with `images`, uint8 [H, W, 3] each, as the pipeline prepared
  /// them for the text encoder). By default the images are refused: the encoder reads text only.
  virtual PromptEmbeds encode(const std::vector<std::string>& prompts, const std::vector<at::Tensor>& images,
                              int64_t max_sequence_length);
};

/// The arguments of a pipeline call (diffusers' __call__), with the same meanings. Unset values
/// take the pipeline's defaults.
struct GenerateRequest {
  std::vector<std::string> prompt;            ///< encoded by the pipeline's PromptEncoder
  std::vector<std::string> negative_prompt;   ///< one, or one per prompt
  std::optional<PromptEmbeds> prompt_embeds;  ///< instead of `prompt`
  std::optional<PromptEmbeds> negative_prompt_embeds;
  std::optional<int64_t> height;  ///< pixels; rounded down to a multiple of 2 * vae_scale_factor
  std::optional<int64_t> width;
  std::optional<int64_t> num_inference_steps;
  std::optional<double> guidance_scale;  ///< FLUX.1, FLUX.2 dev: embedded guidance; FLUX.2 klein: CFG scale
  std::optional<double> true_cfg_scale;  ///< FLUX.1 and Qwen-Image: CFG with the negative prompt
  int64_t num_images_per_prompt = 1;
  int64_t max_sequence_length = 512;
  uint64_t seed = 0;  ///< the CPU generator's seed (torch.Generator("cpu").manual_seed)
  /// The latents to start from, in the layout the pipeline's `latents=` takes (FLUX.1 and
  /// Qwen-Image packed [B, N, 4C], FLUX.2 [B, 4C, H/16, W/16]); none: drawn from `seed`.
  std::optional<at::Tensor> latents;
  /// Called after every step with the step index and the packed latents [B, N, C4].
  std::function<void(int64_t step, const at::Tensor& latents)> callback_on_step_end;
  /// Called on every rank as the loop starts (done 0) and after each step (after
  /// callback_on_step_end) with the steps done and the steps in all, for a progress display: the
  /// library draws none itself.
  std::function<void(int64_t done, int64_t total)> on_progress;
  /// Whether generate() says on stderr (rank 0) where it does not take the request as given (a
  /// size rounded down, true_cfg_scale without a negative prompt).
  bool notes = true;
  /// Step caching for this call (models/step_cache.h); none: whatever the transformer has on
  /// (transformer's enable_cache), by default nothing. Checked against the model by check().
  std::optional<models::StepCacheConfig> cache;
  /// Reference images for editing, uint8 [H, W, 3] RGB pixels each (io::read_image / decode_image
  /// give them). FLUX.2 ([klein] and [dev]): up to kMaxReferenceImages, each encoded to its own
  /// tokens after the noise tokens, the output size taken from the first unless given.
  /// FluxKontextPipeline: the image to edit (one for all images of the call, or one per prompt
  /// row as diffusers' batch). Pipelines without image input refuse them (check()).
  std::vector<at::Tensor> image;
  /// FluxKontextPipeline's max_area: the output's pixel area (default 1024²), the aspect of
  /// height x width kept. The Qwen-Image edit pipelines: the area their calculate_dimensions
  /// gives the VAE's images and the default output size (diffusers' fixed 1024²).
  std::optional<int64_t> max_area;
  /// FluxKontextPipeline's _auto_resize: the input image resized to the preferred Kontext
  /// resolution nearest in aspect (true, diffusers' default), or kept at its own size.
  bool auto_resize = true;
};

/// The most reference images one call takes (FLUX.2: the model's ten reference slots).
constexpr int64_t kMaxReferenceImages = 10;

/// The reference images of a call as the transformer takes them after the noise tokens: their
/// packed latents [B, M, C4] and position ids (the family's layout: FLUX.2 int64 [B, M, 4],
/// FLUX.1 Kontext float [M, 3]; Qwen-Image, whose RoPE takes grids, each image's img_shapes
/// entry (frames, rows, columns) as int64 [K, 3]). Undefined without reference images.
struct ReferenceTokens {
  at::Tensor latents;
  at::Tensor ids;
  bool defined() const { return latents.defined(); }
};

/// A pipeline family's values for what a request leaves unset (its diffusers __call__ defaults).
struct CallDefaults {
  int64_t num_inference_steps = 50;
  double guidance_scale = 1.0;
  double true_cfg_scale = 1.0;
};

/// A request as the shared start of DiffusionPipeline::generate() resolves it (diffusers' __call__
/// up to the denoising loop), for the family's rest of the call (generate_prepared).
struct PreparedRequest {
  int64_t height = 0;  ///< the image size in pixels, rounded to a multiple of 2 * vae_scale_factor
  int64_t width = 0;
  int64_t h = 0;  ///< the latent token grid: height / (2 * vae_scale_factor)
  int64_t w = 0;
  int64_t batch = 0;  ///< prompts x num_images_per_prompt
  int64_t num_inference_steps = 0;
  double guidance_scale = 0;  ///< the request's, or the family's default
  double true_cfg_scale = 0;
  bool do_cfg = false;  ///< runs_cfg(request)
  /// The prompts' embeddings, each row num_images_per_prompt times, on the latents' device and dtype.
  PromptEmbeds cond;
  /// The negative prompts' likewise; only with CFG.
  std::optional<PromptEmbeds> uncond;
  /// The initial latents as tokens [B, N, C4] on the transformer's device, in its dtype.
  at::Tensor latents;
  /// The reference images' tokens and ids (reference_tokens()); undefined without images.
  ReferenceTokens references;
  /// Set for num_inference_steps with the family's mu.
  schedulers::FlowMatchEulerDiscreteScheduler scheduler{schedulers::FlowMatchEulerDiscreteSchedulerConfig{}};
  /// The transformer's device and dtype (the latents').
  at::Device device() const { return latents.device(); }
  at::ScalarType dtype() const { return latents.scalar_type(); }
};

/// What a call returns.
struct GenerateResult {
  at::Tensor image;    ///< float32 [B, H, W, 3] in [0, 1]; undefined on ranks without a VAE (see vae_parallel)
  at::Tensor latents;  ///< the final packed latents [B, N, C4], float32
  int64_t height = 0;  ///< the (possibly rounded) image size
  int64_t width = 0;
  int64_t num_inference_steps = 0;
  double guidance = 0;  ///< the guidance (or true-CFG) scale used
  bool cfg = false;     ///< whether a negative prediction was combined
  /// With a step cache: its config, and per step and cache context ("cond", then "uncond" with
  /// CFG), whether the transformer ran its whole stack (int64 [steps, contexts], 1 or 0), the
  /// same on every rank; First-Block Cache also the ratio it compared (float64, NaN where there
  /// was none). Undefined without a cache.
  std::optional<models::StepCacheConfig> cache;
  std::vector<std::string> cache_contexts;
  at::Tensor cache_computed;
  at::Tensor cache_ratio;
  int64_t cache_state_bytes = 0;  ///< what the cache held at the end, on this rank
  /// generate_batch() only: the notes (core/notes.h) that preparing this request emitted (a
  /// prompt truncated, a size rounded), taken out of the caller's notes so that each request
  /// gets its own; the notes of the batch's shared loop go to the caller as usual.
  std::vector<std::string> notes;
};

/// How a pipeline folder is loaded: each component gets its own parallel config.
struct PipelineLoadOptions {
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  /// How the ranks are laid out for the transformer (parallel::ParallelDims::build): the
  /// transformer is sharded over the mesh's "tp" dimension, its sequence split over "ulysses" and
  /// "ring", and with a "cfg" dimension of 2 the conditional and unconditional branches of
  /// classifier-free guidance run on its two halves (DiffusionPipeline::guided). Default: one
  /// rank, the transformer loaded whole (shard it later with transformer()->enable_parallelism).
  parallel::ParallelLayout parallel;
  /// Whether this rank loads the (replicated) VAE and decodes; nullopt: world rank 0 only.
  std::optional<bool> load_vae;
  /// Decode in tiles (diffusers' vae.enable_tiling()).
  bool vae_tiling = false;
  /// Decode on all ranks of the world together (they all end the denoising loop with the same
  /// latents), each holding a band of the rows (AutoencoderModel::
  /// enable_parallel_decode): they all load the VAE, and the image is on each of them. Not with
  /// vae_tiling, nor with load_vae false.
  bool vae_parallel = false;
  /// Whether load() also loads the folder's tokenizers and text encoders as the PromptEncoder
  /// (when the folder has them and none was set with set_prompt_encoder).
  bool load_text_encoders = true;
  /// The text encoders' tensor-parallel degree; nullopt: the largest divisor of the world their
  /// heads allow (a note is printed when it differs from the transformer's).
  std::optional<int> text_encoder_tp;
  /// LoRA adapters load() puts on the transformer after its weights (diffusers'
  /// load_lora_weights): each named as its request says (by default after its file) and active at
  /// its weight, in this order. The files are opened and checked by open(), before any weight.
  std::vector<models::LoraRequest> lora;
  /// The runtime scale multiplying every adapter (diffusers' `scale` attention kwarg); with
  /// fuse_lora, the lora_scale of the merge.
  double lora_scale = 1.0;
  /// Merge the adapters into the weights once, at load (diffusers' fuse_lora): the steps then cost
  /// what the base model's cost.
  bool fuse_lora = false;
  /// The pipeline class to build instead of the one model_index.json names (`--pipeline`), as
  /// diffusers' `FluxKontextPipeline.from_pretrained(flux1_folder)`: it must take the folder's
  /// transformer class (FluxPipeline and FluxKontextPipeline share FLUX.1's).
  std::optional<std::string> pipeline_class;
  /// The transformer's weights from this single file instead of the folder's transformer/
  /// (diffusers' `from_pretrained(folder, transformer=Model.from_single_file(file))`): its layout
  /// (BFL, ComfyUI, FP8) detected and mapped by the class's registry row
  /// (models::open_transformer_file); the config, and every other component, from the folder.
  std::optional<std::string> transformer_file;
  /// Whether the mesh's replicas (a world larger than cfg x ulysses x ring x tp) run different
  /// requests, as `serve` runs them: each replica then also encodes prompts on its own ranks (the
  /// text encoders' degree divides the replica's size), its first rank loads the VAE (unless
  /// load_vae says otherwise) and reference images are shared within it (replica_group()). Not
  /// with vae_parallel. Otherwise every replica computes the same image.
  bool independent_replicas = false;
  /// The transformer's Linears in 8 bits (parallel::LoadOptions::weights; docs/quantization.md).
  /// The text encoders and the VAE load in `dtype`.
  nn::WeightsDtype weights = nn::WeightsDtype::Checkpoint;
  /// The transformer's int8 Linears multiply in int8 (parallel::LoadOptions::int8_compute); needs
  /// weights = Int8.
  bool int8_compute = false;
};

/// A text-to-image pipeline: open(), load(), then generate().
class DiffusionPipeline {
 public:
  virtual ~DiffusionPipeline() = default;
  /// Opens a diffusers pipeline folder and builds the pipeline its model_index.json names (or
  /// options.pipeline_class), from the table of pipeline classes (auto_pipeline.h), weights not
  /// yet loaded (see load()). Every component the pipeline needs is checked to be there (named
  /// when missing). Defined with that table, in auto_pipeline.cpp.
  static std::unique_ptr<DiffusionPipeline> open(const std::string& path, const PipelineLoadOptions& options = {});
  /// open() then load().
  static std::unique_ptr<DiffusionPipeline> from_pretrained(const std::string& path,
                                                            const PipelineLoadOptions& options = {});
  /// Loads the weights: the transformer over options.parallel's mesh with its LoRA adapters
  /// (options.lora), the VAE (replicated) on the ranks that decode, and the text encoders (see
  /// PipelineLoadOptions::load_text_encoders). Does nothing the second time.
  void load();
  bool loaded() const { return loaded_; }

  /// The pipeline class ("FluxPipeline").
  virtual std::string class_name() const = 0;
  /// Its prompt encoding: the row of class_name() in the pipeline table (auto_pipeline.h).
  const PromptEncoderRecipe& prompt_encoding() const;
  /// Checks a request against the pipeline's components without loading or computing anything:
  /// steps, sizes, the prompt embeddings' widths and dtypes, the latents' shape, and under
  /// CFG-parallel that the request runs CFG. generate() makes the same checks; call this first to
  /// fail before a long load.
  void check(const GenerateRequest& request) const;

  /// Runs the pipeline (after load()). Everything is checked (sizes, steps, embeddings, latents)
  /// before the first transformer call. Collective: every rank of the transformer's mesh calls it
  /// with the same request. The start of the call is shared (prepare()); the family's
  /// generate_prepared() runs the rest.
  GenerateResult generate(const GenerateRequest& request);

  /// After each step of a batch of generate_batch(), on every rank: the indices (into its
  /// requests) of the batch that runs, the steps done and in all. Returns whether to stop that
  /// batch now; it must return the same on every rank (a server broadcasts its decision).
  using BatchProgress = std::function<bool(const std::vector<size_t>& members, int64_t done, int64_t total)>;
  /// Runs several requests together where they can share one denoising loop (batched_generation.cpp; no diffusers
  /// counterpart: a server's batching of its clients' requests), each request's image bit for bit
  /// the one generate(request) gives under nn::SamplewiseProducts (which this call holds):
  /// prompts are encoded and noise drawn per request, the transformer and the VAE compute each
  /// sample alone. Requests are batched with the first earlier one that agrees in size, steps,
  /// guidance, the CFG decision and the shapes of the prompt embeddings (Qwen-Image's differ with
  /// the prompt's length); the batches run one after another. None may carry a step cache (its
  /// decision to skip a step is taken for the whole batch), reference images or callbacks. An
  /// entry is nullopt when `progress` stopped its batch. Collective like generate().
  std::vector<std::optional<GenerateResult>> generate_batch(const std::vector<GenerateRequest>& requests,
                                                             const BatchProgress& progress = {});

  /// Whether `request` runs classifier-free guidance (a negative prediction combined with the
  /// positive one at every step).
  virtual bool runs_cfg(const GenerateRequest& request) const = 0;
  /// When this pipeline runs CFG, in words, for errors ("... when true_cfg_scale > 1 and a
  /// negative prompt is given").
  virtual std::string cfg_condition() const = 0;
  /// Whether this pipeline can run CFG at all (FLUX.2 klein: not when distilled).
  virtual bool supports_cfg() const { return true; }
  /// Whether its __call__ has a negative_prompt at all (Flux2Pipeline: no); check() refuses one
  /// given to a pipeline without.
  virtual bool takes_negative_prompt() const { return true; }
  /// The degrees of the transformer's mesh: all 1 when loaded whole, tp as it is sharded.
  parallel::ParallelDims parallel_dims() const;

  /// The most reference images a call takes (GenerateRequest::image): 0 for text-to-image only.
  virtual int64_t max_reference_images() const { return 0; }
  /// Whether the pipeline takes GenerateRequest::max_area (FluxKontextPipeline, the Qwen-Image
  /// edit pipelines).
  virtual bool takes_max_area() const { return false; }
  /// Whether max_area is the output's area (FluxKontextPipeline: a served request's size sets
  /// it); the Qwen-Image edit pipelines' is the VAE images' area, whatever the output's size.
  virtual bool max_area_is_output_area() const { return false; }
  /// The images the prompts are encoded with (PromptEncoder::encode with images), prepared from
  /// the request's as the pipeline does for its text encoder; none for text-only encoders.
  virtual std::vector<at::Tensor> prompt_images(const GenerateRequest& request) const;
  /// The reference images' tokens and ids for `batch` images (diffusers' prepare_image_latents):
  /// each image prepared as the family's image processor does, encoded by the VAE (posterior
  /// mean) and normalised, on every rank (encoded on the ranks with the VAE and sent to the
  /// others). Collective over the world like generate(); after load(). Undefined without images.
  virtual ReferenceTokens reference_tokens(const GenerateRequest& request, int64_t batch) const;

  /// The transformer's text width (joint_attention_dim) and pooled width (0: none).
  virtual int64_t joint_attention_dim() const = 0;
  virtual int64_t pooled_projection_dim() const { return 0; }
  /// The shape `latents=` takes for `batch` images of a (H/16) x (W/16) token grid.
  virtual std::vector<int64_t> latents_shape(int64_t batch, int64_t h, int64_t w) const = 0;
  /// Its dimensions in words, for errors.
  virtual std::string latents_layout() const = 0;

  /// The transformer's LoRA adapters, owned by the pipeline (after load()): load more, choose and
  /// weight the active ones, fuse or unload them between generate() calls (diffusers'
  /// load_lora_weights, set_adapters, fuse_lora, unload_lora_weights). Collective like
  /// generate(): every rank of the mesh makes the same calls.
  parallel::LoraAdapters& lora_adapters();
  /// Loads every file of `requests` into lora_adapters(), each named after its file, and makes
  /// exactly them active at their weights under the runtime scale `lora_scale`; with `fuse`,
  /// merges them into the weights at `lora_scale` instead. Every file is checked before the
  /// first is loaded (after load()).
  void load_lora_weights(const std::vector<models::LoraRequest>& requests, double lora_scale = 1.0, bool fuse = false);

  /// The ranks that compute one generate() together: this rank's replica under
  /// independent_replicas (after load()), otherwise the world.
  const std::shared_ptr<dist::Group>& replica_group() const { return replica_group_; }

  /// Uses `encoder` for GenerateRequest::prompt.
  void set_prompt_encoder(std::shared_ptr<PromptEncoder> encoder) { prompt_encoder_ = std::move(encoder); }
  const std::shared_ptr<parallel::TensorParallelModule>& transformer() const { return transformer_; }
  /// The transformer as the joint-stream skeleton every pipeline's is (step caches live there).
  models::JointTransformer2DModel& joint_transformer() const;
  /// Null on ranks that do not decode.
  const std::shared_ptr<models::AutoencoderModel>& vae() const { return vae_; }
  const io::ModelFolder& folder() const { return folder_; }
  /// The VAE's pixels per latent pixel (from its config, also where the VAE is not loaded).
  int64_t vae_scale_factor() const { return vae_scale_factor_; }

 protected:
  /// Opens the components (the transformer must be a `transformer_class`); load() reads the weights.
  DiffusionPipeline(io::ModelFolder folder, const PipelineLoadOptions& options, const std::string& pipeline_class,
                    const std::string& transformer_class);

  // The steps of generate() each family fills in.
  /// What the request's unset values take.
  virtual CallDefaults call_defaults() const = 0;
  /// diffusers' prepare_latents: the request's latents (checked against latents_shape) or noise
  /// from its seed, as the tokens the transformer takes, [B, N, C4], on its device in its dtype.
  virtual at::Tensor prepare_latents(const GenerateRequest& request, int64_t batch, int64_t h, int64_t w) const = 0;
  /// The negative prompt's embeddings, one row per prompt (before the repeat for
  /// num_images_per_prompt), with `call`'s scales and CFG decision set: by default
  /// negative_embeds(request, num_prompts), nullopt without a negative prompt. With CFG they must be there.
  virtual std::optional<PromptEmbeds> call_negative_embeds(const GenerateRequest& request,
                                                           const PreparedRequest& call, int64_t num_prompts) const;
  /// The scheduler's mu for `image_seq_len` tokens and `steps` steps: by default calculate_shift.
  virtual double scheduler_mu(int64_t image_seq_len, int64_t steps) const;
  /// The rest of the call after the shared start: the transformer's inputs and the CFG formula
  /// (through denoise()), and the decode.
  virtual GenerateResult generate_prepared(PreparedRequest& call, const GenerateRequest& request) = 0;

  /// The shared start of generate() after check(): size, defaults, prompt embeddings, the CFG
  /// decision, initial latents, scheduler.
  PreparedRequest prepare(const GenerateRequest& request) const;
  /// The output size a request asks for before rounding, {height, width}: its own, else the
  /// family's default (default_size(); FLUX.2: the first reference image's prepared size).
  virtual std::pair<int64_t, int64_t> requested_size(const GenerateRequest& request) const;
  /// The family's checks of the request's reference images beyond the count and pixel layout
  /// (FLUX.2: each side >= 64 and aspect <= 8:1, diffusers' messages).
  virtual void check_reference_images(const GenerateRequest& request, int64_t batch) const;
  /// The VAE's normalised latents (AutoencoderModel::normalize_latents) of one prepared image
  /// (float32 [1, 3, h, w] in [-1, 1]), float32 [1, C, h', w'] on the CPU on every rank (a
  /// single frame's axis dropped: Qwen-Image): encoded where the VAE is loaded (by all ranks
  /// together under vae_parallel), broadcast to the others.
  at::Tensor encode_image_latents(const at::Tensor& image) const;
  /// The request's size rounded as diffusers does (a multiple of 2 * vae_scale_factor), with a
  /// printed note on rank 0 when it changes and `note` is set; errors for sizes that round to nothing.
  std::pair<int64_t, int64_t> resolve_size(const GenerateRequest& request, bool note = true) const;
  /// diffusers' default image side: default_sample_size (128) x vae_scale_factor.
  int64_t default_size() const { return 128 * vae_scale_factor_; }
  /// The request's latents (checked against latents_shape), or noise of that shape from its seed.
  at::Tensor initial_latents(const GenerateRequest& request, int64_t batch, int64_t h, int64_t w) const;
  /// FLUX.1's and Qwen-Image's prepare_latents on the CPU: the request's packed latents (checked),
  /// or noise drawn unpacked [B, C, H/8, W/8] from its seed and packed to [B, N, 4C] as they do
  /// (latents_shape is [B, N, 4C]).
  at::Tensor packed_noise_latents(const GenerateRequest& request, int64_t batch, int64_t h, int64_t w) const;
  /// The prompt embeddings of the request (given, or made by the encoder from `prompts` with
  /// `images` when there are any: prompt_images()), or nullopt when neither is there. `what`
  /// names them in errors.
  std::optional<PromptEmbeds> embeds_for(const std::optional<PromptEmbeds>& given,
                                         const std::vector<std::string>& prompts, int64_t max_sequence_length,
                                         const char* what, const std::vector<at::Tensor>& images = {}) const;
  /// FLUX.1's and Qwen-Image's calculate_shift for `image_seq_len` tokens, with the scheduler
  /// config's sequence lengths and shifts.
  double calculate_shift(int64_t image_seq_len) const;
  /// The request's prompt embeddings (given, or encoded), checked against the transformer's widths.
  PromptEmbeds positive_embeds(const GenerateRequest& request) const;
  /// The negative prompt's embeddings for `num_prompts` prompts (given, or encoded from the
  /// negative prompts, or from `default_prompt` when there are none), checked likewise; nullopt
  /// when there is no negative prompt.
  std::optional<PromptEmbeds> negative_embeds(const GenerateRequest& request, int64_t num_prompts,
                                              const std::optional<std::string>& default_prompt = std::nullopt) const;
  /// The result of a call: the final latents (float32 on the CPU), its size and steps, and the
  /// guidance it reports.
  static GenerateResult make_result(const at::Tensor& latents, const PreparedRequest& call, double guidance);
  /// A fresh scheduler from the folder's scheduler_config.json with the pipelines' sigmas.
  schedulers::FlowMatchEulerDiscreteScheduler make_scheduler(int64_t steps, double mu) const;
  /// The transformer on one branch's prompt embeddings: latents [B, N, C4] and timestep [B] to
  /// the prediction [B, N, C4].
  using TransformerCall =
      std::function<at::Tensor(const PromptEmbeds& embeds, const at::Tensor& latents, const at::Tensor& timestep)>;
  /// A family's CFG formula on the conditional and unconditional predictions.
  using CfgCombine = std::function<at::Tensor(const at::Tensor& cond, const at::Tensor& uncond)>;
  /// The denoising loop of a prepared call: for each timestep t, latents <- call.scheduler.step(
  /// guided(transformer on call.cond, and on call.uncond with CFG, combined), t, latents), with
  /// the timestep passed as t/1000 [B]; the request's callbacks after each step. Returns the
  /// final latents [B, N, C4].
  at::Tensor denoise(PreparedRequest& call, const GenerateRequest& request, const TransformerCall& transformer,
                     const CfgCombine& combine) const;
  /// The step cache's decisions over the call into `result` (gathered over the cfg group under
  /// CFG-parallel, so every rank has every context's).
  void report_cache(const models::StepCache& cache, const PreparedRequest& call, GenerateResult& result) const;
  /// vae.decode(z) -> image float32 [B, H, W, 3] in [0, 1] (diffusers' postprocess, "np").
  at::Tensor decode_image(const at::Tensor& vae_latents) const;
  /// One step's prediction with classifier-free guidance: `branch(true)` runs the transformer on
  /// the positive prompt, `branch(false)` on the negative one, and `combine(cond, uncond)` is the
  /// pipeline's CFG formula. Without CFG (`do_cfg` false): branch(true). With CFG on a mesh
  /// without a cfg dimension: both branches here, one after the other. Under CFG-parallel (a
  /// "cfg" dimension of 2): this rank runs only its half's branch (cfg index 0 the conditional,
  /// 1 the unconditional), the two predictions are all-gathered over the cfg group, and every
  /// rank combines them alike, so the latents stay identical on every rank.
  at::Tensor guided(bool do_cfg, const std::function<at::Tensor(bool conditional)>& branch,
                    const std::function<at::Tensor(const at::Tensor& cond, const at::Tensor& uncond)>& combine) const;

  io::ModelFolder folder_;
  PipelineLoadOptions options_;
  std::shared_ptr<parallel::TensorParallelModule> transformer_;
  /// The transformer's sharding: the mesh's "tp" dimension; none on one rank.
  std::optional<parallel::TensorParallelConfig> transformer_parallel_;
  /// Made by load(); declared after transformer_, so it is destroyed first.
  std::unique_ptr<parallel::LoraAdapters> lora_;
  std::shared_ptr<models::AutoencoderModel> vae_;
  std::shared_ptr<models::AutoencoderModel> vae_model_;  ///< built from the config, loaded by load()
  io::Checkpoint transformer_weights_;
  io::Checkpoint vae_weights_;
  /// options.lora opened and checked against the transformer by the constructor; load() reads them.
  std::vector<models::LoraFile> adapter_files_;
  bool loaded_ = false;
  std::shared_ptr<PromptEncoder> prompt_encoder_;
  int64_t vae_scale_factor_ = 8;
  schedulers::FlowMatchEulerDiscreteSchedulerConfig scheduler_config_;
  /// The group of the mesh's "cfg" dimension when it is 2 (CFG-parallel); null otherwise.
  std::shared_ptr<dist::Group> cfg_group_;
  std::shared_ptr<dist::Group> replica_group_;

 private:
  /// Refuses CFG-parallel on a pipeline that cannot run CFG, and a mesh the transformer cannot be
  /// split over (listing those it can), before any weight is read.
  void check_parallel() const;
};

/// Checks prompt embeddings against the transformer's text width `joint_attention_dim` (and the
/// pooled width when `pooled_dim` > 0): floating, [P, L, D]; mask [P, L] integer or bool.
/// `what` names them in errors ("prompt_embeds", "negative_prompt_embeds").
void check_prompt_embeds(const PromptEmbeds& embeds, int64_t joint_attention_dim, int64_t pooled_dim,
                         const std::string& what);

/// Each row repeated `n` times in place (rows i*n .. i*n+n-1 from row i), in `dtype` on `device`.
PromptEmbeds repeat_prompt_embeds(const PromptEmbeds& embeds, int64_t n, at::ScalarType dtype, at::Device device);

/// Standard normal noise of `shape` from a CPU generator seeded with `seed` (float32, as
/// torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed))): the same on every
/// rank and device.
at::Tensor seeded_noise(at::IntArrayRef shape, uint64_t seed);

/// FLUX.1 / Qwen-Image _pack_latents: [B, C, 2h, 2w] -> [B, h*w, 4C] with token i*w+j holding
/// channel c*4 + dy*2 + dx = latent[c, 2i+dy, 2j+dx].
at::Tensor pack_latents_2x2(const at::Tensor& latents);
/// The inverse: [B, h*w, 4C] -> [B, C, 2h, 2w].
at::Tensor unpack_latents_2x2(const at::Tensor& packed, int64_t h, int64_t w);

/// Checks latents given to a pipeline (`latents=`): floating, of shape `expected` (`layout`
/// names the dimensions).
void check_given_latents(const at::Tensor& latents, const std::vector<int64_t>& expected, const std::string& layout);

/// Whether the request gives a negative prompt (as text or as embeddings).
inline bool has_negative_prompt(const GenerateRequest& request) {
  return request.negative_prompt_embeds.has_value() || !request.negative_prompt.empty();
}

/// The negative prompts for `num_prompts` prompts: none, one for all, or one each.
std::vector<std::string> negative_prompts_for(const std::vector<std::string>& negative, int64_t num_prompts);

/// The bounds of a request, checked before anything is allocated, for the command line and the
/// server alike: far above any real use (FLUX.1 and Qwen-Image generate up to 2048 pixels a side
/// with 512 or 1024 prompt tokens), low enough that no size computed from them overflows or asks
/// for more memory than a machine has.
constexpr int64_t kMaxInferenceSteps = 10000;
constexpr int64_t kMaxImageSide = 16384;       ///< pixels, height or width
/// FluxKontextPipeline's largest max_area (--max-area), 2048² pixels: FLUX.1's largest size. Far
/// larger areas ask the scheduler for a shift whose float32 exp overflows (NaN sigmas from
/// about 11600² on).
constexpr int64_t kMaxArea = int64_t{2048} * 2048;
constexpr int64_t kMaxImagesPerCall = 256;     ///< prompts x num_images_per_prompt
constexpr int64_t kMaxSequenceLength = 4096;   ///< prompt tokens

/// The checks every pipeline makes of a request before any compute: steps, sizes, counts and
/// lengths within the bounds above (named with their command-line flags), guidance scales and
/// given latents and embeddings finite (NaN or Inf would give a black image without a word).
void check_request(const GenerateRequest& request);

}  // namespace shardit::pipelines

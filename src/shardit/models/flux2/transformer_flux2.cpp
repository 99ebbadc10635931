#include "shardit/models/flux2/transformer_flux2.h"
#include "shardit/core/profile.h"

#include <c10/util/Exception.h>

#include <numeric>
#include <utility>

namespace shardit::models {

namespace {

std::shared_ptr<nn::Linear> linear_no_bias(int64_t in, int64_t out) {
  return std::make_shared<nn::Linear>(nn::LinearOptions(in, out).with_bias(false));
}

/// The local sizes of a fused layer's declared blocks when its local width is `local_total`:
/// packed sharding keeps every block's proportion, so each block shrinks by the same factor.
std::vector<int64_t> local_blocks(const std::vector<int64_t>& declared, int64_t local_total) {
  const int64_t total = std::accumulate(declared.begin(), declared.end(), int64_t{0});
  std::vector<int64_t> local;
  for (const int64_t block : declared) {
    TORCH_INTERNAL_ASSERT((block * local_total) % total == 0, "fused block ", block, " of ", total,
                          " does not scale to local width ", local_total);
    local.push_back(block * local_total / total);
  }
  return local;
}

/// silu(gate) * up for [..., gate M | up M].
at::Tensor swiglu(const at::Tensor& x) {
  const std::vector<at::Tensor> halves = x.chunk(2, -1);
  return at::silu(halves[0]).mul_(halves[1]);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Config

Flux2Transformer2DModelConfig Flux2Transformer2DModelConfig::from_json(const nlohmann::json& json,
                                                                       const std::string& source) {
  const io::ConfigReader reader(json, source);
  Flux2Transformer2DModelConfig config;
  config.patch_size = reader.integer("patch_size", config.patch_size, 1, io::kMaxConfigDim);
  config.in_channels = reader.integer("in_channels", config.in_channels, 1, io::kMaxConfigDim);
  config.out_channels = reader.optional_integer("out_channels", 1, io::kMaxConfigDim);
  config.num_layers = reader.integer("num_layers", config.num_layers, 0, io::kMaxConfigLayers);
  config.num_single_layers = reader.integer("num_single_layers", config.num_single_layers, 0, io::kMaxConfigLayers);
  config.attention_head_dim = reader.integer("attention_head_dim", config.attention_head_dim, 1, io::kMaxConfigDim);
  config.num_attention_heads = reader.integer("num_attention_heads", config.num_attention_heads, 1, io::kMaxConfigDim);
  config.joint_attention_dim = reader.integer("joint_attention_dim", config.joint_attention_dim, 1, io::kMaxConfigDim);
  config.timestep_guidance_channels =
      reader.integer("timestep_guidance_channels", config.timestep_guidance_channels, 2, io::kMaxConfigDim);
  reader.require(config.timestep_guidance_channels % 2 == 0, "'timestep_guidance_channels' must be even, got ",
                 config.timestep_guidance_channels);
  config.mlp_ratio = reader.number("mlp_ratio", config.mlp_ratio, 1e-3, 64.0);
  config.axes_dims_rope =
      reader.rope_axes("axes_dims_rope", config.axes_dims_rope, "attention_head_dim", config.attention_head_dim);
  config.rope_theta = reader.number("rope_theta", config.rope_theta, 1e-3, 1e12);
  config.eps = reader.number("eps", config.eps, 1e-30, 1.0);
  config.guidance_embeds = reader.boolean("guidance_embeds", config.guidance_embeds);
  reader.width("num_attention_heads", config.num_attention_heads, "attention_head_dim", config.attention_head_dim);
  reader.require(config.mlp_hidden_dim() > 0, "'mlp_ratio' ", config.mlp_ratio, " gives an empty MLP for width ",
                 config.inner_dim());
  return config;
}

// ---------------------------------------------------------------------------------------------
// Modulation and embeddings

Flux2Modulation::Flux2Modulation(int64_t dim, int64_t mod_param_sets) : mod_param_sets_(mod_param_sets) {
  linear = register_module("linear", linear_no_bias(dim, dim * 3 * mod_param_sets));
}

Flux2Modulation::Output Flux2Modulation::forward(const at::Tensor& temb) {
  Output out;
  // [B, 3 * sets * D], gathered to full width under TP
  out.emb = linear->forward(at::silu(temb));
  const std::vector<at::Tensor> chunks = out.emb.chunk(3 * mod_param_sets_, 1);
  for (int64_t i = 0; i < mod_param_sets_; ++i) {
    out.sets.push_back({chunks[3 * i], chunks[3 * i + 1], chunks[3 * i + 2]});
  }
  return out;
}

Flux2TimestepGuidanceEmbeddings::Flux2TimestepGuidanceEmbeddings(int64_t in_channels, int64_t embedding_dim,
                                                                 bool with_guidance)
    : time_proj(nn::TimestepsOptions(in_channels, /*flip_sin_to_cos=*/true, /*downscale_freq_shift=*/0)) {
  timestep_embedder = register_module("timestep_embedder",
                                      std::make_shared<nn::TimestepEmbedding>(in_channels, embedding_dim, false));
  if (with_guidance) {
    guidance_embedder = register_module("guidance_embedder",
                                        std::make_shared<nn::TimestepEmbedding>(in_channels, embedding_dim, false));
  }
}

at::Tensor Flux2TimestepGuidanceEmbeddings::forward(const at::Tensor& timestep, const std::optional<at::Tensor>& guidance,
                                                    at::ScalarType dtype) {
  // [B, C] fp32
  const at::Tensor timesteps_proj = time_proj.forward(timestep);
  emit("temb.timestep_proj", timesteps_proj);
  // [B, D]
  at::Tensor temb = timestep_embedder->forward(timesteps_proj.to(dtype));
  emit("temb.timestep_emb", temb);
  if (guidance_embedder) {
    TORCH_INTERNAL_ASSERT(guidance.has_value(), "guidance missing for a guidance-embedding model");
    const at::Tensor guidance_proj = time_proj.forward(*guidance);
    emit("temb.guidance_proj", guidance_proj);
    const at::Tensor guidance_emb = guidance_embedder->forward(guidance_proj.to(dtype));
    emit("temb.guidance_emb", guidance_emb);
    temb = temb + guidance_emb;
  }
  return temb;
}

// ---------------------------------------------------------------------------------------------
// Feed-forward and attention

Flux2FeedForward::Flux2FeedForward(int64_t dim, int64_t inner_dim) {
  // Output [gate M | up M]: packed colwise sharding keeps each rank's gate and up columns paired.
  linear_in = register_module(
      "linear_in", std::make_shared<nn::Linear>(
                       nn::LinearOptions(dim, 2 * inner_dim).with_bias(false).with_out_blocks({inner_dim, inner_dim})));
  linear_out = register_module("linear_out", linear_no_bias(inner_dim, dim));
}

at::Tensor Flux2FeedForward::forward(const at::Tensor& x) {
  // [..., 2M_local] -> [..., M_local] -> [..., D]
  return linear_out->forward(swiglu(linear_in->forward(x)));
}

Flux2Attention::Flux2Attention(int64_t query_dim, int64_t heads, int64_t dim_head, int64_t added_kv_proj_dim,
                               double eps)
    : head_dim_(dim_head) {
  const int64_t inner_dim = heads * dim_head;
  const auto rms = [&] { return std::make_shared<nn::RMSNorm>(nn::RMSNormOptions(dim_head).with_eps(eps)); };
  to_q = register_module("to_q", linear_no_bias(query_dim, inner_dim));
  to_k = register_module("to_k", linear_no_bias(query_dim, inner_dim));
  to_v = register_module("to_v", linear_no_bias(query_dim, inner_dim));
  norm_q = register_module("norm_q", rms());
  norm_k = register_module("norm_k", rms());
  to_out = register_module("to_out", std::make_shared<nn::ModuleList<nn::Linear>>());
  to_out->push_back(linear_no_bias(inner_dim, query_dim));
  norm_added_q = register_module("norm_added_q", rms());
  norm_added_k = register_module("norm_added_k", rms());
  add_q_proj = register_module("add_q_proj", linear_no_bias(added_kv_proj_dim, inner_dim));
  add_k_proj = register_module("add_k_proj", linear_no_bias(added_kv_proj_dim, inner_dim));
  add_v_proj = register_module("add_v_proj", linear_no_bias(added_kv_proj_dim, inner_dim));
  to_add_out = register_module("to_add_out", linear_no_bias(inner_dim, query_dim));
}

std::pair<at::Tensor, at::Tensor> Flux2Attention::forward(const at::Tensor& hidden_states,
                                                          const at::Tensor& encoder_hidden_states,
                                                          const nn::RotaryEmbedding& rope) {
  SHARDIT_PROFILE_SCOPE("Flux2Attention");
  // hidden_states [B, N, D], encoder_hidden_states [B, L, D]
  // [B, N, H_local, hd] and [B, L, H_local, hd]
  const nn::HeadsQKV image = nn::project_heads(hidden_states, {*to_q, *to_k, *to_v, norm_q.get(), norm_k.get()}, head_dim_);
  const nn::HeadsQKV text = nn::project_heads(
      encoder_hidden_states, {*add_q_proj, *add_k_proj, *add_v_proj, norm_added_q.get(), norm_added_k.get()}, head_dim_);
  // The RoPE table covers [text; image].
  const int64_t text_len = encoder_hidden_states.size(1);
  const nn::RotaryEmbedding text_rope = rope.slice(0, text_len);
  const nn::RotaryEmbedding image_rope = rope.slice(text_len, rope.cos.size(0));
  const auto [text_attended, image_attended] = nn::joint_attention(text, image, &text_rope, &image_rope);
  // [B, N, D] and [B, L, D]
  return {(*to_out)[0].forward(image_attended), to_add_out->forward(text_attended)};
}

Flux2ParallelSelfAttention::Flux2ParallelSelfAttention(int64_t query_dim, int64_t heads, int64_t dim_head,
                                                       int64_t mlp_hidden_dim, double eps)
    : head_dim_(dim_head) {
  const int64_t inner_dim = heads * dim_head;
  // Output [q D | k D | v D | gate M | up M]; input of to_out [attn D | mlp M]. Packed sharding
  // splits each block on its own, so a rank keeps its heads' q/k/v and its MLP columns.
  to_qkv_mlp_proj = register_module(
      "to_qkv_mlp_proj",
      std::make_shared<nn::Linear>(nn::LinearOptions(query_dim, 3 * inner_dim + 2 * mlp_hidden_dim)
                                       .with_bias(false)
                                       .with_out_blocks({inner_dim, inner_dim, inner_dim, mlp_hidden_dim, mlp_hidden_dim})));
  norm_q = register_module("norm_q", std::make_shared<nn::RMSNorm>(nn::RMSNormOptions(dim_head).with_eps(eps)));
  norm_k = register_module("norm_k", std::make_shared<nn::RMSNorm>(nn::RMSNormOptions(dim_head).with_eps(eps)));
  to_out = register_module("to_out", std::make_shared<nn::Linear>(nn::LinearOptions(inner_dim + mlp_hidden_dim, query_dim)
                                                                      .with_bias(false)
                                                                      .with_in_blocks({inner_dim, mlp_hidden_dim})));
}

at::Tensor Flux2ParallelSelfAttention::forward(const at::Tensor& hidden_states, const nn::RotaryEmbedding& rope) {
  SHARDIT_PROFILE_SCOPE("Flux2ParallelSelfAttention");
  // hidden_states [B, S, D] -> [B, S, 3D_local + 2M_local]
  const at::Tensor projected = to_qkv_mlp_proj->forward(hidden_states);
  emit("to_qkv_mlp_proj", projected);
  // The local block sizes follow from the local width and the declared proportions.
  const std::vector<int64_t> blocks = local_blocks(to_qkv_mlp_proj->options().out_blocks, projected.size(-1));
  const std::vector<at::Tensor> parts = projected.split_with_sizes({blocks[0], blocks[1], blocks[2], blocks[3] + blocks[4]}, -1);
  // [B, S, D_local]
  const at::Tensor attended =
      nn::attention(nn::split_qkv_heads(parts[0], parts[1], parts[2], norm_q.get(), norm_k.get(), head_dim_), &rope);
  // [B, S, M_local]
  const at::Tensor mlp = swiglu(parts[3]);
  // [B, S, D_local + M_local] -> [B, S, D], without materialising cat[attended, mlp]
  return to_out->forward_blocks({attended, mlp});
}

// ---------------------------------------------------------------------------------------------
// Blocks

Flux2TransformerBlock::Flux2TransformerBlock(int64_t dim, int64_t num_attention_heads, int64_t attention_head_dim,
                                             double mlp_ratio, double eps)
    : eps_(eps) {
  const auto mlp_hidden_dim = static_cast<int64_t>(static_cast<double>(dim) * mlp_ratio);
  attn = register_module("attn", std::make_shared<Flux2Attention>(dim, num_attention_heads, attention_head_dim, dim, eps));
  ff = register_module("ff", std::make_shared<Flux2FeedForward>(dim, mlp_hidden_dim));
  ff_context = register_module("ff_context", std::make_shared<Flux2FeedForward>(dim, mlp_hidden_dim));
}

std::pair<at::Tensor, at::Tensor> Flux2TransformerBlock::forward(const at::Tensor& hidden_states,
                                                                 const at::Tensor& encoder_hidden_states,
                                                                 const std::vector<Flux2ModulationParams>& mod_img,
                                                                 const std::vector<Flux2ModulationParams>& mod_txt,
                                                                 const nn::RotaryEmbedding& rope) {
  SHARDIT_PROFILE_SCOPE("Flux2TransformerBlock");
  TORCH_INTERNAL_ASSERT(mod_img.size() == 2 && mod_txt.size() == 2, "double block needs two modulation sets");
  // hidden_states [B, N, D], encoder_hidden_states [B, L, D]
  const at::Tensor norm_hidden_states =
      nn::modulated_layer_norm(hidden_states, eps_, mod_img[0].shift, mod_img[0].scale);
  const at::Tensor norm_encoder_hidden_states =
      nn::modulated_layer_norm(encoder_hidden_states, eps_, mod_txt[0].shift, mod_txt[0].scale);

  const auto [attn_output, context_attn_output] = attn->forward(norm_hidden_states, norm_encoder_hidden_states, rope);
  emit("attn.hidden_states", attn_output);
  emit("attn.encoder_hidden_states", context_attn_output);

  // Image stream. [B, N, D]
  at::Tensor image = nn::gated_residual(hidden_states, mod_img[0].gate, attn_output);
  const at::Tensor ff_output = ff->forward(nn::modulated_layer_norm(image, eps_, mod_img[1].shift, mod_img[1].scale));
  emit("ff", ff_output);
  image = nn::gated_residual(image, mod_img[1].gate, ff_output);

  // Text stream. [B, L, D]
  at::Tensor text = nn::gated_residual(encoder_hidden_states, mod_txt[0].gate, context_attn_output);
  const at::Tensor ff_context_output =
      ff_context->forward(nn::modulated_layer_norm(text, eps_, mod_txt[1].shift, mod_txt[1].scale));
  emit("ff_context", ff_context_output);
  text = nn::gated_residual(text, mod_txt[1].gate, ff_context_output);
  return {text, image};
}

Flux2SingleTransformerBlock::Flux2SingleTransformerBlock(int64_t dim, int64_t num_attention_heads,
                                                         int64_t attention_head_dim, double mlp_ratio, double eps)
    : eps_(eps) {
  const auto mlp_hidden_dim = static_cast<int64_t>(static_cast<double>(dim) * mlp_ratio);
  attn = register_module("attn", std::make_shared<Flux2ParallelSelfAttention>(dim, num_attention_heads,
                                                                              attention_head_dim, mlp_hidden_dim, eps));
}

at::Tensor Flux2SingleTransformerBlock::forward(const at::Tensor& hidden_states, const Flux2ModulationParams& mod,
                                                const nn::RotaryEmbedding& rope) {
  SHARDIT_PROFILE_SCOPE("Flux2SingleTransformerBlock");
  // hidden_states [B, S, D]
  const at::Tensor normed = nn::modulated_layer_norm(hidden_states, eps_, mod.shift, mod.scale);
  const at::Tensor attn_output = attn->forward(normed, rope);
  emit("attn", attn_output);
  return nn::gated_residual(hidden_states, mod.gate, attn_output);
}

// ---------------------------------------------------------------------------------------------
// Model

Flux2Transformer2DModel::Flux2Transformer2DModel(const Flux2Transformer2DModelConfig& config)
    : JointTransformer2DModel(config.num_attention_heads),
      config(config),
      pos_embed(config.rope_theta, config.axes_dims_rope) {
  const int64_t inner_dim = config.inner_dim();
  time_guidance_embed = register_module(
      "time_guidance_embed", std::make_shared<Flux2TimestepGuidanceEmbeddings>(config.timestep_guidance_channels,
                                                                               inner_dim, config.guidance_embeds));
  double_stream_modulation_img =
      register_module("double_stream_modulation_img", std::make_shared<Flux2Modulation>(inner_dim, 2));
  double_stream_modulation_txt =
      register_module("double_stream_modulation_txt", std::make_shared<Flux2Modulation>(inner_dim, 2));
  single_stream_modulation = register_module("single_stream_modulation", std::make_shared<Flux2Modulation>(inner_dim, 1));
  x_embedder = register_module("x_embedder", linear_no_bias(config.in_channels, inner_dim));
  context_embedder = register_module("context_embedder", linear_no_bias(config.joint_attention_dim, inner_dim));
  transformer_blocks = register_module("transformer_blocks", std::make_shared<nn::ModuleList<Flux2TransformerBlock>>());
  for (int64_t i = 0; i < config.num_layers; ++i) {
    transformer_blocks->push_back(std::make_shared<Flux2TransformerBlock>(
        inner_dim, config.num_attention_heads, config.attention_head_dim, config.mlp_ratio, config.eps));
  }
  single_transformer_blocks =
      register_module("single_transformer_blocks", std::make_shared<nn::ModuleList<Flux2SingleTransformerBlock>>());
  for (int64_t i = 0; i < config.num_single_layers; ++i) {
    single_transformer_blocks->push_back(std::make_shared<Flux2SingleTransformerBlock>(
        inner_dim, config.num_attention_heads, config.attention_head_dim, config.mlp_ratio, config.eps));
  }
  norm_out = register_module("norm_out", std::make_shared<nn::AdaLayerNormContinuous>(
                                         nn::AdaLayerNormContinuousOptions(inner_dim, inner_dim).with_eps(config.eps).with_bias(false)));
  proj_out = register_module(
      "proj_out", linear_no_bias(inner_dim, config.patch_size * config.patch_size * config.resolved_out_channels()));
}

// Counts of the live tensors per token in units of D, as FluxTransformer2DModel::step_model's.
StepModel Flux2Transformer2DModel::step_model(const StepShape& shape) const {
  const int64_t n = image_tokens(shape, 16);
  const int64_t s = n + shape.text_tokens;
  const int64_t d = config.inner_dim();
  const int64_t mlp = config.mlp_hidden_dim();
  StepModel step{{}, s, config.num_attention_heads, config.attention_head_dim};
  if (config.num_single_layers > 0) {
    // Single block: the fused [q|k|v|gate|up] output (v stays a view of it) and the SwiGLU
    // result beside the normed and rotated q, k and the product's operands.
    step.phases.push_back({s, 2 * d, (3 * d + 2 * mlp) + mlp + 6 * d, true});
    step.phases.push_back({s, 3 * d, 2 * (d + mlp)});
  }
  if (config.num_layers > 0) {
    step.phases.push_back({s, 2 * d, 10 * d, true});
    // SwiGLU feed-forward: [gate | up] and the product local.
    step.phases.push_back({n, 3 * d, 3 * mlp});
  }
  return step;
}

Flux2Transformer2DModelInputs Flux2Transformer2DModelInputs::from_file(const io::SafetensorsFile& file) {
  Flux2Transformer2DModelInputs inputs;
  inputs.hidden_states = file.read("hidden_states");
  inputs.encoder_hidden_states = file.read("encoder_hidden_states");
  inputs.timestep = file.read("timestep");
  inputs.img_ids = file.read("img_ids");
  inputs.txt_ids = file.read("txt_ids");
  inputs.guidance = file.read_if_present("guidance");
  return inputs;
}

at::Tensor Flux2Transformer2DModel::forward_from_file(const io::SafetensorsFile& inputs) {
  return forward(Flux2Transformer2DModelInputs::from_file(inputs));
}

// diffusers' FLUX.2 LoRA conversions (kohya, BFL/ai-toolkit; loaders/lora_conversion_utils.py):
// BFL's fused qkv split by rows; the single blocks' linear1/linear2 are the fused projections
// here; BFL/ai-toolkit files carry no alphas (diffusers refuses them) and may hold diffusers block
// names already.
const LoraKeyConventions& Flux2Transformer2DModel::lora_conventions() const {
  static const LoraKeyConventions conventions = [] {
    LoraKeyConventions c;
    c.family = "FLUX.2";
    c.bfl_double_block = {
        {"img_attn_qkv", {"attn.to_q", "attn.to_k", "attn.to_v"}},
        {"img_attn_proj", {"attn.to_out.0"}},
        {"img_mlp_0", {"ff.linear_in"}},
        {"img_mlp_2", {"ff.linear_out"}},
        {"txt_attn_qkv", {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"}},
        {"txt_attn_proj", {"attn.to_add_out"}},
        {"txt_mlp_0", {"ff_context.linear_in"}},
        {"txt_mlp_2", {"ff_context.linear_out"}},
    };
    c.bfl_single_block = {
        {"linear1", {"attn.to_qkv_mlp_proj"}},
        {"linear2", {"attn.to_out"}},
    };
    c.bfl_top_level = {
        {"img_in", {"x_embedder"}},
        {"txt_in", {"context_embedder"}},
        {"time_in_in_layer", {"time_guidance_embed.timestep_embedder.linear_1"}},
        {"time_in_out_layer", {"time_guidance_embed.timestep_embedder.linear_2"}},
        {"guidance_in_in_layer", {"time_guidance_embed.guidance_embedder.linear_1"}},
        {"guidance_in_out_layer", {"time_guidance_embed.guidance_embedder.linear_2"}},
        {"final_layer_linear", {"proj_out"}},
        {"final_layer_adaLN_modulation_1", {"norm_out.linear"}},
        {"single_stream_modulation_lin", {"single_stream_modulation.linear"}},
        {"double_stream_modulation_img_lin", {"double_stream_modulation_img.linear"}},
        {"double_stream_modulation_txt_lin", {"double_stream_modulation_txt.linear"}},
    };
    c.bfl_names_may_be_diffusers = true;
    c.bfl_refuses_alpha = true;
    return c;
  }();
  return conventions;
}

std::vector<std::string> Flux2Transformer2DModel::high_precision_modules() const {
  // Left dense by --weights-dtype (docs/quantization.md): the embedders, the modulation and the
  // output head. The modulation sets every token's shift, scale and gate in every block; the
  // embedders and the head are small, so dense costs little memory.
  return {
      "x_embedder", "context_embedder", "time_guidance_embed.*", "double_stream_modulation_img.*",
      "double_stream_modulation_txt.*", "single_stream_modulation.*", "norm_out.*", "proj_out"};
}

const std::vector<SingleFileLayout>& Flux2Transformer2DModel::single_file_layouts() {
  // Black Forest Labs' FLUX.2 files (flux2-dev.safetensors): diffusers'
  // convert_flux2_transformer_checkpoint_to_diffusers as data. The single blocks' linear1 stays
  // fused ([q|k|v|gate|up] is the model's to_qkv_mlp_proj); only the double blocks' qkv splits.
  static const std::vector<SingleFileLayout> layouts = {
      {"BFL",
       {"", "model.diffusion_model."},
       {"single_stream_modulation.lin.weight"},
       {
           {"img_in", {"x_embedder"}},
           {"txt_in", {"context_embedder"}},
           {"time_in.in_layer", {"time_guidance_embed.timestep_embedder.linear_1"}},
           {"time_in.out_layer", {"time_guidance_embed.timestep_embedder.linear_2"}},
           {"guidance_in.in_layer", {"time_guidance_embed.guidance_embedder.linear_1"}},
           {"guidance_in.out_layer", {"time_guidance_embed.guidance_embedder.linear_2"}},
           {"double_stream_modulation_img.lin", {"double_stream_modulation_img.linear"}},
           {"double_stream_modulation_txt.lin", {"double_stream_modulation_txt.linear"}},
           {"single_stream_modulation.lin", {"single_stream_modulation.linear"}},
           {"final_layer.linear", {"proj_out"}},
           {"final_layer.adaLN_modulation.1", {"norm_out.linear"}, "weight", /*swapped_halves=*/true},
           {"double_blocks.*.img_attn.qkv",
            {"transformer_blocks.*.attn.to_q", "transformer_blocks.*.attn.to_k", "transformer_blocks.*.attn.to_v"}},
           {"double_blocks.*.txt_attn.qkv",
            {"transformer_blocks.*.attn.add_q_proj", "transformer_blocks.*.attn.add_k_proj",
             "transformer_blocks.*.attn.add_v_proj"}},
           {"double_blocks.*.img_attn.norm.query_norm", {"transformer_blocks.*.attn.norm_q"}, "scale"},
           {"double_blocks.*.img_attn.norm.key_norm", {"transformer_blocks.*.attn.norm_k"}, "scale"},
           {"double_blocks.*.img_attn.proj", {"transformer_blocks.*.attn.to_out.0"}},
           {"double_blocks.*.img_mlp.0", {"transformer_blocks.*.ff.linear_in"}},
           {"double_blocks.*.img_mlp.2", {"transformer_blocks.*.ff.linear_out"}},
           {"double_blocks.*.txt_attn.norm.query_norm", {"transformer_blocks.*.attn.norm_added_q"}, "scale"},
           {"double_blocks.*.txt_attn.norm.key_norm", {"transformer_blocks.*.attn.norm_added_k"}, "scale"},
           {"double_blocks.*.txt_attn.proj", {"transformer_blocks.*.attn.to_add_out"}},
           {"double_blocks.*.txt_mlp.0", {"transformer_blocks.*.ff_context.linear_in"}},
           {"double_blocks.*.txt_mlp.2", {"transformer_blocks.*.ff_context.linear_out"}},
           {"single_blocks.*.linear1", {"single_transformer_blocks.*.attn.to_qkv_mlp_proj"}},
           {"single_blocks.*.linear2", {"single_transformer_blocks.*.attn.to_out"}},
           {"single_blocks.*.norm.query_norm", {"single_transformer_blocks.*.attn.norm_q"}, "scale"},
           {"single_blocks.*.norm.key_norm", {"single_transformer_blocks.*.attn.norm_k"}, "scale"},
       },
       {kComfyScaledFp8Marker}},
      {"diffusers", {"", "model.diffusion_model."}, {"single_stream_modulation.linear.weight"}, {},
       {kComfyScaledFp8Marker}},
  };
  return layouts;
}

const parallel::TpPlan& Flux2Transformer2DModel::tp_plan() const {
  // diffusers' FLUX.2 plan: q/k/v (image and text) and the FF linear_in split colwise, closed by
  // rowwise to_out.0 / to_add_out / linear_out (one all-reduce each). linear_in's output is
  // [gate M | up M] and the single block's fused to_qkv_mlp_proj is [q | k | v | gate | up]:
  // packed colwise, each declared block split on its own. The single block's to_out reads
  // [attn D | mlp M]: packed rowwise. Our addition: the three shared modulation linears
  // (D -> 6D, 6D, 3D) split colwise and all-gathered instead of held whole on every rank, and so
  // are the other full-width conditioning linears, which FLUX.2 [dev]'s size makes worth it
  // (0.25B parameters: the context embedder 15360 -> D, the timestep and guidance MLPs, norm_out's
  // D -> 2D): each output column is computed whole on one rank, so the result is the same.
  // Replicated (not listed): x_embedder and proj_out (in/out channels wide), the RMSNorms.
  const auto plan_for = [this](bool guidance) {
    std::vector<std::string> gathered = {"double_stream_modulation_img.linear",
                                         "double_stream_modulation_txt.linear",
                                         "single_stream_modulation.linear",
                                         "context_embedder",
                                         "time_guidance_embed.timestep_embedder.linear_1",
                                         "time_guidance_embed.timestep_embedder.linear_2",
                                         "norm_out.linear"};
    if (guidance) {
      gathered.push_back("time_guidance_embed.guidance_embedder.linear_1");
      gathered.push_back("time_guidance_embed.guidance_embedder.linear_2");
    }
    return parallel::with_sharded_modulation(gathered, *reference_tp_plan());
  };
  // The guidance embedder exists only with guidance_embeds ([dev]; not [klein]).
  static const parallel::TpPlan with_guidance = plan_for(true);
  static const parallel::TpPlan without_guidance = plan_for(false);
  return config.guidance_embeds ? with_guidance : without_guidance;
}

const parallel::TpPlan* Flux2Transformer2DModel::reference_tp_plan() const {
  using parallel::ShardStyle;
  // tp_plan() without the shared modulation linears: diffusers keeps them whole on every rank.
  // The FF linear_in is [gate | up], equal halves: blocks {1, 1} as the reference writes them.
  static const parallel::TpPlan plan = {
      {"transformer_blocks.*.attn.to_q", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.to_k", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.to_v", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.to_out.0", ShardStyle::Rowwise},
      {"transformer_blocks.*.attn.add_q_proj", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.add_k_proj", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.add_v_proj", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.to_add_out", ShardStyle::Rowwise},
      {"transformer_blocks.*.ff.linear_in", ShardStyle::PackedColwise, {1, 1}},
      {"transformer_blocks.*.ff.linear_out", ShardStyle::Rowwise},
      {"transformer_blocks.*.ff_context.linear_in", ShardStyle::PackedColwise, {1, 1}},
      {"transformer_blocks.*.ff_context.linear_out", ShardStyle::Rowwise},
      {"single_transformer_blocks.*.attn.to_qkv_mlp_proj", ShardStyle::PackedColwise},
      {"single_transformer_blocks.*.attn.to_out", ShardStyle::PackedRowwise},
  };
  return &plan;
}

at::Tensor Flux2Transformer2DModel::forward(const Flux2Transformer2DModelInputs& inputs) {
  SHARDIT_PROFILE_SCOPE("Flux2Transformer2DModel");
  // TaylorSeer: a forward it predicts runs nothing.
  if (std::optional<at::Tensor> predicted = predicted_output(inputs.hidden_states)) return *predicted;
  // Both token streams checked and, under context parallelism, split: [B, N_local, C], [B, L_local, C].
  JointForward joint(*this, inputs.hidden_states, config.in_channels, inputs.encoder_hidden_states,
                     config.joint_attention_dim);

  // The model's own scaling of the pipeline's t/1000, in fp32.
  const at::Tensor timestep = joint.per_sample("timestep", inputs.timestep) * 1000;
  std::optional<at::Tensor> guidance = joint.optional_per_sample("guidance", inputs.guidance, config.guidance_embeds);
  if (guidance) *guidance = *guidance * 1000;
  // [B, D]
  const at::Tensor temb = time_guidance_embed->forward(timestep, guidance, joint.dtype);
  emit("temb", temb);

  // Computed once, shared by every block of a kind.
  const Flux2Modulation::Output mod_img = double_stream_modulation_img->forward(temb);
  const Flux2Modulation::Output mod_txt = double_stream_modulation_txt->forward(temb);
  const Flux2Modulation::Output mod_single = single_stream_modulation->forward(temb);
  emit("mod.double_stream_img", mod_img.emb);
  emit("mod.double_stream_txt", mod_txt.emb);
  emit("mod.single_stream", mod_single.emb);

  // [B, N, D] and [B, L, D]
  at::Tensor hidden_states = x_embedder->forward(joint.to_model(joint.image_tokens));
  emit("x_embedder", hidden_states);
  at::Tensor encoder_hidden_states = context_embedder->forward(joint.to_model(joint.text_tokens));
  emit("context_embedder", encoder_hidden_states);

  // [L_local, 4] and [N_local, 4]
  const auto [txt_ids, img_ids] = joint.position_ids(inputs.txt_ids, inputs.img_ids, config.axes_dims_rope.size());
  // [N, hd] and [L, hd] fp32, joined text first
  const nn::RotaryEmbedding image_rope = pos_embed.forward(img_ids);
  const nn::RotaryEmbedding text_rope = pos_embed.forward(txt_ids);
  const nn::RotaryEmbedding rope{at::cat({text_rope.cos, image_rope.cos}, 0), at::cat({text_rope.sin, image_rope.sin}, 0)};
  emit("rope.img.cos", image_rope.cos);
  emit("rope.img.sin", image_rope.sin);
  emit("rope.txt.cos", text_rope.cos);
  emit("rope.txt.sin", text_rope.sin);
  emit("rope.cos", rope.cos);
  emit("rope.sin", rope.sin);

  run_transformer_blocks(joint, *transformer_blocks, hidden_states, encoder_hidden_states, mod_img.sets, mod_txt.sets, rope);
  run_single_transformer_blocks(joint, *single_transformer_blocks, SingleBlockOutput::Joint, hidden_states,
                                encoder_hidden_states, mod_single.sets[0], rope);
  return output_head(joint, hidden_states, temb);
}

const parallel::CpPlan* Flux2Transformer2DModel::cp_plan() const {
  using parallel::CpAction;
  using parallel::SequenceStream;
  // As FLUX.1's: beside both token streams, their position ids split (RoPE rows computed from the
  // local ids travel with their tokens); the modulation is per sample.
  static const parallel::CpPlan plan = joint_cp_plan({
      {"img_ids", CpAction::Split, 0, SequenceStream::Image},
      {"txt_ids", CpAction::Split, 0, SequenceStream::Text},
  });
  return &plan;
}

at::Tensor flux2_image_ids(int64_t batch, int64_t h, int64_t w, int64_t t) {
  const auto options = at::TensorOptions().dtype(at::kLong);
  at::Tensor ids = at::zeros({h, w, 4}, options);
  ids.select(2, 0).fill_(t);
  ids.select(2, 1).add_(at::arange(h, options).unsqueeze(1));
  ids.select(2, 2).add_(at::arange(w, options).unsqueeze(0));
  return ids.reshape({1, h * w, 4}).expand({batch, h * w, 4}).contiguous();  // [B, N, 4] = (t, row, col, 0)
}

at::Tensor flux2_text_ids(int64_t batch, int64_t length) {
  const auto options = at::TensorOptions().dtype(at::kLong);
  at::Tensor ids = at::zeros({length, 4}, options);
  ids.select(1, 3).copy_(at::arange(length, options));
  return ids.unsqueeze(0).expand({batch, length, 4}).contiguous();  // [B, L, 4] = (0, 0, 0, l)
}

}  // namespace shardit::models

#include "shardit/models/flux/transformer_flux.h"
#include "shardit/core/profile.h"
#include "shardit/nn/activations.h"
#include "shardit/nn/inputs.h"

#include <c10/util/Exception.h>

#include <string>
#include <utility>

namespace shardit::models {

namespace {

constexpr double kNormEps = 1e-6;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Config

FluxTransformer2DModelConfig FluxTransformer2DModelConfig::from_json(const nlohmann::json& json,
                                                                     const std::string& source) {
  const io::ConfigReader reader(json, source);
  FluxTransformer2DModelConfig config;
  config.patch_size = reader.integer("patch_size", config.patch_size, 1, io::kMaxConfigDim);
  config.in_channels = reader.integer("in_channels", config.in_channels, 1, io::kMaxConfigDim);
  config.out_channels = reader.optional_integer("out_channels", 1, io::kMaxConfigDim);
  config.num_layers = reader.integer("num_layers", config.num_layers, 0, io::kMaxConfigLayers);
  config.num_single_layers = reader.integer("num_single_layers", config.num_single_layers, 0, io::kMaxConfigLayers);
  config.attention_head_dim = reader.integer("attention_head_dim", config.attention_head_dim, 1, io::kMaxConfigDim);
  config.num_attention_heads = reader.integer("num_attention_heads", config.num_attention_heads, 1, io::kMaxConfigDim);
  config.joint_attention_dim = reader.integer("joint_attention_dim", config.joint_attention_dim, 1, io::kMaxConfigDim);
  config.pooled_projection_dim = reader.integer("pooled_projection_dim", config.pooled_projection_dim, 1, io::kMaxConfigDim);
  config.guidance_embeds = reader.boolean("guidance_embeds", config.guidance_embeds);
  config.axes_dims_rope =
      reader.rope_axes("axes_dims_rope", config.axes_dims_rope, "attention_head_dim", config.attention_head_dim);
  reader.width("num_attention_heads", config.num_attention_heads, "attention_head_dim", config.attention_head_dim);
  return config;
}

// ---------------------------------------------------------------------------------------------
// Normalisation with modulation

AdaLayerNormZero::AdaLayerNormZero(int64_t embedding_dim) {
  linear = register_module("linear",
                           std::make_shared<nn::Linear>(nn::LinearOptions(embedding_dim, 6 * embedding_dim)));
}

AdaLayerNormZero::Output AdaLayerNormZero::forward(const at::Tensor& x, const at::Tensor& emb) {
  Output out;
  // [B, 6D]
  out.emb = linear->forward(at::silu(emb));
  const std::vector<at::Tensor> chunks = out.emb.chunk(6, 1);
  out.gate_msa = chunks[2];
  out.shift_mlp = chunks[3];
  out.scale_mlp = chunks[4];
  out.gate_mlp = chunks[5];
  out.hidden_states = nn::modulated_layer_norm(x, kNormEps, chunks[0], chunks[1]);
  return out;
}

AdaLayerNormZeroSingle::AdaLayerNormZeroSingle(int64_t embedding_dim) {
  linear = register_module("linear",
                           std::make_shared<nn::Linear>(nn::LinearOptions(embedding_dim, 3 * embedding_dim)));
}

AdaLayerNormZeroSingle::Output AdaLayerNormZeroSingle::forward(const at::Tensor& x, const at::Tensor& emb) {
  Output out;
  // [B, 3D]
  out.emb = linear->forward(at::silu(emb));
  const std::vector<at::Tensor> chunks = out.emb.chunk(3, 1);
  out.gate = chunks[2];
  out.hidden_states = nn::modulated_layer_norm(x, kNormEps, chunks[0], chunks[1]);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Conditioning embedding

CombinedTimestepGuidanceTextProjEmbeddings::CombinedTimestepGuidanceTextProjEmbeddings(int64_t embedding_dim,
                                                                                       int64_t pooled_projection_dim,
                                                                                       bool with_guidance)
    : time_proj(nn::TimestepsOptions(256, /*flip_sin_to_cos=*/true, /*downscale_freq_shift=*/0)) {
  timestep_embedder = register_module("timestep_embedder", std::make_shared<nn::TimestepEmbedding>(256, embedding_dim));
  if (with_guidance) {
    guidance_embedder = register_module("guidance_embedder", std::make_shared<nn::TimestepEmbedding>(256, embedding_dim));
  }
  text_embedder = register_module("text_embedder", std::make_shared<nn::PixArtAlphaTextProjection>(
                                                       pooled_projection_dim, embedding_dim));
}

at::Tensor CombinedTimestepGuidanceTextProjEmbeddings::forward(const at::Tensor& timestep,
                                                               const std::optional<at::Tensor>& guidance,
                                                               const at::Tensor& pooled_projection) {
  const at::ScalarType dtype = pooled_projection.scalar_type();
  // [B, 256] fp32
  const at::Tensor timesteps_proj = time_proj.forward(timestep);
  emit("temb.timestep_proj", timesteps_proj);
  // [B, D]
  at::Tensor conditioning = timestep_embedder->forward(timesteps_proj.to(dtype));
  emit("temb.timestep_emb", conditioning);
  if (guidance_embedder) {
    TORCH_INTERNAL_ASSERT(guidance.has_value(), "guidance missing for a guidance-distilled model");
    const at::Tensor guidance_proj = time_proj.forward(*guidance);
    emit("temb.guidance_proj", guidance_proj);
    const at::Tensor guidance_emb = guidance_embedder->forward(guidance_proj.to(dtype));
    emit("temb.guidance_emb", guidance_emb);
    conditioning = conditioning + guidance_emb;
  }
  const at::Tensor pooled_emb = text_embedder->forward(pooled_projection);
  emit("temb.pooled_emb", pooled_emb);
  return conditioning + pooled_emb;
}

// ---------------------------------------------------------------------------------------------
// Attention

FluxAttention::FluxAttention(const FluxAttentionOptions& options) : options_(options) {
  const int64_t inner_dim = options.heads * options.dim_head;
  const auto rms = [&] { return std::make_shared<nn::RMSNorm>(nn::RMSNormOptions(options.dim_head).with_eps(options.eps)); };
  const auto linear = [](int64_t in, int64_t out) { return std::make_shared<nn::Linear>(nn::LinearOptions(in, out)); };
  norm_q = register_module("norm_q", rms());
  norm_k = register_module("norm_k", rms());
  to_q = register_module("to_q", linear(options.query_dim, inner_dim));
  to_k = register_module("to_k", linear(options.query_dim, inner_dim));
  to_v = register_module("to_v", linear(options.query_dim, inner_dim));
  if (!options.pre_only) {
    to_out = register_module("to_out", std::make_shared<nn::ModuleList<nn::Linear>>());
    to_out->push_back(linear(inner_dim, options.query_dim));
  }
  if (options.added_kv_proj_dim > 0) {
    norm_added_q = register_module("norm_added_q", rms());
    norm_added_k = register_module("norm_added_k", rms());
    add_q_proj = register_module("add_q_proj", linear(options.added_kv_proj_dim, inner_dim));
    add_k_proj = register_module("add_k_proj", linear(options.added_kv_proj_dim, inner_dim));
    add_v_proj = register_module("add_v_proj", linear(options.added_kv_proj_dim, inner_dim));
    to_add_out = register_module("to_add_out", linear(inner_dim, options.query_dim));
  }
}

FluxAttention::Output FluxAttention::forward(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                                             const nn::RotaryEmbedding& rope) {
  SHARDIT_PROFILE_SCOPE("FluxAttention");
  // hidden_states [B, N, D]; encoder_hidden_states [B, L, D] or undefined
  // [B, N, H_local, hd]
  const nn::HeadsQKV image =
      nn::project_heads(hidden_states, {*to_q, *to_k, *to_v, norm_q.get(), norm_k.get()}, options_.dim_head);
  Output out;
  if (!encoder_hidden_states.defined()) {
    // [B, S, H_local * hd]
    const at::Tensor attended = nn::attention(image, &rope);
    out.hidden_states = options_.pre_only ? attended : (*to_out)[0].forward(attended);
    return out;
  }
  TORCH_INTERNAL_ASSERT(add_q_proj, "FluxAttention: encoder_hidden_states given to an attention without added KV");
  const int64_t text_len = encoder_hidden_states.size(1);
  // [B, L, H_local, hd]
  const nn::HeadsQKV text = nn::project_heads(
      encoder_hidden_states, {*add_q_proj, *add_k_proj, *add_v_proj, norm_added_q.get(), norm_added_k.get()},
      options_.dim_head);
  // The RoPE table covers [text; image].
  const nn::RotaryEmbedding text_rope = rope.slice(0, text_len);
  const nn::RotaryEmbedding image_rope = rope.slice(text_len, rope.cos.size(0));
  // [B, L, H_local * hd] and [B, N, H_local * hd]
  const auto [text_attended, image_attended] = nn::joint_attention(text, image, &text_rope, &image_rope);
  out.hidden_states = (*to_out)[0].forward(image_attended);
  out.encoder_hidden_states = to_add_out->forward(text_attended);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Blocks

FluxTransformerBlock::FluxTransformerBlock(int64_t dim, int64_t num_attention_heads, int64_t attention_head_dim) {
  norm1 = register_module("norm1", std::make_shared<AdaLayerNormZero>(dim));
  norm1_context = register_module("norm1_context", std::make_shared<AdaLayerNormZero>(dim));
  FluxAttentionOptions attn_options{dim, num_attention_heads, attention_head_dim};
  attn_options.added_kv_proj_dim = dim;
  attn_options.eps = kNormEps;
  attn = register_module("attn", std::make_shared<FluxAttention>(attn_options));
  // norm2 / norm2_context: LayerNorm without affine parameters (nn::layer_norm below).
  ff = register_module("ff", std::make_shared<nn::FeedForward>(nn::FeedForwardOptions(dim)));
  ff_context = register_module("ff_context", std::make_shared<nn::FeedForward>(nn::FeedForwardOptions(dim)));
}

std::pair<at::Tensor, at::Tensor> FluxTransformerBlock::forward(const at::Tensor& hidden_states,
                                                                const at::Tensor& encoder_hidden_states,
                                                                const at::Tensor& temb, const nn::RotaryEmbedding& rope) {
  SHARDIT_PROFILE_SCOPE("FluxTransformerBlock");
  // hidden_states [B, N, D], encoder_hidden_states [B, L, D], temb [B, D]
  const AdaLayerNormZero::Output img = norm1->forward(hidden_states, temb);
  const AdaLayerNormZero::Output txt = norm1_context->forward(encoder_hidden_states, temb);
  emit("norm1.linear", img.emb);
  emit("norm1_context.linear", txt.emb);

  const FluxAttention::Output attention = attn->forward(img.hidden_states, txt.hidden_states, rope);
  emit("attn.hidden_states", attention.hidden_states);
  emit("attn.encoder_hidden_states", attention.encoder_hidden_states);

  // Image stream. [B, N, D]
  at::Tensor image = nn::gated_residual(hidden_states, img.gate_msa, attention.hidden_states);
  const at::Tensor ff_output = ff->forward(nn::modulated_layer_norm(image, kNormEps, img.shift_mlp, img.scale_mlp));
  emit("ff", ff_output);
  image = nn::gated_residual(image, img.gate_mlp, ff_output);

  // Text stream. [B, L, D]
  at::Tensor text = nn::gated_residual(encoder_hidden_states, txt.gate_msa, attention.encoder_hidden_states);
  const at::Tensor ff_context_output =
      ff_context->forward(nn::modulated_layer_norm(text, kNormEps, txt.shift_mlp, txt.scale_mlp));
  emit("ff_context", ff_context_output);
  text = nn::gated_residual(text, txt.gate_mlp, ff_context_output);
  return {text, image};
}

FluxSingleTransformerBlock::FluxSingleTransformerBlock(int64_t dim, int64_t num_attention_heads,
                                                       int64_t attention_head_dim, double mlp_ratio) {
  const auto mlp_hidden_dim = static_cast<int64_t>(static_cast<double>(dim) * mlp_ratio);
  norm = register_module("norm", std::make_shared<AdaLayerNormZeroSingle>(dim));
  proj_mlp = register_module("proj_mlp", std::make_shared<nn::Linear>(nn::LinearOptions(dim, mlp_hidden_dim)));
  // The input is cat[attn, mlp]: packed rowwise sharding splits each block on its own.
  proj_out = register_module("proj_out", std::make_shared<nn::Linear>(
                                             nn::LinearOptions(dim + mlp_hidden_dim, dim).with_in_blocks({dim, mlp_hidden_dim})));
  FluxAttentionOptions attn_options{dim, num_attention_heads, attention_head_dim};
  attn_options.pre_only = true;
  attn_options.eps = kNormEps;
  attn = register_module("attn", std::make_shared<FluxAttention>(attn_options));
}

at::Tensor FluxSingleTransformerBlock::forward(const at::Tensor& hidden_states, const at::Tensor& temb,
                                               const nn::RotaryEmbedding& rope) {
  SHARDIT_PROFILE_SCOPE("FluxSingleTransformerBlock");
  // hidden_states [B, S, D], temb [B, D]
  const AdaLayerNormZeroSingle::Output normed = norm->forward(hidden_states, temb);
  emit("norm.linear", normed.emb);
  // [B, S, 4D_local]: act_mlp(proj_mlp(x)), GELU(tanh); proj_mlp's own output is emitted where it
  // exists (the AMX kernel runs the GELU in the product's epilogue).
  const at::Tensor mlp = proj_mlp->forward_gelu_tanh(normed.hidden_states,
                                                     [this](const at::Tensor& pre) { emit("proj_mlp", pre); });
  // [B, S, D_local]
  const at::Tensor attention = attn->forward(normed.hidden_states, at::Tensor(), rope).hidden_states;
  emit("attn", attention);
  // [B, S, D_local + 4D_local] -> [B, S, D], without materialising cat[attention, mlp]
  const at::Tensor projected = proj_out->forward_blocks({attention, mlp});
  return nn::gated_residual(hidden_states, normed.gate, projected);
}

// ---------------------------------------------------------------------------------------------
// Model

FluxTransformer2DModel::FluxTransformer2DModel(const FluxTransformer2DModelConfig& config)
    : JointTransformer2DModel(config.num_attention_heads), config(config), pos_embed(10000.0, config.axes_dims_rope) {
  const int64_t inner_dim = config.inner_dim();
  time_text_embed = register_module("time_text_embed", std::make_shared<CombinedTimestepGuidanceTextProjEmbeddings>(
                                                           inner_dim, config.pooled_projection_dim, config.guidance_embeds));
  context_embedder = register_module(
      "context_embedder", std::make_shared<nn::Linear>(nn::LinearOptions(config.joint_attention_dim, inner_dim)));
  x_embedder = register_module("x_embedder", std::make_shared<nn::Linear>(nn::LinearOptions(config.in_channels, inner_dim)));
  transformer_blocks =
      register_module("transformer_blocks", std::make_shared<nn::ModuleList<FluxTransformerBlock>>());
  for (int64_t i = 0; i < config.num_layers; ++i) {
    transformer_blocks->push_back(
        std::make_shared<FluxTransformerBlock>(inner_dim, config.num_attention_heads, config.attention_head_dim));
  }
  single_transformer_blocks =
      register_module("single_transformer_blocks", std::make_shared<nn::ModuleList<FluxSingleTransformerBlock>>());
  for (int64_t i = 0; i < config.num_single_layers; ++i) {
    single_transformer_blocks->push_back(
        std::make_shared<FluxSingleTransformerBlock>(inner_dim, config.num_attention_heads, config.attention_head_dim));
  }
  norm_out = register_module("norm_out", std::make_shared<nn::AdaLayerNormContinuous>(nn::AdaLayerNormContinuousOptions(inner_dim, inner_dim).with_eps(kNormEps)));
  proj_out = register_module("proj_out", std::make_shared<nn::Linear>(nn::LinearOptions(
                                             inner_dim, config.patch_size * config.patch_size * config.resolved_out_channels())));
}

// Counts of the live tensors, in units of the inner dim D per token, read from the block code.
// Attention phase, at the scores' peak (the product with v): full are the block input and its
// normed, modulated copy (2); local are q, k after the per-head RMSNorm and v (3), q and k after
// RoPE (2, the normed ones stay referenced), and the product's operand copy and output (2): 7.
// Double blocks also hold the joint [text; image] cat of q, k, v: +3.
StepModel FluxTransformer2DModel::step_model(const StepShape& shape) const {
  const int64_t n = image_tokens(shape, 16);
  const int64_t s = n + shape.text_tokens;
  const int64_t d = config.inner_dim();
  const int64_t mlp = 4 * d;
  StepModel step{{}, s, config.num_attention_heads, config.attention_head_dim};
  if (config.num_single_layers > 0) {
    // Single block: MLP hidden (gelu in place) beside attention; then cat[attn | mlp] into
    // proj_out, its full output, the gated residual.
    step.phases.push_back({s, 2 * d, 7 * d + mlp, true});
    step.phases.push_back({s, 3 * d, 2 * (d + mlp)});
  }
  if (config.num_layers > 0) {
    step.phases.push_back({s, 2 * d, 10 * d, true});
    // Feed-forward of the image stream: hidden, normed, output full; GELU hidden local.
    step.phases.push_back({n, 3 * d, mlp});
  }
  return step;
}

FluxTransformer2DModelInputs FluxTransformer2DModelInputs::from_file(const io::SafetensorsFile& file) {
  FluxTransformer2DModelInputs inputs;
  inputs.hidden_states = file.read("hidden_states");
  inputs.encoder_hidden_states = file.read("encoder_hidden_states");
  inputs.pooled_projections = file.read("pooled_projections");
  inputs.timestep = file.read("timestep");
  inputs.img_ids = file.read("img_ids");
  inputs.txt_ids = file.read("txt_ids");
  inputs.guidance = file.read_if_present("guidance");
  return inputs;
}

at::Tensor FluxTransformer2DModel::forward_from_file(const io::SafetensorsFile& inputs) {
  return forward(FluxTransformer2DModelInputs::from_file(inputs));
}

// diffusers' FLUX.1 LoRA conversions (kohya, BFL, XLabs; loaders/lora_conversion_utils.py):
// BFL's fused qkv and linear1 split by rows; kohya's
// sources outside the blocks are converted without the `transformer.` prefix and then not loaded.
const LoraKeyConventions& FluxTransformer2DModel::lora_conventions() const {
  static const LoraKeyConventions conventions = [] {
    LoraKeyConventions c;
    c.family = "FLUX.1";
    c.bfl_double_block = {
        {"img_attn_qkv", {"attn.to_q", "attn.to_k", "attn.to_v"}},
        {"img_attn_proj", {"attn.to_out.0"}},
        {"img_mlp_0", {"ff.net.0.proj"}},
        {"img_mlp_2", {"ff.net.2"}},
        {"img_mod_lin", {"norm1.linear"}},
        {"txt_attn_qkv", {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"}},
        {"txt_attn_proj", {"attn.to_add_out"}},
        {"txt_mlp_0", {"ff_context.net.0.proj"}},
        {"txt_mlp_2", {"ff_context.net.2"}},
        {"txt_mod_lin", {"norm1_context.linear"}},
    };
    c.bfl_single_block = {
        {"linear1", {"attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"}},
        {"linear2", {"proj_out"}},
        {"modulation_lin", {"norm.linear"}},
    };
    c.kohya_skipped_prefixes = {"img_in", "txt_in", "time_in_", "vector_in_", "guidance_in_", "final_layer_"};
    c.xlabs_double_block = {
        {"qkv_lora1", {"attn.to_q", "attn.to_k", "attn.to_v"}},
        {"proj_lora1", {"attn.to_out.0"}},
        {"qkv_lora2", {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"}},
        {"proj_lora2", {"attn.to_add_out"}},
    };
    c.xlabs_single_block = {
        {"qkv_lora", {"attn.to_q", "attn.to_k", "attn.to_v"}},
        {"proj_lora", {"proj_out"}},
    };
    return c;
  }();
  return conventions;
}

std::vector<std::string> FluxTransformer2DModel::high_precision_modules() const {
  // Left dense by --weights-dtype (docs/quantization.md): the embedders, the modulation and the
  // output head. The modulation sets every token's shift, scale and gate in every block; the
  // embedders and the head are small, so dense costs little memory.
  return {
      "x_embedder", "context_embedder", "time_text_embed.*", "transformer_blocks.*.norm1.linear",
      "transformer_blocks.*.norm1_context.linear", "single_transformer_blocks.*.norm.linear", "norm_out.*",
      "proj_out"};
}

const std::vector<SingleFileLayout>& FluxTransformer2DModel::single_file_layouts() {
  // Black Forest Labs' FLUX.1 files (flux1-dev.safetensors, ComfyUI's copies under
  // `model.diffusion_model.`): diffusers' convert_flux_transformer_checkpoint_to_diffusers as data.
  // The fused qkv and linear1 are split by the model's own row counts (D, D, D, mlp), not by a
  // fixed width.
  static const std::vector<SingleFileLayout> layouts = {
      {"BFL",
       {"", "model.diffusion_model."},
       {"double_blocks.0.img_mod.lin.weight"},
       {
           {"time_in.in_layer", {"time_text_embed.timestep_embedder.linear_1"}},
           {"time_in.out_layer", {"time_text_embed.timestep_embedder.linear_2"}},
           {"vector_in.in_layer", {"time_text_embed.text_embedder.linear_1"}},
           {"vector_in.out_layer", {"time_text_embed.text_embedder.linear_2"}},
           {"guidance_in.in_layer", {"time_text_embed.guidance_embedder.linear_1"}},
           {"guidance_in.out_layer", {"time_text_embed.guidance_embedder.linear_2"}},
           {"txt_in", {"context_embedder"}},
           {"img_in", {"x_embedder"}},
           {"double_blocks.*.img_mod.lin", {"transformer_blocks.*.norm1.linear"}},
           {"double_blocks.*.txt_mod.lin", {"transformer_blocks.*.norm1_context.linear"}},
           {"double_blocks.*.img_attn.qkv",
            {"transformer_blocks.*.attn.to_q", "transformer_blocks.*.attn.to_k", "transformer_blocks.*.attn.to_v"}},
           {"double_blocks.*.txt_attn.qkv",
            {"transformer_blocks.*.attn.add_q_proj", "transformer_blocks.*.attn.add_k_proj",
             "transformer_blocks.*.attn.add_v_proj"}},
           {"double_blocks.*.img_attn.norm.query_norm", {"transformer_blocks.*.attn.norm_q"}, "scale"},
           {"double_blocks.*.img_attn.norm.key_norm", {"transformer_blocks.*.attn.norm_k"}, "scale"},
           {"double_blocks.*.txt_attn.norm.query_norm", {"transformer_blocks.*.attn.norm_added_q"}, "scale"},
           {"double_blocks.*.txt_attn.norm.key_norm", {"transformer_blocks.*.attn.norm_added_k"}, "scale"},
           {"double_blocks.*.img_mlp.0", {"transformer_blocks.*.ff.net.0.proj"}},
           {"double_blocks.*.img_mlp.2", {"transformer_blocks.*.ff.net.2"}},
           {"double_blocks.*.txt_mlp.0", {"transformer_blocks.*.ff_context.net.0.proj"}},
           {"double_blocks.*.txt_mlp.2", {"transformer_blocks.*.ff_context.net.2"}},
           {"double_blocks.*.img_attn.proj", {"transformer_blocks.*.attn.to_out.0"}},
           {"double_blocks.*.txt_attn.proj", {"transformer_blocks.*.attn.to_add_out"}},
           {"single_blocks.*.modulation.lin", {"single_transformer_blocks.*.norm.linear"}},
           {"single_blocks.*.linear1",
            {"single_transformer_blocks.*.attn.to_q", "single_transformer_blocks.*.attn.to_k",
             "single_transformer_blocks.*.attn.to_v", "single_transformer_blocks.*.proj_mlp"}},
           {"single_blocks.*.norm.query_norm", {"single_transformer_blocks.*.attn.norm_q"}, "scale"},
           {"single_blocks.*.norm.key_norm", {"single_transformer_blocks.*.attn.norm_k"}, "scale"},
           {"single_blocks.*.linear2", {"single_transformer_blocks.*.proj_out"}},
           {"final_layer.linear", {"proj_out"}},
           {"final_layer.adaLN_modulation.1", {"norm_out.linear"}, "weight", /*swapped_halves=*/true},
       },
       {kComfyScaledFp8Marker}},
      {"diffusers", {"", "model.diffusion_model."}, {"transformer_blocks.0.norm1.linear.weight"}, {},
       {kComfyScaledFp8Marker}},
  };
  return layouts;
}

const parallel::TpPlan& FluxTransformer2DModel::tp_plan() const {
  // diffusers' FLUX.1 plan: q/k/v and the FF input split by heads / hidden columns (colwise), the
  // projections back to D split by rows (rowwise, one all-reduce each). The single block's
  // proj_out reads cat[attn D | mlp 4D]: each block is split on its own (blocks declared by the
  // layer). Our addition: the AdaLN modulation linears (D -> 6D / 3D, a quarter of FLUX.1's
  // parameters) are split colwise and all-gathered instead of held whole on every rank.
  // Replicated (not listed): embedders, norm_out and proj_out (small), and the per-head RMSNorms.
  static const parallel::TpPlan plan = parallel::with_sharded_modulation(
      {"transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear",
       "single_transformer_blocks.*.norm.linear"},
      *reference_tp_plan());
  return plan;
}

const parallel::TpPlan* FluxTransformer2DModel::reference_tp_plan() const {
  using parallel::ShardStyle;
  // tp_plan() without the modulation linears: diffusers keeps them whole on every rank.
  static const parallel::TpPlan plan = {
      {"transformer_blocks.*.attn.to_q", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.to_k", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.to_v", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.to_out.0", ShardStyle::Rowwise},
      {"transformer_blocks.*.attn.add_q_proj", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.add_k_proj", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.add_v_proj", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.to_add_out", ShardStyle::Rowwise},
      {"transformer_blocks.*.ff.net.0.proj", ShardStyle::Colwise},
      {"transformer_blocks.*.ff.net.2", ShardStyle::Rowwise},
      {"transformer_blocks.*.ff_context.net.0.proj", ShardStyle::Colwise},
      {"transformer_blocks.*.ff_context.net.2", ShardStyle::Rowwise},
      {"single_transformer_blocks.*.attn.to_q", ShardStyle::Colwise},
      {"single_transformer_blocks.*.attn.to_k", ShardStyle::Colwise},
      {"single_transformer_blocks.*.attn.to_v", ShardStyle::Colwise},
      {"single_transformer_blocks.*.proj_mlp", ShardStyle::Colwise},
      {"single_transformer_blocks.*.proj_out", ShardStyle::PackedRowwise},
  };
  return &plan;
}

at::Tensor FluxTransformer2DModel::forward(const FluxTransformer2DModelInputs& inputs) {
  SHARDIT_PROFILE_SCOPE("FluxTransformer2DModel");
  // TaylorSeer: a forward it predicts runs nothing.
  if (std::optional<at::Tensor> predicted = predicted_output(inputs.hidden_states)) return *predicted;
  // Both token streams checked and, under context parallelism, split: [B, N_local, C], [B, L_local, C].
  JointForward joint(*this, inputs.hidden_states, config.in_channels, inputs.encoder_hidden_states,
                     config.joint_attention_dim);
  nn::check_shape(joint.where, "pooled_projections", inputs.pooled_projections,
                  {{"B", joint.batch}, config.pooled_projection_dim});

  // [B, N, D]
  at::Tensor hidden_states = x_embedder->forward(joint.to_model(joint.image_tokens));
  emit("x_embedder", hidden_states);

  // The model's own scaling of the pipeline's t/1000, in fp32.
  const at::Tensor timestep = joint.per_sample("timestep", inputs.timestep) * 1000;
  std::optional<at::Tensor> guidance = joint.optional_per_sample("guidance", inputs.guidance, config.guidance_embeds);
  if (guidance) *guidance = *guidance * 1000;
  // [B, D]
  const at::Tensor temb = time_text_embed->forward(timestep, guidance, joint.to_model(inputs.pooled_projections));
  emit("temb", temb);

  // [B, L, D]
  at::Tensor encoder_hidden_states = context_embedder->forward(joint.to_model(joint.text_tokens));
  emit("context_embedder", encoder_hidden_states);

  // [L_local, 3] and [N_local, 3] (diffusers deprecates the batched form [B, S, 3])
  const auto [txt_ids, img_ids] = joint.position_ids(inputs.txt_ids, inputs.img_ids, config.axes_dims_rope.size());
  // [L + N, head_dim] fp32, text first
  const nn::RotaryEmbedding rope = pos_embed.forward(at::cat({txt_ids, img_ids}, 0));
  emit("rope.cos", rope.cos);
  emit("rope.sin", rope.sin);

  run_transformer_blocks(joint, *transformer_blocks, hidden_states, encoder_hidden_states, temb, rope);
  // The reference's single blocks take and return the two streams: observed as such.
  run_single_transformer_blocks(joint, *single_transformer_blocks, SingleBlockOutput::Streams, hidden_states,
                                encoder_hidden_states, temb, rope);
  return output_head(joint, hidden_states, temb);
}

const parallel::CpPlan* FluxTransformer2DModel::cp_plan() const {
  using parallel::CpAction;
  using parallel::SequenceStream;
  // diffusers' `_cp_plan`: beside both token streams, their position ids split along the
  // sequence (the RoPE tables are computed from the local ids, so they travel with their tokens).
  static const parallel::CpPlan plan = joint_cp_plan({
      {"img_ids", CpAction::Split, 0, SequenceStream::Image},
      {"txt_ids", CpAction::Split, 0, SequenceStream::Text},
  });
  return &plan;
}

}  // namespace shardit::models

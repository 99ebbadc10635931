#include "shardit/models/qwen_image/transformer_qwenimage.h"
#include "shardit/io/file.h"
#include "shardit/io/json.h"
#include "shardit/core/profile.h"
#include "shardit/nn/inputs.h"

#include <c10/util/Exception.h>

#include <sstream>
#include <utility>

namespace shardit::models {

namespace {

constexpr double kNormEps = 1e-6;

/// The Timesteps scale of Qwen-Image: it multiplies t * freq (not t) by 1000.
constexpr double kTimestepScale = 1000.0;

std::string format_shapes(const std::vector<QwenImageShape>& shapes) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shapes.size(); ++i) {
    out << (i ? ", " : "") << "(" << shapes[i][0] << ", " << shapes[i][1] << ", " << shapes[i][2] << ")";
  }
  out << "]";
  return out.str();
}

/// Centred positions of an axis of n tokens: -(n - n/2) .. -1, 0 .. n/2 - 1 (fp32 [n]).
at::Tensor centred_positions(int64_t n) {
  return at::arange(n, at::TensorOptions().dtype(at::kFloat)) - static_cast<double>(n - n / 2);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Config

QwenImageTransformer2DModelConfig QwenImageTransformer2DModelConfig::from_json(const nlohmann::json& json,
                                                                               const std::string& source) {
  const io::ConfigReader reader(json, source);
  QwenImageTransformer2DModelConfig config;
  config.patch_size = reader.integer("patch_size", config.patch_size, 1, io::kMaxConfigDim);
  config.in_channels = reader.integer("in_channels", config.in_channels, 1, io::kMaxConfigDim);
  // diffusers' default is 16; an explicit null means in_channels.
  if (reader.contains("out_channels")) config.out_channels = reader.optional_integer("out_channels", 1, io::kMaxConfigDim);
  config.num_layers = reader.integer("num_layers", config.num_layers, 0, io::kMaxConfigLayers);
  config.attention_head_dim = reader.integer("attention_head_dim", config.attention_head_dim, 1, io::kMaxConfigDim);
  config.num_attention_heads = reader.integer("num_attention_heads", config.num_attention_heads, 1, io::kMaxConfigDim);
  config.joint_attention_dim = reader.integer("joint_attention_dim", config.joint_attention_dim, 1, io::kMaxConfigDim);
  config.axes_dims_rope = reader.rope_axes("axes_dims_rope", config.axes_dims_rope, "attention_head_dim",
                                           config.attention_head_dim, /*count=*/3);
  config.zero_cond_t = reader.boolean("zero_cond_t", config.zero_cond_t);
  for (const char* key : {"guidance_embeds", "use_additional_t_cond", "use_layer3d_rope"}) {
    reader.require(!reader.boolean(key, false), "'", key,
                   "' = true selects a Qwen-Image variant that is not supported; only the base and edit models "
                   "(guidance_embeds, use_additional_t_cond, use_layer3d_rope all false) are");
  }
  reader.width("num_attention_heads", config.num_attention_heads, "attention_head_dim", config.attention_head_dim);
  return config;
}

// ---------------------------------------------------------------------------------------------
// RoPE

QwenEmbedRope::QwenEmbedRope(double theta, std::vector<int64_t> axes_dim)
    : theta_(theta), axes_dim_(std::move(axes_dim)) {}

at::Tensor QwenEmbedRope::angles(const std::vector<at::Tensor>& axis_positions) const {
  TORCH_INTERNAL_ASSERT(axis_positions.size() == axes_dim_.size());
  std::vector<at::Tensor> parts;
  for (size_t a = 0; a < axes_dim_.size(); ++a) {
    const at::Tensor& pos = axis_positions[a];
    // fp32 as the reference: 1 / theta^(fl32(2j) / d), then fl32(pos * freq).
    const at::Tensor exponent = at::arange(0, axes_dim_[a], 2, pos.options()).div(static_cast<double>(axes_dim_[a]));
    const at::Tensor freqs = at::reciprocal(at::pow(theta_, exponent));
    parts.push_back(at::outer(pos, freqs));
  }
  // [S, head_dim / 2]
  return at::cat(parts, 1);
}

QwenEmbedRope::Tables QwenEmbedRope::forward(const std::vector<QwenImageShape>& shapes, int64_t text_len,
                                             at::Device device) const {
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
  std::vector<at::Tensor> frame_pos, height_pos, width_pos;
  int64_t max_vid_index = 0;
  for (size_t idx = 0; idx < shapes.size(); ++idx) {
    const auto [frames, height, width] = shapes[idx];
    const std::vector<int64_t> grid = {frames, height, width};
    // [F, H, W] each, flattened row-major (frame outer, width inner)
    const at::Tensor f = (at::arange(frames, f32) + static_cast<double>(idx)).view({frames, 1, 1}).expand(grid);
    const at::Tensor h = centred_positions(height).view({1, height, 1}).expand(grid);
    const at::Tensor w = centred_positions(width).view({1, 1, width}).expand(grid);
    frame_pos.push_back(f.reshape({-1}));
    height_pos.push_back(h.reshape({-1}));
    width_pos.push_back(w.reshape({-1}));
    max_vid_index = std::max({max_vid_index, height / 2, width / 2});
  }
  Tables tables;
  tables.img_angles = angles({at::cat(frame_pos), at::cat(height_pos), at::cat(width_pos)}).to(device);
  const at::Tensor text_pos = at::arange(text_len, f32) + static_cast<double>(max_vid_index);
  tables.txt_angles = angles({text_pos, text_pos, text_pos}).to(device);
  return tables;
}

namespace {

/// Real cos/sin tables [S, head_dim] (each pair's angle repeated) from angles [S, head_dim / 2].
nn::RotaryEmbedding rotary_from_angles(const at::Tensor& angles) {
  return {at::cos(angles).repeat_interleave(2, 1), at::sin(angles).repeat_interleave(2, 1)};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Conditioning and modulation

QwenTimestepProjEmbeddings::QwenTimestepProjEmbeddings(int64_t embedding_dim)
    : time_proj([] {
        nn::TimestepsOptions options(256, /*flip_sin_to_cos=*/true, /*downscale_freq_shift=*/0);
        options.scale = kTimestepScale;
        return options;
      }()) {
  timestep_embedder = register_module("timestep_embedder", std::make_shared<nn::TimestepEmbedding>(256, embedding_dim));
}

at::Tensor QwenTimestepProjEmbeddings::forward(const at::Tensor& timestep, at::ScalarType dtype) {
  // [B, 256] fp32
  const at::Tensor timesteps_proj = time_proj.forward(timestep);
  emit("temb.timestep_proj", timesteps_proj);
  // [B, D]
  const at::Tensor timesteps_emb = timestep_embedder->forward(timesteps_proj.to(dtype));
  emit("temb.timestep_emb", timesteps_emb);
  return timesteps_emb;
}

QwenModulation::QwenModulation(int64_t dim) {
  // "0" is the parameter-free SiLU.
  linear = register_module("1", std::make_shared<nn::Linear>(nn::LinearOptions(dim, 6 * dim)));
}

at::Tensor QwenModulation::forward(const at::Tensor& temb) { return linear->forward(at::silu(temb)); }

// ---------------------------------------------------------------------------------------------
// Attention

QwenDoubleStreamAttention::QwenDoubleStreamAttention(int64_t dim, int64_t heads, int64_t dim_head, double eps)
    : head_dim_(dim_head) {
  const int64_t inner_dim = heads * dim_head;
  const auto rms = [&] { return std::make_shared<nn::RMSNorm>(nn::RMSNormOptions(dim_head).with_eps(eps)); };
  const auto linear = [](int64_t in, int64_t out) { return std::make_shared<nn::Linear>(nn::LinearOptions(in, out)); };
  to_q = register_module("to_q", linear(dim, inner_dim));
  to_k = register_module("to_k", linear(dim, inner_dim));
  to_v = register_module("to_v", linear(dim, inner_dim));
  norm_q = register_module("norm_q", rms());
  norm_k = register_module("norm_k", rms());
  to_out = register_module("to_out", std::make_shared<nn::ModuleList<nn::Linear>>());
  to_out->push_back(linear(inner_dim, dim));
  add_q_proj = register_module("add_q_proj", linear(dim, inner_dim));
  add_k_proj = register_module("add_k_proj", linear(dim, inner_dim));
  add_v_proj = register_module("add_v_proj", linear(dim, inner_dim));
  norm_added_q = register_module("norm_added_q", rms());
  norm_added_k = register_module("norm_added_k", rms());
  to_add_out = register_module("to_add_out", linear(inner_dim, dim));
}

std::pair<at::Tensor, at::Tensor> QwenDoubleStreamAttention::forward(const at::Tensor& hidden_states,
                                                                     const at::Tensor& encoder_hidden_states,
                                                                     const nn::RotaryEmbedding& img_rope,
                                                                     const nn::RotaryEmbedding& txt_rope,
                                                                     const std::optional<at::Tensor>& key_mask) {
  SHARDIT_PROFILE_SCOPE("QwenDoubleStreamAttention");
  // hidden_states [B, N, D], encoder_hidden_states [B, L, D]
  // [B, N, H_local, hd] and [B, L, H_local, hd]
  const nn::HeadsQKV image = nn::project_heads(hidden_states, {*to_q, *to_k, *to_v, norm_q.get(), norm_k.get()}, head_dim_);
  const nn::HeadsQKV text = nn::project_heads(
      encoder_hidden_states, {*add_q_proj, *add_k_proj, *add_v_proj, norm_added_q.get(), norm_added_k.get()}, head_dim_);
  // [B, L, H_local * hd] and [B, N, H_local * hd]
  const auto [text_attended, image_attended] = nn::joint_attention(text, image, &txt_rope, &img_rope, key_mask);
  return {(*to_out)[0].forward(image_attended), to_add_out->forward(text_attended)};
}

// ---------------------------------------------------------------------------------------------
// Block

QwenImageTransformerBlock::QwenImageTransformerBlock(int64_t dim, int64_t num_attention_heads,
                                                     int64_t attention_head_dim, double eps)
    : eps_(eps) {
  img_mod = register_module("img_mod", std::make_shared<QwenModulation>(dim));
  attn = register_module("attn",
                         std::make_shared<QwenDoubleStreamAttention>(dim, num_attention_heads, attention_head_dim, eps));
  img_mlp = register_module("img_mlp", std::make_shared<nn::FeedForward>(nn::FeedForwardOptions(dim).with_dim_out(dim)));
  txt_mod = register_module("txt_mod", std::make_shared<QwenModulation>(dim));
  txt_mlp = register_module("txt_mlp", std::make_shared<nn::FeedForward>(nn::FeedForwardOptions(dim).with_dim_out(dim)));
}

std::pair<at::Tensor, at::Tensor> QwenImageTransformerBlock::forward(
    const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states, const at::Tensor& temb,
    const nn::RotaryEmbedding& img_rope, const nn::RotaryEmbedding& txt_rope, const std::optional<at::Tensor>& key_mask,
    const std::optional<at::Tensor>& reference_tokens) {
  SHARDIT_PROFILE_SCOPE("QwenImageTransformerBlock");
  // hidden_states [B, N, D], encoder_hidden_states [B, L, D], temb [B, D] ([2B, D] with
  // reference_tokens)
  // [B, 6D] each ([2B, 6D] for the image): [shift, scale, gate] (attention), [shift, scale, gate] (MLP)
  const at::Tensor img_params = img_mod->forward(temb);
  const int64_t batch = hidden_states.size(0);
  const at::Tensor txt_params = txt_mod->forward(reference_tokens ? temb.narrow(0, 0, batch) : temb);
  emit("img_mod", img_params);
  emit("txt_mod", txt_params);
  std::vector<at::Tensor> img = img_params.chunk(6, 1);
  const std::vector<at::Tensor> txt = txt_params.chunk(6, 1);
  if (reference_tokens) {
    // Per token: the step's parameters (rows [0, B)) on the noise tokens, timestep 0's (rows
    // [B, 2B)) on the reference tokens. [B, N, 1] selecting [B, 1, D] -> [B, N, D]
    const at::Tensor on_reference = reference_tokens->unsqueeze(-1);
    for (at::Tensor& parameter : img) {
      parameter = at::where(on_reference, parameter.narrow(0, batch, batch).unsqueeze(1),
                            parameter.narrow(0, 0, batch).unsqueeze(1));
    }
  }

  const at::Tensor img_modulated = nn::modulated_layer_norm(hidden_states, eps_, img[0], img[1]);
  const at::Tensor txt_modulated = nn::modulated_layer_norm(encoder_hidden_states, eps_, txt[0], txt[1]);

  const auto [img_attn, txt_attn] = attn->forward(img_modulated, txt_modulated, img_rope, txt_rope, key_mask);
  emit("attn.hidden_states", img_attn);
  emit("attn.encoder_hidden_states", txt_attn);

  // Image stream. [B, N, D]
  at::Tensor image = nn::gated_residual(hidden_states, img[2], img_attn);
  const at::Tensor img_mlp_out = img_mlp->forward(nn::modulated_layer_norm(image, eps_, img[3], img[4]));
  emit("img_mlp", img_mlp_out);
  image = nn::gated_residual(image, img[5], img_mlp_out);

  // Text stream. [B, L, D]
  at::Tensor text = nn::gated_residual(encoder_hidden_states, txt[2], txt_attn);
  const at::Tensor txt_mlp_out = txt_mlp->forward(nn::modulated_layer_norm(text, eps_, txt[3], txt[4]));
  emit("txt_mlp", txt_mlp_out);
  text = nn::gated_residual(text, txt[5], txt_mlp_out);

  if (image.scalar_type() == at::kHalf) {
    // The reference clips fp16 streams to the finite range.
    image = image.clamp(-65504, 65504);
    text = text.clamp(-65504, 65504);
  }
  return {text, image};
}

// ---------------------------------------------------------------------------------------------
// Model


QwenImageTransformer2DModel::QwenImageTransformer2DModel(const QwenImageTransformer2DModelConfig& config)
    : JointTransformer2DModel(config.num_attention_heads), config(config), pos_embed(10000.0, config.axes_dims_rope) {
  const int64_t inner_dim = config.inner_dim();
  time_text_embed = register_module("time_text_embed", std::make_shared<QwenTimestepProjEmbeddings>(inner_dim));
  txt_norm = register_module(
      "txt_norm", std::make_shared<nn::RMSNorm>(nn::RMSNormOptions(config.joint_attention_dim).with_eps(kNormEps)));
  img_in = register_module("img_in", std::make_shared<nn::Linear>(nn::LinearOptions(config.in_channels, inner_dim)));
  txt_in = register_module("txt_in",
                           std::make_shared<nn::Linear>(nn::LinearOptions(config.joint_attention_dim, inner_dim)));
  transformer_blocks =
      register_module("transformer_blocks", std::make_shared<nn::ModuleList<QwenImageTransformerBlock>>());
  for (int64_t i = 0; i < config.num_layers; ++i) {
    transformer_blocks->push_back(std::make_shared<QwenImageTransformerBlock>(inner_dim, config.num_attention_heads,
                                                                              config.attention_head_dim, kNormEps));
  }
  norm_out = register_module("norm_out", std::make_shared<nn::AdaLayerNormContinuous>(
                                             nn::AdaLayerNormContinuousOptions(inner_dim, inner_dim).with_eps(kNormEps)));
  proj_out = register_module("proj_out", std::make_shared<nn::Linear>(nn::LinearOptions(
                                             inner_dim, config.patch_size * config.patch_size * config.resolved_out_channels())));
}

// Counts of the live tensors per token in units of D, as FluxTransformer2DModel::step_model's.
StepModel QwenImageTransformer2DModel::step_model(const StepShape& shape) const {
  const int64_t n = image_tokens(shape, 8 * config.patch_size);
  const int64_t s = n + shape.text_tokens;
  const int64_t d = config.inner_dim();
  StepModel step{{}, s, config.num_attention_heads, config.attention_head_dim};
  step.phases.push_back({s, 2 * d, 10 * d, true});
  step.phases.push_back({n, 3 * d, 4 * d});
  return step;
}

namespace {

/// The directory part of a file path ("." when there is none).
std::string parent_dir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

using QwenShapes = std::vector<std::vector<QwenImageShape>>;

/// One (frame, height, width) grid read from a file, bounded so that the token counts of up to
/// kMaxConfigLayers grids can never wrap around (which would pass the token-count check).
QwenImageShape checked_grid(int64_t frame, int64_t height, int64_t width, const std::string& source) {
  for (const int64_t value : {frame, height, width}) {
    TORCH_CHECK(value >= 1 && value <= io::kMaxConfigDim, source, ": img_shapes grid (", frame, ", ", height, ", ",
                width, ") has an entry out of the accepted range [1, ", io::kMaxConfigDim, "]");
  }
  // Each entry is at most 2^20, so the product fits 64 bits.
  TORCH_CHECK(frame * height * width <= io::kMaxConfigDim * io::kMaxConfigDim, source, ": img_shapes grid (", frame,
              ", ", height, ", ", width, ") holds more tokens than any image can");
  return {frame, height, width};
}

/// img_shapes from an int64 tensor [B, K, 3] or [B, 3].
QwenShapes shapes_from_tensor(const at::Tensor& tensor, const std::string& source) {
  TORCH_CHECK((tensor.dim() == 2 || tensor.dim() == 3) && tensor.size(-1) == 3, source,
              ": img_shapes must be [B, 3] or [B, K, 3] (frame, height, width), got ", tensor.sizes());
  TORCH_CHECK(!at::isFloatingType(tensor.scalar_type()) && tensor.scalar_type() != at::kBool, source,
              ": img_shapes must be an integer tensor, got ", tensor.scalar_type());
  TORCH_CHECK(tensor.dim() == 2 || tensor.size(1) <= io::kMaxConfigLayers, source, ": img_shapes lists ",
              tensor.size(1), " grids per sample, more than ", io::kMaxConfigLayers);
  const at::Tensor values = (tensor.dim() == 2 ? tensor.unsqueeze(1) : tensor).to(at::kLong).contiguous();
  QwenShapes shapes(values.size(0));
  const auto acc = values.accessor<int64_t, 3>();
  for (int64_t b = 0; b < values.size(0); ++b) {
    for (int64_t k = 0; k < values.size(1); ++k) {
      shapes[b].push_back(checked_grid(acc[b][k][0], acc[b][k][1], acc[b][k][2], source));
    }
  }
  return shapes;
}

/// img_shapes from inputs.json's non_tensor_kwargs: [[[f, h, w], ...], ...].
QwenShapes shapes_from_json(const std::string& json_path) {
  TORCH_CHECK(io::regular_file_problem(json_path).empty(), io::regular_file_problem(json_path),
              "; QwenImageTransformer2DModel needs img_shapes (the (frame, height, width) token grid of each sample): ",
              "put an `img_shapes` int64 tensor [B, K, 3] in the inputs file or `non_tensor_kwargs.img_shapes` in an ",
              "inputs.json next to it");
  const nlohmann::json json = io::read_json_file(json_path);
  TORCH_CHECK(json.is_object() && json.contains("non_tensor_kwargs") && json["non_tensor_kwargs"].is_object() &&
                  json["non_tensor_kwargs"].contains("img_shapes"),
              json_path, ": no non_tensor_kwargs.img_shapes; QwenImageTransformer2DModel needs the token grid of ",
              "each sample as [[[frame, height, width], ...], ...]");
  const nlohmann::json& value = json["non_tensor_kwargs"]["img_shapes"];
  TORCH_CHECK(value.is_array(), json_path, ": non_tensor_kwargs.img_shapes must be a list per sample");
  QwenShapes shapes;
  for (const auto& sample : value) {
    TORCH_CHECK(sample.is_array() && sample.size() <= static_cast<size_t>(io::kMaxConfigLayers), json_path,
                ": each img_shapes entry must be a list of at most ", io::kMaxConfigLayers, " [frame, height, width]");
    std::vector<QwenImageShape> grids;
    for (const auto& grid : sample) {
      TORCH_CHECK(grid.is_array() && grid.size() == 3 && grid[0].is_number_integer() && grid[1].is_number_integer() &&
                      grid[2].is_number_integer(),
                  json_path, ": each grid of img_shapes must be [frame, height, width] integers, got ", grid.dump());
      grids.push_back(checked_grid(grid[0].get<int64_t>(), grid[1].get<int64_t>(), grid[2].get<int64_t>(), json_path));
    }
    shapes.push_back(std::move(grids));
  }
  return shapes;
}

}  // namespace

QwenImageTransformer2DModelInputs QwenImageTransformer2DModelInputs::from_file(const io::SafetensorsFile& file) {
  QwenImageTransformer2DModelInputs inputs;
  inputs.hidden_states = file.read("hidden_states");
  inputs.encoder_hidden_states = file.read("encoder_hidden_states");
  inputs.encoder_hidden_states_mask = file.read_if_present("encoder_hidden_states_mask");
  inputs.timestep = file.read("timestep");
  inputs.img_shapes = file.contains("img_shapes") ? shapes_from_tensor(file.read("img_shapes"), file.path())
                                                  : shapes_from_json(parent_dir(file.path()) + "/inputs.json");
  return inputs;
}

at::Tensor QwenImageTransformer2DModel::forward_from_file(const io::SafetensorsFile& inputs) {
  return forward(QwenImageTransformer2DModelInputs::from_file(inputs));
}

// diffusers' Qwen-Image LoRA conversion (loaders/lora_conversion_utils.py): kohya names are the diffusers module
// paths with `_`, every kohya module has its alpha, and lora_A/lora_B files lose their alphas.
const LoraKeyConventions& QwenImageTransformer2DModel::lora_conventions() const {
  static const LoraKeyConventions conventions = [] {
    LoraKeyConventions c;
    c.family = "Qwen-Image";
    c.lora_ab_names_drop_alpha = true;
    c.kohya_requires_alpha = true;
    return c;
  }();
  return conventions;
}

std::vector<std::string> QwenImageTransformer2DModel::high_precision_modules() const {
  // Left dense by --weights-dtype (docs/quantization.md): the embedders, the modulation and the
  // output head. The modulation sets every token's shift, scale and gate in every block; the
  // embedders and the head are small, so dense costs little memory.
  return {
      "img_in", "txt_in", "time_text_embed.*", "transformer_blocks.*.img_mod.*",
      "transformer_blocks.*.txt_mod.*", "norm_out.*", "proj_out"};
}

const std::vector<SingleFileLayout>& QwenImageTransformer2DModel::single_file_layouts() {
  // ComfyUI's Qwen-Image files (qwen_image_bf16 / _fp8_e4m3fn.safetensors) use diffusers' own
  // names, with or without the `model.diffusion_model.` prefix: diffusers' from_single_file maps
  // QwenImageTransformer2DModel's keys as they are.
  static const std::vector<SingleFileLayout> layouts = {
      {"ComfyUI",
       {"model.diffusion_model.", ""},
       {"txt_norm.weight", "transformer_blocks.0.img_mod.1.weight"},
       {},
       {kComfyScaledFp8Marker}},
  };
  return layouts;
}

const parallel::TpPlan& QwenImageTransformer2DModel::tp_plan() const {
  // diffusers' Qwen-Image plan: q/k/v (image and text) split by heads (colwise), the output
  // projections back to D split by rows (rowwise, one all-reduce each), and the GELU FFs split
  // colwise / rowwise. Our addition: the modulation linears (D -> 6D, a third of the weights) are
  // split colwise and all-gathered. Replicated (not listed): embedders, txt_norm, norm_out,
  // proj_out (small), and the per-head RMSNorms.
  static const parallel::TpPlan plan = parallel::with_sharded_modulation(
      {"transformer_blocks.*.img_mod.1", "transformer_blocks.*.txt_mod.1"}, *reference_tp_plan());
  return plan;
}

const parallel::TpPlan* QwenImageTransformer2DModel::reference_tp_plan() const {
  using parallel::ShardStyle;
  // tp_plan() without img_mod / txt_mod: diffusers keeps the modulation whole on every rank.
  static const parallel::TpPlan plan = {
      {"transformer_blocks.*.attn.to_q", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.to_k", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.to_v", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.to_out.0", ShardStyle::Rowwise},
      {"transformer_blocks.*.attn.add_q_proj", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.add_k_proj", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.add_v_proj", ShardStyle::Colwise},
      {"transformer_blocks.*.attn.to_add_out", ShardStyle::Rowwise},
      {"transformer_blocks.*.img_mlp.net.0.proj", ShardStyle::Colwise},
      {"transformer_blocks.*.img_mlp.net.2", ShardStyle::Rowwise},
      {"transformer_blocks.*.txt_mlp.net.0.proj", ShardStyle::Colwise},
      {"transformer_blocks.*.txt_mlp.net.2", ShardStyle::Rowwise},
  };
  return &plan;
}

at::Tensor QwenImageTransformer2DModel::forward(const QwenImageTransformer2DModelInputs& inputs) {
  SHARDIT_PROFILE_SCOPE("QwenImageTransformer2DModel");
  // TaylorSeer: a forward it predicts runs nothing.
  if (std::optional<at::Tensor> predicted = predicted_output(inputs.hidden_states)) return *predicted;
  // Both token streams checked and, under context parallelism, split: [B, N_local, C], [B, L_local, C].
  JointForward joint(*this, inputs.hidden_states, config.in_channels, inputs.encoder_hidden_states,
                     config.joint_attention_dim);
  const std::string& where = joint.where;
  const at::Tensor timestep = joint.per_sample("timestep", inputs.timestep);

  // The grids of the image tokens: diffusers uses the first sample's list for all.
  TORCH_CHECK(!inputs.img_shapes.empty() && !inputs.img_shapes[0].empty(),
              "QwenImageTransformer2DModel: img_shapes is empty; pass the (frame, height, width) token grid(s) of ",
              "each sample, e.g. [[(1, h, w)]] * B");
  const std::vector<QwenImageShape>& shapes = inputs.img_shapes[0];
  for (size_t b = 1; b < inputs.img_shapes.size(); ++b) {
    TORCH_CHECK(inputs.img_shapes[b] == shapes, "QwenImageTransformer2DModel: img_shapes differ within the batch (",
                format_shapes(shapes), " vs ", format_shapes(inputs.img_shapes[b]), " for sample ", b,
                "); all samples must share one token grid");
  }
  int64_t grid_tokens = 0;
  for (const auto& shape : shapes) {
    TORCH_CHECK(shape[0] > 0 && shape[1] > 0 && shape[2] > 0,
                "QwenImageTransformer2DModel: img_shapes entries must be positive, got ", format_shapes(shapes));
    grid_tokens += shape[0] * shape[1] * shape[2];
  }
  TORCH_CHECK(grid_tokens == joint.image_len, "QwenImageTransformer2DModel: img_shapes ", format_shapes(shapes),
              " hold ", grid_tokens, " tokens but hidden_states has ", joint.image_len,
              " (N = sum of frame * height * width)");

  // Key mask over [text; image], true = attend: padded text tokens are hidden.
  std::optional<at::Tensor> key_mask;
  if (inputs.encoder_hidden_states_mask.has_value() && inputs.encoder_hidden_states_mask->defined()) {
    const at::Tensor& mask = *inputs.encoder_hidden_states_mask;
    nn::check_shape(where, "encoder_hidden_states_mask", mask, {{"B", joint.batch}, {"L", joint.text_len}});
    // [B, L_local]
    const at::Tensor text_mask = joint.cp.point("encoder_hidden_states_mask", mask.to(joint.device).to(at::kBool));
    const at::Tensor image_mask = at::ones({joint.batch, joint.image_tokens.size(1)}, text_mask.options());
    // [B, L + N]
    key_mask = at::cat({text_mask, image_mask}, 1);
  }

  // [B, N, D]
  at::Tensor hidden_states = img_in->forward(joint.to_model(joint.image_tokens));
  emit("img_in", hidden_states);

  // [B, L, C] -> [B, L, D]
  const at::Tensor text_normed = txt_norm->forward(joint.to_model(joint.text_tokens));
  emit("txt_norm", text_normed);
  at::Tensor encoder_hidden_states = txt_in->forward(text_normed);
  emit("txt_in", encoder_hidden_states);

  // zero_cond_t: the reference images' tokens (every grid after the first) are modulated with
  // timestep 0's embedding. [B] -> [2B]: the step's timesteps, then zeros.
  std::optional<at::Tensor> reference_tokens;
  at::Tensor timesteps = timestep;
  if (config.zero_cond_t) {
    const int64_t noise_tokens = shapes[0][0] * shapes[0][1] * shapes[0][2];
    // [B, N], true after the first grid; this rank's tokens under context parallelism.
    at::Tensor reference = at::arange(joint.image_len, at::TensorOptions().device(joint.device)).ge(noise_tokens);
    reference_tokens = joint.cp.point("reference_tokens", reference.unsqueeze(0).expand({joint.batch, joint.image_len}));
    timesteps = at::cat({timestep, timestep * 0});
  }
  // [B, D] ([2B, D] with zero_cond_t)
  const at::Tensor temb = time_text_embed->forward(timesteps, joint.dtype);
  emit("temb", temb);

  const QwenEmbedRope::Tables tables = pos_embed.forward(shapes, joint.text_len, joint.device);
  if (observed()) {
    emit("rope.img.real", at::cos(tables.img_angles));
    emit("rope.img.imag", at::sin(tables.img_angles));
    emit("rope.txt.real", at::cos(tables.txt_angles));
    emit("rope.txt.imag", at::sin(tables.txt_angles));
  }
  // The tables of the full sequences, then this rank's rows: [N_local, hd / 2], [L_local, hd / 2].
  const nn::RotaryEmbedding img_rope = rotary_from_angles(joint.cp.point("rope.img", tables.img_angles));
  const nn::RotaryEmbedding txt_rope = rotary_from_angles(joint.cp.point("rope.txt", tables.txt_angles));

  run_transformer_blocks(joint, *transformer_blocks, hidden_states, encoder_hidden_states, temb, img_rope, txt_rope,
                         key_mask, reference_tokens);
  // The output head takes the step's embeddings. [B, D]
  return output_head(joint, hidden_states, temb.narrow(0, 0, joint.batch));
}

const parallel::CpPlan* QwenImageTransformer2DModel::cp_plan() const {
  using parallel::CpAction;
  using parallel::SequenceStream;
  // diffusers' `_cp_plan`: beside both token streams, the text mask, the reference-token mask
  // (diffusers' modulate_index) and the rotary tables (computed for the full grids, then split,
  // so each token keeps its row) along the sequence. Mask padding is false, so padded text keys
  // stay hidden.
  static const parallel::CpPlan plan = joint_cp_plan({
      {"encoder_hidden_states_mask", CpAction::Split, 1, SequenceStream::Text, /*optional=*/true},
      {"reference_tokens", CpAction::Split, 1, SequenceStream::Image, /*optional=*/true},
      {"rope.img", CpAction::Split, 0, SequenceStream::Image},
      {"rope.txt", CpAction::Split, 0, SequenceStream::Text},
  });
  return &plan;
}

}  // namespace shardit::models

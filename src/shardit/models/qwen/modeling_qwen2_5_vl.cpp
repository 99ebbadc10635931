#include "shardit/models/qwen/modeling_qwen2_5_vl.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <set>

#include "shardit/core/profile.h"
#include "shardit/io/model_folder.h"
#include "shardit/nn/attention.h"
#include "shardit/nn/inputs.h"

namespace shardit::models {

Qwen3Config qwen2_5_vl_text_config_from_json(const nlohmann::json& json, const std::string& source) {
  const bool nested = !json.contains("hidden_size") && json.contains("text_config") && json.at("text_config").is_object();
  Qwen3Config config = Qwen3Config::from_json(nested ? json.at("text_config") : json,
                                              nested ? source + " (text_config)" : source, {"default", "mrope"});
  // Qwen2.5-VL's attention always has q/k/v biases (its config has no attention_bias key).
  config.attention_bias = true;
  return config;
}

Qwen2_5_VLVisionConfig Qwen2_5_VLVisionConfig::from_json(const nlohmann::json& json, const std::string& source) {
  const io::ConfigReader reader(json, source);
  Qwen2_5_VLVisionConfig config;
  config.depth = reader.integer("depth", config.depth, 1, io::kMaxConfigLayers);
  config.hidden_size = reader.integer("hidden_size", config.hidden_size, 1, io::kMaxConfigDim);
  config.hidden_act = nn::parse_activation(reader.string("hidden_act", "silu"), source, "hidden_act");
  config.intermediate_size = reader.integer("intermediate_size", config.intermediate_size, 1, io::kMaxConfigDim);
  config.num_heads = reader.integer("num_heads", config.num_heads, 1, io::kMaxConfigDim);
  reader.require(config.hidden_size % config.num_heads == 0, "'hidden_size' ", config.hidden_size,
                 " is not a multiple of 'num_heads' ", config.num_heads);
  reader.require((config.hidden_size / config.num_heads) % 4 == 0, "the head size ",
                 config.hidden_size / config.num_heads, " must be a multiple of 4 (2D rotary embedding)");
  config.in_channels = reader.integer("in_channels", reader.integer("in_chans", config.in_channels, 1, 64), 1, 64);
  config.patch_size = reader.integer("patch_size", config.patch_size, 1, 1024);
  config.spatial_merge_size = reader.integer("spatial_merge_size", config.spatial_merge_size, 1, 64);
  config.temporal_patch_size = reader.integer("temporal_patch_size", config.temporal_patch_size, 1, 64);
  config.window_size = reader.integer("window_size", config.window_size, 1, 1 << 20);
  reader.require(config.window_size / config.spatial_merge_size / config.patch_size >= 1, "'window_size' ",
                 config.window_size, " is below spatial_merge_size * patch_size = ",
                 config.spatial_merge_size * config.patch_size);
  config.out_hidden_size = reader.integer("out_hidden_size", config.out_hidden_size, 1, io::kMaxConfigDim);
  config.fullatt_block_indexes =
      reader.integers("fullatt_block_indexes", config.fullatt_block_indexes, 0, io::kMaxConfigLayers, 4096);
  return config;
}

Qwen2_5_VLImageConfig qwen2_5_vl_image_config_from_json(const nlohmann::json& json, const std::string& source,
                                                        const Qwen3Config& text) {
  TORCH_CHECK(json.contains("vision_config") && json.at("vision_config").is_object(), source,
              ": no 'vision_config'; the vision tower needs Qwen2.5-VL's full config.json");
  Qwen2_5_VLImageConfig config;
  config.vision = Qwen2_5_VLVisionConfig::from_json(json.at("vision_config"), source + " (vision_config)");
  const io::ConfigReader reader(json, source);
  config.image_token_id = reader.integer("image_token_id", config.image_token_id, 0, int64_t{1} << 31);
  config.vision_start_token_id = reader.integer("vision_start_token_id", config.vision_start_token_id, 0, int64_t{1} << 31);
  const bool nested = !json.contains("hidden_size") && json.contains("text_config") && json.at("text_config").is_object();
  const nlohmann::json& text_json = nested ? json.at("text_config") : json;
  const nlohmann::json* scaling = nullptr;
  if (text_json.contains("rope_scaling") && text_json.at("rope_scaling").is_object()) scaling = &text_json.at("rope_scaling");
  if (scaling == nullptr && json.contains("rope_scaling") && json.at("rope_scaling").is_object()) scaling = &json.at("rope_scaling");
  TORCH_CHECK(scaling != nullptr && scaling->contains("mrope_section"), source,
              ": no 'rope_scaling.mrope_section'; M-RoPE over images needs it");
  const io::ConfigReader scaling_reader(*scaling, source + " (rope_scaling)");
  config.mrope_section = scaling_reader.integers("mrope_section", {}, 1, io::kMaxConfigDim, 3);
  int64_t total = 0;
  for (const int64_t s : config.mrope_section) total += s;
  scaling_reader.require(config.mrope_section.size() == 3 && total * 2 == text.head_dim,
                         "'mrope_section' must be 3 sections summing to head_dim / 2 = ", text.head_dim / 2);
  return config;
}

Qwen2_5_VLForConditionalGeneration::Qwen2_5_VLForConditionalGeneration(const Qwen3Config& config,
                                                                       std::optional<Qwen2_5_VLImageConfig> image_config)
    : config(config), image_config(std::move(image_config)) {
  model = register_module("model", std::make_shared<Qwen3Model>(config, /*qk_norm=*/false));
  if (this->image_config.has_value()) {
    TORCH_CHECK(this->image_config->vision.out_hidden_size == config.hidden_size,
                "Qwen2_5_VLForConditionalGeneration: vision_config.out_hidden_size ",
                this->image_config->vision.out_hidden_size, " differs from the text model's hidden_size ",
                config.hidden_size);
    visual = register_module("visual",
                             std::make_shared<Qwen2_5_VisionTransformerPretrainedModel>(this->image_config->vision));
  }
  // transformers >= 4.52 saves the text model as model.language_model.* and the tower as
  // model.visual.*.
  for (const auto& slot : named_states()) {
    const std::string& name = slot.name;
    if (name.rfind("model.", 0) == 0) {
      key_aliases_.push_back({name, {"model.language_model." + name.substr(std::string("model.").size())}});
    } else if (name.rfind("visual.", 0) == 0) {
      key_aliases_.push_back({name, {"model." + name}});
    }
  }
}

const parallel::TpPlan& Qwen2_5_VLForConditionalGeneration::tp_plan() const {
  if (!visual) return qwen_decoder_tp_plan();
  static const parallel::TpPlan plan = [] {
    using parallel::ShardStyle;
    parallel::TpPlan out = qwen_decoder_tp_plan();
    // The vision blocks as the text layers: the fused q|k|v colwise by heads (each block split on
    // its own), proj rowwise; gate/up colwise, down rowwise. The merger's MLP likewise (GELU acts
    // per element). Replicated: the patch embedding (a Conv3d), the RMS norms, ln_q.
    const parallel::TpPlan vision = {
        {"visual.blocks.*.attn.qkv", ShardStyle::PackedColwise, {1, 1, 1}},
        {"visual.blocks.*.attn.proj", ShardStyle::Rowwise},
        {"visual.blocks.*.mlp.gate_proj", ShardStyle::Colwise},
        {"visual.blocks.*.mlp.up_proj", ShardStyle::Colwise},
        {"visual.blocks.*.mlp.down_proj", ShardStyle::Rowwise},
        {"visual.merger.mlp.0", ShardStyle::Colwise},
        {"visual.merger.mlp.2", ShardStyle::Rowwise},
    };
    out.insert(out.end(), vision.begin(), vision.end());
    return out;
  }();
  return plan;
}

parallel::ModelTraits Qwen2_5_VLForConditionalGeneration::traits() const {
  parallel::ModelTraits traits = qwen_decoder_traits(config);
  traits.key_aliases = key_aliases_;
  if (visual) {
    // A rank holds whole vision heads.
    traits.divisors.push_back({"vision_config.num_heads", image_config->vision.num_heads});
  } else {
    // The vision tower is not used on text-only prompts.
    traits.ignored_checkpoint_keys.push_back("visual.*");
    traits.ignored_checkpoint_keys.push_back("model.visual.*");
  }
  return traits;
}

// ---------------------------------------------------------------------------------------------
// Vision tower

Qwen2_5_VisionPatchEmbed::Qwen2_5_VisionPatchEmbed(const Qwen2_5_VLVisionConfig& config) : config_(config) {
  const int64_t p = config.patch_size;
  nn::Conv3dOptions options(config.in_channels, config.hidden_size, {config.temporal_patch_size, p, p});
  options.with_stride({config.temporal_patch_size, p, p});
  options.bias = false;
  proj = register_module("proj", std::make_shared<nn::Conv3d>(options));
}

at::Tensor Qwen2_5_VisionPatchEmbed::forward(const at::Tensor& pixel_values) {
  const int64_t p = config_.patch_size;
  // [N, C, tp, p, p] -> [N, hidden, 1, 1, 1] -> [N, hidden]
  const at::Tensor patches = pixel_values.view({-1, config_.in_channels, config_.temporal_patch_size, p, p});
  return proj->forward(patches.to(proj->weight.scalar_type())).view({-1, config_.hidden_size});
}

Qwen2_5_VLVisionAttention::Qwen2_5_VLVisionAttention(const Qwen2_5_VLVisionConfig& config)
    : head_dim_(config.hidden_size / config.num_heads) {
  const int64_t d = config.hidden_size;
  qkv = register_module("qkv", std::make_shared<nn::Linear>(nn::LinearOptions(d, 3 * d).with_out_blocks({d, d, d})));
  proj = register_module("proj", std::make_shared<nn::Linear>(nn::LinearOptions(d, d)));
}

at::Tensor Qwen2_5_VLVisionAttention::forward(const at::Tensor& hidden_states, const std::vector<int64_t>& cu_seqlens,
                                              const nn::RotaryEmbedding& rope) {
  // [N, 3 * H_local * hd]: q | k | v, each this rank's heads
  const std::vector<at::Tensor> parts = qkv->forward(hidden_states).unsqueeze(0).chunk(3, -1);
  // [1, N, H_local, hd] each
  const nn::HeadsQKV heads = nn::split_qkv_heads(parts[0], parts[1], parts[2], nullptr, nullptr, head_dim_);
  std::vector<at::Tensor> outputs;
  for (size_t i = 0; i + 1 < cu_seqlens.size(); ++i) {
    const int64_t begin = cu_seqlens[i];
    const int64_t end = cu_seqlens[i + 1];
    const nn::HeadsQKV segment{heads.query.slice(1, begin, end), heads.key.slice(1, begin, end),
                               heads.value.slice(1, begin, end)};
    const nn::RotaryEmbedding segment_rope = rope.slice(begin, end);
    // [1, n, H_local * hd]
    outputs.push_back(nn::attention(segment, &segment_rope));
  }
  // [N, H_local * hd] -> [N, D]
  return proj->forward(at::cat(outputs, 1).squeeze(0));
}

Qwen2_5_VLMLP::Qwen2_5_VLMLP(const Qwen2_5_VLVisionConfig& config) : activation_(config.hidden_act) {
  const auto linear = [](int64_t in, int64_t out) { return std::make_shared<nn::Linear>(nn::LinearOptions(in, out)); };
  gate_proj = register_module("gate_proj", linear(config.hidden_size, config.intermediate_size));
  up_proj = register_module("up_proj", linear(config.hidden_size, config.intermediate_size));
  down_proj = register_module("down_proj", linear(config.intermediate_size, config.hidden_size));
}

at::Tensor Qwen2_5_VLMLP::forward(const at::Tensor& x) {
  // [N, I_local] -> [N, D]
  return down_proj->forward(nn::activate(gate_proj->forward(x), activation_) * up_proj->forward(x));
}

Qwen2_5_VLVisionBlock::Qwen2_5_VLVisionBlock(const Qwen2_5_VLVisionConfig& config) {
  const auto norm = [&] { return std::make_shared<nn::RMSNorm>(nn::RMSNormOptions(config.hidden_size).with_eps(1e-6)); };
  norm1 = register_module("norm1", norm());
  norm2 = register_module("norm2", norm());
  attn = register_module("attn", std::make_shared<Qwen2_5_VLVisionAttention>(config));
  mlp = register_module("mlp", std::make_shared<Qwen2_5_VLMLP>(config));
}

at::Tensor Qwen2_5_VLVisionBlock::forward(const at::Tensor& hidden_states, const std::vector<int64_t>& cu_seqlens,
                                          const nn::RotaryEmbedding& rope) {
  SHARDIT_PROFILE_SCOPE("Qwen2_5_VLVisionBlock");
  const at::Tensor attended = hidden_states + attn->forward(norm1->forward(hidden_states), cu_seqlens, rope);
  return attended + mlp->forward(norm2->forward(attended));
}

Qwen2_5_VLMergerMLP::Qwen2_5_VLMergerMLP(int64_t hidden, int64_t out) {
  fc1 = register_module("0", std::make_shared<nn::Linear>(nn::LinearOptions(hidden, hidden)));
  fc2 = register_module("2", std::make_shared<nn::Linear>(nn::LinearOptions(hidden, out)));
}

at::Tensor Qwen2_5_VLMergerMLP::forward(const at::Tensor& x) {
  // [M, hidden] -> [M, hidden_local] -> [M, out]
  return fc2->forward(nn::activate(fc1->forward(x), nn::Activation::Gelu));
}

Qwen2_5_VLPatchMerger::Qwen2_5_VLPatchMerger(const Qwen2_5_VLVisionConfig& config)
    : hidden_(config.hidden_size * config.spatial_merge_size * config.spatial_merge_size) {
  ln_q = register_module("ln_q", std::make_shared<nn::RMSNorm>(nn::RMSNormOptions(config.hidden_size).with_eps(1e-6)));
  mlp = register_module("mlp", std::make_shared<Qwen2_5_VLMergerMLP>(hidden_, config.out_hidden_size));
}

at::Tensor Qwen2_5_VLPatchMerger::forward(const at::Tensor& x) {
  // [N, D] -> [N / merge², merge² * D] -> [N / merge², out]
  return mlp->forward(ln_q->forward(x).reshape({-1, hidden_}));
}

Qwen2_5_VisionTransformerPretrainedModel::Qwen2_5_VisionTransformerPretrainedModel(const Qwen2_5_VLVisionConfig& config)
    : config(config) {
  for (const int64_t index : config.fullatt_block_indexes) {
    TORCH_CHECK(index < config.depth, "vision_config: fullatt_block_indexes names block ", index, " of ", config.depth);
  }
  patch_embed = register_module("patch_embed", std::make_shared<Qwen2_5_VisionPatchEmbed>(config));
  blocks = register_module("blocks", std::make_shared<nn::ModuleList<Qwen2_5_VLVisionBlock>>());
  for (int64_t i = 0; i < config.depth; ++i) blocks->push_back(std::make_shared<Qwen2_5_VLVisionBlock>(config));
  merger = register_module("merger", std::make_shared<Qwen2_5_VLPatchMerger>(config));
}

namespace {

/// grid_thw [n, 3] as rows, checked: positive, h and w multiples of the merge size.
std::vector<std::array<int64_t, 3>> grid_rows(const at::Tensor& grid_thw, int64_t merge) {
  TORCH_CHECK(grid_thw.dim() == 2 && grid_thw.size(1) == 3 && !at::isFloatingType(grid_thw.scalar_type()),
              "Qwen2.5-VL vision tower: image_grid_thw must be integer [n, 3], got ", grid_thw.scalar_type(), " ",
              grid_thw.sizes());
  const at::Tensor grid = grid_thw.cpu().to(at::kLong).contiguous();
  std::vector<std::array<int64_t, 3>> rows;
  for (int64_t i = 0; i < grid.size(0); ++i) {
    const int64_t* g = grid.data_ptr<int64_t>() + 3 * i;
    TORCH_CHECK(g[0] > 0 && g[1] > 0 && g[2] > 0 && g[1] % merge == 0 && g[2] % merge == 0,
                "Qwen2.5-VL vision tower: image ", i, " has grid (", g[0], ", ", g[1], ", ", g[2],
                "); each must be positive and h, w multiples of spatial_merge_size ", merge);
    rows.push_back({g[0], g[1], g[2]});
  }
  return rows;
}

}  // namespace

Qwen2_5_VLWindows Qwen2_5_VisionTransformerPretrainedModel::windows(const at::Tensor& grid_thw) const {
  const int64_t merge = config.spatial_merge_size;
  const int64_t unit = merge * merge;
  const int64_t window = config.window_size / merge / config.patch_size;  // in merged tokens
  Qwen2_5_VLWindows out;
  std::vector<int64_t> index;
  out.cu_window_seqlens = {0};
  out.cu_seqlens = {0};
  int64_t offset = 0;
  for (const auto& [t, h, w] : grid_rows(grid_thw, merge)) {
    const int64_t gh = h / merge;
    const int64_t gw = w / merge;
    // Windows of window x window merged tokens, row-major over the (padded) grid; tokens inside a
    // window row-major; windows a padding row/column would fill stay short (or empty: dropped).
    const int64_t windows_h = (gh + window - 1) / window;
    const int64_t windows_w = (gw + window - 1) / window;
    for (int64_t f = 0; f < t; ++f) {
      for (int64_t wy = 0; wy < windows_h; ++wy) {
        for (int64_t wx = 0; wx < windows_w; ++wx) {
          int64_t count = 0;
          for (int64_t y = wy * window; y < std::min(gh, (wy + 1) * window); ++y) {
            for (int64_t x = wx * window; x < std::min(gw, (wx + 1) * window); ++x) {
              index.push_back(offset + (f * gh + y) * gw + x);
              ++count;
            }
          }
          if (count > 0) out.cu_window_seqlens.push_back(out.cu_window_seqlens.back() + count * unit);
        }
      }
      out.cu_seqlens.push_back(out.cu_seqlens.back() + h * w);
    }
    offset += t * gh * gw;
  }
  out.window_index = at::tensor(index, at::kLong);
  return out;
}

nn::RotaryEmbedding Qwen2_5_VisionTransformerPretrainedModel::rotary(const at::Tensor& grid_thw) const {
  const int64_t merge = config.spatial_merge_size;
  std::vector<int64_t> rows;
  std::vector<int64_t> cols;
  for (const auto& [t, h, w] : grid_rows(grid_thw, merge)) {
    for (int64_t f = 0; f < t; ++f) {
      // Patches in merge-window order: windows row-major, merge x merge patches inside.
      for (int64_t by = 0; by < h / merge; ++by) {
        for (int64_t bx = 0; bx < w / merge; ++bx) {
          for (int64_t y = 0; y < merge; ++y) {
            for (int64_t x = 0; x < merge; ++x) {
              rows.push_back(by * merge + y);
              cols.push_back(bx * merge + x);
            }
          }
        }
      }
    }
  }
  const int64_t head_dim = config.hidden_size / config.num_heads;
  const int64_t dim = head_dim / 2;  // Qwen2_5_VisionRotaryEmbedding(head_dim / 2)
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  // [dim / 2], fp32 as transformers computes it
  const at::Tensor inv_freq = 1.0 / at::pow(10000.0, at::arange(0, dim, 2, f32.dtype(at::kLong)).to(at::kFloat) /
                                                         static_cast<double>(dim));
  // [N, dim / 2] each: position * inv_freq (the outer product's single rounding)
  const at::Tensor h_angles = at::tensor(rows, at::kLong).to(at::kFloat).unsqueeze(-1) * inv_freq;
  const at::Tensor w_angles = at::tensor(cols, at::kLong).to(at::kFloat).unsqueeze(-1) * inv_freq;
  // [N, head_dim]: cat[h, w] twice
  const at::Tensor angles = at::cat({h_angles, w_angles, h_angles, w_angles}, -1);
  return {angles.cos(), angles.sin(), /*rotate_half=*/true};
}

at::Tensor Qwen2_5_VisionTransformerPretrainedModel::forward(const at::Tensor& pixel_values, const at::Tensor& grid_thw) {
  SHARDIT_PROFILE_SCOPE("Qwen2_5_VisionTransformerPretrainedModel");
  const std::string where = type_name();
  const int64_t merge = config.spatial_merge_size;
  const int64_t unit = merge * merge;
  const int64_t patch_values = config.in_channels * config.temporal_patch_size * config.patch_size * config.patch_size;
  const auto shape = nn::check_shape(where, "pixel_values", pixel_values, {"N", nn::Dim("P", patch_values)});
  const Qwen2_5_VLWindows layout = windows(grid_thw);
  TORCH_CHECK(layout.cu_seqlens.back() == shape[0], where, ": pixel_values has ", shape[0],
              " patches but image_grid_thw describes ", layout.cu_seqlens.back());
  const at::Device device = merger->ln_q->weight.device();
  // [N, D]
  at::Tensor hidden = patch_embed->forward(pixel_values.to(device));
  nn::RotaryEmbedding rope = rotary(grid_thw);
  // Tokens into window order, a merge unit at a time. [N, D]
  const at::Tensor index = layout.window_index.to(device);
  const int64_t n = shape[0];
  hidden = hidden.reshape({n / unit, unit, -1}).index_select(0, index).reshape({n, -1});
  const at::Tensor cpu_index = layout.window_index;
  rope.cos = rope.cos.reshape({n / unit, unit, -1}).index_select(0, cpu_index).reshape({n, -1}).to(device);
  rope.sin = rope.sin.reshape({n / unit, unit, -1}).index_select(0, cpu_index).reshape({n, -1}).to(device);
  const std::set<int64_t> full(config.fullatt_block_indexes.begin(), config.fullatt_block_indexes.end());
  for (int64_t i = 0; i < static_cast<int64_t>(blocks->size()); ++i) {
    hidden = (*blocks)[i].forward(hidden, full.count(i) ? layout.cu_seqlens : layout.cu_window_seqlens, rope);
  }
  // [N / merge², out] in window order, then back to raster order
  const at::Tensor merged = merger->forward(hidden);
  return merged.index_select(0, at::argsort(index));
}

// ---------------------------------------------------------------------------------------------
// Text and images

at::Tensor qwen2_5_vl_rope_index(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                 const at::Tensor& image_grid_thw, int64_t image_token_id,
                                 int64_t vision_start_token_id, int64_t spatial_merge_size) {
  const char* where = "get_rope_index";
  const auto shape = nn::check_shape(where, "input_ids", input_ids, {"B", "S"});
  nn::check_shape(where, "attention_mask", attention_mask, {{"B", shape[0]}, {"S", shape[1]}});
  const auto grids = grid_rows(image_grid_thw, spatial_merge_size);
  const at::Tensor ids_tensor = input_ids.cpu().to(at::kLong).contiguous();
  const at::Tensor mask_tensor = attention_mask.cpu().to(at::kLong).contiguous();
  const auto ids = ids_tensor.accessor<int64_t, 2>();
  const auto mask = mask_tensor.accessor<int64_t, 2>();
  at::Tensor positions_tensor = at::ones({3, shape[0], shape[1]}, at::kLong);
  auto positions = positions_tensor.accessor<int64_t, 3>();
  size_t image = 0;
  for (int64_t b = 0; b < shape[0]; ++b) {
    std::vector<int64_t> tokens;
    std::vector<int64_t> where_in_row;
    for (int64_t s = 0; s < shape[1]; ++s) {
      if (mask[b][s] != 0) {
        tokens.push_back(ids[b][s]);
        where_in_row.push_back(s);
      }
    }
    // Images of this row: a vision start followed by an image token.
    int64_t images_in_row = 0;
    for (size_t i = 0; i + 1 < tokens.size(); ++i) {
      if (tokens[i] == vision_start_token_id && tokens[i + 1] == image_token_id) ++images_in_row;
    }
    std::array<std::vector<int64_t>, 3> rows;
    int64_t next = 0;  // max position so far + 1
    size_t st = 0;
    const auto add_text = [&](size_t length) {
      for (size_t i = 0; i < length; ++i) {
        for (auto& row : rows) row.push_back(next + static_cast<int64_t>(i));
      }
      if (length > 0) next += static_cast<int64_t>(length);
    };
    for (int64_t k = 0; k < images_in_row; ++k) {
      size_t ed = st;
      while (ed < tokens.size() && tokens[ed] != image_token_id) ++ed;
      TORCH_CHECK(ed < tokens.size() && image < grids.size(), where, ": row ", b, " has more images than the ",
                  grids.size(), " grids given");
      add_text(ed - st);
      const auto [t, h, w] = grids[image++];
      const int64_t gh = h / spatial_merge_size;
      const int64_t gw = w / spatial_merge_size;
      int64_t top = next;
      for (int64_t f = 0; f < t; ++f) {
        for (int64_t y = 0; y < gh; ++y) {
          for (int64_t x = 0; x < gw; ++x) {
            // Images have no time step between frames (second_per_grid_t = 0): t stays 0.
            rows[0].push_back(next);
            rows[1].push_back(next + y);
            rows[2].push_back(next + x);
            top = std::max({top, next + y, next + x});
          }
        }
      }
      next = top + 1;
      st = ed + static_cast<size_t>(t * gh * gw);
    }
    add_text(tokens.size() - std::min(st, tokens.size()));
    TORCH_CHECK(rows[0].size() == tokens.size(), where, ": row ", b, "'s image tokens (", tokens.size() - st,
                " after the last image) do not match its grids");
    for (int r = 0; r < 3; ++r) {
      for (size_t i = 0; i < tokens.size(); ++i) positions[r][b][where_in_row[i]] = rows[r][i];
    }
  }
  TORCH_CHECK(image == grids.size(), where, ": ", grids.size(), " image grids given but the prompts hold ", image,
              " images");
  return positions_tensor;
}

nn::RotaryEmbedding qwen2_5_vl_mrope(const at::Tensor& position_ids, int64_t head_dim, double theta,
                                     const std::vector<int64_t>& mrope_section) {
  TORCH_CHECK(position_ids.dim() == 3 && position_ids.size(0) == 3, "M-RoPE: position_ids must be [3, B, S], got ",
              position_ids.sizes());
  int64_t total = 0;
  for (const int64_t s : mrope_section) total += s;
  TORCH_CHECK(mrope_section.size() == 3 && total * 2 == head_dim, "M-RoPE: mrope_section must be 3 sections summing to ",
              head_dim / 2, " (head_dim / 2)");
  std::array<nn::RotaryEmbedding, 3> tables;
  for (int64_t r = 0; r < 3; ++r) tables[r] = nn::rotary_pos_embed_rotate_half(head_dim, position_ids[r], theta);
  // Channel j (and j + head_dim / 2) from the row whose section holds j.
  std::vector<at::Tensor> cos_parts;
  std::vector<at::Tensor> sin_parts;
  for (int half = 0; half < 2; ++half) {
    int64_t begin = half * head_dim / 2;
    for (int64_t r = 0; r < 3; ++r) {
      cos_parts.push_back(tables[r].cos.slice(-1, begin, begin + mrope_section[r]));
      sin_parts.push_back(tables[r].sin.slice(-1, begin, begin + mrope_section[r]));
      begin += mrope_section[r];
    }
  }
  return {at::cat(cos_parts, -1), at::cat(sin_parts, -1), /*rotate_half=*/true};
}

DecoderHiddenStates Qwen2_5_VLForConditionalGeneration::forward_with_images(
    const at::Tensor& input_ids, const at::Tensor& attention_mask, const at::Tensor& pixel_values,
    const at::Tensor& image_grid_thw, const std::vector<int64_t>& hidden_states, bool last_hidden_state) {
  SHARDIT_PROFILE_SCOPE("Qwen2_5_VLForConditionalGeneration");
  const std::string where = type_name();
  TORCH_CHECK(visual, where, ": built without the vision tower; build it with the image config to encode images");
  TORCH_CHECK(is_materialized(), where, ": forward called before the weights were loaded");
  const auto shape = nn::check_shape(where, "input_ids", input_ids, {"B", "S"});
  nn::check_shape(where, "attention_mask", attention_mask, {{"B", shape[0]}, {"S", shape[1]}});
  const at::Device device = model->norm->weight.device();
  const at::Tensor ids = input_ids.to(device, at::kLong);
  // [B, S, D]
  at::Tensor embeds = model->embed_tokens->forward(ids);
  // [sum tokens, D]
  const at::Tensor image_embeds = visual->forward(pixel_values, image_grid_thw).to(embeds.scalar_type());
  emit("image_embeds", image_embeds);
  const at::Tensor pads = ids.eq(image_config->image_token_id);
  const int64_t pad_count = pads.sum().item<int64_t>();
  TORCH_CHECK(pad_count == image_embeds.size(0), where, ": the prompt holds ", pad_count,
              " image tokens but the images give ", image_embeds.size(0),
              " features; expand each <|image_pad|> to its image's token count");
  embeds = embeds.masked_scatter(pads.unsqueeze(-1), image_embeds);
  // [3, B, S]
  const at::Tensor position_ids =
      qwen2_5_vl_rope_index(input_ids, attention_mask, image_grid_thw, image_config->image_token_id,
                            image_config->vision_start_token_id, image_config->vision.spatial_merge_size);
  emit("position_ids", position_ids);
  const nn::RotaryEmbedding rope =
      qwen2_5_vl_mrope(position_ids.to(device), config.head_dim, config.rope_theta, image_config->mrope_section);
  return model->forward_embeds(embeds, attention_mask, rope, hidden_states, last_hidden_state);
}

at::Tensor qwen2_5_vl_text_position_ids(const at::Tensor& attention_mask) {
  const at::Tensor mask = attention_mask.to(at::kLong);
  return (mask.cumsum(-1) - 1).masked_fill_(mask.eq(0), 1);
}

DecoderHiddenStates Qwen2_5_VLForConditionalGeneration::forward(const at::Tensor& input_ids,
                                                                const std::optional<at::Tensor>& attention_mask,
                                                                const std::vector<int64_t>& hidden_states,
                                                                bool last_hidden_state) {
  SHARDIT_PROFILE_SCOPE("Qwen2_5_VLForConditionalGeneration");
  const std::string where = type_name();
  TORCH_CHECK(is_materialized(), where, ": forward called before the weights were loaded");
  const auto shape = nn::check_shape(where, "input_ids", input_ids, {"B", "S"});
  TORCH_CHECK(shape[1] >= 1, where, ": input_ids has no tokens");
  at::Tensor positions;
  if (attention_mask.has_value()) {
    nn::check_shape(where, "attention_mask", *attention_mask, {{"B", shape[0]}, {"S", shape[1]}});
    // [B, S]
    positions = qwen2_5_vl_text_position_ids(*attention_mask);
  } else {
    // [B, S]
    positions = at::arange(shape[1], at::TensorOptions().dtype(at::kLong)).unsqueeze(0).expand({shape[0], shape[1]});
  }
  // [3, B, S]: temporal, height and width rows are equal for text
  emit("position_ids", positions.unsqueeze(0).expand({3, shape[0], shape[1]}));
  return model->forward(input_ids, attention_mask, positions, hidden_states, last_hidden_state);
}

QwenImagePromptEmbeds qwenimage_prompt_embeds_from_hidden(const at::Tensor& last_hidden_state,
                                                          const at::Tensor& attention_mask, int64_t drop_idx) {
  TORCH_CHECK(drop_idx >= 0, "qwenimage_prompt_embeds: drop_idx must be >= 0, got ", drop_idx);
  const auto shape = nn::check_shape("qwenimage_prompt_embeds", "last_hidden_state", last_hidden_state, {"B", "S", "D"});
  nn::check_shape("qwenimage_prompt_embeds", "attention_mask", attention_mask, {{"B", shape[0]}, {"S", shape[1]}});
  const at::Tensor keep = attention_mask.to(last_hidden_state.device()).ne(0);
  std::vector<at::Tensor> rows;
  int64_t longest = 0;
  for (int64_t b = 0; b < shape[0]; ++b) {
    // [n_b, D]: the tokens under the mask, template prefix dropped
    const at::Tensor valid = last_hidden_state[b].index_select(0, keep[b].nonzero().flatten());
    rows.push_back(valid.slice(0, std::min(drop_idx, valid.size(0))));
    longest = std::max(longest, rows.back().size(0));
  }
  QwenImagePromptEmbeds out;
  out.prompt_embeds = at::zeros({shape[0], longest, shape[2]}, last_hidden_state.options());
  out.prompt_embeds_mask = at::zeros({shape[0], longest}, at::TensorOptions().dtype(at::kLong).device(last_hidden_state.device()));
  for (int64_t b = 0; b < shape[0]; ++b) {
    const int64_t n = rows[b].size(0);
    out.prompt_embeds[b].slice(0, 0, n).copy_(rows[b]);
    out.prompt_embeds_mask[b].slice(0, 0, n).fill_(1);
  }
  return out;
}

QwenImagePromptEmbeds qwenimage_prompt_embeds(Qwen2_5_VLForConditionalGeneration& text_encoder,
                                              const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                              int64_t drop_idx) {
  const DecoderHiddenStates out = text_encoder.forward(input_ids, attention_mask);
  return qwenimage_prompt_embeds_from_hidden(out.last_hidden_state, attention_mask, drop_idx);
}

}  // namespace shardit::models

#include "shardit/models/vae/autoencoder_kl_qwenimage.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "shardit/io/model_folder.h"
#include "shardit/nn/attention.h"

namespace shardit::models {

AutoencoderKLQwenImageConfig AutoencoderKLQwenImageConfig::from_json(const nlohmann::json& config,
                                                                   const std::string& source) {
  const io::ConfigReader reader(config, source);
  const int64_t max_dim = io::kMaxConfigDim;
  const int64_t max_blocks = io::kMaxConfigLayers;
  const double any = io::kAnyFiniteNumber;
  AutoencoderKLQwenImageConfig out;
  out.base_dim = reader.integer("base_dim", out.base_dim, 1, max_dim);
  out.z_dim = reader.integer("z_dim", out.z_dim, 1, max_dim);
  out.dim_mult = reader.integers("dim_mult", out.dim_mult, 1, max_dim, max_blocks);
  for (const int64_t mult : out.dim_mult) reader.width("base_dim", out.base_dim, "dim_mult", mult);
  out.num_res_blocks = reader.integer("num_res_blocks", out.num_res_blocks, 0, max_blocks);
  out.attn_scales = reader.numbers("attn_scales", out.attn_scales, -any, any, max_blocks);
  out.temperal_downsample = reader.booleans("temperal_downsample", out.temperal_downsample, max_blocks);
  out.input_channels = reader.integer("input_channels", out.input_channels, 1, max_dim);
  reader.require(reader.contains("latents_mean") && reader.contains("latents_std"),
                 "latents_mean and latents_std are required (the pipeline de-normalises with them)");
  out.latents_mean = reader.numbers("latents_mean", out.latents_mean, -any, any, max_dim);
  out.latents_std = reader.numbers("latents_std", out.latents_std, -any, any, max_dim);

  reader.require(!out.dim_mult.empty(), "dim_mult is empty");
  TORCH_CHECK(out.temperal_downsample.size() + 1 == out.dim_mult.size(), source, ": temperal_downsample has ",
              out.temperal_downsample.size(), " entries, expected len(dim_mult) - 1 = ", out.dim_mult.size() - 1);
  TORCH_CHECK(static_cast<int64_t>(out.latents_mean.size()) == out.z_dim &&
                  static_cast<int64_t>(out.latents_std.size()) == out.z_dim,
              source, ": latents_mean and latents_std have ", out.latents_mean.size(), " and ", out.latents_std.size(),
              " entries, expected z_dim = ", out.z_dim);
  for (double s : out.latents_std) TORCH_CHECK(s != 0.0, source, ": latents_std has a zero entry");
  return out;
}

// ---------------------------------------------------------------------------------------------

QwenImageCausalConv3d::QwenImageCausalConv3d(int64_t in_channels, int64_t out_channels,
                                             std::array<int64_t, 3> kernel_size, std::array<int64_t, 3> padding)
    : nn::Conv3d(nn::Conv3dOptions(in_channels, out_channels, kernel_size)), causal_padding_(padding) {}

at::Tensor QwenImageCausalConv3d::forward(const at::Tensor& x) const {
  const auto& options = this->options();
  TORCH_CHECK(x.dim() == 5 && x.size(1) == options.in_channels, "QwenImageCausalConv3d: input has shape ",
              x.sizes(), ", expected [B, ", options.in_channels, ", T, H, W]");
  const int64_t time_kernel = options.kernel_size[0];
  // The height padding through convolve_rows (the rows beyond a band come from its neighbours).
  return convolve_rows(x, 3, causal_padding_[1], [&](const at::Tensor& input, int64_t pad_h) {
    if (input.size(2) == 1 && 2 * causal_padding_[0] == time_kernel - 1) {
      // One frame: the 2 * padding_t frames before it are zeros, so only the last temporal slice
      // of the kernel meets data. [B, in, H, W] -> [B, out, H, W]
      const at::Tensor frame = input.squeeze(2);
      const at::Tensor kernel = weight.select(2, time_kernel - 1);
      return at::conv2d(frame, kernel, bias, /*stride=*/{1, 1}, {pad_h, causal_padding_[2]}).unsqueeze(2);
    }
    // F.pad order: (w_left, w_right, h_top, h_bottom, t_front, t_back).
    const at::Tensor padded = at::constant_pad_nd(
        input, {causal_padding_[2], causal_padding_[2], pad_h, pad_h, 2 * causal_padding_[0], 0});
    return at::conv3d(padded, weight, bias);
  });
}

QwenImageRMS_norm::QwenImageRMS_norm(int64_t dim, bool images) : scale_(std::sqrt(static_cast<double>(dim))) {
  if (images) {
    register_parameter("gamma", &gamma, {dim, 1, 1});
  } else {
    register_parameter("gamma", &gamma, {dim, 1, 1, 1});
  }
}

at::Tensor QwenImageRMS_norm::forward(const at::Tensor& x) const {
  TORCH_CHECK(x.dim() == gamma.dim() + 1 && x.size(1) == gamma.size(0), "QwenImageRMS_norm: input has shape ",
              x.sizes(), ", expected ", gamma.dim() + 1, " dimensions with ", gamma.size(0), " channels");
  const bool reduced = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  const at::Tensor x32 = reduced ? x.to(at::kFloat) : x;
  // F.normalize(x, dim=1): x / max(||x||_2, 1e-12) over the channels.
  const at::Tensor denom = at::linalg_vector_norm(x32, 2, {1}, /*keepdim=*/true).clamp_min(1e-12);
  const at::Tensor normalized = (x32 / denom).to(x.scalar_type());
  return normalized * scale_ * gamma;
}

QwenImageResample::Sequential::Sequential(int64_t dim, bool down) {
  conv = register_module("1", std::make_shared<nn::Conv2d>(down ? nn::Conv2dOptions(dim, dim, 3).with_stride(2)
                                                                : nn::Conv2dOptions(dim, dim / 2, 3).with_padding(1)));
}

QwenImageResample::QwenImageResample(int64_t dim, const std::string& mode) : mode_(mode) {
  TORCH_CHECK(mode == "upsample2d" || mode == "upsample3d" || mode == "downsample2d" || mode == "downsample3d",
              "QwenImageResample: mode '", mode,
              "' is not supported; expected upsample2d, upsample3d, downsample2d or downsample3d");
  resample = register_module("resample", std::make_shared<Sequential>(dim, mode.rfind("down", 0) == 0));
  if (mode == "upsample3d") {
    time_conv = register_module("time_conv",
                                std::make_shared<QwenImageCausalConv3d>(dim, dim * 2, std::array<int64_t, 3>{3, 1, 1},
                                                                        std::array<int64_t, 3>{1, 0, 0}));
  } else if (mode == "downsample3d") {
    // Stride 2 over frames in the reference; never run on one frame.
    time_conv = register_module(
        "time_conv", std::make_shared<QwenImageCausalConv3d>(dim, dim, std::array<int64_t, 3>{3, 1, 1}));
  }
}

at::Tensor QwenImageResample::forward(const at::Tensor& x) {
  // [B, C, T, H, W]. With one frame, the 3d modes' time_conv is not applied (the reference
  // caches the first chunk and skips it).
  const int64_t b = x.size(0), c = x.size(1), t = x.size(2), h = x.size(3), w = x.size(4);
  TORCH_CHECK(t == 1 || !time_conv, "QwenImageResample: ", t, " frames; only single-frame images are supported");
  // [B * T, C, H, W]
  at::Tensor frames = x.permute({0, 2, 1, 3, 4}).reshape({b * t, c, h, w});
  if (mode_.rfind("down", 0) == 0) {
    // ZeroPad2d((0, 1, 0, 1)) and the stride-2 convolution: [B * T, C, H / 2, W / 2]
    frames = downsample_rows(frames, resample->conv->weight, resample->conv->bias,
                             "QwenImageResample '" + path() + "'");
    return frames.view({b, t, frames.size(1), frames.size(2), frames.size(3)}).permute({0, 2, 1, 3, 4});
  }
  // nearest-exact at scale 2 picks the same source pixels as nearest; computed in fp32.
  frames = at::upsample_nearest2d(frames.to(at::kFloat), {2 * h, 2 * w}).to(x.scalar_type());
  frames = resample->conv->forward(frames);  // [B * T, C / 2, 2H, 2W]
  return frames.view({b, t, frames.size(1), frames.size(2), frames.size(3)}).permute({0, 2, 1, 3, 4});
}

QwenImageResidualBlock::QwenImageResidualBlock(int64_t in_dim, int64_t out_dim) {
  const std::array<int64_t, 3> k3{3, 3, 3};
  const std::array<int64_t, 3> p1{1, 1, 1};
  norm1 = register_module("norm1", std::make_shared<QwenImageRMS_norm>(in_dim, /*images=*/false));
  conv1 = register_module("conv1", std::make_shared<QwenImageCausalConv3d>(in_dim, out_dim, k3, p1));
  norm2 = register_module("norm2", std::make_shared<QwenImageRMS_norm>(out_dim, /*images=*/false));
  conv2 = register_module("conv2", std::make_shared<QwenImageCausalConv3d>(out_dim, out_dim, k3, p1));
  if (in_dim != out_dim) {
    conv_shortcut = register_module("conv_shortcut", std::make_shared<QwenImageCausalConv3d>(
                                                         in_dim, out_dim, std::array<int64_t, 3>{1, 1, 1}));
  }
}

at::Tensor QwenImageResidualBlock::forward(const at::Tensor& x) {
  // [B, in, T, H, W]
  const at::Tensor h = conv_shortcut ? conv_shortcut->forward(x) : x;
  at::Tensor y = conv1->forward(at::silu(norm1->forward(x)));
  y = conv2->forward(at::silu(norm2->forward(y)));  // [B, out, T, H, W]
  return y + h;
}

QwenImageAttentionBlock::QwenImageAttentionBlock(int64_t dim) {
  norm = register_module("norm", std::make_shared<QwenImageRMS_norm>(dim, /*images=*/true));
  to_qkv = register_module("to_qkv", std::make_shared<nn::Conv2d>(nn::Conv2dOptions(dim, dim * 3, 1)));
  proj = register_module("proj", std::make_shared<nn::Conv2d>(nn::Conv2dOptions(dim, dim, 1)));
}

at::Tensor QwenImageAttentionBlock::forward(const at::Tensor& x) {
  // [B, C, T, H, W]
  const int64_t b = x.size(0), c = x.size(1), t = x.size(2), h = x.size(3), w = x.size(4);
  // [B * T, C, H, W]
  at::Tensor frames = x.permute({0, 2, 1, 3, 4}).reshape({b * t, c, h, w});
  frames = norm->forward(frames);
  // [B * T, 3C, H, W] -> [B * T, 1, 3C, H * W] -> [B * T, 1, H * W, 3C]
  const at::Tensor qkv = to_qkv->forward(frames).reshape({b * t, 1, c * 3, -1}).permute({0, 1, 3, 2}).contiguous();
  const auto parts = qkv.chunk(3, -1);  // each [B * T, 1, H * W, C]
  at::Tensor attended = attend(parts[0], parts[1], parts[2]);
  // [B * T, H * W, C] -> [B * T, C, H, W]
  attended = attended.squeeze(1).permute({0, 2, 1}).reshape({b * t, c, h, w});
  attended = proj->forward(attended);
  // [B, C, T, H, W]
  attended = attended.view({b, t, c, h, w}).permute({0, 2, 1, 3, 4});
  return attended + x;
}

QwenImageMidBlock::QwenImageMidBlock(int64_t dim, int64_t num_layers) {
  attentions = register_module("attentions", std::make_shared<nn::ModuleList<QwenImageAttentionBlock>>());
  resnets = register_module("resnets", std::make_shared<nn::ModuleList<QwenImageResidualBlock>>());
  resnets->push_back(std::make_shared<QwenImageResidualBlock>(dim, dim));
  for (int64_t i = 0; i < num_layers; ++i) {
    attentions->push_back(std::make_shared<QwenImageAttentionBlock>(dim));
    resnets->push_back(std::make_shared<QwenImageResidualBlock>(dim, dim));
  }
}

at::Tensor QwenImageMidBlock::forward(const at::Tensor& x) {
  at::Tensor y = (*resnets)[0].forward(x);
  for (size_t i = 0; i < attentions->size(); ++i) {
    y = (*attentions)[i].forward(y);
    y = (*resnets)[i + 1].forward(y);
  }
  return y;
}

QwenImageUpBlock::QwenImageUpBlock(int64_t in_dim, int64_t out_dim, int64_t num_res_blocks,
                                   const std::string& upsample_mode) {
  resnets = register_module("resnets", std::make_shared<nn::ModuleList<QwenImageResidualBlock>>());
  int64_t current_dim = in_dim;
  for (int64_t i = 0; i < num_res_blocks + 1; ++i) {
    resnets->push_back(std::make_shared<QwenImageResidualBlock>(current_dim, out_dim));
    current_dim = out_dim;
  }
  if (!upsample_mode.empty()) {
    upsamplers = register_module("upsamplers", std::make_shared<nn::ModuleList<QwenImageResample>>());
    upsamplers->push_back(std::make_shared<QwenImageResample>(out_dim, upsample_mode));
  }
}

at::Tensor QwenImageUpBlock::forward(const at::Tensor& x) {
  at::Tensor y = x;
  for (auto& resnet : *resnets) y = resnet->forward(y);
  if (upsamplers) y = (*upsamplers)[0].forward(y);
  return y;
}

QwenImageDecoder3d::QwenImageDecoder3d(const AutoencoderKLQwenImageConfig& config) {
  const auto& mult = config.dim_mult;
  // dims = dim * [dim_mult[-1]] + dim_mult reversed
  std::vector<int64_t> dims{config.base_dim * mult.back()};
  for (auto it = mult.rbegin(); it != mult.rend(); ++it) dims.push_back(config.base_dim * *it);
  const std::vector<bool> temperal_upsample(config.temperal_downsample.rbegin(), config.temperal_downsample.rend());

  const std::array<int64_t, 3> k3{3, 3, 3};
  const std::array<int64_t, 3> p1{1, 1, 1};
  conv_in = register_module("conv_in", std::make_shared<QwenImageCausalConv3d>(config.z_dim, dims[0], k3, p1));
  mid_block = register_module("mid_block", std::make_shared<QwenImageMidBlock>(dims[0], 1));
  up_blocks = register_module("up_blocks", std::make_shared<nn::ModuleList<QwenImageUpBlock>>());
  int64_t out_dim = dims[0];
  for (size_t i = 0; i + 1 < dims.size(); ++i) {
    int64_t in_dim = dims[i];
    out_dim = dims[i + 1];
    if (i > 0) in_dim /= 2;  // the previous block's resampler halved the channels
    std::string upsample_mode;
    if (i + 1 != mult.size()) upsample_mode = temperal_upsample[i] ? "upsample3d" : "upsample2d";
    up_blocks->push_back(std::make_shared<QwenImageUpBlock>(in_dim, out_dim, config.num_res_blocks, upsample_mode));
  }
  norm_out = register_module("norm_out", std::make_shared<QwenImageRMS_norm>(out_dim, /*images=*/false));
  conv_out = register_module("conv_out",
                             std::make_shared<QwenImageCausalConv3d>(out_dim, config.input_channels, k3, p1));
}

at::Tensor QwenImageDecoder3d::forward(const at::Tensor& x) {
  // [B, z_dim, 1, h, w]
  at::Tensor y = conv_in->forward(x);
  emit("conv_in", y);
  y = mid_block->forward(y);
  emit("mid_block", y);
  for (size_t i = 0; i < up_blocks->size(); ++i) {
    y = (*up_blocks)[i].forward(y);
    emit("up_blocks." + std::to_string(i), y);
  }
  y = norm_out->forward(y);
  emit("norm_out", y);
  y = conv_out->forward(at::silu(y));  // [B, 3, 1, H, W]
  emit("conv_out", y);
  return y;
}

QwenImageEncoder3d::QwenImageEncoder3d(const AutoencoderKLQwenImageConfig& config, int64_t z_channels) {
  // dims = dim * [1] + dim_mult
  std::vector<int64_t> dims{config.base_dim};
  for (const int64_t m : config.dim_mult) dims.push_back(config.base_dim * m);
  const std::array<int64_t, 3> k3{3, 3, 3};
  const std::array<int64_t, 3> p1{1, 1, 1};
  conv_in = register_module("conv_in", std::make_shared<QwenImageCausalConv3d>(config.input_channels, dims[0], k3, p1));
  down_blocks = register_module("down_blocks", std::make_shared<nn::ModuleList<nn::Module>>());
  double scale = 1.0;
  int64_t out_dim = dims[0];
  for (size_t i = 0; i + 1 < dims.size(); ++i) {
    int64_t in_dim = dims[i];
    out_dim = dims[i + 1];
    for (int64_t r = 0; r < config.num_res_blocks; ++r) {
      auto block = std::make_shared<QwenImageResidualBlock>(in_dim, out_dim);
      down_blocks->push_back(block);
      down_forwards_.push_back([block](const at::Tensor& x) { return block->forward(x); });
      if (std::find(config.attn_scales.begin(), config.attn_scales.end(), scale) != config.attn_scales.end()) {
        auto attention = std::make_shared<QwenImageAttentionBlock>(out_dim);
        down_blocks->push_back(attention);
        down_forwards_.push_back([attention](const at::Tensor& x) { return attention->forward(x); });
      }
      in_dim = out_dim;
    }
    if (i + 1 != config.dim_mult.size()) {
      const bool temporal = i < config.temperal_downsample.size() && config.temperal_downsample[i];
      auto resample = std::make_shared<QwenImageResample>(out_dim, temporal ? "downsample3d" : "downsample2d");
      down_blocks->push_back(resample);
      down_forwards_.push_back([resample](const at::Tensor& x) { return resample->forward(x); });
      scale /= 2.0;
    }
  }
  mid_block = register_module("mid_block", std::make_shared<QwenImageMidBlock>(out_dim, 1));
  norm_out = register_module("norm_out", std::make_shared<QwenImageRMS_norm>(out_dim, /*images=*/false));
  conv_out = register_module("conv_out", std::make_shared<QwenImageCausalConv3d>(out_dim, z_channels, k3, p1));
}

at::Tensor QwenImageEncoder3d::forward(const at::Tensor& x) {
  // [B, 3, 1, H, W]
  at::Tensor y = conv_in->forward(x);
  emit("conv_in", y);
  for (size_t i = 0; i < down_forwards_.size(); ++i) {
    y = down_forwards_[i](y);
    emit("down_blocks." + std::to_string(i), y);
  }
  y = mid_block->forward(y);
  emit("mid_block", y);
  y = norm_out->forward(y);
  emit("norm_out", y);
  y = conv_out->forward(at::silu(y));  // [B, 2 z_dim, 1, h, w]
  emit("conv_out", y);
  return y;
}

// ---------------------------------------------------------------------------------------------

AutoencoderKLQwenImage::AutoencoderKLQwenImage(const AutoencoderKLQwenImageConfig& config) : config_(config) {
  encoder = register_module("encoder", std::make_shared<QwenImageEncoder3d>(config, 2 * config.z_dim));
  quant_conv = register_module(
      "quant_conv",
      std::make_shared<QwenImageCausalConv3d>(2 * config.z_dim, 2 * config.z_dim, std::array<int64_t, 3>{1, 1, 1}));
  post_quant_conv = register_module(
      "post_quant_conv",
      std::make_shared<QwenImageCausalConv3d>(config.z_dim, config.z_dim, std::array<int64_t, 3>{1, 1, 1}));
  decoder = register_module("decoder", std::make_shared<QwenImageDecoder3d>(config));
}

int64_t AutoencoderKLQwenImage::vae_scale_factor() const {
  return int64_t{1} << config_.temperal_downsample.size();
}

at::Tensor AutoencoderKLQwenImage::denormalize_latents(const at::Tensor& latents) const {
  check_latents(type_name(), latents, 5, config_.z_dim, "[B, C, 1, h, w]");
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor mean =
      at::tensor(config_.latents_mean, options).view({1, -1, 1, 1, 1}).to(latents.device(), latents.scalar_type());
  // The pipeline's float32 tensor of the config values, inverted in float32.
  const at::Tensor std_inverse = (1.0 / at::tensor(config_.latents_std, options).view({1, -1, 1, 1, 1}))
                                     .to(latents.device(), latents.scalar_type());
  at::Tensor z = latents / std_inverse + mean;
  emit("z", z);
  return z;
}

at::Tensor AutoencoderKLQwenImage::normalize_latents(const at::Tensor& z) const {
  check_latents(type_name(), z, 5, config_.z_dim, "[B, C, 1, h, w]");
  // _encode_vae_image: float32 tensors of the config values, (z - mean) / std.
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor mean = at::tensor(config_.latents_mean, options).view({1, -1, 1, 1, 1}).to(z.device(), z.scalar_type());
  const at::Tensor std = at::tensor(config_.latents_std, options).view({1, -1, 1, 1, 1}).to(z.device(), z.scalar_type());
  return (z - mean) / std;
}

at::Tensor AutoencoderKLQwenImage::_encode(const at::Tensor& image) {
  // [B, 3, 1, H, W]
  const at::Tensor frame = image.dim() == 4 ? image.unsqueeze(2) : image;
  TORCH_CHECK(frame.dim() == 5 && frame.size(2) == 1, type_name(), ": image has shape ", image.sizes(),
              "; only single images [B, 3, H, W] (or [B, 3, 1, H, W]) are encoded");
  TORCH_CHECK(frame.size(1) == config_.input_channels, type_name(), ": image has shape ", image.sizes(),
              ", expected [B, ", config_.input_channels, ", H, W] or [B, ", config_.input_channels,
              ", 1, H, W] (float pixels in [-1, 1])");
  check_image(type_name(), frame.squeeze(2), config_.input_channels, vae_scale_factor());
  const at::Tensor pixels = frame.to(quant_conv->weight.device(), quant_conv->weight.scalar_type());
  at::Tensor moments;
  if (use_tiling_ && (pixels.size(4) > tile_sample_min_width || pixels.size(3) > tile_sample_min_height)) {
    // diffusers' tiled_encode: tiles of the image, their moments blended (tiles run unobserved).
    const int64_t factor = vae_scale_factor();
    const std::string settings = "tile_sample_min_height " + std::to_string(tile_sample_min_height) +
                                 ", tile_sample_min_width " + std::to_string(tile_sample_min_width) +
                                 ", tile_sample_stride_height " + std::to_string(tile_sample_stride_height) +
                                 ", tile_sample_stride_width " + std::to_string(tile_sample_stride_width);
    moments = tiled_encode(pixels, encode_tile_grid(pixels.size(3), pixels.size(4)), factor, type_name(), settings,
                           [&](const at::Tensor& tile) { return quant_conv->forward(encoder->forward(tile)); });
  } else {
    // [B, 2 z_dim, 1, h, w]: mean | log-variance
    moments = quant_conv->forward(encoder->forward(pixels));
    emit("quant_conv", moments);
  }
  emit("moments", moments);
  return moments.slice(1, 0, config_.z_dim);
}

TileGrid AutoencoderKLQwenImage::encode_tile_grid(int64_t height, int64_t width) const {
  // The decode grid's tiles and strides, in image pixels here; blends and kept sizes in latents.
  const TileGrid decode = tile_grid(1, 1);
  const int64_t ratio = vae_scale_factor();
  TileGrid grid;
  grid.tile_latent_height = tile_sample_min_height;
  grid.tile_latent_width = tile_sample_min_width;
  grid.latent_stride_height = tile_sample_stride_height;
  grid.latent_stride_width = tile_sample_stride_width;
  grid.blend_height = decode.tile_latent_height - decode.latent_stride_height;
  grid.blend_width = decode.tile_latent_width - decode.latent_stride_width;
  grid.keep_height = decode.latent_stride_height;
  grid.keep_width = decode.latent_stride_width;
  grid.crop = std::make_pair(height / ratio, width / ratio);
  return grid;
}

at::Tensor AutoencoderKLQwenImage::decode_frame(const at::Tensor& z) {
  const at::Tensor x = post_quant_conv->forward(z);
  emit("post_quant_conv", x);
  return decoder->forward(x);
}

at::Tensor AutoencoderKLQwenImage::_decode(const at::Tensor& z) {
  check_latents(type_name(), z, 5, config_.z_dim, "[B, C, 1, h, w]");
  TORCH_CHECK(z.size(2) == 1, type_name(), ": latents have ", z.size(2),
              " frames; only single-frame (image) latents [B, C, 1, h, w] are decoded");
  const int64_t ratio = vae_scale_factor();
  if (use_tiling_ && (z.size(4) > tile_sample_min_width / ratio || z.size(3) > tile_sample_min_height / ratio)) {
    // diffusers' tiled_decode does not clamp.
    return tiled_decode(z, tile_grid(z.size(3), z.size(4)),
                        [this](const at::Tensor& tile) { return decode_frame(tile); });
  }
  const at::Tensor out = decode_frame(z);
  emit("decoder_out_before_clamp", out);
  return at::clamp(out, -1.0, 1.0);
}

void AutoencoderKLQwenImage::enable_tiling(std::optional<int64_t> min_height, std::optional<int64_t> min_width,
                                           std::optional<int64_t> stride_height, std::optional<int64_t> stride_width) {
  use_tiling_ = true;
  // diffusers uses `value or current`, so 0 keeps the current setting too.
  if (min_height.value_or(0) != 0) tile_sample_min_height = *min_height;
  if (min_width.value_or(0) != 0) tile_sample_min_width = *min_width;
  if (stride_height.value_or(0) != 0) tile_sample_stride_height = *stride_height;
  if (stride_width.value_or(0) != 0) tile_sample_stride_width = *stride_width;
}

TileGrid AutoencoderKLQwenImage::tile_grid(int64_t height, int64_t width) const {
  const int64_t ratio = vae_scale_factor();
  TORCH_CHECK(tile_sample_stride_height >= ratio && tile_sample_stride_width >= ratio &&
                  tile_sample_stride_height <= tile_sample_min_height &&
                  tile_sample_stride_width <= tile_sample_min_width,
              type_name(), ": tile strides (", tile_sample_stride_height, ", ", tile_sample_stride_width,
              ") must be at least the compression ratio ", ratio, " and at most the tile sizes (",
              tile_sample_min_height, ", ", tile_sample_min_width, ")");
  TileGrid grid;
  grid.tile_latent_height = tile_sample_min_height / ratio;
  grid.tile_latent_width = tile_sample_min_width / ratio;
  grid.latent_stride_height = tile_sample_stride_height / ratio;
  grid.latent_stride_width = tile_sample_stride_width / ratio;
  grid.blend_height = tile_sample_min_height - tile_sample_stride_height;
  grid.blend_width = tile_sample_min_width - tile_sample_stride_width;
  grid.keep_height = tile_sample_stride_height;
  grid.keep_width = tile_sample_stride_width;
  grid.crop = std::make_pair(height * ratio, width * ratio);
  return grid;
}

}  // namespace shardit::models

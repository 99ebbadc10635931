#include "shardit/models/vae/vae.h"

#include <utility>

#include <c10/util/Exception.h>

#include "shardit/nn/spatial_parallel_layer.h"

#include <algorithm>
#include <cmath>

namespace shardit::models {

namespace {

/// diffusers' blend_v / blend_h: b's first `extent` entries along `dim` become
/// a_tail * (1 - y / extent) + b_head * (y / extent), in place. The weights are the Python
/// floats of the reference rounded to float32, as its tensor-by-scalar products do.
void blend(const at::Tensor& a, const at::Tensor& b, int64_t extent, int64_t dim) {
  extent = std::min({a.size(dim), b.size(dim), extent});
  if (extent <= 0) return;
  std::vector<float> keep_a(extent);
  std::vector<float> keep_b(extent);
  for (int64_t y = 0; y < extent; ++y) {
    const double w = static_cast<double>(y) / static_cast<double>(extent);
    keep_a[y] = static_cast<float>(1.0 - w);
    keep_b[y] = static_cast<float>(w);
  }
  std::vector<int64_t> shape(b.dim(), 1);
  shape[dim] = extent;
  const auto options = at::TensorOptions().dtype(at::kFloat).device(b.device());
  const at::Tensor weight_a = at::tensor(keep_a, options).view(shape);
  const at::Tensor weight_b = at::tensor(keep_b, options).view(shape);
  at::Tensor b_head = b.narrow(dim, 0, extent);
  const at::Tensor a_tail = a.narrow(dim, a.size(dim) - extent, extent);
  b_head.copy_(a_tail * weight_a + b_head * weight_b);
}

/// AutoencoderKL's square tiles of `input_tile` input rows and columns (latents to decode, or
/// image pixels to encode) giving `output_tile`: a tile every input_tile x (1 - overlap), blended
/// over output_tile x overlap, output_tile minus that kept.
TileGrid square_tile_grid(int64_t input_tile, int64_t output_tile, double overlap) {
  const auto stride = static_cast<int64_t>(static_cast<double>(input_tile) * (1.0 - overlap));
  const auto blend_extent = static_cast<int64_t>(static_cast<double>(output_tile) * overlap);
  TileGrid grid;
  grid.tile_latent_height = grid.tile_latent_width = input_tile;
  grid.latent_stride_height = grid.latent_stride_width = stride;
  grid.blend_height = grid.blend_width = blend_extent;
  grid.keep_height = grid.keep_width = output_tile - blend_extent;
  return grid;
}

/// The config checks the Encoder and Decoder share: one block of the one supported type per
/// width (`direction` "up" or "down" names the config key), and SiLU.
void check_blocks(const std::string& source, const std::string& direction, const std::vector<std::string>& types,
                  const std::string& supported, const std::vector<int64_t>& widths, const std::string& act_fn) {
  TORCH_CHECK(!widths.empty(), source, ": block_out_channels is empty");
  TORCH_CHECK(types.size() == widths.size(), source, ": ", types.size(), " ", direction, "_block_types for ",
              widths.size(), " block_out_channels; give one block type per entry");
  TORCH_CHECK(act_fn == "silu" || act_fn == "swish", source, ": act_fn '", act_fn,
              "' is not supported; the FLUX VAEs use \"silu\"");
  for (const std::string& type : types) {
    TORCH_CHECK(type == supported, source, ": ", direction, " block type '", type, "' is not supported; supported: ",
                supported);
  }
}

}  // namespace

Decoder::Decoder(const DecoderOptions& options, const std::string& source) {
  check_blocks(source, "up", options.up_block_types, "UpDecoderBlock2D", options.block_out_channels, options.act_fn);
  const int64_t top = options.block_out_channels.back();
  conv_in = register_module("conv_in",
                            std::make_shared<nn::Conv2d>(nn::Conv2dOptions(options.in_channels, top, 3).with_padding(1)));
  UNetMidBlock2DOptions mid(top);
  mid.resnet_groups = options.norm_num_groups;
  mid.add_attention = options.mid_block_add_attention;
  mid.attention_head_dim = top;
  mid_block = register_module("mid_block", std::make_shared<UNetMidBlock2D>(mid));

  up_blocks = register_module("up_blocks", std::make_shared<nn::ModuleList<UpDecoderBlock2D>>());
  std::vector<int64_t> reversed(options.block_out_channels.rbegin(), options.block_out_channels.rend());
  int64_t output_channel = reversed[0];
  for (size_t i = 0; i < reversed.size(); ++i) {
    const int64_t prev_output_channel = output_channel;
    output_channel = reversed[i];
    UpDecoderBlock2DOptions block(prev_output_channel, output_channel);
    block.num_layers = options.layers_per_block + 1;
    block.resnet_groups = options.norm_num_groups;
    block.add_upsample = i + 1 != reversed.size();
    up_blocks->push_back(std::make_shared<UpDecoderBlock2D>(block));
  }
  conv_norm_out = register_module(
      "conv_norm_out", std::make_shared<nn::GroupNorm>(
                           nn::GroupNormOptions(options.norm_num_groups, options.block_out_channels[0]).with_eps(1e-6)));
  conv_out = register_module("conv_out", std::make_shared<nn::Conv2d>(
                                             nn::Conv2dOptions(options.block_out_channels[0], options.out_channels, 3)
                                                 .with_padding(1)));
}

at::Tensor Decoder::forward(const at::Tensor& sample) {
  // [B, in, h, w]
  at::Tensor x = conv_in->forward(sample);
  emit("conv_in", x);
  x = mid_block->forward(x);
  emit("mid_block", x);
  for (size_t i = 0; i < up_blocks->size(); ++i) {
    x = (*up_blocks)[i].forward(x);
    emit("up_blocks." + std::to_string(i), x);
  }
  x = conv_norm_out->forward(x);
  emit("conv_norm_out", x);
  x = conv_out->forward(at::silu(x));  // [B, out, H, W]
  emit("conv_out", x);
  return x;
}

Encoder::Encoder(const EncoderOptions& options, const std::string& source) {
  check_blocks(source, "down", options.down_block_types, "DownEncoderBlock2D", options.block_out_channels,
               options.act_fn);
  const std::vector<int64_t>& widths = options.block_out_channels;
  conv_in = register_module(
      "conv_in", std::make_shared<nn::Conv2d>(nn::Conv2dOptions(options.in_channels, widths[0], 3).with_padding(1)));
  down_blocks = register_module("down_blocks", std::make_shared<nn::ModuleList<DownEncoderBlock2D>>());
  int64_t output_channel = widths[0];
  for (size_t i = 0; i < widths.size(); ++i) {
    const int64_t input_channel = output_channel;
    output_channel = widths[i];
    DownEncoderBlock2DOptions block(input_channel, output_channel);
    block.num_layers = options.layers_per_block;
    block.resnet_groups = options.norm_num_groups;
    block.add_downsample = i + 1 != widths.size();
    down_blocks->push_back(std::make_shared<DownEncoderBlock2D>(block));
  }
  UNetMidBlock2DOptions mid(widths.back());
  mid.resnet_groups = options.norm_num_groups;
  mid.add_attention = options.mid_block_add_attention;
  mid.attention_head_dim = widths.back();
  mid_block = register_module("mid_block", std::make_shared<UNetMidBlock2D>(mid));
  conv_norm_out = register_module(
      "conv_norm_out",
      std::make_shared<nn::GroupNorm>(nn::GroupNormOptions(options.norm_num_groups, widths.back()).with_eps(1e-6)));
  const int64_t conv_out_channels = options.double_z ? 2 * options.out_channels : options.out_channels;
  conv_out = register_module(
      "conv_out",
      std::make_shared<nn::Conv2d>(nn::Conv2dOptions(widths.back(), conv_out_channels, 3).with_padding(1)));
}

at::Tensor Encoder::forward(const at::Tensor& sample) {
  // [B, in, H, W]
  at::Tensor x = conv_in->forward(sample);
  emit("conv_in", x);
  for (size_t i = 0; i < down_blocks->size(); ++i) {
    x = (*down_blocks)[i].forward(x);
    emit("down_blocks." + std::to_string(i), x);
  }
  // [B, C, H / f, W / f]
  x = mid_block->forward(x);
  emit("mid_block", x);
  x = conv_norm_out->forward(x);
  emit("conv_norm_out", x);
  x = conv_out->forward(at::silu(x));  // [B, 2 out, H / f, W / f]
  emit("conv_out", x);
  return x;
}

at::Tensor tiled_decode(const at::Tensor& z, const TileGrid& grid,
                        const std::function<at::Tensor(const at::Tensor& tile)>& decode_tile) {
  TORCH_CHECK(grid.latent_stride_height > 0 && grid.latent_stride_width > 0 && grid.tile_latent_height > 0 &&
                  grid.tile_latent_width > 0 && grid.keep_height > 0 && grid.keep_width > 0,
              "tiled decode: tile sizes and strides must be positive (tile ", grid.tile_latent_height, "x",
              grid.tile_latent_width, ", stride ", grid.latent_stride_height, "x", grid.latent_stride_width,
              "); check the tiling settings");
  const int64_t h_dim = z.dim() - 2;
  const int64_t w_dim = z.dim() - 1;
  const nn::ObserveForward unobserved{nn::ForwardObserver{}};
  const int64_t height = z.size(h_dim);
  const int64_t width = z.size(w_dim);
  std::vector<at::Tensor> previous_row;  // the blended tiles of the row above
  std::vector<at::Tensor> result_rows;
  for (int64_t i = 0; i < height; i += grid.latent_stride_height) {
    std::vector<at::Tensor> row;
    std::vector<at::Tensor> result_row;
    for (int64_t j = 0; j < width; j += grid.latent_stride_width) {
      const at::Tensor tile_latents = z.narrow(h_dim, i, std::min(grid.tile_latent_height, height - i))
                                          .narrow(w_dim, j, std::min(grid.tile_latent_width, width - j));
      at::Tensor tile = decode_tile(tile_latents);
      if (!previous_row.empty()) blend(previous_row[row.size()], tile, grid.blend_height, h_dim);
      if (!row.empty()) blend(row.back(), tile, grid.blend_width, w_dim);
      result_row.push_back(tile.narrow(h_dim, 0, std::min(grid.keep_height, tile.size(h_dim)))
                               .narrow(w_dim, 0, std::min(grid.keep_width, tile.size(w_dim))));
      row.push_back(tile);
    }
    result_rows.push_back(at::cat(result_row, w_dim));
    previous_row = std::move(row);
  }
  at::Tensor dec = at::cat(result_rows, h_dim);
  if (grid.crop.has_value()) {
    dec = dec.narrow(h_dim, 0, std::min(grid.crop->first, dec.size(h_dim)))
              .narrow(w_dim, 0, std::min(grid.crop->second, dec.size(w_dim)));
  }
  return dec;
}

AutoencoderKLTiling AutoencoderKLTiling::from_config(int64_t sample_size, size_t num_blocks) {
  AutoencoderKLTiling tiling;
  tiling.tile_sample_min_size = sample_size;
  tiling.tile_latent_min_size =
      static_cast<int64_t>(static_cast<double>(sample_size) / std::pow(2.0, static_cast<double>(num_blocks) - 1.0));
  return tiling;
}

bool AutoencoderKLTiling::applies(const at::Tensor& z) const {
  return z.size(-1) > tile_latent_min_size || z.size(-2) > tile_latent_min_size;
}

TileGrid AutoencoderKLTiling::grid() const {
  return square_tile_grid(tile_latent_min_size, tile_sample_min_size, tile_overlap_factor);
}

bool AutoencoderKLTiling::applies_to_image(const at::Tensor& image) const {
  return image.size(-1) > tile_sample_min_size || image.size(-2) > tile_sample_min_size;
}

TileGrid AutoencoderKLTiling::encode_grid() const {
  return square_tile_grid(tile_sample_min_size, tile_latent_min_size, tile_overlap_factor);
}

at::Tensor tiled_encode(const at::Tensor& image, const TileGrid& grid, int64_t factor, const std::string& model,
                        const std::string& tile_settings,
                        const std::function<at::Tensor(const at::Tensor& tile)>& moments_of) {
  return tiled_decode(image, grid, [&](const at::Tensor& tile) {
    TORCH_CHECK(tile.size(-2) >= factor && tile.size(-1) >= factor, model, ": tiled encode: a tile of ",
                tile.size(-2), "x", tile.size(-1), " pixels at the edge of an image of ", image.size(-2), "x",
                image.size(-1), " is smaller than the encoder's ", factor, "-pixel downsampling; change the tile size (",
                tile_settings, ") or disable tiling");
    return moments_of(tile);
  });
}

at::Tensor encode_2d(const nn::Module& vae, Encoder& encoder, nn::Conv2d* quant_conv, const at::Tensor& image,
                     const AutoencoderKLTiling* tiling) {
  const auto moments_of = [&](const at::Tensor& pixels) {
    at::Tensor moments = encoder.forward(pixels);
    if (quant_conv != nullptr) {
      moments = quant_conv->forward(moments);
      vae.emit("quant_conv", moments);
    }
    return moments;  // [B, 2 latent, h, w]
  };
  at::Tensor moments;
  if (tiling != nullptr && tiling->applies_to_image(image)) {
    const int64_t factor = int64_t{1} << (encoder.down_blocks->size() - 1);
    moments = tiled_encode(image, tiling->encode_grid(), factor, vae.type_name(),
                           "tile_sample_min_size " + std::to_string(tiling->tile_sample_min_size), moments_of);
  } else {
    moments = moments_of(image);
  }
  vae.emit("moments", moments);
  // DiagonalGaussianDistribution(moments).mode(): the mean, the first half of the channels.
  return moments.narrow(1, 0, moments.size(1) / 2).contiguous();
}

void check_image(const std::string& model, const at::Tensor& image, int64_t channels, int64_t factor) {
  TORCH_CHECK(image.defined() && image.dim() == 4 && image.size(1) == channels, model, ": image has shape ",
              image.defined() ? image.sizes() : c10::IntArrayRef{}, ", expected [B, ", channels,
              ", H, W] (float pixels in [-1, 1])");
  TORCH_CHECK(at::isFloatingType(image.scalar_type()), model, ": image has dtype ", image.scalar_type(),
              ", expected a floating-point dtype (pixels in [-1, 1])");
  TORCH_CHECK(image.size(0) > 0 && image.size(2) >= factor && image.size(3) >= factor, model, ": image has shape ",
              image.sizes(), "; the encoder needs a batch of at least 1 and sides of at least ", factor,
              " pixels (one latent pixel)");
}

at::Tensor decode_2d(const nn::Module& vae, nn::Conv2d* post_quant_conv, Decoder& decoder, const at::Tensor& z,
                     const AutoencoderKLTiling* tiling) {
  const auto decode_untiled = [&](const at::Tensor& latents) {
    at::Tensor x = latents;
    if (post_quant_conv != nullptr) {
      x = post_quant_conv->forward(x);
      vae.emit("post_quant_conv", x);
    }
    return decoder.forward(x);
  };
  if (tiling != nullptr && tiling->applies(z)) return tiled_decode(z, tiling->grid(), decode_untiled);
  return decode_untiled(z);
}

at::Tensor AutoencoderModel::decode(const at::Tensor& z) {
  if (spatial_.degree() == 1) return _decode(z);
  TORCH_CHECK(!use_tiling_, type_name(), ": tiled decoding and a parallel decode over ", spatial_.degree(),
              " ranks do not combine; disable one (the parallel decode already splits the activations over the ranks)");
  TORCH_CHECK(z.defined() && z.dim() >= 4, type_name(), ": latents have shape ",
              z.defined() ? z.sizes() : c10::IntArrayRef{}, ", expected [B, C, (T,) h, w]");
  // Bands of latent rows -> bands of sample rows (the decoders only upsample).
  const at::Tensor band = spatial_.split(z, -2, type_name() + " parallel decode");
  return spatial_.gather(_decode(band), -2);
}

at::Tensor AutoencoderModel::encode(const at::Tensor& image) {
  TORCH_CHECK(has_encoder(), type_name(), " has no encoder in shardit: it cannot encode reference images");
  TORCH_CHECK(image.defined() && (image.dim() == 4 || image.dim() == 5), type_name(), ": image has shape ",
              image.defined() ? image.sizes() : c10::IntArrayRef{},
              ", expected [B, C, H, W] (or one frame [B, C, 1, H, W] for a video VAE)");
  TORCH_CHECK(image.dim() == 4 || image.size(2) == 1, type_name(), ": image has shape ", image.sizes(), ", ",
              image.size(2), " frames; only one frame [B, C, 1, H, W] (an image) is encoded");
  // Checked on the whole image, so that every member of a parallel encode refuses it together.
  TORCH_CHECK(!at::isFloatingType(image.scalar_type()) || at::isfinite(image).all().item<bool>(), type_name(),
              ": image of shape ", image.sizes(), " holds non-finite values (NaN or infinity); expected pixels in [-1, 1]");
  if (spatial_.degree() == 1) return _encode(image);
  TORCH_CHECK(!use_tiling_, type_name(), ": tiled encoding and a parallel encode over ", spatial_.degree(),
              " ranks do not combine; disable one (the parallel encode already splits the activations over the ranks)");
  // Bands of whole latent rows: every band starts at a multiple of the downsampling factor, so
  // that each stride-2 convolution sees the rows it sees on the whole image (Downsample2D reads
  // one row of the band below); the last band takes the rows left over.
  const int64_t factor = vae_scale_factor();
  // The rows are the second-to-last dimension, [B, C, H, W] or [B, C, 1, H, W].
  const int64_t row_dim = image.dim() - 2;
  const int64_t rows = image.size(row_dim);
  const int64_t units = rows / factor;
  const int degree = spatial_.degree();
  TORCH_CHECK(units >= degree, type_name(), ": an image of ", rows, " rows (", image.sizes(), ") has ", units,
              " latent rows, too few to encode over ", degree, " ranks of group '", spatial_.group->name(),
              "' (each needs at least one); the largest degree that works for this height is ", std::max<int64_t>(units, 1));
  const int rank = spatial_.group->rank();
  const auto [first, count] = nn::row_band(units, degree, rank);
  const int64_t length = count * factor + (rank + 1 == degree ? rows % factor : 0);
  const at::Tensor band = image.narrow(row_dim, first * factor, length);
  return spatial_.gather(_encode(band), -2);
}

at::Tensor AutoencoderModel::_encode(const at::Tensor&) {
  TORCH_CHECK(false, type_name(), " has no encoder in shardit: it cannot encode reference images");
}

at::Tensor AutoencoderModel::normalize_latents(const at::Tensor&) const {
  TORCH_CHECK(false, type_name(), " has no encoder in shardit: it cannot normalise encoded images");
}

void AutoencoderModel::enable_parallel_decode(std::shared_ptr<dist::Group> group) {
  spatial_ = parallel::enable_spatial_parallelism(*this, std::move(group));
}

void AutoencoderModel::disable_parallel_decode() {
  parallel::disable_spatial_parallelism(*this);
  spatial_ = {};
}

const parallel::TpPlan& AutoencoderModel::tp_plan() const {
  // Replicated: a VAE decodes on one rank, or on several by row bands (enable_parallel_decode).
  static const parallel::TpPlan plan = {};
  return plan;
}

parallel::ModelTraits AutoencoderModel::traits() const {
  parallel::ModelTraits traits;
  // A decode-only model does not load the encoder half of a diffusers VAE checkpoint; a model
  // with an encoder declares those weights and needs them all.
  if (!has_encoder()) traits.ignored_checkpoint_keys = {"encoder.*", "quant_conv.*"};
  return traits;
}

std::string vae_intermediate_name(const std::string& module_path, const std::string& name) {
  return module_path.empty() ? name : module_path + "." + name;
}

void check_latents(const std::string& model, const at::Tensor& z, int64_t dims, int64_t channels, const char* layout) {
  TORCH_CHECK(z.defined() && z.dim() == dims && z.size(1) == channels, model, ": latents have shape ",
              z.defined() ? z.sizes() : c10::IntArrayRef{}, ", expected ", layout, " with ", channels,
              " latent channels; check that the latents were made for this VAE");
  TORCH_CHECK(at::isFloatingType(z.scalar_type()), model, ": latents have dtype ", z.scalar_type(),
              ", expected a floating-point dtype");
  // An empty batch or latent grid has nothing to decode (LibTorch's convolutions would fail
  // naming only a kernel size).
  for (int64_t d = 0; d < z.dim(); ++d) {
    TORCH_CHECK(z.size(d) > 0, model, ": latents have shape ", z.sizes(), ", with no element along dimension ", d,
                "; expected ", layout, " with every size at least 1");
  }
}

}  // namespace shardit::models

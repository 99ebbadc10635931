#include "shardit/models/vae/vae.h"

#include <utility>

#include <c10/util/Exception.h>

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

}  // namespace

Decoder::Decoder(const DecoderOptions& options, const std::string& source) {
  TORCH_CHECK(!options.block_out_channels.empty(), source, ": block_out_channels is empty");
  TORCH_CHECK(options.up_block_types.size() == options.block_out_channels.size(), source, ": ",
              options.up_block_types.size(), " up_block_types for ", options.block_out_channels.size(),
              " block_out_channels; give one block type per entry");
  TORCH_CHECK(options.act_fn == "silu" || options.act_fn == "swish", source, ": act_fn '", options.act_fn,
              "' is not supported; the FLUX VAEs use \"silu\"");
  for (const std::string& type : options.up_block_types) {
    TORCH_CHECK(type == "UpDecoderBlock2D", source, ": up block type '", type,
                "' is not supported; supported: UpDecoderBlock2D");
  }
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

at::Tensor Decoder::forward(const at::Tensor& sample, const IntermediateRecorder& record) {
  // [B, in, h, w]
  at::Tensor x = conv_in->forward(sample);
  if (record) record("conv_in", x);
  x = mid_block->forward(x);
  if (record) record("mid_block", x);
  for (size_t i = 0; i < up_blocks->size(); ++i) {
    x = (*up_blocks)[i].forward(x);
    if (record) record("up_blocks." + std::to_string(i), x);
  }
  x = conv_norm_out->forward(x);
  if (record) record("conv_norm_out", x);
  x = conv_out->forward(at::silu(x));  // [B, out, H, W]
  if (record) record("conv_out", x);
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
  const auto overlap_size = static_cast<int64_t>(static_cast<double>(tile_latent_min_size) * (1.0 - tile_overlap_factor));
  const auto blend_extent = static_cast<int64_t>(static_cast<double>(tile_sample_min_size) * tile_overlap_factor);
  TileGrid grid;
  grid.tile_latent_height = grid.tile_latent_width = tile_latent_min_size;
  grid.latent_stride_height = grid.latent_stride_width = overlap_size;
  grid.blend_height = grid.blend_width = blend_extent;
  grid.keep_height = grid.keep_width = tile_sample_min_size - blend_extent;
  return grid;
}

at::Tensor decode_2d(nn::Conv2d* post_quant_conv, Decoder& decoder, const at::Tensor& z,
                     const AutoencoderKLTiling* tiling, const IntermediateRecorder& record) {
  const auto decode_untiled = [&](const at::Tensor& latents, const IntermediateRecorder& recorder) {
    at::Tensor x = latents;
    if (post_quant_conv != nullptr) {
      x = post_quant_conv->forward(x);
      if (recorder) recorder("post_quant_conv", x);
    }
    return decoder.forward(x, prefixed_recorder(recorder, "decoder."));
  };
  if (tiling != nullptr && tiling->applies(z)) {
    return tiled_decode(z, tiling->grid(), [&](const at::Tensor& tile) { return decode_untiled(tile, {}); });
  }
  return decode_untiled(z, record);
}

at::Tensor AutoencoderModel::decode(const at::Tensor& z, const IntermediateRecorder& record) {
  if (spatial_.degree() == 1) return _decode(z, record);
  TORCH_CHECK(!use_tiling_, type_name(), ": tiled decoding and a parallel decode over ", spatial_.degree(),
              " ranks do not combine; disable one (the parallel decode already splits the activations over the ranks)");
  TORCH_CHECK(z.defined() && z.dim() >= 4, type_name(), ": latents have shape ",
              z.defined() ? z.sizes() : c10::IntArrayRef{}, ", expected [B, C, (T,) h, w]");
  // Bands of latent rows -> bands of sample rows (the decoders only upsample).
  const at::Tensor band = spatial_.split(z, -2, type_name() + " parallel decode");
  return spatial_.gather(_decode(band, record), -2);
}

at::Tensor AutoencoderModel::encode(const at::Tensor& image, const IntermediateRecorder& record) {
  return _encode(image, record);
}

at::Tensor AutoencoderModel::_encode(const at::Tensor&, const IntermediateRecorder&) {
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
  // Decode-only: the encoder half of a diffusers VAE checkpoint is not loaded.
  traits.ignored_checkpoint_keys = {"encoder.*", "quant_conv.*"};
  return traits;
}

IntermediateRecorder prefixed_recorder(const IntermediateRecorder& record, std::string prefix) {
  if (!record) return {};
  return [record, prefix = std::move(prefix)](const std::string& name, const at::Tensor& value) {
    record(prefix + name, value);
  };
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

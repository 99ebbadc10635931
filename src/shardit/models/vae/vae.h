#pragma once
// diffusers' vae.py: the 2-D `Encoder` and `Decoder` of AutoencoderKL and AutoencoderKLFlux2, the
// interface every shardit VAE offers the pipelines (AutoencoderMixin's role), and tiled decoding
// and encoding: tiles run one at a time and blended linearly over their overlaps, as diffusers'
// tiled_decode and _tiled_encode.
#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardit/models/vae/unet_2d_blocks.h"
#include "shardit/nn/conv.h"
#include "shardit/nn/group_norm.h"
#include "shardit/parallel/spatial_parallel.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::models {

/// The golden name of a tensor a VAE emits (nn::Module::emit) while it de-normalises, decodes or
/// encodes, from what a ForwardObserver receives: the emitting module's path below the VAE, then
/// the name ("decoder.conv_in", "encoder.down_blocks.0"); the VAE's own tensors by their name
/// alone ("z", "post_quant_conv", "moments").
std::string vae_intermediate_name(const std::string& module_path, const std::string& name);

struct DecoderOptions {
  int64_t in_channels = 3;
  int64_t out_channels = 3;
  std::vector<std::string> up_block_types{"UpDecoderBlock2D"};
  std::vector<int64_t> block_out_channels{64};
  int64_t layers_per_block = 2;
  int64_t norm_num_groups = 32;
  std::string act_fn = "silu";
  bool mid_block_add_attention = true;
};

/// conv_in -> mid_block -> up_blocks (reversed block_out_channels, each with layers_per_block + 1
/// resnets and a 2x upsampler except the last) -> conv_norm_out -> SiLU -> conv_out.
class Decoder : public nn::Module {
 public:
  /// `source` names the config in errors.
  Decoder(const DecoderOptions& options, const std::string& source);
  std::string type_name() const override { return "Decoder"; }
  /// [B, in, h, w] -> [B, out, h * 2^(blocks-1), w * 2^(blocks-1)]. Emits conv_in, mid_block,
  /// up_blocks.{i}, conv_norm_out (before the SiLU) and conv_out.
  at::Tensor forward(const at::Tensor& sample);

  std::shared_ptr<nn::Conv2d> conv_in;
  std::shared_ptr<UNetMidBlock2D> mid_block;
  std::shared_ptr<nn::ModuleList<UpDecoderBlock2D>> up_blocks;
  std::shared_ptr<nn::GroupNorm> conv_norm_out;
  std::shared_ptr<nn::Conv2d> conv_out;
};

struct EncoderOptions {
  int64_t in_channels = 3;
  int64_t out_channels = 3;
  std::vector<std::string> down_block_types{"DownEncoderBlock2D"};
  std::vector<int64_t> block_out_channels{64};
  int64_t layers_per_block = 2;
  int64_t norm_num_groups = 32;
  std::string act_fn = "silu";
  bool double_z = true;
  bool mid_block_add_attention = true;
};

/// conv_in -> down_blocks (block_out_channels in order, each with layers_per_block resnets and a
/// 2x downsampler except the last) -> mid_block -> conv_norm_out -> SiLU -> conv_out (2 x
/// out_channels with double_z: the posterior's mean and log-variance).
class Encoder : public nn::Module {
 public:
  /// `source` names the config in errors.
  Encoder(const EncoderOptions& options, const std::string& source);
  std::string type_name() const override { return "Encoder"; }
  /// [B, in, H, W] -> [B, out (x2), H / 2^(blocks-1), W / 2^(blocks-1)] (each downsampler
  /// floors). Emits conv_in, down_blocks.{i}, mid_block, conv_norm_out (before the SiLU) and
  /// conv_out.
  at::Tensor forward(const at::Tensor& sample);

  std::shared_ptr<nn::Conv2d> conv_in;
  std::shared_ptr<nn::ModuleList<DownEncoderBlock2D>> down_blocks;
  std::shared_ptr<UNetMidBlock2D> mid_block;
  std::shared_ptr<nn::GroupNorm> conv_norm_out;
  std::shared_ptr<nn::Conv2d> conv_out;
};

/// Where the tiles of a tiled decode lie, in the last two dimensions (height, width) of the
/// latents and of the decoded sample.
struct TileGrid {
  int64_t tile_latent_height = 0;  ///< latent rows per tile
  int64_t tile_latent_width = 0;
  int64_t latent_stride_height = 0;  ///< a tile starts every stride latent rows
  int64_t latent_stride_width = 0;
  int64_t blend_height = 0;  ///< decoded rows blended with the tile above
  int64_t blend_width = 0;   ///< decoded columns blended with the tile to the left
  int64_t keep_height = 0;   ///< decoded rows kept from each tile
  int64_t keep_width = 0;
  /// The sample is cut to this [height, width] at the end (AutoencoderKLQwenImage), or not.
  std::optional<std::pair<int64_t, int64_t>> crop;
};

/// diffusers' tiled_decode: tiles of the latents' last two dimensions decoded one at a time by
/// `decode_tile`; each decoded tile is blended with the (already blended) tile above over
/// blend_height rows and the one to the left over blend_width columns, cut to keep_height x
/// keep_width and concatenated. Only two rows of decoded tiles are held at once. The tiles decode
/// unobserved: what they would emit are not intermediates of the whole (diffusers' golden data
/// holds none for a tiled decode).
at::Tensor tiled_decode(const at::Tensor& z, const TileGrid& grid,
                        const std::function<at::Tensor(const at::Tensor& tile)>& decode_tile);

/// AutoencoderKL's square-tile settings (its tile_sample_min_size, tile_latent_min_size,
/// tile_overlap_factor attributes).
struct AutoencoderKLTiling {
  int64_t tile_sample_min_size = 0;
  int64_t tile_latent_min_size = 0;
  double tile_overlap_factor = 0.25;

  /// The defaults diffusers derives from the config: sample_size and sample_size /
  /// 2^(len(block_out_channels) - 1).
  static AutoencoderKLTiling from_config(int64_t sample_size, size_t num_blocks);
  /// True when a latent of this size is decoded in tiles.
  bool applies(const at::Tensor& z) const;
  TileGrid grid() const;
  /// True when an image of this size is encoded in tiles (a side above tile_sample_min_size).
  bool applies_to_image(const at::Tensor& image) const;
  /// _tiled_encode's tiles, in tiled_decode's terms: tiles of tile_sample_min_size image pixels
  /// every tile_sample_min_size x (1 - overlap) pixels, their latents blended over
  /// tile_latent_min_size x overlap rows and columns.
  TileGrid encode_grid() const;
};

/// AutoencoderKL's and AutoencoderKLFlux2's _decode: post_quant_conv (when not null) and the
/// decoder, in tiles when `tiling` is given and z is larger than a tile. `vae` (the model) emits
/// post_quant_conv, the decoder its own (untiled only).
at::Tensor decode_2d(const nn::Module& vae, nn::Conv2d* post_quant_conv, Decoder& decoder, const at::Tensor& z,
                     const AutoencoderKLTiling* tiling);

/// AutoencoderKL's and AutoencoderKLFlux2's _encode followed by the posterior's mode: the
/// encoder and quant_conv (when not null), in tiles when `tiling` is given and the image is larger
/// than a tile, then the mean half of the moments. image [B, in, H, W] -> [B, latent, h, w].
/// `vae` (the model) emits quant_conv (untiled only) and moments, the encoder its own (untiled
/// only).
at::Tensor encode_2d(const nn::Module& vae, Encoder& encoder, nn::Conv2d* quant_conv, const at::Tensor& image,
                     const AutoencoderKLTiling* tiling);

/// diffusers' tiled_encode loop: `moments_of` on each tile of `image`'s last two dimensions laid
/// out by `grid` (tiles and strides in pixels, blends and kept sizes in latents), blended as
/// tiled_decode. A tile at the image's edge with a side under `factor` pixels (the encoder's
/// downsampling) is refused, naming `model` and `tile_settings` (the settings to change).
at::Tensor tiled_encode(const at::Tensor& image, const TileGrid& grid, int64_t factor, const std::string& model,
                        const std::string& tile_settings,
                        const std::function<at::Tensor(const at::Tensor& tile)>& moments_of);

/// Checks an image for an encoder of `channels` input channels and `factor` pixels per latent
/// pixel, naming `model`: float [B, channels, H, W], every size positive, H and W at least
/// `factor`, finite values.
void check_image(const std::string& model, const at::Tensor& image, int64_t channels, int64_t factor);

/// The interface of shardit's VAEs, as the pipelines use them. VAEs are replicated: their
/// tensor-parallel plan is empty. Those with an encoder (has_encoder) also encode images for the
/// editing pipelines.
class AutoencoderModel : public parallel::TensorParallelModule {
 public:
  const parallel::TpPlan& tp_plan() const override;
  parallel::ModelTraits traits() const override;

  /// The decoder's input channels (z).
  virtual int64_t latent_channels() const = 0;
  /// Image pixels per latent pixel along height and width (the pipelines' vae_scale_factor).
  virtual int64_t vae_scale_factor() const = 0;
  /// The pipeline's final latents, unpacked, to the decoder input z (the de-normalisation each
  /// pipeline applies before vae.decode). Emits "z" (and model-specific steps).
  virtual at::Tensor denormalize_latents(const at::Tensor& latents) const = 0;
  /// Whether the model holds an encoder (built and loaded with the decoder): AutoencoderKL,
  /// AutoencoderKLFlux2 and AutoencoderKLQwenImage do.
  virtual bool has_encoder() const { return false; }
  /// vae.encode(image).latent_dist.mode(), the posterior mean (what the editing pipelines take
  /// with sample_mode="argmax"): image float [B, in_channels, H, W] in [-1, 1] -> z [B,
  /// latent_channels, H / vae_scale_factor, W / vae_scale_factor]; AutoencoderKLQwenImage takes
  /// that or one frame [B, in_channels, 1, H, W] (what diffusers' edit pipeline passes) and
  /// returns [B, latent_channels, 1, h, w]. More than one frame is a named error. Tiled
  /// (diffusers' tiled_encode) when use_tiling() and the image is larger than a tile. Under
  /// enable_parallel_decode, collective over its group like decode: every member passes the same
  /// image, encodes a band of its rows (the second-to-last dimension) and gets the whole z.
  /// Errors name the model when it has no encoder or the image's shape does not fit. Emits encoder.*, quant_conv (both not while
  /// tiling) and moments; under a parallel encode, this member's band of each.
  at::Tensor encode(const at::Tensor& image);
  /// The editing pipelines' normalisation of an encoded image z, the inverse of
  /// denormalize_latents: FLUX.1 (Kontext) (z - shift_factor) * scaling_factor, [B, C, h, w];
  /// FLUX.2 patchified then (x - bn.running_mean) / sqrt(bn.running_var + batch_norm_eps),
  /// [B, 4C, h / 2, w / 2].
  virtual at::Tensor normalize_latents(const at::Tensor& z) const;

  /// vae.decode(z).sample. Emits the golden intermediates (not while tiling; under a parallel
  /// decode, this member's band of each; see vae_intermediate_name). Under
  /// enable_parallel_decode, collective over its group: every member passes the same z and gets
  /// the whole sample.
  at::Tensor decode(const at::Tensor& z);

  /// diffusers' enable_tiling / disable_tiling with the model's current tile settings.
  void enable_tiling() { use_tiling_ = true; }
  void disable_tiling() { use_tiling_ = false; }
  bool use_tiling() const { return use_tiling_; }

  /// Decodes on the members of `group` together (parallel/spatial_parallel.h): each decodes a
  /// band of the latent rows, exchanging halo rows, GroupNorm statistics and attention keys with
  /// the others, and every member returns the whole sample. A group of one: decodes alone. Does
  /// not combine with tiling (decode refuses it).
  void enable_parallel_decode(std::shared_ptr<dist::Group> group);
  void disable_parallel_decode();
  /// The members decoding together (1: alone).
  int parallel_decode_degree() const { return spatial_.degree(); }

 protected:
  /// The model's own decode (diffusers' _decode) of z, or of a band of its rows under a parallel
  /// decode.
  virtual at::Tensor _decode(const at::Tensor& z) = 0;
  /// The model's own encode (diffusers' _encode, then the posterior's mean) of an image, or of a
  /// band of its rows under a parallel decode. By default: an error naming the model.
  virtual at::Tensor _encode(const at::Tensor& image);

  bool use_tiling_ = false;

 private:
  parallel::SpatialParallelism spatial_;
};

/// Checks z against a decoder input of `channels` channels and `dims` dimensions, naming `model`.
void check_latents(const std::string& model, const at::Tensor& z, int64_t dims, int64_t channels, const char* layout);

}  // namespace shardit::models

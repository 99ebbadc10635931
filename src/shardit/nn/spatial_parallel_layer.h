#pragma once
// Spatial (row-band) parallelism of the layers that look beyond one position of a feature map:
// the feature map's height (dim -2 of [B, C, H, W] and [B, C, T, H, W]) is cut into contiguous
// bands, one per member of a group, in group order. Pointwise layers and nearest upsampling need
// nothing (an upsampled band is the band of the upsampled map); the layers here do:
//   a "same" convolution reads `halo` rows beyond its band: they come from the neighbouring
//     bands (dist::Group::neighbour_exchange), zeros at the image's top and bottom;
//   a GroupNorm's statistics cover the whole map: sums over the bands are all-reduced;
//   a self-attention over the map's positions attends to the keys and values of every band.
// parallel::enable_spatial_parallelism switches a model's layers over.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "shardit/dist/group.h"
#include "shardit/nn/module.h"

namespace shardit::nn {

/// A layer that can run on a band of rows of a feature map split over a group.
class SpatialParallelLayer {
 public:
  virtual ~SpatialParallelLayer() = default;
  /// From now on the layer's input is this member's band of rows of a map split over `group`;
  /// null (or a group of one) switches that off.
  virtual void set_spatial_group(std::shared_ptr<dist::Group> group);
  /// The group the rows are split over, or null.
  dist::Group* spatial_group() const { return spatial_group_.get(); }
  /// The rows this layer reads beyond its band on each side (0: none). Every band must hold at
  /// least as many.
  virtual int64_t halo_rows() const { return 0; }

 protected:
  /// `conv(input, pad_h)` runs a convolution that is "same" along the height `dim` of `input`,
  /// with `pad_h` rows of zero padding on each side. Alone: conv(x, pad). Split over a group: the
  /// band is convolved with zero padding too (its inner rows are then exact), and the first and
  /// last `pad` output rows that border another band are recomputed from that band's rows (the
  /// halo, exchanged with the neighbours), without copying the band.
  at::Tensor convolve_rows(const at::Tensor& x, int64_t dim, int64_t pad,
                           const std::function<at::Tensor(const at::Tensor& input, int64_t pad_h)>& conv) const;

  /// The VAE encoders' downsampler: F.pad(x, (0, 1, 0, 1)), then a 3x3 convolution of stride 2
  /// without padding, `weight` [out, C, 3, 3]: x [N, C, H, W] -> [N, out, floor(H / 2),
  /// floor(W / 2)]. Split over a group, the row below a band is the first row of the band below
  /// (zeros under the last band), and every band above another must hold an even number of
  /// rows. `layer` names the layer in errors.
  at::Tensor downsample_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                             const std::string& layer) const;

  std::shared_ptr<dist::Group> spatial_group_;
};

/// Self-attention over the positions of a feature map (sequences [B, heads, S, D], S = rows x
/// width, rows outer): the base of the VAE decoders' attention blocks. Under spatial parallelism
/// each band's queries attend to the keys and values of every band, gathered over the group.
class FeatureMapAttention : public Module, public SpatialParallelLayer {
 protected:
  /// softmax(q k^T / sqrt(D)) v for the queries of this feature map (or band) over the keys and
  /// values of the whole map. q, k, v [B, heads, S, D] -> [B, heads, S, D].
  at::Tensor attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) const;
};

/// Member `rank`'s band of `rows` rows split over `degree` members, as {first row, row count}:
/// contiguous, in rank order, the first rows % degree members holding one row more.
std::pair<int64_t, int64_t> row_band(int64_t rows, int64_t degree, int64_t rank);

/// Every member's band concatenated along `dim` in group order. Bands may differ in size along
/// `dim` (other dimensions equal). Collective over `group`.
at::Tensor gather_rows(const at::Tensor& band, int64_t dim, dist::Group& group);

}  // namespace shardit::nn

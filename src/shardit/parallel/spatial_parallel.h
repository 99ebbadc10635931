#pragma once
// The model-agnostic applier of spatial (row-band) parallelism, the decode split of xDiT's
// patch-parallel VAE: every member of a group holds a contiguous band of the feature map's rows
// (dim -2), the layers that look beyond a position exchange what they need (nn/spatial_parallel_layer.h:
// halo rows for convolutions, all-reduced GroupNorm statistics, gathered attention keys/values),
// and the result is every band gathered in order: the single-rank result up to float rounding,
// with each member holding about 1/n of every activation.
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>

#include "shardit/dist/group.h"
#include "shardit/nn/module.h"

namespace shardit::parallel {

/// A model whose layers run on row bands over `group` (what enable_spatial_parallelism returns).
struct SpatialParallelism {
  std::shared_ptr<dist::Group> group;
  /// The most rows any layer reads beyond its band (3x3 convolutions: 1).
  int64_t halo_rows = 0;

  int degree() const { return group ? group->size() : 1; }
  /// The largest number of members whose bands of `rows` rows all hold halo_rows rows.
  int64_t max_degree(int64_t rows) const;
  /// This member's band of x's rows along `dim` (nn::row_band). Refuses, naming `what`, the sizes
  /// and max_degree, a split that leaves a band smaller than the halo. The same on every member.
  at::Tensor split(const at::Tensor& x, int64_t dim, const std::string& what) const;
  /// Every member's band along `dim`, concatenated in order (the whole map on every member).
  /// Collective.
  at::Tensor gather(const at::Tensor& band, int64_t dim) const;
};

/// Splits `model`'s feature maps over `group` by rows: every nn::SpatialParallelLayer below it
/// (convolutions, GroupNorms, feature-map attentions) is switched to bands. The model's forward
/// then takes and returns one band (SpatialParallelism::split / gather around it); layers that
/// act per position need nothing. A group of one switches spatial parallelism off.
SpatialParallelism enable_spatial_parallelism(nn::Module& model, std::shared_ptr<dist::Group> group);

/// Switches every layer of `model` back to whole feature maps.
void disable_spatial_parallelism(nn::Module& model);

}  // namespace shardit::parallel

#pragma once
// diffusers' tile loops (tiled_decode, _tiled_encode) transcribed literally for the tests: every
// tile run and kept, then blended row by row with per-row/column scalar weights, in place. The
// library's tiled_decode is checked against this, not against itself.
#include <ATen/ATen.h>

#include <functional>

#include "shardit/models/vae/vae.h"

namespace shardit::testing {

/// diffusers' tile loop over the last two dimensions of `z` with `grid`'s tiles, strides,
/// blends, kept sizes and crop; `run_tile` decodes (or encodes) one tile.
at::Tensor reference_tiled_decode(const at::Tensor& z, const models::TileGrid& grid,
                                  const std::function<at::Tensor(const at::Tensor&)>& run_tile);

}  // namespace shardit::testing

#include "support/tiled_reference.h"

#include <algorithm>
#include <vector>

namespace shardit::testing {

at::Tensor reference_tiled_decode(const at::Tensor& z, const models::TileGrid& grid,
                                  const std::function<at::Tensor(const at::Tensor&)>& run_tile) {
  const int64_t hd = z.dim() - 2, wd = z.dim() - 1;
  std::vector<std::vector<at::Tensor>> rows;
  for (int64_t i = 0; i < z.size(hd); i += grid.latent_stride_height) {
    std::vector<at::Tensor> row;
    for (int64_t j = 0; j < z.size(wd); j += grid.latent_stride_width) {
      row.push_back(run_tile(z.slice(hd, i, i + grid.tile_latent_height).slice(wd, j, j + grid.tile_latent_width)));
    }
    rows.push_back(row);
  }
  const auto blend = [](const at::Tensor& a, at::Tensor& b, int64_t extent, int64_t dim) {
    extent = std::min({a.size(dim), b.size(dim), extent});
    for (int64_t y = 0; y < extent; ++y) {
      const double w = static_cast<double>(y) / static_cast<double>(extent);
      b.select(dim, y).copy_(a.select(dim, a.size(dim) - extent + y) * (1 - w) + b.select(dim, y) * w);
    }
  };
  std::vector<at::Tensor> result_rows;
  for (size_t i = 0; i < rows.size(); ++i) {
    std::vector<at::Tensor> result_row;
    for (size_t j = 0; j < rows[i].size(); ++j) {
      at::Tensor& tile = rows[i][j];
      if (i > 0) blend(rows[i - 1][j], tile, grid.blend_height, hd);
      if (j > 0) blend(rows[i][j - 1], tile, grid.blend_width, wd);
      result_row.push_back(tile.slice(hd, 0, grid.keep_height).slice(wd, 0, grid.keep_width));
    }
    result_rows.push_back(at::cat(result_row, wd));
  }
  at::Tensor dec = at::cat(result_rows, hd);
  if (grid.crop) dec = dec.slice(hd, 0, grid.crop->first).slice(wd, 0, grid.crop->second);
  return dec;
}

}  // namespace shardit::testing

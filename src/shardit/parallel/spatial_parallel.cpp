#include "shardit/parallel/spatial_parallel.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#include "shardit/nn/spatial_parallel_layer.h"

namespace shardit::parallel {

namespace {

void set_group(nn::Module& model, const std::shared_ptr<dist::Group>& group, int64_t* halo_rows) {
  for (const auto& [path, module] : model.named_modules()) {
    if (auto* layer = dynamic_cast<nn::SpatialParallelLayer*>(module)) {
      layer->set_spatial_group(group);
      if (halo_rows != nullptr) *halo_rows = std::max(*halo_rows, layer->halo_rows());
    }
  }
}

}  // namespace

int64_t SpatialParallelism::max_degree(int64_t rows) const { return halo_rows > 0 ? rows / halo_rows : rows; }

at::Tensor SpatialParallelism::split(const at::Tensor& x, int64_t dim, const std::string& what) const {
  if (degree() == 1) return x;
  TORCH_CHECK(x.dim() > 0, what, ": cannot split a scalar into row bands");
  dim = dim < 0 ? dim + x.dim() : dim;
  TORCH_CHECK(dim >= 0 && dim < x.dim(), what, ": dim ", dim, " is out of range for shape ", x.sizes());
  const int64_t rows = x.size(dim);
  const int64_t smallest = rows / degree();
  TORCH_CHECK(smallest >= std::max<int64_t>(halo_rows, 1), what, ": ", rows, " rows (dim ", dim, " of ", x.sizes(),
              ") split over ", degree(), " ranks of group '", group->name(), "' leave bands of ", smallest,
              " rows, fewer than the ", std::max<int64_t>(halo_rows, 1),
              " a band needs (the rows its convolutions read from each neighbour); the largest degree that works "
              "for this height is ",
              max_degree(rows));
  const auto [first, count] = nn::row_band(rows, degree(), group->rank());
  return x.narrow(dim, first, count);
}

at::Tensor SpatialParallelism::gather(const at::Tensor& band, int64_t dim) const {
  if (degree() == 1) return band;
  return nn::gather_rows(band, dim, *group);
}

SpatialParallelism enable_spatial_parallelism(nn::Module& model, std::shared_ptr<dist::Group> group) {
  SpatialParallelism result;
  if (group && group->size() > 1) result.group = group;
  set_group(model, result.group, &result.halo_rows);
  return result;
}

void disable_spatial_parallelism(nn::Module& model) { set_group(model, nullptr, nullptr); }

}  // namespace shardit::parallel

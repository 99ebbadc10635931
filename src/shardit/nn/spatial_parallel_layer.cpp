#include "shardit/nn/spatial_parallel_layer.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <vector>

#include "shardit/nn/attention.h"

namespace shardit::nn {

void SpatialParallelLayer::set_spatial_group(std::shared_ptr<dist::Group> group) {
  spatial_group_ = group && group->size() > 1 ? std::move(group) : nullptr;
}

at::Tensor SpatialParallelLayer::convolve_rows(
    const at::Tensor& x, int64_t dim, int64_t pad,
    const std::function<at::Tensor(const at::Tensor& input, int64_t pad_h)>& conv) const {
  if (!spatial_group_ || pad == 0) return conv(x, pad);
  dist::Group& group = *spatial_group_;
  const int64_t rows = x.size(dim);
  TORCH_CHECK(rows >= pad, "spatial parallelism on group '", group.name(), "': member ", group.rank(),
              " holds a band of ", rows, " rows of ", x.sizes(), ", fewer than the ", pad,
              " rows a convolution reads from its neighbours; use fewer members for this height");
  // Our first rows go to the band above, our last rows to the band below.
  const auto [from_previous, from_next] =
      group.neighbour_exchange(x.narrow(dim, 0, pad), x.narrow(dim, rows - pad, pad));
  if (rows < 2 * pad) {
    // A band thinner than both halos: convolve it with them attached.
    std::vector<int64_t> edge_shape = x.sizes().vec();
    edge_shape[dim] = pad;
    const at::Tensor top = from_previous.defined() ? from_previous : at::zeros(edge_shape, x.options());
    const at::Tensor bottom = from_next.defined() ? from_next : at::zeros(edge_shape, x.options());
    return conv(at::cat({top, x, bottom}, dim), 0);
  }
  // Output row i reads input rows i - pad .. i + pad: the first `pad` output rows need the rows
  // above (halo, then our first 2 pad rows), the last `pad` the rows below.
  at::Tensor out = conv(x, pad);
  const int64_t out_dim = dim - x.dim() + out.dim();
  if (from_previous.defined()) {
    out.narrow(out_dim, 0, pad).copy_(conv(at::cat({from_previous, x.narrow(dim, 0, 2 * pad)}, dim), 0));
  }
  if (from_next.defined()) {
    out.narrow(out_dim, out.size(out_dim) - pad, pad)
        .copy_(conv(at::cat({x.narrow(dim, rows - 2 * pad, 2 * pad), from_next}, dim), 0));
  }
  return out;
}

at::Tensor SpatialParallelLayer::downsample_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                                const std::string& layer) const {
  // [N, C, H, W]
  TORCH_CHECK(x.dim() == 4 && x.size(1) == weight.size(1), layer, ": input has shape ", x.sizes(), ", expected [B, ",
              weight.size(1), ", H, W]");
  const int64_t rows = x.size(2);
  // The zero column on the right is this band's alone.
  at::Tensor padded = at::constant_pad_nd(x, {0, 1, 0, 0}, 0.0);
  at::Tensor bottom;  // the row below this band: the next band's first row, or zeros
  if (spatial_group_) {
    TORCH_CHECK(rows >= 1, layer, ": spatial parallelism on group '", spatial_group_->name(), "': member ",
                spatial_group_->rank(), " holds no rows; use fewer members for this height");
    // Our first row goes to the band above; the band below sends us its first row.
    bottom = spatial_group_->neighbour_exchange(padded.narrow(2, 0, 1), padded.narrow(2, rows - 1, 1)).second;
    TORCH_CHECK(!bottom.defined() || rows % 2 == 0, layer, ": member ", spatial_group_->rank(), " of group '",
                spatial_group_->name(), "' holds a band of ", rows,
                " rows, an odd count above another band; bands must start at even rows");
  }
  if (!bottom.defined()) bottom = at::zeros({padded.size(0), padded.size(1), 1, padded.size(3)}, padded.options());
  padded = at::cat({padded, bottom}, 2);  // [N, C, H + 1, W + 1]
  const std::array<int64_t, 2> stride{2, 2};
  const std::array<int64_t, 2> padding{0, 0};
  return at::conv2d(padded, weight, bias, stride, padding);  // [N, out, H / 2, W / 2]
}

at::Tensor FeatureMapAttention::attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) const {
  if (!spatial_group_) return nn::scaled_dot_product_attention(query, key, value);
  // One gather for both: [B, heads, S_band, 2D] -> [B, heads, S, 2D]
  const at::Tensor key_value = gather_rows(at::cat({key, value}, -1), 2, *spatial_group_);
  const auto parts = key_value.split(key.size(-1), -1);
  return nn::scaled_dot_product_attention(query, parts[0], parts[1]);
}

std::pair<int64_t, int64_t> row_band(int64_t rows, int64_t degree, int64_t rank) {
  TORCH_CHECK(degree > 0 && rank >= 0 && rank < degree, "row_band: rank ", rank, " is out of range for ", degree,
              " members");
  const int64_t base = rows / degree;
  const int64_t extra = rows % degree;
  return {rank * base + std::min(rank, extra), base + (rank < extra ? 1 : 0)};
}

at::Tensor gather_rows(const at::Tensor& band, int64_t dim, dist::Group& group) {
  if (group.size() == 1) return band;
  TORCH_CHECK(band.dim() > 0, "gather_rows on group '", group.name(), "': needs a tensor with dimensions");
  dim = dim < 0 ? dim + band.dim() : dim;
  // The bands' sizes first: all_gather moves equal shapes, so each band is padded to the largest.
  const at::Tensor sizes = group.all_gather(at::full({1}, band.size(dim), at::kLong), 0);
  const std::vector<int64_t> rows(sizes.data_ptr<int64_t>(), sizes.data_ptr<int64_t>() + sizes.numel());
  const int64_t largest = *std::max_element(rows.begin(), rows.end());
  at::Tensor padded = band;
  if (band.size(dim) < largest) {
    std::vector<int64_t> filler_shape = band.sizes().vec();
    filler_shape[dim] = largest - band.size(dim);
    padded = at::cat({band, at::zeros(filler_shape, band.options())}, dim);
  }
  const at::Tensor gathered = group.all_gather(padded, dim);  // [..., size * largest, ...]
  if (std::all_of(rows.begin(), rows.end(), [&](int64_t r) { return r == largest; })) return gathered;
  std::vector<at::Tensor> parts;
  for (size_t i = 0; i < rows.size(); ++i) {
    parts.push_back(gathered.narrow(dim, static_cast<int64_t>(i) * largest, rows[i]));
  }
  return at::cat(parts, dim);
}

}  // namespace shardit::nn

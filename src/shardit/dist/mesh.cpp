#include "shardit/dist/mesh.h"

#include <c10/util/Exception.h>

#include <set>
#include <sstream>

#include "shardit/dist/world.h"

namespace shardit::dist {

DeviceMesh::DeviceMesh(World& world, std::vector<std::pair<std::string, int>> dims)
    : dims_(std::move(dims)) {
  TORCH_CHECK(!dims_.empty(), "DeviceMesh needs at least one dimension");
  std::set<std::string> names;
  int64_t product = 1;
  for (const auto& [name, size] : dims_) {
    TORCH_CHECK(!name.empty(), "DeviceMesh ", to_string(), ": a dimension has an empty name");
    TORCH_CHECK(names.insert(name).second, "DeviceMesh ", to_string(), ": dimension '", name,
                "' appears twice");
    TORCH_CHECK(size >= 1, "DeviceMesh ", to_string(), ": dimension '", name, "' has size ", size,
                ", expected at least 1");
    product *= size;
  }
  TORCH_CHECK(product == world.size(), "DeviceMesh ", to_string(), " holds ", product,
              " ranks but the world has ", world.size(), "; choose sizes whose product is ",
              world.size());

  // Row-major: the last dimension varies fastest.
  const int n = ndim();
  std::vector<int64_t> strides(n, 1);
  for (int d = n - 2; d >= 0; --d) strides[d] = strides[d + 1] * dims_[d + 1].second;
  coordinates_.resize(n);
  for (int d = 0; d < n; ++d) coordinates_[d] = static_cast<int>(world.rank() / strides[d] % dims_[d].second);

  // For each dimension, one group per combination of the other coordinates, made in the same
  // order on every rank (new_group is collective over the world); this rank keeps the one it is in.
  groups_.resize(n);
  for (int d = 0; d < n; ++d) {
    const int size = dims_[d].second;
    for (int base = 0; base < world.size(); ++base) {
      if (base / strides[d] % size != 0) continue;  // enumerate each line once, from coordinate 0
      std::vector<int> ranks;
      for (int i = 0; i < size; ++i) ranks.push_back(static_cast<int>(base + i * strides[d]));
      auto group = world.new_group(ranks);
      if (group) groups_[d] = std::move(group);
    }
    TORCH_INTERNAL_ASSERT(groups_[d], "rank ", world.rank(), " is in no group of mesh dimension ",
                          dims_[d].first);
  }
}

DeviceMesh DeviceMesh::one_d(World& world, const std::string& name) {
  return DeviceMesh(world, {{name, world.size()}});
}

int DeviceMesh::dim_index(const std::string& dim) const {
  for (int d = 0; d < ndim(); ++d) {
    if (dims_[d].first == dim) return d;
  }
  TORCH_CHECK(false, "DeviceMesh ", to_string(), " has no dimension '", dim, "'");
}

int DeviceMesh::size(const std::string& dim) const { return dims_[dim_index(dim)].second; }

int DeviceMesh::coordinate(const std::string& dim) const { return coordinates_[dim_index(dim)]; }

std::shared_ptr<Group> DeviceMesh::group(const std::string& dim) const {
  return groups_[dim_index(dim)];
}

std::string DeviceMesh::to_string() const {
  std::ostringstream out;
  for (size_t d = 0; d < dims_.size(); ++d) {
    out << (d ? " x " : "") << dims_[d].first << "=" << dims_[d].second;
  }
  return out.str();
}

}  // namespace shardit::dist

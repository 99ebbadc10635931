#pragma once
// A named N-D arrangement of the world's ranks (e.g. ulysses=2 x tp=2), with a group per
// dimension. The pipelines' meshes are made by parallel::ParallelDims::build (replica, cfg,
// ulysses, ring, tp).
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardit/dist/group.h"

namespace shardit::dist {

class World;

class DeviceMesh {
 public:
  /// `dims` in order, e.g. {{"ulysses", 2}, {"tp", 2}}: ranks are laid out row-major, the last
  /// dimension varying fastest (rank = ulysses_index * 2 + tp_index). The product must equal the
  /// world size. Collective: every rank constructs the same mesh.
  DeviceMesh(World& world, std::vector<std::pair<std::string, int>> dims);
  /// A 1-D mesh over the whole world.
  static DeviceMesh one_d(World& world, const std::string& name = "tp");

  int ndim() const { return static_cast<int>(dims_.size()); }
  const std::vector<std::pair<std::string, int>>& dims() const { return dims_; }
  /// Size of a named dimension (error naming the dimension and the mesh when unknown).
  int size(const std::string& dim) const;
  /// This rank's index along a named dimension.
  int coordinate(const std::string& dim) const;
  /// The group of ranks that share every coordinate but `dim`.
  std::shared_ptr<Group> group(const std::string& dim) const;
  /// "ulysses=2 x tp=2"
  std::string to_string() const;

 private:
  int dim_index(const std::string& dim) const;
  std::vector<std::pair<std::string, int>> dims_;
  std::vector<int> coordinates_;
  std::vector<std::shared_ptr<Group>> groups_;
};

}  // namespace shardit::dist

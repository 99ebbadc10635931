#pragma once
// The degrees of the mesh a model runs on, cfg x ulysses x ring x tp (and the replicas of it), from
// the command line's --cfg-parallel, --ulysses, --ring, --tp and serve's --replicas and the world
// size: parsed, checked and turned into a dist::DeviceMesh in one place. It is the one path from
// degrees to a mesh: a pipeline's transformer, its text encoders (ParallelDims{1, 1, 1, degree}),
// the model commands and the benchmark all build theirs here.
//
// The mesh's dimensions, row-major with tp varying fastest:
//   ["replica" (only when > 1)], "cfg", "ulysses", "ring", "tp"
// cfg, ulysses, ring and tp are always present, size 1 included, so mesh.size("ulysses") and
// mesh.group("cfg") work on every mesh built here. The world may be a multiple of
// cfg x ulysses x ring x tp: each block of that many consecutive ranks then runs the whole
// pipeline as one replica (the same image on every replica, or, with serve's independent
// replicas, requests of its own).
#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shardit/parallel/tensor_parallel.h"

namespace shardit::dist {
class DeviceMesh;
class World;
}  // namespace shardit::dist

namespace shardit::parallel {

struct ParallelLayout;

/// cfg x ulysses x ring x tp, and how many copies of that mesh the world holds.
struct ParallelDims {
  /// Classifier-free guidance branches run side by side: 1, or 2 (the conditional branch on the
  /// first half of the mesh, the unconditional one on the second).
  int cfg = 1;
  /// Ulysses (all-to-all) context-parallel degree.
  int ulysses = 1;
  /// Ring-attention context-parallel degree.
  int ring = 1;
  /// Tensor-parallel degree; 0: what the world leaves after cfg x ulysses x ring (and the
  /// replicas, when set).
  int tp = 0;
  /// Copies of the cfg x ulysses x ring x tp mesh (serve's --replicas); 0: what the world leaves.
  /// When set, replicas x cfg x ulysses x ring x tp must make the world exactly.
  int replicas = 0;

  /// cfg * ulysses * ring * tp, with an unset tp counted as 1 (the replicas not counted).
  int product() const;
  /// The degrees checked against a world of `world_size` ranks, with tp filled in when unset.
  /// Errors, naming the command-line flags: a degree below 1 (tp below 0), a cfg degree other
  /// than 1 or 2, a product that does not divide the world (listing the meshes that fit it), and
  /// set replicas that do not make the world with the mesh.
  ParallelDims resolved(int world_size) const;
  /// Replicas of the (resolved) mesh in a world of `world_size` ranks.
  int replicas_in(int world_size) const { return world_size / resolved(world_size).product(); }
  /// The mesh's dimensions in order (see the file comment), resolved against `world_size`.
  std::vector<std::pair<std::string, int>> mesh_dims(int world_size) const;
  /// The degrees resolved against `world` and the mesh built from them (none on a world of one
  /// rank). Collective over the world: the ranks first agree on the degrees, so ranks launched
  /// with different flags fail with a named error.
  ParallelLayout build(dist::World& world) const;
  /// "cfg=2 x ulysses=1 x ring=1 x tp=2" (tp=auto when unset): the mesh's degrees; the replicas
  /// are what the world leaves of them.
  std::string to_string() const;
  /// The command-line flags that select these degrees ("--cfg-parallel --ulysses 2 --tp 2"):
  /// --cfg-parallel, --ulysses and --ring only when above 1, --tp always (when set).
  std::string to_flags() const;
  /// Every cfg x ulysses x ring x tp with cfg in {1, 2} whose product is `world_size`, ordered
  /// by cfg, then ulysses, then ring.
  static std::vector<ParallelDims> fitting(int world_size);

  bool operator==(const ParallelDims& other) const {
    return cfg == other.cfg && ulysses == other.ulysses && ring == other.ring && tp == other.tp &&
           replicas == other.replicas;
  }
  bool operator!=(const ParallelDims& other) const { return !(*this == other); }
};

/// How the ranks are laid out for one model: the resolved degrees and the mesh built from them,
/// together, so that nothing downstream reads the degrees back from the mesh. Made by
/// ParallelDims::build (or default: one rank, no mesh).
struct ParallelLayout {
  ParallelDims dims{1, 1, 1, 1};  ///< resolved: tp is set
  /// cfg x ulysses x ring x tp (with "replica" first when the world holds several); null on a
  /// world of one rank, where the model is loaded whole.
  std::shared_ptr<const dist::DeviceMesh> mesh;

  /// The mesh's "tp" dimension as a model's tensor-parallel config (the mesh kept with it, for
  /// the context-parallel dimensions); nullopt without a mesh (a world of one rank: the model is
  /// loaded whole).
  std::optional<TensorParallelConfig> tensor_parallel() const;
};

/// Why `model` cannot run on a mesh of (resolved) `dims`: its plan does not resolve at dims.tp, or
/// a head count it declares (check_context_parallel_split) does not divide by
/// tp x ulysses (Ulysses attention splits the heads TP leaves). "" when it can. Reads no weight.
std::string split_problem(TensorParallelModule& model, const ParallelDims& dims, at::ScalarType dtype = at::kFloat);

/// Fails unless `model` can run on `dims`, naming `what` (the model) and the problem, and listing
/// the meshes of `world_size` ranks it can run on (with cfg 2 only when `allow_cfg`).
void check_split(TensorParallelModule& model, const ParallelDims& dims, int world_size, const std::string& what,
                 bool allow_cfg, at::ScalarType dtype = at::kFloat);

}  // namespace shardit::parallel

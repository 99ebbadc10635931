#pragma once
// Context parallelism against the single-rank output, for any model with both plans (a TP plan
// and a CP plan): the reference forward runs in the test's own process, then each mesh
// (tp, ulysses, ring) runs as real ranks on this host, every rank loading the same weights,
// sharding them over "tp", splitting the sequence over "ulysses" x "ring", and comparing the
// gathered output with the reference.
//
//   TEST(CpMyModel, MeshesMatchSingleRank) {
//     const ContextParallelCase c = my_case();     // the same in the parent and in every rank
//     if (shardit::testing::is_worker()) return context_parallel_worker(c);
//     expect_context_parallel_matches(c);
//   }
#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace shardit::parallel {
class TensorParallelModule;
}

namespace shardit::testing {

/// One mesh: tensor-parallel, Ulysses and ring degrees (world = their product).
struct CpMesh {
  int tp = 1;
  int ulysses = 1;
  int ring = 1;
  int world() const { return tp * ulysses * ring; }
  /// "tp=2 x ulysses=1 x ring=2"
  std::string to_string() const;
};

/// (tp, ulysses, ring) in {(1,1,1), (2,1,1), (1,2,1), (1,1,2), (2,2,1), (2,1,2)}.
const std::vector<CpMesh>& standard_cp_meshes();

struct ContextParallelCase {
  /// The model with its weights loaded whole (the same on every rank; not sharded).
  std::function<std::shared_ptr<parallel::TensorParallelModule>()> load_model;
  /// One forward on the case's inputs (the same on every rank: fixed seeds or files); the sample.
  std::function<at::Tensor(parallel::TensorParallelModule&)> forward;
  /// |a - b| <= atol + rtol |b|: the golden tolerance of an fp32 transformer by default.
  double atol = 1e-4;
  double rtol = 1e-4;
};

/// The rank's side: builds the mesh from the launch, loads, shards over "tp", enables context
/// parallelism, runs the forward and compares with the parent's reference. Also checks that the
/// sequence really travelled (all-to-all for Ulysses, ring shifts for the ring).
void context_parallel_worker(const ContextParallelCase& c);

/// The parent's side: the single-rank reference, then one multi-process run per mesh.
void expect_context_parallel_matches(const ContextParallelCase& c,
                                     const std::vector<CpMesh>& meshes = standard_cp_meshes());

}  // namespace shardit::testing

#include "support/context_parallel_case.h"

#include <gtest/gtest.h>

#include <iostream>
#include <sstream>

#include "shardit/dist/mesh.h"
#include "shardit/dist/world.h"
#include "shardit/io/safetensors.h"
#include "shardit/parallel/context_parallel.h"
#include "shardit/parallel/tensor_parallel.h"
#include "support/multiprocess.h"
#include "support/test_support.h"

namespace shardit::testing {

std::string CpMesh::to_string() const {
  return "tp=" + std::to_string(tp) + " x ulysses=" + std::to_string(ulysses) + " x ring=" + std::to_string(ring);
}

const std::vector<CpMesh>& standard_cp_meshes() {
  static const std::vector<CpMesh> meshes = {{1, 1, 1}, {2, 1, 1}, {1, 2, 1}, {1, 1, 2}, {2, 2, 1}, {2, 1, 2}};
  return meshes;
}

namespace {

CpMesh mesh_from_environment() {
  CpMesh mesh;
  std::istringstream text(env_or("SHARDIT_CP_MESH"));
  char comma = 0;
  text >> mesh.tp >> comma >> mesh.ulysses >> comma >> mesh.ring;
  return mesh;
}

}  // namespace

void context_parallel_worker(const ContextParallelCase& c) {
  auto& world = dist::World::init();
  const CpMesh degrees = mesh_from_environment();
  ASSERT_EQ(degrees.world(), world.size()) << degrees.to_string();
  // The shared convention: cfg x ulysses x ring x tp, row-major, tp fastest.
  const dist::DeviceMesh mesh(world, {{"ulysses", degrees.ulysses}, {"ring", degrees.ring}, {"tp", degrees.tp}});
  auto model = c.load_model();
  if (degrees.tp > 1) model->enable_parallelism(parallel::TensorParallelConfig(mesh, "tp"));
  const parallel::ContextParallelConfig config(mesh);
  model->enable_context_parallelism(config);
  const at::Tensor sample = c.forward(*model);

  const at::Tensor expected = io::SafetensorsFile::open(env_or("SHARDIT_CP_REFERENCE"))->read("sample");
  const auto result = tensors_close(model->type_name() + " sample at " + degrees.to_string(), sample, expected,
                                    c.atol, c.rtol);
  EXPECT_TRUE(result);
  if (world.rank() == 0) std::cout << result.message() << "\n";
  EXPECT_EQ(model->tp_degree(), degrees.tp);
  // The sequence really travelled: a forward that skipped the exchange would still run.
  if (degrees.ulysses > 1) {
    EXPECT_GT(config.ulysses_group->stats().calls_by_op["all_to_all"], 0u);
  }
  if (degrees.ring > 1) {
    EXPECT_GT(config.ring_group->stats().calls_by_op["ring_shift"], 0u);
  }
}

void expect_context_parallel_matches(const ContextParallelCase& c, const std::vector<CpMesh>& meshes) {
  auto model = c.load_model();
  const at::Tensor sample = c.forward(*model);
  const std::string reference = make_temp_dir("cp-reference") + "/reference.safetensors";
  io::save_safetensors(reference, {{"sample", sample}});
  for (const CpMesh& mesh : meshes) {
    EXPECT_EQ(run_ranks(mesh.world(), {{"SHARDIT_CP_MESH", std::to_string(mesh.tp) + "," + std::to_string(mesh.ulysses) +
                                                               "," + std::to_string(mesh.ring)},
                                       {"SHARDIT_CP_REFERENCE", reference}}),
              0)
        << mesh.to_string();
  }
}

}  // namespace shardit::testing

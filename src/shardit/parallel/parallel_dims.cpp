#include "shardit/parallel/parallel_dims.h"

#include <c10/util/Exception.h>

#include <optional>
#include <string>

#include "shardit/dist/mesh.h"
#include "shardit/dist/world.h"

namespace shardit::parallel {

namespace {

/// "cfg 2 (--cfg-parallel) x ulysses 1 (--ulysses) x ring 1 (--ring)", with " x tp 3 (--tp)"
/// when tp is set.
std::string with_flags(const ParallelDims& dims) {
  std::string out = "cfg " + std::to_string(dims.cfg) + " (--cfg-parallel) x ulysses " +
                    std::to_string(dims.ulysses) + " (--ulysses) x ring " + std::to_string(dims.ring) + " (--ring)";
  if (dims.tp > 0) out += " x tp " + std::to_string(dims.tp) + " (--tp)";
  return out;
}

std::string ranks(int n) { return std::to_string(n) + (n == 1 ? " rank" : " ranks"); }

/// "[--tp 4], [--ring 2 --tp 2], ...": the meshes that fill `world_size` ranks exactly.
std::string fitting_list(int world_size) {
  std::string out;
  for (const ParallelDims& dims : ParallelDims::fitting(world_size)) {
    out += (out.empty() ? "[" : ", [") + dims.to_flags() + "]";
  }
  return out;
}

/// `dims` (with replicas set) checked against `world_size`: the world as that many copies of the
/// mesh, an unset tp taking what they leave. Only serve has --replicas, so the error says so.
ParallelDims with_replicas(const ParallelDims& dims, int world_size) {
  ParallelDims out = dims;
  const int context = dims.cfg * dims.ulysses * dims.ring;
  if (dims.tp == 0 && world_size % (dims.replicas * context) == 0) out.tp = world_size / (dims.replicas * context);
  TORCH_CHECK(out.tp >= 1 && out.product() * dims.replicas == world_size, "serve: --replicas ", dims.replicas, " of ",
              out.to_string(), " do not make the ", world_size, " ranks; choose --replicas and --tp (--cfg-parallel, "
              "--ulysses, --ring) so that replicas x cfg x ulysses x ring x tp = ", world_size);
  return out;
}

}  // namespace

int ParallelDims::product() const { return cfg * ulysses * ring * (tp > 0 ? tp : 1); }

ParallelDims ParallelDims::resolved(int world_size) const {
  TORCH_CHECK(world_size >= 1, "the world has ", world_size, " ranks; expected at least 1");
  TORCH_CHECK(ulysses >= 1, "--ulysses is ", ulysses, "; the Ulysses degree is at least 1");
  TORCH_CHECK(ring >= 1, "--ring is ", ring, "; the ring degree is at least 1");
  TORCH_CHECK(tp >= 0, "--tp is ", tp, "; the tensor-parallel degree is at least 1 (or unset: the rest of the world)");
  TORCH_CHECK(cfg == 1 || cfg == 2, "--cfg-parallel degree ", cfg,
              ": classifier-free guidance has two branches (conditional and unconditional), so the cfg degree "
              "is 1 or 2");
  TORCH_CHECK(replicas >= 0, "--replicas is ", replicas, "; expected at least 1 (or unset: what the mesh leaves)");
  if (replicas > 0) return with_replicas(*this, world_size);
  ParallelDims out = *this;
  const int fixed = product();
  if (tp == 0) {
    TORCH_CHECK(world_size % fixed == 0, "the parallel mesh ", with_flags(*this), " = ", fixed,
                " does not divide the ", ranks(world_size), " launched, so --tp cannot take the rest; launch a "
                "multiple of ", ranks(fixed), ", or choose degrees whose product is ", world_size, ": ",
                fitting_list(world_size));
    out.tp = world_size / fixed;
  } else {
    TORCH_CHECK(world_size % fixed == 0, "the parallel mesh ", with_flags(*this), " = ", fixed,
                " does not divide the ", ranks(world_size), " launched; choose degrees whose product is ",
                world_size, " (or divides it: each block of that many ranks then runs a replica): ",
                fitting_list(world_size));
  }
  return out;
}

std::vector<std::pair<std::string, int>> ParallelDims::mesh_dims(int world_size) const {
  const ParallelDims dims = resolved(world_size);
  std::vector<std::pair<std::string, int>> out;
  const int replicas = world_size / dims.product();
  if (replicas > 1) out.emplace_back("replica", replicas);
  out.emplace_back("cfg", dims.cfg);
  out.emplace_back("ulysses", dims.ulysses);
  out.emplace_back("ring", dims.ring);
  out.emplace_back("tp", dims.tp);
  return out;
}

ParallelLayout ParallelDims::build(dist::World& world) const {
  ParallelLayout layout;
  layout.dims = resolved(world.size());  // wrong degrees fail here, naming the flags
  if (world.size() == 1) return layout;
  world.agree("parallel mesh (--cfg-parallel, --ulysses, --ring, --tp)", layout.dims.to_string());
  layout.mesh = std::make_shared<const dist::DeviceMesh>(world, mesh_dims(world.size()));
  return layout;
}

std::optional<TensorParallelConfig> ParallelLayout::tensor_parallel() const {
  if (!mesh) return std::nullopt;
  return TensorParallelConfig(*mesh, "tp");
}

std::string ParallelDims::to_string() const {
  return "cfg=" + std::to_string(cfg) + " x ulysses=" + std::to_string(ulysses) + " x ring=" + std::to_string(ring) +
         " x tp=" + (tp > 0 ? std::to_string(tp) : std::string("auto"));
}

std::string ParallelDims::to_flags() const {
  std::string out;
  const auto add = [&out](const std::string& flag) { out += (out.empty() ? "" : " ") + flag; };
  if (cfg > 1) add(cfg == 2 ? "--cfg-parallel" : "--cfg-parallel=" + std::to_string(cfg));
  if (ulysses > 1) add("--ulysses " + std::to_string(ulysses));
  if (ring > 1) add("--ring " + std::to_string(ring));
  if (tp > 0) add("--tp " + std::to_string(tp));
  return out;
}

std::vector<ParallelDims> ParallelDims::fitting(int world_size) {
  std::vector<ParallelDims> out;
  for (int cfg = 1; cfg <= 2; ++cfg) {
    if (world_size % cfg != 0) continue;
    const int rest = world_size / cfg;
    for (int ulysses = 1; ulysses <= rest; ++ulysses) {
      if (rest % ulysses != 0) continue;
      for (int ring = 1; ring <= rest / ulysses; ++ring) {
        if (rest / ulysses % ring != 0) continue;
        out.push_back(ParallelDims{cfg, ulysses, ring, rest / ulysses / ring});
      }
    }
  }
  return out;
}

std::string split_problem(TensorParallelModule& model, const ParallelDims& dims, at::ScalarType dtype) {
  try {
    model.resolve(dims.tp, dtype);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  try {
    check_context_parallel_split(model, dims.tp, dims.ulysses);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

void check_split(TensorParallelModule& model, const ParallelDims& dims, int world_size, const std::string& what,
                 bool allow_cfg, at::ScalarType dtype) {
  const std::string problem = split_problem(model, dims, dtype);
  if (problem.empty()) return;
  std::string fits;
  for (const ParallelDims& candidate : ParallelDims::fitting(world_size)) {
    if (candidate.cfg > 1 && !allow_cfg) continue;
    if (split_problem(model, candidate, dtype).empty()) fits += (fits.empty() ? "[" : ", [") + candidate.to_flags() + "]";
  }
  TORCH_CHECK(false, what, " cannot run on the mesh ", dims.to_string(), ": ", problem, "; meshes of ",
              ranks(world_size), " it can run on: ", fits.empty() ? "none (launch another number of ranks)" : fits);
}

}  // namespace shardit::parallel

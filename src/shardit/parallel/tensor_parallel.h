#pragma once
// The one model-agnostic tensor-parallel applier. A plan is resolved against a model (every
// parameter gets a ShardSpec, everything validated before any weight moves), then applied either
// to a model already in memory (enable_parallelism) or while loading from safetensors
// (load_weights with a config: each rank reads only its own slices).
#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardit/dist/group.h"
#include "shardit/io/safetensors.h"
#include "shardit/nn/module.h"
#include "shardit/parallel/plan.h"

namespace shardit::dist {
class DeviceMesh;
}

namespace shardit::parallel {

/// Which ranks a model is sharded over.
struct TensorParallelConfig {
  /// The tensor-parallel group: the whole world, or one dimension of a mesh.
  std::shared_ptr<dist::Group> group;

  explicit TensorParallelConfig(std::shared_ptr<dist::Group> group);
  /// The `dim` dimension of a (possibly 2-D) mesh.
  explicit TensorParallelConfig(const dist::DeviceMesh& mesh, const std::string& dim = "tp");
  /// TP over the whole world; `tp_degree` must equal the world size.
  static TensorParallelConfig from_degree(int tp_degree);

  int tp_degree() const;
  int tp_rank() const;
};

/// How one parameter is laid out across ranks.
struct ShardSpec {
  std::string parameter;            ///< dotted name, as the checkpoint key
  std::string plan_key;             ///< the plan entry that matched its module, "" if none
  std::optional<ShardStyle> style;  ///< nullopt: replicated
  std::vector<int64_t> full_shape;
  int64_t dim = -1;                 ///< the split dimension, -1 when replicated
  /// Per rank, the ranges of `dim` it holds (concatenated in this order).
  std::vector<std::vector<io::Range>> ranges_per_rank;

  bool is_sharded() const { return dim >= 0; }
  std::vector<int64_t> local_shape(int tp_rank) const;
};

/// A plan resolved against one model at one TP degree.
struct ResolvedPlan {
  int tp_degree = 1;
  std::vector<ShardSpec> parameters;  ///< every parameter of the model, in model order
  int64_t element_size = 4;           ///< bytes per element used for the byte counts
  int64_t replicated_bytes() const;   ///< bytes every rank holds whole
  int64_t sharded_bytes() const;      ///< full bytes of the sharded parameters
  int64_t bytes_on_rank(int tp_rank) const;
  const ShardSpec& spec(const std::string& parameter) const;
  /// A human-readable table: parameter, style, full shape, per-rank shape, bytes.
  std::string to_table() const;
};

/// Resolves `plan` against `model` at `tp_degree`. Validates before anything moves: each key
/// matches at least one module, at most one `*` whose prefix names a module list, the matched
/// module is a Linear, every split dimension and packed block divides by the degree, and every
/// `divisors` entry too. Errors name the plan key, the tensor, the sizes, and the degrees that
/// would work.
ResolvedPlan resolve_plan(nn::Module& model, const TpPlan& plan, int tp_degree,
                          const std::vector<TpDivisor>& divisors = {});

/// This rank's slice of a full tensor under `spec` (a copy; the full tensor can be freed).
at::Tensor shard_tensor(const at::Tensor& full, const ShardSpec& spec, int tp_rank);

/// Shards a model already in memory: replaces every sharded parameter by this rank's slice
/// (freeing the rest) and switches each matched Linear to its parallel mode.
void apply_tensor_parallel(nn::Module& model, const TpPlan& plan, const TensorParallelConfig& config,
                           const std::vector<TpDivisor>& divisors = {});

struct LoadOptions {
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  /// Tensor parallelism applied while loading; nullopt: load whole.
  std::optional<TensorParallelConfig> tensor_parallel;
  /// Checkpoint tensors whose names start with one of these are allowed and not read (diffusers'
  /// `_keys_to_ignore_on_load_unexpected`: a decode-only VAE skips `encoder.`).
  std::vector<std::string> ignored_prefixes;
};

/// Fills a model's (meta) parameters from a checkpoint. With tensor_parallel set, reads only
/// this rank's slice of each sharded tensor and switches the Linears to their parallel modes.
/// Errors list missing weights, unexpected extra weights and shape mismatches, naming the file.
void load_weights(nn::Module& model, const io::Checkpoint& checkpoint, const TpPlan& plan,
                  const LoadOptions& options, const std::vector<TpDivisor>& divisors = {});

/// A model that carries its tensor-parallel plan. Model code declares the plan; it never reads
/// ranks.
class TensorParallelModule : public nn::Module {
 public:
  /// The model's plan, as data.
  virtual const TpPlan& tp_plan() const = 0;
  /// Constraints beyond the sharded shapes (head counts).
  virtual std::vector<TpDivisor> tp_divisors() const { return {}; }
  /// Checkpoint name prefixes the model does not load (added to LoadOptions::ignored_prefixes).
  virtual std::vector<std::string> ignored_weight_prefixes() const { return {}; }

  /// Shards this (loaded) model in memory.
  void enable_parallelism(const TensorParallelConfig& config);
  /// Loads weights, sharded on the fly when options.tensor_parallel is set.
  void load(const io::Checkpoint& checkpoint, const LoadOptions& options);
  /// The plan resolved at `tp_degree` (for `shardit inspect --plan`).
  ResolvedPlan resolve(int tp_degree);
  int tp_degree() const { return tp_degree_; }

 private:
  int tp_degree_ = 1;
};

}  // namespace shardit::parallel

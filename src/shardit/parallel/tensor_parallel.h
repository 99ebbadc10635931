#pragma once
// The one model-agnostic tensor-parallel applier. A plan is resolved against a model (every
// parameter gets a ShardSpec, everything validated before any weight moves), then applied either
// to a model already in memory (enable_parallelism) or while loading from safetensors
// (load_weights with a config: each rank reads only its own slices).
#include <ATen/ATen.h>

#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shardit/dist/group.h"
#include "shardit/io/gguf.h"
#include "shardit/io/safetensors.h"
#include "shardit/nn/module.h"
#include "shardit/nn/quantized_weight.h"
#include "shardit/parallel/context_parallel.h"
#include "shardit/parallel/plan.h"

namespace shardit::dist {
class DeviceMesh;
}

namespace shardit::parallel {

/// Which ranks one component is sharded over. Each component of a pipeline gets its own: the
/// transformer at TP=4, a text encoder at TP=2, the VAE replicated (no config).
struct TensorParallelConfig {
  /// The tensor-parallel group: the whole world, or one dimension of a mesh.
  std::shared_ptr<dist::Group> group;
  /// The mesh the group is a dimension of (null when built from a bare group). Later parallel
  /// dimensions (context, CFG) of the same component are read from it.
  std::shared_ptr<const dist::DeviceMesh> mesh;
  /// The name of the tensor-parallel dimension in `mesh`.
  std::string mesh_dim;

  explicit TensorParallelConfig(std::shared_ptr<dist::Group> group);
  /// The `dim` dimension of a (possibly N-D) mesh; the mesh is kept (it is cheap to copy). A
  /// degree over the world is laid out by parallel::ParallelDims::build (ParallelLayout::
  /// tensor_parallel gives its "tp" dimension).
  explicit TensorParallelConfig(const dist::DeviceMesh& mesh, const std::string& dim = "tp");

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
  /// Ranks holding each slice: 1, or degree / heads for a head-replicated entry
  /// (ModelTraits::replicable_heads), whose rank r holds head r / replicas whole.
  int64_t replicas = 1;
  int64_t element_size = 4;         ///< bytes per element in the loaded dtype
  /// GGUF blocks (count_as_gguf_blocks): elements per stored block, element_size then being one
  /// block's bytes; 1 otherwise.
  int64_t block_elements = 1;
  /// A Linear weight held in 8 bits (element_size 1; its fp32 per-row scales are not counted) or
  /// as GGUF blocks (their scales counted: they are part of each block).
  bool quantized = false;
  bool is_buffer = false;
  bool is_floating = true;

  bool is_sharded() const { return dim >= 0; }
  /// Counts this Linear weight as held in GGUF blocks of `type` (Q4_K: 144 bytes per 256
  /// elements), as stored: what a loader of GGUF weights (nn/gguf_linear.h) sets.
  void count_as_gguf_blocks(io::GgmlType type);
  std::vector<int64_t> local_shape(int tp_rank) const;
  int64_t full_bytes() const;
  int64_t bytes_on_rank(int tp_rank) const;
};

/// A plan resolved against one model at one TP degree: every tensor of its state (parameters
/// and persistent buffers) with its layout. Kept by the loaded model (TensorParallelModule::
/// resolved_plan) for inspect, tests and benchmarks.
struct ResolvedPlan {
  int tp_degree = 1;
  TpPlanKind plan = TpPlanKind::Full;  ///< which of the model's plans (TensorParallelModule::plan)
  at::ScalarType dtype = at::kFloat;  ///< the dtype the byte counts are in
  std::vector<ShardSpec> parameters;  ///< every state tensor of the model, in model order
  int64_t replicated_bytes() const;   ///< bytes every rank holds whole
  int64_t sharded_bytes() const;      ///< full bytes of the sharded parameters
  /// Extra bytes the head-replicated tensors take over all ranks (each slice held `replicas`
  /// times): every rank holds replicated + (sharded + head_replica_bytes) / tp_degree.
  int64_t head_replica_bytes() const;
  int64_t bytes_on_rank(int tp_rank) const;
  int64_t total_elements() const;
  /// Sharded layers with this style (counted by their weights): at a degree above 1, a forward
  /// all-reduces once per Rowwise / PackedRowwise layer call and all-gathers once per
  /// ColwiseGather layer call, on the tensor-parallel group.
  int64_t layers_with_style(std::initializer_list<ShardStyle> styles) const;
  const ShardSpec& spec(const std::string& parameter) const;
  /// A human-readable table: parameter, style, full shape, per-rank shape, bytes.
  std::string to_table() const;
};

/// Colwise plan entries whose output is `heads` equal head blocks that may be replicated across
/// ranks (vLLM's key/value head replication for grouped-query attention): at a degree dividing
/// `heads` each rank holds heads / degree of them (a plain colwise split); at a multiple of
/// `heads`, rank r holds head r / (degree / heads) whole, like the degree / heads - 1 ranks next
/// to it. Any other degree is refused, listing the ones that work.
struct ReplicableHeads {
  std::vector<std::string> plan_keys;  ///< "layers.*.self_attn.k_proj", exactly as in the plan
  std::string what;                    ///< "num_key_value_heads", for messages
  int64_t heads;
};

/// What the model declares besides its plan, for resolving and loading.
struct ModelTraits {
  /// Constraints beyond the sharded shapes (head counts).
  std::vector<TpDivisor> divisors;
  /// diffusers' `_keep_in_fp32_modules`: tensors under a module of one of these names stay fp32
  /// whatever the load dtype (nn::keeps_fp32).
  std::vector<std::string> keep_in_fp32_modules;
  /// Alternative checkpoint keys per state name (tied weights stored under the other name,
  /// renamed weights): the first key present is read; any others present are accepted too.
  std::vector<std::pair<std::string, std::vector<std::string>>> key_aliases;
  /// Checkpoint keys the model does not use, as globs with `*` standing for any run of characters
  /// (transformers' `_keys_to_ignore_on_load_unexpected`).
  std::vector<std::string> ignored_checkpoint_keys;
  /// Colwise entries that split by heads below the head count and replicate heads above it.
  std::vector<ReplicableHeads> replicable_heads;
  /// Linears that quantize-on-load (LoadOptions::weights) leaves dense, as module-path globs with
  /// `*` standing for any run of characters ("transformer_blocks.*.norm1.linear", "norm_out.*").
  std::vector<std::string> keep_high_precision;
};

/// Whether quantize-on-load to `weights` stores the Linear weight `parameter` ("a.b.weight" of a
/// Linear) in 8 bits: not for Checkpoint, keep-in-fp32 modules, or (unless `quantize_kept`)
/// modules matching traits.keep_high_precision.
bool quantizes_on_load(const std::string& parameter, nn::WeightsDtype weights, const ModelTraits& traits,
                       bool quantize_kept = false);

/// Resolves `plan` against `model` at `tp_degree`. Validates before anything moves: each key
/// matches at least one module, at most one `*` whose prefix names a module list, the matched
/// module is a Linear, every split dimension and packed block divides by the degree, and every
/// `divisors` entry too. Errors name the plan key, the tensor, the sizes, and the degrees that
/// would work.
/// Byte counts are in `dtype` (floating tensors; fp32 for keep-in-fp32 ones), one byte for the
/// Linear weights quantize-on-load to `weights` stores in 8 bits.
ResolvedPlan resolve_plan(nn::Module& model, const TpPlan& plan, int tp_degree, const ModelTraits& traits = {},
                          at::ScalarType dtype = at::kFloat, nn::WeightsDtype weights = nn::WeightsDtype::Checkpoint);

/// This rank's slice of a full tensor under `spec` (a copy; the full tensor can be freed).
at::Tensor shard_tensor(const at::Tensor& full, const ShardSpec& spec, int tp_rank);

/// Shards a model already in memory: replaces every sharded parameter by this rank's slice
/// (freeing the rest) and switches each matched layer to its parallel mode. Returns the plan.
ResolvedPlan apply_tensor_parallel(nn::Module& model, const TpPlan& plan, const TensorParallelConfig& config,
                                   const ModelTraits& traits = {});

struct LoadOptions {
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  /// Tensor parallelism applied while loading; nullopt: load whole.
  std::optional<TensorParallelConfig> tensor_parallel;
  /// Which of the model's plans tensor_parallel applies (TensorParallelModule::load).
  TpPlanKind plan = TpPlanKind::Full;
  /// Quantize-on-load: Fp8 or Int8 stores each Linear weight (but ModelTraits::keep_high_precision
  /// ones) in 8 bits with symmetric per-output-row scales over the whole, unsharded row, so every
  /// TP degree holds the same dequantized weights. Checkpoint: F8_E4M3 / F8_E5M2 Linear weights
  /// stay 8-bit (scaled by the checkpoint's `<module>.weight_scale` / `<module>.scale_weight`,
  /// docs/quantization.md), the rest load dense in `dtype`.
  nn::WeightsDtype weights = nn::WeightsDtype::Checkpoint;
  /// Int8 compute (nn/int8_compute.h): the int8 Linears multiply int8 activation codes in
  /// LibTorch's quantized engine instead of dequantizing. Needs weights = Int8 on the CPU
  /// (nn::check_int8_compute, before anything is read).
  bool int8_compute = false;
  /// Quantizes the keep_high_precision Linears too (tests of every shard style; not a user default).
  bool quantize_kept_layers = false;
};

/// Fills a model's (meta) parameters and persistent buffers from a checkpoint. With
/// tensor_parallel set, reads only this rank's slice of each sharded tensor and switches the
/// matched layers to their parallel modes. 8-bit Linear weights (LoadOptions::weights) are checked
/// (scales present, shaped [], [1], [out] or [out, 1], finite, positive) before any weight is read. Errors list missing weights, unexpected extra weights
/// and shape mismatches, naming the file. Returns the plan (at degree 1 without tensor_parallel).
ResolvedPlan load_weights(nn::Module& model, const io::Checkpoint& checkpoint, const TpPlan& plan,
                          const LoadOptions& options, const ModelTraits& traits = {});

/// What load_weights would hold at `tp_degree` from `checkpoint`, without reading a weight: the plan
/// with each weight counted in the form the load keeps (GGUF blocks as stored, 8-bit Linears in one
/// byte), after the same checks (keys, shapes, 8-bit scales, GGUF blocks a degree would cut).
ResolvedPlan resolve_as_stored(nn::Module& model, const io::Checkpoint& checkpoint, const TpPlan& plan, int tp_degree,
                               const LoadOptions& options, const ModelTraits& traits = {});

class TensorParallelModule;

/// Refuses tensor-parallel and Ulysses degrees that do not split every head count the model
/// declares (ModelTraits::divisors named "...heads") into whole heads; the message lists the
/// (tp, ulysses) pairs that work. The ring degree is free.
void check_context_parallel_split(const TensorParallelModule& model, int tp_degree, int ulysses_degree);

/// A model that carries its tensor-parallel plan. Model code declares the plan; it never reads
/// ranks.
class TensorParallelModule : public nn::Module {
 public:
  /// The model's plan, as data.
  virtual const TpPlan& tp_plan() const = 0;
  /// The reference implementation's plan for this model (diffusers' `_tp_plan`, entry for
  /// entry), so its memory and outputs can be reproduced; null when the reference has none.
  virtual const TpPlan* reference_tp_plan() const { return nullptr; }
  /// tp_plan() or reference_tp_plan(); an error naming the model when it has no reference plan.
  const TpPlan& plan(TpPlanKind kind) const;
  /// Head-count constraints, keep-in-fp32 modules, key aliases.
  virtual ModelTraits traits() const { return {}; }

  /// Shards this (loaded) model in memory.
  void enable_parallelism(const TensorParallelConfig& config, TpPlanKind kind = TpPlanKind::Full);
  /// Loads weights, sharded on the fly when options.tensor_parallel is set.
  void load(const io::Checkpoint& checkpoint, const LoadOptions& options);
  /// Casts to `dtype` (keep-in-fp32 modules stay fp32) and moves to `device`.
  void to(at::Device device, at::ScalarType dtype);
  /// The plan resolved at `tp_degree` without loading anything (for `shardit inspect --plan`).
  ResolvedPlan resolve(int tp_degree, at::ScalarType dtype = at::kFloat, TpPlanKind kind = TpPlanKind::Full,
                       nn::WeightsDtype weights = nn::WeightsDtype::Checkpoint);
  /// The plan at `tp_degree` with the weights counted as `checkpoint` stores them and a load keeps
  /// them (parallel::resolve_as_stored), dense Linears quantized on load to `weights` as a load
  /// with --weights-dtype would: `shardit inspect --plan --transformer FILE`.
  ResolvedPlan resolve_as_stored(const io::Checkpoint& checkpoint, int tp_degree, at::ScalarType dtype = at::kFloat,
                                 TpPlanKind kind = TpPlanKind::Full,
                                 nn::WeightsDtype weights = nn::WeightsDtype::Checkpoint);
  int tp_degree() const { return resolved_plan_ ? resolved_plan_->tp_degree : 1; }
  /// The plan this model was loaded or sharded with (per-rank shapes and bytes); null before.
  const ResolvedPlan* resolved_plan() const { return resolved_plan_ ? &*resolved_plan_ : nullptr; }
  /// Fails naming `where` when a forward runs before every weight was loaded.
  void check_loaded(const std::string& where);
  /// The config it was sharded with; null when whole.
  const TensorParallelConfig* parallel_config() const { return config_ ? &*config_ : nullptr; }
  /// Makes `value` the same on every rank of the tensor-parallel group (the first member's), for
  /// a decision each rank computes from replicated activations: equal in exact arithmetic, it
  /// must not depend on a last bit. No-op when whole.
  void agree(at::Tensor& value) const;

  /// The model's context-parallel plan (diffusers' `_cp_plan`): the points of its forward that
  /// split the sequence and gather the output. Null: the model has none.
  virtual const CpPlan* cp_plan() const { return nullptr; }
  /// Splits every following forward's sequence over `config`'s ranks (parallel/context_parallel.h);
  /// composes with tensor parallelism (enable it before or after). Refused, before any forward,
  /// when the model has no cp plan or a head count does not divide by tp x ulysses (the message
  /// lists the pairs that work).
  void enable_context_parallelism(const ContextParallelConfig& config);
  /// The config from enable_context_parallelism; null without.
  const ContextParallelConfig* context_parallel_config() const { return cp_config_ ? &*cp_config_ : nullptr; }
  /// For the model's forward: the scope in which its cp plan's points split and gather and its
  /// attention exchanges; a no-op scope without context parallelism.
  ContextParallelForward context_parallel_forward() const;

 private:
  std::optional<ResolvedPlan> resolved_plan_;
  std::optional<TensorParallelConfig> config_;
  std::optional<ContextParallelConfig> cp_config_;
};

}  // namespace shardit::parallel

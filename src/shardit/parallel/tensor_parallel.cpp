// The applier: a plan resolved (plan_resolution.h) and applied to a model in memory, or while
// loading (weight_loading.cpp); the tensor-parallel config and the model that carries its plan.
#include "shardit/parallel/tensor_parallel.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#include "shardit/dist/mesh.h"
#include "shardit/parallel/plan_resolution.h"

namespace shardit::parallel {

// ---------------------------------------------------------------------------------------------
// TensorParallelConfig

TensorParallelConfig::TensorParallelConfig(std::shared_ptr<dist::Group> group) : group(std::move(group)) {
  TORCH_CHECK(this->group != nullptr,
              "TensorParallelConfig: the group is null (is this rank outside the group?)");
}

TensorParallelConfig::TensorParallelConfig(const dist::DeviceMesh& mesh, const std::string& dim)
    : TensorParallelConfig(mesh.group(dim)) {
  this->mesh = std::make_shared<const dist::DeviceMesh>(mesh);
  mesh_dim = dim;
}

int TensorParallelConfig::tp_degree() const { return group->size(); }
int TensorParallelConfig::tp_rank() const { return group->rank(); }

// ---------------------------------------------------------------------------------------------
// Resolving, sharding

ResolvedPlan resolve_plan(nn::Module& model, const TpPlan& plan, int tp_degree, const ModelTraits& traits,
                          at::ScalarType dtype, nn::WeightsDtype weights) {
  return resolve_with_layers(model, plan, tp_degree, traits, dtype, weights).plan;
}

ResolvedPlan apply_tensor_parallel(nn::Module& model, const TpPlan& plan, const TensorParallelConfig& config,
                                   const ModelTraits& traits) {
  TORCH_CHECK(config.group != nullptr, "apply_tensor_parallel: the config has no group");
  auto slots = model.named_states();
  for (const auto& slot : slots) {
    TORCH_CHECK(slot.tensor->defined() && !slot.tensor->is_meta(), "apply_tensor_parallel: parameter '",
                slot.name,
                "' is not loaded; load the weights first, or shard while loading (load_weights with "
                "LoadOptions::tensor_parallel)");
  }
  // Byte counts in the dtype the model holds now.
  at::ScalarType dtype = at::kFloat;
  for (const auto& slot : slots) {
    if (!slot.tensor->is_floating_point() || nn::keeps_fp32(slot.name, traits.keep_in_fp32_modules)) continue;
    dtype = slot.tensor->scalar_type();
    break;
  }
  Resolution resolution = resolve_with_layers(model, plan, config.tp_degree(), traits, dtype);
  TORCH_INTERNAL_ASSERT(slots.size() == resolution.plan.parameters.size());
  const int rank = config.tp_rank();
  for (size_t i = 0; i < slots.size(); ++i) {
    const ShardSpec& spec = resolution.plan.parameters[i];
    TORCH_INTERNAL_ASSERT(spec.parameter == slots[i].name);
    if (!spec.is_sharded()) continue;
    nn::Linear* linear = linear_of_weight(slots[i]);
    if (linear != nullptr && linear->weight_format() != nn::WeightFormat::Dense) {
      TORCH_CHECK(!nn::weight_format_is_gguf(linear->weight_format()), "Linear '", linear->path(), "' holds ",
                  nn::weight_format_name(linear->weight_format()),
                  " blocks, which each rank reads as its own share (nn/gguf_linear.h); they are not resharded after "
                  "loading");
      // The per-row scales go with the rows: split like dim 0 when the rows are, else whole.
      linear->set_quantized_weight(shard_tensor(linear->weight, spec, rank), linear->weight_format(),
                                   row_scales_for_rank(linear->weight_scale(), spec, rank), linear->weight_dtype());
      continue;
    }
    // Assigning drops the slot's reference to the full tensor, so its memory is released.
    *slots[i].tensor = shard_tensor(*slots[i].tensor, spec, rank);
  }
  set_parallel_modes(resolution.layers, config.group);
  return std::move(resolution.plan);
}

// ---------------------------------------------------------------------------------------------
// TensorParallelModule

const TpPlan& TensorParallelModule::plan(TpPlanKind kind) const {
  if (kind == TpPlanKind::Full) return tp_plan();
  const TpPlan* reference = reference_tp_plan();
  TORCH_CHECK(reference != nullptr, type_name(), ": the reference implementation has no tensor-parallel plan for this ",
              "model; use the 'full' plan");
  return *reference;
}

namespace {

// Every head count the model declares must split into whole heads over tp x ulysses.
void check_context_parallel_divisors(const TensorParallelModule& model, const ContextParallelConfig& config) {
  check_context_parallel_split(model, std::max(model.tp_degree(), config.mesh_tp_degree()), config.ulysses_degree());
}

}  // namespace

void check_context_parallel_split(const TensorParallelModule& model, int tp_degree, int ulysses_degree) {
  for (const TpDivisor& divisor : model.traits().divisors) {
    const std::string& what = divisor.what;
    if (what.size() < 5 || what.compare(what.size() - 5, 5, "heads") != 0) continue;
    check_context_parallel_heads(model.type_name(), what, divisor.value, tp_degree, ulysses_degree);
  }
}

void TensorParallelModule::enable_parallelism(const TensorParallelConfig& config, TpPlanKind kind) {
  resolved_plan_ = apply_tensor_parallel(*this, plan(kind), config, traits());
  resolved_plan_->plan = kind;
  config_ = config;
  if (cp_config_) check_context_parallel_divisors(*this, *cp_config_);
}

void TensorParallelModule::load(const io::Checkpoint& checkpoint, const LoadOptions& options) {
  resolved_plan_ = load_weights(*this, checkpoint, plan(options.plan), options, traits());
  resolved_plan_->plan = options.plan;
  config_ = options.tensor_parallel;
  if (cp_config_) check_context_parallel_divisors(*this, *cp_config_);
}

void TensorParallelModule::enable_context_parallelism(const ContextParallelConfig& config) {
  TORCH_CHECK(cp_plan() != nullptr, type_name(), " has no context-parallel plan (cp_plan); it cannot split its ",
              "sequence over ", config.to_string());
  check_context_parallel_divisors(*this, config);
  cp_config_ = config;
}

ContextParallelForward TensorParallelModule::context_parallel_forward() const {
  if (!cp_config_) return ContextParallelForward();
  return ContextParallelForward(*cp_config_, *cp_plan(), type_name());
}

void TensorParallelModule::to(at::Device device, at::ScalarType dtype) {
  nn::Module::to(device, dtype, traits().keep_in_fp32_modules);
  if (resolved_plan_) {
    // Keep the recorded byte counts true to the new dtype.
    const ModelTraits model_traits = traits();
    resolved_plan_->dtype = dtype;
    for (ShardSpec& spec : resolved_plan_->parameters) {
      if (!spec.is_floating || spec.quantized) continue;  // integer and 8-bit state keep their type
      spec.element_size = loaded_element_size(spec.parameter, dtype, model_traits);
    }
  }
}

void TensorParallelModule::check_loaded(const std::string& where) {
  TORCH_CHECK(is_materialized(), where, ": forward called before the weights were loaded");
}

void TensorParallelModule::agree(at::Tensor& value) const {
  if (!config_ || config_->group->size() == 1) return;
  value = value.contiguous();
  config_->group->broadcast(value, 0);
}

ResolvedPlan TensorParallelModule::resolve(int tp_degree, at::ScalarType dtype, TpPlanKind kind,
                                           nn::WeightsDtype weights) {
  ResolvedPlan resolved = resolve_plan(*this, plan(kind), tp_degree, traits(), dtype, weights);
  resolved.plan = kind;
  return resolved;
}

ResolvedPlan TensorParallelModule::resolve_as_stored(const io::Checkpoint& checkpoint, int tp_degree,
                                                     at::ScalarType dtype, TpPlanKind kind, nn::WeightsDtype weights) {
  LoadOptions options;
  options.dtype = dtype;
  options.weights = weights;
  ResolvedPlan resolved = parallel::resolve_as_stored(*this, checkpoint, plan(kind), tp_degree, options, traits());
  resolved.plan = kind;
  return resolved;
}

}  // namespace shardit::parallel

#include "shardit/parallel/lora.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "shardit/nn/inputs.h"

namespace shardit::parallel {

namespace {

const ShardSpec* find_spec(const ResolvedPlan& plan, const std::string& parameter) {
  for (const ShardSpec& spec : plan.parameters) {
    if (spec.parameter == parameter) return &spec;
  }
  return nullptr;
}

/// An adapter weight or scale: finite and within what a float holds with room to multiply (a
/// larger one fails inside LibTorch's float conversion, naming nothing).
void check_lora_weight(const std::string& what, double value) {
  constexpr double kMaxLoraWeight = 1e4;
  TORCH_CHECK(std::isfinite(value) && std::abs(value) <= kMaxLoraWeight, what, " is ", value,
              "; it must be a finite number from ", -kMaxLoraWeight, " to ", kMaxLoraWeight);
}

/// The rows of `source` a factor uses, checked against the file.
io::Range source_rows(const io::SafetensorsFile& file, const LoraFactorSource& source, const std::string& module) {
  TORCH_CHECK(file.contains(source.key), file.path(), ": tensor '", source.key, "' (for module '", module,
              "') is missing; the file is truncated or not a complete LoRA");
  const io::TensorInfo& info = file.info(source.key);
  // An integer factor would be cast to the compute dtype and silently change the weights.
  TORCH_CHECK(at::isFloatingType(io::to_scalar_type(info.dtype)), file.path(), ": tensor '", source.key, "' is ",
              io::st_dtype_name(info.dtype), ", expected a floating-point LoRA factor (F32, F16, BF16) for module '",
              module, "'");
  TORCH_CHECK(info.shape.size() == 2, file.path(), ": tensor '", source.key, "' has shape [",
              c10::IntArrayRef(info.shape), "], expected a 2-D LoRA factor (for module '", module, "')");
  const int64_t rows = source.rows < 0 ? info.shape[0] - source.row_begin : source.rows;
  TORCH_CHECK(source.row_begin >= 0 && rows > 0 && source.row_begin + rows <= info.shape[0], file.path(),
              ": tensor '", source.key, "' has ", info.shape[0], " rows, but module '", module, "' needs rows [",
              source.row_begin, ", ", source.row_begin + rows, ")");
  return {source.row_begin, source.row_begin + rows};
}

/// Checks one target against the file and the model's plan; returns the weight's shard spec.
const ShardSpec& check_target(const io::SafetensorsFile& file, const LoraTarget& target, const ResolvedPlan& plan,
                              const std::string& model_name) {
  const ShardSpec* spec = find_spec(plan, target.module + ".weight");
  TORCH_CHECK(spec != nullptr && spec->full_shape.size() == 2, file.path(), ": tensor '", target.lora_B.key,
              "' targets module '", target.module, "', which is not a Linear of ", model_name,
              "; the LoRA is for another model family or version");
  const io::Range a_rows = source_rows(file, target.lora_A, target.module);
  const io::Range b_rows = source_rows(file, target.lora_B, target.module);
  const auto& a_shape = file.info(target.lora_A.key).shape;
  const auto& b_shape = file.info(target.lora_B.key).shape;
  const int64_t out = spec->full_shape[0];
  const int64_t in = spec->full_shape[1];
  TORCH_CHECK(a_shape[1] == in, file.path(), ": tensor '", target.lora_A.key, "' has shape [",
              c10::IntArrayRef(a_shape), "], but module '", target.module, "' has ", in,
              " input features (weight [", out, ", ", in, "]); the LoRA was trained for another model");
  TORCH_CHECK(b_rows.size() == out, file.path(), ": tensor '", target.lora_B.key, "' gives ", b_rows.size(),
              " output rows to module '", target.module, "', which has ", out, " (weight [", out, ", ", in,
              "]); the LoRA was trained for another model");
  TORCH_CHECK(b_shape[1] == a_rows.size(), file.path(), ": tensor '", target.lora_B.key, "' has rank ", b_shape[1],
              ", but '", target.lora_A.key, "' gives rank ", a_rows.size(), " (module '", target.module,
              "'); the two factors do not belong together");
  return *spec;
}

std::vector<io::Range> shifted(const std::vector<io::Range>& ranges, int64_t offset) {
  std::vector<io::Range> result;
  result.reserve(ranges.size());
  for (const io::Range& range : ranges) result.push_back({range.begin + offset, range.end + offset});
  return result;
}

/// This rank's lora_A and lora_B of one target (fp32, factors applied).
std::pair<at::Tensor, at::Tensor> read_target(const io::SafetensorsFile& file, const LoraTarget& target,
                                              const ShardSpec& spec, int tp_rank) {
  const io::Range a_rows = source_rows(file, target.lora_A, target.module);
  const io::Range b_rows = source_rows(file, target.lora_B, target.module);
  at::Tensor lora_A;
  at::Tensor lora_B;
  if (spec.is_sharded() && spec.dim == 1) {
    // Rowwise: lora_A [r, in_local], the columns this rank's weight holds; lora_B whole.
    lora_A = file.read_slices(target.lora_A.key, 1, spec.ranges_per_rank[tp_rank], at::kFloat)
                 .narrow(0, a_rows.begin, a_rows.size());
  } else {
    lora_A = file.read_slices(target.lora_A.key, 0, {a_rows}, at::kFloat);
  }
  if (spec.is_sharded() && spec.dim == 0) {
    // Colwise (and packed, gather): lora_B [out_local, r], the rows this rank's weight holds.
    lora_B = file.read_slices(target.lora_B.key, 0, shifted(spec.ranges_per_rank[tp_rank], b_rows.begin), at::kFloat);
  } else {
    lora_B = file.read_slices(target.lora_B.key, 0, {b_rows}, at::kFloat);
  }
  if (target.lora_A.factor != 1.0) lora_A = lora_A.mul(target.lora_A.factor);
  if (target.lora_B.factor != 1.0) lora_B = lora_B.mul(target.lora_B.factor);
  return {lora_A.contiguous(), lora_B.contiguous()};
}

int tp_rank_of(const TensorParallelModule& model) {
  return model.parallel_config() ? model.parallel_config()->tp_rank() : 0;
}

}  // namespace

int64_t lora_bytes_on_rank(const LoraAdapterSpec& spec, const io::SafetensorsFile& file, const ResolvedPlan& plan,
                           int tp_rank) {
  const int64_t element_size = c10::elementSize(plan.dtype);
  int64_t bytes = 0;
  for (const LoraTarget& target : spec.targets) {
    const ShardSpec& weight = check_target(file, target, plan, "the model");
    const int64_t rank = source_rows(file, target.lora_A, target.module).size();
    const std::vector<int64_t> local = weight.local_shape(tp_rank);  // [out_local, in_local]
    bytes += (rank * local[1] + local[0] * rank) * element_size;
  }
  return bytes;
}

LoraAdapters::LoraAdapters(TensorParallelModule& model)
    : model_(model), selection_(std::make_shared<nn::LoraSelection>()) {}

LoraAdapters::~LoraAdapters() {
  // The adapters belong to this object: the model runs without them afterwards.
  for (auto& [path, module] : model_.named_modules()) {
    auto* layer = dynamic_cast<nn::Linear*>(module);
    if (layer == nullptr) continue;
    for (const std::string& name : names_) layer->remove_lora(name);
  }
}

nn::Linear& LoraAdapters::linear(const std::string& module, const std::string& context) const {
  auto* layer = dynamic_cast<nn::Linear*>(model_.find_module(module));
  TORCH_CHECK(layer != nullptr, context, ": module '", module, "' is not a Linear of ", model_.type_name(),
              "; the LoRA is for another model family or version");
  return *layer;
}

void LoraAdapters::load(const std::string& name, const LoraAdapterSpec& spec, std::shared_ptr<io::ReadStats> stats) {
  load(name, spec, *io::SafetensorsFile::open(spec.path, std::move(stats)));
}

void LoraAdapters::load(const std::string& name, const LoraAdapterSpec& spec, const io::SafetensorsFile& file) {
  TORCH_CHECK(!name.empty(), spec.path, ": an adapter needs a name");
  TORCH_CHECK(std::find(names_.begin(), names_.end(), name) == names_.end(), spec.path, ": an adapter named '",
              name, "' is already loaded; unload it first or choose another name");
  TORCH_CHECK(!spec.targets.empty(), spec.path, ": the LoRA targets no module");
  const ResolvedPlan* plan = model_.resolved_plan();
  TORCH_CHECK(plan != nullptr, spec.path, ": load the model's weights before its LoRA adapters");
  const int tp_rank = tp_rank_of(model_);

  // Read and check everything first: a bad adapter leaves the model as it was.
  std::map<std::string, std::string> seen;  // module -> first key
  std::vector<std::pair<nn::Linear*, nn::LoraLayer>> pending;
  pending.reserve(spec.targets.size());
  for (const LoraTarget& target : spec.targets) {
    const ShardSpec& weight_spec = check_target(file, target, *plan, model_.type_name());
    const auto [it, fresh] = seen.emplace(target.module, target.lora_B.key);
    TORCH_CHECK(fresh, spec.path, ": tensors '", it->second, "' and '", target.lora_B.key,
                "' both target module '", target.module, "'; a LoRA gives each module one pair");
    nn::Linear& layer = linear(target.module, spec.path);
    TORCH_CHECK(layer.loras().empty() || layer.lora_selection() == selection_, spec.path, ": module '",
                target.module, "' holds adapters of another LoraAdapters object; keep one per model");
    auto [lora_A, lora_B] = read_target(file, target, weight_spec, tp_rank);
    // As FP8 and quantized base weights are: a NaN or Inf here would make every image of every
    // request that uses the adapter NaN, blamed on no file.
    for (const auto& [key, tensor] : {std::pair{&target.lora_A.key, &lora_A}, std::pair{&target.lora_B.key, &lora_B}}) {
      const std::string bad = nn::non_finite(*tensor);
      TORCH_CHECK(bad.empty(), spec.path, ": LoRA adapter '", name, "', tensor '", *key, "': ", bad,
                  " (in this rank's slice); the adapter is corrupt, refusing to load it");
    }
    const auto options = layer.weight.options().dtype(layer.weight_dtype());
    // weight_in_features: a GGUF weight's codes are [out, row_bytes]; the adapter sees its elements.
    TORCH_INTERNAL_ASSERT(lora_A.size(1) == layer.weight_in_features() && lora_B.size(0) == layer.weight.size(0),
                          "LoRA slice of '", target.module, "' does not match the local weight");
    pending.push_back({&layer, nn::LoraLayer{name, lora_A.to(options), lora_B.to(options), target.scaling}});
  }
  for (auto& [layer, lora] : pending) layer->add_lora(std::move(lora), selection_);
  names_.push_back(name);
  selection_->weights.emplace_back(name, 1.0);
}

void LoraAdapters::unload(const std::string& name) {
  TORCH_CHECK(std::find(names_.begin(), names_.end(), name) != names_.end(), "LoRA adapter '", name,
              "' is not loaded");
  for (auto& [path, module] : model_.named_modules()) {
    if (auto* layer = dynamic_cast<nn::Linear*>(module)) layer->remove_lora(name);
  }
  names_.erase(std::find(names_.begin(), names_.end(), name));
  auto& weights = selection_->weights;
  weights.erase(std::remove_if(weights.begin(), weights.end(), [&](const auto& entry) { return entry.first == name; }),
                weights.end());
}

void LoraAdapters::set_adapters(const std::vector<std::string>& names, const std::vector<double>& weights) {
  TORCH_CHECK(names.size() == weights.size(), "set_adapters: ", names.size(), " adapter names but ", weights.size(),
              " weights; give one weight per adapter");
  std::vector<std::pair<std::string, double>> selected;
  for (size_t i = 0; i < names.size(); ++i) {
    TORCH_CHECK(std::find(names_.begin(), names_.end(), names[i]) != names_.end(), "set_adapters: adapter '",
                names[i], "' is not loaded (loaded: ", c10::Join(", ", names_), ")");
    for (const auto& entry : selected) {
      TORCH_CHECK(entry.first != names[i], "set_adapters: adapter '", names[i], "' given twice");
    }
    check_lora_weight("the weight of LoRA adapter '" + names[i] + "'", weights[i]);
    selected.emplace_back(names[i], weights[i]);
  }
  selection_->weights = std::move(selected);
}

void LoraAdapters::set_scale(double scale) {
  check_lora_weight("the LoRA scale (--lora-scale)", scale);
  selection_->scale = scale;
}

void LoraAdapters::fuse(double lora_scale) {
  check_lora_weight("the LoRA scale (--lora-scale)", lora_scale);
  for (auto& [path, module] : model_.named_modules()) {
    auto* layer = dynamic_cast<nn::Linear*>(module);
    if (layer == nullptr || layer->loras().empty()) continue;
    TORCH_CHECK(layer->weight_format() == nn::WeightFormat::Dense, "--fuse-lora: module '", path, "' holds ",
                nn::weight_format_name(layer->weight_format()),
                " weights, which a fused adapter would need re-quantizing; keep the adapters unfused (drop "
                "--fuse-lora) or load the weights dense");
    // One adapter after the other, in set_adapters order, in fp32.
    at::Tensor fused = layer->weight.to(at::kFloat);
    for (const auto& [adapter, adapter_weight] : selection_->weights) {
      for (const nn::LoraLayer& lora : layer->loras()) {
        if (lora.adapter != adapter) continue;
        const double factor = lora_scale * lora.scaling * adapter_weight;
        fused.add_(at::matmul(lora.lora_B.to(at::kFloat), lora.lora_A.to(at::kFloat)), factor);  // [out_l, in_l]
      }
    }
    layer->weight.copy_(fused);
  }
  for (const std::string& name : std::vector<std::string>(names_)) unload(name);
}

std::vector<std::string> LoraAdapters::names() const { return names_; }

}  // namespace shardit::parallel

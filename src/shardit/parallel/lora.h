#pragma once
// LoRA adapters on a tensor-parallel model, sharded by the model's own plan. For a target Linear
// with weight W [out, in] and the adapter's lora_A [r, in], lora_B [out, r]:
//   colwise, packed colwise, colwise-gather (W split by output rows): each rank reads the rows of
//     lora_B that its weight shard holds (the same ranges, per packed block), and lora_A whole;
//   rowwise, packed rowwise (W split by input columns): each rank reads the columns of lora_A its
//     weight shard holds, and lora_B whole; the partial products are summed by the layer's
//     all-reduce;
//   replicated: both whole.
// So the delta on every rank is exactly its slice of the full B·A. Adapters are applied unfused
// in nn::Linear's forward (switchable per forward through one LoraSelection per model), or fused
// into the sharded weights.
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardit/io/safetensors.h"
#include "shardit/nn/linear.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::parallel {

/// Where one factor (lora_A or lora_B) of one target comes from in the adapter file: the rows
/// [row_begin, row_begin + rows) of tensor `key` (a fused source such as q|k|v gives each part its
/// rows of lora_B), times `factor` (kohya's alpha/rank, split between the two factors as
/// diffusers does).
struct LoraFactorSource {
  std::string key;
  int64_t row_begin = 0;
  int64_t rows = -1;  ///< -1: all rows
  double factor = 1.0;
};

/// One targeted Linear of the model, in diffusers' module names.
struct LoraTarget {
  std::string module;  ///< "transformer_blocks.0.attn.to_q"
  LoraFactorSource lora_A;
  LoraFactorSource lora_B;
  double scaling = 1.0;  ///< lora_alpha / r as PEFT holds it (1 where the file's alpha is folded in)
};

/// An adapter file converted to diffusers' layout, without reading any weight: what every rank
/// reads its slices by. Made by the per-family converters (models/lora_formats.h).
struct LoraAdapterSpec {
  std::string path;                   ///< the adapter file
  std::string format;                 ///< "diffusers", "diffusers+metadata", "kohya", "xlabs", "bfl"
  int64_t rank = 0;                   ///< the largest rank of its pairs
  std::vector<double> alphas;         ///< distinct alpha values found in the file (empty: none)
  std::vector<LoraTarget> targets;    ///< in file order
  std::vector<std::string> skipped;   ///< source keys diffusers reads but does not load (named by inspect)
};

/// Bytes of the adapter on `tp_rank` at `plan`'s degree (the slices that rank reads), in the
/// plan's dtype. Throws like load_lora when a target does not fit the model.
int64_t lora_bytes_on_rank(const LoraAdapterSpec& spec, const io::SafetensorsFile& file, const ResolvedPlan& plan,
                           int tp_rank);

/// The adapters loaded into one model, by name: loaded unfused (each rank reading only its
/// slices), switched between forwards with set_adapters/set_scale, or fused into the weights.
class LoraAdapters {
 public:
  /// `model` must be loaded (its resolved plan is what the adapters are sharded by) and must
  /// outlive this object. Destroying it removes its unfused adapters from the model (fused
  /// ones stay in the weights).
  explicit LoraAdapters(TensorParallelModule& model);
  ~LoraAdapters();
  LoraAdapters(const LoraAdapters&) = delete;
  LoraAdapters& operator=(const LoraAdapters&) = delete;

  /// Reads this rank's slices of every target of `spec` and attaches them under `name`, active at
  /// weight 1 (added after the active ones). Everything (every key, module and shape) is checked
  /// and read before any Linear changes; errors name the file, the key and the module. `stats`
  /// (optional) counts the bytes read from the file: only this rank's slices.
  void load(const std::string& name, const LoraAdapterSpec& spec, std::shared_ptr<io::ReadStats> stats = nullptr);
  /// The same, reading from `file` (spec.path opened already).
  void load(const std::string& name, const LoraAdapterSpec& spec, const io::SafetensorsFile& file);
  /// Removes the adapter `name` from every Linear.
  void unload(const std::string& name);
  /// Activates exactly `names` with `weights` (one per name), in this order (diffusers'
  /// set_adapters). Names must be loaded.
  void set_adapters(const std::vector<std::string>& names, const std::vector<double>& weights);
  /// The runtime scale multiplying every active adapter (diffusers' `scale` attention kwarg).
  void set_scale(double scale);
  /// Merges the active adapters into the weights, W += lora_scale · Σ scaling·weight·B·A in
  /// set_adapters order (fp32), then removes every unfused adapter: the forward runs on W alone.
  void fuse(double lora_scale = 1.0);

  /// Loaded adapter names, in load order.
  std::vector<std::string> names() const;
  const nn::LoraSelection& selection() const { return *selection_; }

 private:
  TensorParallelModule& model_;
  std::shared_ptr<nn::LoraSelection> selection_;
  std::vector<std::string> names_;
  nn::Linear& linear(const std::string& module, const std::string& context) const;
};

}  // namespace shardit::parallel

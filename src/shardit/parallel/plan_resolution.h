#pragma once
// Plan resolution (internal to parallel/): the layers a plan's globs name, their split dimensions
// and blocks, the degrees every split divides by, one ShardSpec per state tensor, and what each
// rank holds under a spec. The applier (tensor_parallel.cpp) and the loader (weight_loading.cpp)
// share it.
#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardit/dist/group.h"
#include "shardit/nn/embedding.h"
#include "shardit/nn/linear.h"
#include "shardit/nn/module.h"
#include "shardit/nn/quantized_weight.h"
#include "shardit/parallel/plan.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::parallel {

/// A matched layer: the Linear or Embedding a plan entry applies to.
struct LayerMatch {
  std::string path;
  nn::Module* module = nullptr;
  nn::Linear* linear = nullptr;        ///< set for a Linear
  nn::Embedding* embedding = nullptr;  ///< set for an Embedding
  const PlanEntry* entry = nullptr;
  /// The split dimension of the weight and its blocks (absolute sizes); one block when not packed.
  int64_t weight_dim = 0;
  std::vector<int64_t> blocks;
  bool bias_sharded = false;
  /// Vocab-parallel embedding: contiguous ranges of ceil(size / degree), the last ones shorter,
  /// so any degree works.
  bool uneven = false;
  /// Head-replicable colwise entry (ModelTraits::replicable_heads): its head count, 0 otherwise.
  int64_t replicable_heads = 0;

  const at::Tensor& weight() const { return linear ? linear->weight : embedding->weight; }
};

/// A plan resolved against a model, with the layers its entries matched.
struct Resolution {
  ResolvedPlan plan;
  std::vector<LayerMatch> layers;
};

/// resolve_plan, keeping the matched layers (for set_parallel_modes). `quantize_kept`:
/// LoadOptions::quantize_kept_layers.
Resolution resolve_with_layers(nn::Module& model, const TpPlan& plan, int tp_degree, const ModelTraits& traits,
                               at::ScalarType dtype, nn::WeightsDtype weights = nn::WeightsDtype::Checkpoint,
                               bool quantize_kept = false);

/// Switches each matched layer to its parallel mode on `group`.
void set_parallel_modes(const std::vector<LayerMatch>& layers, const std::shared_ptr<dist::Group>& group);

/// The Linear whose weight `slot` is; null for any other tensor.
nn::Linear* linear_of_weight(const nn::Module::TensorSlot& slot);

/// Bytes per element of a state tensor loaded in `dtype`: keep-in-fp32 tensors stay fp32.
int64_t loaded_element_size(const std::string& name, at::ScalarType dtype, const ModelTraits& traits);

/// This rank's per-output-row scales of a weight laid out by `spec`, from the whole [out] scales:
/// the rows' own when the weight is split by rows (colwise, packed colwise: each block's scales
/// follow the block), all of them when it is split by columns or replicated.
at::Tensor row_scales_for_rank(const at::Tensor& full, const ShardSpec& spec, int tp_rank);

/// "a, b, c, ... (n more)": the first `limit` of `names`, for messages.
std::string join_names(const std::vector<std::string>& names, size_t limit);

}  // namespace shardit::parallel

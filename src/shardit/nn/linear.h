#pragma once
// The one parallel-aware layer. Y = X A^T + b with A of shape [out, in].
//   Colwise:  A = [A_1; ...; A_p] split by output rows; rank r computes Y_r = X A_r^T + b_r and
//             keeps its output local (no communication).
//   Rowwise:  A = [A_1 ... A_p] split by input columns; rank r holds the matching input shard
//             X_r, computes X_r A_r^T, the partial sums are all-reduced, then the whole b is added
//             once.
//   ColwiseGather: colwise, then the output is all-gathered back to full width in the original
//             column order (Megatron's gather_output).
// Fused projections declare their column blocks (`in_blocks`/`out_blocks`): packed styles shard
// each block separately, so a local shard is the concatenation of every block's local piece.
#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "shardit/dist/group.h"
#include "shardit/nn/module.h"

namespace shardit::nn {

struct LinearOptions {
  LinearOptions(int64_t in_features, int64_t out_features) : in_features(in_features), out_features(out_features) {}
  int64_t in_features;
  int64_t out_features;
  bool bias = true;
  /// Sizes of the fused blocks of the input features (e.g. {D, 4D} for cat[attn, mlp]); empty
  /// when the input is not fused. Used by packed rowwise sharding.
  std::vector<int64_t> in_blocks;
  /// Sizes of the fused blocks of the output features (e.g. {D, D, D} for fused q|k|v).
  std::vector<int64_t> out_blocks;

  LinearOptions& with_bias(bool value) { bias = value; return *this; }
  LinearOptions& with_in_blocks(std::vector<int64_t> blocks) { in_blocks = std::move(blocks); return *this; }
  LinearOptions& with_out_blocks(std::vector<int64_t> blocks) { out_blocks = std::move(blocks); return *this; }
};

/// How a Linear's output relates to the other ranks'. Set by parallel::apply_tensor_parallel.
enum class LinearParallel { None, Colwise, Rowwise, ColwiseGather };

class Linear : public Module {
 public:
  explicit Linear(const LinearOptions& options);
  std::string type_name() const override { return "Linear"; }

  /// [..., in_local] -> [..., out_local] (Colwise), [..., out] (None, Rowwise, ColwiseGather).
  at::Tensor forward(const at::Tensor& x);

  /// Switches the layer to a parallel mode after its weight (and bias) were replaced by this
  /// rank's shard. `gather_blocks` (ColwiseGather of a packed output): the full sizes of the
  /// output blocks, so the gathered columns can be put back in their original order.
  void set_parallel(LinearParallel mode, std::shared_ptr<dist::Group> group,
                    std::vector<int64_t> gather_blocks = {});
  LinearParallel parallel_mode() const { return mode_; }
  const LinearOptions& options() const { return options_; }

  at::Tensor weight;  ///< [out, in] (a shard of it once parallel)
  at::Tensor bias;    ///< [out] or undefined

 private:
  LinearOptions options_;
  LinearParallel mode_ = LinearParallel::None;
  std::shared_ptr<dist::Group> group_;
  std::vector<int64_t> gather_blocks_;
};

}  // namespace shardit::nn

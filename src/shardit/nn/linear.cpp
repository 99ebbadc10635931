#include "shardit/nn/linear.h"
#include "shardit/core/profile.h"

#include <c10/util/Exception.h>

#include <numeric>
#include <utility>

namespace shardit::nn {

namespace {

int64_t sum_of(const std::vector<int64_t>& values) {
  return std::accumulate(values.begin(), values.end(), int64_t{0});
}

const char* mode_name(LinearParallel mode) {
  switch (mode) {
    case LinearParallel::None: return "None";
    case LinearParallel::Colwise: return "Colwise";
    case LinearParallel::Rowwise: return "Rowwise";
    case LinearParallel::ColwiseGather: return "ColwiseGather";
  }
  return "?";
}

}  // namespace

Linear::Linear(const LinearOptions& options) : options_(options) {
  TORCH_CHECK(options.in_features > 0 && options.out_features > 0,
              "Linear: in_features and out_features must be positive, got [", options.out_features, ", ",
              options.in_features, "]");
  TORCH_CHECK(options.in_blocks.empty() || sum_of(options.in_blocks) == options.in_features,
              "Linear: in_blocks ", c10::IntArrayRef(options.in_blocks), " sum to ",
              sum_of(options.in_blocks), ", expected in_features ", options.in_features);
  TORCH_CHECK(options.out_blocks.empty() || sum_of(options.out_blocks) == options.out_features,
              "Linear: out_blocks ", c10::IntArrayRef(options.out_blocks), " sum to ",
              sum_of(options.out_blocks), ", expected out_features ", options.out_features);
  register_parameter("weight", &weight, {options.out_features, options.in_features});
  if (options.bias) register_parameter("bias", &bias, {options.out_features});
}

at::Tensor Linear::forward(const at::Tensor& x) {
  SHARDIT_PROFILE_SCOPE("Linear");
  // x: [..., in] (None, Colwise, ColwiseGather) or [..., in_local] (Rowwise)
  TORCH_CHECK(x.dim() >= 1, "Linear '", path(), "' (", mode_name(mode_), "): input is a scalar, expected [..., ",
              weight.size(1), "]");
  TORCH_CHECK(x.size(-1) == weight.size(1), "Linear '", path(), "' (", mode_name(mode_), "): input has ", x.size(-1),
              " features, the weight ", weight.sizes(), " expects ", weight.size(1));
  switch (mode_) {
    case LinearParallel::None:
    case LinearParallel::Colwise:
      // [..., out] or [..., out_local]
      return at::linear(x, weight, bias);

    case LinearParallel::Rowwise: {
      // Partial sums X_r A_r^T; the bias must be added once, after the sum.
      at::Tensor y = at::linear(x, weight);  // [..., out], partial
      group_->all_reduce(y);                 // [..., out], full sum
      if (bias.defined()) y.add_(bias);
      return y;
    }

    case LinearParallel::ColwiseGather: {
      const at::Tensor local = at::linear(x, weight, bias);              // [..., out_local]
      at::Tensor gathered = group_->all_gather(local, local.dim() - 1);  // [..., out], rank-major
      if (gather_blocks_.empty()) return gathered;
      // Packed output: gathered = [r0: b0_0 b1_0 ..., r1: b0_1 b1_1 ...]; the original order is
      // [b0_0 b0_1 ... b1_0 b1_1 ...].
      const int64_t world = group_->size();
      const int64_t local_width = local.size(-1);
      std::vector<at::Tensor> pieces;
      pieces.reserve(gather_blocks_.size() * static_cast<size_t>(world));
      int64_t block_offset = 0;
      for (const int64_t block : gather_blocks_) {
        const int64_t piece = block / world;
        for (int64_t r = 0; r < world; ++r) {
          pieces.push_back(gathered.narrow(-1, r * local_width + block_offset, piece));
        }
        block_offset += piece;
      }
      return at::cat(pieces, -1);  // [..., out]
    }
  }
  TORCH_INTERNAL_ASSERT(false, "Linear: unknown parallel mode");
}

void Linear::set_parallel(LinearParallel mode, std::shared_ptr<dist::Group> group,
                          std::vector<int64_t> gather_blocks) {
  TORCH_CHECK(mode == LinearParallel::None || group != nullptr, "Linear::set_parallel(", mode_name(mode),
              "): a parallel mode needs a group");
  if (!gather_blocks.empty()) {
    TORCH_CHECK(mode == LinearParallel::ColwiseGather,
                "Linear::set_parallel: gather_blocks apply to ColwiseGather only, got mode ",
                mode_name(mode));
    const int64_t world = group->size();
    TORCH_CHECK(sum_of(gather_blocks) == weight.size(0) * world, "Linear::set_parallel: gather_blocks ",
                c10::IntArrayRef(gather_blocks), " sum to ", sum_of(gather_blocks),
                ", expected the full output width ", weight.size(0) * world, " (local ", weight.size(0),
                " x ", world, " ranks)");
    for (const int64_t block : gather_blocks) {
      TORCH_CHECK(block % world == 0, "Linear::set_parallel: gather block of size ", block,
                  " does not divide by the group size ", world);
    }
  }
  mode_ = mode;
  group_ = std::move(group);
  gather_blocks_ = std::move(gather_blocks);
}

}  // namespace shardit::nn

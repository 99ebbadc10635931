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

#include <functional>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardit/dist/group.h"
#include "shardit/nn/int8_compute.h"
#include "shardit/nn/module.h"
#include "shardit/nn/quantized_weight.h"

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

/// One LoRA adapter held by a Linear (PEFT's lora.Linear): it adds
/// scaling · weight · scale · lora_B (lora_A x) to the output, where `weight` and `scale` come from
/// the model's LoraSelection. Under tensor parallelism each rank holds the slices that make its
/// share of the full delta B·A: colwise layers split lora_B by output rows (lora_A whole), rowwise
/// layers split lora_A by input columns (lora_B whole; the partial products join the all-reduce).
struct LoraLayer {
  std::string adapter;
  at::Tensor lora_A;     ///< [r, in] ([r, in_local] when rowwise)
  at::Tensor lora_B;     ///< [out, r] ([out_local, r] when colwise)
  double scaling = 1.0;  ///< lora_alpha / r
};

/// Which adapters are active, at which weights (diffusers' set_adapters), and the runtime scale
/// multiplying them all (diffusers' `scale` attention kwarg). One per model, shared by its Linears,
/// so switching adapters between forwards is one assignment.
struct LoraSelection {
  std::vector<std::pair<std::string, double>> weights;  ///< adapter name -> adapter weight
  double scale = 1.0;
};

/// While one lives, every Linear on this thread computes each sample of a batched input (dim 0 of
/// [B, ..., in], B > 1) on its own, products and all-reduce alike, exactly as it would for that
/// sample alone. Why: a product's kernel, and so its rounding, may depend on its row count (a
/// conditioning row [1, D] goes to a matrix-vector kernel, [B, D] to a matrix product; oneDNN's
/// bf16 kernels block differently for few rows) and an all-reduce over 3+ ranks sums an element
/// in an order set by the tensor's size; a server batching requests must give each request the
/// image it would get alone. Costs little where a sample has many rows (tokens); the conditioning
/// products read their weight once per sample. Scopes nest.
class SamplewiseProducts {
 public:
  SamplewiseProducts();
  ~SamplewiseProducts();
  SamplewiseProducts(const SamplewiseProducts&) = delete;
  SamplewiseProducts& operator=(const SamplewiseProducts&) = delete;
  /// Whether one lives on this thread.
  static bool active();

 private:
  bool previous_;
};

/// How a Linear's output relates to the other ranks'. Set by parallel::apply_tensor_parallel.
enum class LinearParallel { None, Colwise, Rowwise, ColwiseGather };

class Linear : public Module {
 public:
  explicit Linear(const LinearOptions& options);
  std::string type_name() const override { return "Linear"; }

  /// [..., in_local] -> [..., out_local] (Colwise), [..., out] (None, Rowwise, ColwiseGather).
  at::Tensor forward(const at::Tensor& x);
  /// forward(at::cat(parts, -1)) without the concatenation: part i multiplies its own column
  /// block of the weight, y = Σ_i x_i A_i^T + b, accumulated in one output (for a fused input
  /// such as cat[attn, mlp], whose copy costs as much memory traffic as the GEMM's output).
  at::Tensor forward_blocks(const std::vector<at::Tensor>& parts);
  /// gelu(forward(x), approximate="tanh") (the MLP's up-projection). Where the product runs on
  /// the AMX kernel (nn/cpu/amx_gemm.h) the GELU runs in its epilogue, on each output's fp32 sum
  /// before the one rounding to bf16, and forward(x) itself never exists; elsewhere (and with LoRA
  /// adapters, an 8-bit weight or a rowwise or gathering layer) forward(x) is computed, passed to
  /// `pre_activation` when given (what a block emits for parity; not under SamplewiseProducts with
  /// a batch, whose samples run apart), then the fused GELU runs in place.
  at::Tensor forward_gelu_tanh(const at::Tensor& x,
                               const std::function<void(const at::Tensor&)>& pre_activation = {});

  /// Switches the layer to a parallel mode after its weight (and bias) were replaced by this
  /// rank's shard. `gather_blocks` (ColwiseGather of a packed output): the full sizes of the
  /// output blocks, so the gathered columns can be put back in their original order.
  void set_parallel(LinearParallel mode, std::shared_ptr<dist::Group> group,
                    std::vector<int64_t> gather_blocks = {});
  LinearParallel parallel_mode() const { return mode_; }

  /// Adds an unfused adapter, applied in forward while `selection` lists it. Shapes are checked
  /// against this rank's weight. Replaces an adapter of the same name.
  void add_lora(LoraLayer layer, std::shared_ptr<const LoraSelection> selection);
  /// Drops the adapter `adapter` (no-op when absent).
  void remove_lora(const std::string& adapter);
  const std::vector<LoraLayer>& loras() const { return loras_; }
  /// The selection switching this layer's adapters; null without adapters.
  const std::shared_ptr<const LoraSelection>& lora_selection() const { return lora_selection_; }
  const LinearOptions& options() const { return options_; }

  /// Holds this rank's weight in 8 bits: `codes` [out_local, in_local] (uint8 FP8 bytes or int8)
  /// replace `weight`, `scale` [out_local] fp32 (positive, finite) scales each row. Each forward
  /// dequantizes the weight to the input's dtype (nn/quantized_weight.h). `dtype`: the dtype the
  /// weight would have had dense (what adapters and callers that cast inputs use).
  void set_quantized_weight(at::Tensor codes, WeightFormat format, at::Tensor scale, at::ScalarType dtype);
  /// Holds this rank's weight as GGUF blocks (nn/gguf_linear.h reads them): `codes` uint8
  /// [out_local, row_bytes], each row whole blocks of `type` (a rowwise layer's rank holds its
  /// blocks of every row), replace `weight`. Each forward dequantizes them to the input's dtype
  /// through dequantize_rows, as 8-bit weights are. `dtype`: the dtype the weight would have dense.
  void set_gguf_weight(at::Tensor codes, io::GgmlType type, at::ScalarType dtype);
  /// The input features of this rank's weight (its columns once dequantized).
  int64_t weight_in_features() const;
  /// Multiplies in int8 from now on (nn/int8_compute.h): each token of the input quantized with
  /// its own scale, times the int8 weight, in LibTorch's quantized engine. Needs an Int8 weight on
  /// the CPU. Kept through a later set_quantized_weight (the shard is packed again).
  void enable_int8_compute();
  bool int8_compute() const { return int8_weight_ != nullptr; }
  /// The dtype of the dense weight (of its dequantized form when quantized).
  at::ScalarType weight_dtype() const {
    return weight_format_ == WeightFormat::Dense ? weight.scalar_type() : dense_dtype_;
  }
  WeightFormat weight_format() const { return weight_format_; }
  /// [out_local] fp32; undefined when dense.
  const at::Tensor& weight_scale() const { return weight_scale_; }
  /// The weight as the product uses it, in `dtype`: `weight` when dense, else dequantized.
  at::Tensor dense_weight(at::ScalarType dtype) const;

  at::Tensor weight;  ///< [out, in] (a shard of it once parallel); 8-bit codes when quantized
  at::Tensor bias;    ///< [out] or undefined

 private:
  /// Whether this layer's product of `rows` rows of x (x's device and dtype) runs on the AMX
  /// kernel: a dense bf16 weight (and bias) and nn::linear_on_amx's choice.
  bool product_on_amx(const at::Tensor& x, int64_t rows) const;

  LinearOptions options_;
  WeightFormat weight_format_ = WeightFormat::Dense;
  at::Tensor weight_scale_;
  std::shared_ptr<const Int8PackedWeight> int8_weight_;  ///< set by enable_int8_compute
  at::ScalarType dense_dtype_ = at::kFloat;
  LinearParallel mode_ = LinearParallel::None;
  std::shared_ptr<dist::Group> group_;
  std::vector<int64_t> gather_blocks_;
  std::vector<LoraLayer> loras_;
  std::shared_ptr<const LoraSelection> lora_selection_;

  /// x [..., in_local] times the weight (dequantized, or in int8), plus `bias` when defined.
  at::Tensor product(const at::Tensor& x, const at::Tensor& bias) const;
  /// product() in int8 (int8_weight_).
  at::Tensor int8_product(const at::Tensor& x, const at::Tensor& bias) const;
  /// Rowwise: sums the partial products over the group, then adds the bias once.
  void finish_rowwise(at::Tensor& y);
  /// Adds the active adapters' deltas to `y` (local output, or partial sums before the
  /// all-reduce when rowwise).
  void add_lora_deltas(at::Tensor& y, const at::Tensor& x) const;
};

}  // namespace shardit::nn

#include "shardit/nn/linear.h"

#include "shardit/core/profile.h"
#include "shardit/nn/activations.h"
#include "shardit/nn/cpu/amx_gemm.h"
#include "shardit/nn/gemm.h"

#include <c10/util/Exception.h>

#include <algorithm>
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

thread_local bool t_samplewise_products = false;

/// Whether `x` is a batch that SamplewiseProducts splits: [B, ..., in] with B > 1.
bool split_by_sample(const at::Tensor& x) { return t_samplewise_products && x.dim() >= 2 && x.size(0) > 1; }

}  // namespace

SamplewiseProducts::SamplewiseProducts() : previous_(t_samplewise_products) { t_samplewise_products = true; }
SamplewiseProducts::~SamplewiseProducts() { t_samplewise_products = previous_; }
bool SamplewiseProducts::active() { return t_samplewise_products; }

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
  const int64_t in_features = weight_in_features();
  TORCH_CHECK(x.dim() >= 1, "Linear '", path(), "' (", mode_name(mode_), "): input is a scalar, expected [..., ",
              in_features, "]");
  TORCH_CHECK(x.size(-1) == in_features, "Linear '", path(), "' (", mode_name(mode_), "): input has ", x.size(-1),
              " features, the weight ", weight.sizes(),
              weight_format_is_gguf(weight_format_) ? c10::str(" (", weight_format_name(weight_format_), " blocks)") : "",
              " expects ", in_features);
  if (split_by_sample(x)) {
    // Each sample alone (SamplewiseProducts); a quantized weight is then dequantized per sample.
    std::vector<at::Tensor> samples;
    samples.reserve(static_cast<size_t>(x.size(0)));
    for (int64_t i = 0; i < x.size(0); ++i) samples.push_back(forward(x.narrow(0, i, 1)));
    return at::cat(samples, 0);
  }
  switch (mode_) {
    case LinearParallel::None:
    case LinearParallel::Colwise: {
      // [..., out] or [..., out_local]
      at::Tensor y = product(x, bias);
      if (!loras_.empty()) add_lora_deltas(y, x);
      return y;
    }

    case LinearParallel::Rowwise: {
      // Partial sums X_r A_r^T; the bias must be added once, after the sum.
      at::Tensor y = product(x, at::Tensor());  // [..., out], partial
      // Σ_r (x_r A_rᵀ) Bᵀ = (x Aᵀ) Bᵀ: each rank's LoRA partial joins the same all-reduce.
      if (!loras_.empty()) add_lora_deltas(y, x);
      finish_rowwise(y);
      return y;
    }

    case LinearParallel::ColwiseGather: {
      at::Tensor local = product(x, bias);                               // [..., out_local]
      if (!loras_.empty()) add_lora_deltas(local, x);
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

bool Linear::product_on_amx(const at::Tensor& x, int64_t rows) const {
  return weight_format_ == WeightFormat::Dense && weight.scalar_type() == at::kBFloat16 &&
         (!bias.defined() || bias.scalar_type() == at::kBFloat16) &&
         linear_on_amx(x.device(), x.scalar_type(), rows, weight.size(1), weight.size(0));
}

at::Tensor Linear::forward_gelu_tanh(const at::Tensor& x, const std::function<void(const at::Tensor&)>& pre_activation) {
  if (split_by_sample(x)) {
    // Each sample alone, as forward does, so a batched request's bits equal its solo ones.
    std::vector<at::Tensor> samples;
    samples.reserve(static_cast<size_t>(x.size(0)));
    for (int64_t i = 0; i < x.size(0); ++i) samples.push_back(forward_gelu_tanh(x.narrow(0, i, 1)));
    return at::cat(samples, 0);
  }
  const int64_t rows = x.dim() == 0 || x.size(-1) == 0 ? 0 : x.numel() / x.size(-1);
  const bool in_epilogue = (mode_ == LinearParallel::None || mode_ == LinearParallel::Colwise) && loras_.empty() &&
                           x.dim() >= 1 && x.size(-1) == weight.size(1) && product_on_amx(x, rows);
  if (in_epilogue) {
    SHARDIT_PROFILE_SCOPE("Linear");
    return cpu::amx_linear_gelu_tanh(x, weight, bias);
  }
  at::Tensor y = forward(x);
  if (pre_activation) pre_activation(y);
  return gelu_tanh_(y);
}

at::Tensor Linear::forward_blocks(const std::vector<at::Tensor>& parts) {
  TORCH_CHECK(!parts.empty(), "Linear '", path(), "': forward_blocks needs at least one input");
  if (split_by_sample(parts.front())) {
    std::vector<at::Tensor> samples;
    for (int64_t i = 0; i < parts.front().size(0); ++i) {
      std::vector<at::Tensor> sample_parts;
      for (const at::Tensor& part : parts) sample_parts.push_back(part.narrow(0, i, 1));
      samples.push_back(forward_blocks(sample_parts));
    }
    return at::cat(samples, 0);
  }
  // Gathered outputs take the concatenated path. Adapters add their delta from the concatenated
  // input below, so the base product sums in the same order whether or not one is active.
  // oneDNN reads a weight in place only whole (a column block would be copied, which costs more
  // than the input's concatenation), so a product it computes takes the concatenated path too; so
  // does one on the AMX kernel when a block's width is not a multiple of 32 (the kernel reads
  // blocks whole tile columns at a time).
  const int64_t leading_rows = parts.front().size(-1) == 0 ? 0 : parts.front().numel() / parts.front().size(-1);
  const bool on_amx = product_on_amx(parts.front(), leading_rows) &&
                      std::all_of(parts.begin(), parts.end(), [](const at::Tensor& p) { return p.size(-1) % 32 == 0; });
  // A quantized weight is dequantized whole once, which the concatenated path does.
  if (parts.size() == 1 || mode_ == LinearParallel::ColwiseGather || weight_format_ != WeightFormat::Dense ||
      gemm_backend_for(parts.front().device(), parts.front().scalar_type(), leading_rows, weight.numel()) ==
          GemmBackend::OneDnn ||
      (!on_amx && linear_on_amx(parts.front().device(), parts.front().scalar_type(), leading_rows, weight.size(1),
                                weight.size(0)))) {
    return forward(parts.size() == 1 ? parts.front() : at::cat(parts, -1));
  }
  SHARDIT_PROFILE_SCOPE("Linear");
  int64_t width = 0;
  for (const at::Tensor& part : parts) width += part.size(-1);
  TORCH_CHECK(width == weight.size(1), "Linear '", path(), "' (", mode_name(mode_), "): inputs have ", width,
              " features together, the weight ", weight.sizes(), " expects ", weight.size(1));
  const bool rowwise = mode_ == LinearParallel::Rowwise;
  if (on_amx) {
    // [..., out] (or its partial sum when rowwise): the blocks read in place, one product.
    at::Tensor y = cpu::amx_linear(parts, weight, rowwise ? at::Tensor() : bias);
    if (!loras_.empty()) add_lora_deltas(y, at::cat(parts, -1));
    if (rowwise) finish_rowwise(y);
    return y;
  }
  const int64_t first = parts.front().size(-1);
  // [..., out] (or its partial sum when rowwise)
  at::Tensor y = nn::linear(parts.front(), weight.narrow(1, 0, first), rowwise ? at::Tensor() : bias);
  // [rows, out]: a view of y
  at::Tensor y_rows = y.view({-1, y.size(-1)});
  int64_t offset = first;
  for (size_t i = 1; i < parts.size(); ++i) {
    const int64_t part_width = parts[i].size(-1);
    TORCH_CHECK(parts[i].numel() / std::max<int64_t>(1, part_width) == y_rows.size(0), "Linear '", path(),
                "': forward_blocks inputs have different leading shapes: ", parts.front().sizes(), " and ",
                parts[i].sizes());
    // The weight's column block, read in place (a transposed view BLAS takes with its stride).
    y_rows.addmm_(parts[i].reshape({-1, part_width}), weight.narrow(1, offset, part_width).t());
    offset += part_width;
  }
  if (!loras_.empty()) add_lora_deltas(y, at::cat(parts, -1));  // a rowwise partial joins the all-reduce
  if (rowwise) finish_rowwise(y);
  return y;
}

void Linear::set_quantized_weight(at::Tensor codes, WeightFormat format, at::Tensor scale, at::ScalarType dtype) {
  TORCH_INTERNAL_ASSERT(format != WeightFormat::Dense, "Linear::set_quantized_weight: a dense format");
  TORCH_INTERNAL_ASSERT(!weight_format_is_gguf(format), "Linear::set_quantized_weight: GGUF blocks go through "
                        "set_gguf_weight");
  // The shape is this rank's, which the loader checked against the plan.
  TORCH_CHECK(codes.dim() == 2, "Linear '", path(), "': quantized weight has shape ", codes.sizes(),
              ", expected [out, in]");
  TORCH_CHECK(codes.scalar_type() == (format == WeightFormat::Int8 ? at::kChar : at::kByte), "Linear '", path(),
              "': ", weight_format_name(format), " codes must be ", format == WeightFormat::Int8 ? "int8" : "uint8",
              ", got ", codes.scalar_type());
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == codes.size(0), "Linear '", path(), "': weight scale has shape ",
              scale.sizes(), ", expected one per output row [", codes.size(0), "]");
  TORCH_CHECK(loras_.empty(), "Linear '", path(), "': quantize the weight before adding LoRA adapters");
  weight = std::move(codes);
  weight_scale_ = scale.to(at::kFloat).contiguous();
  weight_format_ = format;
  dense_dtype_ = dtype;
  if (int8_weight_) {
    int8_weight_.reset();
    enable_int8_compute();  // pack the new weight (a shard of the old one)
  }
}

void Linear::set_gguf_weight(at::Tensor codes, io::GgmlType type, at::ScalarType dtype) {
  const WeightFormat format = gguf_weight_format(type, "Linear '" + path() + "'");
  const io::GgmlBlock block = io::ggml_block(type);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.size(1) % block.type_size == 0, "Linear '",
              path(), "': GGUF codes have shape ", codes.sizes(), " and dtype ", codes.scalar_type(),
              ", expected uint8 [out, row_bytes] with rows of whole ", io::ggml_type_name(type), " blocks of ",
              block.type_size, " bytes");
  TORCH_CHECK(loras_.empty(), "Linear '", path(), "': set the GGUF weight before adding LoRA adapters");
  TORCH_CHECK(!int8_weight_, "Linear '", path(), "': int8 compute needs an int8 weight, not GGUF blocks");
  weight = std::move(codes);
  weight_scale_ = at::Tensor();
  weight_format_ = format;
  dense_dtype_ = dtype;
}

int64_t Linear::weight_in_features() const {
  if (!weight_format_is_gguf(weight_format_)) return weight.size(1);
  const io::GgmlBlock block = io::ggml_block(gguf_type_of(weight_format_));
  return weight.size(1) / block.type_size * block.block_size;
}

at::Tensor Linear::product(const at::Tensor& x, const at::Tensor& bias) const {
  if (int8_weight_) return int8_product(x, bias);
  // A quantized weight is dequantized here, block by block as layers run, so only one layer's
  // dense weight is alive at a time.
  return nn::linear(x, dense_weight(x.scalar_type()), bias);
}

at::Tensor Linear::int8_product(const at::Tensor& x, const at::Tensor& bias) const {
  SHARDIT_PROFILE_SCOPE("Linear.int8");
  const at::Tensor tokens = x.reshape({-1, x.size(-1)});  // [T, in_local]
  at::Tensor absmax = int8_row_absmax(tokens);              // [T]
  // A rowwise layer's input is split by columns: each token takes its whole row's maximum (exact
  // in any order), so its codes are the ones TP=1 computes.
  if (mode_ == LinearParallel::Rowwise) absmax = group_->all_gather(absmax.unsqueeze(0), 0).amax(0);
  const at::Tensor x_scale = int8_activation_scales(absmax);
  const at::Tensor accumulator = int8_weight_->accumulate(tokens, x_scale);  // [T, out_local] fp32
  const at::Tensor y = int8_rescale(accumulator, weight_scale_, x_scale, bias, x.scalar_type());
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = y.size(1);
  return y.view(shape);  // [..., out_local]
}

void Linear::enable_int8_compute() {
  TORCH_CHECK(weight_format_ == WeightFormat::Int8, "Linear '", path(), "': int8 compute needs an int8 weight, this "
              "one is ", weight_format_name(weight_format_), " (load with --weights-dtype int8)");
  TORCH_CHECK(weight.device().is_cpu(), "Linear '", path(), "': int8 compute runs on the CPU, the weight is on ",
              weight.device());
  auto packed = std::make_shared<const Int8PackedWeight>(weight);
  weight = packed->codes();  // the engine's copy: the layer's own is freed
  int8_weight_ = std::move(packed);
}

at::Tensor Linear::dense_weight(at::ScalarType dtype) const {
  if (weight_format_ == WeightFormat::Dense) return weight;
  SHARDIT_PROFILE_SCOPE("Linear.dequantize");
  return dequantize_rows(weight, weight_format_, weight_scale_, dtype);
}

void Linear::finish_rowwise(at::Tensor& y) {
  group_->all_reduce(y);  // [..., out], full sum
  if (bias.defined()) y.add_(bias);
}

void Linear::add_lora_deltas(at::Tensor& y, const at::Tensor& x) const {
  if (!lora_selection_) return;
  for (const auto& [adapter, adapter_weight] : lora_selection_->weights) {
    for (const LoraLayer& layer : loras_) {
      if (layer.adapter != adapter) continue;
      const double factor = layer.scaling * adapter_weight * lora_selection_->scale;
      if (factor == 0.0) continue;
      const at::Tensor down = nn::linear(x, layer.lora_A);  // [..., r]
      y.add_(nn::linear(down, layer.lora_B), factor);       // [..., out_local]
    }
  }
}

void Linear::add_lora(LoraLayer layer, std::shared_ptr<const LoraSelection> selection) {
  TORCH_CHECK(layer.lora_A.dim() == 2 && layer.lora_B.dim() == 2 && layer.lora_A.size(0) == layer.lora_B.size(1),
              "Linear::add_lora('", layer.adapter, "'): lora_A ", layer.lora_A.sizes(), " and lora_B ",
              layer.lora_B.sizes(), " are not [r, in] and [out, r] of one rank r");
  TORCH_CHECK(layer.lora_A.size(1) == weight_in_features() && layer.lora_B.size(0) == weight.size(0),
              "Linear::add_lora('", layer.adapter, "'): lora_B @ lora_A is [", layer.lora_B.size(0), ", ",
              layer.lora_A.size(1), "], expected this rank's weight shape [", weight.size(0), ", ",
              weight_in_features(), "]");
  TORCH_CHECK(selection != nullptr, "Linear::add_lora('", layer.adapter, "'): no adapter selection given");
  TORCH_CHECK(loras_.empty() || lora_selection_ == selection, "Linear::add_lora('", layer.adapter,
              "'): the layer's other adapters are switched by another selection; keep one per model");
  remove_lora(layer.adapter);
  loras_.push_back(std::move(layer));
  lora_selection_ = std::move(selection);
}

void Linear::remove_lora(const std::string& adapter) {
  loras_.erase(std::remove_if(loras_.begin(), loras_.end(),
                              [&](const LoraLayer& layer) { return layer.adapter == adapter; }),
               loras_.end());
  if (loras_.empty()) lora_selection_.reset();
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

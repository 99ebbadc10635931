// Loading a model's weights from safetensors: each rank reads only its own slices of the sharded
// tensors; Linear weights the checkpoint holds in 8 bits stay 8-bit and dense ones are quantized
// on load when asked (nn/weight_storage.h decides which). The whole checkpoint is checked against
// the model before any weight is read.
#include <c10/util/Exception.h>
#include <fnmatch.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include "shardit/nn/gguf_dequantize.h"
#include "shardit/nn/gguf_linear.h"
#include "shardit/nn/int8_compute.h"
#include "shardit/nn/weight_storage.h"
#include "shardit/parallel/plan_resolution.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::parallel {

namespace {

/// `text` matches `glob` (fnmatch(3) without flags: plan keys use `*` for any run of characters,
/// dots included).
bool glob_matches(const std::string& glob, const std::string& text) { return ::fnmatch(glob.c_str(), text.c_str(), 0) == 0; }

/// For each state tensor, the checkpoint key it is read from: its own name, else the first of its
/// aliases present; "" when none is.
std::vector<std::string> source_keys(const std::vector<nn::Module::TensorSlot>& slots,
                                     const io::Checkpoint& checkpoint, const ModelTraits& traits,
                                     std::set<std::string>& accepted) {
  std::map<std::string, const std::vector<std::string>*> aliases;
  for (const auto& [name, alternatives] : traits.key_aliases) aliases[name] = &alternatives;
  std::vector<std::string> keys;
  keys.reserve(slots.size());
  for (const auto& slot : slots) {
    std::vector<std::string> candidates{slot.name};
    const auto found = aliases.find(slot.name);
    if (found != aliases.end()) candidates.insert(candidates.end(), found->second->begin(), found->second->end());
    std::string key;
    for (const std::string& candidate : candidates) {
      if (!checkpoint.contains(candidate)) continue;
      accepted.insert(candidate);
      if (key.empty()) key = candidate;
    }
    keys.push_back(key);
  }
  return keys;
}

/// How one Linear weight is stored once loaded, with the checkpoint's scales.
struct WeightSource {
  nn::WeightStorage storage;
  at::Tensor full_scale;  ///< [out] fp32, the checkpoint's (storage.stored_quantized only)
};

/// Checkpoint names of a weight's scales, tried in this order: compressed-tensors / vLLM's
/// `<module>.weight_scale`, ComfyUI's `<module>.scale_weight`.
const char* const kWeightScaleNames[] = {"weight_scale", "scale_weight"};
/// Activation scales of static FP8 recipes (`input_scale`, ComfyUI's `scale_input`): accepted and
/// unused, since activations stay in the compute dtype.
const char* const kInputScaleNames[] = {"input_scale", "scale_input"};

/// The scale `scale_key` of the 8-bit weight `weight_key` ([out, in]), checked and expanded to one
/// per output row ([out] fp32). A per-tensor scale ([] or [1]) applies to every row, so each
/// block of a fused projection gets it too.
at::Tensor read_weight_scale(const io::Checkpoint& checkpoint, const std::string& scale_key,
                             const std::string& weight_key, const std::vector<int64_t>& weight_shape) {
  const io::TensorInfo& info = checkpoint.info(scale_key);
  const std::string& file = checkpoint.path_of(scale_key);
  const int64_t out = weight_shape.at(0);
  const int64_t count = info.numel();
  const bool per_tensor = count == 1 && info.shape.size() <= 1;
  const bool per_row = count == out && (info.shape.size() == 1 || (info.shape.size() == 2 && info.shape[1] == 1));
  TORCH_CHECK(per_tensor || per_row, file, ": scale '", scale_key, "' has shape ", c10::IntArrayRef(info.shape),
              ", expected [], [1], [", out, "] or [", out, ", 1] for weight '", weight_key, "' ",
              c10::IntArrayRef(weight_shape), " (per-tensor or per-output-channel scales; block-wise scales are "
              "not supported)");
  TORCH_CHECK(io::st_dtype_is_floating(info.dtype), file, ": scale '", scale_key, "' is ",
              io::st_dtype_name(info.dtype), ", expected a floating dtype (F32, BF16, F16)");
  const at::Tensor scale = checkpoint.read(scale_key, at::kFloat).reshape({-1});
  const at::Tensor bad = (~at::isfinite(scale)).nonzero();
  TORCH_CHECK(bad.numel() == 0, file, ": scale '", scale_key, "' of weight '", weight_key, "' holds ",
              scale[bad[0][0].item<int64_t>()].item<float>(), " at index ", bad[0][0].item<int64_t>(),
              "; scales must be finite (the checkpoint is corrupt)");
  const at::Tensor nonpositive = (scale <= 0).nonzero();
  TORCH_CHECK(nonpositive.numel() == 0, file, ": scale '", scale_key, "' of weight '", weight_key, "' holds ",
              scale[nonpositive[0][0].item<int64_t>()].item<float>(), " at index ", nonpositive[0][0].item<int64_t>(),
              "; scales must be positive (a zero scale would erase the row)");
  return per_tensor ? scale.expand({out}).clone() : scale;
}

/// The largest |w| of each whole row of the 2-D tensor `key` ([out] fp32), read from the file in
/// bands of rows: a rank holding only some columns of each row (rowwise) still scales by the
/// whole row, so every degree quantizes alike. The maximum is exact in any order.
at::Tensor full_row_absmax(const io::Checkpoint& checkpoint, const std::string& key) {
  const io::TensorInfo& info = checkpoint.info(key);
  const int64_t rows = info.shape[0];
  const int64_t cols = std::max<int64_t>(1, info.shape[1]);
  const int64_t band = std::max<int64_t>(1, (int64_t{16} << 20) / (cols * 4));  // ~16 MiB of fp32 per read
  std::vector<at::Tensor> pieces;
  for (int64_t begin = 0; begin < rows; begin += band) {
    const int64_t end = std::min(rows, begin + band);
    pieces.push_back(checkpoint.read_slices(key, 0, {{begin, end}}, at::kFloat).abs().amax(1));
  }
  return at::cat(pieces, 0);
}

/// NaN (and, for e5m2, infinity) codes in FP8 bytes: the mask of their bit patterns.
bool has_nonfinite_fp8(const at::Tensor& codes, io::StDtype dtype) {
  const int mask = dtype == io::StDtype::F8_E4M3 ? 0x7F : 0x7C;
  return (codes.bitwise_and(mask) == mask).any().item<bool>();
}

/// The checkpoint's scale of the Linear weight `key` ("" when it has none); the activation scales
/// beside it are `accepted` (and unused).
std::string scale_key_of(const io::Checkpoint& checkpoint, const std::string& key, std::set<std::string>& accepted) {
  const std::string module = nn::module_of_weight(key);
  if (module.empty()) return "";
  for (const char* name : kInputScaleNames) {
    if (checkpoint.contains(module + "." + name)) accepted.insert(module + "." + name);
  }
  for (const char* name : kWeightScaleNames) {
    if (checkpoint.contains(module + "." + name)) return module + "." + name;
  }
  return "";
}

/// How each Linear weight is stored: FP8 (and scaled I8) tensors as they are, with their scales
/// (`accepted`); dense ones quantized on load where `plan` says; the rest dense.
std::vector<WeightSource> weight_sources(const std::vector<nn::Module::TensorSlot>& slots,
                                         const std::vector<std::string>& keys, const io::Checkpoint& checkpoint,
                                         const ResolvedPlan& plan, nn::WeightsDtype weights,
                                         std::set<std::string>& accepted) {
  std::vector<WeightSource> sources(slots.size());
  std::vector<std::string> fp8_without_scale;
  std::string fp8_with_scale;  // one FP8 weight that has a scale, for the message
  for (size_t i = 0; i < slots.size(); ++i) {
    if (keys[i].empty() || linear_of_weight(slots[i]) == nullptr) continue;
    const io::TensorInfo& info = checkpoint.info(keys[i]);
    if (info.is_gguf_blocks()) continue;  // held as stored, as GGUF blocks (load_gguf_weight)
    const std::string scale_key = scale_key_of(checkpoint, keys[i], accepted);
    WeightSource& source = sources[i];
    source.storage = nn::weight_storage(info.dtype, !scale_key.empty(), plan.parameters[i].quantized, weights);
    if (!source.storage.stored_quantized) {
      TORCH_CHECK(scale_key.empty(), checkpoint.path_of(scale_key), ": scale '", scale_key, "' belongs to '",
                  keys[i], "', which is ", io::st_dtype_name(info.dtype), ", not an 8-bit weight; the file mixes ",
                  "formats (remove the scale, or store the weight in F8_E4M3 / I8)");
      continue;
    }
    if (scale_key.empty()) {
      if (source.storage.format != nn::WeightFormat::Int8) fp8_without_scale.push_back(keys[i]);
      source.full_scale = at::ones({info.shape.at(0)}, at::kFloat);  // FP8 values as they are
      continue;
    }
    accepted.insert(scale_key);
    if (fp8_with_scale.empty()) fp8_with_scale = scale_key;
    source.full_scale = read_weight_scale(checkpoint, scale_key, keys[i], info.shape);
  }
  // A checkpoint that scales its FP8 weights scales all of them: an unscaled one is a missing
  // tensor, whose values would be off by its scale.
  TORCH_CHECK(fp8_with_scale.empty() || fp8_without_scale.empty(), "checkpoint '", checkpoint.path(), "': ",
              fp8_without_scale.size(), " FP8 weight(s) have no scale (", join_names(fp8_without_scale, 10),
              ") while others do ('", fp8_with_scale, "'); expected '<module>.weight_scale' or "
              "'<module>.scale_weight' beside each (the file is incomplete)");
  return sources;
}

/// Refuses a checkpoint that does not fit `model`: a weight of a non-floating dtype, shape
/// mismatches, missing weights (`keys` empty) and unexpected ones (neither `accepted` nor ignored
/// by the traits), each listed.
void check_checkpoint_fits(const nn::Module& model, const std::vector<nn::Module::TensorSlot>& slots,
                           const std::vector<std::string>& keys, const std::vector<WeightSource>& sources,
                           const io::Checkpoint& checkpoint, const ModelTraits& traits,
                           const std::set<std::string>& accepted) {
  std::vector<std::string> missing;
  std::vector<std::string> mismatched;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (keys[i].empty()) {
      missing.push_back(slots[i].name);
      continue;
    }
    const io::TensorInfo& info = checkpoint.info(keys[i]);
    // An integer or boolean tensor under a weight's name is not a weight: it would be cast
    // silently, or fail at the first product naming no tensor.
    TORCH_CHECK(!slots[i].tensor->is_floating_point() || io::st_dtype_is_floating(info.dtype) ||
                    sources[i].storage.stored_quantized || info.is_gguf_blocks(),
                checkpoint.path_of(keys[i]), ": tensor '", keys[i], "' is ", io::st_dtype_name(info.dtype),
                ", but it is a weight of ", model.type_name(), " and weights are floating point (F32, BF16, F16, "
                "F64, F8_E4M3, F8_E5M2; I8 with a '.weight_scale'); the file is not this model's checkpoint");
    const std::vector<int64_t> declared = slots[i].tensor->sizes().vec();
    if (info.shape != declared) {
      std::ostringstream line;
      line << checkpoint.path_of(keys[i]) << ": tensor '" << keys[i] << "' has shape "
           << c10::IntArrayRef(info.shape) << ", the model expects " << c10::IntArrayRef(declared);
      mismatched.push_back(line.str());
    }
  }
  std::vector<std::string> extra;
  for (const std::string& name : checkpoint.names()) {
    if (accepted.count(name) != 0) continue;
    const bool ignored = std::any_of(traits.ignored_checkpoint_keys.begin(), traits.ignored_checkpoint_keys.end(),
                                     [&](const std::string& glob) { return glob_matches(glob, name); });
    if (!ignored) extra.push_back(name);
  }
  constexpr size_t kListed = 10;
  TORCH_CHECK(mismatched.empty(), "checkpoint '", checkpoint.path(), "' does not fit ", model.type_name(),
              ": ", mismatched.size(), " shape mismatch(es): ", join_names(mismatched, kListed),
              "; check that the checkpoint and the model config are the same variant");
  TORCH_CHECK(missing.empty() && extra.empty(), "checkpoint '", checkpoint.path(), "' does not fit ",
              model.type_name(), ":",
              missing.empty() ? std::string()
                              : " " + std::to_string(missing.size()) +
                                    " missing weight(s): " + join_names(missing, kListed) + ";",
              extra.empty()
                  ? std::string()
                  : " " + std::to_string(extra.size()) +
                        " unexpected weight(s) not in the model: " + join_names(extra, kListed) + ";",
              " check that the checkpoint and the model config are the same variant");
}

/// Fills the 8-bit Linear weight `key` from the checkpoint: this rank's codes as stored, or its
/// slice quantized with its whole rows' scales.
void load_8_bit_weight(nn::Linear& linear, const io::Checkpoint& checkpoint, const std::string& key,
                       const ShardSpec& spec, const WeightSource& source, int rank, at::ScalarType target,
                       const LoadOptions& options) {
  const io::TensorInfo& info = checkpoint.info(key);
  const nn::WeightFormat format = source.storage.format;
  at::Tensor codes;
  at::Tensor scale;
  if (source.storage.stored_quantized) {
    codes = spec.is_sharded() ? checkpoint.read_slices(key, spec.dim, spec.ranges_per_rank[rank])
                              : checkpoint.read(key);
    const at::ScalarType code_type = format == nn::WeightFormat::Int8 ? at::kChar : at::kByte;
    if (codes.scalar_type() != code_type) codes = codes.view(code_type);  // LibTorch's own float8 type
    TORCH_CHECK(format == nn::WeightFormat::Int8 || !has_nonfinite_fp8(codes, info.dtype),
                checkpoint.path_of(key), ": FP8 weight '", key, "' holds NaN or Inf codes; "
                "the checkpoint is corrupt");
    scale = row_scales_for_rank(source.full_scale, spec, rank);
  } else {
    // Quantize on load: this rank's slice in fp32 (exact for F32/BF16/F16), scaled by its
    // whole rows' maxima.
    const at::Tensor value = spec.is_sharded()
                                 ? checkpoint.read_slices(key, spec.dim, spec.ranges_per_rank[rank], at::kFloat)
                                 : checkpoint.read(key, at::kFloat);
    const at::Tensor absmax = spec.dim == 1 ? full_row_absmax(checkpoint, key) : value.abs().amax(1);
    TORCH_CHECK(at::isfinite(absmax).all().item<bool>(), checkpoint.path_of(key), ": weight '",
                key, "' holds NaN or Inf; refusing to quantize it (the checkpoint is corrupt)");
    scale = nn::symmetric_row_scales(absmax, format);
    codes = nn::quantize_rows(value, format, scale);
  }
  linear.set_quantized_weight(codes.to(options.device), format, scale.to(options.device), target);
  if (options.int8_compute && format == nn::WeightFormat::Int8) linear.enable_int8_compute();
}

/// The ggml type of a tensor stored in GGUF blocks.
io::GgmlType gguf_type(const io::TensorInfo& info) { return static_cast<io::GgmlType>(info.ggml_block_type); }

/// The first split range of `spec` on `rank` that cuts a block of `block` elements, if any: rows
/// (dim 0) are free to cut; a split along the row must fall between blocks.
std::optional<io::Range> gguf_cut(const ShardSpec& spec, int64_t block) {
  if (!spec.is_sharded() || spec.dim == 0) return std::nullopt;
  for (const auto& ranges : spec.ranges_per_rank) {
    for (const io::Range& range : ranges) {
      if (range.begin % block != 0 || range.end % block != 0) return range;
    }
  }
  return std::nullopt;
}

/// Refuses, before anything is read, a degree at which the split of a tensor stored in GGUF blocks
/// cuts its blocks, listing the degrees (up to 64) at which the plan resolves and every such split
/// falls on whole blocks.
void check_gguf_splits(nn::Module& model, const TpPlan& plan, const ResolvedPlan& resolved,
                       const std::vector<std::string>& keys, const io::Checkpoint& checkpoint, const LoadOptions& options,
                       const ModelTraits& traits) {
  const auto first_cut = [&](const ResolvedPlan& candidate) -> std::optional<size_t> {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i].empty() || !checkpoint.info(keys[i]).is_gguf_blocks()) continue;
      if (gguf_cut(candidate.parameters[i], io::ggml_block(gguf_type(checkpoint.info(keys[i]))).block_size)) return i;
    }
    return std::nullopt;
  };
  const std::optional<size_t> cut = first_cut(resolved);
  if (!cut) return;
  std::vector<std::string> working;
  for (int degree = 1; degree <= 64; ++degree) {
    try {
      const Resolution candidate = resolve_with_layers(model, plan, degree, traits, options.dtype, options.weights,
                                                       options.quantize_kept_layers);
      if (!first_cut(candidate.plan)) working.push_back(std::to_string(degree));
    } catch (const c10::Error&) {
      // The plan itself refuses this degree.
    }
  }
  const ShardSpec& spec = resolved.parameters[*cut];
  const io::TensorInfo& info = checkpoint.info(keys[*cut]);
  const io::Range range = *gguf_cut(spec, io::ggml_block(gguf_type(info)).block_size);
  TORCH_CHECK(false, checkpoint.path_of(keys[*cut]), ": tensor '", keys[*cut], "' (", io::ggml_type_name(gguf_type(info)),
              ", shape ", c10::IntArrayRef(info.shape), ") is stored in blocks of ",
              io::ggml_block(gguf_type(info)).block_size, " elements along its rows, but tensor parallelism at degree ",
              resolved.tp_degree, " splits its rows at columns [", range.begin, ", ", range.end,
              "), inside a block; degrees that keep every GGUF block whole: ", join_names(working, 64),
              " (or use a file whose type has smaller blocks)");
}

/// Fills the weight of slot `slot` from the tensor `key` stored in GGUF blocks: a Linear keeps this
/// rank's blocks as stored (whole rows when colwise, whole blocks of every row when rowwise);
/// another tensor is dequantized on load to `target`.
void load_gguf_weight(const nn::Module::TensorSlot& slot, const io::Checkpoint& checkpoint, const std::string& key,
                      const ShardSpec& spec, int rank, at::ScalarType target, const LoadOptions& options) {
  const io::GgmlType type = gguf_type(checkpoint.info(key));
  const std::vector<io::Range>* ranges = spec.is_sharded() ? &spec.ranges_per_rank[static_cast<size_t>(rank)] : nullptr;
  const at::Tensor codes = ranges ? checkpoint.read_slices(key, spec.dim, *ranges) : checkpoint.read(key);
  const std::string what = checkpoint.path_of(key) + ": tensor '" + key + "'";
  const int64_t first_row = ranges && spec.dim == 0 ? ranges->front().begin : 0;
  const int64_t first_block =
      ranges && spec.dim > 0 ? ranges->front().begin / io::ggml_block(type).block_size : 0;
  if (nn::Linear* linear = linear_of_weight(slot)) {
    nn::set_gguf_linear_codes(*linear, codes.to(options.device), type, what, first_row, first_block, target);
    return;
  }
  nn::check_gguf_scales(codes, type, what, first_row, first_block);
  *slot.tensor = nn::gguf_dequantize(codes, type, target, what).reshape(spec.local_shape(rank)).to(options.device);
}

/// Records in `spec` the form a load holds the weight in when it differs from the plan's dense
/// one: GGUF blocks as stored (a Linear weight; other block tensors are dequantized) or 8 bits.
void count_as_held(ShardSpec& spec, const nn::Module::TensorSlot& slot, const io::TensorInfo& info,
                   const WeightSource& source) {
  if (info.is_gguf_blocks()) {
    if (linear_of_weight(slot) != nullptr) spec.count_as_gguf_blocks(gguf_type(info));
    return;
  }
  if (source.storage.format != nn::WeightFormat::Dense) {
    spec.quantized = true;
    spec.element_size = 1;
  }
}

/// The plan at `tp_degree` checked against `checkpoint` as load_weights checks it before reading
/// (keys, shapes, 8-bit scales, GGUF splits), with the checkpoint's key and source per state tensor.
struct CheckedLoad {
  Resolution resolution;
  std::vector<nn::Module::TensorSlot> slots;
  std::vector<std::string> keys;
  std::vector<WeightSource> sources;
};

CheckedLoad check_load(nn::Module& model, const io::Checkpoint& checkpoint, const TpPlan& plan, int tp_degree,
                       const LoadOptions& options, const ModelTraits& traits) {
  CheckedLoad load{resolve_with_layers(model, plan, tp_degree, traits, options.dtype, options.weights,
                                       options.quantize_kept_layers),
                   model.named_states(), {}, {}};
  TORCH_INTERNAL_ASSERT(load.slots.size() == load.resolution.plan.parameters.size());
  std::set<std::string> accepted;
  load.keys = source_keys(load.slots, checkpoint, traits, accepted);
  load.sources = weight_sources(load.slots, load.keys, checkpoint, load.resolution.plan, options.weights, accepted);
  check_checkpoint_fits(model, load.slots, load.keys, load.sources, checkpoint, traits, accepted);
  check_gguf_splits(model, plan, load.resolution.plan, load.keys, checkpoint, options, traits);
  return load;
}

}  // namespace

ResolvedPlan resolve_as_stored(nn::Module& model, const io::Checkpoint& checkpoint, const TpPlan& plan, int tp_degree,
                               const LoadOptions& options, const ModelTraits& traits) {
  CheckedLoad load = check_load(model, checkpoint, plan, tp_degree, options, traits);
  for (size_t i = 0; i < load.slots.size(); ++i) {
    count_as_held(load.resolution.plan.parameters[i], load.slots[i], checkpoint.info(load.keys[i]), load.sources[i]);
  }
  return std::move(load.resolution.plan);
}

ResolvedPlan load_weights(nn::Module& model, const io::Checkpoint& checkpoint, const TpPlan& plan,
                          const LoadOptions& options, const ModelTraits& traits) {
  const bool parallel = options.tensor_parallel.has_value();
  TORCH_CHECK(!parallel || options.tensor_parallel->group != nullptr,
              "load_weights: the tensor-parallel config has no group");
  if (options.int8_compute) nn::check_int8_compute(options.weights, options.device);
  // Validate the whole checkpoint against the model before reading anything.
  CheckedLoad load =
      check_load(model, checkpoint, plan, parallel ? options.tensor_parallel->tp_degree() : 1, options, traits);
  Resolution& resolution = load.resolution;
  const auto& slots = load.slots;
  const auto& keys = load.keys;
  const auto& sources = load.sources;

  const int rank = parallel ? options.tensor_parallel->tp_rank() : 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    const ShardSpec& spec = resolution.plan.parameters[i];
    TORCH_INTERNAL_ASSERT(spec.parameter == slots[i].name);
    const at::ScalarType target = nn::keeps_fp32(slots[i].name, traits.keep_in_fp32_modules) ? at::kFloat
                                                                                              : options.dtype;
    if (checkpoint.info(keys[i]).is_gguf_blocks()) {
      load_gguf_weight(slots[i], checkpoint, keys[i], resolution.plan.parameters[i], rank, target, options);
      count_as_held(resolution.plan.parameters[i], slots[i], checkpoint.info(keys[i]), sources[i]);
      continue;
    }
    if (sources[i].storage.format != nn::WeightFormat::Dense) {
      load_8_bit_weight(*linear_of_weight(slots[i]), checkpoint, keys[i], spec, sources[i], rank, target, options);
      count_as_held(resolution.plan.parameters[i], slots[i], checkpoint.info(keys[i]), sources[i]);
      continue;
    }
    const bool floating = io::st_dtype_is_floating(checkpoint.info(keys[i]).dtype);
    const std::optional<at::ScalarType> dtype = floating ? std::optional<at::ScalarType>(target) : std::nullopt;
    const at::Tensor value = spec.is_sharded()
                                 ? checkpoint.read_slices(keys[i], spec.dim, spec.ranges_per_rank[rank], dtype)
                                 : checkpoint.read(keys[i], dtype);
    *slots[i].tensor = value.to(options.device);
  }
  if (parallel) set_parallel_modes(resolution.layers, options.tensor_parallel->group);
  return std::move(resolution.plan);
}

}  // namespace shardit::parallel

#include "shardit/models/lora_formats.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <exception>
#include <filesystem>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "shardit/io/json.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/joint_transformer.h"
#include "shardit/models/registry.h"
#include "shardit/nn/linear.h"

namespace shardit::models {

namespace {

using parallel::LoraAdapterSpec;
using parallel::LoraFactorSource;
using parallel::LoraTarget;

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.size() >= prefix.size() && text.compare(0, prefix.size(), prefix) == 0;
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string underscored(std::string text) {
  std::replace(text.begin(), text.end(), '.', '_');
  return text;
}

/// The names of one pair's tensors in the file.
struct SourcePair {
  std::string stem;
  std::string down;   ///< lora_A
  std::string up;     ///< lora_B
  std::string alpha;  ///< "" when absent
  size_t suffix = 0;  ///< which of the format's (down, up) suffix pairs the down factor uses
};

/// The factor suffixes of one format: (down, up).
using Suffixes = std::vector<std::pair<std::string, std::string>>;

/// What the converter needs of the model: its LoRA key conventions, its Linears and their output
/// widths.
struct ModelLinears {
  std::string model_name;
  const LoraKeyConventions* conventions = nullptr;
  std::map<std::string, int64_t> out_features;        ///< module -> out
  std::map<std::string, std::string> by_underscored;  ///< "transformer_blocks_0_attn_to_q" -> module
};

ModelLinears linears_of(parallel::TensorParallelModule& model) {
  ModelLinears linears;
  linears.model_name = model.type_name();
  const auto* transformer = dynamic_cast<const JointTransformer2DModel*>(&model);
  TORCH_CHECK(transformer != nullptr, "LoRA adapters are supported on the transformer classes (",
              c10::Join(", ", supported_classes(ComponentKind::Transformer)), "), not on ", linears.model_name);
  linears.conventions = &transformer->lora_conventions();
  for (const auto& [name, module] : model.named_modules()) {
    if (const auto* layer = dynamic_cast<const nn::Linear*>(module)) {
      linears.out_features[name] = layer->options().out_features;
      linears.by_underscored[underscored(name)] = name;
    }
  }
  return linears;
}

/// Groups the file's keys (after `prefix`) into pairs by stem, in file order. A key that is not
/// one of `suffixes` or `.alpha` is an error, and so is a factor without its partner.
std::vector<SourcePair> pairs_of(const io::SafetensorsFile& file, const std::string& prefix, const Suffixes& suffixes,
                                 const std::string& format) {
  std::vector<SourcePair> pairs;
  std::map<std::string, size_t> index;
  auto pair_for = [&](const std::string& stem) -> SourcePair& {
    const auto [it, fresh] = index.emplace(stem, pairs.size());
    if (fresh) pairs.push_back({stem, "", "", ""});
    return pairs[it->second];
  };
  for (const std::string& key : file.names()) {
    size_t suffix_index = 0;
    TORCH_CHECK(starts_with(key, prefix), file.path(), ": key '", key, "' does not start with '", prefix,
                "' like the other keys of this ", format, " LoRA; the file mixes formats or is not a LoRA");
    const std::string rest = key.substr(prefix.size());
    bool matched = false;
    for (const auto& [down, up] : suffixes) {
      if (ends_with(rest, down)) {
        SourcePair& pair = pair_for(rest.substr(0, rest.size() - down.size()));
        pair.down = key;
        pair.suffix = suffix_index;
        matched = true;
      } else if (ends_with(rest, up)) {
        pair_for(rest.substr(0, rest.size() - up.size())).up = key;
        matched = true;
      }
      if (matched) break;
      ++suffix_index;
    }
    if (!matched && ends_with(rest, ".alpha")) {
      pair_for(rest.substr(0, rest.size() - 6)).alpha = key;
      matched = true;
    }
    TORCH_CHECK(matched, file.path(), ": key '", key, "' is not a tensor of a ", format, " LoRA (expected names ending in '",
                suffixes.front().first, "', '", suffixes.front().second, "' or '.alpha')");
  }
  for (const SourcePair& pair : pairs) {
    TORCH_CHECK(!pair.down.empty() && !pair.up.empty(), file.path(), ": '", prefix, pair.stem, "' has ",
                pair.down.empty() ? "no down (lora_A)" : "no up (lora_B)", " factor",
                pair.alpha.empty() ? "" : " (only its alpha)", "; the file is truncated or not a LoRA");
  }
  return pairs;
}

int64_t rank_of(const io::SafetensorsFile& file, const SourcePair& pair) {
  const io::TensorInfo& info = file.info(pair.down);
  TORCH_CHECK(info.shape.size() == 2, file.path(), ": tensor '", pair.down, "' has shape [",
              c10::IntArrayRef(info.shape), "], expected [r, in]");
  return info.shape[0];
}

double alpha_of(const io::SafetensorsFile& file, const SourcePair& pair, LoraAdapterSpec& spec) {
  const at::Tensor alpha = file.read(pair.alpha, at::kDouble);
  TORCH_CHECK(alpha.numel() == 1, file.path(), ": tensor '", pair.alpha, "' has shape ", alpha.sizes(),
              ", expected one value (the LoRA alpha)");
  const double value = alpha.item<double>();
  TORCH_CHECK(std::isfinite(value), file.path(), ": tensor '", pair.alpha, "' is ", value, ", expected a finite alpha");
  if (std::find(spec.alphas.begin(), spec.alphas.end(), value) == spec.alphas.end()) spec.alphas.push_back(value);
  return value;
}

/// Adds the targets of one source pair: `modules` take consecutive row blocks of lora_B (their
/// output widths) and a copy of lora_A.
void add_targets(const io::SafetensorsFile& file, const ModelLinears& linears, const SourcePair& pair,
                 const std::vector<std::string>& modules, double a_factor, double b_factor, double scaling,
                 LoraAdapterSpec& spec) {
  int64_t row = 0;
  for (const std::string& module : modules) {
    const auto found = linears.out_features.find(module);
    TORCH_CHECK(found != linears.out_features.end(), file.path(), ": key '", pair.up, "' maps to module '", module,
                "', which is not a Linear of ", linears.model_name, "; the LoRA is for another model family or version");
    LoraTarget target;
    target.module = module;
    target.lora_A = LoraFactorSource{pair.down, 0, -1, a_factor};
    target.lora_B = LoraFactorSource{pair.up, row, modules.size() == 1 ? -1 : found->second, b_factor};
    target.scaling = scaling;
    spec.targets.push_back(std::move(target));
    row += found->second;
  }
  const io::TensorInfo& up = file.info(pair.up);
  TORCH_CHECK(up.shape.size() == 2, file.path(), ": tensor '", pair.up, "' has shape [", c10::IntArrayRef(up.shape),
              "], expected [out, r]");
  TORCH_CHECK(modules.size() == 1 || up.shape[0] == row, file.path(), ": tensor '", pair.up, "' has ", up.shape[0],
              " rows, but the modules it splits into (", c10::Join(", ", modules), ") have ", row,
              " output features together; the LoRA was trained for another model");
  spec.rank = std::max(spec.rank, rank_of(file, pair));
}

/// kohya's alpha/rank folded into the two factors as diffusers does: s = alpha / r split as
/// (s_down, s_up), doubling s_down and halving s_up while 2·s_down < s_up.
std::pair<double, double> kohya_factors(double alpha, int64_t rank) {
  double s_down = alpha / static_cast<double>(rank);
  double s_up = 1.0;
  while (s_down * 2 < s_up) {
    s_down *= 2;
    s_up /= 2;
  }
  return {s_down, s_up};
}

std::string block_module(const std::string& list, const std::string& index, const std::string& name) {
  return list + "." + index + "." + name;
}

/// A BFL module name of a block ("double_blocks_3_img_attn_qkv", dots already turned into `_`)
/// split into block kind, index and the rest; false when it is not a block name.
bool split_block(const std::string& name, std::string& kind, std::string& index, std::string& rest) {
  for (const std::string candidate : {"double_blocks_", "single_blocks_"}) {
    if (!starts_with(name, candidate)) continue;
    const size_t digits_end = name.find('_', candidate.size());
    if (digits_end == std::string::npos || digits_end == candidate.size()) return false;
    index = name.substr(candidate.size(), digits_end - candidate.size());
    if (!std::all_of(index.begin(), index.end(), [](char c) { return c >= '0' && c <= '9'; })) return false;
    kind = candidate.substr(0, candidate.size() - 1);
    rest = name.substr(digits_end + 1);
    return true;
  }
  return false;
}

/// BFL module names (with `_`) -> diffusers modules, in lora_up row order, by the family's tables.
/// Empty: not a module diffusers converts.
std::vector<std::string> bfl_targets(const LoraKeyConventions& conventions, const std::string& name) {
  std::string kind;
  std::string index;
  std::string rest;
  if (split_block(name, kind, index, rest)) {
    const bool is_double = kind == "double_blocks";
    const LoraModuleTable& table = is_double ? conventions.bfl_double_block : conventions.bfl_single_block;
    const auto found = table.find(rest);
    if (found == table.end()) return {};
    std::vector<std::string> modules;
    for (const std::string& module : found->second) {
      modules.push_back(block_module(is_double ? "transformer_blocks" : "single_transformer_blocks", index, module));
    }
    return modules;
  }
  const auto found = conventions.bfl_top_level.find(name);
  return found == conventions.bfl_top_level.end() ? std::vector<std::string>{} : found->second;
}

/// kohya sources that the family's diffusers conversion drops.
bool is_kohya_skipped(const LoraKeyConventions& conventions, const std::string& name) {
  return std::any_of(conventions.kohya_skipped_prefixes.begin(), conventions.kohya_skipped_prefixes.end(),
                     [&](const std::string& prefix) { return starts_with(name, prefix); });
}

/// Resolves a converted-format source name to diffusers modules, or fails naming the key.
std::vector<std::string> modules_for(const io::SafetensorsFile& file, const ModelLinears& linears,
                                     const SourcePair& pair, const std::string& name, bool underscore_names) {
  const LoraKeyConventions& conventions = *linears.conventions;
  if (conventions.names_are_module_paths()) {
    if (underscore_names) {
      const auto found = linears.by_underscored.find(underscored(name));
      TORCH_CHECK(found != linears.by_underscored.end(), file.path(), ": key '", pair.up, "' names module '", name,
                  "', which is not a Linear of ", linears.model_name,
                  "; the LoRA is for another model family or version");
      return {found->second};
    }
    return {name};
  }
  if (conventions.bfl_names_may_be_diffusers && !underscore_names) {
    // Some FLUX.2 exports already hold diffusers block names (and `sformer_blocks.` for
    // `transformer_blocks.`).
    for (const std::string prefix : {"transformer_blocks.", "single_transformer_blocks."}) {
      if (starts_with(name, prefix)) return {name};
    }
    if (starts_with(name, "sformer_blocks.")) return {"tran" + name};
  }
  const std::vector<std::string> modules = bfl_targets(conventions, underscored(name));
  TORCH_CHECK(!modules.empty(), file.path(), ": key '", pair.up, "' names '", name, "', which is not a ",
              conventions.family, " module a LoRA can target (expected double_blocks.<i>.img_attn.qkv, single_blocks.<i>.linear1 and the "
              "like); the LoRA is for another model family");
  return modules;
}

/// PEFT's LoraConfig values from `lora_adapter_metadata` (keys with or without `transformer.`).
struct PeftConfig {
  bool present = false;
  double r = 0;
  double lora_alpha = 0;
  bool use_rslora = false;
  std::map<std::string, double> rank_pattern;
  std::map<std::string, double> alpha_pattern;

  double scaling(const std::string& module) const {
    double rank = r;
    double alpha = lora_alpha;
    // PEFT matches a pattern key as a suffix of the module path.
    auto lookup = [&](const std::map<std::string, double>& patterns, double& value) {
      for (const auto& [key, pattern_value] : patterns) {
        if (module == key || ends_with(module, "." + key)) value = pattern_value;
      }
    };
    lookup(rank_pattern, rank);
    lookup(alpha_pattern, alpha);
    return use_rslora ? alpha / std::sqrt(rank) : alpha / rank;
  }
};

PeftConfig peft_config(const io::SafetensorsFile& file) {
  PeftConfig config;
  const auto found = file.metadata().find("lora_adapter_metadata");
  if (found == file.metadata().end()) return config;
  const std::string label = file.path() + ": __metadata__ lora_adapter_metadata";
  const nlohmann::json json = io::parse_json(found->second.data(), found->second.size(), label);
  TORCH_CHECK(json.is_object(), label, " is not a JSON object");
  auto value = [&](const std::string& key) -> const nlohmann::json* {
    for (const std::string& name : {"transformer." + key, key}) {
      if (json.contains(name) && !json.at(name).is_null()) return &json.at(name);
    }
    return nullptr;
  };
  const nlohmann::json* r = value("r");
  const nlohmann::json* alpha = value("lora_alpha");
  TORCH_CHECK(r != nullptr && r->is_number() && r->get<double>() > 0, label, ": 'r' is missing or not a positive number");
  TORCH_CHECK(alpha != nullptr && alpha->is_number(), label, ": 'lora_alpha' is missing or not a number");
  config.present = true;
  config.r = r->get<double>();
  config.lora_alpha = alpha->get<double>();
  if (const nlohmann::json* rslora = value("use_rslora")) config.use_rslora = rslora->is_boolean() && rslora->get<bool>();
  for (const auto& [key, target] : {std::pair{"rank_pattern", &config.rank_pattern},
                                    std::pair{"alpha_pattern", &config.alpha_pattern}}) {
    const nlohmann::json* patterns = value(key);
    if (patterns == nullptr) continue;
    TORCH_CHECK(patterns->is_object(), label, ": '", key, "' is not an object");
    for (const auto& [pattern, number] : patterns->items()) {
      TORCH_CHECK(number.is_number() && number.get<double>() > 0, label, ": ", key, "['", pattern,
                  "'] is not a positive number");
      (*target)[pattern] = number.get<double>();
    }
  }
  const nlohmann::json* dora = value("use_dora");
  TORCH_CHECK(dora == nullptr || !dora->is_boolean() || !dora->get<bool>(), label,
              ": use_dora is true; DoRA adapters are not supported");
  return config;
}

void convert_diffusers(const io::SafetensorsFile& file, const ModelLinears& linears, LoraAdapterSpec& spec) {
  const PeftConfig config = peft_config(file);
  spec.format = config.present ? "diffusers+metadata" : "diffusers";
  const Suffixes suffixes = {{".lora_A.weight", ".lora_B.weight"}, {".lora_A.default.weight", ".lora_B.default.weight"}};
  for (const SourcePair& pair : pairs_of(file, "transformer.", suffixes, "diffusers")) {
    const int64_t rank = rank_of(file, pair);
    double scaling = 1.0;
    if (config.present) {
      scaling = config.scaling(pair.stem);
    } else if (!pair.alpha.empty()) {
      scaling = alpha_of(file, pair, spec) / static_cast<double>(rank);
    }
    if (config.present && std::find(spec.alphas.begin(), spec.alphas.end(), config.lora_alpha) == spec.alphas.end()) {
      spec.alphas.push_back(config.lora_alpha);
    }
    add_targets(file, linears, pair, {pair.stem}, 1.0, 1.0, scaling, spec);
  }
}

/// kohya (`lora_unet_`) and ComfyUI/BFL/ai-toolkit (`diffusion_model.`, PEFT's
/// `base_model.model.`) files.
void convert_prefixed(const io::SafetensorsFile& file, const ModelLinears& linears, const std::string& prefix,
                      LoraAdapterSpec& spec) {
  const bool kohya = prefix == "lora_unet_";
  const Suffixes suffixes = {{".lora_down.weight", ".lora_up.weight"},
                             {".lora_A.weight", ".lora_B.weight"},
                             {".lora_A.default.weight", ".lora_B.default.weight"}};
  spec.format = kohya ? "kohya" : "bfl";
  const LoraKeyConventions& conventions = *linears.conventions;
  for (const SourcePair& pair : pairs_of(file, prefix, suffixes, spec.format)) {
    if (kohya && is_kohya_skipped(conventions, pair.stem)) {
      spec.skipped.push_back(prefix + pair.stem);
      continue;
    }
    const int64_t rank = rank_of(file, pair);
    const bool down_up_names = pair.suffix == 0;
    double alpha = static_cast<double>(rank);
    if (conventions.lora_ab_names_drop_alpha && !down_up_names) {
      // diffusers drops the alphas of such a lora_A/lora_B file: scale 1.
    } else if (conventions.bfl_refuses_alpha && !kohya) {
      TORCH_CHECK(pair.alpha.empty(), file.path(), ": key '", pair.alpha, "': a ", conventions.family,
                  " BFL/ai-toolkit LoRA carries no alpha (diffusers refuses it too); remove the alpha keys or fold "
                  "them into the weights");
    } else if (!pair.alpha.empty()) {
      alpha = alpha_of(file, pair, spec);
    } else {
      TORCH_CHECK(!conventions.kohya_requires_alpha, file.path(), ": '", prefix, pair.stem, "' has no '.alpha'; a ",
                  conventions.family, " kohya LoRA (lora_down/lora_up) gives every module its alpha");
    }
    const auto [a_factor, b_factor] = kohya_factors(alpha, rank);
    add_targets(file, linears, pair, modules_for(file, linears, pair, pair.stem, kohya), a_factor, b_factor, 1.0, spec);
  }
}

void convert_xlabs(const io::SafetensorsFile& file, const ModelLinears& linears, LoraAdapterSpec& spec) {
  // XLabs trained FLUX.1 only; a family that takes its files lists their sources.
  const LoraKeyConventions& conventions = *linears.conventions;
  TORCH_CHECK(conventions.has_xlabs(), file.path(), ": an XLabs LoRA is for FLUX.1, not for ", linears.model_name);
  spec.format = "xlabs";
  for (const SourcePair& pair : pairs_of(file, "", {{".down.weight", ".up.weight"}}, "XLabs")) {
    TORCH_CHECK(pair.alpha.empty(), file.path(), ": key '", pair.alpha, "': XLabs LoRAs carry no alpha");
    // "[diffusion_model.]double_blocks.<i>.processor.<source>"
    const std::string stem =
        starts_with(pair.stem, "diffusion_model.") ? pair.stem.substr(std::string("diffusion_model.").size()) : pair.stem;
    const size_t processor = stem.find(".processor.");
    std::string kind;
    std::string index;
    std::string rest;
    const bool is_block = processor != std::string::npos &&
                          split_block(underscored(stem.substr(0, processor)) + "_x", kind, index, rest);
    const auto& table = kind == "double_blocks" ? conventions.xlabs_double_block : conventions.xlabs_single_block;
    const auto found = is_block ? table.find(stem.substr(processor + 11)) : table.end();
    TORCH_CHECK(found != table.end(), file.path(), ": key '", pair.up,
                "' is not an XLabs FLUX.1 source (double_blocks.<i>.processor.qkv_lora1/2, proj_lora1/2, "
                "single_blocks.<i>.processor.qkv_lora, proj_lora)");
    std::vector<std::string> modules;
    for (const std::string& module : found->second) {
      modules.push_back(block_module(kind == "double_blocks" ? "transformer_blocks" : "single_transformer_blocks",
                                     index, module));
    }
    add_targets(file, linears, pair, modules, 1.0, 1.0, 1.0, spec);
  }
}

}  // namespace

parallel::LoraAdapterSpec read_lora_spec(const std::string& path, parallel::TensorParallelModule& model) {
  return read_lora_spec(*io::SafetensorsFile::open(path), model);
}

parallel::LoraAdapterSpec read_lora_spec(const io::SafetensorsFile& file, parallel::TensorParallelModule& model) {
  const ModelLinears linears = linears_of(model);
  const std::string& path = file.path();
  const std::vector<std::string> names = file.names();
  TORCH_CHECK(!names.empty(), path, ": the file holds no tensors; it is not a LoRA");
  LoraAdapterSpec spec;
  spec.path = path;
  const std::string& first = names.front();
  auto any = [&](auto predicate) { return std::any_of(names.begin(), names.end(), predicate); };
  if (any([](const std::string& key) { return starts_with(key, "lora_unet_"); })) {
    convert_prefixed(file, linears, "lora_unet_", spec);
  } else if (any([](const std::string& key) { return key.find(".processor.") != std::string::npos; })) {
    convert_xlabs(file, linears, spec);
  } else if (any([](const std::string& key) { return starts_with(key, "diffusion_model."); })) {
    convert_prefixed(file, linears, "diffusion_model.", spec);
  } else if (any([](const std::string& key) { return starts_with(key, "base_model.model."); })) {
    convert_prefixed(file, linears, "base_model.model.", spec);
  } else if (any([](const std::string& key) { return starts_with(key, "transformer."); })) {
    convert_diffusers(file, linears, spec);
  } else {
    TORCH_CHECK(false, path, ": unknown LoRA format (first key '", first,
                "'); known: diffusers/PEFT 'transformer.<module>.lora_A.weight', kohya 'lora_unet_*', XLabs "
                "'double_blocks.<i>.processor.*', BFL/ai-toolkit 'diffusion_model.*' or 'base_model.model.*'");
  }
  TORCH_CHECK(!spec.targets.empty(), path, ": the ", spec.format, " LoRA targets no module of ", linears.model_name,
              " (skipped: ", c10::Join(", ", spec.skipped), ")");
  return spec;
}

std::vector<LoraFile> open_lora_files(const std::vector<LoraRequest>& requests, parallel::TensorParallelModule& model) {
  std::vector<LoraFile> files;
  for (const LoraRequest& request : requests) {
    TORCH_CHECK(std::isfinite(request.weight), request.path, ": the adapter weight ", request.weight,
                " is not a finite number");
    LoraFile opened;
    opened.name = request.name.empty() ? lora_adapter_name(request.path) : request.name;
    for (const LoraFile& earlier : files) {
      TORCH_CHECK(earlier.name != opened.name, request.path, ": an adapter named '", opened.name, "' (from ",
                  earlier.spec.path, ") is already given; name each adapter apart (adapters without a name are "
                  "named after their files; serve takes --lora NAME=FILE[:WEIGHT])");
    }
    opened.weight = request.weight;
    opened.file = io::SafetensorsFile::open(request.path);
    opened.spec = read_lora_spec(*opened.file, model);
    files.push_back(std::move(opened));
  }
  return files;
}

void load_lora_files(parallel::LoraAdapters& adapters, const std::vector<LoraFile>& files, double lora_scale,
                     bool fuse) {
  TORCH_CHECK(std::isfinite(lora_scale), "the LoRA scale (--lora-scale) ", lora_scale, " is not a finite number");
  std::vector<std::string> names;
  std::vector<double> weights;
  for (const LoraFile& file : files) {
    adapters.load(file.name, file.spec, *file.file);
    names.push_back(file.name);
    weights.push_back(file.weight);
  }
  adapters.set_adapters(names, weights);
  if (fuse) {
    adapters.fuse(lora_scale);
  } else {
    adapters.set_scale(lora_scale);
  }
}

std::string lora_adapter_name(const std::string& path) {
  std::string name = std::filesystem::path(path).filename().string();
  if (ends_with(name, ".safetensors")) name.resize(name.size() - 12);
  return name;
}

}  // namespace shardit::models

// Plan resolution: each plan key's modules (globs over module lists), their styles' split
// dimensions and blocks, every size the degree must divide (errors name the key, the tensor and
// the degrees that would work), and the ShardSpec of every state tensor.
#include "shardit/parallel/plan_resolution.h"

#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <iomanip>
#include <map>
#include <numeric>
#include <sstream>
#include <utility>

#include "shardit/core/units.h"
#include "shardit/nn/weight_storage.h"

namespace shardit::parallel {

namespace {

// The largest TP degree an error message suggests.
constexpr int kMaxSuggestedDegree = 64;

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> out;
  if (path.empty()) return out;
  size_t begin = 0;
  while (true) {
    const size_t dot = path.find('.', begin);
    out.push_back(path.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin));
    if (dot == std::string::npos) break;
    begin = dot + 1;
  }
  return out;
}

std::string join_path(const std::vector<std::string>& segments, size_t count) {
  std::string out;
  for (size_t i = 0; i < count; ++i) out += (i ? "." : "") + segments[i];
  return out;
}

/// A size the TP degree must divide, with what to say when it does not.
struct Constraint {
  int64_t size;
  std::string plan_key;
  std::string what;
  /// A head count that a degree may also be a multiple of (its heads are then replicated).
  bool replicable = false;

  bool accepts(int64_t degree) const { return size % degree == 0 || (replicable && degree % size == 0); }
};

/// Why `key` matched nothing: the deepest module its path reaches, and that module's children.
std::string explain_no_match(nn::Module& model, const std::vector<std::string>& segments) {
  nn::Module* current = &model;
  std::string reached;
  for (const std::string& segment : segments) {
    nn::Module* next = nullptr;
    for (const auto& [name, child] : current->children()) {
      if (name == segment || (segment == "*" && dynamic_cast<nn::ModuleListBase*>(current))) {
        next = child.get();
        break;
      }
    }
    if (next == nullptr) {
      std::vector<std::string> names;
      for (const auto& [name, child] : current->children()) names.push_back(name);
      std::ostringstream out;
      out << "'" << (reached.empty() ? std::string("<model>") : reached) << "' (" << current->type_name()
          << ") has no child '" << segment << "'";
      out << (names.empty() ? std::string("; it has no children")
                            : "; its children: " + join_names(names, 16));
      return out.str();
    }
    reached += (reached.empty() ? "" : ".") + (segment == "*" ? std::string("0") : segment);
    current = next;
  }
  return "it names '" + reached + "'";
}

/// The modules `entry` names, validated: one `*` at most, standing for a whole segment whose
/// prefix is a module list.
std::vector<std::pair<std::string, nn::Module*>> match_entry(
    nn::Module& model, const PlanEntry& entry,
    const std::vector<std::pair<std::string, nn::Module*>>& modules) {
  const std::string& key = entry.pattern;
  const auto stars = std::count(key.begin(), key.end(), '*');
  TORCH_CHECK(stars <= 1, "tp_plan key '", key, "' has ", stars,
              " '*': at most one is allowed, standing for the index in one module list "
              "(e.g. 'transformer_blocks.*.attn.to_q')");
  const std::vector<std::string> segments = split_path(key);
  size_t star_at = segments.size();
  for (size_t i = 0; i < segments.size(); ++i) {
    if (segments[i].find('*') == std::string::npos) continue;
    TORCH_CHECK(segments[i] == "*", "tp_plan key '", key, "': '*' must stand for a whole path segment (the ",
                "index in a module list), got segment '", segments[i], "'");
    star_at = i;
  }
  if (star_at < segments.size()) {
    const std::string prefix = join_path(segments, star_at);
    nn::Module* container = model.find_module(prefix);
    TORCH_CHECK(
        container != nullptr, "tp_plan key '", key, "' matches no module: ",
        explain_no_match(model, std::vector<std::string>(segments.begin(), segments.begin() + star_at)));
    TORCH_CHECK(dynamic_cast<nn::ModuleListBase*>(container) != nullptr, "tp_plan key '", key,
                "': '*' must stand for the index in a module list, but '",
                prefix.empty() ? "<model>" : prefix, "' is a ", container->type_name(),
                ", not a module list");
  }

  std::vector<std::pair<std::string, nn::Module*>> matches;
  for (const auto& [name, module] : modules) {
    const std::vector<std::string> parts = split_path(name);
    if (parts.size() != segments.size()) continue;
    bool same = true;
    for (size_t i = 0; i < parts.size() && same; ++i) same = segments[i] == "*" || segments[i] == parts[i];
    if (same) matches.emplace_back(name, module);
  }
  TORCH_CHECK(!matches.empty(), "tp_plan key '", key, "' matches no module of ", model.type_name(), ": ",
              explain_no_match(model, segments));
  return matches;
}

/// Absolute block sizes of `size` for a packed entry, from its proportions or the layer's
/// declared blocks.
std::vector<int64_t> packed_blocks(const PlanEntry& entry, const std::string& path, const nn::Linear& linear,
                                   int64_t size, bool output_side) {
  const char* side = output_side ? "out_blocks" : "in_blocks";
  const std::string tensor = path + ".weight";
  if (!entry.blocks.empty()) {
    int64_t total = 0;
    for (const int64_t proportion : entry.blocks) {
      TORCH_CHECK(proportion > 0, "tp_plan key '", entry.pattern,
                  "': block proportions must be positive, got ", c10::IntArrayRef(entry.blocks));
      total += proportion;
    }
    TORCH_CHECK(size % total == 0, "tp_plan key '", entry.pattern, "': block proportions ",
                c10::IntArrayRef(entry.blocks), " (sum ", total, ") do not divide dim ", output_side ? 0 : 1,
                " of '", tensor, "' (size ", size, "); give proportions whose sum divides ", size,
                ", or leave them empty and declare LinearOptions::", side, " on the layer");
    std::vector<int64_t> blocks;
    for (const int64_t proportion : entry.blocks) blocks.push_back(proportion * (size / total));
    return blocks;
  }
  const std::vector<int64_t>& declared =
      output_side ? linear.options().out_blocks : linear.options().in_blocks;
  TORCH_CHECK(!declared.empty(), "tp_plan key '", entry.pattern, "' (", shard_style_name(entry.style),
              ") gives no blocks and the layer '", path, "' declares no ", side,
              ": give the block proportions in the plan entry or declare LinearOptions::", side);
  const int64_t total = std::accumulate(declared.begin(), declared.end(), int64_t{0});
  TORCH_CHECK(total == size, "tp_plan key '", entry.pattern, "': the layer '", path, "' declares ", side, " ",
              c10::IntArrayRef(declared), " (sum ", total, ") but '", tensor, "' dim ", output_side ? 0 : 1,
              " has size ", size);
  return declared;
}

/// Fills the split dimension and blocks of a matched Embedding: Rowwise splits the vocabulary
/// (any degree), Colwise and ColwiseGather the embedding dimension.
void lay_out_embedding(LayerMatch& layer) {
  const PlanEntry& entry = *layer.entry;
  const at::Tensor& weight = layer.embedding->weight;
  TORCH_CHECK(entry.blocks.empty(), "tp_plan key '", entry.pattern, "': blocks ", c10::IntArrayRef(entry.blocks),
              " are given for the Embedding '", layer.path, "'; embeddings take no blocks");
  switch (entry.style) {
    case ShardStyle::Rowwise:
      layer.weight_dim = 0;
      layer.blocks = {weight.size(0)};
      layer.uneven = true;
      return;
    case ShardStyle::Colwise:
    case ShardStyle::ColwiseGather:
      layer.weight_dim = 1;
      layer.blocks = {weight.size(1)};
      return;
    case ShardStyle::PackedColwise:
    case ShardStyle::PackedRowwise:
      break;
  }
  TORCH_CHECK(false, "tp_plan key '", entry.pattern, "' puts ", shard_style_name(entry.style),
              " on the Embedding '", layer.path,
              "'; embeddings take Rowwise (vocabulary split), Colwise or ColwiseGather (embedding dim split)");
}

/// Fills the split dimension and blocks of a matched layer.
void lay_out(LayerMatch& layer) {
  if (layer.embedding) {
    lay_out_embedding(layer);
    return;
  }
  const PlanEntry& entry = *layer.entry;
  const nn::Linear& linear = *layer.linear;
  const int64_t out = linear.weight.size(0);
  const int64_t in = linear.weight.size(1);
  const bool packed = entry.style == ShardStyle::PackedColwise || entry.style == ShardStyle::PackedRowwise;
  TORCH_CHECK(entry.blocks.empty() || packed || entry.style == ShardStyle::ColwiseGather, "tp_plan key '",
              entry.pattern, "': blocks ", c10::IntArrayRef(entry.blocks), " are given for the ",
              shard_style_name(entry.style),
              " style; only PackedColwise, PackedRowwise and ColwiseGather take blocks");
  switch (entry.style) {
    case ShardStyle::Colwise:
      layer.weight_dim = 0;
      layer.blocks = {out};
      layer.bias_sharded = true;
      break;
    case ShardStyle::Rowwise:
      layer.weight_dim = 1;
      layer.blocks = {in};
      break;
    case ShardStyle::PackedColwise:
      layer.weight_dim = 0;
      layer.blocks = packed_blocks(entry, layer.path, linear, out, true);
      layer.bias_sharded = true;
      break;
    case ShardStyle::PackedRowwise:
      layer.weight_dim = 1;
      layer.blocks = packed_blocks(entry, layer.path, linear, in, false);
      break;
    case ShardStyle::ColwiseGather:
      // Contiguous ranges unless the entry packs the output: the gather restores the order.
      layer.weight_dim = 0;
      layer.blocks = entry.blocks.empty() ? std::vector<int64_t>{out}
                                          : packed_blocks(entry, layer.path, linear, out, true);
      layer.bias_sharded = true;
      break;
  }
}

/// Contiguous ranges of ceil(size / degree) rows; the last ranks may hold fewer (or none).
std::vector<std::vector<io::Range>> uneven_ranges(int64_t size, int tp_degree) {
  const int64_t piece = (size + tp_degree - 1) / tp_degree;
  std::vector<std::vector<io::Range>> per_rank(tp_degree);
  for (int r = 0; r < tp_degree; ++r) {
    const int64_t begin = std::min(size, r * piece);
    per_rank[r].push_back({begin, std::min(size, begin + piece)});
  }
  return per_rank;
}

/// Head-replicated ranges: `heads` blocks of size / heads; rank r holds block r / (degree / heads).
std::vector<std::vector<io::Range>> replicated_head_ranges(int64_t size, int64_t heads, int tp_degree) {
  const int64_t block = size / heads;
  const int64_t replicas = tp_degree / heads;
  std::vector<std::vector<io::Range>> per_rank(tp_degree);
  for (int r = 0; r < tp_degree; ++r) {
    const int64_t head = r / replicas;
    per_rank[r].push_back({head * block, (head + 1) * block});
  }
  return per_rank;
}

std::vector<std::vector<io::Range>> ranges_for(const std::vector<int64_t>& blocks, int tp_degree) {
  std::vector<std::vector<io::Range>> per_rank(tp_degree);
  int64_t offset = 0;
  for (const int64_t block : blocks) {
    const int64_t piece = block / tp_degree;
    for (int r = 0; r < tp_degree; ++r) per_rank[r].push_back({offset + r * piece, offset + (r + 1) * piece});
    offset += block;
  }
  return per_rank;
}

std::string working_degrees(const std::vector<Constraint>& constraints) {
  std::string out;
  for (int d = 1; d <= kMaxSuggestedDegree; ++d) {
    const bool ok = std::all_of(constraints.begin(), constraints.end(),
                                [d](const Constraint& c) { return c.accepts(d); });
    if (ok) out += (out.empty() ? "" : ", ") + std::to_string(d);
  }
  return out;
}

// 1. Matches every key; each module gets at most one style.
std::vector<LayerMatch> match_layers(nn::Module& model, const TpPlan& plan) {
  const auto modules = model.named_modules();
  std::vector<LayerMatch> layers;
  std::map<nn::Module*, std::string> claimed;  // module -> key that matched it
  for (const PlanEntry& entry : plan) {
    for (const auto& [path, module] : match_entry(model, entry, modules)) {
      auto* linear = dynamic_cast<nn::Linear*>(module);
      auto* embedding = dynamic_cast<nn::Embedding*>(module);
      TORCH_CHECK(linear != nullptr || embedding != nullptr, "tp_plan key '", entry.pattern, "' puts a ",
                  shard_style_name(entry.style), " style on module '", path, "', a ", module->type_name(),
                  " without a weight to split: styles apply to Linear and Embedding layers only (remove the "
                  "key, or name the layer inside it)");
      const auto [it, inserted] = claimed.emplace(module, entry.pattern);
      TORCH_CHECK(inserted, "tp_plan keys '", it->second, "' and '", entry.pattern, "' both match module '",
                  path, "': each module may have one style");
      const bool already_parallel = linear ? linear->parallel_mode() != nn::LinearParallel::None
                                           : embedding->parallel_mode() != nn::EmbeddingParallel::None;
      TORCH_CHECK(!already_parallel, "tp_plan key '", entry.pattern, "': module '", path,
                  "' is already parallel; a model can be sharded once");
      LayerMatch match;
      match.path = path;
      match.module = module;
      match.linear = linear;
      match.embedding = embedding;
      match.entry = &entry;
      TORCH_CHECK(match.weight().dim() == 2, "tp_plan key '", entry.pattern, "': '", path, ".weight' has shape ",
                  match.weight().sizes(), ", expected 2 dimensions");
      layers.push_back(std::move(match));
    }
  }
  return layers;
}

// 2. Lays out each matched layer and collects every size the degree must divide.
std::vector<Constraint> lay_out_layers(std::vector<LayerMatch>& layers, const TpPlan& plan, const ModelTraits& traits) {
  // The model's own constraints (head counts) come first: they explain a failure best.
  std::vector<Constraint> constraints;
  for (const TpDivisor& divisor : traits.divisors) {
    constraints.push_back({divisor.value, "", divisor.what + " = " + std::to_string(divisor.value)});
  }
  std::map<std::string, const ReplicableHeads*> replicable;  // plan key -> rule
  for (const ReplicableHeads& rule : traits.replicable_heads) {
    TORCH_CHECK(rule.heads >= 1, "replicable heads '", rule.what, "': the head count must be >= 1, got ", rule.heads);
    constraints.push_back({rule.heads, "",
                           rule.what + " = " + std::to_string(rule.heads) + " (or a multiple of it: heads replicated)",
                           /*replicable=*/true});
    for (const std::string& key : rule.plan_keys) {
      const bool in_plan = std::any_of(plan.begin(), plan.end(), [&](const PlanEntry& e) { return e.pattern == key; });
      TORCH_CHECK(in_plan, "replicable heads '", rule.what, "' name the plan key '", key,
                  "', which is not in the tp_plan");
      replicable[key] = &rule;
    }
  }
  for (LayerMatch& layer : layers) {
    lay_out(layer);
    if (layer.uneven) continue;  // any degree works
    const auto rule = replicable.find(layer.entry->pattern);
    if (rule != replicable.end()) {
      TORCH_CHECK(layer.linear != nullptr && layer.entry->style == ShardStyle::Colwise, "tp_plan key '",
                  layer.entry->pattern, "' is listed with replicable heads ('", rule->second->what,
                  "'), so it must put Colwise on a Linear; it puts ", shard_style_name(layer.entry->style), " on a ",
                  layer.module->type_name());
      const int64_t out = layer.weight().size(0);
      TORCH_CHECK(out % rule->second->heads == 0, "tp_plan key '", layer.entry->pattern, "': '", layer.path,
                  ".weight' has ", out, " output rows, not a multiple of ", rule->second->what, " = ",
                  rule->second->heads);
      // The head rule above decides the degree; whole heads split or replicate.
      layer.replicable_heads = rule->second->heads;
      continue;
    }
    const at::Tensor& weight = layer.weight();
    const std::string tensor = layer.path + ".weight";
    const int64_t full = weight.size(layer.weight_dim);
    for (size_t b = 0; b < layer.blocks.size(); ++b) {
      std::ostringstream what;
      what << "tensor '" << tensor << "' " << weight.sizes() << " dim " << layer.weight_dim;
      if (layer.blocks.size() > 1) {
        what << " block " << b << " of " << layer.blocks.size() << " " << c10::IntArrayRef(layer.blocks)
             << " has size " << layer.blocks[b];
      } else {
        what << " has size " << full;
      }
      constraints.push_back({layer.blocks[b], layer.entry->pattern, what.str()});
    }
  }
  return constraints;
}

// 3. Validates the degree against all of them before anything moves.
void check_degree(const std::vector<Constraint>& constraints, int tp_degree) {
  for (const Constraint& c : constraints) {
    if (c.accepts(tp_degree)) continue;
    TORCH_CHECK(false, c.plan_key.empty() ? std::string() : "tp_plan key '" + c.plan_key + "': ", c.what,
                ", which does not divide by tp_degree ", tp_degree, "; degrees that would work (up to ",
                kMaxSuggestedDegree, "): ", working_degrees(constraints));
  }
}

// 4. A spec for every state tensor, in model order.
ResolvedPlan shard_specs(nn::Module& model, const std::vector<LayerMatch>& layers, int tp_degree,
                         const ModelTraits& traits, at::ScalarType dtype, nn::WeightsDtype weights, bool quantize_kept) {
  std::map<nn::Module*, const LayerMatch*> layer_of;
  for (const LayerMatch& layer : layers) layer_of[layer.module] = &layer;
  ResolvedPlan resolved;
  resolved.tp_degree = tp_degree;
  resolved.dtype = dtype;
  for (const auto& slot : model.named_states()) {
    ShardSpec spec;
    spec.parameter = slot.name;
    spec.full_shape = slot.tensor->sizes().vec();
    spec.is_buffer = slot.is_buffer;
    spec.is_floating = slot.tensor->is_floating_point();
    spec.element_size = slot.tensor->is_floating_point()
                            ? loaded_element_size(slot.name, dtype, traits)
                            : static_cast<int64_t>(slot.tensor->element_size());
    if (linear_of_weight(slot) != nullptr &&
        (quantizes_on_load(slot.name, weights, traits, quantize_kept) ||
         linear_of_weight(slot)->weight_format() != nn::WeightFormat::Dense)) {
      spec.quantized = true;
      spec.element_size = 1;
    }
    const auto found = slot.is_buffer ? layer_of.end() : layer_of.find(slot.owner);
    if (found != layer_of.end()) {
      const LayerMatch& layer = *found->second;
      spec.plan_key = layer.entry->pattern;
      const bool is_weight = slot.tensor == &layer.weight();
      if (is_weight || layer.bias_sharded) {
        spec.style = layer.entry->style;
        spec.dim = is_weight ? layer.weight_dim : 0;
        if (layer.uneven) {
          spec.ranges_per_rank = uneven_ranges(layer.blocks[0], tp_degree);
        } else if (layer.replicable_heads > 0 && tp_degree > layer.replicable_heads) {
          spec.ranges_per_rank = replicated_head_ranges(layer.blocks[0], layer.replicable_heads, tp_degree);
          spec.replicas = tp_degree / layer.replicable_heads;
        } else {
          spec.ranges_per_rank = ranges_for(layer.blocks, tp_degree);
        }
      }
    }
    resolved.parameters.push_back(std::move(spec));
  }
  return resolved;
}

nn::LinearParallel linear_mode(ShardStyle style) {
  switch (style) {
    case ShardStyle::Colwise:
    case ShardStyle::PackedColwise: return nn::LinearParallel::Colwise;
    case ShardStyle::Rowwise:
    case ShardStyle::PackedRowwise: return nn::LinearParallel::Rowwise;
    case ShardStyle::ColwiseGather: return nn::LinearParallel::ColwiseGather;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ShardStyle");
}

nn::EmbeddingParallel embedding_mode(ShardStyle style) {
  switch (style) {
    case ShardStyle::Rowwise: return nn::EmbeddingParallel::VocabParallel;
    case ShardStyle::Colwise: return nn::EmbeddingParallel::Colwise;
    case ShardStyle::ColwiseGather: return nn::EmbeddingParallel::ColwiseGather;
    case ShardStyle::PackedColwise:
    case ShardStyle::PackedRowwise: break;
  }
  TORCH_INTERNAL_ASSERT(false, "packed styles do not apply to embeddings");
}

}  // namespace

std::string join_names(const std::vector<std::string>& names, size_t limit) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < limit; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > limit) out += ", ... (" + std::to_string(names.size() - limit) + " more)";
  return out;
}

int64_t loaded_element_size(const std::string& name, at::ScalarType dtype, const ModelTraits& traits) {
  return static_cast<int64_t>(
      c10::elementSize(nn::keeps_fp32(name, traits.keep_in_fp32_modules) ? at::kFloat : dtype));
}

nn::Linear* linear_of_weight(const nn::Module::TensorSlot& slot) {
  auto* linear = dynamic_cast<nn::Linear*>(slot.owner);
  return linear != nullptr && slot.tensor == &linear->weight && !slot.is_buffer ? linear : nullptr;
}

Resolution resolve_with_layers(nn::Module& model, const TpPlan& plan, int tp_degree, const ModelTraits& traits,
                               at::ScalarType dtype, nn::WeightsDtype weights, bool quantize_kept) {
  TORCH_CHECK(tp_degree >= 1, "tensor parallel: tp_degree must be >= 1, got ", tp_degree);
  Resolution result;
  result.layers = match_layers(model, plan);
  check_degree(lay_out_layers(result.layers, plan, traits), tp_degree);
  result.plan = shard_specs(model, result.layers, tp_degree, traits, dtype, weights, quantize_kept);
  return result;
}

void set_parallel_modes(const std::vector<LayerMatch>& layers, const std::shared_ptr<dist::Group>& group) {
  const int rank = group->rank();
  for (const LayerMatch& layer : layers) {
    if (layer.embedding) {
      const int64_t vocab_begin = layer.uneven ? uneven_ranges(layer.blocks[0], group->size())[rank][0].begin : 0;
      layer.embedding->set_parallel(embedding_mode(layer.entry->style), group, vocab_begin);
      continue;
    }
    const nn::LinearParallel mode = linear_mode(layer.entry->style);
    const bool packed_gather = mode == nn::LinearParallel::ColwiseGather && layer.blocks.size() > 1;
    layer.linear->set_parallel(mode, group, packed_gather ? layer.blocks : std::vector<int64_t>{});
  }
}

// ---------------------------------------------------------------------------------------------
// ShardSpec, ResolvedPlan

std::vector<int64_t> ShardSpec::local_shape(int tp_rank) const {
  std::vector<int64_t> shape = full_shape;
  if (!is_sharded()) return shape;
  TORCH_CHECK(tp_rank >= 0 && tp_rank < static_cast<int>(ranges_per_rank.size()), "ShardSpec '", parameter,
              "': tp_rank ", tp_rank, " out of range [0, ", ranges_per_rank.size(), ")");
  int64_t size = 0;
  for (const io::Range& range : ranges_per_rank[tp_rank]) size += range.size();
  shape[dim] = size;
  return shape;
}

int64_t ShardSpec::full_bytes() const { return c10::multiply_integers(full_shape) / block_elements * element_size; }

int64_t ShardSpec::bytes_on_rank(int tp_rank) const {
  return c10::multiply_integers(local_shape(tp_rank)) / block_elements * element_size;
}

void ShardSpec::count_as_gguf_blocks(io::GgmlType type) {
  const io::GgmlBlock block = io::ggml_block(type);
  quantized = true;
  block_elements = block.block_size;
  element_size = block.type_size;
}

int64_t ResolvedPlan::replicated_bytes() const {
  int64_t total = 0;
  for (const ShardSpec& spec : parameters) {
    if (!spec.is_sharded()) total += spec.full_bytes();
  }
  return total;
}

int64_t ResolvedPlan::sharded_bytes() const {
  int64_t total = 0;
  for (const ShardSpec& spec : parameters) {
    if (spec.is_sharded()) total += spec.full_bytes();
  }
  return total;
}

int64_t ResolvedPlan::head_replica_bytes() const {
  int64_t total = 0;
  for (const ShardSpec& spec : parameters) {
    if (spec.is_sharded()) total += spec.full_bytes() * (spec.replicas - 1);
  }
  return total;
}

int64_t ResolvedPlan::bytes_on_rank(int tp_rank) const {
  TORCH_CHECK(tp_rank >= 0 && tp_rank < tp_degree, "bytes_on_rank: tp_rank ", tp_rank, " out of range [0, ",
              tp_degree, ")");
  int64_t total = 0;
  for (const ShardSpec& spec : parameters) total += spec.bytes_on_rank(tp_rank);
  return total;
}

int64_t ResolvedPlan::total_elements() const {
  int64_t total = 0;
  for (const ShardSpec& spec : parameters) total += c10::multiply_integers(spec.full_shape);
  return total;
}

int64_t ResolvedPlan::layers_with_style(std::initializer_list<ShardStyle> styles) const {
  if (tp_degree <= 1) return 0;
  const std::string suffix = ".weight";
  int64_t layers = 0;
  for (const ShardSpec& spec : parameters) {
    const bool weight = spec.parameter.size() > suffix.size() &&
                        spec.parameter.compare(spec.parameter.size() - suffix.size(), suffix.size(), suffix) == 0;
    if (weight && spec.style && std::find(styles.begin(), styles.end(), *spec.style) != styles.end()) ++layers;
  }
  return layers;
}

const ShardSpec& ResolvedPlan::spec(const std::string& parameter) const {
  for (const ShardSpec& spec : parameters) {
    if (spec.parameter == parameter) return spec;
  }
  TORCH_CHECK(false, "ResolvedPlan: no parameter named '", parameter, "'");
}

std::string ResolvedPlan::to_table() const {
  struct Row {
    std::string name, style, full, local, bytes;
  };
  std::vector<Row> rows{{"parameter", "style", "full shape", "per-rank shape", "bytes/rank"}};
  for (const ShardSpec& spec : parameters) {
    std::string style = spec.style ? shard_style_name(*spec.style) : "replicated";
    if (spec.is_sharded()) {
      style += " (dim " + std::to_string(spec.dim) +
               (spec.replicas > 1 ? ", heads on " + std::to_string(spec.replicas) + " ranks each" : std::string()) + ")";
    }
    const auto local = spec.local_shape(0);
    rows.push_back({spec.parameter, style, c10::str(c10::IntArrayRef(spec.full_shape)),
                    c10::str(c10::IntArrayRef(local)), std::to_string(spec.bytes_on_rank(0))});
  }
  size_t widths[4] = {0, 0, 0, 0};
  for (const Row& row : rows) {
    widths[0] = std::max(widths[0], row.name.size());
    widths[1] = std::max(widths[1], row.style.size());
    widths[2] = std::max(widths[2], row.full.size());
    widths[3] = std::max(widths[3], row.local.size());
  }
  std::ostringstream out;
  out << "tensor-parallel plan at tp_degree " << tp_degree << " (" << c10::toString(dtype) << ")\n";
  for (const Row& row : rows) {
    out << std::left << std::setw(static_cast<int>(widths[0]) + 2) << row.name
        << std::setw(static_cast<int>(widths[1]) + 2) << row.style
        << std::setw(static_cast<int>(widths[2]) + 2) << row.full
        << std::setw(static_cast<int>(widths[3]) + 2) << row.local << std::right << row.bytes << "\n";
  }
  const int64_t replicated = replicated_bytes();
  const int64_t sharded = sharded_bytes();
  const int64_t per_rank = bytes_on_rank(0);
  out << "replicated: " << replicated << " bytes (" << human_bytes(replicated) << ") on every rank\n";
  const int64_t head_replicas = head_replica_bytes();
  if (head_replicas == 0) {
    out << "sharded:    " << sharded << " bytes (" << human_bytes(sharded) << ") / " << tp_degree << " = "
        << sharded / tp_degree << " bytes per rank\n";
  } else {
    out << "sharded:    " << sharded << " bytes (" << human_bytes(sharded) << ") + " << head_replicas
        << " bytes of replicated key/value heads, / " << tp_degree << " = " << (sharded + head_replicas) / tp_degree
        << " bytes per rank\n";
  }
  out << "per rank:   " << per_rank << " bytes (" << human_bytes(per_rank) << ") of " << replicated + sharded
      << " bytes (" << human_bytes(replicated + sharded) << ") in all\n";
  return out.str();
}

at::Tensor shard_tensor(const at::Tensor& full, const ShardSpec& spec, int tp_rank) {
  TORCH_CHECK(full.sizes().vec() == spec.full_shape, "shard_tensor: tensor '", spec.parameter, "' has shape ",
              full.sizes(), ", expected the full shape ", c10::IntArrayRef(spec.full_shape));
  if (!spec.is_sharded()) return full.clone(at::MemoryFormat::Contiguous);
  TORCH_CHECK(tp_rank >= 0 && tp_rank < static_cast<int>(spec.ranges_per_rank.size()), "shard_tensor: '",
              spec.parameter, "': tp_rank ", tp_rank, " out of range [0, ", spec.ranges_per_rank.size(), ")");
  const auto& ranges = spec.ranges_per_rank[tp_rank];
  if (ranges.size() == 1) {
    return full.narrow(spec.dim, ranges[0].begin, ranges[0].size()).clone(at::MemoryFormat::Contiguous);
  }
  std::vector<at::Tensor> pieces;
  pieces.reserve(ranges.size());
  for (const io::Range& range : ranges) pieces.push_back(full.narrow(spec.dim, range.begin, range.size()));
  return at::cat(pieces, spec.dim);  // a fresh contiguous tensor
}

at::Tensor row_scales_for_rank(const at::Tensor& full, const ShardSpec& spec, int tp_rank) {
  if (spec.dim != 0) return full.clone();
  std::vector<at::Tensor> pieces;
  for (const io::Range& range : spec.ranges_per_rank[tp_rank]) pieces.push_back(full.narrow(0, range.begin, range.size()));
  return at::cat(pieces, 0);
}

bool quantizes_on_load(const std::string& parameter, nn::WeightsDtype weights, const ModelTraits& traits,
                       bool quantize_kept) {
  return nn::quantizes_on_load(parameter, weights, traits.keep_in_fp32_modules, traits.keep_high_precision,
                               quantize_kept);
}

}  // namespace shardit::parallel

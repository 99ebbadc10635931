#include "shardit/parallel/tensor_parallel.h"

#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <fnmatch.h>

#include <algorithm>
#include <iomanip>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <utility>

#include "shardit/core/units.h"
#include "shardit/dist/mesh.h"
#include "shardit/dist/world.h"
#include "shardit/nn/embedding.h"
#include "shardit/nn/linear.h"

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

std::string join_names(const std::vector<std::string>& names, size_t limit) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < limit; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > limit) out += ", ... (" + std::to_string(names.size() - limit) + " more)";
  return out;
}

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

/// A size the TP degree must divide, with what to say when it does not.
struct Constraint {
  int64_t size;
  std::string plan_key;
  std::string what;
  /// A head count that a degree may also be a multiple of (its heads are then replicated).
  bool replicable = false;

  bool accepts(int64_t degree) const { return size % degree == 0 || (replicable && degree % size == 0); }
};

struct Resolution {
  ResolvedPlan plan;
  std::vector<LayerMatch> layers;
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

/// Bytes per element of a state tensor loaded in `dtype`: keep-in-fp32 tensors stay fp32.
int64_t loaded_element_size(const std::string& name, at::ScalarType dtype, const ModelTraits& traits) {
  return static_cast<int64_t>(
      c10::elementSize(nn::keeps_fp32(name, traits.keep_in_fp32_modules) ? at::kFloat : dtype));
}

/// The Linear whose weight `slot` is; null for any other tensor.
nn::Linear* linear_of_weight(const nn::Module::TensorSlot& slot) {
  auto* linear = dynamic_cast<nn::Linear*>(slot.owner);
  return linear != nullptr && slot.tensor == &linear->weight && !slot.is_buffer ? linear : nullptr;
}

Resolution resolve(nn::Module& model, const TpPlan& plan, int tp_degree, const ModelTraits& traits,
                   at::ScalarType dtype, nn::WeightsDtype weights = nn::WeightsDtype::Checkpoint,
                   bool quantize_kept = false) {
  TORCH_CHECK(tp_degree >= 1, "tensor parallel: tp_degree must be >= 1, got ", tp_degree);
  const auto modules = model.named_modules();

  // 1. Match every key; each module gets at most one style.
  Resolution result;
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
      result.layers.push_back(std::move(match));
    }
  }

  // 2. Lay out each matched layer and collect every size the degree must divide.
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
  for (LayerMatch& layer : result.layers) {
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

  // 3. Validate the degree against all of them before anything moves.
  for (const Constraint& c : constraints) {
    if (c.accepts(tp_degree)) continue;
    TORCH_CHECK(false, c.plan_key.empty() ? std::string() : "tp_plan key '" + c.plan_key + "': ", c.what,
                ", which does not divide by tp_degree ", tp_degree, "; degrees that would work (up to ",
                kMaxSuggestedDegree, "): ", working_degrees(constraints));
  }

  // 4. A spec for every state tensor, in model order.
  std::map<nn::Module*, const LayerMatch*> layer_of;
  for (const LayerMatch& layer : result.layers) layer_of[layer.module] = &layer;
  ResolvedPlan& resolved = result.plan;
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
  return result;
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

}  // namespace

// ---------------------------------------------------------------------------------------------
// TensorParallelConfig

TensorParallelConfig::TensorParallelConfig(std::shared_ptr<dist::Group> group) : group(std::move(group)) {
  TORCH_CHECK(this->group != nullptr,
              "TensorParallelConfig: the group is null (is this rank outside the group?)");
}

TensorParallelConfig::TensorParallelConfig(const dist::DeviceMesh& mesh, const std::string& dim)
    : TensorParallelConfig(mesh.group(dim)) {
  this->mesh = std::make_shared<const dist::DeviceMesh>(mesh);
  mesh_dim = dim;
}

TensorParallelConfig TensorParallelConfig::from_degree(dist::World& world, int tp_degree) {
  TORCH_CHECK(tp_degree >= 1 && tp_degree <= world.size() && world.size() % tp_degree == 0, "tp_degree ",
              tp_degree, " does not divide the world size ", world.size(),
              ": choose a degree that divides it (each group of tp_degree ranks holds one sharded copy), or "
              "launch a multiple of ", tp_degree, " ranks");
  if (tp_degree == world.size()) {
    return TensorParallelConfig(dist::DeviceMesh(world, {{"tp", tp_degree}}), "tp");
  }
  return TensorParallelConfig(dist::DeviceMesh(world, {{"replica", world.size() / tp_degree}, {"tp", tp_degree}}),
                              "tp");
}

int TensorParallelConfig::tp_degree() const { return group->size(); }
int TensorParallelConfig::tp_rank() const { return group->rank(); }

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

int64_t ShardSpec::full_bytes() const { return c10::multiply_integers(full_shape) * element_size; }

int64_t ShardSpec::bytes_on_rank(int tp_rank) const {
  return c10::multiply_integers(local_shape(tp_rank)) * element_size;
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

// ---------------------------------------------------------------------------------------------
// Resolving, sharding, loading

ResolvedPlan resolve_plan(nn::Module& model, const TpPlan& plan, int tp_degree, const ModelTraits& traits,
                          at::ScalarType dtype, nn::WeightsDtype weights) {
  return resolve(model, plan, tp_degree, traits, dtype, weights).plan;
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

namespace {

/// This rank's per-output-row scales of a weight laid out by `spec`, from the whole [out] scales:
/// the rows' own when the weight is split by rows (colwise, packed colwise: each block's scales
/// follow the block), all of them when it is split by columns or replicated.
at::Tensor row_scales_for_rank(const at::Tensor& full, const ShardSpec& spec, int tp_rank) {
  if (spec.dim != 0) return full.clone();
  std::vector<at::Tensor> pieces;
  for (const io::Range& range : spec.ranges_per_rank[tp_rank]) pieces.push_back(full.narrow(0, range.begin, range.size()));
  return at::cat(pieces, 0);
}

}  // namespace

ResolvedPlan apply_tensor_parallel(nn::Module& model, const TpPlan& plan, const TensorParallelConfig& config,
                                   const ModelTraits& traits) {
  TORCH_CHECK(config.group != nullptr, "apply_tensor_parallel: the config has no group");
  auto slots = model.named_states();
  for (const auto& slot : slots) {
    TORCH_CHECK(slot.tensor->defined() && !slot.tensor->is_meta(), "apply_tensor_parallel: parameter '",
                slot.name,
                "' is not loaded; load the weights first, or shard while loading (load_weights with "
                "LoadOptions::tensor_parallel)");
  }
  // Byte counts in the dtype the model holds now.
  at::ScalarType dtype = at::kFloat;
  for (const auto& slot : slots) {
    if (!slot.tensor->is_floating_point() || nn::keeps_fp32(slot.name, traits.keep_in_fp32_modules)) continue;
    dtype = slot.tensor->scalar_type();
    break;
  }
  Resolution resolution = resolve(model, plan, config.tp_degree(), traits, dtype);
  TORCH_INTERNAL_ASSERT(slots.size() == resolution.plan.parameters.size());
  const int rank = config.tp_rank();
  for (size_t i = 0; i < slots.size(); ++i) {
    const ShardSpec& spec = resolution.plan.parameters[i];
    TORCH_INTERNAL_ASSERT(spec.parameter == slots[i].name);
    if (!spec.is_sharded()) continue;
    nn::Linear* linear = linear_of_weight(slots[i]);
    if (linear != nullptr && linear->weight_format() != nn::WeightFormat::Dense) {
      // The per-row scales go with the rows: split like dim 0 when the rows are, else whole.
      linear->set_quantized_weight(shard_tensor(linear->weight, spec, rank), linear->weight_format(),
                                   row_scales_for_rank(linear->weight_scale(), spec, rank), linear->weight_dtype());
      continue;
    }
    // Assigning drops the slot's reference to the full tensor, so its memory is released.
    *slots[i].tensor = shard_tensor(*slots[i].tensor, spec, rank);
  }
  set_parallel_modes(resolution.layers, config.group);
  return std::move(resolution.plan);
}

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

/// How one Linear weight is stored once loaded.
struct WeightSource {
  nn::WeightFormat format = nn::WeightFormat::Dense;
  /// The codes are read as stored (an F8 or scaled I8 tensor); otherwise a dense tensor is
  /// quantized while it is read.
  bool stored_quantized = false;
  at::Tensor full_scale;  ///< [out] fp32, the checkpoint's (stored_quantized only)
};

/// Checkpoint names of a weight's scales, tried in this order: compressed-tensors / vLLM's
/// `<module>.weight_scale`, ComfyUI's `<module>.scale_weight`.
const char* const kWeightScaleNames[] = {"weight_scale", "scale_weight"};
/// Activation scales of static FP8 recipes (`input_scale`, ComfyUI's `scale_input`): accepted and
/// unused, since activations stay in the compute dtype.
const char* const kInputScaleNames[] = {"input_scale", "scale_input"};

/// "a.b" for "a.b.weight"; "" for a name without that suffix.
std::string module_of_weight(const std::string& key) {
  const std::string suffix = ".weight";
  if (key.size() <= suffix.size() || key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0) return "";
  return key.substr(0, key.size() - suffix.size());
}

/// The scale `scale_key` of the 8-bit weight `weight_key` ([out, in]), checked and expanded to one
/// per output row ([out] fp32). A per-tensor scale ([] or [1]) applies to every row, so each
/// block of a fused projection gets it too.
at::Tensor read_weight_scale(const io::Checkpoint& checkpoint, const std::string& scale_key,
                             const std::string& weight_key, const std::vector<int64_t>& weight_shape) {
  const io::TensorInfo& info = checkpoint.info(scale_key);
  const std::string& file = checkpoint.file_of(scale_key).path();
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

}  // namespace

bool quantizes_on_load(const std::string& parameter, nn::WeightsDtype weights, const ModelTraits& traits,
                       bool quantize_kept) {
  if (weights == nn::WeightsDtype::Checkpoint || nn::keeps_fp32(parameter, traits.keep_in_fp32_modules)) return false;
  if (quantize_kept) return true;
  const std::string module = module_of_weight(parameter);
  return std::none_of(traits.keep_high_precision.begin(), traits.keep_high_precision.end(),
                      [&](const std::string& glob) { return glob_matches(glob, module); });
}

ResolvedPlan load_weights(nn::Module& model, const io::Checkpoint& checkpoint, const TpPlan& plan,
                          const LoadOptions& options, const ModelTraits& traits) {
  const bool parallel = options.tensor_parallel.has_value();
  TORCH_CHECK(!parallel || options.tensor_parallel->group != nullptr,
              "load_weights: the tensor-parallel config has no group");
  if (options.int8_compute) nn::check_int8_compute(options.weights, options.device);
  Resolution resolution = resolve(model, plan, parallel ? options.tensor_parallel->tp_degree() : 1, traits,
                                  options.dtype, options.weights, options.quantize_kept_layers);
  auto slots = model.named_states();
  TORCH_INTERNAL_ASSERT(slots.size() == resolution.plan.parameters.size());

  // Validate the whole checkpoint against the model before reading anything.
  std::set<std::string> accepted;
  const std::vector<std::string> keys = source_keys(slots, checkpoint, traits, accepted);
  // How each Linear weight is stored: FP8 (and scaled I8) tensors as they are, with their scales;
  // dense ones quantized on load when options.weights asks; the rest dense.
  std::vector<WeightSource> sources(slots.size());
  std::vector<std::string> fp8_without_scale;
  std::string fp8_with_scale;  // one FP8 weight that has a scale, for the message
  for (size_t i = 0; i < slots.size(); ++i) {
    if (keys[i].empty() || linear_of_weight(slots[i]) == nullptr) continue;
    const io::TensorInfo& info = checkpoint.info(keys[i]);
    const std::string module = module_of_weight(keys[i]);
    std::string scale_key;
    for (const char* name : kWeightScaleNames) {
      if (!module.empty() && checkpoint.contains(module + "." + name)) {
        scale_key = module + "." + name;
        break;
      }
    }
    for (const char* name : kInputScaleNames) {
      if (!module.empty() && checkpoint.contains(module + "." + name)) accepted.insert(module + "." + name);
    }
    WeightSource& source = sources[i];
    if (io::st_dtype_is_fp8(info.dtype)) {
      source.format = info.dtype == io::StDtype::F8_E4M3 ? nn::WeightFormat::Fp8E4M3 : nn::WeightFormat::Fp8E5M2;
      source.stored_quantized = true;
    } else if (info.dtype == io::StDtype::I8 && !scale_key.empty()) {
      source.format = nn::WeightFormat::Int8;
      source.stored_quantized = true;
    } else if (resolution.plan.parameters[i].quantized) {
      source.format = options.weights == nn::WeightsDtype::Fp8 ? nn::WeightFormat::Fp8E4M3 : nn::WeightFormat::Int8;
    }
    if (!source.stored_quantized) {
      TORCH_CHECK(scale_key.empty(), checkpoint.file_of(scale_key).path(), ": scale '", scale_key, "' belongs to '",
                  keys[i], "', which is ", io::st_dtype_name(info.dtype), ", not an 8-bit weight; the file mixes ",
                  "formats (remove the scale, or store the weight in F8_E4M3 / I8)");
      continue;
    }
    if (scale_key.empty()) {
      if (source.format != nn::WeightFormat::Int8) fp8_without_scale.push_back(keys[i]);
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
                    sources[i].stored_quantized,
                checkpoint.file_of(keys[i]).path(), ": tensor '", keys[i], "' is ", io::st_dtype_name(info.dtype),
                ", but it is a weight of ", model.type_name(), " and weights are floating point (F32, BF16, F16, "
                "F64, F8_E4M3, F8_E5M2; I8 with a '.weight_scale'); the file is not this model's checkpoint");
    const std::vector<int64_t> declared = slots[i].tensor->sizes().vec();
    if (info.shape != declared) {
      std::ostringstream line;
      line << checkpoint.file_of(keys[i]).path() << ": tensor '" << keys[i] << "' has shape "
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

  const int rank = parallel ? options.tensor_parallel->tp_rank() : 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    const ShardSpec& spec = resolution.plan.parameters[i];
    TORCH_INTERNAL_ASSERT(spec.parameter == slots[i].name);
    const io::TensorInfo& info = checkpoint.info(keys[i]);
    const bool floating = io::st_dtype_is_floating(info.dtype);
    const at::ScalarType target = nn::keeps_fp32(slots[i].name, traits.keep_in_fp32_modules) ? at::kFloat
                                                                                              : options.dtype;
    const WeightSource& source = sources[i];
    if (source.format != nn::WeightFormat::Dense) {
      nn::Linear* linear = linear_of_weight(slots[i]);
      at::Tensor codes;
      at::Tensor scale;
      if (source.stored_quantized) {
        codes = spec.is_sharded() ? checkpoint.read_slices(keys[i], spec.dim, spec.ranges_per_rank[rank])
                                  : checkpoint.read(keys[i]);
        const at::ScalarType code_type = source.format == nn::WeightFormat::Int8 ? at::kChar : at::kByte;
        if (codes.scalar_type() != code_type) codes = codes.view(code_type);  // LibTorch's own float8 type
        TORCH_CHECK(source.format == nn::WeightFormat::Int8 || !has_nonfinite_fp8(codes, info.dtype),
                    checkpoint.file_of(keys[i]).path(), ": FP8 weight '", keys[i], "' holds NaN or Inf codes; "
                    "the checkpoint is corrupt");
        scale = row_scales_for_rank(source.full_scale, spec, rank);
      } else {
        // Quantize on load: this rank's slice in fp32 (exact for F32/BF16/F16), scaled by its
        // whole rows' maxima.
        const at::Tensor value = spec.is_sharded()
                                     ? checkpoint.read_slices(keys[i], spec.dim, spec.ranges_per_rank[rank], at::kFloat)
                                     : checkpoint.read(keys[i], at::kFloat);
        const at::Tensor absmax = spec.dim == 1 ? full_row_absmax(checkpoint, keys[i]) : value.abs().amax(1);
        TORCH_CHECK(at::isfinite(absmax).all().item<bool>(), checkpoint.file_of(keys[i]).path(), ": weight '",
                    keys[i], "' holds NaN or Inf; refusing to quantize it (the checkpoint is corrupt)");
        scale = nn::symmetric_row_scales(absmax, source.format);
        codes = nn::quantize_rows(value, source.format, scale);
      }
      linear->set_quantized_weight(codes.to(options.device), source.format, scale.to(options.device), target);
      if (options.int8_compute && source.format == nn::WeightFormat::Int8) linear->enable_int8_compute();
      resolution.plan.parameters[i].quantized = true;
      resolution.plan.parameters[i].element_size = 1;
      continue;
    }
    const std::optional<at::ScalarType> dtype = floating ? std::optional<at::ScalarType>(target) : std::nullopt;
    const at::Tensor value = spec.is_sharded()
                                 ? checkpoint.read_slices(keys[i], spec.dim, spec.ranges_per_rank[rank], dtype)
                                 : checkpoint.read(keys[i], dtype);
    *slots[i].tensor = value.to(options.device);
  }
  if (parallel) set_parallel_modes(resolution.layers, options.tensor_parallel->group);
  return std::move(resolution.plan);
}

// ---------------------------------------------------------------------------------------------
// TensorParallelModule

const TpPlan& TensorParallelModule::plan(TpPlanKind kind) const {
  if (kind == TpPlanKind::Full) return tp_plan();
  const TpPlan* reference = reference_tp_plan();
  TORCH_CHECK(reference != nullptr, type_name(), ": the reference implementation has no tensor-parallel plan for this ",
              "model; use the 'full' plan");
  return *reference;
}

namespace {

// Every head count the model declares must split into whole heads over tp x ulysses.
void check_context_parallel_divisors(const TensorParallelModule& model, const ContextParallelConfig& config) {
  check_context_parallel_split(model, std::max(model.tp_degree(), config.mesh_tp_degree()), config.ulysses_degree());
}

}  // namespace

void check_context_parallel_split(const TensorParallelModule& model, int tp_degree, int ulysses_degree) {
  for (const TpDivisor& divisor : model.traits().divisors) {
    const std::string& what = divisor.what;
    if (what.size() < 5 || what.compare(what.size() - 5, 5, "heads") != 0) continue;
    check_context_parallel_heads(model.type_name(), what, divisor.value, tp_degree, ulysses_degree);
  }
}

void TensorParallelModule::enable_parallelism(const TensorParallelConfig& config, TpPlanKind kind) {
  resolved_plan_ = apply_tensor_parallel(*this, plan(kind), config, traits());
  resolved_plan_->plan = kind;
  config_ = config;
  if (cp_config_) check_context_parallel_divisors(*this, *cp_config_);
}

void TensorParallelModule::load(const io::Checkpoint& checkpoint, const LoadOptions& options) {
  resolved_plan_ = load_weights(*this, checkpoint, plan(options.plan), options, traits());
  resolved_plan_->plan = options.plan;
  config_ = options.tensor_parallel;
  if (cp_config_) check_context_parallel_divisors(*this, *cp_config_);
}

void TensorParallelModule::enable_context_parallelism(const ContextParallelConfig& config) {
  TORCH_CHECK(cp_plan() != nullptr, type_name(), " has no context-parallel plan (cp_plan); it cannot split its ",
              "sequence over ", config.to_string());
  check_context_parallel_divisors(*this, config);
  cp_config_ = config;
}

ContextParallelForward TensorParallelModule::context_parallel_forward() const {
  if (!cp_config_) return ContextParallelForward();
  return ContextParallelForward(*cp_config_, *cp_plan(), type_name());
}

void TensorParallelModule::to(at::Device device, at::ScalarType dtype) {
  nn::Module::to(device, dtype, traits().keep_in_fp32_modules);
  if (resolved_plan_) {
    // Keep the recorded byte counts true to the new dtype.
    const ModelTraits model_traits = traits();
    resolved_plan_->dtype = dtype;
    for (ShardSpec& spec : resolved_plan_->parameters) {
      if (!spec.is_floating || spec.quantized) continue;  // integer and 8-bit state keep their type
      spec.element_size = loaded_element_size(spec.parameter, dtype, model_traits);
    }
  }
}

void TensorParallelModule::check_loaded(const std::string& where) {
  TORCH_CHECK(is_materialized(), where, ": forward called before the weights were loaded");
}

void TensorParallelModule::agree(at::Tensor& value) const {
  if (!config_ || config_->group->size() == 1) return;
  value = value.contiguous();
  config_->group->broadcast(value, 0);
}

ResolvedPlan TensorParallelModule::resolve(int tp_degree, at::ScalarType dtype, TpPlanKind kind,
                                           nn::WeightsDtype weights) {
  ResolvedPlan resolved = resolve_plan(*this, plan(kind), tp_degree, traits(), dtype, weights);
  resolved.plan = kind;
  return resolved;
}

}  // namespace shardit::parallel

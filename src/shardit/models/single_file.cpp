#include "shardit/models/single_file.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <utility>

namespace shardit::models {

namespace {

/// `name` matched against `pattern`, whose one `*` stands for a block index (digits): the index,
/// "" for a pattern without `*` that equals `name`, nullopt otherwise.
std::optional<std::string> match_index(const std::string& pattern, const std::string& name) {
  const size_t star = pattern.find('*');
  if (star == std::string::npos) return pattern == name ? std::optional<std::string>("") : std::nullopt;
  const std::string head = pattern.substr(0, star);
  const std::string tail = pattern.substr(star + 1);
  if (name.size() <= head.size() + tail.size() || name.compare(0, head.size(), head) != 0 ||
      name.compare(name.size() - tail.size(), tail.size(), tail) != 0) {
    return std::nullopt;
  }
  const std::string index = name.substr(head.size(), name.size() - head.size() - tail.size());
  const bool digits = std::all_of(index.begin(), index.end(), [](char c) { return c >= '0' && c <= '9'; });
  return digits ? std::optional<std::string>(index) : std::nullopt;
}

std::string with_index(const std::string& pattern, const std::string& index) {
  const size_t star = pattern.find('*');
  return star == std::string::npos ? pattern : pattern.substr(0, star) + index + pattern.substr(star + 1);
}

/// "a.b.weight" -> {"a.b", "weight"}.
std::pair<std::string, std::string> split_last(const std::string& name) {
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos) return {"", name};
  return {name.substr(0, dot), name.substr(dot + 1)};
}

/// One use of a rule: block `index`, its targets with their row counts (their weights'), and the
/// file module they are read from.
struct RuleUse {
  const SingleFileRule* rule;
  std::string source_module;
  std::vector<std::string> targets;
};

/// The pieces of target `j` of `use`, for a file tensor of `rows` rows whose targets hold
/// `sizes` rows each.
std::vector<io::TensorPiece> pieces_of(const RuleUse& use, size_t j, const std::string& key, int64_t rows,
                                       const std::vector<int64_t>& sizes, const std::string& file_label,
                                       const std::string& what) {
  int64_t total = 0;
  for (int64_t size : sizes) total += size;
  TORCH_CHECK(total == rows, file_label, ": tensor '", key, "' has ", rows, " rows, but ", what, " expects ", total,
              " (", use.targets.size(), " part(s) of ", c10::IntArrayRef(sizes),
              " rows); check that the file and the model config are the same variant");
  if (use.rule->swapped_halves) {
    TORCH_CHECK(rows % 2 == 0, file_label, ": tensor '", key, "' has an odd number of rows (", rows,
                "); expected its [shift, scale] halves");
    return {{key, io::Range{rows / 2, rows}}, {key, io::Range{0, rows / 2}}};
  }
  if (use.targets.size() == 1) return {{key, std::nullopt}};
  int64_t offset = 0;
  for (size_t i = 0; i < j; ++i) offset += sizes[i];
  return {{key, io::Range{offset, offset + sizes[j]}}};
}

}  // namespace

const SingleFileLayout* detect_single_file_layout(const io::Checkpoint& file,
                                                  const std::vector<SingleFileLayout>& layouts, std::string* prefix) {
  for (const SingleFileLayout& layout : layouts) {
    for (const std::string& candidate : layout.prefixes) {
      const bool all = std::all_of(layout.markers.begin(), layout.markers.end(), [&](const std::string& marker) {
        return file.find_source(candidate + marker) != nullptr;
      });
      if (all && !layout.markers.empty()) {
        if (prefix != nullptr) *prefix = candidate;
        return &layout;
      }
    }
  }
  return nullptr;
}

io::KeyMapping single_file_mapping(const io::Checkpoint& file, const SingleFileLayout& layout,
                                   const std::string& prefix, nn::Module& model) {
  const std::string label = file.path() + " (" + layout.name + " layout)";
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& slot : model.named_states()) {
    if (!slot.is_buffer || slot.persistent) shapes[slot.name] = slot.tensor->sizes().vec();
  }
  const auto rows_of = [&](const std::string& name) {
    const auto it = shapes.find(name);
    TORCH_CHECK(it != shapes.end() && !it->second.empty(), "single-file layout ", layout.name, ": rule target '",
                name, "' is not a tensor of ", model.type_name(), " with rows");
    return it->second[0];
  };

  io::KeyMapping mapping;
  std::set<std::string> consumed;
  std::map<std::string, std::vector<std::string>> missing;  // file key -> the model's names it gives
  std::map<std::string, RuleUse> uses;  // file module -> its rule's use
  for (const auto& [name, shape] : shapes) {
    const auto [module, suffix] = split_last(name);
    const SingleFileRule* rule = nullptr;
    std::string index;
    size_t j = 0;
    for (const SingleFileRule& candidate : layout.rules) {
      for (size_t t = 0; t < candidate.targets.size() && rule == nullptr; ++t) {
        if (const auto found = match_index(candidate.targets[t], module)) {
          rule = &candidate;
          index = *found;
          j = t;
        }
      }
      if (rule != nullptr) break;
    }
    if (rule == nullptr) {
      const std::string key = prefix + name;
      if (file.find_source(key) == nullptr) {
        missing[key].push_back(name);
        continue;
      }
      mapping[name] = {{key, std::nullopt}};
      consumed.insert(key);
      continue;
    }
    RuleUse use{rule, with_index(rule->source, index), {}};
    for (const std::string& target : rule->targets) use.targets.push_back(with_index(target, index));
    const std::string key =
        prefix + use.source_module + "." + (suffix == "weight" ? rule->weight_name : suffix);
    const io::TensorInfo* info = file.find_source(key);
    if (info == nullptr) {
      missing[key].push_back(name);
      continue;
    }
    TORCH_CHECK(!info->shape.empty(), label, ": tensor '", key, "' is a scalar, but ", name, " has shape ",
                c10::IntArrayRef(shape));
    std::vector<int64_t> sizes;
    for (const std::string& target : use.targets) sizes.push_back(rows_of(target + "." + suffix));
    mapping[name] = pieces_of(use, j, key, info->shape[0], sizes, label, model.type_name() + "'s " + name);
    consumed.insert(key);
    uses.emplace(use.source_module, std::move(use));
  }
  if (!missing.empty()) {
    std::ostringstream list;
    constexpr size_t kListed = 12;
    size_t listed = 0;
    for (const auto& [key, names] : missing) {
      if (listed++ == kListed) break;
      list << (listed > 1 ? ", " : "") << "'" << key << "'";
      if (key != prefix + names.front()) {
        list << " (for";
        for (const std::string& each : names) list << " " << each;
        list << ")";
      }
    }
    if (missing.size() > kListed) list << " and " << missing.size() - kListed << " more";
    TORCH_CHECK(false, label, ": ", missing.size(), " tensor(s) that ", model.type_name(), " needs are missing: ",
                list.str(), "; the file is incomplete, or of another variant than the model config");
  }

  // The file's other tensors: those of a split module (the scales of its 8-bit weight) go to every
  // target, per-tensor whole and per-row by the weight's rows; the rest keep their names.
  const std::set<std::string> ignored(layout.ignored.begin(), layout.ignored.end());
  for (const std::string& key : file.source_names()) {
    if (consumed.count(key) != 0) continue;
    const bool prefixed = key.compare(0, prefix.size(), prefix) == 0;
    const std::string name = prefixed ? key.substr(prefix.size()) : key;
    if (prefixed && ignored.count(name) != 0) continue;
    const auto [module, suffix] = split_last(name);
    const auto use = prefixed ? uses.find(module) : uses.end();
    if (use == uses.end()) {
      TORCH_CHECK(mapping.count(name) == 0, label, ": '", key, "' and another tensor both give '", name, "'");
      mapping[name] = {{key, std::nullopt}};
      continue;
    }
    const io::TensorInfo& info = *file.find_source(key);
    const bool per_tensor = info.numel() == 1 && info.shape.size() <= 1;
    for (size_t j = 0; j < use->second.targets.size(); ++j) {
      const std::string target = use->second.targets[j] + "." + suffix;
      if (per_tensor) {
        mapping[target] = {{key, std::nullopt}};
        continue;
      }
      std::vector<int64_t> sizes;
      for (const std::string& each : use->second.targets) sizes.push_back(rows_of(each + ".weight"));
      TORCH_CHECK(!info.shape.empty(), label, ": tensor '", key, "' is empty-shaped");
      mapping[target] = pieces_of(use->second, j, key, info.shape[0], sizes, label, "the per-row tensor " + target);
    }
  }
  return mapping;
}

}  // namespace shardit::models

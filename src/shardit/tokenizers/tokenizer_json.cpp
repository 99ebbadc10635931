#include "shardit/tokenizers/tokenizer_json.h"

#include <c10/util/Exception.h>

#include <cctype>

#include "shardit/tokenizers/tokenizer_config.h"

namespace shardit::tokenizers {

namespace {

// The ByteLevel pre-tokenizer's own split (use_regex=true), GPT-2's pattern.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

using json = nlohmann::json;

const json& member(const json& object, const char* key, const std::string& where) {
  TORCH_CHECK(object.is_object() && object.contains(key), where, ": missing key '", key, "'");
  return object.at(key);
}

std::string type_of(const json& object, const std::string& where) {
  const json& type = member(object, "type", where);
  TORCH_CHECK(type.is_string(), where, ": 'type' is not a string");
  return type.get<std::string>();
}

void parse_normalizer(const json& n, const std::string& where, std::vector<NormalForm>& out) {
  if (n.is_null()) return;
  const std::string type = type_of(n, where);
  if (type == "Sequence") {
    for (const json& item : member(n, "normalizers", where)) parse_normalizer(item, where, out);
  } else if (type == "NFC") {
    out.push_back(NormalForm::NFC);
  } else if (type == "NFD") {
    out.push_back(NormalForm::NFD);
  } else if (type == "NFKC") {
    out.push_back(NormalForm::NFKC);
  } else if (type == "NFKD") {
    out.push_back(NormalForm::NFKD);
  } else {
    TORCH_CHECK(false, where, ": normalizer type '", type, "' is not supported (NFC, NFD, NFKC, NFKD, Sequence)");
  }
}

// A component given alone or as a {"type": "Sequence", <list_key>: [...]}, as a list.
std::vector<json> sequence_items(const json& node, const char* list_key, const std::string& where) {
  if (node.is_null()) return {};
  if (type_of(node, where) != "Sequence") return {node};
  const json& items = member(node, list_key, where);
  TORCH_CHECK(items.is_array(), where, ": '", list_key, "' is not a list");
  return items.get<std::vector<json>>();
}

bool flag(const json& object, const char* key) {
  return object.contains(key) && object.at(key).is_boolean() && object.at(key).get<bool>();
}

// Cuts each piece at the matches of `pattern`, keeping matches and gaps as pieces ("Isolated").
std::vector<std::string> split_isolated(const std::vector<std::string>& pieces, const Regex& pattern) {
  std::vector<std::string> out;
  for (const std::string& piece : pieces) {
    size_t last = 0;
    for (const auto& [begin, end] : pattern.find_all(piece)) {
      if (begin > last) out.push_back(piece.substr(last, begin - last));
      out.push_back(piece.substr(begin, end - begin));
      last = end;
    }
    if (last < piece.size()) out.push_back(piece.substr(last));
  }
  return out;
}

}  // namespace

TokenizerJson TokenizerJson::from_folder(const std::string& folder) {
  const std::string path = require_file(folder, "tokenizer.json", "a BPE tokenizer is read from tokenizer.json");
  const json root = read_tokenizer_json(path);
  TORCH_CHECK(root.is_object(), path, ": expected a JSON object");
  TokenizerJson tok;
  tok.source_ = folder;

  parse_normalizer(root.value("normalizer", json()), path + " normalizer", tok.normalizers_);

  // Pre-tokenizer: Split (Isolated) and ByteLevel steps, alone or in a Sequence.
  for (const json& step : sequence_items(root.value("pre_tokenizer", json()), "pretokenizers", path + " pre_tokenizer")) {
    const std::string where = path + " pre_tokenizer";
    const std::string type = type_of(step, where);
    if (type == "Split") {
      const json& pattern = member(step, "pattern", where);
      TORCH_CHECK(member(step, "behavior", where) == "Isolated" && !flag(step, "invert"), where,
                  ": only Split with behavior 'Isolated' and invert=false is supported, got ", step.dump());
      std::string regex;
      if (pattern.contains("Regex")) {
        regex = pattern.at("Regex").get<std::string>();
      } else {
        // A literal string: every character escaped.
        for (char c : member(pattern, "String", where).get<std::string>()) {
          if (!std::isalnum(static_cast<unsigned char>(c)) && !(static_cast<unsigned char>(c) & 0x80)) regex += '\\';
          regex += c;
        }
      }
      tok.splits_.push_back({Regex(regex, path)});
    } else if (type == "ByteLevel") {
      TORCH_CHECK(!flag(step, "add_prefix_space"), where, ": ByteLevel add_prefix_space=true is not supported");
      if (!step.contains("use_regex") || flag(step, "use_regex")) tok.splits_.push_back({Regex(kGpt2Pattern, path)});
      tok.byte_level_ = true;
    } else {
      TORCH_CHECK(false, where, ": pre-tokenizer type '", type, "' is not supported (Split, ByteLevel, Sequence)");
    }
  }

  const std::string model_where = path + " model";
  const json& model = member(root, "model", path);
  TORCH_CHECK(type_of(model, model_where) == "BPE", model_where, ": only BPE models are supported, got '",
              type_of(model, model_where), "'");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json value = model.value(key, json());
    TORCH_CHECK(value.is_null() || value == "", model_where, ": '", key, "' = ", value.dump(), " is not supported");
  }
  TORCH_CHECK(!flag(model, "byte_fallback"), model_where, ": byte_fallback=true is not supported");
  TORCH_CHECK(model.value("dropout", json()).is_null(), model_where, ": BPE dropout is not supported");
  tok.ignore_merges_ = flag(model, "ignore_merges");
  const json& vocab = member(model, "vocab", model_where);
  TORCH_CHECK(vocab.is_object(), model_where, ": 'vocab' is not an object");
  tok.vocab_.reserve(vocab.size());
  for (const auto& [token, id] : vocab.items()) {
    TORCH_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0, model_where, ": vocab entry '", token,
                "' has id ", id.dump());
    tok.vocab_.emplace(token, id.get<int64_t>());
  }
  const json& merges = member(model, "merges", model_where);
  TORCH_CHECK(merges.is_array(), model_where, ": 'merges' is not an array");
  for (const json& merge : merges) {
    if (merge.is_string()) {
      const std::string line = merge.get<std::string>();
      const size_t space = line.find(' ');
      TORCH_CHECK(space != std::string::npos && space > 0 && space + 1 < line.size(), model_where,
                  ": merge '", line, "' is not 'left right'");
      tok.ranks_.add(line.substr(0, space), line.substr(space + 1));
    } else {
      TORCH_CHECK(merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string(), model_where,
                  ": merge ", merge.dump(), " is neither 'left right' nor [left, right]");
      tok.ranks_.add(merge[0].get<std::string>(), merge[1].get<std::string>());
    }
  }
  const json unk = model.value("unk_token", json());
  if (!unk.is_null()) {
    const auto it = tok.vocab_.find(unk.get<std::string>());
    TORCH_CHECK(it != tok.vocab_.end(), model_where, ": unk_token ", unk.dump(), " is not in the vocabulary");
    tok.unk_id_ = it->second;
  }

  std::vector<AddedToken> raw, normalized;
  for (const json& entry : root.value("added_tokens", json::array())) {
    const json& id = member(entry, "id", path + " added_tokens");
    TORCH_CHECK(id.is_number_integer(), path, ": added token id ", id.dump(), " is not an integer");
    AddedToken token = parse_added_token(entry, id.get<int64_t>(), path);
    tok.added_ids_[token.content] = token.id;
    (token.normalized ? normalized : raw).push_back(std::move(token));
  }
  tok.raw_added_ = AddedTokenMatcher(std::move(raw), is_white_space);
  tok.normalized_added_ = AddedTokenMatcher(std::move(normalized), is_white_space);

  // Post-processor: ByteLevel adds nothing; TemplateProcessing's single template adds its
  // special tokens around $A.
  for (const json& processor : sequence_items(root.value("post_processor", json()), "processors", path + " post_processor")) {
    const std::string where = path + " post_processor";
    const std::string type = type_of(processor, where);
    if (type == "ByteLevel") continue;
    TORCH_CHECK(type == "TemplateProcessing", where, ": post-processor type '", type,
                "' is not supported (ByteLevel, TemplateProcessing, Sequence)");
    bool after_sequence = false;
    for (const json& item : member(processor, "single", where)) {
      if (item.contains("Sequence")) {
        after_sequence = true;
        continue;
      }
      const std::string name = member(member(item, "SpecialToken", where), "id", where).get<std::string>();
      const json& ids = member(member(member(processor, "special_tokens", where), name.c_str(), where), "ids", where);
      for (const json& id : ids) (after_sequence ? tok.suffix_ : tok.prefix_).push_back(id.get<int64_t>());
    }
  }

  const TokenizerConfig config = TokenizerConfig::from_folder(folder);
  if (const auto pad = config.special_token("pad_token")) {
    const int64_t id = tok.token_to_id(*pad);
    TORCH_CHECK(id >= 0, folder, ": pad_token '", *pad, "' is neither an added token nor in the vocabulary");
    tok.pad_id_ = id;
  }
  const std::string side = config.value<std::string>("padding_side", "right");
  TORCH_CHECK(side == "left" || side == "right", folder, "/tokenizer_config.json: padding_side is '", side,
              "'; expected 'left' or 'right'");
  tok.pads_left_ = side == "left";
  return tok;
}

int64_t TokenizerJson::token_to_id(const std::string& token) const {
  if (const auto it = added_ids_.find(token); it != added_ids_.end()) return it->second;
  if (const auto it = vocab_.find(token); it != vocab_.end()) return it->second;
  return -1;
}

int64_t TokenizerJson::num_special_tokens() const { return static_cast<int64_t>(prefix_.size() + suffix_.size()); }

int64_t TokenizerJson::pad_token_id() const {
  TORCH_CHECK(pad_id_.has_value(), source_, ": no pad_token in tokenizer_config.json or special_tokens_map.json, "
              "so the tokenizer cannot pad; add one or call without padding");
  return *pad_id_;
}

std::vector<int64_t> TokenizerJson::add_special_tokens(std::vector<int64_t> ids) const {
  ids.insert(ids.begin(), prefix_.begin(), prefix_.end());
  ids.insert(ids.end(), suffix_.begin(), suffix_.end());
  return ids;
}

void TokenizerJson::encode_pretoken(std::string_view word, std::vector<int64_t>& ids) const {
  const std::string mapped = byte_level_ ? byte_level_encode(word) : std::string(word);
  if (ignore_merges_) {
    if (const auto it = vocab_.find(mapped); it != vocab_.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  for (const std::string& symbol : bpe_merge(split_characters(mapped), ranks_)) {
    if (const auto it = vocab_.find(symbol); it != vocab_.end()) {
      ids.push_back(it->second);
    } else if (unk_id_) {
      // The tokenizers library merges consecutive unknowns only with fuse_unk; one each here.
      ids.push_back(*unk_id_);
    }
  }
}

std::vector<int64_t> TokenizerJson::encode_without_specials(std::string_view raw) const {
  std::vector<int64_t> ids;
  for (const TextPiece& piece : raw_added_.split(valid_utf8(raw))) {
    if (piece.id >= 0) {
      ids.push_back(piece.id);
      continue;
    }
    std::string text = piece.text;
    for (NormalForm form : normalizers_) text = normalize(text, form);
    for (const TextPiece& part : normalized_added_.split(text)) {
      if (part.id >= 0) {
        ids.push_back(part.id);
        continue;
      }
      std::vector<std::string> words{part.text};
      for (const SplitStep& step : splits_) words = split_isolated(words, step.pattern);
      for (const std::string& word : words) encode_pretoken(word, ids);
    }
  }
  return ids;
}

}  // namespace shardit::tokenizers

#include "shardit/tokenizers/cases.h"

#include <c10/util/Exception.h>

#include <sstream>

#include "shardit/tokenizers/prompt_templates.h"

namespace shardit::tokenizers {

namespace {

using json = nlohmann::json;

std::vector<int64_t> id_list(const json& value, const std::string& where) {
  TORCH_CHECK(value.is_array(), where, ": expected a list of ids, got ", value.type_name());
  std::vector<int64_t> ids;
  for (const json& v : value) {
    TORCH_CHECK(v.is_number_integer(), where, ": expected integer ids, got ", v.dump());
    ids.push_back(v.get<int64_t>());
  }
  return ids;
}

class Checker {
 public:
  CasesReport report;

  void ids(const std::string& name, const std::vector<int64_t>& expected, const std::vector<int64_t>& got) {
    CaseCheck check{name, expected == got, ""};
    if (!check.passed) {
      std::ostringstream out;
      size_t i = 0;
      while (i < expected.size() && i < got.size() && expected[i] == got[i]) ++i;
      out << "lengths " << expected.size() << " expected, " << got.size() << " got; first difference at index " << i;
      if (i < expected.size()) out << ": expected " << expected[i];
      if (i < got.size()) out << (i < expected.size() ? ", got " : ": got ") << got[i];
      check.detail = out.str();
    }
    report.checks.push_back(std::move(check));
  }

  void text(const std::string& name, const std::string& expected, const std::string& got) {
    report.checks.push_back({name, expected == got, expected == got ? "" : "rendered text differs: got '" + got + "'"});
  }

  // `ids`, and `input_ids`/`attention_mask` as a padded call of their length.
  void entry(const std::string& where, const json& c, const Tokenizer& tok, bool ids_with_specials) {
    const std::string text = case_text(c, where);
    if (c.contains("ids")) {
      ids(where + ".ids", id_list(c.at("ids"), where + ".ids"),
          ids_with_specials ? tok.encode(text) : tok.encode_without_specials(text));
    }
    if (c.contains("input_ids")) {
      const auto expected = id_list(c.at("input_ids"), where + ".input_ids");
      const Encoding got = tok(text, static_cast<int64_t>(expected.size()), Padding::MaxLength);
      ids(where + ".input_ids", expected, got.input_ids);
      if (c.contains("attention_mask")) {
        ids(where + ".attention_mask", id_list(c.at("attention_mask"), where + ".attention_mask"), got.attention_mask);
      }
    }
  }

  void list(const std::string& where, const json& section, const Tokenizer& tok, bool ids_with_specials) {
    if (!section.contains("cases")) return;
    const json& entries = section.at("cases");
    TORCH_CHECK(entries.is_array(), where, ".cases: expected a list");
    for (size_t i = 0; i < entries.size(); ++i) {
      entry(where + "cases[" + std::to_string(i) + "]", entries[i], tok, ids_with_specials);
    }
  }

  // A pipeline section (qwenimage / flux2_klein / flux2_dev): template text, ids and the
  // pipeline's call.
  void pipeline(const std::string& where, const json& section, const Tokenizer& tok, PromptTemplate tmpl) {
    const json& entries = section.at("cases");
    for (size_t i = 0; i < entries.size(); ++i) {
      const json& c = entries[i];
      const std::string name = where + ".cases[" + std::to_string(i) + "]";
      TORCH_CHECK(c.contains("prompt") && c.at("prompt").is_string(), name, ": no 'prompt'");
      const std::string prompt = c.at("prompt").get<std::string>();
      const std::string rendered = apply_prompt_template(tmpl, prompt);
      if (c.contains("text")) text(name + ".text", case_text(c, name), rendered);
      const Encoding call = pipeline_call(tmpl, tok, {prompt}).front();
      if (c.contains("ids")) {
        // Qwen-Image's ids are its call; FLUX.2 [dev]'s template writes its own BOS.
        ids(name + ".ids", id_list(c.at("ids"), name + ".ids"),
            tmpl == PromptTemplate::QwenImage ? call.input_ids
            : tmpl == PromptTemplate::Flux2Dev ? tok.encode_without_specials(rendered)
                                                : tok.encode(rendered));
      }
      if (c.contains("input_ids")) ids(name + ".input_ids", id_list(c.at("input_ids"), name), call.input_ids);
      if (c.contains("attention_mask")) {
        ids(name + ".attention_mask", id_list(c.at("attention_mask"), name), call.attention_mask);
      }
    }
  }

  static std::vector<Encoding> pipeline_call(PromptTemplate tmpl, const Tokenizer& tok,
                                             const std::vector<std::string>& prompts) {
    switch (tmpl) {
      case PromptTemplate::QwenImage: return encode_qwenimage_prompts(tok, prompts);
      case PromptTemplate::Flux2Klein: return encode_flux2_klein_prompts(tok, prompts);
      case PromptTemplate::Flux2Dev: return encode_flux2_dev_prompts(tok, prompts);
      case PromptTemplate::None: break;
    }
    TORCH_INTERNAL_ASSERT(false, "pipeline_call without a template");
  }

  // FLUX.2 [dev]: the batched call gives each prompt's single-call row; a short max_length keeps
  // the first tokens.
  void flux2_dev_extras(const json& section, const Tokenizer& tok) {
    if (section.contains("batch")) {
      const auto prompts = section.at("batch").at("prompts").get<std::vector<std::string>>();
      const auto rows = encode_flux2_dev_prompts(tok, prompts);
      for (size_t r = 0; r < rows.size(); ++r) {
        const std::string name = "flux2_dev.batch[" + std::to_string(r) + "]";
        // The golden row of the case with this prompt.
        const json* single = nullptr;
        for (const json& c : section.at("cases")) {
          if (c.value("prompt", std::string()) == prompts[r]) single = &c;
        }
        TORCH_CHECK(single != nullptr && single->contains("input_ids"), name, ": no case with the prompt ",
                    json(prompts[r]).dump(), " and its input_ids");
        ids(name + ".input_ids", id_list(single->at("input_ids"), name), rows[r].input_ids);
        ids(name + ".attention_mask", id_list(single->at("attention_mask"), name), rows[r].attention_mask);
      }
    }
    if (section.contains("truncation")) {
      const json& t = section.at("truncation");
      const auto expected = id_list(t.at("input_ids"), "flux2_dev.truncation");
      const Encoding call =
          encode_flux2_dev_prompts(tok, {t.at("prompt").get<std::string>()}, t.at("max_length").get<int64_t>()).front();
      ids("flux2_dev.truncation.input_ids", expected, call.input_ids);
      ids("flux2_dev.truncation.attention_mask", std::vector<int64_t>(expected.size(), 1), call.attention_mask);
    }
  }
};

}  // namespace

size_t CasesReport::failures() const {
  size_t n = 0;
  for (const auto& c : checks) n += c.passed ? 0 : 1;
  return n;
}

std::string case_text(const json& entry, const std::string& where) {
  if (entry.contains("utf8_hex")) {
    const std::string hex = entry.at("utf8_hex").get<std::string>();
    TORCH_CHECK(hex.size() % 2 == 0, where, ": utf8_hex has an odd number of digits");
    std::string bytes;
    for (size_t i = 0; i < hex.size(); i += 2) {
      const std::string pair = hex.substr(i, 2);
      TORCH_CHECK(pair.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos, where,
                  ": utf8_hex has a non-hex digit in '", pair, "'");
      bytes.push_back(static_cast<char>(std::stoi(pair, nullptr, 16)));
    }
    return bytes;
  }
  TORCH_CHECK(entry.contains("text") && entry.at("text").is_string(), where, ": a case needs 'text' or 'utf8_hex'");
  return entry.at("text").get<std::string>();
}

namespace {

// check_cases without the layout errors named.
CasesReport check_cases_of(const json& cases, const Tokenizer& tok, TokenizerKind kind) {
  Checker checker;
  switch (kind) {
    case TokenizerKind::Clip: {
      const json& section = cases.contains("tokenizer") ? cases.at("tokenizer") : cases;
      checker.list("", section, tok, /*ids_with_specials=*/true);
      break;
    }
    case TokenizerKind::T5: {
      const json& section = cases.contains("tokenizer_2") ? cases.at("tokenizer_2") : cases;
      checker.list("", section, tok, true);
      // The slow tokenizer's ids where other implementations differ.
      for (const char* key : {"fast_vs_slow_differences", "spm_vs_t5tokenizer_differences"}) {
        if (!section.contains(key)) continue;
        const json& entries = section.at(key);
        for (size_t i = 0; i < entries.size(); ++i) {
          const std::string name = std::string(key) + "[" + std::to_string(i) + "]";
          checker.ids(name + ".t5tokenizer", id_list(entries[i].at("t5tokenizer"), name),
                      tok.encode(case_text(entries[i], name)));
        }
      }
      if (section.contains("flux1")) checker.list("flux1.", section.at("flux1"), tok, true);
      break;
    }
    case TokenizerKind::Qwen: {
      checker.list("", cases, tok, /*ids_with_specials=*/false);
      if (cases.contains("qwenimage")) {
        const json& q = cases.at("qwenimage");
        if (q.contains("drop_idx")) {
          checker.ids("qwenimage.drop_idx", {q.at("drop_idx").get<int64_t>()}, {kQwenImageDropIdx});
        }
        if (q.contains("template_prefix_ids")) {
          checker.ids("qwenimage.template_prefix_ids", id_list(q.at("template_prefix_ids"), "qwenimage"),
                      tok.encode(q.at("template_prefix").get<std::string>()));
        }
        checker.pipeline("qwenimage", q, tok, PromptTemplate::QwenImage);
        if (q.contains("batch")) {
          const json& batch = q.at("batch");
          const auto rows = encode_qwenimage_prompts(tok, batch.at("prompts").get<std::vector<std::string>>());
          for (size_t r = 0; r < rows.size(); ++r) {
            const std::string name = "qwenimage.batch[" + std::to_string(r) + "]";
            checker.ids(name + ".input_ids", id_list(batch.at("input_ids").at(r), name), rows[r].input_ids);
            checker.ids(name + ".attention_mask", id_list(batch.at("attention_mask").at(r), name),
                        rows[r].attention_mask);
          }
        }
      }
      if (cases.contains("flux2_klein")) checker.pipeline("flux2_klein", cases.at("flux2_klein"), tok, PromptTemplate::Flux2Klein);
      if (cases.contains("flux2_dev")) {
        checker.pipeline("flux2_dev", cases.at("flux2_dev"), tok, PromptTemplate::Flux2Dev);
        checker.flux2_dev_extras(cases.at("flux2_dev"), tok);
      }
      break;
    }
  }
  return checker.report;
}

}  // namespace

CasesReport check_cases(const json& cases, const Tokenizer& tok, TokenizerKind kind, const std::string& source) {
  TORCH_CHECK(cases.is_object(), source, ": expected a JSON object");
  // A missing key or a value of the wrong type anywhere below is nlohmann's exception: named with
  // the file here rather than checked at every access; the checks' own errors get the file too.
  try {
    return check_cases_of(cases, tok, kind);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, source, ": not a cases file of the expected layout for this tokenizer (", e.what(), ")");
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, source, ": ", e.what_without_backtrace());
  }
}

}  // namespace shardit::tokenizers

#pragma once
// Checks a tokenizer against a cases file: the `cases.json` layout of the golden tokenizer
// folders (strings with their expected ids, padded calls and pipeline templates).
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "shardit/tokenizers/tokenizer.h"

namespace shardit::tokenizers {

/// One comparison: what was compared and, on a mismatch, where.
struct CaseCheck {
  std::string name;    ///< e.g. "cases[12].ids"
  bool passed = false;
  std::string detail;  ///< first differing index, expected vs got (empty when passed)
};

/// Every check a cases file asks for.
struct CasesReport {
  std::vector<CaseCheck> checks;
  size_t failures() const;
};

/// The text of a case: its `utf8_hex` bytes when present (exact, even invalid UTF-8), else `text`.
std::string case_text(const nlohmann::json& entry, const std::string& where);

/// Runs every check of `cases` for a tokenizer of `kind`. A CLIP file's cases sit under
/// "tokenizer", a T5 file's under "tokenizer_2" (FLUX.1's folder names) or at the top level.
/// Checked: `ids` (CLIP/T5: with special tokens; tokenizer.json: without), `input_ids` and
/// `attention_mask` (a padded, truncated call of their length), T5's slow-tokenizer ids of the
/// differences lists, and the `qwenimage` / `flux2_klein` / `flux2_dev` pipeline templates and calls.
/// `source` (the file) names every error, also a missing key or a wrong type in the layout.
CasesReport check_cases(const nlohmann::json& cases, const Tokenizer& tokenizer, TokenizerKind kind,
                        const std::string& source);

}  // namespace shardit::tokenizers

// `shardit tokenize`: ids of a prompt as JSON, or a check of a cases file.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <memory>
#include <string>

#include "apps/commands.h"
#include "shardit/io/json.h"
#include "shardit/io/model_folder.h"
#include "shardit/tokenizers/cases.h"
#include "shardit/tokenizers/prompt_templates.h"
#include "shardit/tokenizers/tokenizer.h"

namespace shardit::apps {

namespace {

struct TokenizeOptions {
  std::string folder;
  std::string kind;
  std::string prompt_template;
  int64_t max_length = 0;
  std::string text;
  bool has_text = false;
  std::string cases;
};

int run_tokenize(const TokenizeOptions& options) {
  using namespace shardit::tokenizers;
  // The folder's own files say which tokenizer it is, unless --kind overrides.
  const TokenizerKind kind = options.kind.empty() ? detect_tokenizer_kind(options.folder) : parse_tokenizer_kind(options.kind);
  const auto tokenizer = load_tokenizer(options.folder, kind);

  if (!options.cases.empty()) {
    // Cases files (tens of thousands of ids) are larger than configs but still bounded.
    const nlohmann::json cases = io::read_json_file(options.cases, io::JsonLimits{256ull << 20});
    const CasesReport report = check_cases(cases, *tokenizer, kind, options.cases);
    for (const auto& check : report.checks) {
      if (!check.passed) std::printf("MISMATCH %s: %s\n", check.name.c_str(), check.detail.c_str());
    }
    const size_t failed = report.failures();
    std::printf("%s: %zu passed, %zu failed\n", options.cases.c_str(), report.checks.size() - failed, failed);
    return failed == 0 && !report.checks.empty() ? 0 : 1;
  }

  TORCH_CHECK(options.has_text, "tokenize: give --text TEXT or --cases FILE");
  const PromptTemplate tmpl = parse_prompt_template(options.prompt_template);
  nlohmann::json out;
  Encoding encoding;
  switch (tmpl) {
    case PromptTemplate::QwenImage:
      encoding = encode_qwenimage_prompts(*tokenizer, {options.text},
                                          options.max_length > 0 ? options.max_length
                                                                 : kQwenImageTokenizerMaxLength + kQwenImageDropIdx)
                     .front();
      out["drop_idx"] = kQwenImageDropIdx;
      break;
    case PromptTemplate::Flux2Klein:
      encoding = encode_flux2_klein_prompts(*tokenizer, {options.text},
                                            options.max_length > 0 ? options.max_length : kFlux2KleinMaxSequenceLength)
                     .front();
      break;
    case PromptTemplate::Flux2Dev:
      encoding = encode_flux2_dev_prompts(*tokenizer, {options.text},
                                          options.max_length > 0 ? options.max_length : kFlux2DevMaxSequenceLength)
                     .front();
      break;
    case PromptTemplate::None:
      if (options.max_length > 0) {
        encoding = (*tokenizer)(options.text, options.max_length, Padding::MaxLength);
      } else {
        encoding.input_ids = tokenizer->encode(options.text);
        encoding.attention_mask.assign(encoding.input_ids.size(), 1);
      }
      break;
  }
  if (tmpl != PromptTemplate::None) out["text"] = apply_prompt_template(tmpl, options.text);
  out["input_ids"] = encoding.input_ids;
  out["attention_mask"] = encoding.attention_mask;
  // Invalid UTF-8 in the rendered text is replaced in the JSON output too.
  std::printf("%s\n", out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  return 0;
}

}  // namespace

void register_tokenize(CLI::App& app, CommandBody& body) {
  auto options = std::make_shared<TokenizeOptions>();
  CLI::App* command = app.add_subcommand("tokenize", "Print the token ids of a prompt as JSON, or check a cases file");
  command->add_option("--tokenizer", options->folder, "tokenizer folder (tokenizer/, tokenizer_2/)")->required();
  command->add_option("--kind", options->kind,
                      "clip | t5 | qwen (tokenizer.json BPE); default: from the folder's files")
      ->check(CLI::IsMember({"clip", "t5", "qwen"}));
  command->add_option("--template", options->prompt_template,
                      "pipeline prompt template: qwenimage | flux2_klein | flux2_dev")
      ->check(CLI::IsMember({"qwenimage", "flux2_klein", "flux2_dev"}));
  command->add_option("--max-length", options->max_length, "truncate and pad to N tokens (padding='max_length')")
      ->check(integer_in(1, pipelines::kMaxSequenceLength));
  auto* text = command->add_option("--text", options->text, "the prompt (UTF-8)");
  auto* cases = command->add_option("--cases", options->cases, "a cases.json to check; exits 1 on any mismatch");
  text->excludes(cases);
  command->callback([&body, options, text] {
    options->has_text = text->count() > 0;
    body = [options] {
      const int status = run_tokenize(*options);
      std::fflush(stdout);
      return status;
    };
  });
}

}  // namespace shardit::apps

// Every case of the golden tokenizer files (made by transformers / tokenizers) gives exactly the
// expected ids: plain encodes, the pipelines' padded calls and the prompt templates.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "shardit/io/json.h"
#include "shardit/io/model_folder.h"
#include "shardit/tokenizers/cases.h"
#include "shardit/tokenizers/prompt_templates.h"
#include "shardit/tokenizers/tokenizer.h"
#include "support/test_support.h"

namespace test_tokenizers {
namespace {

using json = nlohmann::json;
using shardit::testing::golden_path;
using namespace shardit::tokenizers;

json cases_file(const std::string& folder) {
  return shardit::io::read_json_file(golden_path("text/" + folder + "/cases.json"), shardit::io::JsonLimits{256ull << 20});
}

std::vector<int64_t> ids(const json& value) { return value.get<std::vector<int64_t>>(); }

// `ids` of each case (with or without the special tokens), and `input_ids` / `attention_mask`
// as a truncating, max_length-padded call of their length. Returns the number of cases.
size_t expect_cases(const json& section, const Tokenizer& tok, bool with_specials) {
  const json& entries = section.at("cases");
  for (size_t i = 0; i < entries.size(); ++i) {
    const json& c = entries[i];
    const std::string text = case_text(c, "case");
    SCOPED_TRACE("case " + std::to_string(i) + ": " + c.at("text").dump());
    EXPECT_EQ(with_specials ? tok.encode(text) : tok.encode_without_specials(text), ids(c.at("ids")));
    if (c.contains("input_ids")) {
      const auto expected = ids(c.at("input_ids"));
      const Encoding call = tok(text, static_cast<int64_t>(expected.size()), Padding::MaxLength);
      EXPECT_EQ(call.input_ids, expected);
      EXPECT_EQ(call.attention_mask, ids(c.at("attention_mask")));
    }
  }
  return entries.size();
}

TEST(TokenizerParity, ClipSlowTokenizerAndFlux1Call) {
  const json all = cases_file("tokenizer_flux1");
  const auto tok = load_tokenizer(golden_path("text/tokenizer_flux1/tokenizer"), TokenizerKind::Clip);
  EXPECT_EQ(expect_cases(all.at("tokenizer"), *tok, true), 227u);
}

TEST(TokenizerParity, T5SlowTokenizerAndFlux1Call) {
  const json section = cases_file("tokenizer_flux1").at("tokenizer_2");
  const auto tok = load_tokenizer(golden_path("text/tokenizer_flux1/tokenizer_2"), TokenizerKind::T5);
  EXPECT_EQ(expect_cases(section, *tok, true), 222u);
  EXPECT_EQ(expect_cases(section.at("flux1"), *tok, true), 6u);
  // Where the fast tokenizer or plain SentencePiece differ, the slow T5Tokenizer is the reference.
  for (const char* key : {"fast_vs_slow_differences", "spm_vs_t5tokenizer_differences"}) {
    ASSERT_FALSE(section.at(key).empty()) << key;
    for (const json& c : section.at(key)) {
      EXPECT_EQ(tok->encode(case_text(c, key)), ids(c.at("t5tokenizer"))) << key << ": " << c.at("text").dump();
    }
  }
}

TEST(TokenizerParity, QwenTokenizerJson) {
  const json all = cases_file("tokenizer_qwen");
  const auto tok = load_tokenizer(golden_path("text/tokenizer_qwen/tokenizer"), TokenizerKind::Qwen);
  EXPECT_EQ(expect_cases(all, *tok, false), 222u);
}

TEST(TokenizerParity, QwenImagePromptTemplate) {
  const json q = cases_file("tokenizer_qwen").at("qwenimage");
  const auto tok = load_tokenizer(golden_path("text/tokenizer_qwen/tokenizer"), TokenizerKind::Qwen);
  EXPECT_EQ(q.at("drop_idx").get<int64_t>(), kQwenImageDropIdx);
  EXPECT_EQ(tok->encode(q.at("template_prefix").get<std::string>()), ids(q.at("template_prefix_ids")));
  EXPECT_EQ(apply_prompt_template(PromptTemplate::QwenImage, "{}"), q.at("template").get<std::string>());
  ASSERT_EQ(q.at("cases").size(), 5u);
  for (const json& c : q.at("cases")) {
    const std::string prompt = c.at("prompt").get<std::string>();
    EXPECT_EQ(apply_prompt_template(PromptTemplate::QwenImage, prompt), case_text(c, "qwenimage"));
    EXPECT_EQ(encode_qwenimage_prompts(*tok, {prompt}).front().input_ids, ids(c.at("ids"))) << prompt;
  }
  const json& batch = q.at("batch");
  const auto rows = encode_qwenimage_prompts(*tok, batch.at("prompts").get<std::vector<std::string>>());
  ASSERT_EQ(rows.size(), 2u);
  for (size_t r = 0; r < rows.size(); ++r) {
    EXPECT_EQ(rows[r].input_ids, ids(batch.at("input_ids")[r])) << "row " << r;
    EXPECT_EQ(rows[r].attention_mask, ids(batch.at("attention_mask")[r])) << "row " << r;
  }
}

TEST(TokenizerParity, Flux2KleinChatTemplate) {
  const json k = cases_file("tokenizer_qwen").at("flux2_klein");
  const auto tok = load_tokenizer(golden_path("text/tokenizer_qwen/tokenizer"), TokenizerKind::Qwen);
  EXPECT_EQ(k.at("max_length").get<int64_t>(), kFlux2KleinMaxSequenceLength);
  ASSERT_EQ(k.at("cases").size(), 5u);
  for (const json& c : k.at("cases")) {
    const std::string prompt = c.at("prompt").get<std::string>();
    const std::string text = apply_prompt_template(PromptTemplate::Flux2Klein, prompt);
    EXPECT_EQ(text, case_text(c, "flux2_klein"));
    EXPECT_EQ(tok->encode(text), ids(c.at("ids"))) << prompt;
    const Encoding call = encode_flux2_klein_prompts(*tok, {prompt}).front();
    EXPECT_EQ(call.input_ids, ids(c.at("input_ids"))) << prompt;
    EXPECT_EQ(call.attention_mask, ids(c.at("attention_mask"))) << prompt;
  }
}

TEST(TokenizerParity, Mistral3TokenizerJson) {
  const json all = cases_file("tokenizer_mistral3");
  const auto tok = load_tokenizer(golden_path("text/tokenizer_mistral3/tokenizer"), TokenizerKind::Qwen);
  EXPECT_EQ(expect_cases(all, *tok, false), 233u);
  // With the special tokens the post-processor prepends only <s>.
  EXPECT_EQ(tok->encode("Hello world").front(), 1);
  EXPECT_EQ(tok->encode("Hello world").size(), ids(all.at("cases")[0].at("ids")).size() + 1);
  EXPECT_TRUE(tok->pads_left());
  EXPECT_EQ(tok->pad_token_id(), 11);
}

TEST(TokenizerParity, Flux2DevChatTemplate) {
  const json d = cases_file("tokenizer_mistral3").at("flux2_dev");
  const auto tok = load_tokenizer(golden_path("text/tokenizer_mistral3/tokenizer"), TokenizerKind::Qwen);
  EXPECT_EQ(d.at("max_length").get<int64_t>(), kFlux2DevMaxSequenceLength);
  EXPECT_EQ(std::string(kFlux2DevSystemMessage), d.at("system_message").get<std::string>());
  ASSERT_EQ(d.at("cases").size(), 7u);
  for (const json& c : d.at("cases")) {
    const std::string prompt = c.at("prompt").get<std::string>();
    const std::string text = apply_prompt_template(PromptTemplate::Flux2Dev, prompt);
    EXPECT_EQ(text, case_text(c, "flux2_dev")) << prompt;
    EXPECT_EQ(tok->encode_without_specials(text), ids(c.at("ids"))) << prompt;
    const Encoding call = encode_flux2_dev_prompts(*tok, {prompt}).front();
    EXPECT_EQ(call.input_ids, ids(c.at("input_ids"))) << prompt;
    EXPECT_EQ(call.attention_mask, ids(c.at("attention_mask"))) << prompt;
    EXPECT_EQ(call.truncated_tokens, 0);
  }
  // Truncation keeps the first max_length tokens (the end of the template is cut), no padding.
  const json& t = d.at("truncation");
  const Encoding cut =
      encode_flux2_dev_prompts(*tok, {t.at("prompt").get<std::string>()}, t.at("max_length").get<int64_t>()).front();
  EXPECT_EQ(cut.input_ids, ids(t.at("input_ids")));
  EXPECT_EQ(cut.attention_mask, std::vector<int64_t>(cut.input_ids.size(), 1));
  EXPECT_GT(cut.truncated_tokens, 0);
}

// The same files through the CLI's checker: every check passes, and none is skipped silently.
TEST(TokenizerParity, CasesCheckerAgrees) {
  struct File {
    const char* folder;
    const char* tokenizer;
    TokenizerKind kind;
    size_t checks;
  };
  for (const File& f : {File{"tokenizer_flux1", "tokenizer", TokenizerKind::Clip, 227 * 3},
                        File{"tokenizer_flux1", "tokenizer_2", TokenizerKind::T5, 222 + 16 + 2 + 6 * 3},
                        File{"tokenizer_qwen", "tokenizer", TokenizerKind::Qwen, 222 + 2 + 5 * 2 + 2 * 2 + 5 * 4},
                        File{"tokenizer_mistral3", "tokenizer", TokenizerKind::Qwen, 233 + 7 * 4 + 2 * 2 + 2}}) {
    const std::string dir = golden_path(std::string("text/") + f.folder + "/" + f.tokenizer);
    EXPECT_EQ(detect_tokenizer_kind(dir), f.kind) << dir;
    const auto tok = load_tokenizer(dir, f.kind);
    const CasesReport report = check_cases(cases_file(f.folder), *tok, f.kind, f.folder);
    EXPECT_EQ(report.checks.size(), f.checks) << f.folder << "/" << f.tokenizer;
    EXPECT_EQ(report.failures(), 0u) << f.folder << "/" << f.tokenizer;
  }
}

}  // namespace
}  // namespace test_tokenizers

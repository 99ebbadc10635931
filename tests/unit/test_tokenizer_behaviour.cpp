// Tokenizer building blocks and behaviour at the edges (empty, invalid UTF-8, over-long), and the
// `shardit tokenize` command.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "shardit/tokenizers/added_tokens.h"
#include "shardit/tokenizers/bpe.h"
#include "shardit/tokenizers/prompt_templates.h"
#include "shardit/tokenizers/text_cleaning.h"
#include "shardit/tokenizers/tokenizer.h"
#include "shardit/tokenizers/unicode.h"
#include "support/test_support.h"

namespace test_tokenizer_behaviour {
namespace {

using namespace shardit::tokenizers;
using shardit::testing::golden_path;

std::string clip_dir() { return golden_path("text/tokenizer_flux1/tokenizer"); }
std::string t5_dir() { return golden_path("text/tokenizer_flux1/tokenizer_2"); }
std::string qwen_dir() { return golden_path("text/tokenizer_qwen/tokenizer"); }
std::string mistral_dir() { return golden_path("text/tokenizer_mistral3/tokenizer"); }

TEST(Unicode, InvalidUtf8BecomesOneReplacementPerMaximalSubpart) {
  bool replaced = false;
  EXPECT_EQ(sanitize_utf8("a\xe2\x80" "b", &replaced), "a\uFFFD" "b");  // truncated 3-byte sequence
  EXPECT_TRUE(replaced);
  EXPECT_EQ(sanitize_utf8("\xed\xa0\x80"), "\uFFFD\uFFFD\uFFFD");       // encoded surrogate
  EXPECT_EQ(sanitize_utf8("\xff\xc3\xa9"), "\uFFFD\u00e9");
  EXPECT_EQ(sanitize_utf8("ok", &replaced), "ok");
  EXPECT_FALSE(replaced);
}

TEST(Unicode, LowerCaseIsPythons) {
  EXPECT_EQ(to_lower("\u0130stanbul"), "i\u0307stanbul");
  EXPECT_EQ(normalize("cafe\u0301", NormalForm::NFC), "caf\u00e9");
}

TEST(TextCleaning, FtfyFixesAndWhitespaceClean) {
  EXPECT_EQ(fix_text("\u201ccurly\u201d \ufb01ne \uff21\u3000b\r\nc\xc2\x85"), "\"curly\" fine A b\nc\u2026");
  EXPECT_EQ(fix_text("a &amp; b"), "a & b");
  EXPECT_EQ(fix_text("<b>a &amp; b</b>"), "<b>a &amp; b</b>");  // HTML is left alone
  const std::string controls("nul\x00inside\x1b[31mred", 18);
  EXPECT_EQ(fix_text(controls), "nulinsidered");
  EXPECT_EQ(whitespace_clean("  a \t\u00a0 b\n "), "a b");
}

TEST(Bpe, MergesLowestRankFirstLeftmostOnTies) {
  BpeRanks ranks;
  ranks.add("a", "a");
  ranks.add("aa", "aa");
  EXPECT_EQ(bpe_merge({"a", "a", "a", "a", "a"}, ranks), (std::vector<std::string>{"aaaa", "a"}));
  EXPECT_EQ(byte_level_encode(" \n"), "\u0120\u010a");
}

TEST(AddedTokens, LongestMatchAndStripping) {
  AddedTokenMatcher matcher({AddedToken{"<a>", 1}, AddedToken{"<a><b>", 2}, AddedToken{"<x>", 3, true, true}},
                            is_python_space);
  const auto pieces = matcher.split("q<a><b>r  <x>  s<a>");
  ASSERT_EQ(pieces.size(), 6u);
  EXPECT_EQ(pieces[1].id, 2);
  EXPECT_EQ(pieces[2].text, "r");  // <x> swallowed the spaces on both sides
  EXPECT_EQ(pieces[3].id, 3);
  EXPECT_EQ(pieces[4].text, "s");
  EXPECT_EQ(pieces[5].id, 1);
}

TEST(GoldenTokenizers, EmptyPromptGivesOnlySpecialTokens) {
  const auto clip = load_tokenizer(clip_dir(), TokenizerKind::Clip);
  EXPECT_EQ(clip->encode(""), (std::vector<int64_t>{1212, 1213}));
  const auto t5 = load_tokenizer(t5_dir(), TokenizerKind::T5);
  EXPECT_EQ(t5->encode(""), (std::vector<int64_t>{1}));
  const auto qwen = load_tokenizer(qwen_dir(), TokenizerKind::Qwen);
  EXPECT_TRUE(qwen->encode("").empty());
  const Encoding padded = (*qwen)("", 4, Padding::MaxLength);
  EXPECT_EQ(padded.input_ids, (std::vector<int64_t>{151643, 151643, 151643, 151643}));
  EXPECT_EQ(padded.attention_mask, (std::vector<int64_t>{0, 0, 0, 0}));
}

TEST(GoldenTokenizers, InvalidUtf8IsReplacedNotFatal) {
  for (const auto kind : {TokenizerKind::Clip, TokenizerKind::T5, TokenizerKind::Qwen}) {
    const auto tok = load_tokenizer(kind == TokenizerKind::Clip ? clip_dir() : kind == TokenizerKind::T5 ? t5_dir() : qwen_dir(), kind);
    EXPECT_EQ(tok->encode("bad \xff\xfe byte \xe2\x80"), tok->encode("bad \uFFFD\uFFFD byte \uFFFD"));
  }
}

TEST(GoldenTokenizers, OverLongPromptIsTruncatedKeepingTheEnd) {
  std::string long_prompt;
  for (int i = 0; i < 400; ++i) long_prompt += "word ";
  const auto clip = load_tokenizer(clip_dir(), TokenizerKind::Clip);
  const Encoding c = (*clip)(long_prompt, 77, Padding::MaxLength);
  ASSERT_EQ(c.input_ids.size(), 77u);
  EXPECT_EQ(c.input_ids.front(), 1212);
  EXPECT_EQ(c.input_ids.back(), 1213);  // EOS survives truncation
  EXPECT_GT(c.truncated_tokens, 0);
  EXPECT_EQ(c.attention_mask, std::vector<int64_t>(77, 1));

  const auto t5 = load_tokenizer(t5_dir(), TokenizerKind::T5);
  const Encoding t = (*t5)(long_prompt + long_prompt, 512, Padding::MaxLength);
  ASSERT_EQ(t.input_ids.size(), 512u);
  EXPECT_EQ(t.input_ids.back(), 1);  // </s>
  EXPECT_GT(t.truncated_tokens, 0);

  const auto qwen = load_tokenizer(qwen_dir(), TokenizerKind::Qwen);
  const Encoding k = encode_flux2_klein_prompts(*qwen, {long_prompt + long_prompt}).front();
  EXPECT_EQ(k.input_ids.size(), 512u);
  EXPECT_GT(k.truncated_tokens, 0);
  EXPECT_EQ(k.input_ids.front(), 151644);  // <|im_start|>: truncation keeps the start

  // FLUX.2 [dev]: the template writes <s> itself; truncation keeps it and the system message.
  const auto mistral = load_tokenizer(mistral_dir(), TokenizerKind::Qwen);
  const Encoding d = encode_flux2_dev_prompts(*mistral, {long_prompt + long_prompt}).front();
  EXPECT_EQ(d.input_ids.size(), 512u);
  EXPECT_GT(d.truncated_tokens, 0);
  EXPECT_EQ(d.input_ids.front(), 1);
  EXPECT_EQ(d.input_ids[1], 17);  // [SYSTEM_PROMPT]
  EXPECT_EQ(d.attention_mask, std::vector<int64_t>(512, 1));
}

TEST(GoldenTokenizers, LeftPaddingPutsPadsFirst) {
  // FLUX.2 [dev]'s tokenizer_config.json says padding_side "left": pads and zero mask before the
  // tokens, in a padded call of any kind; Qwen's folder pads on the right.
  const auto mistral = load_tokenizer(mistral_dir(), TokenizerKind::Qwen);
  const std::vector<std::string> texts{"a photo of a cat", "a"};
  const auto rows = (*mistral)(texts, 16, Padding::Longest);
  ASSERT_EQ(rows[1].input_ids.size(), rows[0].input_ids.size());
  const size_t pads = rows[0].input_ids.size() - mistral->encode("a").size();
  ASSERT_GT(pads, 0u);
  for (size_t i = 0; i < pads; ++i) {
    EXPECT_EQ(rows[1].input_ids[i], 11) << i;
    EXPECT_EQ(rows[1].attention_mask[i], 0) << i;
  }
  EXPECT_EQ(rows[1].input_ids[pads], 1);  // <s> right after the padding
  EXPECT_EQ(rows[1].attention_mask.back(), 1);
  const auto qwen = load_tokenizer(qwen_dir(), TokenizerKind::Qwen);
  EXPECT_FALSE(qwen->pads_left());
  EXPECT_EQ((*qwen)("a", 8, Padding::MaxLength).attention_mask.front(), 1);
}

TEST(GoldenTokenizers, KindIsDetectedFromTheFolder) {
  EXPECT_EQ(detect_tokenizer_kind(clip_dir()), TokenizerKind::Clip);
  EXPECT_EQ(detect_tokenizer_kind(t5_dir()), TokenizerKind::T5);  // tokenizer.json too, but T5Tokenizer
  EXPECT_EQ(detect_tokenizer_kind(qwen_dir()), TokenizerKind::Qwen);
  EXPECT_EQ(detect_tokenizer_kind(mistral_dir()), TokenizerKind::Qwen);
  const std::string empty = shardit::testing::make_temp_dir("tokenizer_kind");
  const std::string message = shardit::testing::error_of([&] { detect_tokenizer_kind(empty); });
  EXPECT_NE(message.find("no tokenizer files found"), std::string::npos) << message;
  EXPECT_NE(message.find(empty), std::string::npos) << message;
}

TEST(GoldenTokenizeCli, PrintsIdsAndChecksCases) {
  std::string out;
  const std::string cli = shardit::testing::cli_path();
  ASSERT_EQ(shardit::testing::run_command(cli + " tokenize --kind clip --tokenizer " + clip_dir() +
                                              " --text 'Hello world'", &out), 0) << out;
  EXPECT_NE(out.find("\"input_ids\":[1212,898,75,334,622,681,1213]"), std::string::npos) << out;

  ASSERT_EQ(shardit::testing::run_command(cli + " tokenize --kind qwen --template qwenimage --tokenizer " + qwen_dir() +
                                              " --text 'A cat'", &out), 0) << out;
  EXPECT_NE(out.find("\"drop_idx\":34"), std::string::npos) << out;

  const std::string cases = golden_path("text/tokenizer_flux1/cases.json");
  ASSERT_EQ(shardit::testing::run_command(cli + " tokenize --kind t5 --tokenizer " + t5_dir() + " --cases " + cases, &out), 0)
      << out;
  EXPECT_NE(out.find(" 0 failed"), std::string::npos) << out;

  // No --kind: every golden tokenizer folder checks its cases file with the kind its files say.
  for (const auto& [folder, tokenizer] : std::vector<std::pair<std::string, std::string>>{
           {"tokenizer_flux1", "tokenizer"}, {"tokenizer_flux1", "tokenizer_2"}, {"tokenizer_qwen", "tokenizer"},
           {"tokenizer_mistral3", "tokenizer"}}) {
    const std::string file = golden_path("text/" + folder + "/cases.json");
    ASSERT_EQ(shardit::testing::run_command(cli + " tokenize --tokenizer " + golden_path("text/" + folder + "/" + tokenizer) +
                                                " --cases " + file, &out), 0)
        << folder << "/" << tokenizer << ": " << out;
    EXPECT_NE(out.find(" 0 failed"), std::string::npos) << out;
  }
  ASSERT_EQ(shardit::testing::run_command(cli + " tokenize --template flux2_dev --max-length 8 --tokenizer " + mistral_dir() +
                                              " --text 'A cat'", &out), 0) << out;
  EXPECT_NE(out.find("\"input_ids\":[1,17,"), std::string::npos) << out;

  // One wrong id: reported with its place, and a non-zero exit.
  const std::string dir = shardit::testing::make_temp_dir("tokenize_cli");
  const std::string bad = dir + "/cases.json";
  std::ofstream(bad) << R"({"cases": [{"text": "Hello world", "ids": [1212, 898, 75, 334, 622, 682, 1213]}]})";
  EXPECT_EQ(shardit::testing::run_command(cli + " tokenize --kind clip --tokenizer " + clip_dir() + " --cases " + bad, &out), 1)
      << out;
  EXPECT_NE(out.find("MISMATCH cases[0].ids"), std::string::npos) << out;
  EXPECT_NE(out.find("index 5: expected 682, got 681"), std::string::npos) << out;

  EXPECT_EQ(shardit::testing::run_command(cli + " tokenize --kind t5 --tokenizer " + clip_dir() + " --text hi", &out), 1);
  EXPECT_NE(out.find("spiece.model"), std::string::npos) << out;
}

}  // namespace
}  // namespace test_tokenizer_behaviour

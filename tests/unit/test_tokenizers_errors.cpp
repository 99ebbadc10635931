// Tokenizer folders with a missing or broken file: the error names the file.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "shardit/tokenizers/prompt_templates.h"
#include "shardit/tokenizers/regex.h"
#include "shardit/tokenizers/tokenizer.h"
#include "support/test_support.h"

namespace test_tokenizers_errors {
namespace {

namespace fs = std::filesystem;
using namespace shardit::tokenizers;
using shardit::testing::error_of;
using shardit::testing::golden_path;

// A copy of a golden tokenizer folder without `drop` (and with `replace` written over `name`).
std::string copy_without(const std::string& golden, const std::string& drop, const std::string& tag) {
  const std::string dir = shardit::testing::make_temp_dir(tag);
  for (const auto& entry : fs::directory_iterator(golden_path(golden))) {
    if (entry.path().filename() == drop) continue;
    fs::copy_file(entry.path(), fs::path(dir) / entry.path().filename());
    fs::permissions(fs::path(dir) / entry.path().filename(), fs::perms::owner_write, fs::perm_options::add);
  }
  return dir;
}

TEST(GoldenTokenizersErrors, MissingFileIsNamed) {
  const std::string clip = copy_without("text/tokenizer_flux1/tokenizer", "merges.txt", "tok_no_merges");
  EXPECT_NE(error_of([&] { load_tokenizer(clip, TokenizerKind::Clip); }).find("no merges.txt"), std::string::npos);
  const std::string t5 = copy_without("text/tokenizer_flux1/tokenizer_2", "spiece.model", "tok_no_spiece");
  EXPECT_NE(error_of([&] { load_tokenizer(t5, TokenizerKind::T5); }).find("no spiece.model"), std::string::npos);
  const std::string qwen = copy_without("text/tokenizer_qwen/tokenizer", "tokenizer.json", "tok_no_json");
  EXPECT_NE(error_of([&] { load_tokenizer(qwen, TokenizerKind::Qwen); }).find("no tokenizer.json"), std::string::npos);
  EXPECT_NE(error_of([&] { load_tokenizer("/nonexistent/tokenizer", TokenizerKind::Clip); }).find("does not exist"),
            std::string::npos);
}

TEST(GoldenTokenizersErrors, BrokenFilesAreNamed) {
  const std::string dir = copy_without("text/tokenizer_flux1/tokenizer", "", "tok_broken");
  std::ofstream(dir + "/vocab.json") << "{\"a\": 1,";
  const std::string truncated = error_of([&] { load_tokenizer(dir, TokenizerKind::Clip); });
  EXPECT_NE(truncated.find("vocab.json: invalid JSON"), std::string::npos) << truncated;

  std::ofstream(dir + "/vocab.json") << std::string(100, '[') << std::string(100, ']');
  const std::string deep = error_of([&] { load_tokenizer(dir, TokenizerKind::Clip); });
  EXPECT_NE(deep.find("/vocab.json: file nests JSON deeper than 32 levels (at byte 32)"), std::string::npos) << deep;

  const std::string t5 = copy_without("text/tokenizer_flux1/tokenizer_2", "", "tok_bad_spiece");
  std::ofstream(t5 + "/spiece.model") << "not a model";
  const std::string model = error_of([&] { load_tokenizer(t5, TokenizerKind::T5); });
  EXPECT_NE(model.find("spiece.model: not a SentencePiece model"), std::string::npos) << model;
}

TEST(GoldenTokenizersErrors, EmptyMergesAreRefused) {
  const std::string dir = copy_without("text/tokenizer_flux1/tokenizer", "", "tok_empty_merges");
  std::ofstream(dir + "/merges.txt", std::ios::trunc) << "#version: 0.2\n";
  const std::string error = error_of([&] { load_tokenizer(dir, TokenizerKind::Clip); });
  EXPECT_NE(error.find("merges.txt: holds no merges"), std::string::npos) << error;
  std::ofstream(dir + "/merges.txt", std::ios::trunc) << "";
  EXPECT_NE(error_of([&] { load_tokenizer(dir, TokenizerKind::Clip); }).find("holds no merges"), std::string::npos);
}

// A pattern that backtracks catastrophically hits PCRE2's match limit: the error names the file,
// PCRE2's reason and the pattern, not only a code.
TEST(TokenizerRegexErrors, MatchLimitNamesTheSourceAndPattern) {
  const Regex catastrophic("(a+)+$", "evil/tokenizer.json");
  const std::string error = error_of([&] { catastrophic.find_all(std::string(40, 'a') + "!"); });
  EXPECT_NE(error.find("evil/tokenizer.json: pre-tokenizer regex failed on a text of 41 bytes ("), std::string::npos)
      << error;
  EXPECT_NE(error.find("PCRE2 code -"), std::string::npos) << error;
  EXPECT_NE(error.find("(a+)+$"), std::string::npos) << error;
}

TEST(GoldenTokenizersErrors, UnknownNamesAndBadLengths) {
  EXPECT_NE(error_of([] { parse_tokenizer_kind("bert"); }).find("expected clip, t5 or qwen"), std::string::npos);
  EXPECT_NE(error_of([] { parse_prompt_template("sdxl"); }).find("qwenimage, flux2_klein or flux2_dev"),
            std::string::npos);
  const auto clip = load_tokenizer(golden_path("text/tokenizer_flux1/tokenizer"), TokenizerKind::Clip);
  EXPECT_NE(error_of([&] { (*clip)("a", 2, Padding::MaxLength); }).find("max_length 2 leaves no room"),
            std::string::npos);
}

TEST(GoldenTokenizersErrors, PaddingWithoutPadTokenIsExplained) {
  const std::string dir = copy_without("text/tokenizer_qwen/tokenizer", "tokenizer_config.json", "tok_no_pad");
  const auto tok = load_tokenizer(dir, TokenizerKind::Qwen);
  EXPECT_EQ(tok->encode("hi").size(), 1u);
  EXPECT_NE(error_of([&] { (*tok)("hi", 8, Padding::MaxLength); }).find("no pad_token"), std::string::npos);
}

}  // namespace
}  // namespace test_tokenizers_errors

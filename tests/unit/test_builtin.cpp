// The built-in tiny pipeline: written the same, byte for byte, every time; its tokenizers turn text
// into ids and back; its text encoders hold the reference checkpoints' tensor names; the BPE
// merge learner and SentencePiece's trainer behind them.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "shardit/io/json.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/builtin.h"
#include "shardit/tokenizers/bpe.h"
#include "shardit/tokenizers/clip_tokenizer.h"
#include "shardit/tokenizers/sentencepiece.h"
#include "shardit/tokenizers/t5_tokenizer.h"
#include "support/test_support.h"

namespace test_builtin {
namespace {

namespace fs = std::filesystem;
using shardit::models::BuiltinModelPaths;
using shardit::models::write_builtin_model;

const BuiltinModelPaths& builtin() {
  static const BuiltinModelPaths paths = write_builtin_model(shardit::testing::make_temp_dir("builtin") + "/model");
  return paths;
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Every file under `root`, by relative path.
std::map<std::string, std::string> files_under(const fs::path& root) {
  std::map<std::string, std::string> files;
  for (const auto& entry : fs::recursive_directory_iterator(root)) {
    if (entry.is_regular_file()) files[fs::relative(entry.path(), root).string()] = read_bytes(entry.path());
  }
  return files;
}

nlohmann::json read_json(const fs::path& path) { return nlohmann::json::parse(read_bytes(path)); }

TEST(BuiltinModel, WritesTheSameBytesEveryTime) {
  const std::string dir = shardit::testing::make_temp_dir("builtin-twice");
  const auto start = std::chrono::steady_clock::now();
  const auto first = write_builtin_model(dir + "/first");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "the built-in model was written in " << seconds << " s\n";
  const auto second = write_builtin_model(dir + "/second");
  const auto a = files_under(first.pipeline), b = files_under(second.pipeline);
  for (const std::string expected :
       {"model_index.json", "text_encoder/config.json", "text_encoder/model.safetensors", "text_encoder_2/config.json",
        "text_encoder_2/model.safetensors", "tokenizer/vocab.json", "tokenizer/merges.txt",
        "tokenizer/special_tokens_map.json", "tokenizer/tokenizer_config.json", "tokenizer_2/spiece.model",
        "tokenizer_2/special_tokens_map.json", "tokenizer_2/tokenizer_config.json", "prompt_embeds.safetensors"}) {
    EXPECT_EQ(a.count(expected), 1u) << expected << " was not written";
  }
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, bytes] : a) {
    const auto other = b.find(name);
    ASSERT_NE(other, b.end()) << name << " was written only the first time";
    EXPECT_TRUE(bytes == other->second) << name << " differs between two writes (" << bytes.size() << " vs "
                                        << other->second.size() << " bytes)";
  }
  // A complete folder is reused as it is.
  const auto modified = fs::last_write_time(fs::path(first.pipeline) / "tokenizer_2" / "spiece.model");
  write_builtin_model(first.pipeline);
  EXPECT_EQ(fs::last_write_time(fs::path(first.pipeline) / "tokenizer_2" / "spiece.model"), modified);
}

TEST(BuiltinModel, ListsFluxTextEncodersWithMatchingWidths) {
  const fs::path root = builtin().pipeline;
  const nlohmann::json index = read_json(root / "model_index.json");
  EXPECT_EQ(index.at("text_encoder"), nlohmann::json({"transformers", "CLIPTextModel"}));
  EXPECT_EQ(index.at("text_encoder_2"), nlohmann::json({"transformers", "T5EncoderModel"}));
  EXPECT_EQ(index.at("tokenizer"), nlohmann::json({"transformers", "CLIPTokenizer"}));
  EXPECT_EQ(index.at("tokenizer_2"), nlohmann::json({"transformers", "T5TokenizerFast"}));
  const nlohmann::json transformer = read_json(root / "transformer" / "config.json");
  const nlohmann::json clip = read_json(root / "text_encoder" / "config.json");
  const nlohmann::json t5 = read_json(root / "text_encoder_2" / "config.json");
  EXPECT_EQ(transformer.at("pooled_projection_dim"), clip.at("hidden_size"));
  EXPECT_EQ(transformer.at("joint_attention_dim"), t5.at("d_model"));

  // The encoders' vocabularies are the tokenizers'.
  const auto vocab = read_json(root / "tokenizer" / "vocab.json");
  EXPECT_EQ(clip.at("vocab_size").get<int64_t>(), static_cast<int64_t>(vocab.size()));
  EXPECT_EQ(vocab.at("<|endoftext|>").get<int64_t>(), static_cast<int64_t>(vocab.size()) - 1);
  const shardit::tokenizers::SentencePiece sp((root / "tokenizer_2" / "spiece.model").string());
  EXPECT_GE(sp.piece_size(), 500);
  EXPECT_LE(sp.piece_size(), 1000);
  EXPECT_EQ(t5.at("vocab_size").get<int64_t>(), sp.piece_size() + 100);
  EXPECT_EQ(sp.id_to_piece(0), "<pad>");
  EXPECT_EQ(sp.id_to_piece(1), "</s>");
  EXPECT_EQ(sp.id_to_piece(2), "<unk>");
}

// GPT-2's byte-level symbols back to bytes.
std::string byte_level_decode(const std::string& symbols) {
  static const std::map<std::string, char> bytes = [] {
    std::map<std::string, char> out;
    for (int b = 0; b < 256; ++b) {
      const std::string byte(1, static_cast<char>(b));
      out[shardit::tokenizers::byte_level_encode(byte)] = byte[0];
    }
    return out;
  }();
  std::string out;
  for (const std::string& symbol : shardit::tokenizers::split_characters(symbols)) out += bytes.at(symbol);
  return out;
}

TEST(BuiltinModel, ClipTokenizerRoundTrips) {
  const std::string dir = fs::path(builtin().pipeline) / "tokenizer";
  const auto tokenizer = shardit::tokenizers::CLIPTokenizer::from_folder(dir);
  const nlohmann::json vocab = read_json(fs::path(dir) / "vocab.json");
  std::map<int64_t, std::string> tokens;
  for (const auto& [token, id] : vocab.items()) tokens[id.get<int64_t>()] = token;

  const std::string text = "A red fox, sleeping under 2 old pine trees at night!";
  const std::vector<int64_t> ids = tokenizer.encode(text);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), tokenizer.bos_token_id());
  EXPECT_EQ(ids.back(), tokenizer.eos_token_id());
  // CLIPTokenizer.decode: the bytes of each token, a space where a word ends; the text as CLIP's
  // clean-up leaves it (lower case).
  std::string decoded;
  for (size_t i = 1; i + 1 < ids.size(); ++i) {
    std::string token = tokens.at(ids[i]);
    const bool end_of_word = token.size() > 4 && token.compare(token.size() - 4, 4, "</w>") == 0;
    if (end_of_word) token.resize(token.size() - 4);
    decoded += byte_level_decode(token) + (end_of_word ? " " : "");
  }
  EXPECT_EQ(decoded, "a red fox , sleeping under 2 old pine trees at night ! ");
  // The merges learned from the built-in text join its frequent words' letters.
  EXPECT_EQ(tokenizer.encode_without_specials("the").size(), 1u);
  EXPECT_LT(tokenizer.encode_without_specials("lighthouse").size(), 5u);
  EXPECT_EQ(tokenizer.encode_without_specials("\xc3\xa9").size(), 2u) << "a character outside the text: its bytes";
}

TEST(BuiltinModel, T5TokenizerRoundTrips) {
  const std::string dir = fs::path(builtin().pipeline) / "tokenizer_2";
  const auto tokenizer = shardit::tokenizers::T5Tokenizer::from_folder(dir);
  const shardit::tokenizers::SentencePiece sp(dir + "/spiece.model");
  const std::string text = "A red fox, sleeping under 2 old pine trees at night! (Xylophone?)";
  const std::vector<int64_t> ids = tokenizer.encode(text);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.back(), tokenizer.eos_token_id());
  std::string decoded;
  for (size_t i = 0; i + 1 < ids.size(); ++i) {
    EXPECT_NE(ids[i], 2) << "<unk> at " << i << ": every printable ASCII character has a piece";
    decoded += sp.id_to_piece(ids[i]);
  }
  // "▁" (U+2581) marks a space; the first is SentencePiece's dummy prefix.
  std::string spaced;
  for (size_t at = 0; at < decoded.size();) {
    if (decoded.compare(at, 3, "\xe2\x96\x81") == 0) {
      spaced += ' ';
      at += 3;
    } else {
      spaced += decoded[at++];
    }
  }
  EXPECT_EQ(spaced, " " + text);
  EXPECT_EQ(tokenizer.encode_without_specials("fox").size(), 1u);
  // The sentinel tokens follow the pieces, <extra_id_0> last.
  EXPECT_EQ(tokenizer.encode_without_specials("<extra_id_0>"), std::vector<int64_t>{sp.piece_size() + 99});
  EXPECT_EQ(tokenizer.encode_without_specials("<extra_id_99>"), std::vector<int64_t>{sp.piece_size()});
}

// The tensor names of a safetensors file, with those of layers at or past `num_layers` (marked by
// `layer_marker`, "layers." or "block.") left out.
std::set<std::string> tensor_names(const std::string& path, const std::string& layer_marker, int num_layers) {
  std::set<std::string> names;
  for (const std::string& name : shardit::io::SafetensorsFile::open(path)->names()) {
    const size_t at = name.find(layer_marker);
    if (at != std::string::npos && std::stoi(name.substr(at + layer_marker.size())) >= num_layers) continue;
    names.insert(name);
  }
  return names;
}

std::set<std::string> config_keys(const std::string& path) {
  const nlohmann::json config = read_json(path);
  std::set<std::string> keys;
  for (const auto& item : config.items()) keys.insert(item.key());
  return keys;
}

// The reference FLUX.1 pipeline's tiny encoders (3 layers, saved by transformers): the same
// tensor names for our 2 layers, and the same config keys (but transformers' version stamp).
TEST(BuiltinModelGolden, TextEncodersHoldTheReferenceNames) {
  const std::string golden = shardit::testing::golden_path("pipeline_flux1");
  const fs::path root = builtin().pipeline;
  for (const auto& [component, marker] :
       {std::pair<std::string, std::string>{"text_encoder", "layers."}, {"text_encoder_2", "block."}}) {
    EXPECT_EQ(tensor_names((root / component / "model.safetensors").string(), marker, 2),
              tensor_names(golden + "/" + component + "/model.safetensors", marker, 2))
        << component;
    std::set<std::string> expected = config_keys(golden + "/" + component + "/config.json");
    expected.erase("transformers_version");
    EXPECT_EQ(config_keys((root / component / "config.json").string()), expected) << component;
    EXPECT_EQ(shardit::io::SafetensorsFile::open((root / component / "model.safetensors").string())->metadata(),
              (std::map<std::string, std::string>{{"format", "pt"}}))
        << component;
  }
  for (const std::string component : {"tokenizer", "tokenizer_2"}) {
    for (const std::string file : {"special_tokens_map.json", "tokenizer_config.json"}) {
      EXPECT_EQ(config_keys((root / component / file).string()), config_keys(golden + "/" + component + "/" + file))
          << component << "/" << file;
    }
  }
}

TEST(BuiltinBpe, LearnsTheMostFrequentPairFirst) {
  using shardit::tokenizers::BpeWord;
  const std::vector<BpeWord> words = {{{"l", "o", "w</w>"}, 5}, {{"l", "o", "w", "e", "r</w>"}, 2},
                                      {{"n", "e", "w", "e", "s", "t</w>"}, 6}, {{"w", "i", "d", "e", "s", "t</w>"}, 3}};
  const auto merges = shardit::tokenizers::learn_bpe_merges(words, 4);
  // e s (9) and s t</w> (9) tie: the smaller bytes first; then es t</w> (9); then l o (7); then
  // n e, e w and w est</w> (6) tie: e w.
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"e", "s"}, {"es", "t</w>"}, {"l", "o"}, {"e", "w"}};
  EXPECT_EQ(merges, expected);
  // Stops when no pair occurs twice.
  EXPECT_TRUE(shardit::tokenizers::learn_bpe_merges({{{"a", "b</w>"}, 1}}, 10).empty());
}

TEST(BuiltinBpe, ByteLevelAlphabetHasEveryByteOnce) {
  const auto alphabet = shardit::tokenizers::byte_level_alphabet();
  ASSERT_EQ(alphabet.size(), 256u);
  EXPECT_EQ(alphabet.front(), "!");
  EXPECT_EQ(alphabet[93], "~");
  EXPECT_EQ(alphabet.back(), shardit::tokenizers::byte_level_encode("\xad"));
  EXPECT_EQ(std::set<std::string>(alphabet.begin(), alphabet.end()).size(), 256u);
}

TEST(SentencePieceTrainer, BadOptionIsNamed) {
  const std::string message = shardit::testing::error_of(
      [] { shardit::tokenizers::train_sentencepiece({"a b c"}, {{"no_such_flag", "1"}}, 1); });
  EXPECT_NE(message.find("SentencePiece training failed"), std::string::npos) << message;
  EXPECT_NE(message.find("no_such_flag"), std::string::npos) << message;
}

}  // namespace
}  // namespace test_builtin

#include "shardit/models/builtin.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <unistd.h>

#include "shardit/io/json.h"
#include "shardit/io/safetensors.h"
#include "shardit/models/clip/modeling_clip.h"
#include "shardit/models/flux/transformer_flux.h"
#include "shardit/models/t5/modeling_t5.h"
#include "shardit/models/vae/autoencoder_kl.h"
#include "shardit/tokenizers/bpe.h"
#include "shardit/tokenizers/sentencepiece.h"
#include "shardit/tokenizers/tokenizer.h"

namespace shardit::models {

namespace {

namespace fs = std::filesystem;

// The encoders' widths, which the transformer's text inputs take.
constexpr int64_t kClipHiddenSize = 96;  // pooled_projection_dim
constexpr int64_t kT5DModel = 64;        // joint_attention_dim

// FLUX.1-dev's scheduler_config.json.
nlohmann::json builtin_scheduler_config() {
  return {{"_class_name", "FlowMatchEulerDiscreteScheduler"},
          {"base_image_seq_len", 256},
          {"base_shift", 0.5},
          {"max_image_seq_len", 4096},
          {"max_shift", 1.15},
          {"num_train_timesteps", 1000},
          {"shift", 3.0},
          {"use_dynamic_shifting", true}};
}

// CLIPTextModel's config.json as transformers writes it (CLIP-L's token ids: bos 0, pad 1 and
// eos 2, which makes the pooled output take the highest id, as CLIP-L's does). 12 heads, so that
// TP=2, 3 and 4 shard it like the transformer.
nlohmann::json builtin_clip_config(int64_t vocab_size) {
  return {{"architectures", {"CLIPTextModel"}},
          {"attention_dropout", 0.0},
          {"bos_token_id", 0},
          {"dropout", 0.0},
          {"eos_token_id", 2},
          {"hidden_act", "quick_gelu"},
          {"hidden_size", kClipHiddenSize},
          {"initializer_factor", 1.0},
          {"initializer_range", 0.02},
          {"intermediate_size", 2 * kClipHiddenSize},
          {"layer_norm_eps", 1e-05},
          {"max_position_embeddings", 77},
          {"model_type", "clip_text_model"},
          {"num_attention_heads", 12},
          {"num_hidden_layers", 2},
          {"pad_token_id", 1},
          {"projection_dim", kClipHiddenSize},
          {"torch_dtype", "float32"},
          {"vocab_size", vocab_size}};
}

// T5EncoderModel's config.json (T5 v1.1's gated-GELU feed-forward, as FLUX.1's T5-XXL).
nlohmann::json builtin_t5_config(int64_t vocab_size) {
  return {{"architectures", {"T5EncoderModel"}},
          {"classifier_dropout", 0.0},
          {"d_ff", 96},
          {"d_kv", 8},
          {"d_model", kT5DModel},
          {"decoder_start_token_id", 0},
          {"dense_act_fn", "gelu_new"},
          {"dropout_rate", 0.1},
          {"eos_token_id", 1},
          {"feed_forward_proj", "gated-gelu"},
          {"initializer_factor", 1.0},
          {"is_encoder_decoder", true},
          {"is_gated_act", true},
          {"layer_norm_epsilon", 1e-06},
          {"model_type", "t5"},
          {"num_decoder_layers", 2},
          {"num_heads", 12},
          {"num_layers", 2},
          {"pad_token_id", 0},
          {"relative_attention_max_distance", 128},
          {"relative_attention_num_buckets", 32},
          {"tie_word_embeddings", false},
          {"torch_dtype", "float32"},
          {"use_cache", true},
          {"vocab_size", vocab_size}};
}

void write_json(const fs::path& path, const nlohmann::json& json) {
  std::ofstream out(path);
  TORCH_CHECK(out.good(), path.string(), ": cannot write");
  out << json.dump(2) << "\n";
}

// An AddedToken as transformers saves it: in special_tokens_map.json, and with `special` in
// tokenizer_config.json's added_tokens_decoder.
nlohmann::json added_token(const std::string& content, bool normalized, bool strip = false, bool special = false) {
  nlohmann::json token = {{"content", content}, {"lstrip", strip},        {"normalized", normalized},
                          {"rstrip", strip},    {"single_word", false}};
  if (special) token["special"] = true;
  return token;
}

// The built-in text the tokenizers learn from: prompt-like sentences over a few hundred English
// words, picked by a fixed linear congruential sequence (the same text on every platform).
const std::vector<std::string>& builtin_sentences() {
  static const std::vector<std::string> sentences = [] {
    const auto words = [](const char* text) {
      std::vector<std::string> out;
      std::istringstream in(text);
      for (std::string word; in >> word;) out.push_back(word);
      return out;
    };
    const std::vector<std::string> adjectives = words(
        "red orange yellow green blue purple pink brown black white gray golden silver dark bright pale deep soft "
        "warm cold quiet calm busy empty crowded small tiny little large huge tall short long wide narrow old "
        "ancient young new modern rustic wooden stone glass metal paper woven painted carved broken shiny dusty wet "
        "dry frozen sunny rainy cloudy foggy misty snowy windy stormy gentle wild sleepy happy curious brave proud "
        "lonely friendly elegant simple detailed intricate colorful vivid faded glowing sparkling smooth rough round "
        "square sharp heavy light fresh ripe sweet bitter salty spicy hidden secret famous strange magical peaceful "
        "tired hungry clever noble humble silent loud graceful clumsy fierce tender lazy striped spotted furry "
        "feathered velvet marble copper bronze crystal icy sandy muddy grassy leafy thorny blooming withered");
    const std::vector<std::string> nouns = words(
        "fox cat dog wolf bear deer rabbit horse owl eagle sparrow swan duck fish whale dolphin turtle frog "
        "butterfly bee lion tiger elephant giraffe zebra monkey panda squirrel mouse goat sheep cow chicken robot "
        "dragon knight wizard sailor farmer painter child woman man girl boy grandmother family crowd dancer musician "
        "house cottage castle tower bridge church temple village city street road market harbor lighthouse station "
        "garden forest meadow field valley mountain hill river lake ocean beach island desert canyon waterfall cave "
        "cliff glacier volcano jungle swamp sky cloud sun moon star rainbow storm snow rain wind fog night morning "
        "evening sunset sunrise winter summer autumn spring flower rose tulip daisy tree oak pine willow leaf grass "
        "apple orange lemon cherry bread cheese cake coffee tea soup bowl cup plate table chair window door lamp "
        "candle book letter clock mirror bicycle car train boat ship airplane balloon umbrella hat coat scarf shoe "
        "guitar piano violin drum kite map key ring crown sword shield basket bottle vase painting photograph "
        "astronaut pirate queen king princess soldier doctor teacher student baker chef fisherman shepherd "
        "penguin parrot peacock octopus jellyfish crab snail spider lizard camel kangaroo koala hedgehog otter "
        "library kitchen bedroom attic cellar balcony rooftop staircase hallway courtyard fountain statue ruins "
        "palace windmill barn farm orchard vineyard pond stream waves shore reef nebula galaxy planet comet "
        "teapot lantern feather pebble shell seashell pumpkin mushroom strawberry blueberry peach pear grape "
        "chocolate pancake sandwich pizza noodles dumpling honey jar spoon fork knife blanket pillow sofa carpet");
    const std::vector<std::string> verbs = words(
        "sitting standing walking running jumping flying swimming sleeping dreaming reading writing painting "
        "singing dancing playing eating drinking watching waiting resting climbing floating drifting glowing "
        "shining hiding smiling laughing looking listening carrying holding building exploring wandering");
    const std::vector<std::string> prepositions = words(
        "in on under over near beside behind above below between across through along around inside outside "
        "toward against among");
    const std::vector<std::string> openings = {
        "a photo of",      "a painting of", "a drawing of",  "a watercolor of",    "an illustration of",
        "a sketch of",     "a picture of",  "a close up of", "an oil painting of", "a cartoon of",
        "a poster of",     "a render of",   "a portrait of", "a still life of",    "a snapshot of"};
    const std::vector<std::string> endings = {
        "at night",       "in the morning",         "at sunset",       "in winter",
        "in the rain",    "in the snow",            "with soft light", "in high detail",
        "on a sunny day", "under a starry sky",     "by the sea",      "in the style of an old film",
        "with a blurry background", "seen from above", "in warm colors", "in black and white"};
    uint64_t state = 20261130;
    const auto pick = [&state](const std::vector<std::string>& list) -> const std::string& {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      return list[(state >> 33) % list.size()];
    };
    std::vector<std::string> out;
    for (int i = 0; i < 2000; ++i) {
      std::string sentence = pick(openings) + " a " + pick(adjectives) + " " + pick(nouns);
      sentence += " " + pick(verbs) + " " + pick(prepositions) + " the " + pick(adjectives) + " " + pick(nouns);
      sentence += (i % 3 == 0 ? ", " : " ") + pick(endings) + (i % 2 == 0 ? "." : "");
      if (i % 4 == 0) sentence[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(sentence[0])));
      out.push_back(std::move(sentence));
    }
    // Every printable ASCII character, so that SentencePiece has a piece for each (no <unk> on
    // capitals, digits or punctuation).
    for (char first : {'!', '0', 'A', 'a'}) {
      std::string characters;
      for (char c = first; c <= '~' && c < first + 32; ++c) characters += std::string(1, c) + " ";
      out.push_back(characters);
    }
    return out;
  }();
  return sentences;
}

// CLIPTokenizer's files: a byte-level vocabulary (the 256 byte symbols, the same with "</w>", the
// tokens of merges learned from the built-in text, BOS and EOS last, as CLIP's), merges.txt and
// CLIP's special tokens. Returns the vocabulary size.
int64_t write_clip_tokenizer(const fs::path& dir) {
  // The words as CLIPTokenizer's pre-tokenizer sees them (the text is ASCII): lower case, runs of
  // letters, single digits, runs of other characters.
  std::map<std::string, int64_t> word_counts;
  for (const std::string& sentence : builtin_sentences()) {
    std::string word;
    for (size_t i = 0; i <= sentence.size(); ++i) {
      const auto c = static_cast<unsigned char>(i < sentence.size() ? sentence[i] : ' ');
      const auto kind = [](unsigned char x) { return std::isalpha(x) ? 0 : std::isdigit(x) ? 1 : std::isspace(x) ? 2 : 3; };
      if (!word.empty() && (kind(c) != kind(static_cast<unsigned char>(word.back())) || kind(c) == 1)) {
        ++word_counts[word];
        word.clear();
      }
      if (kind(c) != 2) word += static_cast<char>(std::tolower(c));
    }
  }
  std::vector<tokenizers::BpeWord> words;
  for (const auto& [word, count] : word_counts) {
    std::vector<std::string> symbols = tokenizers::split_characters(tokenizers::byte_level_encode(word));
    symbols.back() += "</w>";
    words.push_back({std::move(symbols), count});
  }
  const auto merges = tokenizers::learn_bpe_merges(std::move(words), 700);

  nlohmann::json vocab = nlohmann::json::object();
  int64_t next_id = 0;
  const auto add = [&](const std::string& token) {
    if (!vocab.contains(token)) vocab[token] = next_id++;
  };
  const std::vector<std::string> alphabet = tokenizers::byte_level_alphabet();
  for (const std::string& symbol : alphabet) add(symbol);
  for (const std::string& symbol : alphabet) add(symbol + "</w>");
  std::ofstream merges_file(dir / "merges.txt");
  merges_file << "#version: 0.2\n";
  for (const auto& [left, right] : merges) {
    add(left + right);
    merges_file << left << " " << right << "\n";
  }
  TORCH_CHECK(merges_file.good(), (dir / "merges.txt").string(), ": cannot write");
  const std::string bos = "<|startoftext|>", eos = "<|endoftext|>";
  add(bos);
  add(eos);
  write_json(dir / "vocab.json", vocab);

  const auto special = [](const std::string& content) { return added_token(content, /*normalized=*/true); };
  write_json(dir / "special_tokens_map.json",
             {{"bos_token", special(bos)}, {"eos_token", special(eos)}, {"pad_token", special(eos)},
              {"unk_token", special(eos)}});
  nlohmann::json added = nlohmann::json::object();
  for (const std::string& token : {bos, eos}) {
    added[std::to_string(vocab.at(token).get<int64_t>())] = added_token(token, true, false, /*special=*/true);
  }
  write_json(dir / "tokenizer_config.json", {{"added_tokens_decoder", added},
                                             {"bos_token", bos},
                                             {"clean_up_tokenization_spaces", false},
                                             {"eos_token", eos},
                                             {"errors", "replace"},
                                             {"extra_special_tokens", nlohmann::json::object()},
                                             {"model_max_length", 77},
                                             {"pad_token", eos},
                                             {"tokenizer_class", "CLIPTokenizer"},
                                             {"unk_token", eos}});
  return next_id;
}

// T5's tokenizer files: spiece.model, a unigram SentencePiece model trained on the built-in text
// (one thread, seeded: the same bytes every time) with T5's ids (pad 0, eos 1, unk 2, no BOS),
// and T5Tokenizer's 100 sentinel tokens <extra_id_N> after its pieces. Returns the vocabulary size.
int64_t write_t5_tokenizer(const fs::path& dir) {
  const std::string model = tokenizers::train_sentencepiece(builtin_sentences(),
                                                            {{"model_type", "unigram"},
                                                             {"vocab_size", "1000"},
                                                             // The text allows fewer pieces: take what it allows.
                                                             {"hard_vocab_limit", "false"},
                                                             {"character_coverage", "1.0"},
                                                             {"pad_id", "0"},
                                                             {"eos_id", "1"},
                                                             {"unk_id", "2"},
                                                             {"bos_id", "-1"},
                                                             {"num_threads", "1"},
                                                             {"minloglevel", "2"}},
                                                            /*seed=*/20261130);
  {
    std::ofstream out(dir / "spiece.model", std::ios::binary);
    out.write(model.data(), static_cast<std::streamsize>(model.size()));
    TORCH_CHECK(out.good(), (dir / "spiece.model").string(), ": cannot write");
  }
  const int64_t pieces = tokenizers::SentencePiece((dir / "spiece.model").string()).piece_size();
  constexpr int64_t kExtraIds = 100;

  const auto token = [](const std::string& content, bool strip) { return added_token(content, false, strip, true); };
  nlohmann::json added = nlohmann::json::object();
  added["0"] = token("<pad>", false);
  added["1"] = token("</s>", false);
  added["2"] = token("<unk>", false);
  std::vector<std::string> extra;
  for (int64_t i = 0; i < kExtraIds; ++i) {
    extra.push_back("<extra_id_" + std::to_string(i) + ">");
    added[std::to_string(pieces + kExtraIds - 1 - i)] = token(extra.back(), true);
  }
  write_json(dir / "special_tokens_map.json", {{"additional_special_tokens", extra},
                                               {"eos_token", added_token("</s>", false)},
                                               {"pad_token", added_token("<pad>", false)},
                                               {"unk_token", added_token("<unk>", false)}});
  write_json(dir / "tokenizer_config.json", {{"add_prefix_space", true},
                                             {"added_tokens_decoder", added},
                                             {"additional_special_tokens", extra},
                                             {"clean_up_tokenization_spaces", false},
                                             {"eos_token", "</s>"},
                                             {"extra_ids", kExtraIds},
                                             {"extra_special_tokens", nlohmann::json::object()},
                                             {"legacy", true},
                                             {"model_max_length", 512},
                                             {"pad_token", "<pad>"},
                                             {"sp_model_kwargs", nlohmann::json::object()},
                                             {"tokenizer_class", "T5Tokenizer"},
                                             {"unk_token", "<unk>"}});
  return pieces + kExtraIds;
}

// The trained transformer and VAE (tools/train_builtin_model.py): one safetensors file whose
// metadata holds the two config.json texts and whose tensors are `transformer.<name>` and
// `vae.<name>` (bf16), written out as float32 in diffusers' layout.
struct TrainedWeights {
  std::shared_ptr<io::SafetensorsFile> file;
  std::string label;
  nlohmann::json transformer_config;
  nlohmann::json vae_config;

  // Every parameter of `model` from the tensors under `prefix`, in float32.
  std::vector<std::pair<std::string, at::Tensor>> component(nn::Module& model, const std::string& prefix) const {
    std::vector<std::pair<std::string, at::Tensor>> weights;
    const std::vector<std::string> names = file->names();
    size_t used = 0;
    for (const auto& slot : model.named_parameters()) {
      const std::string name = prefix + slot.name;
      TORCH_CHECK(std::find(names.begin(), names.end(), name) != names.end(), label, ": no tensor ", io::quoted(name),
                  " for the config in its metadata; ", retrain_advice());
      at::Tensor values = file->read(name, at::kFloat);
      TORCH_CHECK(values.sizes() == slot.tensor->sizes(), label, ": ", io::quoted(name), " has shape ", values.sizes(),
                  ", the config in its metadata gives ", slot.tensor->sizes(), "; ", retrain_advice());
      weights.emplace_back(slot.name, std::move(values));
      ++used;
    }
    const auto count = static_cast<size_t>(
        std::count_if(names.begin(), names.end(), [&](const std::string& n) { return n.rfind(prefix, 0) == 0; }));
    TORCH_CHECK(used == count, label, ": ", count, " tensors under ", io::quoted(prefix), ", the config's model has ",
                used, " parameters; ", retrain_advice());
    return weights;
  }

  static std::string retrain_advice() {
    return "configure unpacks it again from src/shardit/models/builtin_weights.safetensors.xz (run "
           "scripts/build.sh); tools/train_builtin_model.py writes that file";
  }
};

TrainedWeights read_trained_weights() {
  const std::string path = builtin_weights_file();
  TrainedWeights out;
  out.label = "the built-in model's trained weights " + io::quoted(path);
  TORCH_CHECK(fs::exists(path), out.label, " do not exist: configure unpacks them from ",
              "src/shardit/models/builtin_weights.safetensors.xz into the build folder (run scripts/build.sh again)");
  out.file = io::SafetensorsFile::open(path);
  const auto config = [&](const char* key) {
    const auto found = out.file->metadata().find(key);
    TORCH_CHECK(found != out.file->metadata().end(), out.label, ": its metadata has no ", key, "; ",
                TrainedWeights::retrain_advice());
    nlohmann::json json = nlohmann::json::parse(found->second, nullptr, /*allow_exceptions=*/false);
    TORCH_CHECK(json.is_object(), out.label, ": its metadata's ", key, " is not a JSON object; ",
                TrainedWeights::retrain_advice());
    return json;
  };
  out.transformer_config = config("transformer_config");
  out.vae_config = config("vae_config");
  // The text encoders are written here: the transformer must take their widths.
  TORCH_CHECK(out.transformer_config.value("joint_attention_dim", int64_t{0}) == kT5DModel &&
                  out.transformer_config.value("pooled_projection_dim", int64_t{0}) == kClipHiddenSize,
              out.label, ": the transformer's joint_attention_dim and pooled_projection_dim must be ", kT5DModel,
              " and ", kClipHiddenSize, " (the built-in T5's and CLIP's widths); ", TrainedWeights::retrain_advice());
  // The transformer takes the VAE's latents packed in 2x2 patches.
  const int64_t latent_channels = out.vae_config.value("latent_channels", int64_t{0});
  const int64_t in_channels = out.transformer_config.value("in_channels", int64_t{0});
  TORCH_CHECK(latent_channels > 0 && in_channels == 4 * latent_channels, out.label,
              ": the transformer's in_channels (", in_channels, ") must be 4 times the VAE's latent_channels (",
              latent_channels, "): the pipeline packs 2x2 latent patches into one token; ",
              TrainedWeights::retrain_advice());
  return out;
}

// Seeded normal weights for every parameter of `model`, norm scales near 1 so that the
// activations stay in range.
std::vector<std::pair<std::string, at::Tensor>> random_weights(nn::Module& model, at::Generator& generator,
                                                               double std) {
  std::vector<std::pair<std::string, at::Tensor>> weights;
  for (const auto& slot : model.named_parameters()) {
    const bool is_norm_weight = slot.name.find("norm") != std::string::npos && slot.tensor->dim() == 1 &&
                                slot.name.size() > 7 && slot.name.compare(slot.name.size() - 7, 7, ".weight") == 0;
    weights.emplace_back(slot.name, at::normal(is_norm_weight ? 1.0 : 0.0, std, slot.tensor->sizes(), generator,
                                               at::TensorOptions().dtype(at::kFloat)));
  }
  return weights;
}

}  // namespace

namespace {

// What to do when the built-in model's folder cannot be made: it lives under TMPDIR.
std::string tmpdir_advice() {
  const char* tmpdir = std::getenv("TMPDIR");
  return tmpdir == nullptr ? std::string("it is written under /tmp (TMPDIR is not set); set TMPDIR to a writable folder")
                           : "it is written under TMPDIR (" + io::quoted(tmpdir) +
                                 "); set TMPDIR to a writable folder";
}

BuiltinModelPaths write_builtin_model_files(const std::string& root_path);

}  // namespace

std::string default_builtin_model_root() {
  std::error_code error;
  const fs::path temp = fs::temp_directory_path(error);
  TORCH_CHECK(!error, "the built-in model has no folder: ", error.message(), "; ", tmpdir_advice());
  // The number changes whenever the built-in's files do (6: the trained transformer and VAE), and
  // the trained weights' SHA-256 follows it, so a cache written by an older build, or from other
  // weights, is never taken for this one's.
  return (temp / ("shardit-builtin-6-" + builtin_weights_sha256().substr(0, 12))).string();
}

BuiltinModelPaths write_builtin_model(const std::string& root_path) {
  try {
    return write_builtin_model_files(root_path);
  } catch (const fs::filesystem_error& e) {
    TORCH_CHECK(false, "the built-in model cannot be written to ", root_path, ": ", e.code().message(),
                e.path1().empty() ? std::string() : " (" + e.path1().string() + ")", "; ", tmpdir_advice());
  }
}

namespace {

BuiltinModelPaths write_builtin_model_files(const std::string& root_path) {
  const fs::path root(root_path);
  BuiltinModelPaths paths{root.string(), (root / "transformer").string(), (root / "inputs").string(),
                          (root / "prompt_embeds.safetensors").string()};
  if (fs::exists(root / ".complete")) {
    // The folder lives in a shared temp folder: re-check it (headers and sizes, which catch a
    // truncated or replaced file) instead of failing forever on a damaged copy.
    try {
      io::Checkpoint::open(paths.transformer);
      io::SafetensorsFile::open((root / "inputs" / "inputs.safetensors").string());
      io::Checkpoint::open((root / "vae").string());
      io::SafetensorsFile::open(paths.prompt_embeds);
      io::Checkpoint::open((root / "text_encoder").string());
      io::Checkpoint::open((root / "text_encoder_2").string());
      tokenizers::load_tokenizer((root / "tokenizer").string(), tokenizers::TokenizerKind::Clip);
      tokenizers::load_tokenizer((root / "tokenizer_2").string(), tokenizers::TokenizerKind::T5);
      return paths;
    } catch (const std::exception&) {
      // Moved aside first, so that ranks starting together never see half a model.
      const fs::path damaged = root.string() + ".damaged-" + std::to_string(::getpid());
      std::error_code error;
      fs::rename(root, damaged, error);
      fs::remove_all(damaged, error);
    }
  }

  const TrainedWeights trained = read_trained_weights();  // a missing or damaged file fails before any write
  // Write into a private folder, then rename: ranks started together never see half a model.
  const fs::path staging = root.string() + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(staging);
  fs::create_directories(staging / "transformer");
  fs::create_directories(staging / "inputs");
  fs::create_directories(staging / "vae");
  for (const char* component : {"scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"}) {
    fs::create_directories(staging / component);
  }
  // As FLUX.1-dev's model_index.json lists them.
  write_json(staging / "model_index.json", {{"_class_name", "FluxPipeline"},
                                            {"scheduler", {"diffusers", "FlowMatchEulerDiscreteScheduler"}},
                                            {"text_encoder", {"transformers", "CLIPTextModel"}},
                                            {"text_encoder_2", {"transformers", "T5EncoderModel"}},
                                            {"tokenizer", {"transformers", "CLIPTokenizer"}},
                                            {"tokenizer_2", {"transformers", "T5TokenizerFast"}},
                                            {"transformer", {"diffusers", "FluxTransformer2DModel"}},
                                            {"vae", {"diffusers", "AutoencoderKL"}}});
  write_json(staging / "vae" / "config.json", trained.vae_config);
  write_json(staging / "scheduler" / "scheduler_config.json", builtin_scheduler_config());
  write_json(staging / "transformer" / "config.json", trained.transformer_config);

  // The transformer in two shards with an index, as diffusers saves large models.
  FluxTransformer2DModel model(FluxTransformer2DModelConfig::from_json(trained.transformer_config, trained.label));
  auto generator = at::make_generator<at::CPUGeneratorImpl>(20261130);
  std::vector<std::pair<std::string, at::Tensor>> shards[2];
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total_size = 0;
  const char* shard_names[2] = {"diffusion_pytorch_model-00001-of-00002.safetensors",
                                "diffusion_pytorch_model-00002-of-00002.safetensors"};
  for (auto& [name, values] : trained.component(model, "transformer.")) {
    const int shard = name.rfind("single_transformer_blocks", 0) == 0 ? 1 : 0;
    weight_map[name] = shard_names[shard];
    total_size += values.numel() * 4;
    shards[shard].emplace_back(std::move(name), std::move(values));
  }
  for (int s = 0; s < 2; ++s) io::save_safetensors((staging / "transformer" / shard_names[s]).string(), shards[s]);
  write_json(staging / "transformer" / "diffusion_pytorch_model.safetensors.index.json",
             {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}});

  // One input case: B=2, a 3x4 latent token grid, 6 text tokens.
  const int64_t batch = 2, grid_h = 3, grid_w = 4, text_len = 6;
  const auto randn = [&](std::vector<int64_t> shape) {
    return at::normal(0.0, 1.0, shape, generator, at::TensorOptions().dtype(at::kFloat));
  };
  const at::Tensor positions = at::arange(grid_h * grid_w, at::kLong);
  const at::Tensor img_ids =
      at::stack({at::zeros_like(positions), positions.div(grid_w, "floor"), positions.remainder(grid_w)}, 1)
          .to(at::kFloat);
  io::save_safetensors((staging / "inputs" / "inputs.safetensors").string(),
                       {{"hidden_states", randn({batch, grid_h * grid_w, model.config.in_channels})},
                        {"encoder_hidden_states", randn({batch, text_len, kT5DModel})},
                        {"pooled_projections", randn({batch, kClipHiddenSize})},
                        {"timestep", at::tensor({0.75f, 0.25f})},
                        {"img_ids", img_ids},
                        {"txt_ids", at::zeros({text_len, 3}, at::kFloat)},
                        {"guidance", at::tensor({3.5f, 3.5f})}});
  write_json(staging / "inputs" / "inputs.json",
             {{"model_class", "FluxTransformer2DModel"},
              {"batch_size", batch},
              {"latent_token_grid", {{"height", grid_h}, {"width", grid_w}}},
              {"text_len", text_len},
              {"notes", {"built-in tiny model input; timestep is t/1000 and guidance the guidance scale, as the pipeline passes them"}}});

  AutoencoderKL vae(AutoencoderKLConfig::from_json(trained.vae_config, trained.label));
  io::save_safetensors((staging / "vae" / "diffusion_pytorch_model.safetensors").string(),
                       trained.component(vae, "vae."));

  // The text encoders and their tokenizers, each encoder with a generator of its own. Their
  // vocabularies are the tokenizers' (T5's with the sentinel tokens).
  const std::map<std::string, std::string> transformers_metadata = {{"format", "pt"}};
  const nlohmann::json clip_config = builtin_clip_config(write_clip_tokenizer(staging / "tokenizer"));
  write_json(staging / "text_encoder" / "config.json", clip_config);
  CLIPTextModel clip(CLIPTextConfig::from_json(clip_config, "built-in CLIP config"));
  auto clip_generator = at::make_generator<at::CPUGeneratorImpl>(20261201);
  io::save_safetensors((staging / "text_encoder" / "model.safetensors").string(),
                       random_weights(clip, clip_generator, 0.1), transformers_metadata);
  const nlohmann::json t5_config = builtin_t5_config(write_t5_tokenizer(staging / "tokenizer_2"));
  write_json(staging / "text_encoder_2" / "config.json", t5_config);
  T5EncoderModel t5(T5Config::from_json(t5_config, "built-in T5 config"));
  auto t5_generator = at::make_generator<at::CPUGeneratorImpl>(20261202);
  io::save_safetensors((staging / "text_encoder_2" / "model.safetensors").string(),
                       random_weights(t5, t5_generator, 0.1), transformers_metadata);

  // Prompt embeddings for `--prompt-embeds` (T5's [1, L, joint] and CLIP's pooled [1, pooled]).
  io::save_safetensors((staging / "prompt_embeds.safetensors").string(),
                       {{"prompt_embeds", randn({1, 8, kT5DModel})}, {"pooled_prompt_embeds", randn({1, kClipHiddenSize})}});
  std::ofstream(staging / ".complete") << "ok\n";

  std::error_code error;
  fs::rename(staging, root, error);
  if (error) {
    // Another process finished first: keep its copy.
    fs::remove_all(staging);
    TORCH_CHECK(fs::exists(root / ".complete"), root.string(), ": cannot create the built-in model: ", error.message());
  }
  return paths;
}

}  // namespace

}  // namespace shardit::models

#include "support/qwen_edit_case.h"

#include <fstream>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/nn/module.h"
#include "shardit/io/safetensors.h"
#include "shardit/pipelines/image_processing_qwen2_vl.h"
#include "shardit/tokenizers/prompt_templates.h"
#include "support/test_support.h"

namespace shardit::testing {

std::shared_ptr<models::Qwen2_5_VLForConditionalGeneration> load_edit_text_encoder(
    const parallel::LoadOptions& options) {
  const auto folder = io::open_component(golden_path("edit_qwenimage"), "text_encoder");
  const std::string source = folder.dir + "/config.json";
  const models::Qwen3Config text = models::qwen2_5_vl_text_config_from_json(folder.config, source);
  auto model = std::make_shared<models::Qwen2_5_VLForConditionalGeneration>(
      text, models::qwen2_5_vl_image_config_from_json(folder.config, source, text));
  model->load(folder.weights(), options);
  return model;
}

std::map<std::string, at::Tensor> run_edit_encoder_cases(models::Qwen2_5_VLForConditionalGeneration& model) {
  const std::string dir = golden_path("edit_qwenimage");
  std::ifstream case_file(dir + "/case.json");
  const nlohmann::json cases = nlohmann::json::parse(case_file);
  std::ifstream config_file(dir + "/processor/preprocessor_config.json");
  const auto config = pipelines::Qwen2VLImageProcessorConfig::from_json(nlohmann::json::parse(config_file),
                                                                        "preprocessor_config.json");
  const auto golden = io::SafetensorsFile::open(dir + "/outputs.safetensors");
  std::map<std::string, at::Tensor> out;
  for (const auto& c : cases.at("encoder")) {
    const std::string key = "encoder." + c.at("name").get<std::string>();
    std::vector<pipelines::Qwen2VLImageInputs> images;
    for (size_t i = 0; i < c.at("images").size(); ++i) {
      images.push_back(pipelines::qwen2_vl_patchify(golden->read(key + ".processor_image." + std::to_string(i)), config));
    }
    const auto batch = pipelines::qwen2_vl_batch(images);
    const at::Tensor input_ids = golden->read(key + ".input_ids");
    const at::Tensor attention_mask = golden->read(key + ".attention_mask");
    std::map<std::string, at::Tensor> emitted;
    models::DecoderHiddenStates hidden;
    {
      const nn::ObserveForward observe([&](const std::string& path, const std::string& name, const at::Tensor& value) {
        if (path.empty()) emitted[name] = value;
      });
      hidden = model.forward_with_images(input_ids, attention_mask, batch.pixel_values, batch.image_grid_thw);
    }
    const auto embeds = models::qwenimage_prompt_embeds_from_hidden(hidden.last_hidden_state, attention_mask,
                                                                    tokenizers::kQwenImageEditDropIdx);
    out[key + ".image_embeds"] = emitted.at("image_embeds");
    out[key + ".position_ids"] = emitted.at("position_ids");
    out[key + ".prompt_embeds"] = embeds.prompt_embeds;
    out[key + ".prompt_embeds_mask"] = embeds.prompt_embeds_mask;
  }
  return out;
}

}  // namespace shardit::testing

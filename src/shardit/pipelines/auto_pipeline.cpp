#include "shardit/pipelines/auto_pipeline.h"

#include <c10/util/Exception.h>

#include "shardit/pipelines/pipeline_flux.h"
#include "shardit/pipelines/pipeline_flux2_klein.h"
#include "shardit/pipelines/pipeline_qwenimage.h"
#include "shardit/pipelines/pipeline_qwenimage_edit_plus.h"

namespace shardit::pipelines {

namespace {

/// The row of `Pipeline`, built from its folder and options, with its class's prompt encoding.
template <class Pipeline>
PipelineClass row(const char* class_name) {
  return {class_name,
          [](io::ModelFolder folder, const PipelineLoadOptions& options) -> std::unique_ptr<DiffusionPipeline> {
            return std::make_unique<Pipeline>(std::move(folder), options);
          },
          Pipeline::prompt_encoder_recipe(), Pipeline::kScheduleFamily};
}

}  // namespace

const std::vector<PipelineClass>& pipeline_classes() {
  static const std::vector<PipelineClass> table = {
      row<FluxPipeline>("FluxPipeline"),
      row<FluxKontextPipeline>("FluxKontextPipeline"),  // FluxPipeline's prompt encoding
      row<Flux2KleinPipeline>("Flux2KleinPipeline"),
      row<Flux2Pipeline>("Flux2Pipeline"),
      row<QwenImagePipeline>("QwenImagePipeline"),
      row<QwenImageEditPipeline>("QwenImageEditPipeline"),
      row<QwenImageEditPlusPipeline>("QwenImageEditPlusPipeline"),
  };
  return table;
}

const PipelineClass* find_pipeline_class(const std::string& class_name) {
  for (const auto& entry : pipeline_classes()) {
    if (entry.class_name == class_name) return &entry;
  }
  return nullptr;
}

const PipelineClass& pipeline_class(const std::string& class_name, const std::string& source) {
  if (const PipelineClass* entry = find_pipeline_class(class_name)) return *entry;
  std::string supported;
  for (const auto& entry : pipeline_classes()) supported += (supported.empty() ? "" : ", ") + entry.class_name;
  TORCH_CHECK(false, source, " '", class_name, "' is not a supported pipeline (supported: ", supported, ")");
}

std::unique_ptr<DiffusionPipeline> DiffusionPipeline::open(const std::string& path,
                                                           const PipelineLoadOptions& options) {
  io::ModelFolder folder = io::ModelFolder::open(path);
  TORCH_CHECK(folder.is_pipeline(), path, " has no model_index.json; give a diffusers pipeline folder");
  const std::string name = options.pipeline_class.value_or(folder.model_index().value("_class_name", std::string()));
  const PipelineClass& entry =
      pipeline_class(name, options.pipeline_class ? std::string("--pipeline") : path + "/model_index.json: _class_name");
  std::unique_ptr<DiffusionPipeline> pipeline = entry.create(std::move(folder), options);
  pipeline->check_parallel();
  return pipeline;
}

std::unique_ptr<DiffusionPipeline> DiffusionPipeline::from_pretrained(const std::string& path,
                                                                      const PipelineLoadOptions& options) {
  auto pipeline = open(path, options);
  pipeline->load();
  return pipeline;
}

}  // namespace shardit::pipelines

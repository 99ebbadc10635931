#pragma once
// The pipeline classes shardit builds, one row each (diffusers' AutoPipeline mapping): the class
// name model_index.json gives, how the class is built, and its prompt encoding. DiffusionPipeline::
// open() builds from this table; a new pipeline class is its own files plus one row here.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/pipelines/pipeline.h"
#include "shardit/pipelines/prompt_encoders.h"

namespace shardit::pipelines {

/// One pipeline class: its model_index.json `_class_name`, its factory (weights not yet loaded)
/// and its prompt encoding (`<Pipeline>::prompt_encoder_recipe()`).
struct PipelineClass {
  std::string class_name;  ///< "FluxPipeline"
  std::function<std::unique_ptr<DiffusionPipeline>(io::ModelFolder folder, const PipelineLoadOptions& options)> create;
  PromptEncoderRecipe prompt_encoder;
  /// How `shardit schedule --family` names its schedule (`<Pipeline>::kScheduleFamily`): "flux1"
  /// and "qwenimage" shift by calculate_shift, "flux2" by compute_empirical_mu.
  std::string schedule_family;
};

/// Every supported pipeline class.
const std::vector<PipelineClass>& pipeline_classes();

/// The class named `class_name`, or null.
const PipelineClass* find_pipeline_class(const std::string& class_name);

/// The class named `class_name`; an error naming `source` (where the name came from) and listing
/// the supported classes otherwise.
const PipelineClass& pipeline_class(const std::string& class_name, const std::string& source);

}  // namespace shardit::pipelines

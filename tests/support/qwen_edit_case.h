#pragma once
// The Qwen-Image editing conditioning cases of tests/golden/edit_qwenimage: Qwen2.5-VL with its
// vision tower loaded from the case's text_encoder/ folder, and each encoder case (1, 2, 3
// images) run from the golden processor images and token ids.
#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>

#include "shardit/models/qwen/modeling_qwen2_5_vl.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::testing {

/// The case's text encoder with its vision tower, loaded with `options` (TP through
/// options.tensor_parallel).
std::shared_ptr<models::Qwen2_5_VLForConditionalGeneration> load_edit_text_encoder(
    const parallel::LoadOptions& options = {});

/// Every encoder case: "encoder.<name>.image_embeds", ".position_ids", ".prompt_embeds",
/// ".prompt_embeds_mask" as the golden file names them.
std::map<std::string, at::Tensor> run_edit_encoder_cases(models::Qwen2_5_VLForConditionalGeneration& model);

}  // namespace shardit::testing

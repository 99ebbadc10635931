#pragma once
// Verification plumbing for the golden-data layout that the CLI's verification commands and the
// tests use: a transformer's forward arguments read from a case file (inputs.safetensors, named as
// the keyword arguments in diffusers, plus the non-tensor ones in inputs.json next to it), and
// intermediates named as the golden outputs.
#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>

#include "shardit/io/model_folder.h"
#include "shardit/io/safetensors.h"
#include "shardit/nn/module.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::verify {

/// Runs one forward of a transformer (built by models::create_transformer) on the tensors of a
/// case's inputs file (JointTransformer2DModel::forward_from_file: each class reads its own
/// arguments). Returns the sample.
at::Tensor forward_from_file(parallel::TensorParallelModule& model, const io::SafetensorsFile& inputs);

/// Receives intermediates under their golden names.
using GoldenRecorder = std::function<void(const std::string& name, const at::Tensor& value)>;

/// A ForwardObserver that names what modules emit as the golden outputs do: the model's own
/// tensors and those of its embedders as emitted ("x_embedder", "temb.timestep_proj",
/// "block.transformer_blocks.0.hidden_states"), tensors of a block or anything inside one as
/// "debug.<module path>.<name>" ("debug.transformer_blocks.0.norm1.linear").
nn::ForwardObserver golden_observer(GoldenRecorder record);

}  // namespace shardit::verify

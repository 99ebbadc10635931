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
#include "shardit/models/flux/transformer_flux.h"
#include "shardit/models/flux2/transformer_flux2.h"
#include "shardit/models/qwen_image/transformer_qwenimage.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::verify {

/// The forward arguments of each transformer read from a case file, named as the keyword
/// arguments (`guidance` optional).
models::FluxTransformer2DModelInputs read_flux_inputs(const io::SafetensorsFile& file);
models::Flux2Transformer2DModelInputs read_flux2_inputs(const io::SafetensorsFile& file);
/// img_shapes come from an `img_shapes` int64 tensor ([B, K, 3] or [B, 3]) in the file if there is
/// one, otherwise from `non_tensor_kwargs.img_shapes` of the inputs.json next to the file.
models::QwenImageTransformer2DModelInputs read_qwenimage_inputs(const io::SafetensorsFile& file);

/// Runs one forward of a transformer (built by models::create_transformer) on the tensors of a
/// case's inputs file. Returns the sample.
at::Tensor forward_from_file(parallel::TensorParallelModule& model, const io::SafetensorsFile& inputs);

/// Receives intermediates under their golden names.
using GoldenRecorder = std::function<void(const std::string& name, const at::Tensor& value)>;

/// A ForwardObserver that names what modules emit as the golden outputs do: the model's own
/// tensors and those of its embedders as emitted ("x_embedder", "temb.timestep_proj",
/// "block.transformer_blocks.0.hidden_states"), tensors of a block or anything inside one as
/// "debug.<module path>.<name>" ("debug.transformer_blocks.0.norm1.linear").
nn::ForwardObserver golden_observer(GoldenRecorder record);

}  // namespace shardit::verify

#pragma once
// Builds a transformer from a diffusers component folder by its config's `_class_name`.
#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardit/io/model_folder.h"
#include "shardit/parallel/tensor_parallel.h"

namespace shardit::models {

class AutoencoderModel;

/// Receives named intermediate tensors during a forward (parity tests compare them with the
/// reference's). An empty recorder records nothing and costs nothing. A recorded tensor may be
/// reused (overwritten in place) after the call returns: copy what you keep.
using IntermediateRecorder = std::function<void(const std::string& name, const at::Tensor& value)>;

/// A recorder that prepends `prefix` to every name ("block.transformer_blocks.0."); empty (and
/// free) when `record` is.
IntermediateRecorder prefixed_recorder(const IntermediateRecorder& record, std::string prefix);

/// The transformer class named by `folder`'s config.json `_class_name`, built from that config
/// with its parameters declared on the meta device (load them with TensorParallelModule::load).
/// Errors name the folder and list the supported classes.
std::shared_ptr<parallel::TensorParallelModule> create_transformer(const io::ComponentFolder& folder);

/// One forward of `model` (made by create_transformer) on the tensors of `inputs`, named as the
/// forward's keyword arguments in diffusers (the golden-data `inputs.safetensors` layout). Returns
/// the sample; `record` receives the model's named intermediates.
at::Tensor forward_from_file(parallel::TensorParallelModule& model, const io::SafetensorsFile& inputs,
                             const IntermediateRecorder& record = {});

/// The `_class_name` values create_transformer accepts.
std::vector<std::string> supported_transformer_classes();

/// The VAE class named by `folder`'s config.json `_class_name` (AutoencoderKL,
/// AutoencoderKLFlux2, AutoencoderKLQwenImage), built from that config with its decoder
/// parameters on the meta device (load them with TensorParallelModule::load). Errors name the
/// folder and list the supported classes.
std::shared_ptr<AutoencoderModel> create_vae(const io::ComponentFolder& folder);

/// The `_class_name` values create_vae accepts.
std::vector<std::string> supported_vae_classes();

}  // namespace shardit::models

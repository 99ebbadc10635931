#include "shardit/verify/transformer_case.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "shardit/io/file.h"
#include "shardit/io/json.h"
#include "shardit/models/flux/transformer_flux.h"
#include "shardit/models/flux2/transformer_flux2.h"
#include "shardit/models/qwen_image/transformer_qwenimage.h"

namespace shardit::verify {

namespace {

/// The directory part of a file path ("." when there is none).
std::string parent_dir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::optional<at::Tensor> read_optional(const io::SafetensorsFile& file, const char* name) {
  if (!file.contains(name)) return std::nullopt;
  return file.read(name);
}

}  // namespace

models::FluxTransformer2DModelInputs read_flux_inputs(const io::SafetensorsFile& file) {
  models::FluxTransformer2DModelInputs inputs;
  inputs.hidden_states = file.read("hidden_states");
  inputs.encoder_hidden_states = file.read("encoder_hidden_states");
  inputs.pooled_projections = file.read("pooled_projections");
  inputs.timestep = file.read("timestep");
  inputs.img_ids = file.read("img_ids");
  inputs.txt_ids = file.read("txt_ids");
  inputs.guidance = read_optional(file, "guidance");
  return inputs;
}

models::Flux2Transformer2DModelInputs read_flux2_inputs(const io::SafetensorsFile& file) {
  models::Flux2Transformer2DModelInputs inputs;
  inputs.hidden_states = file.read("hidden_states");
  inputs.encoder_hidden_states = file.read("encoder_hidden_states");
  inputs.timestep = file.read("timestep");
  inputs.img_ids = file.read("img_ids");
  inputs.txt_ids = file.read("txt_ids");
  inputs.guidance = read_optional(file, "guidance");
  return inputs;
}

namespace {

using QwenShapes = std::vector<std::vector<models::QwenImageShape>>;

/// One (frame, height, width) grid read from a file, bounded so that the token counts of up to
/// kMaxConfigLayers grids can never wrap around (which would pass the token-count check).
models::QwenImageShape checked_grid(int64_t frame, int64_t height, int64_t width, const std::string& source) {
  for (const int64_t value : {frame, height, width}) {
    TORCH_CHECK(value >= 1 && value <= io::kMaxConfigDim, source, ": img_shapes grid (", frame, ", ", height, ", ",
                width, ") has an entry out of the accepted range [1, ", io::kMaxConfigDim, "]");
  }
  // Each entry is at most 2^20, so the product fits 64 bits.
  TORCH_CHECK(frame * height * width <= io::kMaxConfigDim * io::kMaxConfigDim, source, ": img_shapes grid (", frame,
              ", ", height, ", ", width, ") holds more tokens than any image can");
  return {frame, height, width};
}

/// img_shapes from an int64 tensor [B, K, 3] or [B, 3].
QwenShapes shapes_from_tensor(const at::Tensor& tensor, const std::string& source) {
  TORCH_CHECK((tensor.dim() == 2 || tensor.dim() == 3) && tensor.size(-1) == 3, source,
              ": img_shapes must be [B, 3] or [B, K, 3] (frame, height, width), got ", tensor.sizes());
  TORCH_CHECK(!at::isFloatingType(tensor.scalar_type()) && tensor.scalar_type() != at::kBool, source,
              ": img_shapes must be an integer tensor, got ", tensor.scalar_type());
  TORCH_CHECK(tensor.dim() == 2 || tensor.size(1) <= io::kMaxConfigLayers, source, ": img_shapes lists ",
              tensor.size(1), " grids per sample, more than ", io::kMaxConfigLayers);
  const at::Tensor values = (tensor.dim() == 2 ? tensor.unsqueeze(1) : tensor).to(at::kLong).contiguous();
  QwenShapes shapes(values.size(0));
  const auto acc = values.accessor<int64_t, 3>();
  for (int64_t b = 0; b < values.size(0); ++b) {
    for (int64_t k = 0; k < values.size(1); ++k) {
      shapes[b].push_back(checked_grid(acc[b][k][0], acc[b][k][1], acc[b][k][2], source));
    }
  }
  return shapes;
}

/// img_shapes from inputs.json's non_tensor_kwargs: [[[f, h, w], ...], ...].
QwenShapes shapes_from_json(const std::string& json_path) {
  TORCH_CHECK(io::regular_file_problem(json_path).empty(), io::regular_file_problem(json_path),
              "; QwenImageTransformer2DModel needs img_shapes (the (frame, height, width) token grid of each sample): ",
              "put an `img_shapes` int64 tensor [B, K, 3] in the inputs file or `non_tensor_kwargs.img_shapes` in an ",
              "inputs.json next to it");
  const nlohmann::json json = io::read_json_file(json_path);
  TORCH_CHECK(json.is_object() && json.contains("non_tensor_kwargs") && json["non_tensor_kwargs"].is_object() &&
                  json["non_tensor_kwargs"].contains("img_shapes"),
              json_path, ": no non_tensor_kwargs.img_shapes; QwenImageTransformer2DModel needs the token grid of ",
              "each sample as [[[frame, height, width], ...], ...]");
  const nlohmann::json& value = json["non_tensor_kwargs"]["img_shapes"];
  TORCH_CHECK(value.is_array(), json_path, ": non_tensor_kwargs.img_shapes must be a list per sample");
  QwenShapes shapes;
  for (const auto& sample : value) {
    TORCH_CHECK(sample.is_array() && sample.size() <= static_cast<size_t>(io::kMaxConfigLayers), json_path,
                ": each img_shapes entry must be a list of at most ", io::kMaxConfigLayers, " [frame, height, width]");
    std::vector<models::QwenImageShape> grids;
    for (const auto& grid : sample) {
      TORCH_CHECK(grid.is_array() && grid.size() == 3 && grid[0].is_number_integer() && grid[1].is_number_integer() &&
                      grid[2].is_number_integer(),
                  json_path, ": each grid of img_shapes must be [frame, height, width] integers, got ", grid.dump());
      grids.push_back(checked_grid(grid[0].get<int64_t>(), grid[1].get<int64_t>(), grid[2].get<int64_t>(), json_path));
    }
    shapes.push_back(std::move(grids));
  }
  return shapes;
}

}  // namespace

models::QwenImageTransformer2DModelInputs read_qwenimage_inputs(const io::SafetensorsFile& file) {
  models::QwenImageTransformer2DModelInputs inputs;
  inputs.hidden_states = file.read("hidden_states");
  inputs.encoder_hidden_states = file.read("encoder_hidden_states");
  inputs.encoder_hidden_states_mask = read_optional(file, "encoder_hidden_states_mask");
  inputs.timestep = file.read("timestep");
  inputs.img_shapes = file.contains("img_shapes") ? shapes_from_tensor(file.read("img_shapes"), file.path())
                                                  : shapes_from_json(parent_dir(file.path()) + "/inputs.json");
  return inputs;
}

namespace {

/// Runs `Model`'s forward when `model` is one; nullopt otherwise.
template <class Model, class Read>
std::optional<at::Tensor> forward_as(parallel::TensorParallelModule& model, const io::SafetensorsFile& file,
                                     Read read) {
  auto* typed = dynamic_cast<Model*>(&model);
  if (typed == nullptr) return std::nullopt;
  return typed->forward(read(file));
}

bool is_index(const std::string& segment) {
  return !segment.empty() && std::all_of(segment.begin(), segment.end(), [](char c) { return std::isdigit(c); });
}

/// True when the dotted path goes through a module-list entry ("transformer_blocks.0...").
bool inside_block(const std::string& path) {
  size_t begin = 0;
  while (begin < path.size()) {
    const size_t dot = path.find('.', begin);
    if (is_index(path.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin))) return true;
    if (dot == std::string::npos) break;
    begin = dot + 1;
  }
  return false;
}

}  // namespace

at::Tensor forward_from_file(parallel::TensorParallelModule& model, const io::SafetensorsFile& inputs) {
  if (auto out = forward_as<models::FluxTransformer2DModel>(model, inputs, read_flux_inputs)) return *out;
  if (auto out = forward_as<models::Flux2Transformer2DModel>(model, inputs, read_flux2_inputs)) return *out;
  if (auto out = forward_as<models::QwenImageTransformer2DModel>(model, inputs, read_qwenimage_inputs)) return *out;
  TORCH_CHECK(false, inputs.path(), ": no input reader for a ", model.type_name());
}

nn::ForwardObserver golden_observer(GoldenRecorder record) {
  return [record = std::move(record)](const std::string& path, const std::string& name, const at::Tensor& value) {
    record(inside_block(path) ? "debug." + path + "." + name : name, value);
  };
}

}  // namespace shardit::verify

#include "shardit/models/memory_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "shardit/models/joint_transformer.h"

namespace shardit::models {

ComponentMemory memory_of(const parallel::ResolvedPlan& resolved) {
  ComponentMemory memory;
  memory.plan = parallel::tp_plan_kind_name(resolved.plan);
  memory.tp_degree = resolved.tp_degree;
  std::vector<int64_t> rank_parameters(static_cast<size_t>(resolved.tp_degree), 0);
  for (const auto& spec : resolved.parameters) {
    int64_t numel = 1;
    for (int64_t size : spec.full_shape) numel *= size;
    memory.bytes_total += spec.full_bytes();
    if (spec.is_buffer) continue;
    memory.parameters_total += numel;
    if (!spec.is_sharded()) {
      memory.parameters_replicated += numel;
      for (auto& count : rank_parameters) count += numel;
      continue;
    }
    memory.parameters_sharded += numel;
    const int64_t row = numel / spec.full_shape[static_cast<size_t>(spec.dim)];
    for (int rank = 0; rank < resolved.tp_degree; ++rank) {
      int64_t held = 0;
      for (const auto& range : spec.ranges_per_rank[static_cast<size_t>(rank)]) held += range.size();
      rank_parameters[static_cast<size_t>(rank)] += held * row;
    }
  }
  for (int rank = 0; rank < resolved.tp_degree; ++rank) {
    memory.per_rank_parameters = std::max(memory.per_rank_parameters, rank_parameters[static_cast<size_t>(rank)]);
    memory.per_rank_bytes = std::max(memory.per_rank_bytes, resolved.bytes_on_rank(rank));
  }
  return memory;
}

int64_t image_tokens(const StepShape& shape, int64_t pixels_per_token) {
  TORCH_CHECK(shape.height > 0 && shape.width > 0 && shape.height % pixels_per_token == 0 &&
                  shape.width % pixels_per_token == 0,
              "--height and --width must be positive multiples of ", pixels_per_token, " pixels, got ", shape.height,
              "x", shape.width);
  return (shape.height / pixels_per_token) * (shape.width / pixels_per_token);
}

namespace {

StepModel step_model(const parallel::TensorParallelModule& model, const StepShape& shape) {
  const auto* joint = dynamic_cast<const JointTransformer2DModel*>(&model);
  TORCH_CHECK(joint != nullptr, model.type_name(), ": no activation estimate for this class");
  return joint->step_model(shape);
}

/// The attention scores one rank holds at once.
int64_t scores_bytes(const StepModel& step, int tp_degree, at::ScalarType dtype, const StepShape& shape) {
  if (shape.attention_backend == "memory_efficient") return 0;
  TORCH_CHECK(shape.attention_backend == "math", "attention backend '", shape.attention_backend,
              "': the estimate knows 'math' (scores in head groups) and 'memory_efficient' (no score matrix)");
  const int64_t local_heads = step.heads / tp_degree;
  const int64_t per_head = shape.batch * step.attention_tokens * step.attention_tokens * 4;
  const int64_t group = std::clamp<int64_t>(shape.scores_budget_bytes / per_head, 1, std::max<int64_t>(1, local_heads));
  // Scores in the model dtype, the softmax in fp32, then its cast back: all live at the cast.
  const double element = static_cast<double>(at::elementSize(dtype)) / 4.0;
  const double copies = element >= 1.0 ? 2.0 : 1.0 + 2.0 * element;
  return static_cast<int64_t>(copies * static_cast<double>(group * per_head));
}

}  // namespace

int64_t transformer_step_activation_bytes(const parallel::TensorParallelModule& model, int tp_degree,
                                          at::ScalarType dtype, const StepShape& shape) {
  TORCH_CHECK(shape.batch > 0 && shape.text_tokens >= 0, "--batch must be positive and text tokens non-negative, got ",
              shape.batch, " and ", shape.text_tokens);
  const StepModel step = step_model(model, shape);
  const int64_t element = static_cast<int64_t>(at::elementSize(dtype));
  int64_t peak = 0;
  for (size_t i = 0; i < step.phases.size(); ++i) {
    const Phase& phase = step.phases[i];
    int64_t bytes = shape.batch * phase.tokens * (phase.full + phase.local / tp_degree) * element;
    if (phase.attention) bytes += scores_bytes(step, tp_degree, dtype, shape);
    peak = std::max(peak, bytes);
  }
  return peak;
}

int64_t vae_decode_activation_bytes(const nlohmann::json& config, const std::string& source, at::ScalarType dtype,
                                    const StepShape& shape) {
  // AutoencoderKL / AutoencoderKLFlux2 name the widths block_out_channels; AutoencoderKLQwenImage
  // base_dim * dim_mult.
  const io::ConfigReader reader(config, source);
  std::vector<int64_t> widths =
      reader.integers("block_out_channels", {}, 1, io::kMaxConfigDim, static_cast<size_t>(io::kMaxConfigLayers));
  if (widths.empty()) {
    const int64_t base = reader.integer("base_dim", 96, 1, io::kMaxConfigDim);
    for (const int64_t mult :
         reader.integers("dim_mult", {1, 2, 4, 4}, 1, io::kMaxConfigDim, static_cast<size_t>(io::kMaxConfigLayers))) {
      widths.push_back(reader.width("base_dim", base, "dim_mult", mult));
    }
  }
  TORCH_CHECK(widths.size() >= 2, source, ": expected at least two decoder widths, got ", widths.size());
  const int64_t pixels = shape.batch * shape.height * shape.width;
  const int64_t element = static_cast<int64_t>(at::elementSize(dtype));
  // At full resolution: the upsampled input of the last up block (widths[1] channels), then its
  // resnets at widths[0]: input, GroupNorm/SiLU output, conv output, residual sum.
  const int64_t full_resolution = pixels * (widths[1] + 3 * widths[0]) * element;
  // The mid block's single-head attention over every latent pixel (8x downsampled): fp32 scores
  // and softmax, one head, so no grouping bounds it.
  const int64_t latent = shape.batch * (shape.height / 8) * (shape.width / 8);
  const int64_t attention = 2 * latent * (latent / shape.batch) * 4;
  return std::max(full_resolution, attention);
}

}  // namespace shardit::models

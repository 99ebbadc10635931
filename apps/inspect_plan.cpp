#include "apps/inspect_plan.h"

#include <filesystem>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "shardit/core/dtype.h"
#include "shardit/core/error.h"
#include "shardit/core/units.h"
#include "shardit/models/registry.h"
#include "shardit/pipelines/auto_pipeline.h"

namespace shardit::apps {

namespace {

using parallel::TpPlanKind;


/// One component the registry builds, on the meta device.
struct PlannedComponent {
  std::string name;
  std::string class_name;
  models::ComponentKind kind;
  std::shared_ptr<parallel::TensorParallelModule> model;
  nlohmann::json config;
  std::string source;  ///< its config.json
  /// Shown beside the others but not in the totals (another form of a counted component).
  bool counted = true;
  /// A transformer's weights from a single file (--transformer): counted as stored.
  std::optional<io::Checkpoint> stored_weights;

  /// A component with no plan entries is replicated at every degree.
  bool shardable() const { return !model->tp_plan().empty(); }
  bool has_reference() const { return model->reference_tp_plan() != nullptr; }

  /// Its memory at `tp` under `kind` (the full plan for a class the reference has no plan for),
  /// a transformer's 8-bit Linears in one byte (`weights`: pipelines quantize the transformer only).
  models::ComponentMemory memory(int tp, TpPlanKind kind, at::ScalarType dtype, nn::WeightsDtype weights) const {
    const TpPlanKind used = kind == TpPlanKind::Reference && !has_reference() ? TpPlanKind::Full : kind;
    const nn::WeightsDtype held = this->kind == models::ComponentKind::Transformer ? weights : nn::WeightsDtype::Checkpoint;
    const int degree = shardable() ? tp : 1;
    models::ComponentMemory memory = models::memory_of(
        stored_weights ? model->resolve_as_stored(*stored_weights, degree, dtype, used, held)
                       : model->resolve(degree, dtype, used, held));
    memory.component = name;
    memory.class_name = class_name;
    if (!shardable()) memory.plan = "replicated";
    memory.tp_degree = tp;
    return memory;
  }
};

PlannedComponent plan_component(const io::ComponentFolder& folder, const models::ComponentClass& entry) {
  return {folder.name,   entry.class_name, entry.kind, entry.create_module(folder), folder.config,
          folder.dir + "/config.json", true, std::nullopt};
}

/// What `pipeline` holds of `whole` when it loads less than the whole checkpoint (a text encoder
/// slot with build_part, as FLUX.2 [dev]'s Mistral-3: only the layers up to the last hidden state
/// it stacks); nothing when it holds the whole model or has no such slot.
std::optional<PlannedComponent> as_pipeline_holds(const PlannedComponent& whole, const pipelines::PipelineClass& pipeline,
                                                  const io::ComponentFolder& folder) {
  for (const pipelines::TextEncoderSlot& slot : pipeline.prompt_encoder.slots) {
    if (slot.class_name != whole.class_name || !slot.build_part) continue;
    pipelines::HeldTextEncoder held = slot.build_part(folder);
    if (held.part.empty()) return std::nullopt;
    PlannedComponent part = whole;
    part.name = fmt::format("{} ({}, as {} loads it)", whole.name.empty() ? slot.text_encoder : whole.name, held.part,
                            pipeline.class_name);
    part.model = held.module;
    return part;
  }
  return std::nullopt;
}

struct Planned {
  std::vector<PlannedComponent> components;
  std::vector<std::pair<std::string, std::string>> not_counted;  ///< component, why

  /// The degree `component` is split over when the transformer is at `tp`: the text encoders'
  /// own degree (`text_encoder_tp`, else the largest divisor of `tp` that all of them allow, as a
  /// pipeline loads them), `tp` for the others.
  int degree_of(const PlannedComponent& component, int tp, at::ScalarType dtype,
                std::optional<int> text_encoder_tp) const {
    if (component.kind != models::ComponentKind::TextEncoder) return tp;
    if (text_encoder_tp) return *text_encoder_tp;
    for (int degree = tp; degree > 1; --degree) {
      if (tp % degree != 0) continue;
      const bool fits = std::all_of(components.begin(), components.end(), [&](const PlannedComponent& other) {
        if (other.kind != models::ComponentKind::TextEncoder) return true;
        try {
          other.model->resolve(degree, dtype);
          return true;
        } catch (const c10::Error&) {
          return false;
        }
      });
      if (fits) return degree;
    }
    return 1;
  }
};

/// The components of `folder`: a component folder must be of a registered class (the registry's
/// error otherwise); a pipeline's components are built when their class is registered.
Planned plan_folder(const io::ModelFolder& folder) {
  Planned planned;
  if (!folder.is_pipeline()) {
    const io::ComponentFolder component = folder.component("");
    const models::ComponentClass* entry = find_module_class(component.class_name());
    // An unknown class gets the registry's own error, as when the weights are present.
    if (entry == nullptr) models::create_module_component(component);
    planned.components.push_back(plan_component(component, *entry));
    // A text encoder folder of which a pipeline loads only part (FLUX.2 [dev]'s): the whole
    // checkpoint, and beside it what that pipeline holds.
    for (const pipelines::PipelineClass& pipeline : pipelines::pipeline_classes()) {
      if (auto held = as_pipeline_holds(planned.components.front(), pipeline, component)) {
        held->counted = false;
        planned.components.push_back(*held);
      }
    }
    return planned;
  }
  const pipelines::PipelineClass* pipeline =
      pipelines::find_pipeline_class(folder.model_index().value("_class_name", std::string()));
  for (const auto& name : folder.components()) {
    const nlohmann::json& declared = folder.model_index().at(name);
    const std::string class_name = declared.is_array() && declared.size() == 2 && declared[1].is_string()
                                       ? declared[1].get<std::string>()
                                       : std::string();
    const models::ComponentClass* entry = find_module_class(class_name);
    if (entry == nullptr) {
      planned.not_counted.emplace_back(name, class_name.empty() ? "no class" : class_name + ": no weights, or not in the registry yet");
      continue;
    }
    if (!std::filesystem::is_directory(std::filesystem::path(folder.root()) / name)) {
      planned.not_counted.emplace_back(name, class_name + ": no " + name + "/ folder here");
      continue;
    }
    const io::ComponentFolder component = folder.component(name);
    planned.components.push_back(plan_component(component, *entry));
    // A pipeline that loads only part of a text encoder holds that part on its ranks.
    if (pipeline != nullptr) {
      if (auto held = as_pipeline_holds(planned.components.back(), *pipeline, component)) {
        planned.components.back() = *held;
      }
    }
  }
  TORCH_CHECK(!planned.components.empty(), folder.root(), ": no component of a supported class; supported transformers: ",
              fmt::format("{}", fmt::join(models::supported_classes(models::ComponentKind::Transformer), ", ")));
  return planned;
}

/// Billions, or the plain count for models under ten million parameters (test models).
std::string billions(int64_t count) {
  return count < 10'000'000 ? std::to_string(count) : fmt::format("{:.3f}B", static_cast<double>(count) / 1e9);
}

nlohmann::json to_json(const models::ComponentMemory& memory) {
  return {{"component", memory.component},
          {"class_name", memory.class_name},
          {"plan", memory.plan},
          {"tp_degree", memory.tp_degree},
          {"parameters_total", memory.parameters_total},
          {"parameters_replicated", memory.parameters_replicated},
          {"parameters_sharded", memory.parameters_sharded},
          {"per_rank_parameters", memory.per_rank_parameters},
          {"bytes_total", memory.bytes_total},
          {"per_rank_bytes", memory.per_rank_bytes}};
}

/// Activation peaks of one step per rank at `tp`: the largest transformer step and VAE decode
/// (they run one after the other, so the larger one counts).
struct Activations {
  int64_t transformer = 0;
  int64_t vae_decode = 0;
  int64_t peak() const { return std::max(transformer, vae_decode); }
};

Activations activations(const Planned& planned, int tp, const MemoryPlanRequest& request) {
  Activations out;
  if (!request.step) return out;
  for (const auto& component : planned.components) {
    if (component.kind == models::ComponentKind::Transformer) {
      out.transformer = std::max(out.transformer, models::transformer_step_activation_bytes(
                                                      *component.model, tp, request.dtype, *request.step));
    } else if (component.kind == models::ComponentKind::Vae) {
      out.vae_decode = std::max(out.vae_decode, models::vae_decode_activation_bytes(component.config, component.source,
                                                                                   request.dtype, *request.step));
    }
  }
  return out;
}

/// The weights one rank holds at `tp` under `kind`, over every counted component.
int64_t per_rank_weights(const Planned& planned, int tp, TpPlanKind kind, const MemoryPlanRequest& request) {
  int64_t bytes = 0;
  for (const auto& component : planned.components) {
    if (!component.counted) continue;
    const int degree = planned.degree_of(component, tp, request.dtype, request.text_encoder_tp);
    bytes += component.memory(degree, kind, request.dtype, request.weights).per_rank_bytes;
  }
  return bytes;
}

/// The degrees a verdict is given for: 1, 2, 4, 8 and the requested one.
std::vector<int> verdict_degrees(int tp) {
  std::set<int> degrees = {1, 2, 4, 8, tp};
  return {degrees.begin(), degrees.end()};
}

}  // namespace

const models::ComponentClass* find_module_class(const std::string& class_name) {
  for (const auto& entry : models::component_classes()) {
    if (entry.class_name == class_name && entry.create_module) return &entry;
  }
  return nullptr;
}


int text_encoder_degree(const io::ModelFolder& folder, int tp, at::ScalarType dtype) {
  const Planned planned = plan_folder(folder);
  for (const auto& component : planned.components) {
    if (component.kind == models::ComponentKind::TextEncoder) return planned.degree_of(component, tp, dtype, std::nullopt);
  }
  return tp;
}

void print_memory_plan(const io::ModelFolder& folder, const MemoryPlanRequest& request) {
  Planned planned = plan_folder(folder);
  if (!request.transformer_file.empty()) {
    for (auto& component : planned.components) {
      if (component.kind != models::ComponentKind::Transformer) continue;
      component.stored_weights =
          models::open_transformer_file(request.transformer_file, component.class_name, *component.model);
    }
  }
  const std::vector<TpPlanKind> kinds = {TpPlanKind::Full, TpPlanKind::Reference};
  const std::string dtype = c10::toString(request.dtype);

  // Per component, both plans at the requested degree (resolver errors surface here).
  std::vector<std::vector<models::ComponentMemory>> rows;
  for (const auto& component : planned.components) {
    std::vector<models::ComponentMemory> both;
    const int degree = planned.degree_of(component, request.tp, request.dtype, request.text_encoder_tp);
    for (TpPlanKind kind : kinds) both.push_back(component.memory(degree, kind, request.dtype, request.weights));
    rows.push_back(both);
  }
  const size_t chosen = request.plan == TpPlanKind::Full ? 0 : 1;

  nlohmann::json json = {{"tp_degree", request.tp},
                         {"plan", parallel::tp_plan_kind_name(request.plan)},
                         {"dtype", dtype},
                         {"weights_dtype", nn::weights_dtype_name(request.weights)}};
  if (!request.transformer_file.empty()) json["transformer_file"] = request.transformer_file;
  nlohmann::json components = nlohmann::json::array();
  for (size_t c = 0; c < rows.size(); ++c) {
    const auto& both = rows[c];
    nlohmann::json entry = to_json(both[chosen]);
    entry["counted"] = planned.components[c].counted;
    for (size_t k = 0; k < kinds.size(); ++k) entry["plans"][parallel::tp_plan_kind_name(kinds[k])] = to_json(both[k]);
    components.push_back(entry);
  }
  json["components"] = components;
  json["not_counted"] = nlohmann::json::array();
  for (const auto& [name, why] : planned.not_counted) json["not_counted"].push_back({{"component", name}, {"reason", why}});
  for (size_t k = 0; k < kinds.size(); ++k) {
    int64_t parameters = 0;
    int64_t bytes = 0;
    for (size_t c = 0; c < rows.size(); ++c) {
      if (!planned.components[c].counted) continue;
      parameters += rows[c][k].per_rank_parameters;
      bytes += rows[c][k].per_rank_bytes;
    }
    json["pipeline"][parallel::tp_plan_kind_name(kinds[k])] = {{"per_rank_parameters", parameters}, {"per_rank_bytes", bytes}};
  }

  const Activations step = activations(planned, request.tp, request);
  if (request.step) {
    json["activations"] = {{"height", request.step->height},
                           {"width", request.step->width},
                           {"batch", request.step->batch},
                           {"text_tokens", request.step->text_tokens},
                           {"attention_backend", request.step->attention_backend},
                           {"transformer_step_bytes_per_rank", step.transformer},
                           {"vae_decode_bytes", step.vae_decode}};
  }
  std::vector<std::string> verdict_lines;
  if (request.device_memory_gib) {
    const auto capacity = static_cast<int64_t>(*request.device_memory_gib * kBytesPerGiB);
    nlohmann::json verdicts = nlohmann::json::array();
    for (int tp : verdict_degrees(request.tp)) {
      for (TpPlanKind kind : kinds) {
        nlohmann::json verdict = {{"tp_degree", tp}, {"plan", parallel::tp_plan_kind_name(kind)}};
        try {
          const int64_t needed = per_rank_weights(planned, tp, kind, request) + activations(planned, tp, request).peak();
          verdict["per_rank_bytes"] = needed;
          verdict["fits"] = needed <= capacity;
          verdict["headroom_bytes"] = capacity - needed;
          verdict_lines.push_back(fmt::format("| {} | {} | {} | {} | {} |", tp, parallel::tp_plan_kind_name(kind),
                                              gib(needed), needed <= capacity ? "fits" : "does not fit",
                                              gib(capacity - needed)));
        } catch (const std::exception& e) {
          verdict["fits"] = false;
          verdict["error"] = error_message(e);
          verdict_lines.push_back(fmt::format("| {} | {} | - | cannot shard: {} | - |", tp,
                                              parallel::tp_plan_kind_name(kind), error_message(e)));
        }
        verdicts.push_back(verdict);
      }
    }
    json["device_memory_bytes"] = capacity;
    json["verdicts"] = verdicts;
  }

  if (request.json) {
    fmt::print("{}\n", json.dump(2));
    return;
  }
  fmt::print("memory plan at TP={}, {}{} (plan '{}' chosen; both shown):\n", request.tp, dtype,
             request.weights == nn::WeightsDtype::Checkpoint
                 ? std::string()
                 : fmt::format(", transformer Linears in {} (--weights-dtype)", nn::weights_dtype_name(request.weights)),
             parallel::tp_plan_kind_name(request.plan));
  if (!request.transformer_file.empty()) {
    fmt::print("transformer weights as {} stores them (--transformer)\n", request.transformer_file);
  }
  fmt::print("| component | class | plan | TP | parameters | replicated | sharded | per rank | per rank bytes |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& both : rows) {
    for (const auto& memory : both) {
      fmt::print("| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n", memory.component, memory.class_name, memory.plan,
                 memory.tp_degree, billions(memory.parameters_total), billions(memory.parameters_replicated),
                 billions(memory.parameters_sharded), billions(memory.per_rank_parameters), gib(memory.per_rank_bytes));
    }
  }
  for (const auto& component : planned.components) {
    if (!component.counted) fmt::print("{}: another form of the component above, not added to the totals\n", component.name);
  }
  for (TpPlanKind kind : kinds) {
    const auto& total = json["pipeline"][parallel::tp_plan_kind_name(kind)];
    fmt::print("all components, plan '{}': {} parameters, {} per rank\n", parallel::tp_plan_kind_name(kind),
               billions(total["per_rank_parameters"].get<int64_t>()), gib(total["per_rank_bytes"].get<int64_t>()));
  }
  for (const auto& [name, why] : planned.not_counted) fmt::print("not counted: {} ({})\n", name, why);
  if (request.step) {
    fmt::print("activations per rank at {}x{}, batch {}, {} text tokens, {} attention: transformer step {}, VAE decode {}\n",
               request.step->height, request.step->width, request.step->batch, request.step->text_tokens,
               request.step->attention_backend, gib(step.transformer), gib(step.vae_decode));
  }
  if (request.device_memory_gib) {
    fmt::print("on a {:.1f} GiB device (weights per rank + the larger activation peak):\n", *request.device_memory_gib);
    fmt::print("| TP | plan | needed per rank | verdict | headroom |\n|---|---|---|---|---|\n");
    for (const auto& line : verdict_lines) fmt::print("{}\n", line);
  }
}

}  // namespace shardit::apps
